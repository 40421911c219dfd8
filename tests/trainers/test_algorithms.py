"""End-to-end tests of every trainer a config can select: the GRPO family
(GRPO, Dr.GRPO, DAPO, GSPO, CISPO, RLOO, LOO, REINFORCE++ and its baseline
variant), PPO with a critic, the DPO family (DPO, IPO, hinge, SimPO, ORPO),
SFT only, GRPO on a Hugging Face checkpoint (`configs/grpo_qwen.py`), and
`launch/eval.py`.

Every run shrinks a real config file (STYLE.md point 15) to a 1-layer
width-32 model, 4 prompts x 4 samples per RL step in minibatches of 8 rows
(one per fake CPU device), and runs it in process with `trainers.run`. A random
model scores 0 on the task's exact-match reward, which would make every
advantage and gradient zero; the GRPO-family and PPO runs therefore use a
registered test reward, the share of digits in the completion, which is
spread out at initialisation and easy to learn. Learning is shown on
deliberately easy set-ups (that reward; DPO on 16 fixed pairs), because the
real tasks take minutes to improve.

Most runs differ from another only in a few config values, so the module
shares a persistent JAX compilation cache: a program compiled by one run is
loaded, not compiled again, by the next.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from configs import common as config_common
from configs import dpo_arith, grpo_arith, grpo_qwen, ppo_arith, sft_arith
from jrl import checkpoint as ckpt_lib
from jrl import models, rewards, trainers
from jrl.data import ArithmeticTask
from jrl.data.tasks import corrupt_answer
from jrl.metrics import read_jsonl
from jrl.models import hf as hf_lib
from jrl.trainers import controller, dpo
from tests import helpers
from tests.helpers import REPO, capture

# The shrunken job of tests/helpers.py, quiet (no evaluation, TensorBoard or
# plot unless a test asks) and with the config's own checkpoint interval.
SHRINK = {
  k: v for k, v in {**config_common.SMOKE, **helpers.QUIET}.items() if k != 'checkpoint.every'
}

DIGITS = 'test_algorithms_digit_share'

# Metrics every GRPO-family RL record has.
RL_METRICS = (
  'reward/mean',
  'reward/std',
  f'reward/{DIGITS}/mean',
  'advantages/mean',
  'advantages/std',
  'actor/loss',
  'actor/pg_loss',
  'actor/clipfrac',
  'actor/kl_ref',
  'actor/entropy',
  'actor/grad_norm',
  'actor/lr',
  'actor/nonfinite',
  'response_length/mean',
  'groups/zero_variance_frac',
  'groups/drawn',
  'samples/generated',
  'samples/trained',
  'samples/dropped',
  'time/generate',
  'time/reference',
  'time/update',
  'time/step',
)


def digit_share(prompts, completions, metadata):
  """Share of a completion's characters that are digits (0 for an empty one)."""
  del prompts, metadata
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture(scope='module', autouse=True)
def test_reward():
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(rewards.REGISTRY, DIGITS, digit_share)  # removed after the module
    yield


@pytest.fixture(scope='module', autouse=True)
def compilation_cache_dir(tmp_path_factory):
  """A persistent compilation cache for this module's runs (and subprocesses)."""
  path = str(tmp_path_factory.mktemp('jax_cache'))
  names = {
    'jax_compilation_cache_dir': path,
    'jax_persistent_cache_min_compile_time_secs': 0.0,
  }
  saved = {name: getattr(jax.config, name) for name in names}
  compilation_cache.reset_cache()
  for name, value in names.items():
    jax.config.update(name, value)
  yield path
  for name, value in saved.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


def shrink_fields(config):
  """SHRINK's fields of the sections `config` has (an offline config has no `rl`)."""
  return {k: v for k, v in SHRINK.items() if '.' not in k or k.split('.')[0] in config}


def shrink(config_module, workdir, overrides=None):
  """`config_module.get_config()` (locked) with SHRINK and `overrides` ({'a.b': v}) set."""
  config = config_module.get_config()
  values = {**shrink_fields(config), 'workdir': str(workdir), **(overrides or {})}
  # Score in the trainer's thread where the reward service offers the choice:
  # the test reward lives in this module, and worker processes cost seconds.
  if 'reward' in config and 'reward.mode' not in values:
    values['reward.mode'] = 'inline'
  for key, value in values.items():
    *parents, name = key.split('.')
    node = config
    for parent in parents:
      node = node[parent]
    node[name] = value
  return config


