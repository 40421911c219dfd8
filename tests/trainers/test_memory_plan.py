"""The update's memory plan (jrl.trainers.memory_plan, `train.memory_plan`):
the candidates' order, the choice against a limit measured from the
compiled update, the fields a config sets kept, the choice kept on resume,
and the planned job training as the unplanned one does."""

import json
import os

import jax
import numpy as np
import pytest

from jrl import models, trainers
from jrl.trainers import common, controller, memory_plan
from tests.helpers import QUIET, shrunk_config


def test_candidates_try_no_remat_down_to_an_eighth_then_full_down_to_a_row():
  options = memory_plan.candidates('auto', 0, whole=64 * 100, row=100)
  assert options == [
    ('none', 0),
    ('none', 3200),
    ('none', 1600),
    ('none', 800),
    ('full', 0),
    ('full', 3200),
    ('full', 1600),
    ('full', 800),
    ('full', 400),
    ('full', 200),
    ('full', 100),
  ]
  # A set field is kept: the remat (halving down to one row), or the budget.
  assert memory_plan.candidates('dots', 0, whole=400, row=100) == [
    ('dots', 0),
    ('dots', 200),
    ('dots', 100),
  ]
  assert memory_plan.candidates('auto', 300, whole=400, row=100) == [('none', 300), ('full', 300)]
  assert memory_plan.candidates('full', 300, whole=400, row=100) == [('full', 300)]
  # On the CPU 'auto' recomputes (measured faster there once activations are large).
  assert memory_plan.candidates('auto', 0, whole=400, row=100, platform='cpu') == [
    ('full', 0),
    ('full', 200),
    ('full', 100),
  ]
  assert memory_plan.candidates('none', 0, whole=400, row=100, platform='cpu')[0] == ('none', 0)


def test_choose_takes_the_first_that_fits_else_the_smallest():
  need = {('none', 0): 900, ('none', 200): 500, ('full', 0): 400, ('full', 200): 100}
  options = list(need)
  calls = []

  def measure(remat, budget):
    calls.append((remat, budget))
    return need[remat, budget]

  plan = memory_plan.choose(options, measure, limit=600)
  assert (plan.remat, plan.budget, plan.need, plan.limit) == ('none', 200, 500, 600)
  assert calls == options[:2]  # measuring stops at the choice
  assert 'the fastest that fits' in plan.reason and 'none/whole' in plan.reason
  plan = memory_plan.choose(options, measure, limit=1000)
  assert (plan.remat, plan.budget) == ('none', 0) and 'the fastest candidate' in plan.reason
  plan = memory_plan.choose(options, measure, limit=50)
  assert (plan.remat, plan.budget, plan.need) == ('full', 200, 100)
  assert 'nothing fits' in plan.reason and 'train.memory_limit_gib' in plan.reason
  assert [m[2] for m in plan.measured] == [900, 500, 400, 100]


