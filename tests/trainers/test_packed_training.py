"""Packed training (`train.packing`): the model runs on rows that hold several
sequences end to end, and every logprob, loss and gradient is what the
padded rows give.

The model level: attention never crosses a segment (perturbing one segment
leaves the others' logprobs bit-for-bit unchanged), positions restart, and
sliding windows still count from the segment's start. The loss level: the
GRPO-family policy losses under every aggregation (token-mean,
sequence-mean, Dr.GRPO's constant normaliser, GSPO's sequence ratio) give
the same loss and gradients packed and padded, on batches with one very long
sequence, many short ones and empty responses; the token-budget
micro-batches and their row lengths. The run level is in
`test_packed_runs.py`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import dpo_arith
from jrl import models, trainers
from jrl.data import packing
from jrl.trainers import common, dpo, policy_step, ppo, reward_model, sft
from tests.helpers import (
  jit_critic_values,
  jit_token_logprobs,
  set_fields,
  shrunk_config,
  step_config,
)

TINY = models.ModelConfig(
  vocab_size=64, width=32, mlp_width=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)


def make_batch(lengths, prompt_lengths, t, seed=0):
  """A right-padded [B, T] batch: tokens, mask (real), loss_mask (response)."""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  tokens = np.zeros((b, t), np.int32)
  mask = np.zeros((b, t), bool)
  loss_mask = np.zeros((b, t), bool)
  for i, (n, p) in enumerate(zip(lengths, prompt_lengths, strict=True)):
    tokens[i, :n] = rng.integers(1, TINY.vocab_size, n)
    mask[i, :n] = True
    loss_mask[i, p:n] = True
  return tokens, mask, loss_mask


def device_packed(tokens, mask, row_len, multiple=1):
  return jax.tree.map(jnp.asarray, packing.pack_padded(tokens, mask, row_len, multiple))


# Shapes of batch that must all give the padded result: one sequence filling
# the whole row, many short ones, and responses of length 0.
BATCHES = {
  'one_long_many_short': ([24, 3, 5, 2, 4, 6, 3, 2], [10, 2, 2, 1, 3, 2, 2, 1]),
  'empty_responses': ([6, 4, 9, 5], [6, 2, 9, 3]),
  'all_full': ([24, 24, 24], [8, 12, 4]),
  'mixed': ([24, 3, 5, 2, 4, 6, 3, 2, 6, 9], [10, 2, 2, 1, 3, 2, 2, 1, 6, 9]),
}


@pytest.fixture(scope='module')
def model():
  return models.create(TINY, jax.random.PRNGKey(0))


@pytest.mark.parametrize('name', sorted(BATCHES))
def test_packed_logprobs_and_entropies_equal_the_padded_ones(model, name):
  graphdef, params = model
  lengths, prompts = BATCHES[name]
  tokens, mask, _ = make_batch(lengths, prompts, 24)
  packed = device_packed(tokens, mask, 24)
  assert packed.tokens.shape[0] < len(lengths) or name == 'all_full'
  padded = jit_token_logprobs(graphdef, params, tokens, mask, with_entropy=True)
  got = jit_token_logprobs(graphdef, params, tokens, mask, packed, with_entropy=True)
  for want, have in zip(padded, got, strict=True):
    np.testing.assert_allclose(np.asarray(have)[mask], np.asarray(want)[mask], atol=1e-5)
    # Off the sequences the packed values are 0; the first token has no prediction.
    assert not np.asarray(have)[~mask].any()
    assert not np.asarray(have)[:, 0].any()


def test_no_token_attends_across_a_segment_boundary(model):
  graphdef, params = model
  tokens, mask, _ = make_batch([7, 5, 9, 3], [2, 2, 2, 2], 24, seed=1)
  packed = packing.pack_padded(tokens, mask, 24)
  assert packed.tokens.shape[0] == 1  # all four in one row
  base, _ = models.next_token_logprobs(
    graphdef, params, packed.tokens, positions=packed.positions, segment_ids=packed.segment_ids
  )
  seg = packed.segment_ids
  for victim in range(1, 5):
    changed = np.array(packed.tokens)
    changed[seg == victim] = (changed[seg == victim] + 17) % TINY.vocab_size
    logp, _ = models.next_token_logprobs(
      graphdef, params, changed, positions=packed.positions, segment_ids=seg
    )
    others = (seg != victim) & (seg > 0)
    np.testing.assert_array_equal(np.asarray(logp)[others], np.asarray(base)[others])
    assert not np.allclose(np.asarray(logp)[seg == victim], np.asarray(base)[seg == victim])


def test_sliding_windows_count_from_the_segment_start():
  config = dataclasses.replace(TINY, sliding_window=3)
  graphdef, params = models.create(config, jax.random.PRNGKey(2))
  tokens, mask, _ = make_batch([9, 6, 8], [1, 1, 1], 24, seed=2)
  padded, _ = jit_token_logprobs(graphdef, params, tokens, mask)
  packed = device_packed(tokens, mask, 24)
  got, _ = jit_token_logprobs(graphdef, params, tokens, mask, packed)
  np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(padded)[mask], atol=1e-5)


def test_positions_from_segments():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  want = [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]]
  np.testing.assert_array_equal(models.positions_from_segments(seg), want)
  np.testing.assert_array_equal(
    models.segment_starts(seg),
    [[1, 0, 0, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]],
  )


# Every aggregation of the GRPO family, packed vs padded ---------------------------

LOSSES = {
  'grpo_token_mean': dict(policy_loss='ppo', loss_agg='token-mean'),
  'seq_mean_token_mean': dict(policy_loss='ppo', loss_agg='seq-mean-token-mean'),
  'dr_grpo_constant_norm': dict(
    policy_loss='ppo', loss_agg='seq-mean-token-sum-norm', loss_norm=24.0
  ),
  'gspo_sequence_ratio': dict(policy_loss='gspo', loss_agg='seq-mean-token-mean'),
  'cispo': dict(policy_loss='cispo', loss_agg='token-mean'),
  'kl_and_entropy': dict(policy_loss='ppo', kl_coef=0.1, entropy_coef=0.01),
}


@pytest.mark.parametrize('name', sorted(LOSSES))
def test_policy_loss_and_gradients_are_the_same_packed_and_padded(model, name):
  """On one batch with a sequence filling a whole row, many short ones and
  two empty responses."""
  graphdef, params = model
  lengths, prompts = BATCHES['mixed']
  tokens, mask, loss_mask = make_batch(lengths, prompts, 24, seed=3)
  rng = np.random.default_rng(4)
  b = len(lengths)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  # Behaviour and reference logprobs near the policy's, so some ratios fall
  # inside the clip range; advantages of both signs.
  logp, _ = jit_token_logprobs(graphdef, params, tokens, mask)
  near = lambda: f32(np.where(loss_mask, np.asarray(logp) + rng.normal(0.0, 0.1, (b, 24)), 0.0))
  old_logp, ref_logp = near(), near()
  signs = np.where(np.arange(b) % 2 == 0, 1.0, -1.0)[:, None]
  adv = f32(np.where(loss_mask, signs * rng.uniform(0.5, 1.5, (b, 1)), 0.0))
  batch = policy_step.PolicyBatch(
    tokens=jnp.asarray(tokens),
    mask=jnp.asarray(mask),
    loss_mask=jnp.asarray(loss_mask),
    old_logp=old_logp,
    ref_logp=ref_logp,
    advantages=adv,
  )
  cfg = step_config(**LOSSES[name])
  grad = jax.jit(jax.value_and_grad(policy_step.policy_loss, has_aux=True), static_argnums=(1, 3))
  (loss, metrics), grads = grad(params, graphdef, batch, cfg)
  packed = batch._replace(packed=device_packed(tokens, mask, 24))
  (loss_p, metrics_p), grads_p = grad(params, graphdef, packed, cfg)
  np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-5, atol=1e-6)
  for key in ('actor/pg_loss', 'actor/entropy', 'actor/kl_ref'):
    np.testing.assert_allclose(float(metrics_p[key]), float(metrics[key]), rtol=1e-5, atol=1e-6)
  flat, flat_p = jax.tree.leaves(grads), jax.tree.leaves(grads_p)
  assert any(np.abs(np.asarray(g)).max() > 0 for g in flat)
  for g, gp in zip(flat, flat_p, strict=True):
    np.testing.assert_allclose(np.asarray(gp), np.asarray(g), rtol=1e-4, atol=1e-5)

  # Token-budget micro-batches (2 rows of 24, then the short tail in rows of 8):
  # their losses and gradients add up to the whole minibatch's, their metrics
  # combine to its.
  parts = micro_parts(tokens, mask, 24, budget=48, row_lens=SHORT_ROWS)
  assert len(parts) >= 2 and {p.tokens.shape[1] for p in parts} == {24, 8}
  losses, grads_m, metrics_m = [], None, []
  for part in parts:
    (loss_i, metrics_i), grads_i = grad(params, graphdef, batch._replace(packed=part), cfg)
    losses.append(float(loss_i))
    metrics_m.append(jax.device_get(metrics_i))
    grads_m = grads_i if grads_m is None else jax.tree.map(jnp.add, grads_m, grads_i)
  np.testing.assert_allclose(sum(losses), float(loss), rtol=1e-5, atol=1e-6)
  for g, gm in zip(flat, jax.tree.leaves(grads_m), strict=True):
    np.testing.assert_allclose(np.asarray(gm), np.asarray(g), rtol=1e-4, atol=1e-5)
  step = common.MicroBatchedStep(None, None, policy_step.ADDITIVE_METRICS, policy_step.TOKEN_SHARE)
  combined = step.combine(metrics_m)
  np.testing.assert_allclose(sum(m[policy_step.TOKEN_SHARE] for m in metrics_m), 1.0, rtol=1e-6)
  for key in ('actor/pg_loss', 'actor/entropy', 'actor/kl_ref', 'actor/logp_diff_abs'):
    np.testing.assert_allclose(combined[key], float(metrics[key]), rtol=1e-5, atol=1e-6)
  if 'actor/clipfrac' in metrics:
    np.testing.assert_allclose(
      combined['actor/clipfrac'], float(metrics['actor/clipfrac']), atol=1e-6
    )


def micro_parts(tokens, mask, row_len, budget, multiple=1, row_lens=None):
  return [
    jax.tree.map(jnp.asarray, host)
    for host in packing.micro_batches(tokens, mask, row_len, budget, multiple, row_lens)
  ]


# Row lengths for the short tail: the micro-batches of a batch run rows of
# 24 and of 8 tokens (one compile each).
SHORT_ROWS = (8, 12, 24)


def test_micro_batches_hold_every_sequence_once_within_the_budget():
  lengths, prompts = BATCHES['mixed']
  tokens, mask, _ = make_batch(lengths + lengths, prompts + prompts, 24, seed=8)
  parts = packing.micro_batches(tokens, mask, 24, budget=48, multiple=2)
  again = packing.micro_batches(tokens, mask, 24, budget=48, multiple=2)
  assert len(parts) >= 2
  held = np.zeros(len(tokens), int)
  for part, same in zip(parts, again, strict=True):
    for a, b in zip(part, same, strict=True):
      np.testing.assert_array_equal(a, b)  # the same lengths, the same split
    rows, row_len = part.tokens.shape
    # 48 tokens per shard, 2 shards: at most 4 rows of 24; a multiple of the shards.
    assert rows * row_len <= 48 * 2 and rows % 2 == 0
    held += part.select
    # Each held sequence unpacks to its own tokens; the others to nothing.
    back = np.where(part.valid, part.tokens.reshape(-1)[part.index], 0)
    np.testing.assert_array_equal(back[part.select], np.where(mask, tokens, 0)[part.select])
    assert not part.valid[~part.select].any()
  np.testing.assert_array_equal(held, 1)
  with pytest.raises(ValueError, match='less than a row'):
    packing.micro_batches(tokens, mask, 24, budget=20)


def test_row_len_buckets():
  assert packing.row_len_buckets(1024) == (1024, 512, 256, 128)  # whole splash tiles
  assert packing.row_len_buckets(64) == (64, 32, 16)
  assert packing.row_len_buckets(96) == (96, 48, 24)  # 12 is no multiple of 8
  assert packing.row_len_buckets(24) == (24,)


def test_a_short_tail_runs_in_short_rows():
  # One long sequence and nine short ones, a budget of one row: the long one's
  # row of 1,024, then the tail in 2 rows of 128 (not a second row of 1,024).
  lengths = [1000] + [20] * 10
  plan = packing.micro_batch_plan(lengths, 1024, budget=1024)
  assert [(len(bins), length, rows) for bins, length, rows in plan] == [(1, 1024, 1), (2, 128, 2)]
  assert plan[0][0] == [[0, 1]] and sorted(i for row in plan[1][0] for i in row) == list(
    range(2, 11)
  )
  only_long = packing.micro_batch_plan(lengths, 1024, budget=1024, row_lens=(1024,))
  assert [(length, rows) for _, length, rows in only_long] == [(1024, 1), (1024, 1)]


def test_micro_batch_plans_never_run_more_tokens_and_compile_few_shapes():
  """Random long-tailed batches (mean about a quarter of the longest): every
  sequence in one row of one micro-batch, within the row and the budget, row
  lengths from the buckets and never longer than the micro-batch before; the
  tokens run are at most those of rows of one length; few (rows, L) shapes."""
  rng = np.random.default_rng(0)
  for multiple, budget in ((1, 1024), (2, 2048), (4, 4096)):
    shapes = set()
    for _ in range(60):
      lengths = np.minimum(rng.exponential(256, size=int(rng.integers(1, 97))), 1023) + 1
      lengths = lengths.astype(int).tolist()
      plan = packing.micro_batch_plan(lengths, 1024, budget, multiple)
      one_length = packing.micro_batch_plan(lengths, 1024, budget, multiple, row_lens=(1024,))
      assert packing.micro_batch_plan(lengths, 1024, budget, multiple) == plan
      held = sorted(i for bins, _, _ in plan for row in bins for i in row)
      assert held == list(range(len(lengths)))
      run = [rows * length for _, length, rows in plan]
      assert sum(run) <= sum(rows * length for _, length, rows in one_length)
      assert [length for _, length, _ in plan] == sorted((p[1] for p in plan), reverse=True)
      for bins, length, rows in plan:
        assert length in (1024, 512, 256, 128)
        assert all(sum(lengths[i] for i in row) <= length for row in bins)
        assert len(bins) <= rows and rows % multiple == 0 and rows * length <= budget * multiple
        shapes.add((rows, length))
    # Compiles: one per (rows, L), from 4 lengths x a few row counts.
    assert len(shapes) <= 4 * 6, shapes


@pytest.mark.parametrize('loss', ['ppo', 'gspo'])
def test_environment_tokens_inside_a_response_pack_and_split_like_the_padded_rows(model, loss):
  """An agent's rows: model turns, then tool answers (in the sequence and
  attended to, not trained on, no behaviour logprob), then more model
  turns. Padded, packed and split into micro-batches give one loss and
  gradient."""
  graphdef, params = model
  lengths, prompts = BATCHES['mixed']
  tokens, mask, loss_mask = make_batch(lengths, prompts, 24, seed=9)
  with_tools = [row for row, (n, p) in enumerate(zip(lengths, prompts, strict=True)) if n - p >= 4]
  assert len(with_tools) >= 2
  for row in with_tools:
    loss_mask[row, prompts[row] + 1 : prompts[row] + 3] = False  # two environment tokens
  logp, _ = jit_token_logprobs(graphdef, params, tokens, mask)
  rng = np.random.default_rng(10)
  f32 = lambda x: jnp.asarray(np.where(loss_mask, x, 0.0), jnp.float32)
  batch = policy_step.PolicyBatch(
    tokens=jnp.asarray(tokens),
    mask=jnp.asarray(mask),
    loss_mask=jnp.asarray(loss_mask),
    old_logp=f32(np.asarray(logp) + rng.normal(0.0, 0.1, tokens.shape)),
    ref_logp=f32(0.0),
    advantages=f32(rng.normal(0.0, 1.0, (len(lengths), 1))),
  )
  cfg = step_config(policy_loss=loss, loss_agg='seq-mean-token-mean')
  grad = jax.jit(jax.value_and_grad(policy_step.policy_loss, has_aux=True), static_argnums=(1, 3))
  (want, _), grads = grad(params, graphdef, batch, cfg)
  (packed, _), grads_p = grad(
    params, graphdef, batch._replace(packed=device_packed(tokens, mask, 24)), cfg
  )
  parts = [
    grad(params, graphdef, batch._replace(packed=p), cfg)
    for p in micro_parts(tokens, mask, 24, 24, row_lens=SHORT_ROWS)
  ]
  assert len(parts) >= 2
  np.testing.assert_allclose(float(packed), float(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sum(float(p[0][0]) for p in parts), float(want), rtol=1e-5, atol=1e-6)
  summed = jax.tree.map(lambda *g: sum(g), *[p[1] for p in parts])
  for g, gp, gm in zip(*map(jax.tree.leaves, (grads, grads_p, summed)), strict=True):
    np.testing.assert_allclose(np.asarray(gp), np.asarray(g), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gm), np.asarray(g), rtol=1e-4, atol=1e-5)


def test_micro_batch_tokens_must_hold_a_row_and_a_loss_it_can_split(tmp_path):
  config = shrunk_config(tmp_path, {'train.micro_batch_tokens': 8})
  with pytest.raises(
    ValueError, match=r'^`train\.micro_batch_tokens`: must be 0 or at least one row'
  ):
    trainers.validate(config, 1)
  config = shrunk_config(tmp_path, {'train.packing': True, 'train.micro_batch_tokens': 8})
  with pytest.raises(ValueError, match=r'train\.micro_batch_tokens'):
    trainers.validate(config, 1)
  config = set_fields(
    dpo_arith.get_config(), {'train.packing': True, 'train.micro_batch_tokens': 4096}
  )
  with pytest.raises(ValueError, match=r"not 'dpo' \(its pair losses are not split yet\)"):
    trainers.validate(config, 1)


@pytest.mark.parametrize('batch_name', ['one_long_many_short', 'empty_responses'])
def test_critic_values_and_value_loss_are_the_same_packed_and_padded(batch_name):
  graphdef, params = models.create(TINY, jax.random.PRNGKey(5), lm_head=False, scalar_head=True)
  lengths, prompts = BATCHES[batch_name]
  tokens, mask, loss_mask = make_batch(lengths, prompts, 24, seed=6)
  packed = device_packed(tokens, mask, 24)
  want = jit_critic_values(graphdef, params, tokens, mask)
  got = jit_critic_values(graphdef, params, tokens, mask, packed)
  np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=1e-5)
  assert not np.asarray(got)[:, 0].any()
  rng = np.random.default_rng(7)
  f32 = lambda x: jnp.asarray(np.where(loss_mask, x, 0.0), jnp.float32)
  batch = ppo.PPOBatch(
    tokens=jnp.asarray(tokens),
    mask=jnp.asarray(mask),
    loss_mask=jnp.asarray(loss_mask),
    old_logp=f32(0.0),
    ref_logp=f32(0.0),
    advantages=f32(0.0),
    returns=f32(rng.normal(0.0, 1.0, tokens.shape)),
    old_values=f32(np.asarray(want) + rng.normal(0.0, 0.1, tokens.shape)),
  )
  grad = jax.jit(jax.value_and_grad(ppo.value_loss_fn, has_aux=True), static_argnums=(1, 3))
  (loss, _), grads = grad(params, graphdef, batch, 0.2)
  (loss_p, _), grads_p = grad(params, graphdef, batch._replace(packed=packed), 0.2)
  np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-5, atol=1e-6)
  for g, gp in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_p), strict=True):
    np.testing.assert_allclose(np.asarray(gp), np.asarray(g), rtol=1e-4, atol=1e-5)
  # Micro-batches of one row each: the value losses and gradients add up.
  parts = micro_parts(tokens, mask, max(lengths), budget=max(lengths))
  assert len(parts) >= 2
  outs = [grad(params, graphdef, batch._replace(packed=p), 0.2) for p in parts]
  np.testing.assert_allclose(sum(float(o[0][0]) for o in outs), float(loss), rtol=1e-5, atol=1e-6)
  summed = jax.tree.map(lambda *g: sum(g), *[o[1] for o in outs])
  for g, gm in zip(jax.tree.leaves(grads), jax.tree.leaves(summed), strict=True):
    np.testing.assert_allclose(np.asarray(gm), np.asarray(g), rtol=1e-4, atol=1e-5)


def assert_same_loss_and_grads(loss_fn, params, padded, packed):
  grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  (loss, _), grads = grad(params, padded)
  (loss_p, _), grads_p = grad(params, packed)
  np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-5, atol=1e-6)
  flat, flat_p = jax.tree.leaves(grads), jax.tree.leaves(grads_p)
  assert any(np.abs(np.asarray(g)).max() > 0 for g in flat)
  for g, gp in zip(flat, flat_p, strict=True):
    np.testing.assert_allclose(np.asarray(gp), np.asarray(g), rtol=1e-4, atol=1e-5)


def test_sft_loss_and_gradients_are_the_same_packed_and_padded(model):
  graphdef, params = model
  lengths, prompts = BATCHES['one_long_many_short']
  tokens, mask, loss_mask = make_batch(lengths, prompts, 24, seed=8)
  batch = common.SequenceBatch(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(loss_mask))
  packed = batch._replace(packed=device_packed(tokens, mask, 24))
  loss_fn = lambda p, b: sft.sft_loss(p, graphdef, b)
  assert_same_loss_and_grads(loss_fn, params, batch, packed)
  # Micro-batches of one row: the NLL and its gradient add up.
  grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  (want, _), grads = grad(params, batch)
  parts = [
    grad(params, batch._replace(packed=p))
    for p in micro_parts(tokens, mask, 24, 24, row_lens=SHORT_ROWS)
  ]
  assert len(parts) >= 2
  np.testing.assert_allclose(sum(float(p[0][0]) for p in parts), float(want), rtol=1e-5)
  np.testing.assert_allclose(sum(float(p[0][1][sft.TOKEN_SHARE]) for p in parts), 1.0, rtol=1e-6)
  summed = jax.tree.map(lambda *g: sum(g), *[p[1] for p in parts])
  for g, gm in zip(jax.tree.leaves(grads), jax.tree.leaves(summed), strict=True):
    np.testing.assert_allclose(np.asarray(gm), np.asarray(g), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('loss', dpo.DPO_LOSSES)
def test_dpo_family_pair_sums_are_the_same_packed_and_padded(model, loss):
  """Chosen rows then rejected rows (sequence sums or means of the response
  logprobs), packed into fewer rows than pairs."""
  graphdef, params = model
  lengths, prompts = [14, 5, 9, 3, 20, 6, 11, 4], [2, 2, 3, 2, 2, 2, 3, 2]
  tokens, mask, loss_mask = make_batch(lengths, prompts, 24, seed=9)
  average = loss in ('ipo', 'simpo', 'orpo')
  ref = dpo.sequence_logprobs(graphdef, params, tokens, mask, loss_mask, average)
  ref = ref + jnp.asarray(np.random.default_rng(10).normal(0.0, 0.2, ref.shape), jnp.float32)
  batch = dpo.DPOBatch(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(loss_mask), ref)
  packed = batch._replace(packed=device_packed(tokens, mask, 24))
  assert packed.packed.tokens.shape[0] < len(lengths)
  np.testing.assert_allclose(
    dpo.sequence_logprobs(graphdef, params, tokens, mask, loss_mask, average, packed=packed.packed),
    dpo.sequence_logprobs(graphdef, params, tokens, mask, loss_mask, average),
    rtol=1e-5,
    atol=1e-5,
  )
  cfg = dpo.DPOLossConfig(loss=loss)
  loss_fn = lambda p, b: dpo.preference_loss(p, graphdef, b, cfg)
  assert_same_loss_and_grads(loss_fn, params, batch, packed)


def test_reward_model_scores_and_loss_are_the_same_packed_and_padded():
  graphdef, params = models.create(TINY, jax.random.PRNGKey(11), lm_head=False, scalar_head=True)
  lengths = [14, 5, 9, 3, 20, 6, 11, 4]
  tokens, mask, _ = make_batch(lengths, [1] * 8, 24, seed=12)
  packed = device_packed(tokens, mask, 24)
  np.testing.assert_allclose(
    reward_model.sequence_scores(graphdef, params, tokens, mask, packed),
    models.sequence_scores(graphdef, params, tokens, mask),
    rtol=1e-5,
    atol=1e-5,
  )
  margin = jnp.zeros(4, jnp.float32)
  batch = reward_model.PairBatch(jnp.asarray(tokens), jnp.asarray(mask), margin)
  loss_fn = lambda p, b: reward_model.pair_loss(p, graphdef, b, 0.01)
  assert_same_loss_and_grads(loss_fn, params, batch, batch._replace(packed=packed))


def test_row_count_is_a_few_sizes_times_the_shards_and_never_above_the_batch():
  counts = [packing.row_count(n) for n in range(1, 50)]
  assert sorted(set(counts)) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
  assert all(n <= c <= max(1, 3 * n // 2) for n, c in zip(range(1, 50), counts, strict=True))
  assert packing.row_count(3, multiple=2) == 4
  assert packing.row_count(5, multiple=2) == 6
  assert packing.row_count(5, multiple=2, most=6) == 6
  assert packing.row_count(7, most=6) == 7  # never fewer rows than needed
  tokens, mask, _ = make_batch([5, 5, 5, 5, 5, 5], [1] * 6, 24)
  assert packing.pack_padded(tokens, mask, 24, multiple=4).tokens.shape == (4, 24)


def test_a_row_that_is_not_right_padded_is_named():
  tokens, mask, _ = make_batch([5, 5, 5], [1] * 3, 8)
  mask[2] = np.roll(mask[2], 2)
  with pytest.raises(ValueError, match='row 2 is not right-padded'):
    packing.pack_padded(tokens, mask, 8)


def test_pack_row_len_below_the_longest_sequence_is_refused(tmp_path):
  config = shrunk_config(tmp_path, {'train.packing': True, 'train.pack_row_len': 8})
  with pytest.raises(ValueError, match=r'^`train\.pack_row_len`: must be 0 or at least'):
    trainers.validate(config, 1)
  with pytest.raises(ValueError, match=r'train\.pack_row_len'):
    common.make_packer(config.train, 64, None)
