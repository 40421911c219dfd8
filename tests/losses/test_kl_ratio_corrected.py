"""Tests for the ratio-corrected k3 KL estimator (`kl_penalty(estimator='k3_ratio_corrected')`).

The gradient claims of `jrl.losses.kl` are checked exactly, by enumerating a
small categorical distribution (each "token" of a [1, V] batch is one
outcome y, weighted by its probability under the sampling policy):

* with y ~ π_old, E[∇(ρ·k3)] = ∇ KL(π ‖ π_ref) for π_old ≠ π and π_old = π,
  and E[ρ·k3] = KL(π ‖ π_ref);
* with y ~ π_old = π, E[∇ k3] = ∇ KL(π_ref ‖ π), which differs from
  ∇ KL(π ‖ π_ref); with π_old ≠ π it is neither.

Plus the usual four ways: hand-computed values, a float64 reference with its
analytic gradient, check_grads, jit vs no-jit and masking.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jrl.losses as L

EST = 'k3_ratio_corrected'


def _f32(*xs):
  return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _right_padded_mask(lengths, t):
  return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


# ----------------------------------------------------------------------------
# Hand-computed.
# ----------------------------------------------------------------------------


def test_hand_computed_values_and_gradients():
  # x = logp − ref, log ρ = logp − old on four valid tokens (+ masked padding).
  #  0: x = 0.5, log ρ = 0:    k3 = e^−0.5 − 0.5 = 0.1065307; ρ = 1 -> 0.1065307;
  #     gradient ρ·x = 0.5 (plain k3: 1 − e^−0.5 = 0.3934693).
  #  1: x = 1,   log ρ = 0.2:  k3 = e^−1 = 0.3678794; ρ = 1.2214028 -> 0.4493290;
  #     gradient ρ·x = 1.2214028.
  #  2: x = −1,  log ρ = −0.5: k3 = e − 2 = 0.7182818; ρ = 0.6065307 -> 0.4356600;
  #     gradient ρ·x = −0.6065307.
  #  3: x = 0,   log ρ = 1:    k3 = 0, value 0, gradient ρ·0 = 0.
  x = np.array([[0.5, 1.0, -1.0, 0.0, 9.0, 9.0]])
  log_rho = np.array([[0.0, 0.2, -0.5, 1.0, -9.0, 9.0]])
  ref = np.full_like(x, -2.0)
  logp = ref + x
  old = logp - log_rho
  old[0, 5] = -np.inf  # padding may hold anything
  mask = np.array([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
  logp, ref, old, mask = _f32(logp, ref, old, mask)

  def total(lp, estimator):
    kl = L.kl_penalty(lp, ref, estimator=estimator, mask=mask, old_logp=old)
    return jnp.sum(kl), kl

  (_, kl), grad = jax.value_and_grad(total, has_aux=True)(logp, EST)
  np.testing.assert_allclose(kl[0], [0.1065307, 0.4493290, 0.4356600, 0.0, 0.0, 0.0], rtol=1e-5)
  np.testing.assert_allclose(grad[0], [0.5, 1.2214028, -0.6065307, 0.0, 0.0, 0.0], rtol=1e-5)
  # At ρ = 1 (token 0) the values of k3 and ρ·k3 agree but the gradients do not.
  (_, kl3), grad3 = jax.value_and_grad(total, has_aux=True)(logp, 'k3')
  assert float(kl3[0, 0]) == pytest.approx(float(kl[0, 0]), rel=1e-6)
  assert float(grad3[0, 0]) == pytest.approx(1.0 - math.exp(-0.5), rel=1e-6)


def test_old_logp_is_a_constant():
  rng = np.random.default_rng(0)
  logp, ref, old = _f32(*rng.normal(-2.0, 0.5, (3, 4, 8)))
  g_old = jax.grad(lambda o: jnp.sum(L.kl_penalty(logp, ref, estimator=EST, old_logp=o)))(old)
  assert np.all(np.asarray(g_old) == 0.0)


# ----------------------------------------------------------------------------
# Exact expectations over a categorical distribution.
# ----------------------------------------------------------------------------

V = 7


def _logits(seed):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(0.0, 1.0, V), jnp.float32) for _ in range(3))


def _log_softmax(z):
  # float32 before log-softmax, as everywhere in jrl.
  return jax.nn.log_softmax(jnp.asarray(z, jnp.float32))


def _expected(theta, ref_logits, old_logits, estimator):
  """E_{y ~ π_old}[estimate(y)] by enumeration; differentiable in θ."""
  logp_1xV = _log_softmax(theta)[None, :]
  ref_1xV = _log_softmax(ref_logits)[None, :]
  old_1xV = _log_softmax(old_logits)[None, :]
  kl_1xV = L.kl_penalty(logp_1xV, ref_1xV, estimator=estimator, old_logp=old_1xV)
  p_old = jax.lax.stop_gradient(jnp.exp(old_1xV))
  return jnp.sum(p_old * kl_1xV)


def _kl(p_logits, q_logits):
  """Exact KL(p ‖ q) of two categoricals."""
  logp, logq = _log_softmax(p_logits), _log_softmax(q_logits)
  return jnp.sum(jnp.exp(logp) * (logp - logq))


@pytest.mark.parametrize('seed', range(3))
def test_corrected_gradient_is_unbiased_off_policy(seed):
  theta, ref, old = _logits(seed)
  forward_kl = lambda th: _kl(th, ref)  # KL(π ‖ π_ref)
  value, grad = jax.value_and_grad(_expected)(theta, ref, old, EST)
  np.testing.assert_allclose(value, forward_kl(theta), rtol=1e-5)
  np.testing.assert_allclose(grad, jax.grad(forward_kl)(theta), rtol=1e-4, atol=1e-6)
  # Plain k3 from the same off-policy samples: neither the forward nor the
  # reverse KL's gradient.
  g3 = jax.grad(_expected)(theta, ref, old, 'k3')
  reverse = jax.grad(lambda th: _kl(ref, th))(theta)
  assert np.max(np.abs(np.asarray(g3 - jax.grad(forward_kl)(theta)))) > 1e-2
  assert np.max(np.abs(np.asarray(g3 - reverse))) > 1e-2


@pytest.mark.parametrize('seed', range(3))
def test_on_policy_k3_follows_the_reverse_kl_and_corrected_the_forward(seed):
  theta, ref, _ = _logits(seed)
  # π_old = π in value (the first update on a rollout batch).
  old = jax.lax.stop_gradient(theta)
  forward = jax.grad(lambda th: _kl(th, ref))(theta)  # ∇ KL(π ‖ π_ref)
  reverse = jax.grad(lambda th: _kl(ref, th))(theta)  # ∇ KL(π_ref ‖ π)
  g_corrected = jax.grad(_expected)(theta, ref, old, EST)
  g_k3 = jax.grad(_expected)(theta, ref, old, 'k3')
  np.testing.assert_allclose(g_corrected, forward, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(g_k3, reverse, rtol=1e-4, atol=1e-6)
  assert np.max(np.abs(np.asarray(forward - reverse))) > 1e-2
  # The values agree (ρ = 1): both estimate KL(π ‖ π_ref) without bias.
  np.testing.assert_allclose(
    _expected(theta, ref, old, 'k3'), _expected(theta, ref, old, EST), rtol=1e-6
  )


# ----------------------------------------------------------------------------
# Reference, gradients, jit, masks.
# ----------------------------------------------------------------------------


def _random_inputs(seed, b=8, t=16):
  rng = np.random.default_rng(seed)
  ref = rng.normal(-2.0, 1.0, (b, t))
  logp = ref + rng.normal(0.0, 1.0, (b, t))
  old = logp + rng.normal(0.0, 0.3, (b, t))
  mask = _right_padded_mask(rng.integers(0, t + 1, size=b), t)
  return _f32(logp, ref, old, mask)


def _np_corrected(logp, ref, old, mask):
  """Float64: (value, d value / d logp) = (ρ·k3, ρ·x), times the mask."""
  logp, ref, old, mask = (np.asarray(a, np.float64) for a in (logp, ref, old, mask))
  x = logp - ref
  rho = np.exp(logp - old)
  return rho * (np.exp(-x) - 1.0 + x) * mask, rho * x * mask


def test_matches_numpy_reference_and_analytic_gradient():
  logp, ref, old, mask = _random_inputs(1)
  f = lambda lp: jnp.sum(L.kl_penalty(lp, ref, estimator=EST, mask=mask, old_logp=old))
  want, want_grad = _np_corrected(logp, ref, old, mask)
  got = L.kl_penalty(logp, ref, estimator=EST, mask=mask, old_logp=old)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jax.grad(f)(logp), want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('input_clamp, output_clamp', [(None, None), (0.8, None), (None, 0.3)])
def test_check_grads(input_clamp, output_clamp):
  logp, ref, old, mask = _random_inputs(2)
  kw = dict(estimator=EST, mask=mask, old_logp=old)
  kw.update(input_clamp=input_clamp, output_clamp=output_clamp)
  f = lambda lp: L.kl_penalty(lp, ref, **kw)
  check_grads(f, (logp,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


def test_clamps_apply_to_x_and_to_the_product():
  # x = 3, log ρ = 1: input clamp 1 -> k3(1) = e^−1 = 0.3678794, times e = 1.0;
  # output clamp 0.5 -> min(e · k3(3), 0.5) = 0.5 (e · 2.0497871 = 5.5718).
  logp, ref, old = _f32([[1.0]], [[-2.0]], [[0.0]])
  kl = L.kl_penalty(logp, ref, estimator=EST, old_logp=old, input_clamp=1.0)
  np.testing.assert_allclose(kl[0, 0], 1.0, rtol=1e-6)
  kl = L.kl_penalty(logp, ref, estimator=EST, old_logp=old, output_clamp=0.5)
  np.testing.assert_allclose(kl[0, 0], 0.5, rtol=1e-6)


def test_jit_matches_no_jit_and_mask():
  logp, ref, old, mask = _random_inputs(3)
  f = functools.partial(L.kl_penalty, estimator=EST)
  eager = f(logp, ref, mask=mask, old_logp=old)
  np.testing.assert_allclose(eager, jax.jit(f)(logp, ref, mask=mask, old_logp=old), rtol=1e-6)
  pad = np.asarray(mask) == 0
  assert pad.any()
  # Garbage old_logp on the padding (−inf, +1000) reaches neither value nor gradient.
  old_bad = jnp.where(mask > 0, old, jnp.where(jnp.arange(16) % 2 == 0, -jnp.inf, 1000.0))
  g = jax.grad(lambda lp: jnp.sum(f(lp, ref, mask=mask, old_logp=old_bad)))(logp)
  kl = f(logp, ref, mask=mask, old_logp=old_bad)
  assert np.all(np.asarray(kl)[pad] == 0.0) and np.all(np.asarray(g)[pad] == 0.0)
  np.testing.assert_array_equal(np.asarray(kl)[~pad], np.asarray(eager)[~pad])
  assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize(
  'kw, pattern',
  [
    ({}, "`old_logp` is required for estimator='k3_ratio_corrected'"),
    (dict(old_logp=np.zeros((2, 4), np.float32)), '`old_logp` must have the same shape as `logp`'),
  ],
)
def test_bad_input(kw, pattern):
  x = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match=pattern):
    L.kl_penalty(x, x, estimator=EST, **kw)


def test_estimator_is_listed():
  assert EST in L.KL_ESTIMATORS
