"""Rollout topologies (`config.topology`): colocated, disaggregated, one-step-off
(async with k > 1: test_async.py).

All runs are the shrunken default job of tests/helpers.py (8 fake CPU devices,
in process), with the overlong penalty so that rewards vary with length and
RL updates are not zero.
"""

import itertools
import os
import signal

import jax
import numpy as np
import pytest

from configs import common as config_common
from jrl import checkpoint as ckpt_lib
from jrl import trainers
from jrl.metrics import read_jsonl
from jrl.trainers import controller
from jrl.trainers.rollouts import topology
from tests.helpers import QUIET, assert_trees_equal, shrunk_config
from tests.trainers.test_agent import agent_config

BASE = {**QUIET, 'rl.overlong_buffer': 4, 'rl.steps': 4, 'reward.mode': 'inline'}
ONE_STEP_OFF = {'topology.kind': 'one_step_off', 'topology.staleness': 1}
# Partial rollouts, with several dispatches per rollout so that versions move.
ASYNC_PARTIAL = {
  'topology.kind': 'async',
  'topology.partial_rollouts': True,
  'topology.swap_every': 1,
  'sampler.steps_per_dispatch': 2,
}
STAMP_KEYS = ('time/', 'throughput/', 'rollout/')


def run(workdir, overrides=None):
  state = trainers.run(shrunk_config(workdir, {**BASE, **(overrides or {})}))
  return jax.tree.map(np.asarray, state.params), read_jsonl(f'{workdir}/metrics.jsonl')


def history(records):
  """Metrics without timings and topology-specific entries, by step."""
  return {r['step']: {k: v for k, v in r.items() if not k.startswith(STAMP_KEYS)} for r in records}


@pytest.fixture(scope='module')
def colocated(tmp_path_factory):
  return run(str(tmp_path_factory.mktemp('colocated')))


@pytest.fixture(scope='module')
def one_step_off(tmp_path_factory):
  return run(str(tmp_path_factory.mktemp('one_step_off')), ONE_STEP_OFF)


def test_async_path_with_staleness_0_equals_the_synchronous_run(colocated, tmp_path):
  params, records = run(str(tmp_path), {**ONE_STEP_OFF, 'topology.staleness': 0})
  assert_trees_equal(params, colocated[0])
  assert history(records) == history(colocated[1])
  assert all(r.get('rollout/staleness', 0) == 0 for r in records)


def test_one_step_off_trains_on_rollouts_one_version_old(colocated, one_step_off):
  _, records = one_step_off
  rl = [r for r in records if r.get('phase') == 1.0]
  assert [r['rollout/staleness'] for r in rl] == [0.0, 1.0, 1.0, 1.0]
  # Stale rollouts are clipped against the current policy and importance weighted.
  for r in rl[1:]:
    assert 'rollout/is_weight_mean' in r and 'rollout/behaviour_logp_diff_abs' in r
  assert 'rollout/is_weight_mean' not in rl[0]
  # The first RL step is on-policy, so it matches the synchronous run; later ones do not.
  sync = {r['step']: r for r in colocated[1]}
  first = rl[0]['step']
  assert rl[0]['actor/pg_loss'] == sync[first]['actor/pg_loss']
  # After an update that moved the policy, the next step trains on the rollout
  # of the version before it: its behaviour logprobs differ from the policy's
  # (by far more than the float noise of an unchanged policy). Whether the
  # final parameters differ from the synchronous run's depends on the rewards
  # drawn (groups with one reward give no gradient), so it is not asserted.
  assert any(r['actor/grad_norm'] > 0 for r in rl[:-1])
  for before, after in itertools.pairwise(rl):
    if before['actor/grad_norm'] > 0:
      assert after['rollout/behaviour_logp_diff_abs'] > 1e-5, (before, after)