def records(workdir):
  return read_jsonl(os.path.join(str(workdir), 'metrics.jsonl'))


def rl_records(workdir):
  return [r for r in records(workdir) if r['phase'] == 1.0]


def assert_finite(recs):
  """The writer logs a non-finite value as null."""
  for r in recs:
    bad = sorted(k for k, v in r.items() if v is None)
    assert not bad, f'step {r["step"]}: non-finite {bad}'


def assert_trees_equal(a, b):
  """Same structure, and every leaf bitwise equal (dtype, shape and bytes)."""
  a, b = jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
    name = jax.tree_util.keystr(path)
    assert (x.dtype, x.shape) == (y.dtype, y.shape), name
    assert x.tobytes() == y.tobytes(), f'{name} differs: max |diff| {np.max(np.abs(x - y))}'


def trees_differ(a, b):
  return any(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.any(x != y)), a, b)))


def restore_latest(workdir, state):
  """(state, meta) of the latest checkpoint of `workdir`, laid out like `state`."""
  checkpointer = ckpt_lib.Checkpointer(os.path.join(str(workdir), 'checkpoints'))
  step = checkpointer.latest_step()
  restored = checkpointer.restore(step, ckpt_lib.abstract_like(state))
  checkpointer.close()
  return restored


def restore_step(workdir, step, state):
  checkpointer = ckpt_lib.Checkpointer(os.path.join(str(workdir), 'checkpoints'))
  restored = checkpointer.restore(step, ckpt_lib.abstract_like(state))
  checkpointer.close()
  return restored


def without_timings(recs):
  return [{k: v for k, v in r.items() if not k.startswith(('time/', 'throughput/'))} for r in recs]


def write_jsonl(path, rows):
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  return str(path)


# 1. The GRPO family ----------------------------------------------------------------

VARIANTS = {
  'grpo': {},
  'dr_grpo': {'rl.advantage': 'dr_grpo', 'rl.reduction.mode': 'seq-mean-token-sum-norm'},
  'dapo': {
    'rl.loss.ppo.eps_high': 0.28,
    'rl.reduction.mode': 'token-mean',
    'rl.overlong_buffer': 2,
    'rl.dynamic_sampling': True,
  },
  'gspo': {
    'rl.policy_loss': 'gspo',
    'rl.loss.gspo.eps_low': 3e-4,
    'rl.loss.gspo.eps_high': 4e-4,
    'rl.reduction.mode': 'seq-mean-token-mean',
    # Updates large enough for sequence ratios to leave [1 - 3e-4, 1 + 4e-4].
    'optim.lr': 1e-3,
    'optim.warmup_steps': 0,
  },
  'cispo': {'rl.policy_loss': 'cispo'},
  'rloo': {'rl.advantage': 'rloo'},
  'loo': {'rl.advantage': 'loo'},
  'reinforce_pp': {
    'rl.advantage': 'reinforce_pp',
    'rl.kl_coef': 0.01,
    'rl.kl_in': 'reward',
    'rl.kl.estimator': 'k1',
  },
  'reinforce_pp_baseline': {
    'rl.advantage': 'reinforce_pp_baseline',
    'rl.kl_coef': 0.01,
    'rl.kl_in': 'reward',
    'rl.kl.estimator': 'k1',
  },
}


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_grpo_family_variant_runs_with_finite_metrics(tmp_path, variant):
  overrides = VARIANTS[variant]
  config = shrink(grpo_arith, tmp_path, {'reward.functions': (DIGITS,), **overrides})
  state = trainers.run(config)
  rl, b = config.rl, config.rl.prompts_per_step

  recs = records(tmp_path)
  assert [r['step'] for r in recs] == list(range(1, config.sft.steps + rl.steps + 1))
  assert_finite(recs)
  rl_recs = rl_records(tmp_path)
  assert len(rl_recs) == rl.steps
  for r in rl_recs:
    missing = [k for k in RL_METRICS if k not in r]
    assert not missing, f'step {r["step"]}: missing {missing}'
    assert r['actor/nonfinite'] == 0.0
    assert 0.0 <= r[f'reward/{DIGITS}/mean'] <= 1.0
  # The rewards are spread out, so the update is not a no-op.
  assert max(r['advantages/std'] for r in rl_recs) > 0
  assert max(r['actor/grad_norm'] for r in rl_recs) > 0
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.params))
  assert int(state.step) == rl.steps * b * rl.group_size // rl.minibatch_size

  assert (state.extra.ref_params is not None) == (rl.kl_coef > 0)
  if variant == 'dr_grpo':
    # r - mean(group), unscaled: |A| <= 1 for rewards in [0, 1].
    assert all(max(r['advantages/max'], -r['advantages/min']) <= 1.0 + 1e-6 for r in rl_recs)
  if variant == 'dapo':
    for r in rl_recs:
      assert r['groups/drawn'] % b == 0 and b <= r['groups/drawn'] <= b * (
        1 + rl.dynamic_sampling_max_draws
      )
      assert r['groups/dynamic_sampling_short'] in (0.0, 1.0)
      # Every sample generated is either trained on or dropped, and counted.
      g = rl.group_size
      assert r['samples/generated'] == r['groups/drawn'] * g
      assert r['samples/trained'] == b * g
      assert r['samples/dropped'] == r['samples/generated'] - r['samples/trained']
    # The overlong penalty (1 at max_new_tokens) outweighs a share in [0, 1].
    assert min(r['reward/mean'] for r in rl_recs) < 0
  if variant == 'gspo':
    # The second minibatch of a step sees the policy after one update.
    assert max(r['actor/clipfrac'] for r in rl_recs) > 0
    assert all('actor/seq_ratio_mean' in r for r in rl_recs)
  if variant.startswith('reinforce_pp'):
    # KL in the reward, not in the loss; per-token returns whitened over the batch.
    assert all(r['actor/kl_ref'] == 0.0 for r in rl_recs)
    for r in rl_recs:
      assert abs(r['advantages/mean']) < 1e-4, r['advantages/mean']
      assert r['advantages/std'] == pytest.approx(1.0, abs=0.05)


