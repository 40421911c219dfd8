"""Tests for jrl.losses.advantages.

Each estimator is checked four ways (STYLE.md point 14): hand-computed values
on tiny inputs, an independent float64 NumPy reference written with plain
loops, gradient checks, and jit / no-jit; sharded statistics are compared with
the single-device value on the 8 fake CPU devices of conftest.py.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from jrl.losses.advantages import (
  batch_std,
  broadcast_to_tokens,
  discounted_returns,
  dr_grpo_advantages,
  gae,
  grpo_advantages,
  loo_advantages,
  reinforce_pp_advantages,
  reinforce_pp_baseline_advantages,
  rloo_advantages,
  token_level_rewards,
  whiten,
)

SCALES = ('group', 'batch', 'none')
STDS = ('unbiased', 'biased')
SINGLETONS = ('zero', 'raw', 'error')
EPS_MODES = ('var', 'std', 'clamp')

# ----------------------------------------------------------------------------
# Independent float64 NumPy references: plain loops, no shared code with jrl.
# ----------------------------------------------------------------------------


def _f64(x):
  return np.asarray(x, np.float64)


def _mean(xs):
  return sum(xs) / len(xs)


def np_grpo(r, g, *, scale='group', std='unbiased', eps=1e-6, singleton='zero'):
  r = _f64(r)
  ddof = 1 if std == 'unbiased' else 0
  if g == 1:
    if singleton == 'zero':
      return np.zeros_like(r)
    return r.copy() if scale == 'none' else r / (1.0 + eps)
  batch_mean = _mean(list(r))
  batch_sigma = math.sqrt(sum((x - batch_mean) ** 2 for x in r) / (len(r) - ddof))
  out = np.zeros_like(r)
  for start in range(0, len(r), g):
    grp = list(r[start : start + g])
    if len(set(grp)) == 1:
      continue  # zero-variance group: exactly 0
    mean = _mean(grp)
    if scale == 'group':
      sigma = math.sqrt(sum((x - mean) ** 2 for x in grp) / (g - ddof))
    else:
      sigma = batch_sigma
    for i, x in enumerate(grp):
      out[start + i] = (x - mean) if scale == 'none' else (x - mean) / (sigma + eps)
  return out


def np_rloo(r, g):
  r = _f64(r)
  out = np.zeros_like(r)
  for start in range(0, len(r), g):
    grp = list(r[start : start + g])
    if len(set(grp)) == 1:
      continue
    for i, x in enumerate(grp):
      siblings = grp[:i] + grp[i + 1 :]
      out[start + i] = x - _mean(siblings)
  return out


def np_loo(r, g, *, normalize=True, eps=1e-6):
  r = _f64(r)
  out = np.zeros_like(r)
  if g == 1:
    return out
  for start in range(0, len(r), g):
    grp = list(r[start : start + g])
    if len(set(grp)) == 1:
      continue
    for i, x in enumerate(grp):
      siblings = grp[:i] + grp[i + 1 :]
      b = _mean(siblings)
      a = x - b
      # Siblings that all agree have no spread: left unscaled.
      if normalize and g > 2 and len(set(siblings)) > 1:
        sigma = math.sqrt(sum((s - b) ** 2 for s in siblings) / (g - 2))
        a = a / (sigma + eps)
      out[start + i] = a
  return out


def np_batch_std(x, *, ddof=1, mask=None):
  x = _f64(x).ravel()
  m = np.ones_like(x) if mask is None else _f64(mask).ravel()
  vals = [v for v, k in zip(x, m, strict=True) if k > 0]
  if len(vals) <= ddof or not vals:
    return 0.0
  mean = _mean(vals)
  return math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - ddof))


def np_whiten(x, mask, *, shift_mean=True, ddof=1, eps=1e-8, eps_mode='var'):
  x, m = _f64(x), _f64(mask)
  vals = [v for v, k in zip(x.ravel(), m.ravel(), strict=True) if k > 0]
  mean = _mean(vals) if vals else 0.0
  var = np_batch_std(x, ddof=ddof, mask=m) ** 2
  if eps_mode == 'var':
    scale = math.sqrt(var + eps)
  elif eps_mode == 'clamp':
    scale = math.sqrt(max(var, eps))
  else:
    scale = math.sqrt(var) + eps
  if scale == 0:
    scale = 1.0
  out = np.zeros_like(x)
  for b in range(x.shape[0]):
    for t in range(x.shape[1]):
      if m[b, t] > 0:
        out[b, t] = ((x[b, t] - mean) if shift_mean else x[b, t]) / scale
  return out


def np_token_level_rewards(rewards, mask, kl=None, kl_coef=0.0):
  rewards, m = _f64(rewards), _f64(mask)
  out = np.zeros_like(m)
  for b in range(m.shape[0]):
    valid = [t for t in range(m.shape[1]) if m[b, t] > 0]
    for t in valid:
      if kl is not None:
        out[b, t] -= kl_coef * float(kl[b, t])
    if valid:
      out[b, valid[-1]] += rewards[b]
  return out


def np_discounted_returns(r, mask, gamma):
  r, m = _f64(r), _f64(mask)
  out = np.zeros_like(r)
  for b in range(r.shape[0]):
    running = 0.0
    for t in reversed(range(r.shape[1])):
      if m[b, t] > 0:
        running = r[b, t] + gamma * running
        out[b, t] = running
  return out


def np_gae_carry(r, v, mask, gamma, lam):
  """Backwards GAE that skips masked positions by carrying next value/advantage."""
  r, v, m = _f64(r), _f64(v), _f64(mask)
  adv = np.zeros_like(r)
  for b in range(r.shape[0]):
    next_v, next_a = 0.0, 0.0
    for t in reversed(range(r.shape[1])):
      if m[b, t] == 0:
        continue
      delta = r[b, t] + gamma * next_v - v[b, t]
      next_a = delta + gamma * lam * next_a
      next_v = v[b, t]
      adv[b, t] = next_a
  return adv, (adv + v) * m


def np_gae_textbook(r, v, gamma, lam):
  """Textbook GAE over one unmasked trajectory [T]; V = 0 after the end."""
  r, v = _f64(r), _f64(v)
  n = len(r)
  adv = np.zeros(n)
  last = 0.0
  for t in reversed(range(n)):
    next_v = v[t + 1] if t + 1 < n else 0.0
    delta = r[t] + gamma * next_v - v[t]
    last = delta + gamma * lam * last
    adv[t] = last
  return adv


# ----------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------

# Shapes shared by the random tests.
NB = 24  # outcome rewards [NB]: divisible by G = 1, 2, 3, 4, 6, 8
B, T = 8, 6  # token-level [B, T]


def _rng(seed):
  return np.random.default_rng(seed)


def _rewards(seed, b=NB):
  """Continuous float32 rewards: no ties within a group."""
  return _rng(seed).normal(size=(b,)).astype(np.float32)


def _normal(seed, shape=(B, T), scale=1.0):
  return (scale * _rng(seed).normal(size=shape)).astype(np.float32)


def _mask(seed, b=B, t=T, p=0.7):
  """0/1 float32 mask with inner holes; row 0 full, row 1 empty."""
  m = (_rng(seed).uniform(size=(b, t)) < p).astype(np.float32)
  m[0] = 1.0
  m[1] = 0.0
  return m


def _f32(x):
  return np.asarray(x, np.float32)


def _jit(fn, *arrays):
  """fn(*arrays) under jit.

  Tests batch their calls into one jitted program: run op by op, every new
  op and shape is compiled separately, which on CPU would make this file slow.
  """
  return jax.jit(fn)(*arrays)


def _close(actual, expected, tol=1e-5, msg=''):
  np.testing.assert_allclose(
    np.asarray(actual, np.float64), expected, rtol=tol, atol=tol, err_msg=str(msg)
  )


def _shard(fn, *arrays):
  """Runs fn under shard_map over the 8 fake devices, rows split on 'data'."""
  mesh = jax.make_mesh((8,), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, P('data'))
  arrays = [jax.device_put(a, sharding) for a in arrays]
  in_specs = (P('data'),) * len(arrays)
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P('data')))(*arrays)


# ----------------------------------------------------------------------------
# broadcast_to_tokens
# ----------------------------------------------------------------------------


def test_broadcast_to_tokens_hand():
  # Each valid token gets its row's advantage, masked tokens 0.
  out = _jit(broadcast_to_tokens, _f32([1.5, -2.0]), np.array([[1, 1, 0], [0, 1, 1]]))
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(out, [[1.5, 1.5, 0.0], [0.0, -2.0, -2.0]])


def test_broadcast_to_tokens_reference_and_bool_mask():
  a = _rewards(0, B)
  m = _mask(1)
  expected = np.zeros((B, T))
  for b in range(B):
    for t in range(T):
      expected[b, t] = a[b] if m[b, t] else 0.0
  out_f, out_b = _jit(
    lambda a, m, mb: (broadcast_to_tokens(a, m), broadcast_to_tokens(a, mb)), a, m, m > 0
  )
  _close(out_f, expected)
  _close(out_b, expected)


# ----------------------------------------------------------------------------
# grpo_advantages / dr_grpo_advantages
# ----------------------------------------------------------------------------


def test_grpo_hand_group():
  # [1, 0, 0, 0], G=4: mean 0.25, centred [.75, -.25, -.25, -.25],
  # Σ centred² = 0.5625 + 3·0.0625 = 0.75, unbiased var 0.75/3 = 0.25, std 0.5,
  # so A = [0.75, -0.25, -0.25, -0.25] / (0.5 + ε) ≈ [1.5, -0.5, -0.5, -0.5].
  # Biased: var 0.75/4 = 0.1875, std sqrt(0.1875) = 0.4330127, with ε = 0
  # A = 0.75/0.4330127 = sqrt(3), -0.25/0.4330127 = -1/sqrt(3).
  unbiased, biased = _jit(
    lambda r: (grpo_advantages(r, 4, eps=1e-6), grpo_advantages(r, 4, std='biased', eps=0.0)),
    _f32([1.0, 0.0, 0.0, 0.0]),
  )
  _close(unbiased, np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-6), 1e-6)
  _close(biased, np.array([3.0, -1.0, -1.0, -1.0]) / math.sqrt(3), 1e-6)


def test_grpo_hand_batch():
  # [1, 0, 0, 0 | 1, 1, 0, 0], G=4: batch mean 3/8 = 0.375,
  # Σ (r − 0.375)² = 3·0.625² + 5·0.375² = 1.171875 + 0.703125 = 1.875;
  # unbiased var 1.875/7 = 0.267857 (std 0.517549), biased 1.875/8 = 0.234375
  # (std 0.484123). Group-centred: [.75, -.25, -.25, -.25], [.5, .5, -.5, -.5].
  eps = 1e-6
  centred = np.array([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
  unbiased, biased = _jit(
    lambda r: [grpo_advantages(r, 4, scale='batch', std=s, eps=eps) for s in STDS],
    _f32([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]),
  )
  _close(unbiased, centred / (math.sqrt(1.875 / 7) + eps), 1e-5)
  _close(biased, centred / (math.sqrt(1.875 / 8) + eps), 1e-5)


def test_grpo_hand_none_and_dr_grpo():
  # No std: A = r − group mean: [1,0,0,0] → mean .25; [2,4,2,4] → mean 3.
  expected = [0.75, -0.25, -0.25, -0.25, -1.0, 1.0, -1.0, 1.0]
  outs = _jit(
    lambda r: (
      [grpo_advantages(r, 4, scale='none', std=s) for s in STDS] + [dr_grpo_advantages(r, 4)]
    ),
    _f32([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 2.0, 4.0]),
  )
  for out in outs:
    _close(out, expected, 1e-6)


def test_grpo_reference_all_modes():
  # G > 1: every scale x std x singleton matches the loops (`singleton` has
  # no effect there).
  r = _rewards(2)
  keys = [
    dict(group_size=g, scale=sc, std=sd, singleton=sg)
    for g in (2, 3, 8)
    for sc in SCALES
    for sd in STDS
    for sg in SINGLETONS
  ]
  outs = _jit(lambda r: [grpo_advantages(r, **kw) for kw in keys], r)
  for kw, out in zip(keys, outs, strict=True):
    assert out.shape == (NB,) and out.dtype == jnp.float32
    expected = np_grpo(r, kw['group_size'], scale=kw['scale'], std=kw['std'])
    _close(out, expected, 1e-5, msg=kw)


@pytest.mark.parametrize('std', STDS)
@pytest.mark.parametrize('scale', SCALES)
def test_grpo_singleton_conventions(scale, std):
  # group_size=1: 'zero' → 0; 'raw' → r/(1+ε), or r with scale='none';
  # 'error' → ValueError.
  eps = 0.5
  r = _f32([2.0, -1.0, 0.5])
  zero, raw = _jit(
    lambda r: [
      grpo_advantages(r, 1, scale=scale, std=std, singleton=s, eps=eps) for s in SINGLETONS[:2]
    ],
    r,
  )
  np.testing.assert_array_equal(zero, [0.0, 0.0, 0.0])
  expected_raw = [2.0, -1.0, 0.5] if scale == 'none' else [2.0 / 1.5, -1.0 / 1.5, 0.5 / 1.5]
  _close(raw, expected_raw, 1e-6)
  _close(raw, np_grpo(r, 1, scale=scale, std=std, eps=eps, singleton='raw'), 1e-6)
  with pytest.raises(ValueError, match='group_size'):
    grpo_advantages(r, 1, scale=scale, std=std, singleton='error', eps=eps)


def test_grpo_singleton_error_only_for_group_of_one():
  # singleton='error' is used only when group_size == 1.
  r = _f32([1.0, 0.0, 0.0, 1.0])
  _close(_jit(lambda r: grpo_advantages(r, 2, singleton='error'), r), np_grpo(r, 2), 1e-6)


def test_dr_grpo_reference_and_singleton():
  r = _rewards(3)
  groups = (1, 2, 3, 8)
  outs = _jit(lambda r: [dr_grpo_advantages(r, g) for g in groups], r)
  for g, out in zip(groups, outs, strict=True):
    _close(out, np_grpo(r, g, scale='none'), 1e-5, msg=g)  # G=1: 0 ('zero')
  np.testing.assert_array_equal(outs[0], np.zeros(NB))


# Tied groups whose naive (r − mean) in float32 is not exactly 0 for at least
# one of them (asserted below, so the exact-zero tests stay meaningful).
_TIED = [(0.1, 3), (0.3, 8), (0.2, 6)]


def _tied_rewards(value, g):
  """[NB]: a tied first group of `value`, then distinct rewards."""
  r = _rewards(70)
  r[:g] = value
  return r


def test_tied_cases_are_not_trivially_zero():
  def naive(*rs):
    return [jnp.max(jnp.abs(r - jnp.mean(r))) for r in rs]

  worst = _jit(naive, *[np.full((g,), v, np.float32) for v, g in _TIED])
  assert max(float(x) for x in worst) > 0.0


@pytest.mark.parametrize(('value', 'g'), _TIED)
def test_grpo_zero_variance_group_is_exactly_zero(value, g):
  # The tied group is exactly 0 for every scale x std, also for ε = 0 (where
  # a naive 0/0 would be NaN); the other groups are not.
  configs = [(sc, sd, eps) for sc in SCALES for sd in STDS for eps in (1e-6, 0.0)]
  outs = _jit(
    lambda r: [grpo_advantages(r, g, scale=sc, std=sd, eps=eps) for sc, sd, eps in configs],
    _tied_rewards(value, g),
  )
  for config, out in zip(configs, outs, strict=True):
    out = np.asarray(out)
    assert np.all(out[:g] == 0.0), (config, out[:g])
    assert np.all(np.isfinite(out)) and np.all(out[g:] != 0.0), config


@pytest.mark.parametrize(('value', 'g'), _TIED)
def test_rloo_loo_dr_grpo_zero_variance_group_is_exactly_zero(value, g):
  calls = {
    'rloo': lambda r: rloo_advantages(r, g),
    'loo': lambda r: loo_advantages(r, g),
    'loo_unnormalized': lambda r: loo_advantages(r, g, normalize=False),
    'loo_eps0': lambda r: loo_advantages(r, g, eps=0.0),
    'dr_grpo': lambda r: dr_grpo_advantages(r, g),
  }
  outs = _jit(lambda r: {k: f(r) for k, f in calls.items()}, _tied_rewards(value, g))
  for name, out in outs.items():
    out = np.asarray(out)
    assert np.all(out[:g] == 0.0), (name, out[:g])
    assert np.all(out[g:] != 0.0), name


def test_grpo_batch_all_groups_tied_is_zero():
  # Each group constant but the batch spread > 0: everything is 0.
  out = _jit(lambda r: grpo_advantages(r, 2, scale='batch'), _f32([0.1, 0.1, 0.7, 0.7, 0.3, 0.3]))
  np.testing.assert_array_equal(out, np.zeros(6))


@pytest.mark.parametrize('std', STDS)
def test_grpo_batch_scale_sharded(std):
  # 24 rows, G=3: each of the 8 shards holds one whole group.
  r = _rewards(33)
  sharded = _shard(lambda r: grpo_advantages(r, 3, scale='batch', std=std, axis_name='data'), r)
  single = _jit(lambda r: grpo_advantages(r, 3, scale='batch', std=std), r)
  _close(sharded, single, 1e-5)
  _close(single, np_grpo(r, 3, scale='batch', std=std), 1e-5)


# ----------------------------------------------------------------------------
# rloo_advantages
# ----------------------------------------------------------------------------


def test_rloo_hand():
  # [1,0,0,0]: 1 − mean(0,0,0) = 1; 0 − mean(1,0,0) = −1/3.
  # (Equivalently G/(G−1)·(r − mean) = 4/3·[.75, −.25, −.25, −.25].)
  # G=2, [3, 1 | 0, 5]: 3 − 1 = 2, 1 − 3 = −2, 0 − 5 = −5, 5 − 0 = 5.
  out4, out2 = _jit(
    lambda r: (rloo_advantages(r[:4], 4), rloo_advantages(r[4:], 2)),
    _f32([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 0.0, 5.0]),
  )
  _close(out4, [1, -1 / 3, -1 / 3, -1 / 3], 1e-6)
  _close(out2, [2.0, -2.0, -5.0, 5.0], 1e-6)


def test_rloo_reference():
  r = _rewards(4)
  groups = (2, 3, 8)
  outs = _jit(lambda r: [rloo_advantages(r, g) for g in groups], r)
  for g, out in zip(groups, outs, strict=True):
    _close(out, np_rloo(r, g), 1e-5, msg=g)
    _close(out, g / (g - 1) * np_grpo(r, g, scale='none'), 1e-5, msg=g)  # closed form


# ----------------------------------------------------------------------------
# loo_advantages
# ----------------------------------------------------------------------------


def test_loo_hand():
  # [1,0,0,0], G=4. Sample 0: siblings [0,0,0] agree → unscaled, A = 1 − 0 = 1.
  # Sample 1: b = 1/3, A = −1/3; siblings [1,0,0]: Σ(s − b)² = (2/3)² + 2·(1/3)²
  # = 2/3, /(G−2) = 1/3, σ = 0.57735 → A = (−1/3)/(0.57735 + ε) = −0.57735.
  # normalize=False: plain RLOO [1, −1/3, −1/3, −1/3].
  # G=2, [3, 1 | .25, .75]: one sibling, no std: A = r_i − r_j, whatever ε.
  # G=1: 0.
  eps = 1e-6

  def fn(r):
    return (
      loo_advantages(r[:4], 4, eps=eps),
      loo_advantages(r[:4], 4, normalize=False),
      loo_advantages(r[4:], 2),
      loo_advantages(r[4:], 2, eps=0.0),
      loo_advantages(r[4:], 1),
    )

  norm, plain, two, two_eps0, one = _jit(fn, _f32([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 0.25, 0.75]))
  a1 = (-1 / 3) / (math.sqrt(1 / 3) + eps)
  _close(norm, [1.0, a1, a1, a1], 1e-6)
  _close(plain, [1, -1 / 3, -1 / 3, -1 / 3], 1e-6)
  _close(two, [2.0, -2.0, -0.5, 0.5], 1e-6)
  _close(two_eps0, [2.0, -2.0, -0.5, 0.5], 1e-6)
  np.testing.assert_array_equal(one, np.zeros(4))


_AGREE = [(1.0, 0.0), (0.0, 1.0), (1.0, 0.1), (0.7, 0.3), (-1.0, 0.3)]  # (r_i, sibling)
_AGREE_G = (3, 4, 8)


@functools.cache
def _loo_agreeing_siblings():
  """{(r_i, sibling, G): (rewards, loo advantages)}, computed in one program."""
  inputs = {}
  for r_i, sibling in _AGREE:
    for g in _AGREE_G:
      r = _rewards(5)
      r[:g] = sibling
      r[0] = r_i
      inputs[r_i, sibling, g] = r
  outs = _jit(lambda rs: {k: loo_advantages(r, k[2]) for k, r in rs.items()}, inputs)
  return {k: (inputs[k], np.asarray(outs[k])) for k in inputs}


@pytest.mark.parametrize(('r_i', 'sibling'), _AGREE)
def test_loo_siblings_agree_leaves_sample_unscaled(r_i, sibling):
  # Sample 0's G−1 siblings all equal `sibling`: σ_0 = 0, so A_0 = r_i − sibling
  # is not divided by anything.
  expected0 = float(np.float32(r_i)) - float(np.float32(sibling))
  for g in _AGREE_G:
    r, out = _loo_agreeing_siblings()[r_i, sibling, g]
    np.testing.assert_allclose(out[0], expected0, rtol=1e-5, atol=1e-6, err_msg=f'{g=}')
    _close(out, np_loo(r, g), 1e-4, msg=g)


def test_loo_reference():
  r = _rewards(6)
  keys = [(g, normalize) for g in (2, 3, 8) for normalize in (True, False)]
  outs = _jit(lambda r: [loo_advantages(r, g, normalize=n) for g, n in keys], r)
  for (g, normalize), out in zip(keys, outs, strict=True):
    _close(out, np_loo(r, g, normalize=normalize), 1e-4, msg=(g, normalize))


@pytest.mark.parametrize('values', [(0.0, 1.0), (0.0, 0.3, 0.7, 1.0)], ids=['binary', 'discrete'])
def test_loo_reference_discrete_rewards(values):
  # Rewards from a small set: tied groups and agreeing siblings occur often.
  r = _rng(7).choice(np.array(values, np.float32), size=(NB,))
  out3, out8 = _jit(lambda r: (loo_advantages(r, 3), loo_advantages(r, 8)), r)
  _close(out3, np_loo(r, 3), 1e-4)
  _close(out8, np_loo(r, 8), 1e-4)


# ----------------------------------------------------------------------------
# batch_std
# ----------------------------------------------------------------------------


def test_batch_std_hand():
  # [1,2,3,4]: mean 2.5, Σ dev² = 2.25+.25+.25+2.25 = 5 → sqrt(5/3), sqrt(5/4).
  # Mask [1,1,0,0] on [1,3,100,-7]: valid [1,3], mean 2, Σ dev² = 2 → sqrt(2), 1.
  # Fewer than ddof + 1 valid entries: 0.
  def fn(x, y):
    return (
      batch_std(x),
      batch_std(x, ddof=0),
      batch_std(y, mask=np.array([1, 1, 0, 0])),
      batch_std(y, ddof=0, mask=np.array([1, 1, 0, 0])),
      batch_std(y, mask=np.array([0, 1, 0, 0])),
      batch_std(y, mask=np.zeros(4)),
      batch_std(y, ddof=0, mask=np.zeros(4)),
    )

  outs = _jit(fn, _f32([1.0, 2.0, 3.0, 4.0]), _f32([1.0, 3.0, 100.0, -7.0]))
  _close(outs[:4], [math.sqrt(5 / 3), math.sqrt(5 / 4), math.sqrt(2), 1.0], 1e-6)
  np.testing.assert_array_equal(outs[4:], [0.0, 0.0, 0.0])


@pytest.mark.parametrize('ddof', [0, 1])
def test_batch_std_reference_and_sharded(ddof):
  x = _normal(8, (16, T))
  m = _mask(9, 16, T)
  unmasked, masked = _jit(
    lambda x, m: (batch_std(x, ddof=ddof), batch_std(x, ddof=ddof, mask=m)), x, m
  )
  _close(unmasked, np_batch_std(x, ddof=ddof), 1e-5)
  _close(masked, np_batch_std(x, ddof=ddof, mask=m), 1e-5)
  mesh = jax.make_mesh((8,), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, P('data'))
  fn = jax.shard_map(
    lambda x, m: batch_std(x, ddof=ddof, mask=m, axis_name='data'),
    mesh=mesh,
    in_specs=(P('data'), P('data')),
    out_specs=P(),
  )
  sharded = jax.jit(fn)(jax.device_put(x, sharding), jax.device_put(m, sharding))
  _close(sharded, float(masked), 1e-5)


# ----------------------------------------------------------------------------
# whiten
# ----------------------------------------------------------------------------

_WX = _f32([[1.0, 2.0], [3.0, 100.0]])
_WM = np.array([[1, 1], [1, 0]])


def test_whiten_hand():
  # Valid [1, 2, 3]: mean 2, Σ dev² = 2, ddof=1 var 1, ddof=0 var 2/3.
  # 'var', ddof=1, ε = .01: scale sqrt(1.01).
  # 'std', ddof=0, ε = .01: scale sqrt(2/3) + .01 = 0.8164966 + .01.
  # 'clamp', ddof=1: ε = 4 > var → scale 2 (±.5); ε = .25 < var → scale 1.
  # 'clamp', ddof=0, ε = 1 > 2/3 → scale 1.
  # shift_mean=False keeps the mean: 'std' ε = 0 → x / 1; 'var' ε = 3 → x / 2.
  def fn(x, m):
    return (
      whiten(x, m, eps=0.01),
      whiten(x, m, ddof=0, eps=0.01, eps_mode='std'),
      whiten(x, m, eps=4.0, eps_mode='clamp'),
      whiten(x, m, eps=0.25, eps_mode='clamp'),
      whiten(x, m, ddof=0, eps=1.0, eps_mode='clamp'),
      whiten(x, m, shift_mean=False, eps=0.0, eps_mode='std'),
      whiten(x, m, shift_mean=False, eps=3.0),
    )

  outs = _jit(fn, _WX, _WM)
  unit = np.array([[-1.0, 0.0], [1.0, 0.0]])
  _close(outs[0], unit / math.sqrt(1.01), 1e-6)
  _close(outs[1], unit / (math.sqrt(2 / 3) + 0.01), 1e-6)
  _close(outs[2], unit / 2, 1e-6)
  _close(outs[3], unit, 1e-6)
  _close(outs[4], unit, 1e-6)
  _close(outs[5], [[1.0, 2.0], [3.0, 0.0]], 1e-6)
  _close(outs[6], [[0.5, 1.0], [1.5, 0.0]], 1e-6)


def test_whiten_zero_scale_and_all_masked():
  # Constant valid entries with ε = 0: scale 0 is replaced by 1, no NaN.
  # No valid token at all: zeros.
  x = np.full((2, 3), 0.7, np.float32)
  m = np.array([[1, 1, 0], [0, 1, 1]])

  def fn(x, m, x2):
    return [
      (
        whiten(x, m, eps=0.0, eps_mode=mode),
        whiten(x, m, shift_mean=False, eps=0.0, eps_mode=mode),
        whiten(x2, np.zeros((2, 2)), eps_mode=mode),
      )
      for mode in EPS_MODES
    ]

  for mode, (centred, kept, empty) in zip(EPS_MODES, _jit(fn, x, m, _WX), strict=True):
    np.testing.assert_array_equal(centred, np.zeros((2, 3)), err_msg=mode)
    _close(kept, 0.7 * m, 1e-6, msg=mode)
    np.testing.assert_array_equal(empty, np.zeros((2, 2)), err_msg=mode)


def test_whiten_reference():
  x = _normal(12, scale=3.0) + 1.0
  m = _mask(13)
  keys = [
    dict(shift_mean=s, ddof=d, eps=e, eps_mode=mode)
    for mode in EPS_MODES
    for s in (True, False)
    for d in (0, 1)
    for e in (1e-8, 0.5, 20.0)
  ]
  outs = _jit(lambda x, m: [whiten(x, m, **kw) for kw in keys], x, m)
  for kw, out in zip(keys, outs, strict=True):
    _close(out, np_whiten(x, m, **kw), 1e-5, msg=kw)


def test_whiten_masked_equals_sliced():
  # Masked entries take no part: whitening a masked batch equals whitening
  # its valid entries alone, laid out as one unmasked row.
  x = _normal(14)
  m = _mask(15)
  valid = x[m > 0][None, :]
  full, sliced = _jit(lambda x, m, v: (whiten(x, m), whiten(v, jnp.ones_like(v))), x, m, valid)
  full = np.asarray(full)
  _close(full[m > 0], np.asarray(sliced)[0], 1e-5)
  assert np.all(full[m == 0] == 0.0)


@pytest.mark.parametrize(
  ('eps_mode', 'shift_mean'), [('var', True), ('std', False), ('clamp', True)]
)
def test_whiten_sharded(eps_mode, shift_mean):
  x = _normal(16, (16, T))
  m = _mask(17, 16, T)
  fn = functools.partial(whiten, shift_mean=shift_mean, eps_mode=eps_mode)
  sharded = _shard(lambda x, m: fn(x, m, axis_name='data'), x, m)
  _close(sharded, _jit(fn, x, m), 1e-5)


# ----------------------------------------------------------------------------
# token_level_rewards
# ----------------------------------------------------------------------------


def test_token_level_rewards_hand():
  # Reward on the last valid token (highest index with mask 1); empty row → 0.
  # With −β·KL on every valid token: β = 0.5, KL = 0.2 everywhere → −0.1.
  mask = np.array([[1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 0]])
  plain, with_kl = _jit(
    lambda r, m, kl: (token_level_rewards(r, m), token_level_rewards(r, m, kl=kl, kl_coef=0.5)),
    _f32([2.0, -1.0, 5.0]),
    mask,
    np.full((3, 4), 0.2, np.float32),
  )
  np.testing.assert_array_equal(plain, [[0, 2, 0, 0], [0, 0, 0, -1], [0, 0, 0, 0]])
  _close(with_kl, [[-0.1, 1.9, 0, 0], [0, -0.1, 0, -1.1], [0, 0, 0, 0]], 1e-6)


def test_token_level_rewards_reference():
  rewards = _rewards(18, B)
  m = _mask(19)
  kl = _normal(20)
  plain, with_kl = _jit(
    lambda r, m, kl: (token_level_rewards(r, m), token_level_rewards(r, m, kl=kl, kl_coef=0.3)),
    rewards,
    m,
    kl,
  )
  _close(plain, np_token_level_rewards(rewards, m), 1e-6)
  _close(with_kl, np_token_level_rewards(rewards, m, kl, 0.3), 1e-6)


# ----------------------------------------------------------------------------
# discounted_returns
# ----------------------------------------------------------------------------


def test_discounted_returns_hand():
  # r = [1, 2, 3], γ = .5: G2 = 3, G1 = 2 + .5·3 = 3.5, G0 = 1 + .5·3.5 = 2.75.
  # A masked column (reward 9, ignored) is not a step: [2.75, 0, 3.5, 3.0].
  # γ = 1, last token masked: reward-to-go [1+9+2, 9+2, 2, 0] = [12, 11, 2, 0].
  def fn(r):
    return (
      discounted_returns(r[:, [0, 2, 3]], np.ones((1, 3)), gamma=0.5),
      discounted_returns(r, np.array([[1, 0, 1, 1]]), gamma=0.5),
      discounted_returns(r, np.array([[1, 1, 1, 0]])),
    )

  dense, masked, to_go = _jit(fn, _f32([[1.0, 9.0, 2.0, 3.0]]))
  _close(dense, [[2.75, 3.5, 3.0]], 1e-6)
  _close(masked, [[2.75, 0.0, 3.5, 3.0]], 1e-6)
  _close(to_go, [[12.0, 11.0, 2.0, 0.0]], 1e-6)


def test_discounted_returns_reference():
  r = _normal(21)
  m = _mask(22)
  gammas = (0.0, 0.5, 0.9, 1.0)
  outs = _jit(lambda r, m: [discounted_returns(r, m, gamma=g) for g in gammas], r, m)
  for gamma, out in zip(gammas, outs, strict=True):
    _close(out, np_discounted_returns(r, m, gamma), 1e-5, msg=gamma)


# Positions of T = 6 model tokens among 13 columns; the others are masked
# "environment" tokens or trailing padding.
_INSERT = np.array([1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1, 0], bool)


def _insert_masked_columns(seed, *arrays):
  """Spreads [B, T] arrays over 13 columns with garbage at masked positions."""
  out = []
  for i, a in enumerate(arrays):
    wide = _normal(seed + i, (B, _INSERT.size), scale=50.0)
    wide[:, _INSERT] = a
    out.append(wide)
  return [*out, np.broadcast_to(_INSERT, (B, _INSERT.size)).astype(np.float32)]


def test_discounted_returns_masked_columns_are_not_steps():
  # Inserting masked columns (with garbage rewards) leaves the returns at the
  # valid positions unchanged.
  r = _normal(23)
  r_wide, m_wide = _insert_masked_columns(24, r)
  gammas = (0.5, 1.0)

  def fn(r, r_wide, m_wide):
    base = [discounted_returns(r, jnp.ones_like(r), gamma=g) for g in gammas]
    return base, [discounted_returns(r_wide, m_wide, gamma=g) for g in gammas]

  bases, wides = _jit(fn, r, r_wide, m_wide)
  for base, wide in zip(bases, wides, strict=True):
    wide = np.asarray(wide)
    _close(wide[:, _INSERT], base, 1e-5)
    assert np.all(wide[:, ~_INSERT] == 0.0)


# ----------------------------------------------------------------------------
# reinforce_pp_advantages / reinforce_pp_baseline_advantages
# ----------------------------------------------------------------------------


def test_reinforce_pp_hand():
  # γ = .5: row 0 r = [0,0,1] → G = [.25, .5, 1]; row 1 r = [0,1,·] with the
  # last token masked → G = [.5, 1, 0]. Valid G = [.25,.5,1,.5,1], mean .65,
  # deviations [-.4,-.15,.35,-.15,.35], Σ dev² = .45; ddof=0 var .09, std .3.
  # 'std' with ε = 0: A = dev/.3 = [-4/3, -.5, 7/6, -.5, 7/6].
  # ddof=1: var .45/4 = .1125 → A = dev / sqrt(.1125) ('var', ε = 0).
  def fn(r, m):
    return (
      reinforce_pp_advantages(r, m, gamma=0.5, ddof=0, eps=0.0, eps_mode='std'),
      reinforce_pp_advantages(r, m, gamma=0.5, eps=0.0),
    )

  biased, unbiased = _jit(
    fn, _f32([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]), _f32([[1, 1, 1], [1, 1, 0]])
  )
  _close(biased, [[-4 / 3, -0.5, 7 / 6], [-0.5, 7 / 6, 0.0]], 1e-5)
  dev = np.array([[-0.4, -0.15, 0.35], [-0.15, 0.35, 0.0]])
  _close(unbiased, dev / math.sqrt(0.1125), 1e-5)


def test_reinforce_pp_reference():
  r = _normal(25)
  m = _mask(26)
  keys = [(g, d, mode) for g in (0.9, 1.0) for d in (0, 1) for mode in EPS_MODES]
  outs = _jit(
    lambda r, m: [
      reinforce_pp_advantages(r, m, gamma=g, ddof=d, eps_mode=mode) for g, d, mode in keys
    ],
    r,
    m,
  )
  for (gamma, ddof, mode), out in zip(keys, outs, strict=True):
    expected = np_whiten(np_discounted_returns(r, m, gamma), m, ddof=ddof, eps_mode=mode)
    _close(out, expected, 1e-4, msg=(gamma, ddof, mode))


def test_reinforce_pp_baseline_hand():
  # G=2, rewards [1, 0 | 3, 3] → centred [.5, -.5 | 0, 0].
  # mask [[1,1],[1,0],[1,1],[0,1]], γ=1 → returns [.5,.5], [-.5,·], [0,0], [·,0].
  # Valid: [.5,.5,-.5,0,0,0], mean 1/12; dev 5/12 (×2), -7/12, -1/12 (×3);
  # Σ dev² = (50+49+3)/144 = 102/144, ddof=0 var 17/144, std sqrt(17)/12.
  # A = dev·12/sqrt(17): 5/sqrt17, -7/sqrt17, -1/sqrt17.
  out = _jit(
    lambda r, m: reinforce_pp_baseline_advantages(r, m, 2, ddof=0, eps=0.0, eps_mode='std'),
    _f32([1.0, 0.0, 3.0, 3.0]),
    np.array([[1, 1], [1, 0], [1, 1], [0, 1]]),
  )
  a, b, c = 5 / math.sqrt(17), -7 / math.sqrt(17), -1 / math.sqrt(17)
  _close(out, [[a, a], [b, 0.0], [c, c], [0.0, c]], 1e-5)


def test_reinforce_pp_baseline_reference():
  rewards = _rewards(27, B)
  m = _mask(28)
  kl = np.abs(_normal(29))
  keys = [(1, 'var', 1), (2, 'clamp', 0), (4, 'std', 1)]

  def fn(r, m, kl):
    return [
      reinforce_pp_baseline_advantages(
        r, m, g, kl=kl, kl_coef=0.1, gamma=0.95, ddof=ddof, eps_mode=mode
      )
      for g, mode, ddof in keys
    ]

  for (g, mode, ddof), out in zip(keys, _jit(fn, rewards, m, kl), strict=True):
    centred = np_grpo(rewards, g, scale='none')  # G=1: every centred reward is 0
    tok = np_token_level_rewards(centred, m, kl, 0.1)
    expected = np_whiten(np_discounted_returns(tok, m, 0.95), m, ddof=ddof, eps_mode=mode)
    _close(out, expected, 1e-4, msg=(g, mode, ddof))


@pytest.mark.parametrize('eps_mode', EPS_MODES)
def test_reinforce_pp_sharded(eps_mode):
  r = _normal(30, (16, T))
  m = _mask(31, 16, T)
  fn = functools.partial(reinforce_pp_advantages, gamma=0.9, eps_mode=eps_mode)
  sharded = _shard(lambda r, m: fn(r, m, axis_name='data'), r, m)
  _close(sharded, _jit(fn, r, m), 1e-5)


def test_reinforce_pp_baseline_sharded():
  # 16 rows, G=2: each of the 8 shards holds one whole group.
  rewards = _rewards(32, 16)
  m = _mask(33, 16, T)
  sharded = _shard(
    lambda r, m: reinforce_pp_baseline_advantages(r, m, 2, axis_name='data'), rewards, m
  )
  _close(sharded, _jit(lambda r, m: reinforce_pp_baseline_advantages(r, m, 2), rewards, m), 1e-5)


# ----------------------------------------------------------------------------
# gae
# ----------------------------------------------------------------------------


def test_gae_hand():
  # r = [0, 0, 1], V = [.5, .6, .7], γ = .9, λ = .8 (γλ = .72):
  # t2: δ = 1 + 0 − .7 = .3,            A2 = .3
  # t1: δ = 0 + .9·.7 − .6 = .03,       A1 = .03 + .72·.3 = .246
  # t0: δ = 0 + .9·.6 − .5 = .04,       A0 = .04 + .72·.246 = .21712
  # R = A + V = [.71712, .846, 1.0].
  # A masked "environment" column (reward 5, value 9) between t0 and t1 is
  # skipped: same advantages at valid positions, 0 at the masked one.
  def fn(r, v):
    dense = gae(r[:, [0, 2, 3]], v[:, [0, 2, 3]], np.ones((1, 3)), gamma=0.9, lam=0.8)
    return dense, gae(r, v, np.array([[1, 0, 1, 1]]), gamma=0.9, lam=0.8)

  (adv, ret), (adv_m, ret_m) = _jit(fn, _f32([[0.0, 5.0, 0.0, 1.0]]), _f32([[0.5, 9.0, 0.6, 0.7]]))
  _close(adv, [[0.21712, 0.246, 0.3]], 1e-6)
  _close(ret, [[0.71712, 0.846, 1.0]], 1e-6)
  _close(adv_m, [[0.21712, 0.0, 0.246, 0.3]], 1e-6)
  _close(ret_m, [[0.71712, 0.0, 0.846, 1.0]], 1e-6)


_GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5)]


def test_gae_full_mask_is_textbook():
  r, v = _normal(34), _normal(35)
  outs = _jit(
    lambda r, v: [gae(r, v, jnp.ones_like(r), gamma=g, lam=lm) for g, lm in _GAMMA_LAM], r, v
  )
  for (gamma, lam), (adv, ret) in zip(_GAMMA_LAM, outs, strict=True):
    expected = np.stack([np_gae_textbook(r[b], v[b], gamma, lam) for b in range(B)])
    _close(adv, expected, 1e-4, msg=(gamma, lam))
    _close(ret, expected + v, 1e-4, msg=(gamma, lam))


def test_gae_reference_with_mask():
  r, v = _normal(36), _normal(37)
  m = _mask(38, p=0.6)
  outs = _jit(lambda r, v, m: [gae(r, v, m, gamma=g, lam=lm) for g, lm in _GAMMA_LAM], r, v, m)
  for (gamma, lam), (adv, ret) in zip(_GAMMA_LAM, outs, strict=True):
    exp_adv, exp_ret = np_gae_carry(r, v, m, gamma, lam)
    _close(adv, exp_adv, 1e-4, msg=(gamma, lam))
    _close(ret, exp_ret, 1e-4, msg=(gamma, lam))
    # Each row equals textbook GAE on its valid tokens alone (sliced).
    for b in range(B):
      keep = m[b] > 0
      if keep.any():
        expected = np_gae_textbook(r[b, keep], v[b, keep], gamma, lam)
        _close(np.asarray(adv)[b, keep], expected, 1e-4, msg=(gamma, lam, b))


def test_gae_masked_columns_equal_sliced():
  # A trajectory of T model tokens; inserting masked "environment" columns
  # (garbage rewards and values) inside the row and as trailing padding leaves
  # the advantages and returns at the model tokens unchanged.
  r, v = _normal(39), _normal(40)
  r_wide, v_wide, m_wide = _insert_masked_columns(41, r, v)

  def fn(r, v, r_wide, v_wide, m_wide):
    return [
      (gae(r, v, jnp.ones_like(r), gamma=g, lam=lm), gae(r_wide, v_wide, m_wide, gamma=g, lam=lm))
      for g, lm in _GAMMA_LAM
    ]

  outs = _jit(fn, r, v, r_wide, v_wide, m_wide)
  for (gamma, lam), ((adv0, ret0), (adv1, ret1)) in zip(_GAMMA_LAM, outs, strict=True):
    adv1, ret1 = np.asarray(adv1), np.asarray(ret1)
    _close(adv1[:, _INSERT], adv0, 1e-5, msg=(gamma, lam))
    _close(ret1[:, _INSERT], ret0, 1e-5, msg=(gamma, lam))
    assert np.all(adv1[:, ~_INSERT] == 0.0) and np.all(ret1[:, ~_INSERT] == 0.0)


def test_gae_returns_are_adv_plus_values_and_reward_to_go():
  # Returns = adv + values on valid tokens, 0 elsewhere. γ = λ = 1: the values
  # telescope, R_t = Σ_{s ≥ t valid} r_s (reward-to-go); λ = 1 with γ < 1: R_t
  # is the discounted return.
  r, v = _normal(45), _normal(46)
  m = _mask(47)
  (adv, ret), (_, ret_1), (_, ret_09) = _jit(
    lambda r, v, m: (
      gae(r, v, m, gamma=0.97, lam=0.9),
      gae(r, v, m, gamma=1.0, lam=1.0),
      gae(r, v, m, gamma=0.9, lam=1.0),
    ),
    r,
    v,
    m,
  )
  adv, ret = np.asarray(adv), np.asarray(ret)
  _close(ret[m > 0], adv[m > 0] + v[m > 0], 1e-6)
  assert np.all(ret[m == 0] == 0.0) and np.all(adv[m == 0] == 0.0)
  to_go = np.zeros((B, T))
  for b in range(B):
    for t in range(T):
      if m[b, t]:
        to_go[b, t] = sum(float(r[b, s]) for s in range(t, T) if m[b, s])
  _close(ret_1, to_go, 1e-4)
  _close(ret_09, np_discounted_returns(r, m, 0.9), 1e-4)


def test_gae_no_gradient_into_values():
  r, v = _normal(48), _normal(49)
  m = _mask(50)

  def total(r, v, m):
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.95)
    return jnp.sum(adv) + jnp.sum(ret)

  def fn(r, v):
    g_r, g_v = jax.grad(total, argnums=(0, 1))(r, v, m)
    # γ = λ = 1 with a full mask: r_t appears in A_0 .. A_t, d ΣA / d r_t = t + 1.
    g_full = jax.grad(lambda r: jnp.sum(gae(r, v, jnp.ones_like(r))[0]))(r)
    return g_r, g_v, g_full

  g_r, g_v, g_full = _jit(fn, r, v)
  np.testing.assert_array_equal(g_v, np.zeros((B, T)))
  assert np.any(np.asarray(g_r) != 0.0)
  _close(g_full, np.tile(np.arange(1.0, T + 1.0), (B, 1)), 1e-6)


def test_gae_and_returns_sharded():
  # GAE and returns are per row: under shard_map (e.g. inside a sharded train
  # step) each device's rows give the single-device values.
  r, v = _normal(51, (16, T)), _normal(52, (16, T))
  m = _mask(53, 16, T)

  def fn(r, v, m):
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.95)
    return jnp.concatenate([adv, ret, discounted_returns(r, m, gamma=0.9)], axis=1)

  _close(_shard(fn, r, v, m), _jit(fn, r, v, m), 1e-6)


# ----------------------------------------------------------------------------
# jit / no-jit, gradients.
# ----------------------------------------------------------------------------

_R = _rewards(60, B)
_X = _normal(61)
_V = _normal(62)
_M = _mask(63)
_KL = np.abs(_normal(64))

# Each case maps (rewards [B], x [B, T]) to an array.
_CASES = {
  'broadcast_to_tokens': lambda r, x: broadcast_to_tokens(r, _M),
  'grpo_group': lambda r, x: grpo_advantages(r, 4),
  'grpo_batch': lambda r, x: grpo_advantages(r, 4, scale='batch', std='biased'),
  'dr_grpo': lambda r, x: dr_grpo_advantages(r, 4),
  'rloo': lambda r, x: rloo_advantages(r, 4),
  'loo': lambda r, x: loo_advantages(r, 4),
  'batch_std_whiten': lambda r, x: whiten(x, _M) + batch_std(x, mask=_M),
  'token_level_rewards': lambda r, x: token_level_rewards(r, _M, kl=x, kl_coef=0.1),
  'discounted_returns': lambda r, x: discounted_returns(x, _M, gamma=0.9),
  'reinforce_pp': lambda r, x: reinforce_pp_advantages(x, _M, gamma=0.9),
  'reinforce_pp_baseline': lambda r, x: reinforce_pp_baseline_advantages(
    r, _M, 2, kl=_KL, kl_coef=0.1
  ),
  'gae': lambda r, x: jnp.stack(gae(x, _V, _M, gamma=0.9, lam=0.95)),
}


def _values_and_grads(cases, r, x):
  """{name: (fn(r, x), d Σ fn / dr, d Σ fn / dx)} for every case, jitted as one program."""

  def one(fn):
    def total(r, x):
      out = fn(r, x)
      return jnp.sum(out), out

    (_, out), (g_r, g_x) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(r, x)
    return out, g_r, g_x

  return _jit(lambda r, x: {name: one(fn) for name, fn in cases.items()}, r, x)


@functools.cache
def _jitted_cases():
  return _values_and_grads(_CASES, _R, _X)


@pytest.mark.parametrize('name', sorted(_CASES))
def test_jit_matches_eager_and_gradients_finite(name):
  jitted, g_r, g_x = _jitted_cases()[name]
  eager = np.asarray(_CASES[name](_R, _X))  # op by op, no jit
  assert eager.shape == jitted.shape
  np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)
  # Gradient of the sum of the outputs w.r.t. the rewards and x.
  assert np.all(np.isfinite(g_r)) and np.all(np.isfinite(g_x))


_ZERO_MASK_CASES = {
  'whiten_var': lambda x, m: whiten(x, m),
  'whiten_clamp': lambda x, m: whiten(x, m, eps_mode='clamp', ddof=0),
  'reinforce_pp': lambda x, m: reinforce_pp_advantages(x, m, gamma=0.9),
  'reinforce_pp_baseline': lambda x, m: reinforce_pp_baseline_advantages(x[:, 0], m, 2),
}


@functools.cache
def _all_masked_cases():
  m0 = np.zeros((B, T), np.float32)
  cases = {
    k: functools.partial(lambda r, x, fn: fn(x, m0), fn=fn) for k, fn in _ZERO_MASK_CASES.items()
  }
  return _values_and_grads(cases, _R, _X)


@pytest.mark.parametrize('name', sorted(_ZERO_MASK_CASES))
def test_all_masked_outputs_zero_and_gradients_finite(name):
  out, _, g = _all_masked_cases()[name]
  np.testing.assert_array_equal(out, np.zeros_like(out))
  assert np.all(np.isfinite(g)), g


_TIED_GRAD_CASES = {
  'grpo_group': functools.partial(grpo_advantages, scale='group'),
  'grpo_batch': functools.partial(grpo_advantages, scale='batch'),
  'grpo_none': functools.partial(grpo_advantages, scale='none'),
  'rloo': rloo_advantages,
  'loo': loo_advantages,
}


@functools.cache
def _tied_group_grads():
  r = _f32([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0])  # first group all 1
  w = np.arange(1.0, 9.0, dtype=np.float32)
  cases = {
    k: functools.partial(lambda r, x, fn: w * fn(r, 4), fn=fn) for k, fn in _TIED_GRAD_CASES.items()
  }
  return _values_and_grads(cases, r, _X)


@pytest.mark.parametrize('name', sorted(_TIED_GRAD_CASES))
def test_gradients_finite_with_tied_group(name):
  # A group whose samples all got the same reward (e.g. all correct) is the
  # common case with 0/1 rewards; its advantage is exactly 0 and its gradient
  # must not be NaN (NaN poisons anything it is summed into).
  out, g, _ = _tied_group_grads()[name]
  np.testing.assert_array_equal(out[:4], np.zeros(4))
  assert np.all(np.isfinite(g)), g


_CHECK = dict(order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)
_SEPARATED = _f32([0.3, -1.2, 0.9, 2.1, -0.4, 1.5, 0.0, -2.0])  # no ties


def test_grpo_check_grads():
  # Well-separated rewards, so the zero-variance branch is not hit. One
  # function returns every scale x std, so all are checked at once.
  def fn(r):
    return jnp.concatenate(
      [grpo_advantages(r, 4, scale=sc, std=sd) for sc in SCALES for sd in STDS]
      + [grpo_advantages(r, 2, std='biased')]
    )

  check_grads(jax.jit(fn), (_SEPARATED,), **_CHECK)


def test_whiten_check_grads():
  m = _M[:3, :4]

  def fn(x):
    return jnp.stack(
      [whiten(x, m, eps_mode=mode) for mode in EPS_MODES]
      + [whiten(x, m, ddof=0, eps_mode='std', shift_mean=False)]
    )

  check_grads(jax.jit(fn), (_X[:3, :4],), **_CHECK)


def test_loo_and_reinforce_pp_check_grads():
  m = _M[:3, :4]

  def fn(r, x):
    return loo_advantages(r, 4), reinforce_pp_advantages(x, m, gamma=0.9)

  check_grads(jax.jit(fn), (_SEPARATED, _X[:3, :4]), **_CHECK)


# ----------------------------------------------------------------------------
# Rows left out (`valid`): completions whose reward could not be computed
# ----------------------------------------------------------------------------

# Each outcome estimator with `valid`, and its plain-loop reference (applied
# to the valid rows alone, as a batch without the others).
_VALID_CASES = {
  'grpo_group_unbiased': (grpo_advantages, np_grpo),
  'grpo_group_biased': (
    functools.partial(grpo_advantages, std='biased'),
    functools.partial(np_grpo, std='biased'),
  ),
  'grpo_batch': (
    functools.partial(grpo_advantages, scale='batch'),
    functools.partial(np_grpo, scale='batch'),
  ),
  'grpo_none': (
    functools.partial(grpo_advantages, scale='none'),
    functools.partial(np_grpo, scale='none'),
  ),
  'dr_grpo': (dr_grpo_advantages, functools.partial(np_grpo, scale='none')),
  'rloo': (rloo_advantages, np_rloo),
  'loo': (loo_advantages, np_loo),
  'loo_unnormalised': (
    functools.partial(loo_advantages, normalize=False),
    functools.partial(np_loo, normalize=False),
  ),
}
# The estimators whose statistics stay inside a group.
_GROUP_LOCAL = sorted(k for k in _VALID_CASES if k != 'grpo_batch')


def _one_left_out_per_group(seed, n=NB, g=4):
  """[n] bool: one False at a random place in each group of g."""
  valid = np.ones(n, bool)
  valid[np.arange(0, n, g) + _rng(seed).integers(0, g, n // g)] = False
  return valid


def test_valid_rows_hand():
  # Group [1, 0, (5, left out), 0]: the three valid rewards have mean 1/3 and
  # unbiased std sqrt(1/3); their leave-one-out means are 0, 1/2, 1/2; loo
  # scales the last two by the std of siblings (1, 0), sqrt(1/2).
  r = _f32([1.0, 0.0, 5.0, 0.0])
  valid = np.array([True, True, False, True])
  s, h = math.sqrt(1 / 3) + 1e-6, math.sqrt(1 / 2) + 1e-6

  def all_of(r, v):
    fns = (grpo_advantages, dr_grpo_advantages, rloo_advantages, loo_advantages)
    return jnp.stack([fn(r, 4, valid=v) for fn in fns])

  grpo, dr_grpo, rloo, loo = _jit(all_of, r, valid)
  _close(grpo, [(2 / 3) / s, -(1 / 3) / s, 0.0, -(1 / 3) / s])
  _close(dr_grpo, [2 / 3, -1 / 3, 0.0, -1 / 3])
  _close(rloo, [1.0, -0.5, 0.0, -0.5])
  _close(loo, [1.0, -0.5 / h, 0.0, -0.5 / h])


def test_valid_rows_that_tie_or_stand_alone_give_zero():
  # Valid rewards all 1 (the left-out 0 would have made a spread), then a
  # group with one valid row (no baseline), then a group with none.
  r = _f32([1.0, 1.0, 0.0, 1.0, 0.7, 0.2, 0.9, 0.1, 0.3, 0.8, 0.5, 0.6])
  valid = np.array([True, True, False, True, False, True, False, False] + [False] * 4)
  for name, (fn, _) in _VALID_CASES.items():
    out = _jit(lambda r, v, fn=fn: fn(r, 4, valid=v), r, valid)
    np.testing.assert_array_equal(out, np.zeros(12), err_msg=name)


@pytest.mark.parametrize('name', sorted(_VALID_CASES))
def test_valid_rows_equal_the_batch_without_the_others(name):
  """One row of each group left out (its reward NaN: never read) gives the
  other rows what the batch without those rows gives them, and 0 to the
  left-out rows."""
  fn, reference = _VALID_CASES[name]
  r = _rewards(70)
  valid = _one_left_out_per_group(71)
  with_nan = np.where(valid, r, np.nan).astype(np.float32)
  got = _jit(lambda r, v: fn(r, 4, valid=v), with_nan, valid)
  without = _jit(lambda r: fn(r, 3), r[valid])
  np.testing.assert_array_equal(np.asarray(got)[~valid], 0.0)
  _close(np.asarray(got)[valid], np.asarray(without), 1e-5, name)
  _close(np.asarray(got)[valid], reference(r[valid], 3), 1e-5, name)


@pytest.mark.parametrize('name', _GROUP_LOCAL)
def test_valid_rows_any_number_per_group(name):
  # Groups with 4, 3, 2, 1 and 0 valid rows: each group gets the estimator
  # of its valid rows alone (0 with fewer than two).
  fn, reference = _VALID_CASES[name]
  r = _rewards(72, 20)
  valid = np.array([1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0], bool)
  got = np.asarray(_jit(lambda r, v: fn(r, 4, valid=v), r, valid))
  for start in range(0, 20, 4):
    keep = valid[start : start + 4]
    mine = got[start : start + 4]
    k = int(keep.sum())
    want = reference(r[start : start + 4][keep], k) if k >= 2 else np.zeros(k)
    _close(mine[keep], want, 1e-5, (name, start))
    np.testing.assert_array_equal(mine[~keep], 0.0)


def test_valid_none_is_every_row():
  r, every = _rewards(73), np.ones(NB, bool)
  for name, (fn, _) in _VALID_CASES.items():
    both = _jit(lambda r, v, fn=fn: (fn(r, 4), fn(r, 4, valid=v)), r, every)
    np.testing.assert_allclose(both[0], both[1], rtol=1e-6, atol=1e-7, err_msg=name)


def test_valid_rows_reinforce_pp_baseline_equals_the_batch_without_the_others():
  r, kl = _rewards(74), np.abs(_normal(75, (NB, T)))
  m = _mask(76, NB)
  valid = _one_left_out_per_group(77)

  def fn(r, m, kl, v):
    return reinforce_pp_baseline_advantages(r, m, 4, kl=kl, kl_coef=0.1, gamma=0.9, valid=v)

  got = np.asarray(_jit(fn, np.where(valid, r, np.nan).astype(np.float32), m, kl, valid))
  without = _jit(
    lambda r, m, kl: reinforce_pp_baseline_advantages(r, m, 3, kl=kl, kl_coef=0.1, gamma=0.9),
    r[valid],
    m[valid],
    kl[valid],
  )
  np.testing.assert_array_equal(got[~valid], 0.0)
  _close(got[valid], np.asarray(without), 1e-5)


def test_valid_rows_gradients():
  """d adv / d r is 0 for a left-out row and matches finite differences for
  the others; jit and eager agree."""
  valid = np.array([True, False, True, True, True, True, False, True])

  def fn(r):
    return jnp.concatenate(
      [f(r, 4, valid=valid) for f, _ in _VALID_CASES.values()]
      + [reinforce_pp_baseline_advantages(r, _M, 4, valid=valid).reshape(-1)]
    )

  check_grads(jax.jit(fn), (_SEPARATED,), **_CHECK)
  w = _normal(78, (fn(_SEPARATED).shape[0],))
  grad = jax.jit(jax.grad(lambda r: jnp.sum(w * fn(r))))(_SEPARATED)
  np.testing.assert_array_equal(np.asarray(grad)[~valid], 0.0)
  assert np.all(np.isfinite(grad)) and np.abs(np.asarray(grad)[valid]).sum() > 0
  np.testing.assert_allclose(jax.jit(fn)(_SEPARATED), fn(_SEPARATED), rtol=1e-5, atol=1e-6)


def test_valid_rows_grpo_batch_scale_sharded():
  # 24 rows, G=3, one row of each group left out: the batch std over the
  # valid rows of all 8 shards.
  r, valid = _rewards(79), _one_left_out_per_group(80, g=3)
  call = lambda r, v, **kw: grpo_advantages(r, 3, scale='batch', valid=v, **kw)
  sharded = _shard(lambda r, v: call(r, v, axis_name='data'), r, valid)
  single = _jit(call, r, valid)
  _close(sharded, single, 1e-5)
  _close(np.asarray(single)[valid], np_grpo(r[valid], 2, scale='batch'), 1e-5)


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------

_R4 = np.zeros(4, np.float32)
_R2D = np.zeros((4, 2), np.float32)
_X23 = np.zeros((2, 3), np.float32)
_M23 = np.ones((2, 3), np.float32)
_M43 = np.ones((4, 3), np.float32)

_BAD_INPUTS = {
  # Rank of `rewards`.
  'grpo_rank': (lambda: grpo_advantages(_R2D, 2), '`rewards`'),
  'dr_grpo_rank': (lambda: dr_grpo_advantages(_R2D, 2), '`rewards`'),
  'rloo_rank': (lambda: rloo_advantages(_R2D, 2), '`rewards`'),
  'loo_rank': (lambda: loo_advantages(_R2D, 2), '`rewards`'),
  'tlr_rank': (lambda: token_level_rewards(_R2D, _M23), '`rewards`'),
  'rppb_rank': (lambda: reinforce_pp_baseline_advantages(_R2D, _M43, 2), '`rewards`'),
  # group_size: not dividing B, zero, negative, non-int.
  'grpo_divisible': (lambda: grpo_advantages(_R4, 3), '`group_size`'),
  'dr_grpo_divisible': (lambda: dr_grpo_advantages(_R4, 3), '`group_size`'),
  'rloo_divisible': (lambda: rloo_advantages(_R4, 3), '`group_size`'),
  'loo_divisible': (lambda: loo_advantages(_R4, 3), '`group_size`'),
  'rppb_divisible': (lambda: reinforce_pp_baseline_advantages(_R4, _M43, 3), '`group_size`'),
  'grpo_zero': (lambda: grpo_advantages(_R4, 0), '`group_size`'),
  'grpo_negative': (lambda: grpo_advantages(_R4, -2), '`group_size`'),
  'grpo_float': (lambda: grpo_advantages(_R4, 2.0), '`group_size`'),
  'grpo_bool': (lambda: grpo_advantages(_R4, True), '`group_size`'),
  'rloo_zero': (lambda: rloo_advantages(_R4, 0), '`group_size`'),
  'loo_float': (lambda: loo_advantages(_R4, 2.0), '`group_size`'),
  'rloo_one': (lambda: rloo_advantages(_R4, 1), '`group_size`'),
  # Unknown modes name the argument.
  'grpo_scale': (lambda: grpo_advantages(_R4, 2, scale='global'), '`scale`'),
  'grpo_std': (lambda: grpo_advantages(_R4, 2, std='population'), '`std`'),
  'grpo_singleton': (lambda: grpo_advantages(_R4, 2, singleton='skip'), '`singleton`'),
  'whiten_eps_mode': (lambda: whiten(_X23, _M23, eps_mode='add'), '`eps_mode`'),
  'rpp_eps_mode': (lambda: reinforce_pp_advantages(_X23, _M23, eps_mode='add'), '`eps_mode`'),
  # Negative ε.
  'grpo_eps': (lambda: grpo_advantages(_R4, 2, eps=-1e-6), '`eps`'),
  'loo_eps': (lambda: loo_advantages(_R4, 2, eps=-1e-6), '`eps`'),
  'whiten_eps': (lambda: whiten(_X23, _M23, eps=-1e-8), '`eps`'),
  'rpp_eps': (lambda: reinforce_pp_advantages(_X23, _M23, eps=-1e-8), '`eps`'),
  # γ, λ outside [0, 1].
  'returns_gamma_high': (lambda: discounted_returns(_X23, _M23, gamma=1.01), '`gamma`'),
  'returns_gamma_low': (lambda: discounted_returns(_X23, _M23, gamma=-0.1), '`gamma`'),
  'rpp_gamma': (lambda: reinforce_pp_advantages(_X23, _M23, gamma=1.5), '`gamma`'),
  'gae_gamma_high': (lambda: gae(_X23, _X23, _M23, gamma=1.1), '`gamma`'),
  'gae_gamma_low': (lambda: gae(_X23, _X23, _M23, gamma=-0.5), '`gamma`'),
  'gae_lam_high': (lambda: gae(_X23, _X23, _M23, lam=1.1), '`lam`'),
  'gae_lam_low': (lambda: gae(_X23, _X23, _M23, lam=-0.1), '`lam`'),
  # Shapes.
  'gae_values': (lambda: gae(_X23, np.zeros((2, 4)), _M23), '`values`'),
  'gae_values_bcast': (lambda: gae(_X23, np.zeros((1, 3)), _M23), '`values`'),
  'gae_mask': (lambda: gae(_X23, _X23, np.ones((3, 3))), '`mask`'),
  'gae_rank': (lambda: gae(np.zeros(3), np.zeros(3), np.ones(3)), '`token_rewards`'),
  'returns_mask': (lambda: discounted_returns(_X23, np.ones((2, 4))), '`mask`'),
  'returns_rank': (lambda: discounted_returns(np.zeros(3), np.ones(3)), '`token_rewards`'),
  'whiten_mask': (lambda: whiten(_X23, np.ones((2, 1))), '`mask`'),
  'whiten_rank': (lambda: whiten(np.zeros(3), np.ones(3)), '`x`'),
  'rpp_mask': (lambda: reinforce_pp_advantages(_X23, np.ones((3, 3))), '`mask`'),
  'bcast_adv_rank': (lambda: broadcast_to_tokens(_R2D, _M43), '`adv`'),
  'bcast_mask_rank': (lambda: broadcast_to_tokens(_R4, np.ones(4)), '`mask`'),
  'bcast_mask_rows': (lambda: broadcast_to_tokens(_R4, np.ones((3, 2))), '`mask`'),
  'tlr_mask_rows': (lambda: token_level_rewards(_R4, np.ones((3, 2))), '`mask`'),
  'tlr_mask_rank': (lambda: token_level_rewards(_R4, np.ones(4)), '`mask`'),
  'tlr_kl': (lambda: token_level_rewards(_R4, _M43, kl=np.ones((4, 2))), '`kl`'),
  'rppb_kl': (lambda: reinforce_pp_baseline_advantages(_R4, _M43, 2, kl=np.ones((4, 1))), '`kl`'),
  # `valid` must be [B] like the rewards.
  'grpo_valid_rows': (lambda: grpo_advantages(_R4, 2, valid=np.ones(3, bool)), '`valid`'),
  'loo_valid_rank': (lambda: loo_advantages(_R4, 2, valid=np.ones((4, 1), bool)), '`valid`'),
  'rloo_valid_rows': (lambda: rloo_advantages(_R4, 2, valid=np.ones(8, bool)), '`valid`'),
  'rppb_valid_rows': (
    lambda: reinforce_pp_baseline_advantages(_R4, _M43, 2, valid=np.ones(2, bool)),
    '`valid`',
  ),
}


@pytest.mark.parametrize('name', sorted(_BAD_INPUTS))
def test_bad_input_raises(name):
  call, match = _BAD_INPUTS[name]
  with pytest.raises(ValueError, match=match):
    jax.jit(call)()  # checks run at trace time, so nothing is compiled