@pytest.mark.parametrize(
  'topology_fields, staleness',
  [
    (ONE_STEP_OFF, [0.0, 1.0, 1.0]),
    ({'topology.kind': 'async', 'topology.max_staleness': 2}, [0.0, 1.0, 2.0]),
    ({**ASYNC_PARTIAL, 'topology.max_staleness': 2}, [0.0, 1.0, 2.0]),
  ],
  ids=['one_step_off', 'async_k2', 'async_k2_partial'],
)
@pytest.mark.parametrize('algorithm', ['ppo', 'agent'])
def test_ppo_and_the_agent_train_on_stale_rollouts(tmp_path, algorithm, topology_fields, staleness):
  """The proximal pass and its importance weights belong to the online step,
  not to GRPO: PPO (policy and critic) and the agent's episodes train on
  rollouts one version old (one-step-off) or up to two (async, k = 2),
  corrected against the current policy."""
  fields = {**topology_fields, 'rl.steps': 3}
  if algorithm == 'ppo':
    trainers.run(shrunk_config(str(tmp_path), {**BASE, **fields, 'algorithm': 'ppo'}))
  else:
    # The agent trains with PPO here: its untrained policy's rewards are all 0,
    # which gives GRPO no gradient; the critic's GAE advantages move the policy.
    config = agent_config(tmp_path, {**QUIET, **fields, 'sft.steps': 1})
    config.unlock()
    config.ppo = config_common.ppo_section()
    config.agent.trainer = 'ppo'
    config.lock()
    trainers.run(config)
  rl = [r for r in read_jsonl(f'{tmp_path}/metrics.jsonl') if r.get('phase') == 1.0]
  assert [r['rollout/staleness'] for r in rl] == staleness
  assert 'rollout/is_weight_mean' not in rl[0]
  for r in rl[1:]:
    assert 'rollout/is_weight_mean' in r and r['actor/nonfinite'] == 0.0
  # A step after an update that moved the policy trains on the older version's
  # samples: their behaviour logprobs differ from the current policy's.
  assert any(r['actor/grad_norm'] > 0 for r in rl[:-1])
  for before, after in itertools.pairwise(rl):
    if before['actor/grad_norm'] > 0:
      assert after['rollout/behaviour_logp_diff_abs'] > 1e-5, (before, after)
  assert all(r['critic/nonfinite'] == 0.0 and r['critic/grad_norm'] > 0 for r in rl)
  if topology_fields.get('topology.partial_rollouts'):  # tokens fresher than the rollout
    assert any(r['rollout/token_staleness_mean'] < r['rollout/staleness'] for r in rl)


def preempt_and_resume(monkeypatch, workdir, fields, rl_iteration):
  """Runs `fields`, SIGTERMed during RL iteration `rl_iteration` (0-based):
  the controller saves and stops after it; then restarts the run to the end.
  Returns (the step it stopped at, the rollouts in flight then as
  `StepsOff.in_flight`, the final parameters, the metrics records)."""
  config = shrunk_config(workdir, {**BASE, **fields})
  original = topology.StepsOff.next_rollout
  in_flight = []

  def preempt(self, params, iteration):
    generated = original(self, params, iteration)
    if iteration == config.sft.steps + rl_iteration:
      in_flight.append(self.in_flight())
      os.kill(os.getpid(), signal.SIGTERM)  # the controller's handler: stop after this one
    return generated

  monkeypatch.setattr(topology.StepsOff, 'next_rollout', preempt)
  trainers.run(config)
  stopped_at = config.sft.steps + rl_iteration + 1
  total = config.sft.steps + config.rl.steps
  assert read_jsonl(f'{workdir}/metrics.jsonl')[-1]['step'] == stopped_at < total  # preempted
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'))
  assert checkpointer.latest_step() == stopped_at
  checkpointer.close()
  monkeypatch.setattr(topology.StepsOff, 'next_rollout', original)
  params, records = run(workdir, fields)
  return stopped_at, in_flight[0], params, records