# 2. PPO ----------------------------------------------------------------------------

PPO = {'reward.functions': (DIGITS,), 'log.every': 1}


@pytest.fixture(scope='module')
def ppo_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('ppo')
  config = shrink(ppo_arith, workdir, PPO)
  state = trainers.run(config)
  return config, workdir, state


def test_ppo_logs_critic_and_kl_metrics(ppo_run):
  config, workdir, state = ppo_run
  rl, ppo = config.rl, config.ppo
  recs = records(workdir)
  assert_finite(recs)
  rl_recs = rl_records(workdir)
  assert len(rl_recs) == rl.steps
  for r in rl_recs:
    for k in (
      'critic/vf_loss',
      'critic/vf_clipfrac',
      'critic/grad_norm',
      'critic/values_mean',
      'critic/returns_mean',
      'rollout/kl',
      'actor/kl_coef',
      'actor/pg_loss',
    ):
      assert k in r, f'step {r["step"]}: missing {k}'
    assert r['critic/vf_loss'] >= 0 and 0 <= r['critic/vf_clipfrac'] <= 1
    assert r['critic/grad_norm'] > 0 and r['actor/grad_norm'] > 0
    assert r['critic/nonfinite'] == 0.0 and r['actor/nonfinite'] == 0.0
  # The first rollout is sampled from the reference itself; later ones are not.
  assert rl_recs[0]['rollout/kl'] == pytest.approx(0.0, abs=1e-5)
  assert max(r['rollout/kl'] for r in rl_recs[1:]) > 0

  # Adaptive KL: β starts at rl.kl_coef and follows the controller every step.
  coefs = [r['actor/kl_coef'] for r in rl_recs] + [float(state.extra.kl_ctl.coef)]
  assert coefs[0] == pytest.approx(rl.kl_coef, rel=1e-6)
  assert len(set(coefs)) == len(coefs), coefs
  n = rl.prompts_per_step * rl.group_size
  for r, before, after in zip(rl_recs, coefs[:-1], coefs[1:], strict=True):
    error = np.clip(r['rollout/kl'] / ppo.kl_target - 1.0, -0.2, 0.2)
    assert after == pytest.approx(before * (1 + error * n / ppo.kl_horizon), rel=1e-6)


