"""Tests for jrl.losses.logprobs: token logprobs and entropies, chunked.

Checked against a float64 NumPy reference, chunked against unchunked (values
and gradients), from-hidden against explicit logits, numerical gradients,
jit, and the memory bound that is the point of chunking.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jrl.losses import logprobs as L

B, T, V, D = 3, 4, 11, 6  # B·T = 12 rows
CHUNK = 5  # smaller than B·T and does not divide it: 3 chunks, the last padded


def _np_log_softmax(logits, temperature):
  z = np.asarray(logits, np.float64) / temperature
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _np_logprobs(logits, targets, temperature=1.0):
  logp = _np_log_softmax(logits, temperature)
  return np.take_along_axis(logp, np.asarray(targets)[..., None], axis=-1)[..., 0]


def _np_entropy(logits, temperature=1.0):
  logp = _np_log_softmax(logits, temperature)
  return -(np.exp(logp) * logp).sum(axis=-1)


def _inputs(seed=0, b=B, t=T, v=V, d=D, scale=3.0):
  rng = np.random.default_rng(seed)
  logits = (scale * rng.normal(size=(b, t, v))).astype(np.float32)
  targets = rng.integers(0, v, size=(b, t)).astype(np.int32)
  hidden = rng.normal(size=(b, t, d)).astype(np.float32)
  unembed = rng.normal(size=(d, v)).astype(np.float32)
  bias = rng.normal(size=(v,)).astype(np.float32)
  return logits, targets, hidden, unembed, bias


# ----------------------------------------------------------------------------
# Hand-computed values.
# ----------------------------------------------------------------------------


def test_hand_computed_values():
  # Row 0: uniform over 4 tokens -> logp = -log 4, entropy = log 4.
  # Row 1: logits log([1, 2, 3, 4]) -> p = [.1, .2, .3, .4]; target 3 -> log .4;
  #        entropy = -(.1 log .1 + .2 log .2 + .3 log .3 + .4 log .4).
  p1 = np.array([0.1, 0.2, 0.3, 0.4])
  logits = np.array([[[0.0, 0.0, 0.0, 0.0], np.log(p1)]], np.float32)  # [1, 2, 4]
  targets = np.array([[2, 3]], np.int32)
  logp, ent = L.token_logprobs_and_entropy(logits, targets)
  np.testing.assert_allclose(logp, [[-np.log(4.0), np.log(0.4)]], rtol=1e-6)
  np.testing.assert_allclose(ent, [[np.log(4.0), -(p1 * np.log(p1)).sum()]], rtol=1e-6)


def test_hand_computed_temperature():
  # logits 2·log([1, 1, 2]) at τ = 2 -> z = log([1, 1, 2]) -> p = [.25, .25, .5].
  # target 2 -> log .5; entropy = -(2 · .25 log .25 + .5 log .5) = 1.5 log 2.
  logits = (2.0 * np.log(np.array([[[1.0, 1.0, 2.0]]]))).astype(np.float32)
  targets = np.array([[2]], np.int32)
  np.testing.assert_allclose(
    L.token_logprobs(logits, targets, temperature=2.0), [[np.log(0.5)]], rtol=1e-6
  )
  np.testing.assert_allclose(
    L.token_entropy(logits, temperature=2.0), [[1.5 * np.log(2.0)]], rtol=1e-6
  )


def test_hand_computed_gradient():
  # d logp_y / d logits = (onehot(y) - softmax(z)) / τ; here p = [.25, .25, .5], y = 2, τ = 2:
  # ([0, 0, 1] - [.25, .25, .5]) / 2 = [-.125, -.125, .25].
  logits = (2.0 * np.log(np.array([[[1.0, 1.0, 2.0]]]))).astype(np.float32)
  targets = np.array([[2]], np.int32)
  g = jax.grad(lambda z: L.token_logprobs(z, targets, temperature=2.0).sum())(logits)
  np.testing.assert_allclose(g, [[[-0.125, -0.125, 0.25]]], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------
# NumPy reference.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('temperature', [1.0, 0.7, 1.6])
@pytest.mark.parametrize('chunk_size', [None, CHUNK, 1, 1024])
def test_matches_numpy_reference(temperature, chunk_size):
  logits, targets, *_ = _inputs(seed=1)
  ref_logp = _np_logprobs(logits, targets, temperature)
  ref_ent = _np_entropy(logits, temperature)
  kw = {'temperature': temperature, 'chunk_size': chunk_size}

  logp = L.token_logprobs(logits, targets, **kw)
  ent = L.token_entropy(logits, **kw)
  logp2, ent2 = L.token_logprobs_and_entropy(logits, targets, **kw)
  for out in (logp, ent, logp2, ent2):
    assert out.shape == (B, T)
    assert out.dtype == jnp.float32
  np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logp2, ref_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, ref_ent, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent2, ref_ent, rtol=1e-5, atol=1e-5)


def test_with_entropy_false_gives_zeros():
  logits, targets, *_ = _inputs(seed=2)
  logp, ent = L.token_logprobs_and_entropy(logits, targets, with_entropy=False)
  np.testing.assert_allclose(logp, _np_logprobs(logits, targets), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(ent, np.zeros((B, T), np.float32))


def test_large_logits_are_stable():
  # A naive exp() would overflow float32 at 1e4; log-softmax must not.
  logits, targets, *_ = _inputs(seed=3, scale=1e4)
  logp, ent = L.token_logprobs_and_entropy(logits, targets, chunk_size=CHUNK)
  assert np.all(np.isfinite(logp)) and np.all(np.isfinite(ent))
  np.testing.assert_allclose(logp, _np_logprobs(logits, targets), rtol=1e-5, atol=1e-2)
  np.testing.assert_allclose(ent, _np_entropy(logits), atol=1e-4)


@pytest.mark.parametrize('chunk_size', [None, CHUNK])
def test_offset_logits_low_temperature_precise(chunk_size):
  # LLM-sized logits (~30) at a low sampling temperature (τ = 0.3) give z ~ 100.
  # Softmax statistics are shift-invariant, and a float32 evaluation on the
  # max-shifted z is accurate to ~3e-6 here. Computing H as lse(z) − Σ p·z on
  # the unshifted z cancels two numbers of size ~100 and loses ~1e-3, which is
  # 15% of the smallest entropies in this batch (~0.007).
  rng = np.random.default_rng(14)
  v = 1000
  logits = (3.0 * rng.normal(size=(B, T, v)) + 30.0).astype(np.float32)
  targets = rng.integers(0, v, size=(B, T)).astype(np.int32)
  tau = 0.3
  kw = {'temperature': tau, 'chunk_size': chunk_size}
  logp, ent = L.token_logprobs_and_entropy(logits, targets, **kw)
  np.testing.assert_allclose(logp, _np_logprobs(logits, targets, tau), rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(ent, _np_entropy(logits, tau), atol=2e-5)
  # Shift invariance: subtracting the common offset changes nothing.
  logp0, ent0 = L.token_logprobs_and_entropy(logits - 30.0, targets, **kw)
  np.testing.assert_allclose(logp, logp0, rtol=1e-5, atol=2e-5)
  np.testing.assert_allclose(ent, ent0, atol=2e-5)


@pytest.mark.parametrize('chunk_size', [None, CHUNK])
def test_bfloat16_logits_computed_in_float32(chunk_size):
  logits, targets, *_ = _inputs(seed=4)
  logits_bf16 = jnp.asarray(logits, jnp.bfloat16)
  tau = 0.7
  logp, ent = L.token_logprobs_and_entropy(
    logits_bf16, targets, temperature=tau, chunk_size=chunk_size
  )
  assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
  # Close to the float32 logits' reference, up to bfloat16 rounding of the inputs
  # (relative 2^-9 on logits of size ~10 / τ).
  np.testing.assert_allclose(logp, _np_logprobs(logits, targets, tau), atol=0.1)
  np.testing.assert_allclose(ent, _np_entropy(logits, tau), atol=0.1)
  # And equal, to float32 precision, to the reference on the rounded logits: a
  # bfloat16 log-softmax would be off by ~1e-2 here.
  rounded = np.asarray(logits_bf16.astype(jnp.float32))
  np.testing.assert_allclose(logp, _np_logprobs(rounded, targets, tau), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, _np_entropy(rounded, tau), rtol=1e-5, atol=1e-5)


def test_from_hidden_bfloat16_outputs_float32():
  _, targets, hidden, unembed, _ = _inputs(seed=5)
  h16 = jnp.asarray(hidden, jnp.bfloat16)
  u16 = jnp.asarray(unembed, jnp.bfloat16)
  logp, ent = L.token_logprobs_from_hidden(h16, u16, targets, chunk_size=CHUNK, with_entropy=True)
  assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
  logits = np.asarray(hidden, np.float64) @ np.asarray(unembed, np.float64)
  np.testing.assert_allclose(logp, _np_logprobs(logits, targets), atol=0.15)
  np.testing.assert_allclose(ent, _np_entropy(logits), atol=0.15)
  # No tighter check against `(h16 @ u16).astype(f32)`: XLA on CPU may keep the
  # bfloat16 matmul's float32 accumulator (xla_allow_excess_precision), so the
  # exact logits seen by the softmax are backend-defined.


# ----------------------------------------------------------------------------
# Chunked vs unchunked.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('chunk_size', [CHUNK, 1, 7, 12])
def test_chunked_equals_unchunked(chunk_size):
  logits, targets, *_ = _inputs(seed=6)
  tau = 0.8
  a = L.token_logprobs_and_entropy(logits, targets, temperature=tau, chunk_size=chunk_size)
  b = L.token_logprobs_and_entropy(logits, targets, temperature=tau, chunk_size=None)
  # Float32 rounding only: XLA may fuse the chunked and whole reductions differently.
  np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-5)

  def loss(z, cs):
    logp, ent = L.token_logprobs_and_entropy(z, targets, temperature=tau, chunk_size=cs)
    # Weights make every position's gradient distinct.
    w = jnp.arange(B * T, dtype=jnp.float32).reshape(B, T)
    return jnp.sum(w * logp) + jnp.sum(jnp.cos(w) * ent)

  ga = jax.grad(loss)(logits, chunk_size)
  gb = jax.grad(loss)(logits, None)
  np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('with_bias', [False, True])
def test_from_hidden_chunked_equals_unchunked(with_bias):
  _, targets, hidden, unembed, bias = _inputs(seed=7)
  bias = bias if with_bias else None
  tau = 1.3

  def loss(h, u, b_, cs):
    logp, ent = L.token_logprobs_from_hidden(
      h, u, targets, temperature=tau, chunk_size=cs, with_entropy=True, bias=b_
    )
    w = jnp.arange(B * T, dtype=jnp.float32).reshape(B, T)
    return jnp.sum(w * logp) + jnp.sum(jnp.sin(w) * ent), (logp, ent)

  argnums = (0, 1, 2) if with_bias else (0, 1)
  grad_fn = jax.grad(loss, argnums=argnums, has_aux=True)
  ga, (logp_a, ent_a) = grad_fn(hidden, unembed, bias, CHUNK)
  gb, (logp_b, ent_b) = grad_fn(hidden, unembed, bias, None)
  np.testing.assert_allclose(logp_a, logp_b, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent_a, ent_b, rtol=1e-5, atol=1e-5)
  for a, b in zip(ga, gb, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# From hidden vs explicit logits.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('with_bias', [False, True])
@pytest.mark.parametrize('chunk_size', [None, CHUNK])
def test_from_hidden_equals_explicit_logits(with_bias, chunk_size):
  _, targets, hidden, unembed, bias = _inputs(seed=8)
  tau = 0.9
  logits = hidden @ unembed + (bias if with_bias else 0.0)
  kw = {'temperature': tau, 'chunk_size': chunk_size}
  logp, ent = L.token_logprobs_from_hidden(
    hidden, unembed, targets, with_entropy=True, bias=bias if with_bias else None, **kw
  )
  np.testing.assert_allclose(logp, L.token_logprobs(logits, targets, **kw), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, L.token_entropy(logits, **kw), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logp, _np_logprobs(logits, targets, tau), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ent, _np_entropy(logits, tau), rtol=1e-5, atol=1e-5)
  # Default: no entropy.
  logp_only, zeros = L.token_logprobs_from_hidden(
    hidden, unembed, targets, bias=bias if with_bias else None, **kw
  )
  np.testing.assert_allclose(logp_only, logp, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(zeros, np.zeros((B, T), np.float32))


def test_from_hidden_gradients_equal_explicit_logits():
  _, targets, hidden, unembed, bias = _inputs(seed=9)

  def via_hidden(h, u, b_):
    logp, ent = L.token_logprobs_from_hidden(
      h, u, targets, chunk_size=CHUNK, with_entropy=True, bias=b_
    )
    return jnp.sum(logp) + 0.5 * jnp.sum(ent)

  def via_logits(h, u, b_):
    logp, ent = L.token_logprobs_and_entropy(h @ u + b_, targets, chunk_size=None)
    return jnp.sum(logp) + 0.5 * jnp.sum(ent)

  ga = jax.grad(via_hidden, argnums=(0, 1, 2))(hidden, unembed, bias)
  gb = jax.grad(via_logits, argnums=(0, 1, 2))(hidden, unembed, bias)
  for a, b in zip(ga, gb, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------
# Numerical gradients.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('chunk_size', [None, CHUNK])
def test_check_grads_logits(chunk_size):
  logits, targets, *_ = _inputs(seed=10, scale=1.0)
  f = lambda z: L.token_logprobs_and_entropy(z, targets, temperature=1.3, chunk_size=chunk_size)
  check_grads(f, (logits,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


def test_check_grads_from_hidden():
  _, targets, hidden, unembed, bias = _inputs(seed=11)
  f = lambda h, u, b_: L.token_logprobs_from_hidden(
    h, u, targets, temperature=0.8, chunk_size=CHUNK, with_entropy=True, bias=b_
  )
  check_grads(
    f, (hidden, 0.3 * unembed, bias), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3
  )


# ----------------------------------------------------------------------------
# jit / no-jit.
# ----------------------------------------------------------------------------


def test_jit_equals_no_jit():
  logits, targets, hidden, unembed, bias = _inputs(seed=12)
  f = lambda z, y: L.token_logprobs_and_entropy(z, y, temperature=0.9, chunk_size=CHUNK)
  for a, b in zip(jax.jit(f)(logits, targets), f(logits, targets), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

  g = lambda h, u, b_, y: L.token_logprobs_from_hidden(
    h, u, y, chunk_size=CHUNK, with_entropy=True, bias=b_
  )
  for a, b in zip(
    jax.jit(g)(hidden, unembed, bias, targets), g(hidden, unembed, bias, targets), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_jit_with_traced_temperature():
  logits, targets, *_ = _inputs(seed=13)
  f = jax.jit(lambda z, y, tau: L.token_logprobs(z, y, temperature=tau, chunk_size=CHUNK))
  np.testing.assert_allclose(
    f(logits, targets, 1.7), _np_logprobs(logits, targets, 1.7), rtol=1e-5, atol=1e-5
  )


# ----------------------------------------------------------------------------
# Memory: the chunked from-hidden path never holds [B·T, V] float32.
# ----------------------------------------------------------------------------
#
# We compile with jax.jit(...).lower(...).compile() and read
# `memory_analysis().temp_size_in_bytes`, XLA's own count of the scratch buffers
# the executable allocates (inputs and outputs excluded). This works on the
# CPU backend with jax 0.10 and is robust to how XLA fuses or names ops,
# unlike scanning HLO text for a [64, 32768] shape. Each test also compiles the
# unchunked path as a control, which must need at least the full B·T·V·4 bytes,
# so the measurement is shown to detect the tensor we want absent.
#
# Sizes: B·T = 128 rows, V = 32768, chunk 8: the full float32 logits are
# 16 MiB and one chunk's are 1 MiB. D is tiny so that the [D, V] unembedding
# gradient (a parameter-sized buffer that is fine to hold) stays small.

MEM_B, MEM_T, MEM_D, MEM_V, MEM_CHUNK = 8, 16, 4, 32768, 8
FULL_BYTES = MEM_B * MEM_T * MEM_V * 4
CHUNK_BYTES = MEM_CHUNK * MEM_V * 4


def _mem_specs():
  return (
    jax.ShapeDtypeStruct((MEM_B, MEM_T, MEM_D), jnp.float32),
    jax.ShapeDtypeStruct((MEM_D, MEM_V), jnp.float32),
    jax.ShapeDtypeStruct((MEM_B, MEM_T), jnp.int32),
  )


def _temp_bytes(fn):
  return jax.jit(fn).lower(*_mem_specs()).compile().memory_analysis().temp_size_in_bytes


def _from_hidden(chunk_size):
  def f(h, u, y):
    return L.token_logprobs_from_hidden(h, u, y, chunk_size=chunk_size, with_entropy=True)

  return f


def _from_hidden_grad(chunk_size):
  def g(h, u, y):
    def loss(h, u):
      logp, ent = _from_hidden(chunk_size)(h, u, y)
      return jnp.sum(logp) + jnp.sum(ent)

    return jax.grad(loss, argnums=(0, 1))(h, u)

  return g


def test_chunked_from_hidden_forward_memory():
  full = _temp_bytes(_from_hidden(None))
  chunked = _temp_bytes(_from_hidden(MEM_CHUNK))
  assert full >= FULL_BYTES, (full, FULL_BYTES)  # the control sees the full logits
  # A few chunks' worth at most: 6 MiB against 16 MiB (measured: ~1 chunk).
  assert chunked <= 6 * CHUNK_BYTES, (chunked, CHUNK_BYTES)
  assert chunked < FULL_BYTES // 2


def test_chunked_from_hidden_gradient_memory():
  full = _temp_bytes(_from_hidden_grad(None))
  chunked = _temp_bytes(_from_hidden_grad(MEM_CHUNK))
  assert full >= FULL_BYTES, (full, FULL_BYTES)
  # The backward pass rematerialises one chunk at a time (measured: ~4 chunks
  # with the entropy, ~2 without), never the 16 chunks of the whole batch.
  assert chunked <= 6 * CHUNK_BYTES, (chunked, CHUNK_BYTES)
  assert chunked < FULL_BYTES // 2


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------


def test_non_integer_targets_raise():
  logits, targets, hidden, unembed, _ = _inputs()
  bad = targets.astype(np.float32)
  with pytest.raises(ValueError, match='`targets`'):
    L.token_logprobs(logits, bad)
  with pytest.raises(ValueError, match='`targets`'):
    L.token_logprobs_and_entropy(logits, bad)
  with pytest.raises(ValueError, match='`targets`'):
    L.token_logprobs_from_hidden(hidden, unembed, bad)


def test_wrong_ranks_raise():
  logits, targets, hidden, unembed, _ = _inputs()
  with pytest.raises(ValueError, match='`logits`'):
    L.token_logprobs(logits[0], targets)
  with pytest.raises(ValueError, match='`logits`'):
    L.token_entropy(logits[0])
  with pytest.raises(ValueError, match='`logits`'):
    L.token_logprobs_and_entropy(logits[None], targets)
  with pytest.raises(ValueError, match='`targets`'):
    L.token_logprobs(logits, targets.reshape(-1))
  with pytest.raises(ValueError, match='`hidden`'):
    L.token_logprobs_from_hidden(hidden[0], unembed, targets)
  with pytest.raises(ValueError, match='`unembed`'):
    L.token_logprobs_from_hidden(hidden, unembed[None], targets)
  with pytest.raises(ValueError, match='`targets`'):
    L.token_logprobs_from_hidden(hidden, unembed, targets[..., None])


def test_targets_shape_mismatch_raises():
  logits, targets, hidden, unembed, _ = _inputs()
  with pytest.raises(ValueError, match='`targets`'):
    L.token_logprobs(logits, targets[:, :-1])
  with pytest.raises(ValueError, match='`targets`'):
    L.token_logprobs_and_entropy(logits, targets[:-1])
  with pytest.raises(ValueError, match='`targets`'):
    L.token_logprobs_from_hidden(hidden, unembed, targets[:, :-1])


@pytest.mark.parametrize('temperature', [0.0, -1.0, 0])
def test_nonpositive_temperature_raises(temperature):
  logits, targets, hidden, unembed, _ = _inputs()
  with pytest.raises(ValueError, match='`temperature`'):
    L.token_logprobs(logits, targets, temperature=temperature)
  with pytest.raises(ValueError, match='`temperature`'):
    L.token_entropy(logits, temperature=temperature)
  with pytest.raises(ValueError, match='`temperature`'):
    L.token_logprobs_from_hidden(hidden, unembed, targets, temperature=temperature)


@pytest.mark.parametrize('chunk_size', [0, -3, 2.5])
def test_bad_chunk_size_raises(chunk_size):
  logits, targets, hidden, unembed, _ = _inputs()
  with pytest.raises(ValueError, match='`chunk_size`'):
    L.token_logprobs(logits, targets, chunk_size=chunk_size)
  with pytest.raises(ValueError, match='`chunk_size`'):
    L.token_entropy(logits, chunk_size=chunk_size)
  with pytest.raises(ValueError, match='`chunk_size`'):
    L.token_logprobs_from_hidden(hidden, unembed, targets, chunk_size=chunk_size)


def test_unembed_d_mismatch_raises():
  _, targets, hidden, unembed, _ = _inputs()
  with pytest.raises(ValueError, match='`unembed`'):
    L.token_logprobs_from_hidden(hidden, unembed[:-1], targets)
  with pytest.raises(ValueError, match='`unembed`'):
    L.token_logprobs_from_hidden(hidden, unembed.T, targets)


def test_bias_shape_raises():
  _, targets, hidden, unembed, bias = _inputs()
  with pytest.raises(ValueError, match='`bias`'):
    L.token_logprobs_from_hidden(hidden, unembed, targets, bias=bias[:-1])
  with pytest.raises(ValueError, match='`bias`'):
    L.token_logprobs_from_hidden(hidden, unembed, targets, bias=bias[None])