def test_with_remat_changes_only_the_backward_memory():
  config = models.ModelConfig(
    vocab_size=64, width=32, mlp_width=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16
  )
  graphdef, params = models.create(config, jax.random.PRNGKey(0))
  full = common.with_remat(graphdef, params, 'full')
  assert common.with_remat(graphdef, params, 'none') is graphdef
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 64)

  def loss(graphdef):
    return lambda p: models.logits(graphdef, p, tokens).astype(jax.numpy.float32).mean()

  for a, b in zip(
    jax.tree.leaves(jax.grad(loss(graphdef))(params)),
    jax.tree.leaves(jax.grad(loss(full))(params)),
    strict=True,
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_free_bytes_reads_the_device_or_the_host():
  assert memory_plan.free_bytes(jax.devices()[0]) > 0
  assert memory_plan.size(5 * 2**30 + 2**29) == '5.5 GiB' and memory_plan.size(12) == '12 B'


def _job(tmp_path, name, **fields):
  # One minibatch of 16 rows, 2 per batch shard of the 8 test devices, of up
  # to 48 + 6 tokens (the probe's; the prompts sampled are shorter): the
  # activations outweigh the gradients' accumulator.
  base = {**QUIET, 'rl.minibatch_size': 16, 'task.max_prompt_len': 48}
  config = shrunk_config(tmp_path / name, {**base, **fields})
  return config, trainers.build(config)


def test_a_short_limit_gives_micro_batches_then_remat_as_measured(tmp_path):
  # Nothing fits: every candidate is compiled and measured; on the CPU
  # 'auto' tries remat 'full' only.
  _, job = _job(tmp_path, 'all', **{'train.memory_limit_gib': 1e-9})
  controller.close(job)
  measured = {(r, b): n for r, b, n in job.memory_plan.measured}
  assert 'nothing fits' in job.memory_plan.reason
  assert {r for r, _ in measured} == {'full'}
  whole = measured['full', 0]
  assert measured['full', job.resources.seq_len] < whole  # one row per micro-batch: less memory
  # A limit just under the whole minibatch: the first candidate that the
  # measurements say fits.
  limit = whole - 1
  config, job = _job(tmp_path, 'short', **{'train.memory_limit_gib': limit / 2**30})
  plan = job.memory_plan
  first_fit = next((r, b) for r, b, n in job.memory_plan.measured if n <= plan.limit)
  assert (plan.remat, plan.budget) == first_fit == ('full', job.resources.seq_len)
  assert plan.need <= plan.limit <= limit
  assert plan.budget == 0 or plan.budget < config.rl.minibatch_size * job.resources.seq_len
  steps = job.steps
  rl_step = getattr(steps.rl, 'fn', steps.rl)
  assert isinstance(rl_step, trainers.common.MicroBatchedStep) == (plan.budget > 0)
  state = job.start_rl(job.state) if config.sft.steps else job.state
  state, report = job.iterate(state, config.sft.steps)
  m = report.metrics
  controller.close(job)
  assert np.isfinite(m['actor/loss'])
  assert m['throughput/micro_batches'] >= 1  # the budget is in tokens: real rows are shorter
  # The choice is kept for a restart with the same candidates.
  with open(tmp_path / 'short' / 'memory_plan.json', encoding='utf-8') as f:
    assert json.load(f)['plan']['budget'] == plan.budget
  _, again = _job(tmp_path, 'short', **{'train.memory_limit_gib': 1.0})
  controller.close(again)
  assert (again.memory_plan.remat, again.memory_plan.budget) == (plan.remat, plan.budget)
  assert 'as the run chose at its start' in again.memory_plan.reason


def test_set_fields_are_kept_and_small_models_are_not_compiled(tmp_path):
  _, job = _job(tmp_path, 'small')
  controller.close(job)
  assert (job.memory_plan.remat, job.memory_plan.budget) == ('none', 0)
  assert 'not compiled' in job.memory_plan.reason and job.memory_plan.measured == ()
  _, job = _job(tmp_path, 'full', **{'model.remat': 'full', 'train.memory_limit_gib': 1e-9})
  controller.close(job)
  assert {r for r, _, _ in job.memory_plan.measured} == {'full'}
  _, job = _job(tmp_path, 'off', **{'train.memory_plan': 'off', 'train.memory_limit_gib': 1e-9})
  controller.close(job)
  assert (job.memory_plan.remat, job.memory_plan.budget, job.memory_plan.need) == ('none', 0, 0)
  assert not os.path.exists(tmp_path / 'off' / 'memory_plan.json')


def test_ppo_plans_its_policy_and_critic_update(tmp_path):
  config, job = _job(tmp_path, 'ppo', algorithm='ppo', **{'train.memory_limit_gib': 1e-9})
  controller.close(job)
  assert job.memory_plan.measured and 'nothing fits' in job.memory_plan.reason
  whole = job.memory_plan.measured[0][2]
  _, job = _job(
    tmp_path, 'ppo2', algorithm='ppo', **{'train.memory_limit_gib': (whole - 1) / 2**30}
  )
  state = job.start_rl(job.state) if config.sft.steps else job.state
  state, report = job.iterate(state, config.sft.steps)
  m = report.metrics
  controller.close(job)
  assert (job.memory_plan.remat, job.memory_plan.budget) != ('none', 0)
  assert np.isfinite(m['actor/loss']) and np.isfinite(m['critic/vf_loss'])


@pytest.mark.parametrize(
  'field, value, message',
  [
    ('train.memory_plan', 'maybe', "must be 'auto' or 'off'"),
    ('train.memory_limit_gib', -1.0, 'train.memory_limit_gib'),
    ('model.remat', 'some', "'auto' or one of"),
  ],
)
def test_bad_fields_are_named(tmp_path, field, value, message):
  config = shrunk_config(tmp_path, {**QUIET, field: value})
  with pytest.raises(ValueError, match=message):
    trainers.build(config)


class _Device:
  def __init__(self, platform, limit):
    self.platform, self.limit = platform, limit

  def memory_stats(self):
    return {'bytes_limit': self.limit, 'bytes_in_use': 0}


def test_the_plan_by_platform_with_measured_candidates():
  from types import SimpleNamespace as NS

  train = NS(memory_plan='auto', memory_limit_gib=0.0, micro_batch_tokens=0)
  gib = 2**30
  # Stored activations cost 4x what recomputed ones do; a micro-batch of
  # half the rows half as much.
  need = lambda remat, budget: (4 if remat == 'none' else 1) * (budget or 800) * gib // 100
  calls = []

  def measure(remat, budget):
    calls.append((remat, budget))
    return need(remat, budget)

  limit = int(20 * gib / memory_plan.FREE_SHARE)  # 90% of it: 20 GiB
  # An accelerator: no remat while a micro-batch of an eighth or more fits.
  got = memory_plan.plan(train, 'auto', _Device('gpu', limit), 800, 100, measure, bound=30 * gib)
  assert (got.remat, got.budget) == ('none', 400) and calls == [('none', 0), ('none', 400)]
  # The CPU: remat 'full' first, so the whole minibatch.
  calls.clear()
  got = memory_plan.plan(train, 'auto', _Device('cpu', limit), 800, 100, measure, bound=30 * gib)
  assert (got.remat, got.budget) == ('full', 0) and calls == [('full', 0)]
  # A small update is not compiled and runs without remat: on the CPU only
  # under CPU_SMALL_BYTES.
  calls.clear()
  for platform in ('gpu', 'cpu'):
    got = memory_plan.plan(train, 'auto', _Device(platform, limit), 800, 100, measure, bound=gib)
    assert (got.remat, got.budget, got.need) == ('none', 0, 0) and 'not compiled' in got.reason
  got = memory_plan.plan(train, 'auto', _Device('cpu', limit), 800, 100, measure, bound=4 * gib)
  assert (got.remat, got.budget) == ('full', 0) and calls == [('full', 0)]


def test_a_restart_keeps_the_plan_of_the_same_step_and_plans_a_changed_one_again(tmp_path):
  """The saved choice is keyed by the candidates and by the step they were
  measured for: with a set `train.micro_batch_tokens` the candidates do not
  depend on the minibatch, so a restart with longer prompts (more tokens per
  row) must measure again instead of keeping a plan made for shorter rows."""
  config = shrunk_config(tmp_path, {'train.micro_batch_tokens': 64, 'train.memory_limit_gib': 1e-9})
  path = str(tmp_path / 'memory_plan.json')
  device = jax.devices()[0]
  sections = (config.train, config.model.remat)
  calls = []

  def measure(remat, budget):
    calls.append((remat, budget))
    return 10**12  # nothing fits: the first candidate is kept, after measuring them all

  first = memory_plan.plan(*sections, device, 256, 32, measure, 10**9, path)
  assert calls and 'nothing fits' in first.reason
  calls.clear()
  again = memory_plan.plan(*sections, device, 256, 32, measure, 10**9, path)
  assert not calls and 'as the run chose at its start' in again.reason
  longer = memory_plan.plan(*sections, device, 512, 64, measure, 2 * 10**9, path)
  assert calls and 'as the run chose' not in longer.reason
  with open(path, encoding='utf-8') as f:
    assert json.load(f)['step'] == {'whole': 512, 'row': 64, 'bound': 2 * 10**9}
  # A file from before the step was recorded: matched on its candidates alone.
  with open(path, encoding='utf-8') as f:
    saved = json.load(f)
  del saved['step']
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(saved, f)
  calls.clear()
  kept = memory_plan.plan(*sections, device, 128, 16, measure, 10**8, path)
  assert not calls and 'as the run chose at its start' in kept.reason