def test_ppo_checkpoint_holds_the_critic(ppo_run):
  config, workdir, state = ppo_run
  rl = config.rl
  saved, meta = restore_latest(workdir, state)
  assert meta['iteration'] == config.sft.steps + rl.steps
  assert saved.extra.present() == ('ref_params', 'critic', 'kl_ctl')
  assert_trees_equal(saved, state)
  critic = saved.extra.critic
  assert 'score' in critic.params and 'score' not in saved.params
  # One critic update per policy update: epochs x minibatches per iteration.
  updates = rl.steps * rl.epochs * rl.prompts_per_step * rl.group_size // rl.minibatch_size
  assert int(critic.step) == int(saved.step) == updates
  # The critic's backbone started as the warmed-up policy's (the reference) and trained.
  assert trees_differ(critic.params['embed'], saved.extra.ref_params['embed'])


def test_ppo_resumes_to_the_same_result(ppo_run, tmp_path, capsys):
  """2 RL iterations, then the same config with rl.steps = 3 in the same
  workdir: it resumes from the checkpoint, runs only the missing iteration and
  ends where the uninterrupted 3-iteration run ended."""
  config, straight_dir, straight = ppo_run
  sft_steps, steps = config.sft.steps, config.rl.steps
  trainers.run(shrink(ppo_arith, tmp_path, {**PPO, 'rl.steps': steps - 1}))
  capsys.readouterr()
  resumed = trainers.run(shrink(ppo_arith, tmp_path, PPO))
  out = capsys.readouterr().out
  ckdir = os.path.join(str(tmp_path), 'checkpoints')
  done = sft_steps + steps - 1
  assert f'resumed from {ckdir}/{done} (iteration {done})' in out
  total = sft_steps + steps
  assert [int(s) for s in re.findall(rf'\] (\d+)/{total} ', out)] == [total]
  assert_trees_equal(resumed, straight)  # policy, critic, optimisers, KL controller, reference
  assert without_timings(records(tmp_path)) == without_timings(records(straight_dir))


def test_ppo_with_kl_in_the_loss(tmp_path):
  config = shrink(
    ppo_arith, tmp_path, {**PPO, 'rl.kl_in': 'loss', 'rl.kl.estimator': 'k3', 'rl.steps': 2}
  )
  state = trainers.run(config)
  recs = records(tmp_path)
  assert_finite(recs)
  rl_recs = rl_records(tmp_path)
  assert len(rl_recs) == config.rl.steps
  assert all('rollout/kl' in r and 'critic/vf_loss' in r for r in rl_recs)
  # The KL to the reference is in the policy loss: zero before the first update only.
  assert max(r['actor/kl_ref'] for r in rl_recs) > 0
  assert state.extra.ref_params is not None and state.extra.critic is not None


# 3. Learning on easy set-ups -------------------------------------------------------------


def arith_pairs(n):
  """`n` preference pairs of the arithmetic task: the correct answer over one off by 1-10."""
  task = ArithmeticTask(digits=2, ops='+', seed=0)
  rng = np.random.default_rng(0)
  pairs = []
  for i in range(n):
    ex = task.example(i)
    pairs.append(
      {
        'prompt': ex['prompt'],
        'chosen': ex['answer'],
        'rejected': corrupt_answer(ex['answer'], rng),
      }
    )
  return pairs


@pytest.fixture(scope='module')
def pairs_path(tmp_path_factory):
  return write_jsonl(tmp_path_factory.mktemp('pairs') / 'pairs.jsonl', arith_pairs(16))


def test_dpo_learns_the_preferences_of_a_small_pair_set(tmp_path, pairs_path):
  """The generated task never repeats a pair, which a tiny model cannot learn
  from in 30 steps; 16 fixed pairs seen 15 times each, it can."""
  config = shrink(
    dpo_arith,
    tmp_path,
    {
      'dpo.train_path': pairs_path,
      'dpo.pairs_per_step': 8,
      'dpo.steps': 30,
      'optim.lr': 1e-3,
      'optim.warmup_steps': 0,
      'log.every': 10,
    },
  )
  trainers.run(config)
  recs = rl_records(tmp_path)
  assert len(recs) == 30
  assert_finite(recs)
  loss = [r['dpo/loss'] for r in recs]
  accuracy = [r['rewards/accuracies'] for r in recs]
  assert np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.05, loss
  assert np.mean(accuracy[-5:]) > np.mean(accuracy[:5]) + 0.2, accuracy
  assert np.mean(accuracy[-5:]) >= 0.9, accuracy


