"""`lse_attention`: dot_attention's numbers, with a backward that stores O(T).

Checked against the obvious implementation (`dot_attention` under plain
autodiff): outputs and gradients to float32 tolerance with grouped kv heads,
scale, soft-cap, query blocks and queries that see no key; what the backward
keeps holds no [B, H, T, S] array (while dot_attention's does); and the
model's training forward with `attention_impl='lse'` gives the loss and
gradients of 'xla' on padded, packed and shared-prompt rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrl.models as M
from jrl.models.attention import dot_attention
from jrl.models.lse_attention import lse_attention

B, T, H, K, D = 2, 16, 6, 2, 8


def _inputs(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, D)), dtype) for n in (H, K, K))
  allowed = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  allowed = allowed.at[1, :3].set(False)  # three queries with no visible key
  weights = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
  return q, k, v, allowed, weights


def _value_and_grads(attend, q, k, v, allowed, weights, **kw):
  def loss(q, k, v):
    return jnp.sum(attend(q, k, v, allowed, **kw).astype(jnp.float32) * weights)

  return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize('block_q', [None, 4])
@pytest.mark.parametrize('options', [{}, {'scale': 0.3}, {'scale': 0.5, 'softcap': 1.5}])
def test_outputs_and_gradients_equal_dot_attention(options, block_q):
  q, k, v, allowed, weights = _inputs()
  got = lse_attention(q, k, v, allowed, block_q=block_q, **options)
  want = dot_attention(q, k, v, allowed, **options)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # The queries with no visible key average every value (as dot_attention).
  np.testing.assert_allclose(got[1, 0], jnp.repeat(v[1].mean(0), H // K, axis=0), atol=1e-6)
  loss, grads = _value_and_grads(
    lse_attention, q, k, v, allowed, weights, block_q=block_q, **options
  )
  want_loss, want_grads = _value_and_grads(dot_attention, q, k, v, allowed, weights, **options)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for g, w in zip(grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_bfloat16_keeps_its_dtypes_and_stays_within_bfloat16_rounding():
  q, k, v, allowed, weights = _inputs(jnp.bfloat16)
  got = lse_attention(q, k, v, allowed)
  assert got.dtype == jnp.bfloat16
  want = dot_attention(q, k, v, allowed)
  np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=2e-2)
  _, grads = _value_and_grads(lse_attention, q, k, v, allowed, weights)
  _, want_grads = _value_and_grads(dot_attention, q, k, v, allowed, weights)
  for g, w in zip(grads, want_grads, strict=True):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(g.astype(jnp.float32), w.astype(jnp.float32), atol=6e-2, rtol=2e-2)


def _largest_residual(attend):
  """Elements of the largest array the backward of `attend` keeps."""
  q, k, v, allowed, _ = _inputs()
  _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, allowed), q, k, v)
  return max(int(np.size(x)) for x in jax.tree.leaves(vjp) if hasattr(x, 'shape'))


def test_the_backward_keeps_no_score_matrix():
  scores = B * H * T * T
  assert _largest_residual(dot_attention) >= scores  # the probabilities, per head
  assert _largest_residual(lse_attention) < scores  # inputs, output, one float per query
  assert _largest_residual(lse_attention) <= B * T * H * D


def test_block_q_must_divide_the_queries():
  q, k, v, allowed, _ = _inputs()
  with pytest.raises(ValueError, match='block_q = 5 must divide the 16 queries'):
    lse_attention(q, k, v, allowed, block_q=5)


# -- in the model --------------------------------------------------------------------

CFG = M.ModelConfig(
  vocab_size=64,
  width=32,
  mlp_width=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  attn_softcap=3.0,
)


def _rows(layout):
  """(tokens, keyword arguments of hidden_states) of a small batch per layout."""
  tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, CFG.vocab_size)
  if layout == 'padded':
    return tokens, {'mask': jnp.ones((2, 13), bool).at[0, :4].set(False)}
  if layout == 'packed':
    seg = jnp.asarray([[1] * 5 + [2] * 6 + [0] * 2, [1] * 13])
    return tokens, {'segment_ids': seg}
  # Shared prompt: 5 prompt columns, then 2 branches of 4 (one ends early).
  branches = jnp.ones((2, 2, 4), bool).at[1, 0, 3].set(False)
  mask = jnp.concatenate([jnp.ones((2, 5), bool), branches.reshape(2, 8)], axis=1)
  positions = jnp.concatenate([jnp.arange(5), 5 + jnp.arange(4), 5 + jnp.arange(4)])
  positions = jnp.broadcast_to(positions, (2, 13))
  return tokens, {'mask': mask, 'positions': positions, 'branches': branches}


@pytest.mark.parametrize('layout', ['padded', 'packed', 'shared_prompt'])
def test_training_forward_with_lse_gives_the_xla_loss_and_gradients(layout):
  tokens, kw = _rows(layout)
  weights = jax.random.normal(jax.random.key(2), (2, 13, CFG.width))
  _, params = M.create(CFG, jax.random.key(0))

  def loss_and_grads(impl):
    graphdef, _ = M.abstract(CFG.replace(attention_impl=impl))

    def loss(params):
      return jnp.sum(M.hidden_states(graphdef, params, tokens, **kw) * weights)

    return jax.jit(jax.value_and_grad(loss))(params)

  loss, grads = loss_and_grads('lse')
  want_loss, want_grads = loss_and_grads('xla')
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