def test_one_step_off_resumes_exactly_with_a_rollout_in_flight(one_step_off, tmp_path, monkeypatch):
  """Preempted after RL iteration 1 (the rollout for iteration 2 is in flight),
  then restarted: the run ends as the uninterrupted one does."""
  stopped_at, _, params, records = preempt_and_resume(monkeypatch, str(tmp_path), ONE_STEP_OFF, 0)
  assert_trees_equal(params, one_step_off[0])
  assert history(records) == history(one_step_off[1])
  resumed = [r for r in records if r['step'] == stopped_at + 1]
  assert resumed[-1]['rollout/staleness'] == 1.0


def test_async_with_max_staleness_1_is_one_step_off(one_step_off, tmp_path):
  params, records = run(str(tmp_path), {'topology.kind': 'async', 'topology.max_staleness': 1})
  assert_trees_equal(params, one_step_off[0])
  assert history(records) == history(one_step_off[1])


def test_one_step_off_on_separate_rollout_devices(one_step_off, tmp_path):
  """Disaggregated and asynchronous: same samples as one-step-off colocated."""
  params, records = run(str(tmp_path), {**ONE_STEP_OFF, 'topology.rollout_devices': 4})
  sync = {r['step']: r for r in one_step_off[1]}
  assert [r.get('rollout/staleness') for r in records[-4:]] == [0.0, 1.0, 1.0, 1.0]
  for r in records:
    if 'reward/mean' in r:
      assert r['reward/mean'] == sync[r['step']]['reward/mean'], r['step']
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_step_off[0]), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_disaggregated_samples_on_its_own_devices(colocated, tmp_path):
  config = shrunk_config(
    str(tmp_path), {**BASE, 'topology.kind': 'disaggregated', 'topology.rollout_devices': 4}
  )
  job = trainers.build(config)
  assert isinstance(job.topology, topology.Disaggregated)
  train_devices = set(job.resources.mesh.devices.flat)
  rollout_devices = set(job.topology.worker.engine.mesh.devices.flat)
  assert len(train_devices) == len(rollout_devices) == 4
  assert not train_devices & rollout_devices
  placed = job.topology.rollout_params(job.state.params)
  assert all(set(x.sharding.device_set) == rollout_devices for x in jax.tree.leaves(placed))
  state = controller.train(job)
  records = read_jsonl(f'{tmp_path}/metrics.jsonl')
  assert all('time/reshard' in r for r in records if r.get('phase') == 1.0)
  # Same sampled tokens and rewards as colocated; parameters equal up to the
  # summation order of a 4-device instead of an 8-device mesh.
  sync = {r['step']: r for r in colocated[1]}
  for r in records:
    for key in ('reward/mean', 'response_length/mean'):
      if key in r:
        assert r[key] == sync[r['step']][key], (r['step'], key)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(colocated[0]), strict=True):
    np.testing.assert_allclose(np.asarray(a), b, atol=1e-6)


@pytest.mark.parametrize(
  'overrides, field',
  [
    ({'topology.kind': 'ring'}, 'topology.kind'),
    ({'topology.kind': 'disaggregated'}, 'topology.rollout_devices'),
    ({'topology.kind': 'disaggregated', 'topology.rollout_devices': 8}, 'topology.rollout_devices'),
    ({'topology.rollout_devices': 2}, 'topology.rollout_devices'),
    ({'topology.kind': 'one_step_off', 'topology.staleness': 2}, 'topology.staleness'),
    ({'topology.kind': 'async', 'topology.max_staleness': -1}, 'topology.max_staleness'),
    ({'topology.kind': 'one_step_off', 'topology.is_cap': 0.5}, 'topology.is_cap'),
  ],
)
def test_bad_topology_names_the_field(tmp_path, overrides, field):
  config = shrunk_config(str(tmp_path), overrides)
  with pytest.raises(ValueError, match=f'`{field}`'):
    trainers.validate(config, batch_shards=1)