@pytest.mark.parametrize('config_module, lr', [(grpo_arith, 1e-2), (ppo_arith, 3e-3)])
def test_rl_learns_an_easy_reward(tmp_path, config_module, lr):
  """The share of digits in a completion: 10 of the ~100 characters at
  initialisation, learnable within a few dozen steps."""
  overrides = {
    'reward.functions': (DIGITS,),
    'sft.steps': 0,  # the warm-up would teach digits
    'rl.steps': 25,
    'optim.lr': lr,
    'optim.warmup_steps': 0,
    'log.every': 25,
  }
  if config_module is ppo_arith:
    overrides['ppo.critic_lr'] = lr
  trainers.run(shrink(config_module, tmp_path, overrides))
  recs = rl_records(tmp_path)
  assert len(recs) == 25
  reward = [r['reward/mean'] for r in recs]
  assert np.mean(reward[:5]) < 0.3, reward
  assert np.mean(reward[-5:]) > np.mean(reward[:5]) + 0.3, reward


# 4. DPO variants from a JSONL file; SFT only ------------------------------------------------

DPO_LOSSES = ('dpo', 'ipo', 'hinge', 'simpo', 'orpo')
REFERENCE_FREE = ('simpo', 'orpo')


@pytest.mark.parametrize('loss', DPO_LOSSES)
def test_dpo_family_from_jsonl(tmp_path, pairs_path, loss, monkeypatch):
  config = shrink(
    dpo_arith,
    tmp_path,
    {
      'dpo.train_path': pairs_path,
      'dpo.loss': loss,
      'dpo.pairs_per_step': 8,
      'checkpoint.every': 2,  # a checkpoint at the end of the SFT warm-up
    },
  )
  calls = []

  def count_reference_calls(steps):
    def counted(*args, **kwargs):
      calls.append(1)
      return steps.reference(*args, **kwargs)

    return steps._replace(reference=counted)

  capture(monkeypatch, dpo, 'make_steps', count_reference_calls)
  state = trainers.run(config)
  d, sft_steps, steps = config.dpo, config.sft.steps, config.dpo.steps

  recs = rl_records(tmp_path)
  assert len(recs) == steps
  assert_finite(recs)
  for r in recs:
    for k in ('dpo/loss', 'dpo/grad_norm', 'rewards/chosen', 'rewards/margins', 'logps/chosen'):
      assert k in r, k
    assert 0.0 <= r['rewards/accuracies'] <= 1.0
    assert r['dpo/nonfinite'] == 0.0
  assert max(r['dpo/grad_norm'] for r in recs) > 0
  _, meta = restore_latest(tmp_path, state)
  assert meta['streams']['dpo_stream'] == {'position': steps * d.pairs_per_step}

  if loss in REFERENCE_FREE:
    assert state.extra.ref_params is None
    assert not calls
    return
  assert len(calls) == steps
  # The reference is the policy after the warm-up: at the first step the
  # policy is the reference, so every implicit reward is 0.
  warm, _ = restore_step(tmp_path, sft_steps, state)
  assert_trees_equal(state.extra.ref_params, warm.params)
  assert trees_differ(state.params, warm.params)
  first = recs[0]
  assert first['rewards/margins'] == pytest.approx(0.0, abs=1e-5)
  expected_first_loss = {'dpo': np.log(2.0), 'ipo': (1 / (2 * d.beta)) ** 2, 'hinge': 1.0}[loss]
  assert first['dpo/loss'] == pytest.approx(expected_first_loss, rel=1e-4)


GOOD_PAIR = {'prompt': '1+2=', 'chosen': '3', 'rejected': '4'}


@pytest.mark.parametrize(
  'bad_line, message',
  [
    (json.dumps({'prompt': '1+1=', 'chosen': '2'}), 'missing field `rejected`'),
    (json.dumps({'prompt': '1+1=', 'chosen': '2', 'rejected': '2'}), 'identical'),
    ('{"prompt": "1+1=", "chosen": "2", ', 'invalid JSON'),
  ],
)
def test_bad_preference_row_is_named_by_file_and_line(tmp_path, bad_line, message):
  path = tmp_path / 'pairs.jsonl'
  # Line 2 is blank: line numbers count every line of the file.
  path.write_text(json.dumps(GOOD_PAIR) + '\n\n' + json.dumps(GOOD_PAIR) + '\n' + bad_line + '\n')
  config = shrink(dpo_arith, tmp_path / 'run', {'dpo.train_path': str(path)})
  with pytest.raises(ValueError, match=re.escape(f'{path}:4: ') + '.*' + re.escape(message)):
    trainers.build(config)


