"""Tests for jrl.losses.kl (KL estimators, KL controllers) and jrl.losses.value.

Each kernel is tested four ways (STYLE.md point 14): hand-computed values,
an independent float64 NumPy reference, gradient checks, and jit vs no-jit.
Arrays stick to a few shapes ([1, 8] hand-computed rows, [8, 16] random
batches) so the eagerly compiled ops are reused.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jrl.losses as L

ESTIMATORS = ('k1', 'abs', 'k2', 'k3')


def _f32(*xs):
  return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _row(values, n=8):
  """Pads a list to a [1, n] float64 row."""
  out = np.zeros((1, n))
  out[0, : len(values)] = values
  return out


def _right_padded_mask(lengths, t):
  return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _away_from(x, boundaries, margin):
  """Pushes entries within `margin` of any boundary to 2·margin away from it."""
  x = np.array(x, np.float64)
  for b in boundaries:
    near = np.abs(x - b) < margin
    x = np.where(near, b + np.where(x >= b, 2.0 * margin, -2.0 * margin), x)
  return x


def _tree_allclose(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, **tol)


# ----------------------------------------------------------------------------
# kl_penalty.
# ----------------------------------------------------------------------------

# x = logp - ref_logp on six valid tokens; two masked tokens hold x = 7.
HAND_X = [0.0, 1.0, -1.0, 2.0, 0.5, -3.0]
HAND_KL = {
  'k1': HAND_X,
  'abs': [0.0, 1.0, 1.0, 2.0, 0.5, 3.0],
  # x²/2
  'k2': [0.0, 0.5, 0.5, 2.0, 0.125, 4.5],
  # e^-x - 1 + x: 1 - 1 + 0 = 0; e^-1 = 0.367879; e - 2 = 0.718282;
  # e^-2 + 1 = 1.135335; e^-0.5 - 0.5 = 0.106531; e^3 - 4 = 16.085537.
  'k3': [0.0, 0.3678794, 0.7182818, 1.1353353, 0.1065307, 16.0855369],
}


def _hand_inputs():
  ref = np.full((1, 8), -1.5)
  x = _row([*HAND_X, 7.0, 7.0])
  mask = _row([1.0] * 6)
  return _f32(ref + x, ref, mask)


@pytest.mark.parametrize('estimator', ESTIMATORS)
def test_kl_penalty_hand_computed(estimator):
  logp, ref, mask = _hand_inputs()
  kl = L.kl_penalty(logp, ref, estimator=estimator, mask=mask)
  np.testing.assert_allclose(kl[0], HAND_KL[estimator] + [0.0, 0.0], rtol=1e-5, atol=1e-6)
  # Without a mask every position is returned: k1 of the padding is 7.
  kl = L.kl_penalty(logp, ref, estimator=estimator)
  assert float(kl[0, 7]) != 0.0


@pytest.mark.parametrize(
  'estimator, input_clamp, output_clamp, want',
  [
    # x clamped to [-1, 1]: [0, 1, -1, 1, 0.5, -1].
    ('k1', 1.0, None, [0.0, 1.0, -1.0, 1.0, 0.5, -1.0]),
    ('k3', 1.0, None, [0.0, 0.3678794, 0.7182818, 0.3678794, 0.1065307, 0.7182818]),
    # value clamped to [-c, c], symmetric: k1 with c = 0.5.
    ('k1', None, 0.5, [0.0, 0.5, -0.5, 0.5, 0.5, -0.5]),
    # k3 with c = 2: only e^3 - 4 = 16.09 is cut.
    ('k3', None, 2.0, [0.0, 0.3678794, 0.7182818, 1.1353353, 0.1065307, 2.0]),
    # k2 with both: x -> [0, 1, -1, 1, 0.5, -1], x²/2 -> [0, .5, .5, .5, .125, .5], then ≤ 0.4.
    ('k2', 1.0, 0.4, [0.0, 0.4, 0.4, 0.4, 0.125, 0.4]),
  ],
)
def test_kl_penalty_clamps_hand_computed(estimator, input_clamp, output_clamp, want):
  logp, ref, mask = _hand_inputs()
  kl = L.kl_penalty(
    logp, ref, estimator=estimator, input_clamp=input_clamp, output_clamp=output_clamp, mask=mask
  )
  np.testing.assert_allclose(kl[0, :6], want, rtol=1e-5, atol=1e-6)


def test_k3_extreme_log_ratios_with_verl_clamps():
  # x = -50: e^50 - 1 - 50 = 5.184706e21 unclamped (finite in float32). With
  # veRL's clamps, x -> -20 (e^20 - 21 = 4.85e8), then the value -> 10.
  # x = +50: 49 + e^-50 -> 10; x = ±1000: the input clamp keeps exp finite.
  ref = np.full((1, 8), -1.0)
  x = _row([-50.0, 50.0, -1000.0, 1000.0, -20.5, 0.0])
  logp, ref = _f32(ref + x, ref)
  raw = L.kl_penalty(logp, ref, estimator='k3')
  np.testing.assert_allclose(raw[0, 0], math.exp(50.0) - 51.0, rtol=1e-5)
  np.testing.assert_allclose(raw[0, 1], 49.0, rtol=1e-6)
  assert float(raw[0, 2]) == np.inf  # e^1000 overflows without an input clamp

  clamp = dict(estimator='k3', input_clamp=20.0, output_clamp=10.0)
  kl = L.kl_penalty(logp, ref, **clamp)
  np.testing.assert_allclose(kl[0, :6], [10.0, 10.0, 10.0, 10.0, 10.0, 0.0], rtol=1e-6)
  grad = jax.grad(lambda lp: jnp.sum(L.kl_penalty(lp, ref, **clamp)))(logp)
  assert np.all(np.isfinite(grad))
  # Clamped positions are constant: no gradient (x = 0 has gradient 1 - e^0 = 0 too).
  assert np.all(np.asarray(grad) == 0.0)
  # Input clamp alone: x = -1000 -> -20, e^20 - 21 = 4.851652e8, gradient 0 (clamped).
  kl = L.kl_penalty(logp, ref, estimator='k3', input_clamp=20.0)
  np.testing.assert_allclose(kl[0, 2], math.exp(20.0) - 21.0, rtol=1e-5)


def _np_kl(logp, ref, estimator, input_clamp=None, output_clamp=None, mask=None):
  """Float64 reference: (kl, expected d(sum kl)/d logp)."""
  x = np.asarray(logp, np.float64) - np.asarray(ref, np.float64)
  dx = np.ones_like(x)
  if input_clamp is not None:
    dx = (np.abs(x) <= input_clamp).astype(np.float64)
    x = np.clip(x, -input_clamp, input_clamp)
  value, dvalue = {
    'k1': (x, np.ones_like(x)),
    'abs': (np.abs(x), np.sign(x)),
    'k2': (0.5 * x**2, x),
    'k3': (np.exp(-x) - 1.0 + x, 1.0 - np.exp(-x)),
  }[estimator]
  if output_clamp is not None:
    dvalue = dvalue * (np.abs(value) <= output_clamp)
    value = np.clip(value, -output_clamp, output_clamp)
  m = np.ones_like(x) if mask is None else np.asarray(mask, np.float64)
  return value * m, dvalue * dx * m


def _random_kl_inputs(seed, boundaries=(), scale=1.5):
  rng = np.random.default_rng(seed)
  ref = rng.normal(-2.0, 1.0, (8, 16))
  x = _away_from(rng.normal(0.0, scale, (8, 16)), boundaries, 0.05)
  mask = _right_padded_mask(rng.integers(0, 17, size=8), 16)
  return _f32(ref + x, ref, mask)


def _kl_boundaries(estimator, input_clamp, output_clamp):
  """Kinks of the estimator as a function of x (abs at 0, clamps)."""
  out = [0.0] if estimator == 'abs' else []
  if input_clamp is not None:
    out += [-input_clamp, input_clamp]
  if output_clamp is not None:
    # Values of x where |estimate| = output_clamp.
    c = output_clamp
    out += {
      'k1': [-c, c],
      'abs': [-c, c],
      'k2': [-math.sqrt(2 * c), math.sqrt(2 * c)],
      'k3': [_k3_inverse(c, -1), _k3_inverse(c, 1)],
    }[estimator]
  return out


def _k3_inverse(c, sign):
  """The x with sign `sign` where e^-x - 1 + x = c (bisection)."""
  lo, hi = (0.0, 50.0) if sign > 0 else (-50.0, 0.0)
  f = lambda x: math.exp(-x) - 1.0 + x - c
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if (f(mid) > 0) == (sign > 0):
      hi = mid
    else:
      lo = mid
  return 0.5 * (lo + hi)


KL_CLAMPS = [(None, None), (2.0, None), (None, 1.0), (1.5, 0.8)]


@pytest.mark.parametrize('input_clamp, output_clamp', KL_CLAMPS)
@pytest.mark.parametrize('estimator', ESTIMATORS)
def test_kl_penalty_matches_numpy_reference_and_gradient(estimator, input_clamp, output_clamp):
  logp, ref, mask = _random_kl_inputs(0, _kl_boundaries(estimator, input_clamp, output_clamp))
  kw = dict(estimator=estimator, input_clamp=input_clamp, output_clamp=output_clamp, mask=mask)
  kl, grad = jax.value_and_grad(lambda lp: jnp.sum(L.kl_penalty(lp, ref, **kw)))(logp)
  want, want_grad = _np_kl(logp, ref, **kw)
  np.testing.assert_allclose(L.kl_penalty(logp, ref, **kw), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(kl, want.sum(), rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('input_clamp, output_clamp', KL_CLAMPS)
@pytest.mark.parametrize('estimator', ESTIMATORS)
def test_kl_penalty_check_grads(estimator, input_clamp, output_clamp):
  logp, ref, mask = _random_kl_inputs(1, _kl_boundaries(estimator, input_clamp, output_clamp))
  kw = dict(estimator=estimator, input_clamp=input_clamp, output_clamp=output_clamp, mask=mask)
  f = lambda lp: L.kl_penalty(lp, ref, **kw)
  check_grads(f, (logp,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


def test_k3_zero_when_policies_agree_and_zero_gradient_there():
  rng = np.random.default_rng(2)
  (logp,) = _f32(rng.normal(-2.0, 2.0, (8, 16)))
  kl, grad = jax.value_and_grad(lambda lp: jnp.sum(L.kl_penalty(lp, logp, estimator='k3')))(logp)
  assert float(kl) == 0.0
  # d/dx (e^-x - 1 + x) = 1 - e^-x = 0 at x = 0.
  assert np.all(np.asarray(grad) == 0.0)
  assert np.all(np.asarray(L.kl_penalty(logp, logp, estimator='k3')) == 0.0)


@pytest.mark.parametrize('scale', [1e-6, 1e-3, 1.0, 10.0])
def test_k3_is_never_negative(scale):
  # Documented: k3 ≥ 0 (e^-x ≥ 1 - x). Checked on log-ratios of many
  # magnitudes, including the tiny ones of a policy next to its reference.
  rng = np.random.default_rng(3)
  ref = rng.normal(-2.0, 1.0, (8, 16))
  logp, ref = _f32(ref + rng.normal(0.0, scale, (8, 16)), ref)
  kl = np.asarray(L.kl_penalty(logp, ref, estimator='k3'))
  assert kl.min() >= 0.0, f'{(kl < 0).sum()} negative k3 values, min {kl.min():.3g}'


@pytest.mark.parametrize('estimator', ESTIMATORS)
def test_kl_penalty_jit_matches_no_jit(estimator):
  logp, ref, mask = _random_kl_inputs(4)
  kw = dict(estimator=estimator, input_clamp=2.0, output_clamp=1.0)
  f = functools.partial(L.kl_penalty, **kw)
  np.testing.assert_allclose(f(logp, ref, mask=mask), jax.jit(f)(logp, ref, mask=mask), rtol=1e-6)


@pytest.mark.parametrize('estimator', ESTIMATORS)
def test_kl_penalty_mask(estimator):
  logp, ref, mask = _random_kl_inputs(5)
  pad = np.asarray(mask) == 0
  assert pad.any()
  grad = jax.grad(lambda lp: jnp.sum(L.kl_penalty(lp, ref, estimator=estimator, mask=mask)))(logp)
  kl = L.kl_penalty(logp, ref, estimator=estimator, mask=mask)
  unmasked = L.kl_penalty(logp, ref, estimator=estimator)
  assert np.all(np.asarray(kl)[pad] == 0.0)
  assert np.all(np.asarray(grad)[pad] == 0.0)
  np.testing.assert_array_equal(np.asarray(kl)[~pad], np.asarray(unmasked)[~pad])
  ones = L.kl_penalty(logp, ref, estimator=estimator, mask=jnp.ones_like(mask))
  np.testing.assert_array_equal(ones, unmasked)


_BT = np.zeros((2, 3), np.float32)
_BAD_SHAPE = np.zeros((2, 4), np.float32)


@pytest.mark.parametrize(
  'kw, pattern',
  [
    (dict(estimator='k4'), '`estimator` must be one of'),
    (dict(estimator='low_var_kl'), '`estimator` must be one of'),
    (dict(ref_logp=_BAD_SHAPE), '`ref_logp` must have the same shape as `logp`'),
    (dict(mask=_BAD_SHAPE), '`mask` must have the same shape as `logp`'),
    (dict(ref_logp=_BT[0]), '`ref_logp` must have the same shape as `logp`'),
    (dict(logp=_BT[0], ref_logp=_BT[0]), r'`logp` must have shape \[B, T\]'),
    (dict(input_clamp=0.0), '`input_clamp` must be > 0'),
    (dict(output_clamp=-1.0), '`output_clamp` must be > 0'),
  ],
)
def test_kl_penalty_bad_input(kw, pattern):
  args = dict(logp=_BT, ref_logp=_BT)
  args.update(kw)
  with pytest.raises(ValueError, match=pattern):
    L.kl_penalty(**args)


# ----------------------------------------------------------------------------
# KL controllers.
# ----------------------------------------------------------------------------


def test_fixed_kl_controller_keeps_coef():
  ctrl = L.fixed_kl_controller(0.05)
  state = ctrl.init()
  assert isinstance(state, L.KLControllerState)
  assert state.coef.dtype == jnp.float32 and state.coef.shape == ()
  np.testing.assert_allclose(state.coef, 0.05, rtol=1e-7)
  for kl in (0.0, 3.0, 100.0):
    state = ctrl.update(state, jnp.float32(kl), 256)
    np.testing.assert_allclose(state.coef, 0.05, rtol=1e-7)
  assert float(L.fixed_kl_controller(0.0).init().coef) == 0.0  # β = 0 is allowed


@pytest.mark.parametrize(
  'kl, want',
  [
    # β₀ = 0.1, target 6, horizon 10000, n_steps 256.
    # KL 9: e = 9/6 - 1 = 0.5 -> clipped to 0.2; β = 0.1·(1 + 0.2·256/10000) = 0.100512.
    (9.0, 0.100512),
    # KL 3: e = -0.5 -> -0.2; β = 0.1·(1 - 0.00512) = 0.099488.
    (3.0, 0.099488),
    # KL 6.6: e = 0.1 (inside the clip); β = 0.1·(1 + 0.1·0.0256) = 0.100256.
    (6.6, 0.100256),
    # KL 5.4: e = -0.1; β = 0.1·(1 - 0.00256) = 0.099744.
    (5.4, 0.099744),
    # KL on target: e = 0, β unchanged.
    (6.0, 0.1),
    # KL 0: e = -1 -> -0.2, as KL 3.
    (0.0, 0.099488),
  ],
)
def test_adaptive_kl_controller_ziegler_update(kl, want):
  ctrl = L.adaptive_kl_controller(0.1, target=6.0, horizon=10000)
  state = ctrl.init()
  assert isinstance(state, L.KLControllerState)
  np.testing.assert_allclose(state.coef, 0.1, rtol=1e-7)
  new = ctrl.update(state, jnp.float32(kl), 256)
  assert isinstance(new, L.KLControllerState)
  assert new.coef.dtype == jnp.float32
  np.testing.assert_allclose(new.coef, want, rtol=1e-6)
  # The state is a pytree: update jits, with KL and n_steps traced.
  jitted = jax.jit(ctrl.update)(state, jnp.float32(kl), jnp.int32(256))
  np.testing.assert_allclose(jitted.coef, want, rtol=1e-6)


def test_adaptive_kl_controller_max_error_and_compounding():
  # max_error 0.05: KL 6.6 -> e = 0.1 -> 0.05; β = 0.1·(1 + 0.05·512/10000) = 0.100256.
  ctrl = L.adaptive_kl_controller(0.1, target=6.0, horizon=10000, max_error=0.05)
  np.testing.assert_allclose(ctrl.update(ctrl.init(), 6.6, 512).coef, 0.100256, rtol=1e-6)
  # Several steps under lax.scan compound: β_k = β_{k-1}·(1 + e_k·n/horizon).
  ctrl = L.adaptive_kl_controller(0.2, target=1.0, horizon=100)
  kls = jnp.array([3.0, 1.1, 0.5, 0.95, 1.0], jnp.float32)

  def step(state, kl):
    state = ctrl.update(state, kl, 10)
    return state, state.coef

  final, coefs = jax.lax.scan(step, ctrl.init(), kls)
  want, beta = [], 0.2
  for kl in [3.0, 1.1, 0.5, 0.95, 1.0]:
    beta *= 1.0 + min(max(kl / 1.0 - 1.0, -0.2), 0.2) * 10 / 100
    want.append(beta)
  # 0.2·1.02 = 0.204; ·1.01 = 0.20604; ·0.98 = 0.2019192; ·0.995 = 0.2009096; ·1.
  np.testing.assert_allclose(want[:2], [0.204, 0.20604], rtol=1e-12)
  np.testing.assert_allclose(coefs, want, rtol=1e-6)
  np.testing.assert_allclose(final.coef, want[-1], rtol=1e-6)


@pytest.mark.parametrize(
  'make, pattern',
  [
    (lambda: L.fixed_kl_controller(-0.1), '`coef` must be >= 0'),
    (lambda: L.adaptive_kl_controller(-0.1, 6.0, 10000), '`init_coef` must be >= 0'),
    (lambda: L.adaptive_kl_controller(0.1, 0.0, 10000), '`target` must be > 0'),
    (lambda: L.adaptive_kl_controller(0.1, -1.0, 10000), '`target` must be > 0'),
    (lambda: L.adaptive_kl_controller(0.1, 6.0, 0), '`horizon` must be > 0'),
    (lambda: L.adaptive_kl_controller(0.1, 6.0, -5), '`horizon` must be > 0'),
    (lambda: L.adaptive_kl_controller(0.1, 6.0, 100, max_error=0.0), '`max_error` must be > 0'),
  ],
)
def test_kl_controller_bad_arguments(make, pattern):
  with pytest.raises(ValueError, match=pattern):
    make()


# ----------------------------------------------------------------------------
# value_loss.
# ----------------------------------------------------------------------------


def _value_hand_inputs():
  # Token (V_old, R, V) with ε_v = 0.5; V_clip = V_old + clip(V - V_old, ±0.5):
  #  0 (0, 1,  0.3):  inside, V_clip = V: ½·0.7² = 0.245; grad V - R = -0.7
  #  1 (0, 1,  2.0):  V_clip = 0.5: max(1², 0.5²) = 1 -> 0.5; unclipped wins, grad 1
  #  2 (0, 1, -1.0):  V_clip = -0.5: max(2², 1.5²) = 4 -> 2; grad -2
  #  3 (0, 3,  2.0):  V_clip = 0.5: max(1², 2.5²) = 6.25 -> 3.125; clipped wins, grad 0
  #  4 (0, -2, -1.5): V_clip = -0.5: max(0.5², 1.5²) = 2.25 -> 1.125; clipped wins, grad 0
  #  5 (1, 1.2, 1.3): inside: ½·0.1² = 0.005; grad 0.1
  #  6, 7: masked.
  old = _row([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 5.0, 5.0])
  ret = _row([1.0, 1.0, 1.0, 3.0, -2.0, 1.2, -9.0, 9.0])
  v = _row([0.3, 2.0, -1.0, 2.0, -1.5, 1.3, 0.0, 0.0])
  return _f32(v, old, ret, _row([1.0] * 6))


def _value_and_grads(values, old_values, returns, mask, **kw):
  def total(v, o, r):
    loss, metrics = L.value_loss(v, o, r, mask, **kw)
    return jnp.sum(loss), (loss, metrics)

  grads, (loss, metrics) = jax.grad(total, argnums=(0, 1, 2), has_aux=True)(
    values, old_values, returns
  )
  return loss, metrics, grads


def test_value_loss_hand_computed_clipped():
  v, old, ret, mask = _value_hand_inputs()
  loss, metrics, (grad, g_old, g_ret) = _value_and_grads(v, old, ret, mask, clip_eps=0.5)
  np.testing.assert_allclose(loss[0], [0.245, 0.5, 2.0, 3.125, 1.125, 0.005, 0, 0], rtol=1e-5)
  np.testing.assert_allclose(grad[0], [-0.7, 1.0, -2.0, 0.0, 0.0, 0.1, 0, 0], rtol=1e-5, atol=1e-7)
  # Tokens 3 and 4 of six; vpred_mean = (0.3 + 2 - 1 + 2 - 1.5 + 1.3)/6 = 3.1/6.
  np.testing.assert_allclose(metrics['vf_clipfrac'], 2 / 6, rtol=1e-6)
  np.testing.assert_allclose(metrics['vpred_mean'], 3.1 / 6, rtol=1e-6)
  # old_values and returns are constants.
  assert np.all(np.asarray(g_old) == 0.0) and np.all(np.asarray(g_ret) == 0.0)


def test_value_loss_hand_computed_unclipped():
  # clip_eps=None: ½(V - R)² = [0.245, 0.5, 2, 0.5, 0.125, 0.005]; grad V - R.
  v, old, ret, mask = _value_hand_inputs()
  loss, metrics, (grad, _, _) = _value_and_grads(v, old, ret, mask, clip_eps=None)
  np.testing.assert_allclose(loss[0], [0.245, 0.5, 2.0, 0.5, 0.125, 0.005, 0, 0], rtol=1e-5)
  np.testing.assert_allclose(grad[0], [-0.7, 1.0, -2.0, -1.0, 0.5, 0.1, 0, 0], rtol=1e-5, atol=1e-7)
  assert float(metrics['vf_clipfrac']) == 0.0


def test_value_clipfrac_ignores_rounding_inside_the_clip_range():
  # V_old = 0.1, V = 0.02, R = 0, ε_v = 0.5: |V − V_old| = 0.08, far inside the
  # range, so nothing is clipped. In float32 V_old + (V − V_old) is
  # 0.020000003, not V = 0.02, and its squared error is the larger: a
  # "clipped term larger" count alone reports 1/1 here.
  v, old, ret, mask = _f32(_row([0.02]), _row([0.1]), _row([0.0]), _row([1.0]))
  f32 = np.float32
  assert f32(0.1) + (f32(0.02) - f32(0.1)) != f32(0.02)  # the rounding the case relies on
  loss, metrics, (grad, _, _) = _value_and_grads(v, old, ret, mask, clip_eps=0.5)
  assert float(metrics['vf_clipfrac']) == 0.0
  # The loss and gradient are the unclipped ones up to that rounding: ½·0.02², 0.02.
  np.testing.assert_allclose(loss[0, 0], 0.5 * 0.02**2, rtol=1e-6)
  np.testing.assert_allclose(grad[0, 0], 0.02, rtol=1e-6)
  # Clipped tokens are still counted: V = 0.8 (|V − V_old| = 0.7 > 0.5), R = 1.
  v, ret = _f32(_row([0.8]), _row([1.0]))
  _, metrics, _ = _value_and_grads(v, old, ret, mask, clip_eps=0.5)
  assert float(metrics['vf_clipfrac']) == 1.0


def _np_value_loss(values, old_values, returns, mask, clip_eps):
  """Float64 reference: (loss, vf_clipfrac, vpred_mean, expected d(sum loss)/dV)."""
  v, old, ret, m = (np.asarray(x, np.float64) for x in (values, old_values, returns, mask))
  unclipped = (v - ret) ** 2
  grad = v - ret
  clipped_more = np.zeros_like(v, bool)
  if clip_eps is not None:
    v_clip = old + np.clip(v - old, -clip_eps, clip_eps)
    clipped = (v_clip - ret) ** 2
    # Counted only where the clip is active (|V − V_old| > ε_v) and it sets the loss.
    clipped_more = (np.abs(v - old) > clip_eps) & (clipped > unclipped)
    # The clipped branch is active and V is beyond the clip range: constant.
    grad = np.where(clipped_more, 0.0, grad)
    unclipped = np.maximum(unclipped, clipped)
  count = max(m.sum(), 1.0)
  return 0.5 * unclipped * m, (clipped_more * m).sum() / count, (v * m).sum() / count, grad * m


def _random_value_inputs(seed, clip_eps):
  # Values are multiples of 2^-10, so V - V_old and V_old + (V - V_old) are
  # exact in float32: inside the clip range V_clip is exactly V and the
  # "clipped term larger" indicator is not decided by rounding.
  rng = np.random.default_rng(seed)
  q = lambda x: np.round(x * 1024.0) / 1024.0
  old = q(rng.normal(0.0, 1.0, (8, 16)))
  delta = rng.normal(0.0, 0.8, (8, 16))
  if clip_eps is not None:
    delta = _away_from(delta, [-clip_eps, clip_eps], 0.02)
  ret = q(old + rng.normal(0.0, 1.0, (8, 16)))
  mask = _right_padded_mask(rng.integers(0, 17, size=8), 16)
  return _f32(old + q(delta), old, ret, mask)


@pytest.mark.parametrize('clip_eps', [0.5, 0.2, None])
def test_value_loss_matches_numpy_reference_and_gradient(clip_eps):
  v, old, ret, mask = _random_value_inputs(6, clip_eps)
  loss, metrics, (grad, g_old, g_ret) = _value_and_grads(v, old, ret, mask, clip_eps=clip_eps)
  want_loss, want_clipfrac, want_vpred, want_grad = _np_value_loss(v, old, ret, mask, clip_eps)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics['vf_clipfrac'], want_clipfrac, rtol=1e-6)
  np.testing.assert_allclose(metrics['vpred_mean'], want_vpred, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(g_old) == 0.0) and np.all(np.asarray(g_ret) == 0.0)
  if clip_eps is not None:  # the batch has tokens with a zeroed gradient and with a live one
    valid = np.asarray(mask) > 0
    assert 0.0 < want_clipfrac < 1.0
    assert np.any(want_grad[valid] == 0.0) and np.any(want_grad[valid] != 0.0)


@pytest.mark.parametrize('clip_eps', [0.5, None])
def test_value_loss_check_grads(clip_eps):
  v, old, ret, mask = _random_value_inputs(7, clip_eps)
  f = lambda x: L.value_loss(x, old, ret, mask, clip_eps=clip_eps)[0]
  check_grads(f, (v,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


def test_value_loss_jit_matches_no_jit_and_mask():
  v, old, ret, mask = _random_value_inputs(8, 0.5)
  f = functools.partial(_value_and_grads, clip_eps=0.5)
  eager = f(v, old, ret, mask)
  _tree_allclose(eager, jax.jit(f)(v, old, ret, mask), rtol=1e-6, atol=1e-6)
  loss, _, (grad, _, _) = eager
  pad = np.asarray(mask) == 0
  assert pad.any()
  assert np.all(np.asarray(loss)[pad] == 0.0) and np.all(np.asarray(grad)[pad] == 0.0)


@pytest.mark.parametrize(
  'kw, pattern',
  [
    (dict(old_values=_BAD_SHAPE), '`old_values` must have the same shape as `values`'),
    (dict(returns=_BAD_SHAPE), '`returns` must have the same shape as `values`'),
    (dict(mask=_BAD_SHAPE), '`mask` must have the same shape as `values`'),
    (dict(values=_BT[0]), r'`values` must have shape \[B, T\]'),
    (dict(clip_eps=0.0), '`clip_eps` must be > 0'),
    (dict(clip_eps=-0.2), '`clip_eps` must be > 0'),
  ],
)
def test_value_loss_bad_input(kw, pattern):
  args = dict(values=_BT, old_values=_BT, returns=_BT, mask=_BT)
  args.update(kw)
  with pytest.raises(ValueError, match=pattern):
    L.value_loss(**args)


# ----------------------------------------------------------------------------
# entropy_loss.
# ----------------------------------------------------------------------------


def test_entropy_loss_values_gradient_and_jit():
  # -H·mask: [-1.5, -0.2, -3.0, 0 (masked)].
  entropy, mask = _f32(_row([1.5, 0.2, 3.0, 2.0]), _row([1.0, 1.0, 1.0]))
  out = L.entropy_loss(entropy, mask)
  np.testing.assert_allclose(out[0, :4], [-1.5, -0.2, -3.0, 0.0], rtol=1e-7)
  np.testing.assert_allclose(jax.jit(L.entropy_loss)(entropy, mask), out, rtol=1e-7)
  # d/dH of Σ -H·m = -m.
  grad = jax.grad(lambda h: jnp.sum(L.entropy_loss(h, mask)))(entropy)
  np.testing.assert_array_equal(grad, -np.asarray(mask))
  assert out.dtype == jnp.float32


@pytest.mark.parametrize(
  'entropy, mask, pattern',
  [
    (_BT, _BAD_SHAPE, '`mask` must have the same shape as `entropy`'),
    (_BT[0], _BT[0], r'`entropy` must have shape \[B, T\]'),
  ],
)
def test_entropy_loss_bad_input(entropy, mask, pattern):
  with pytest.raises(ValueError, match=pattern):
    L.entropy_loss(entropy, mask)
