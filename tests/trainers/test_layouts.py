"""Training layouts (`jrl.data.layouts`): padded rows cut to the batch's
longest, shared-prompt rows (a GRPO group's prompt once, its completions as
branches), logprobs read at the completion window only, and micro-batches
of a token budget without packing. Each gives the losses, gradients and
values of the plain padded [B, T] forward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import models
from jrl.data import layouts
from jrl.trainers import common, policy_step, ppo
from tests.helpers import jit_critic_values, jit_token_logprobs, step_config

TINY = models.ModelConfig(
  vocab_size=64, width=32, mlp_width=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)
T = 40
SHARDING = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def group_batch(prompt_lens=(5, 9, 4), g=4, seed=0):
  """Rows of groups of `g` completions (1-11 tokens) per prompt, groups
  consecutive as a rollout lays them out: (tokens, mask, loss_mask)."""
  rng = np.random.default_rng(seed)
  rows = []
  for n in prompt_lens:
    prompt = rng.integers(1, TINY.vocab_size, n).tolist()
    for _ in range(g):
      rows.append((prompt, rng.integers(1, TINY.vocab_size, int(rng.integers(1, 12))).tolist()))
  b = len(rows)
  tokens, mask, loss_mask = (np.zeros((b, T), t) for t in (np.int32, bool, bool))
  for i, (p, c) in enumerate(rows):
    n = len(p) + len(c)
    tokens[i, :n], mask[i, :n], loss_mask[i, len(p) : n] = p + c, True, True
  return tokens, mask, loss_mask


@pytest.fixture(scope='module')
def model():
  return models.create(TINY, jax.random.PRNGKey(0))


CASES = [('padded', 0), ('padded', 64), ('packed', 0), ('shared_prompt', 0), ('shared_prompt', 100)]


def parts_of(kind, budget, tokens, mask, loss_mask):
  return common.Packer(T, SHARDING, budget, kind).split(tokens, mask, loss_mask)


def test_length_buckets_are_a_few_per_octave():
  got = [layouts.length_bucket(n) for n in (1, 8, 9, 17, 33, 65, 97, 129, 225)]
  assert got == [8, 8, 16, 24, 40, 80, 112, 160, 256]
  assert layouts.length_bucket(225, most=230) == 230
  assert len({layouts.length_bucket(n) for n in range(129, 257)}) == 4


def test_shared_prompt_rows_hold_each_prompt_once():
  tokens, mask, loss_mask = group_batch()
  (part,) = layouts.shared_prompt(tokens, mask, loss_mask)
  assert part.tokens.shape[0] == 3  # one row per prompt
  g, u = part.branches.shape[1:]
  assert g == 4
  p = part.tokens.shape[1] - g * u
  # Row 1's prompt (9 tokens) once, then its four completions.
  np.testing.assert_array_equal(part.tokens[1, :9], tokens[4, :9])
  assert int(np.asarray(mask).sum()) > int((part.segment_ids > 0).sum())
  for k, i in enumerate(range(4, 8)):
    n = int(mask[i].sum())
    np.testing.assert_array_equal(part.tokens[1, p + k * u : p + k * u + n - 9], tokens[i, 9:n])
    np.testing.assert_array_equal(part.positions[1, p + k * u : p + k * u + n - 9], range(9, n))


@pytest.mark.parametrize(('kind', 'budget'), CASES)
def test_logprobs_and_entropies_equal_the_padded_forward(model, kind, budget):
  graphdef, params = model
  tokens, mask, loss_mask = group_batch()
  want = jit_token_logprobs(graphdef, params, tokens, mask, with_entropy=True)
  parts = parts_of(kind, budget, tokens, mask, loss_mask)
  assert (len(parts) > 1) == bool(budget)
  got = None
  for part in parts:
    out = jit_token_logprobs(graphdef, params, tokens, mask, part, with_entropy=True)
    got = out if got is None else tuple(a + b for a, b in zip(got, out, strict=True))
  for have, ref in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(have)[loss_mask], np.asarray(ref)[loss_mask], atol=1e-5)
    # Completion-only logits: nothing is computed at the prompts and padding.
    assert not np.asarray(have)[~loss_mask].any()


def test_padded_rows_are_cut_to_the_longest_sequence():
  tokens, mask, _ = group_batch()
  (part,) = layouts.padded(tokens, mask)
  longest = int(mask.sum(axis=1).max())
  assert part.tokens.shape[1] == layouts.length_bucket(longest) < T


def test_a_branch_sees_its_prompt_and_never_another_branch(model):
  graphdef, params = model
  tokens, mask, loss_mask = group_batch(seed=1)
  (part,) = parts_of('shared_prompt', 0, tokens, mask, loss_mask)
  base, _ = jit_token_logprobs(graphdef, params, tokens, mask, part)
  changed = tokens.copy()
  victim = 5  # a completion of the second prompt
  changed[victim, loss_mask[victim]] = (changed[victim, loss_mask[victim]] + 7) % TINY.vocab_size
  (part2,) = parts_of('shared_prompt', 0, changed, mask, loss_mask)
  logp, _ = jit_token_logprobs(graphdef, params, changed, mask, part2)
  others = loss_mask.copy()
  others[victim] = False
  np.testing.assert_array_equal(np.asarray(logp)[others], np.asarray(base)[others])
  assert not np.allclose(np.asarray(logp)[victim], np.asarray(base)[victim])


LOSSES = {
  'token_mean': dict(policy_loss='ppo', loss_agg='token-mean'),
  'seq_mean_token_mean': dict(policy_loss='ppo', loss_agg='seq-mean-token-mean'),
  'seq_mean_token_sum': dict(policy_loss='ppo', loss_agg='seq-mean-token-sum'),
  'dr_grpo_norm': dict(policy_loss='ppo', loss_agg='seq-mean-token-sum-norm', loss_norm=16.0),
  'gspo': dict(policy_loss='gspo', loss_agg='seq-mean-token-mean'),
  'kl_k3_entropy': dict(kl_coef=0.1, kl_estimator='k3', entropy_coef=0.01),
  'kl_k1': dict(kl_coef=0.1, kl_estimator='k1'),
}


@pytest.mark.parametrize('name', sorted(LOSSES))
@pytest.mark.parametrize(('kind', 'budget'), [('padded', 64), ('shared_prompt', 0)])
def test_policy_loss_and_gradients_equal_the_padded_minibatch(model, name, kind, budget):
  graphdef, params = model
  tokens, mask, loss_mask = group_batch(seed=2)
  b = tokens.shape[0]
  rng = np.random.default_rng(3)
  logp, _ = jit_token_logprobs(graphdef, params, tokens, mask)
  near = lambda: jnp.asarray(
    np.where(loss_mask, np.asarray(logp) + rng.normal(0, 0.1, (b, T)), 0), jnp.float32
  )
  adv = np.where(loss_mask, np.repeat(rng.normal(size=(b, 1)), T, axis=1), 0)
  batch = policy_step.PolicyBatch(
    jnp.asarray(tokens),
    jnp.asarray(mask),
    jnp.asarray(loss_mask),
    near(),
    near(),
    jnp.asarray(adv, jnp.float32),
  )
  cfg = step_config(**LOSSES[name])
  grad = jax.jit(jax.value_and_grad(policy_step.policy_loss, has_aux=True), static_argnums=(1, 3))
  (loss, metrics), grads = grad(params, graphdef, batch, cfg)
  parts = parts_of(kind, budget, tokens, mask, loss_mask)
  total, summed, pieces = 0.0, None, []
  for part in parts:
    (loss_i, metrics_i), grads_i = grad(params, graphdef, batch._replace(packed=part), cfg)
    total += float(loss_i)
    pieces.append(jax.device_get(metrics_i))
    summed = grads_i if summed is None else jax.tree.map(jnp.add, summed, grads_i)
  np.testing.assert_allclose(total, float(loss), rtol=1e-5, atol=1e-6)
  for g, gp in zip(jax.tree.leaves(grads), jax.tree.leaves(summed), strict=True):
    np.testing.assert_allclose(np.asarray(gp), np.asarray(g), rtol=1e-4, atol=1e-5)
  step = common.MicroBatchedStep(None, None, policy_step.ADDITIVE_METRICS, policy_step.TOKEN_SHARE)
  combined = step.combine(pieces)
  for key in ('actor/pg_loss', 'actor/entropy', 'actor/kl_ref'):
    np.testing.assert_allclose(combined[key], float(metrics[key]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(('kind', 'budget'), CASES)
def test_critic_values_and_value_loss_equal_the_padded_ones(kind, budget):
  graphdef, params = models.create(TINY, jax.random.PRNGKey(5), lm_head=False, scalar_head=True)
  tokens, mask, loss_mask = group_batch(seed=4)
  want = jit_critic_values(graphdef, params, tokens, mask)
  parts = parts_of(kind, budget, tokens, mask, loss_mask)
  got = sum(jit_critic_values(graphdef, params, tokens, mask, p) for p in parts)
  np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=1e-5)
  b = tokens.shape[0]
  rng = np.random.default_rng(6)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  batch = ppo.PPOBatch(
    jnp.asarray(tokens),
    jnp.asarray(mask),
    jnp.asarray(loss_mask),
    f32(np.zeros((b, T))),
    f32(np.zeros((b, T))),
    f32(np.zeros((b, T))),
    f32(rng.normal(size=(b, T))),
    f32(np.asarray(want) + rng.normal(0, 0.1, (b, T))),
  )
  grad = jax.jit(jax.value_and_grad(ppo.value_loss_fn, has_aux=True), static_argnums=(1, 3))
  (loss, _), grads = grad(params, graphdef, batch, 0.2)
  total, summed = 0.0, None
  for part in parts:
    (loss_i, _), grads_i = grad(params, graphdef, batch._replace(packed=part), 0.2)
    total += float(loss_i)
    summed = grads_i if summed is None else jax.tree.map(jnp.add, summed, grads_i)
  np.testing.assert_allclose(total, float(loss), rtol=1e-5, atol=1e-6)
  for g, gp in zip(jax.tree.leaves(grads), jax.tree.leaves(summed), strict=True):
    np.testing.assert_allclose(np.asarray(gp), np.asarray(g), rtol=1e-4, atol=1e-5)


def test_a_budget_below_one_row_is_named():
  tokens, mask, loss_mask = group_batch()
  with pytest.raises(ValueError, match=r'`train\.micro_batch_tokens` \(8\)'):
    layouts.padded(tokens, mask, budget=8)
  with pytest.raises(ValueError, match=r'`train\.micro_batch_tokens` \(40\).*shared-prompt row'):
    layouts.shared_prompt(tokens, mask, loss_mask, budget=40)


def test_a_grpo_run_with_shared_prompts_micro_batches_and_fixed_lengths(tmp_path):
  """The run level: `train.shared_prompt` with micro-batches trains, and
  `sampling.min_new_tokens` = `task.max_response_len` makes every completion
  that long; the same run on padded rows logs the same losses."""
  from jrl import trainers
  from tests.helpers import QUIET, records, shrunk_config

  base = {**QUIET, 'sft.steps': 0, 'rl.steps': 2, 'eval.every': 0}
  config = shrunk_config(tmp_path / 'a', base)
  length = config.task.max_response_len
  fixed = {'sampling.min_new_tokens': length}
  trainers.run(shrunk_config(tmp_path / 'a', {**base, **fixed}))
  shared = {'train.shared_prompt': True, 'train.micro_batch_tokens': 4096}
  trainers.run(shrunk_config(tmp_path / 'b', {**base, **fixed, **shared}))
  a = [r for r in records(tmp_path / 'a') if 'actor/loss' in r]
  b = [r for r in records(tmp_path / 'b') if 'actor/loss' in r]
  assert len(a) == len(b) == 2
  assert [r['response_length/mean'] for r in a + b] == [length] * 4
  # The first step samples with the same parameters: the same batch.
  for key in ('actor/loss', 'actor/pg_loss', 'actor/entropy', 'actor/grad_norm'):
    np.testing.assert_allclose(b[0][key], a[0][key], rtol=1e-4, atol=1e-6)


def test_min_new_tokens_above_the_response_limit_is_named(tmp_path):
  from jrl import trainers
  from tests.helpers import shrunk_config

  config = shrunk_config(tmp_path, {'sampling.min_new_tokens': 10_000})
  with pytest.raises(ValueError, match=r'^`sampling\.min_new_tokens`: must be at most'):
    trainers.validate(config, 1)


@pytest.mark.parametrize(
  'by, shared, minibatch, whole_groups',
  [
    ('auto', True, 8, True),  # the shared-prompt layout computes each prompt once
    ('auto', True, 6, False),  # groups of 4 do not fill minibatches of 6
    ('auto', False, 8, False),  # rows drawn at random, as veRL and TRL draw them
    ('group', False, 8, True),
    ('row', True, 8, False),
  ],
)
def test_minibatches_of_rows_or_whole_groups(tmp_path, by, shared, minibatch, whole_groups):
  from jrl.trainers import online
  from tests.helpers import shrunk_config

  fields = {'rl.prompts_per_step': 6, 'rl.group_size': 4, 'rl.minibatch_size': minibatch}
  fields |= {'rl.minibatch_by': by, 'train.shared_prompt': shared}
  config = shrunk_config(tmp_path, {**fields, 'rl.epochs': 2})
  rows = 24
  full = (jnp.arange(rows)[:, None] * jnp.ones((1, 3), jnp.int32),)
  seen = []

  def step(state, mini):
    seen.append(np.asarray(mini[0][:, 0]))
    return state, {'actor/loss': jnp.float32(0)}

  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  online.run_minibatches(
    step, None, full, config.rl, 0, sharding, seed=config.seed, shared_prompt=shared
  )
  assert len(seen) == 2 * rows // minibatch
  for epoch in (seen[: len(seen) // 2], seen[len(seen) // 2 :]):
    assert sorted(np.concatenate(epoch).tolist()) == list(range(rows))  # every row once
  groups = [set((mini // 4).tolist()) for mini in seen]
  assert all(len(g) == minibatch // 4 for g in groups) == whole_groups


def test_whole_groups_need_a_multiple_of_the_group(tmp_path):
  from jrl import trainers
  from tests.helpers import shrunk_config

  fields = {'rl.prompts_per_step': 6, 'rl.group_size': 4, 'rl.minibatch_size': 6}
  config = shrunk_config(tmp_path, {**fields, 'rl.minibatch_by': 'group'})
  needs = r"^`rl\.minibatch_by`: 'group' needs rl\.minibatch_size \(6\)"
  with pytest.raises(ValueError, match=needs):
    trainers.validate(config, 1)
  config = shrunk_config(tmp_path, {**fields, 'rl.minibatch_by': 'rows'})
  with pytest.raises(ValueError, match=r'^`rl\.minibatch_by`: must be one of'):
    trainers.validate(config, 1)
