"""The trainers' structure: the registry picks one run per algorithm, and the
offline algorithms (SFT, DPO, reward model) build no sampler, no reward
workers and no topology. A new algorithm of its own: test_new_algorithm.py.
"""

import pytest

from configs import common as config_common
from configs import dpo_arith, sft_arith
from jrl import rewards, sampler, trainers
from jrl.rewards import server
from jrl.trainers import agent, checks, controller, dpo, grpo, ppo, reward_model, sft
from jrl.trainers.rollouts import rollout, topology
from tests.helpers import QUIET, records, set_fields, shrunk_config


def test_registry_holds_one_record_per_algorithm():
  # Each module's record, and the job it builds (the agent picks GRPO's or PPO's).
  modules = {
    'grpo': (grpo, grpo.GRPO),
    'ppo': (ppo, ppo.PPO),
    'dpo': (dpo, dpo.DPO),
    'sft': (sft, sft.SFT),
    'reward_model': (reward_model, reward_model.RewardModel),
    'agent': (agent, agent.build),
  }
  assert set(trainers.ALGORITHMS) == set(modules)
  for name, (module, build) in modules.items():
    record = trainers.ALGORITHMS[name]
    assert record is module.ALGORITHM and record.name == name and record.build is build
    if isinstance(build, type):
      assert issubclass(build, controller.Job)
  assert {n for n, a in trainers.ALGORITHMS.items() if a.online} == {'grpo', 'ppo', 'agent'}
  steps = {n: a.steps_section for n, a in trainers.ALGORITHMS.items()}
  assert steps == {
    'grpo': 'rl',
    'ppo': 'rl',
    'agent': 'rl',
    'dpo': 'dpo',
    'reward_model': 'rm',
    'sft': None,
  }


def test_unknown_algorithm_names_the_field(tmp_path):
  config = shrunk_config(tmp_path, {'algorithm': 'dqn'})
  with pytest.raises(ValueError, match='`algorithm`'):
    trainers.run(config)
  with pytest.raises(ValueError, match="unknown algorithm 'dqn'"):
    config_common.base('dqn')


def offline_config(algorithm, workdir):
  fields = {**QUIET, 'workdir': str(workdir), 'checkpoint.every': 100}
  if algorithm == 'sft':
    return set_fields(sft_arith.get_config('smoke'), {**fields, 'sft.steps': 2})
  if algorithm == 'dpo':
    fields.update({'dpo.steps': 2, 'dpo.pairs_per_step': 4})
    return set_fields(dpo_arith.get_config('smoke'), fields)
  fields.update({'algorithm': 'reward_model', 'rm.steps': 2, 'rm.pairs_per_step': 4})
  return shrunk_config(workdir, fields)


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
  assert job.topology is None
  state = controller.train(job)
  own = {'dpo': config.get('dpo'), 'reward_model': config.get('rm')}.get(algorithm)
  warmup = config.sft.steps if 'sft' in config else 0
  total = warmup + (own.steps if own else 0)
  assert total == checks.iterations(config)
  assert [r['step'] for r in records(tmp_path)] == list(range(1, total + 1))
  assert int(state.step) == (own.steps if own else warmup)  # updates of the last phase
  # The offline configs carry no rollout sections.
  assert 'rl' not in config and 'reward' not in config and 'topology' not in config