SFT_ROWS = [
  {'prompt': f'{a}+{b}=', 'response': str(a + b)}
  for a, b in [(12, 34), (5, 6), (70, 8), (9, 9), (41, 23), (3, 50), (66, 11), (2, 2)]
]


def sft_config(workdir, path, steps):
  return shrink(
    sft_arith,
    workdir,
    {'sft.train_path': str(path), 'sft.steps': steps, 'log.every': 100},
  )


@pytest.fixture(scope='module')
def sft_run(tmp_path_factory):
  root = tmp_path_factory.mktemp('sft')
  path = write_jsonl(root / 'sft.jsonl', SFT_ROWS)
  config = sft_config(root / 'run', path, 20)
  state = trainers.run(config)
  return config, root, state


def test_sft_only_from_jsonl_lowers_the_nll(sft_run):
  config, root, _ = sft_run
  recs = records(root / 'run')
  assert config.algorithm == 'sft'
  assert [r['step'] for r in recs] == list(range(1, config.sft.steps + 1))
  assert_finite(recs)
  assert all(r['phase'] == 0.0 and 'reward/mean' not in r for r in recs)
  nll = [r['sft/nll'] for r in recs]
  assert np.mean(nll[-3:]) < np.mean(nll[:3]) - 0.3, nll
  _, meta = restore_latest(root / 'run', sft_run[2])
  assert meta['streams']['sft_stream'] == {'position': config.sft.steps * config.sft.batch_size}


def test_sft_only_run_keeps_its_optimiser_state_and_extends_exactly(sft_run, tmp_path):
  """An SFT-only run has no RL phase: its final state is the SFT optimiser's
  (one step per update), and running the same config with more sft.steps in
  the same workdir continues it as if it had never stopped."""
  config, root, straight = sft_run
  assert int(straight.step) == config.sft.steps
  path = root / 'sft.jsonl'
  trainers.run(sft_config(tmp_path, path, config.sft.steps - 8))
  extended = trainers.run(sft_config(tmp_path, path, config.sft.steps))
  assert_trees_equal(extended, straight)


# 5. GRPO on a Hugging Face checkpoint (configs/grpo_qwen.py) ----------------------------------

QUESTIONS = [(2, 3), (4, 5), (1, 7), (6, 2), (3, 3), (8, 1), (7, 7), (5, 9)]


@pytest.fixture(scope='module')
def qwen_run(tmp_path_factory):
  root = tmp_path_factory.mktemp('qwen')
  model_dir = str(root / 'model')
  helpers.write_tiny_chat_model(model_dir)
  rows = [{'prompt': f'What is {a}+{b}?', 'answer': str(a + b)} for a, b in QUESTIONS]
  config = shrink(
    grpo_qwen,
    root / 'run',
    {
      'model.path': model_dir,
      'model.compute_dtype': 'float32',
      'task.train_path': write_jsonl(root / 'train.jsonl', rows),
      'task.eval_path': write_jsonl(root / 'eval.jsonl', rows[:4]),
      'sft.steps': 0,
      'rl.steps': 3,
      'task.max_prompt_len': 48,
      'task.max_response_len': 8,
      'optim.lr': 1e-3,  # grpo_qwen's 1e-6 after a 10-step warm-up would not move a random model
      'optim.warmup_steps': 0,
      # No parseable answer costs more than a wrong one: rewards are spread out.
      'reward.unscored_value': -1.0,
      'eval.every': 3,
    },
  )
  if 'mode' in config.reward:
    config.reward.mode = grpo_qwen.get_config().reward.mode  # the real set-up
  job = trainers.build(config)
  state = controller.train(job)
  return config, root, job, state


