"""The trainers' structure: the registry picks one run per algorithm, and the
offline algorithms (SFT, DPO, reward model) build no sampler, no reward
workers and no topology.
"""

import pytest

from configs import common as config_common
from configs import dpo_arith, sft_arith
from jrl import rewards, sampler, trainers
from jrl.rewards import server
from jrl.trainers import agent, controller, dpo, grpo, ppo, reward_model, rollout, sft, topology
from tests.helpers import QUIET, SHRINK, records, set_fields, shrunk_config


def test_registry_maps_every_algorithm_to_its_run():
  assert trainers.ALGORITHMS == {
    'grpo': grpo.run,
    'ppo': ppo.run,
    'dpo': dpo.run,
    'sft': sft.run,
    'reward_model': reward_model.run,
    'agent': agent.run,
  }
  assert set(trainers.BUILDERS) == set(trainers.ALGORITHMS)


def test_unknown_algorithm_names_the_field(tmp_path):
  config = shrunk_config(tmp_path, {'algorithm': 'dqn'})
  with pytest.raises(ValueError, match='`algorithm`'):
    trainers.run(config)


def offline_config(algorithm, workdir):
  fields = {**SHRINK, **QUIET, 'workdir': str(workdir), 'checkpoint.every': 100}
  if algorithm == 'sft':
    return set_fields(sft_arith.get_config(), {**fields, 'sft.steps': 2, 'rl.steps': 0})
  if algorithm == 'dpo':
    return set_fields(dpo_arith.get_config(), {**fields, 'rl.steps': 2, 'dpo.pairs_per_step': 4})
  config = shrunk_config(workdir, {**QUIET, 'algorithm': 'reward_model', 'sft.steps': 0})
  set_fields(config, {'rl.steps': 2, 'checkpoint.every': 100})
  config.unlock()
  config.rm = config_common.rm_section()
  config.rm.pairs_per_step = 4
  config.lock()
  return config


@pytest.mark.parametrize('algorithm', ['sft', 'dpo', 'reward_model'])
def test_offline_algorithms_build_no_sampler_reward_workers_or_topology(
  algorithm, tmp_path, monkeypatch
):
  def refuse(name):
    def build(*args, **kwargs):
      raise AssertionError(f'{algorithm} built {name}')

    return build

  monkeypatch.setattr(sampler.Sampler, '__init__', refuse('a sampler'))
  monkeypatch.setattr(rewards.RewardService, '__init__', refuse('a reward service'))
  monkeypatch.setattr(server.RemoteRewardService, '__init__', refuse('a remote reward service'))
  monkeypatch.setattr(rollout.RolloutWorker, '__init__', refuse('a rollout worker'))
  monkeypatch.setattr(topology, 'make', refuse('a topology'))
  config = offline_config(algorithm, tmp_path)
  job = trainers.build(config)
  assert job.topology is None and job.shaper is None
  state = controller.train(job)
  total = config.sft.steps + config.rl.steps
  assert [r['step'] for r in records(tmp_path)] == list(range(1, total + 1))
  assert int(state.step) == (config.rl.steps or config.sft.steps)  # updates of the last phase