def test_grpo_qwen_runs_on_a_hugging_face_checkpoint(qwen_run):
  config, root, _, state = qwen_run
  recs = records(root / 'run')
  assert [r['step'] for r in recs] == [0, 1, 2, 3]
  assert_finite(recs)
  assert 0.0 <= recs[0]['eval/accuracy'] <= 1.0 and 0.0 <= recs[-1]['eval/accuracy'] <= 1.0
  rows = config.rl.prompts_per_step * config.rl.group_size
  for r in recs[1:]:
    assert 0.0 <= r['reward/math_answer/mean'] <= 1.0
    assert 0 <= r['reward/math_answer/unscored'] <= rows
    assert r['time/reference'] > 0
  assert max(r['advantages/std'] for r in recs[1:]) > 0
  # The KL to the reference (the loaded checkpoint) is in the loss.
  assert max(r['actor/kl_ref'] for r in recs[1:]) > 0
  loaded = hf_lib.load(config.model.path)
  assert_trees_equal(hf_lib.to_host(state.extra.ref_params), hf_lib.to_host(loaded.params))


def test_grpo_qwen_export_loads_in_transformers_with_the_same_logits(qwen_run):
  import torch
  import transformers

  config, root, job, state = qwen_run
  export = os.path.join(str(root / 'run'), 'hf_export')
  final = hf_lib.to_host(state.params)
  assert_trees_equal(hf_lib.to_host(hf_lib.load(export).params), final)
  assert trees_differ(final, hf_lib.to_host(hf_lib.load(config.model.path).params))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    with (
      open(os.path.join(export, name), 'rb') as a,
      open(os.path.join(config.model.path, name), 'rb') as b,
    ):
      assert a.read() == b.read(), name

  model = transformers.AutoModelForCausalLM.from_pretrained(
    export, dtype=torch.float32, attn_implementation='eager'
  ).eval()
  texts = [
    job.resources.encoder.prompt_text('What is 2+3?') + 'It is 5.',
    job.resources.encoder.prompt_text('What is 12+9?'),
  ]
  ids = [job.resources.tokenizer.encode(t) for t in texts]
  length = max(map(len, ids))
  tokens = np.zeros((len(ids), length), np.int32)
  mask = np.zeros((len(ids), length), np.int32)
  for i, row in enumerate(ids):
    tokens[i, : len(row)], mask[i, : len(row)] = row, 1
  with torch.no_grad():
    expected = model(
      input_ids=torch.as_tensor(tokens, dtype=torch.long),
      attention_mask=torch.as_tensor(mask, dtype=torch.long),
    ).logits.numpy()
  got = np.asarray(
    models.logits(
      job.resources.model.graphdef, state.params, jnp.asarray(tokens), jnp.asarray(mask)
    )
  )
  real = mask.astype(bool)
  np.testing.assert_allclose(got[real], expected[real], rtol=1e-4, atol=1e-4)


# 6. launch/eval.py -----------------------------------------------------------------------------

EVAL = {'rl.steps': 2, 'eval.every': 2, 'checkpoint.every': 2}


@pytest.fixture(scope='module')
def eval_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('eval')
  config = shrink(grpo_arith, workdir, EVAL)
  trainers.run(config)
  return config, workdir


def test_eval_script_reports_the_checkpoint_accuracy(eval_run, compilation_cache_dir):
  config, workdir = eval_run
  flags = {**shrink_fields(config), **EVAL, 'workdir': str(workdir)}
  if 'mode' in config.reward:
    flags['reward.mode'] = 'inline'
  command = [sys.executable, 'launch/eval.py', '--config', 'configs/grpo_arith.py']
  command += [f'--config.{k}={v}' for k, v in flags.items()]
  env = dict(
    os.environ,
    JAX_PLATFORMS='cpu',
    JAX_COMPILATION_CACHE_DIR=compilation_cache_dir,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
  )
  procs = {
    step: subprocess.Popen(
      command + ([] if step is None else [f'--step={step}']),
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for step in (None, 2)
  }
  logged = {r['step']: r['eval/accuracy'] for r in records(workdir) if 'eval/accuracy' in r}
  total = config.sft.steps + config.rl.steps
  assert sorted(logged) == [0, 2, total]
  try:
    for step, proc in procs.items():
      out, err = proc.communicate(timeout=300)
      assert proc.returncode == 0, err[-3000:]
      result = json.loads(out.strip().splitlines()[-1])
      expected_step = total if step is None else step
      assert result['checkpoint'] == expected_step
      assert result['eval/accuracy'] == logged[expected_step]
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()
