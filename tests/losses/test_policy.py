"""Tests for jrl.losses.policy: PPO clip, GSPO, CISPO and importance weights.

Each kernel is tested four ways (STYLE.md point 14): hand-computed values,
an independent float64 NumPy reference (plus masked vs sliced), gradient
checks (analytic expectations and `jax.test_util.check_grads`), and jit vs
no-jit.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jrl.losses as L

EPS_LOW, EPS_HIGH, DUAL_C = 0.2, 0.28, 3.0
METRIC_TOL = dict(rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------


def _f32(*xs):
  return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _f64(*xs):
  return tuple(np.asarray(x, np.float64) for x in xs)


def _right_padded_mask(lengths, t):
  return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _away_from(x, boundaries, margin):
  """Pushes entries within `margin` of any boundary to 2·margin away from it."""
  x = np.array(x, np.float64)
  for b in boundaries:
    near = np.abs(x - b) < margin
    x = np.where(near, b + np.where(x >= b, 2.0 * margin, -2.0 * margin), x)
  return x


def _ppo_boundaries(eps_low, eps_high, dual_clip_c=None, log_ratio_clamp=None):
  """Kinks of the PPO loss as a function of the log-ratio."""
  out = [math.log(1.0 - eps_low), math.log(1.0 + eps_high)]
  if dual_clip_c is not None:
    out.append(math.log(dual_clip_c))
  if log_ratio_clamp is not None:
    out += [-log_ratio_clamp, log_ratio_clamp]
  return out


def _token_inputs(seed, boundaries, *, b=8, t=16, scale=0.7, margin=0.05, lengths=None):
  """Random float32 (logp, old_logp, advantages, mask) with log-ratios away from kinks."""
  rng = np.random.default_rng(seed)
  old = rng.normal(-2.0, 1.0, (b, t))
  log_ratio = _away_from(rng.normal(0.0, scale, (b, t)), boundaries, margin)
  adv = rng.normal(size=(b, t))
  adv = np.where(np.abs(adv) < 0.1, np.sign(adv + 1e-12) * 0.1 + adv, adv)
  if lengths is None:
    lengths = rng.integers(1, t + 1, size=b)
  mask = _right_padded_mask(lengths, t)
  return _f32(old + log_ratio, old, adv, mask)


def _seq_inputs(seed, seq_log_ratios, seq_adv, lengths, t=8):
  """Inputs whose per-sequence mean log-ratio (over valid tokens) is `seq_log_ratios`.

  The advantage is constant over each sequence (zero on padding, as
  `broadcast_to_tokens` gives) and padding holds moderate garbage.
  """
  rng = np.random.default_rng(seed)
  b = len(seq_log_ratios)
  mask = _right_padded_mask(lengths, t).astype(np.float64)
  noise = rng.normal(0.0, 0.3, (b, t))
  row_mean = (noise * mask).sum(-1, keepdims=True) / mask.sum(-1, keepdims=True)
  log_ratio = np.where(mask > 0, noise - row_mean + np.asarray(seq_log_ratios)[:, None], 0.0)
  log_ratio += (1.0 - mask) * rng.normal(0.0, 3.0, (b, t))  # garbage on padding
  old = rng.normal(-2.0, 1.0, (b, t))
  adv = np.asarray(seq_adv, np.float64)[:, None] * mask
  return _f32(old + log_ratio, old, adv, mask)


def _np_masked_mean(x, mask):
  return float((x * mask).sum() / max(mask.sum(), 1.0))


def _np_ppo(
  logp, old, adv, mask, *, eps_low, eps_high=None, dual_clip_c=None, log_ratio_clamp=None
):
  """Float64 reference straight from the docstring equations.

  Returns (loss, metrics, expected d(sum loss)/d logp).
  """
  logp, old, adv, mask = _f64(logp, old, adv, mask)
  eps_high = eps_low if eps_high is None else eps_high
  log_ratio = logp - old
  clamped = np.zeros_like(log_ratio, bool)
  if log_ratio_clamp is not None:
    clamped = np.abs(log_ratio) > log_ratio_clamp
    log_ratio = np.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp)
  ratio = np.exp(log_ratio)
  loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  high = (adv > 0) & (ratio > 1.0 + eps_high)
  low = (adv < 0) & (ratio < 1.0 - eps_low)
  dual = np.zeros_like(high)
  if dual_clip_c is not None:
    dual = (adv < 0) & (ratio > dual_clip_c)
    loss = np.where(dual, -dual_clip_c * adv, loss)
  # d/dlogp of -A·ρ is -A·ρ; clipped, dual-clipped or clamped tokens are constant.
  grad = np.where(high | low | dual | clamped, 0.0, -adv * ratio) * mask
  metrics = {
    'clipfrac_high': _np_masked_mean(high, mask),
    'clipfrac_low': _np_masked_mean(low, mask),
    'clipfrac': _np_masked_mean(high | low, mask),
    'dual_clipfrac': _np_masked_mean(dual, mask),
    'ppo_kl': _np_masked_mean(-log_ratio, mask),
    'approx_kl': _np_masked_mean(ratio - 1.0 - log_ratio, mask),
  }
  return loss * mask, metrics, grad


def _np_gspo(logp, old, adv, mask, *, eps_low, eps_high):
  logp, old, adv, mask = _f64(logp, old, adv, mask)
  log_ratio = logp - old
  s = np.exp((log_ratio * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))[:, None]
  loss = np.maximum(-adv * s, -adv * np.clip(s, 1.0 - eps_low, 1.0 + eps_high))
  high = (adv > 0) & (s > 1.0 + eps_high)
  low = (adv < 0) & (s < 1.0 - eps_low)
  metrics = {
    'clipfrac_high': _np_masked_mean(high, mask),
    'clipfrac_low': _np_masked_mean(low, mask),
    'clipfrac': _np_masked_mean(high | low, mask),
    'seq_ratio_mean': float(s.mean()),
    'ppo_kl': _np_masked_mean(-log_ratio, mask),
    'approx_kl': _np_masked_mean(np.exp(log_ratio) - 1.0 - log_ratio, mask),
  }
  return loss * mask, metrics


def _np_cispo(logp, old, adv, mask, *, eps_low, eps_high):
  """Returns (loss, metrics, expected d(sum loss)/d logp)."""
  logp, old, adv, mask = _f64(logp, old, adv, mask)
  log_ratio = logp - old
  ratio = np.exp(log_ratio)
  lower = 0.0 if eps_low is None else 1.0 - eps_low
  weight = np.clip(ratio, lower, 1.0 + eps_high)
  high = ratio > 1.0 + eps_high
  low = ratio < lower
  metrics = {
    'clipfrac_high': _np_masked_mean(high, mask),
    'clipfrac_low': _np_masked_mean(low, mask),
    'clipfrac': _np_masked_mean(high | low, mask),
    'ppo_kl': _np_masked_mean(-log_ratio, mask),
    'approx_kl': _np_masked_mean(ratio - 1.0 - log_ratio, mask),
  }
  return -weight * adv * logp * mask, metrics, -weight * adv * mask


def _assert_metrics(got, want, **tol):
  tol = tol or METRIC_TOL
  assert set(want) <= set(got)
  for k, v in want.items():
    np.testing.assert_allclose(float(got[k]), v, err_msg=k, **tol)


def _run(fn, logp, old_logp, advantages, mask, **kw):
  """(loss, metrics, d(sum loss)/d logp), without jit.

  Eager ops are compiled once per shape and reused whatever the
  hyperparameters, so the tests stick to a few shapes ([1, 8] hand-computed
  rows, [8, 16] random tokens, [6, 8] random sequences) to stay fast.
  """

  def total(lp):
    loss, metrics = fn(lp, old_logp, advantages, mask, **kw)
    return jnp.sum(loss), (loss, metrics)

  grad, (loss, metrics) = jax.grad(total, has_aux=True)(logp)
  return loss, metrics, grad


ROW_T = 8  # hand-computed rows are padded to one width so they share compiled programs


def _row(log_ratios, advantages, mask=None, old=-1.0):
  """A [1, 8] batch: the given log-ratios around a constant old_logp, then masked padding."""
  n = len(log_ratios)
  lr = np.zeros((1, ROW_T))
  lr[0, :n] = log_ratios
  adv = np.zeros((1, ROW_T))
  adv[0, :n] = advantages
  m = np.zeros((1, ROW_T))
  m[0, :n] = 1.0 if mask is None else np.asarray(mask, np.float64)
  return _f32(old + lr, np.full_like(lr, old), adv, m)


# ----------------------------------------------------------------------------
# ppo_clip_loss: hand-computed values.
# ----------------------------------------------------------------------------


def test_ppo_hand_computed_clip_regions_and_metrics():
  # ε_low = 0.2, ε_high = 0.28, c = 3. Token (ratio ρ, advantage A):
  #  0 (1.5,  +1): A>0, ρ > 1.28: max(-1.5, -1.28) = -1.28          clip high
  #  1 (0.5,  -1): A<0, ρ < 0.8:  max(0.5, 0.8) = 0.8; min(0.8, 3)   clip low
  #  2 (10,   -1): max(10, 1.28) = 10; dual: min(10, -c·A = 3) = 3   dual clip
  #  3 (1.1,  +2): max(-2.2, -2.2) = -2.2                             unclipped
  #  4 (0.5,  +1): max(-0.5, -0.8) = -0.5  (A>0, low ρ is not clipped)
  #  5 (1.5,  -1): max(1.5, 1.28) = 1.5; min(1.5, 3) = 1.5            unclipped
  #  6 (100,  +5): masked out: loss 0, excluded from the metrics.
  ratios = [1.5, 0.5, 10.0, 1.1, 0.5, 1.5, 100.0]
  adv = [1.0, -1.0, -1.0, 2.0, 1.0, -1.0, 5.0]
  logp, old, adv, mask = _row(np.log(ratios), adv, [1, 1, 1, 1, 1, 1, 0])
  kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip_c=DUAL_C)
  loss, metrics, grad = _run(L.ppo_clip_loss, logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss[0, :7], [-1.28, 0.8, 3.0, -2.2, -0.5, 1.5, 0.0], rtol=1e-5)
  # Gradient: -A·ρ on unclipped tokens (3: -2·1.1, 4: -1·0.5, 5: +1·1.5), 0 elsewhere.
  np.testing.assert_allclose(grad[0, :7], [0, 0, 0, -2.2, -0.5, 1.5, 0], rtol=1e-5, atol=1e-7)
  # Six valid tokens. ppo_kl = -mean(log ρ)
  #   = -(0.405465 - 0.693147 + 2.302585 + 0.095310 - 0.693147 + 0.405465)/6 = -0.303755;
  # approx_kl = mean((ρ - 1) - log ρ)
  #   = (0.094535 + 0.193147 + 6.697415 + 0.004690 + 0.193147 + 0.094535)/6 = 1.212911.
  _assert_metrics(
    metrics,
    {
      'clipfrac_high': 1 / 6,  # token 0
      'clipfrac_low': 1 / 6,  # token 1
      'clipfrac': 2 / 6,
      'dual_clipfrac': 1 / 6,  # token 2
      'ppo_kl': -0.30375519,
      'approx_kl': 1.21291148,
    },
  )


def test_ppo_clip_higher_only_moves_the_upper_bound():
  # Token 0: ρ = 1.25, A = +1. Symmetric ε = 0.2 clips at 1.2: max(-1.25, -1.2) = -1.2;
  #   ε_high = 0.28 leaves it unclipped: -1.25.
  # Token 1: ρ = 0.75, A = -1. ε_low = 0.2 clips at 0.8: max(0.75, 0.8) = 0.8 either way.
  logp, old, adv, mask = _row([math.log(1.25), math.log(0.75)], [1.0, -1.0])
  sym, m_sym, _ = _run(L.ppo_clip_loss, logp, old, adv, mask, eps_low=0.2)
  hi, m_hi, _ = _run(L.ppo_clip_loss, logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
  np.testing.assert_allclose(sym[0, :2], [-1.2, 0.8], rtol=1e-6)
  np.testing.assert_allclose(hi[0, :2], [-1.25, 0.8], rtol=1e-6)
  _assert_metrics(m_sym, {'clipfrac_high': 0.5, 'clipfrac_low': 0.5, 'clipfrac': 1.0})
  _assert_metrics(m_hi, {'clipfrac_high': 0.0, 'clipfrac_low': 0.5, 'clipfrac': 0.5})


def test_ppo_dual_clip_only_caps_negative_advantages():
  # Token 0: ρ = 10, A = -1: max(10, 1.28) = 10; uncapped without dual clip, 3 with c = 3.
  # Token 1: ρ = 10, A = +1: max(-10, -1.28) = -1.28 with or without dual clip.
  logp, old, adv, mask = _row([math.log(10.0)] * 2, [-1.0, 1.0])
  kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH)
  plain, m_plain, _ = _run(L.ppo_clip_loss, logp, old, adv, mask, **kw)
  dual, m_dual, _ = _run(L.ppo_clip_loss, logp, old, adv, mask, dual_clip_c=DUAL_C, **kw)
  np.testing.assert_allclose(plain[0, :2], [10.0, -1.28], rtol=1e-5)
  np.testing.assert_allclose(dual[0, :2], [3.0, -1.28], rtol=1e-5)
  _assert_metrics(m_plain, {'dual_clipfrac': 0.0, 'clipfrac_high': 0.5})
  _assert_metrics(m_dual, {'dual_clipfrac': 0.5, 'clipfrac_high': 0.5})


def test_ppo_log_ratio_clamp_caps_the_ratio():
  # log ρ = 2 clamped to 0.5: ρ = e^0.5 = 1.648721; A = -1 -> loss 1.648721, grad 0.
  logp, old, adv, mask = _row([2.0], [-1.0])
  loss, metrics, grad = _run(L.ppo_clip_loss, logp, old, adv, mask, log_ratio_clamp=0.5)
  np.testing.assert_allclose(loss[0, 0], math.exp(0.5), rtol=1e-6)
  np.testing.assert_allclose(metrics['ppo_kl'], -0.5, rtol=1e-6)  # of the clamped log-ratio
  assert float(grad[0, 0]) == 0.0


# ----------------------------------------------------------------------------
# ppo_clip_loss: reference, gradients.
# ----------------------------------------------------------------------------

PPO_CONFIGS = [
  dict(eps_low=0.2),
  dict(eps_low=0.2, eps_high=0.28),
  dict(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0),
  dict(eps_low=0.1, eps_high=0.3, dual_clip_c=2.0, log_ratio_clamp=1.0),
]


def _ppo_kinks(kw):
  eps_high = kw.get('eps_high') or kw['eps_low']
  return _ppo_boundaries(kw['eps_low'], eps_high, kw.get('dual_clip_c'), kw.get('log_ratio_clamp'))


@pytest.mark.parametrize('kw', PPO_CONFIGS)
def test_ppo_matches_numpy_reference_and_analytic_gradient(kw):
  logp, old, adv, mask = _token_inputs(0, _ppo_kinks(kw))
  loss, metrics, grad = _run(L.ppo_clip_loss, logp, old, adv, mask, **kw)
  want_loss, want_metrics, want_grad = _np_ppo(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  _assert_metrics(metrics, want_metrics)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
  # The random batch exercises every region this config has.
  assert want_metrics['clipfrac_high'] > 0 and want_metrics['clipfrac_low'] > 0
  assert np.any(want_grad != 0)
  if 'dual_clip_c' in kw:
    assert want_metrics['dual_clipfrac'] > 0
  if 'log_ratio_clamp' in kw:
    lr = np.asarray(logp, np.float64) - np.asarray(old, np.float64)
    assert np.any((np.abs(lr) > kw['log_ratio_clamp']) & (np.asarray(mask) > 0))


@pytest.mark.parametrize('kw', PPO_CONFIGS[2:])
def test_ppo_check_grads(kw):
  logp, old, adv, mask = _token_inputs(1, _ppo_kinks(kw))
  f = lambda lp: L.ppo_clip_loss(lp, old, adv, mask, **kw)[0]
  check_grads(f, (logp,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


# ----------------------------------------------------------------------------
# gspo_loss.
# ----------------------------------------------------------------------------

# (eps_low, eps_high, scale): rows get mean log-ratios scale·[4, -4, 1, -1, 4, -4]
# and advantages [+, -, +, -, -, +], so rows 0/1 are clipped (high/low) and
# rows 2-5 are not.
GSPO_CONFIGS = [(3e-4, 4e-4, 2e-4), (0.2, 0.28, 0.1)]
GSPO_ADV = [1.0, -1.0, 0.5, -2.0, -1.0, 1.5]
GSPO_LENGTHS = [8, 5, 3, 1, 6, 2]


def _gspo_inputs(seed, scale):
  targets = scale * np.array([4.0, -4.0, 1.0, -1.0, 4.0, -4.0])
  return _seq_inputs(seed, targets, GSPO_ADV, GSPO_LENGTHS)


def test_gspo_hand_computed():
  # One sequence of 2 valid tokens with log-ratios 0.3 and 0.5 (+ padding with 7):
  # s = exp((0.3 + 0.5)/2) = exp(0.4) = 1.491825. ε = 0.2/0.28.
  # A = +1: max(-1.491825, -1.28) = -1.28 on both valid tokens, clipfrac_high = 1.
  # A = -1: max(1.491825, 1.28) = 1.491825 on both, unclipped.
  for a, want, high in [(1.0, -1.28, 1.0), (-1.0, math.exp(0.4), 0.0)]:
    logp, old, adv, mask = _row([0.3, 0.5, 7.0], [a, a, 0.0], [1, 1, 0])
    loss, metrics, _ = _run(L.gspo_loss, logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(loss[0, :3], [want, want, 0.0], rtol=1e-5)
    _assert_metrics(metrics, {'clipfrac_high': high, 'seq_ratio_mean': math.exp(0.4)})


@pytest.mark.parametrize('eps_low, eps_high, scale', GSPO_CONFIGS)
def test_gspo_matches_numpy_reference(eps_low, eps_high, scale):
  logp, old, adv, mask = _gspo_inputs(0, scale)
  kw = dict(eps_low=eps_low, eps_high=eps_high)
  loss, metrics, _ = _run(L.gspo_loss, logp, old, adv, mask, **kw)
  want_loss, want_metrics = _np_gspo(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  _assert_metrics(metrics, want_metrics)
  assert want_metrics['clipfrac_high'] > 0 and want_metrics['clipfrac_low'] > 0


def _gspo_sequence_objective(logp, old, adv, mask, eps_low, eps_high):
  """mean_i max(-A_i s_i, -A_i clip(s_i)), s_i = exp(mean_t(logp - old)); no token trick."""
  length_B = jnp.sum(mask, axis=-1)
  s_B = jnp.exp(jnp.sum((logp - old) * mask, axis=-1) / length_B)
  adv_B = jnp.sum(adv * mask, axis=-1) / length_B  # A is constant over a sequence
  obj_B = jnp.maximum(-adv_B * s_B, -adv_B * jnp.clip(s_B, 1.0 - eps_low, 1.0 + eps_high))
  return jnp.mean(obj_B)


@pytest.mark.parametrize('eps_low, eps_high, scale', GSPO_CONFIGS)
def test_gspo_gradient_equals_sequence_level_objective(eps_low, eps_high, scale):
  logp, old, adv, mask = _gspo_inputs(1, scale)
  kw = dict(eps_low=eps_low, eps_high=eps_high)

  def both(lp):
    token_form = lambda x: L.seq_mean_token_mean(L.gspo_loss(x, old, adv, mask, **kw)[0], mask)
    seq_form = lambda x: _gspo_sequence_objective(x, old, adv, mask, **kw)
    return jax.value_and_grad(token_form)(lp), jax.value_and_grad(seq_form)(lp)

  (value, grad), (want_value, want_grad) = both(logp)
  np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-7)
  # Clipped rows (0, 1) get no gradient, unclipped rows do, padding gets none.
  grad, mask = np.asarray(grad), np.asarray(mask)
  assert np.all(grad[:2] == 0.0)
  assert np.all(np.abs(grad[2:])[mask[2:] > 0] > 0)
  assert np.all(grad[mask == 0] == 0.0)


def test_gspo_check_grads_of_reduced_loss():
  # The per-token GSPO values are s_i on every token while the gradient of
  # token t only flows through logp_t, so only the seq-mean-token-mean
  # reduction is a function whose numerical derivative is the gradient.
  logp, old, adv, mask = _gspo_inputs(2, 0.1)
  f = lambda lp: L.seq_mean_token_mean(
    L.gspo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)[0], mask
  )
  check_grads(f, (logp,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


# ----------------------------------------------------------------------------
# cispo_loss.
# ----------------------------------------------------------------------------


def test_cispo_hand_computed():
  # ε_high = 0.28, no lower bound. loss = -clip(ρ)·A·logp, gradient -clip(ρ)·A.
  #  ρ = 2,   A = +1, logp = -1 + log 2 = -0.306853: w = min(2, 1.28) = 1.28,
  #           loss = -1.28·1·(-0.306853) = 0.392772; grad = -1.28·1 = -1.28.
  #  ρ = 0.5, A = -2, logp = -1 - log 2 = -1.693147: w = 0.5 (no lower bound),
  #           loss = -0.5·(-2)·(-1.693147) = -1.693147; grad = -0.5·(-2) = 1.
  #  ρ = 2,   A = -1: the weight is clipped whatever the sign of A: w = 1.28, grad 1.28.
  logp, old, adv, mask = _row([math.log(2.0), math.log(0.5), math.log(2.0)], [1.0, -2.0, -1.0])
  loss, metrics, grad = _run(L.cispo_loss, logp, old, adv, mask)
  np.testing.assert_allclose(loss[0, :2], [0.3927716, -1.6931472], rtol=1e-5)
  np.testing.assert_allclose(grad[0, :3], [-1.28, 1.0, 1.28], rtol=1e-6)
  _assert_metrics(metrics, {'clipfrac_high': 2 / 3, 'clipfrac_low': 0.0, 'clipfrac': 2 / 3})
  # With ε_low = 0.2 the second weight becomes 0.8: grad = -0.8·(-2) = 1.6.
  _, metrics, grad = _run(L.cispo_loss, logp, old, adv, mask, eps_low=0.2)
  np.testing.assert_allclose(grad[0, :3], [-1.28, 1.6, 1.28], rtol=1e-6)
  _assert_metrics(metrics, {'clipfrac_high': 2 / 3, 'clipfrac_low': 1 / 3, 'clipfrac': 1.0})


@pytest.mark.parametrize('eps_low', [None, 0.2])
def test_cispo_matches_numpy_reference_and_gradient(eps_low):
  kinks = [math.log(1.28)] + ([] if eps_low is None else [math.log(1.0 - eps_low)])
  logp, old, adv, mask = _token_inputs(3, kinks)
  kw = dict(eps_low=eps_low, eps_high=0.28)
  loss, metrics, grad = _run(L.cispo_loss, logp, old, adv, mask, **kw)
  want_loss, want_metrics, want_grad = _np_cispo(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  _assert_metrics(metrics, want_metrics)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  # Clipped tokens keep a (clipped-weight) gradient, unlike PPO.
  ratio = np.exp(np.asarray(logp, np.float64) - np.asarray(old, np.float64))
  clipped = (ratio > 1.28) & (np.asarray(mask) > 0)
  assert clipped.any() and np.all(np.asarray(grad)[clipped] != 0)
  if eps_low is not None:
    assert want_metrics['clipfrac_low'] > 0


def test_cispo_check_grads_where_weight_is_clipped():
  # CISPO's value contains sg[w]·logp, so its numerical derivative equals the
  # gradient only where w is locally constant: every ρ outside [0.8, 1.28].
  rng = np.random.default_rng(4)
  shape = (8, 16)
  lr = np.where(rng.random(shape) < 0.5, 1.0, -1.0) * rng.uniform(0.4, 1.0, shape)
  old = rng.normal(-2.0, 1.0, shape)
  mask = _right_padded_mask(rng.integers(1, 17, size=8), 16)
  logp, old, adv, mask = _f32(old + lr, old, rng.normal(size=shape), mask)
  f = lambda lp: L.cispo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)[0]
  check_grads(f, (logp,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


# ----------------------------------------------------------------------------
# All three losses: jit, masks, extremes.
# ----------------------------------------------------------------------------

LOSSES = [
  pytest.param(L.ppo_clip_loss, dict(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0), id='ppo'),
  pytest.param(L.gspo_loss, dict(eps_low=0.2, eps_high=0.28), id='gspo'),
  pytest.param(L.cispo_loss, dict(eps_low=0.2, eps_high=0.28), id='cispo'),
]


def _tree_allclose(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, **tol)


def _all_finite(tree):
  return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize('fn, kw', LOSSES)
def test_jit_matches_no_jit(fn, kw):
  logp, old, adv, mask = _gspo_inputs(5, 0.1)
  eager = _run(fn, logp, old, adv, mask, **kw)
  jitted = jax.jit(functools.partial(_run, fn, **kw))(logp, old, adv, mask)
  _tree_allclose(eager, jitted, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('fn, kw', LOSSES)
def test_masked_tokens_have_zero_loss_and_gradient(fn, kw):
  lengths = [16, 0, 3, 5, 9, 1, 12, 7]
  logp, old, adv, mask = _token_inputs(6, _ppo_boundaries(0.2, 0.28, 3.0), lengths=lengths)
  pad = np.asarray(mask) == 0
  loss, metrics, grad = _run(fn, logp, old, adv, mask, **kw)
  assert np.all(np.asarray(loss)[pad] == 0.0)
  assert np.all(np.asarray(grad)[pad] == 0.0)
  assert np.any(np.asarray(grad)[~pad] != 0.0)
  assert _all_finite(metrics)


@pytest.mark.parametrize('fn, kw', LOSSES)
def test_fully_masked_input_gives_zero_loss_and_finite_gradients(fn, kw):
  logp, old, adv, mask = _token_inputs(7, [])
  mask = jnp.zeros_like(mask)
  loss, metrics, grad = _run(fn, logp, old, adv, mask, **kw)
  assert np.all(np.asarray(loss) == 0.0)
  assert np.all(np.asarray(grad) == 0.0)
  assert _all_finite(metrics)
  # Through a reduction too (token counts of 0 must not divide).
  for reduce in (L.token_mean, L.seq_mean_token_mean):
    g = jax.grad(lambda lp, r=reduce: r(fn(lp, old, adv, mask, **kw)[0], mask))(logp)
    assert np.all(np.isfinite(g))


@pytest.mark.parametrize('fn, kw', LOSSES)
def test_masked_matches_sliced_rows(fn, kw):
  # Right-padded rows with garbage on the padding: the per-token loss on the
  # valid positions equals the loss of the rows cut to their length (rows of
  # equal length are cut together; for GSPO this means the padding does not
  # enter s_i), and each metric is the token- (or, for seq_ratio_mean,
  # sequence-) weighted mean of the metrics of the cut batches.
  lengths = np.array([8, 3, 3, 8, 3, 8])
  targets = 0.1 * np.array([4.0, -4.0, 1.0, -1.0, 4.0, -4.0])
  logp, old, adv, mask = _seq_inputs(8, targets, GSPO_ADV, lengths)
  loss, metrics, _ = _run(fn, logp, old, adv, mask, **kw)
  sliced_run = jax.jit(functools.partial(_run, fn, **kw))  # new shapes compile faster jitted
  want = {k: 0.0 for k in metrics}
  for n in np.unique(lengths):
    rows = np.flatnonzero(lengths == n)
    sl = lambda x, rows=rows, n=n: jnp.asarray(np.asarray(x)[rows, :n])
    sliced_loss, sliced_metrics, _ = sliced_run(sl(logp), sl(old), sl(adv), sl(mask))
    np.testing.assert_allclose(loss[rows, :n], sliced_loss, rtol=1e-5, atol=1e-6)
    for k, v in sliced_metrics.items():
      share = len(rows) / len(lengths) if k == 'seq_ratio_mean' else len(rows) * n / lengths.sum()
      want[k] += share * float(v)
  _assert_metrics(metrics, want)


@pytest.mark.parametrize('fn, kw', LOSSES)
def test_padding_values_never_reach_loss_gradient_or_metrics(fn, kw):
  # Documented: the loss is zero where the mask is 0 and the metrics are
  # masked means. A padding position whose log-ratio overflows exp
  # (old_logp = -100 there, logp = 0, advantage 0 as `broadcast_to_tokens`
  # gives) must not turn them into NaN.
  logp, old, adv, mask = _row([0.1, -0.1], [1.0, -1.0])
  logp, old = np.array(logp), np.array(old)
  logp[0, 2:], old[0, 2:] = 0.0, -100.0
  logp, old = _f32(logp, old)
  loss, metrics, grad = _run(fn, logp, old, adv, mask, **kw)
  assert np.all(np.asarray(loss)[0, 2:] == 0.0), loss
  assert np.all(np.asarray(grad)[0, 2:] == 0.0), grad
  bad = {k: float(v) for k, v in metrics.items() if not np.isfinite(float(v))}
  assert not bad, f'non-finite metrics from masked padding: {bad}'


EXTREME_LOG_RATIOS = [50.0, -50.0, 1000.0, -1000.0]


@pytest.mark.parametrize('dual_clip_c', [None, 3.0])
def test_ppo_extreme_log_ratios_finite_with_clamp(dual_clip_c):
  logp, old, adv, mask = _row(EXTREME_LOG_RATIOS * 2, [1.0] * 4 + [-1.0] * 4)
  kw = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=dual_clip_c, log_ratio_clamp=20.0)
  loss, metrics, grad = _run(L.ppo_clip_loss, logp, old, adv, mask, **kw)
  assert _all_finite((loss, metrics, grad))
  # Every |log ρ| ≥ 50 is clamped to ±20, so no token gets a gradient.
  assert np.all(np.asarray(grad) == 0.0)
  # A < 0, log ρ = +50: ρ = e^20 = 4.85e8 -> loss 4.85e8, or c·|A| = 3 with dual clip.
  want = 3.0 if dual_clip_c else math.exp(20.0)
  np.testing.assert_allclose(loss[0, 4], want, rtol=1e-5)


def test_ppo_extreme_log_ratios_loss_finite_without_clamp_when_clipped():
  # Without log_ratio_clamp, ρ = exp(1000) = inf in float32. Where the clip
  # selects the constant branch the *loss value* stays finite:
  #  A = +2, log ρ = +50/+1000: max(-2ρ, -2·1.28) = -2.56
  #  A = -1, log ρ = -50/-1000: max(ρ, 0.8) = 0.8
  #  A = -1, log ρ = +1000 with dual clip c = 3: min(max(inf, 1.28), 3) = 3.
  # Only the loss is asserted: its gradient at ρ = inf is not promised finite
  # (log_ratio_clamp is for that), nor are the KL metrics.
  logp, old, adv, mask = _row([50.0, 1000.0, -50.0, -1000.0, 1000.0], [2, 2, -1, -1, -1])
  kw = dict(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
  loss, _, _ = _run(L.ppo_clip_loss, logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss[0, :5], [-2.56, -2.56, 0.8, 0.8, 3.0], rtol=1e-6)


@pytest.mark.parametrize('fn, kw', LOSSES[1:])
def test_gspo_cispo_large_log_ratios_finite(fn, kw):
  # Neither takes a clamp; at |log ρ| = 50 (exp still finite in float32) loss
  # and gradient are finite for either sign of A. One row per case.
  lr = np.array([50.0, -50.0, 50.0, -50.0, 50.0, -50.0])[:, None] * np.ones((1, 8))
  adv = np.array([1.0, 1.0, -1.0, -1.0, 2.0, -2.0])[:, None] * np.ones((1, 8))
  old = np.full_like(lr, -1.0)
  logp, old, adv, mask = _f32(old + lr, old, adv, np.ones_like(lr))
  loss, _, grad = _run(fn, logp, old, adv, mask, **kw)
  assert _all_finite((loss, grad))


def test_cispo_extreme_log_ratios_finite():
  # The weight is clipped to [0.8, 1.28] before it multiplies logp, so even
  # log ρ = ±1000 (ρ = inf or 0) gives finite loss and gradient -w·A.
  logp, old, adv, mask = _row(EXTREME_LOG_RATIOS * 2, [1.0] * 4 + [-1.0] * 4)
  loss, _, grad = _run(L.cispo_loss, logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
  assert _all_finite((loss, grad))
  np.testing.assert_allclose(grad[0], [-1.28, -0.8] * 2 + [1.28, 0.8] * 2, rtol=1e-6)


# ----------------------------------------------------------------------------
# importance_weights.
# ----------------------------------------------------------------------------


def _is_inputs():
  # Row 0: token weights w = [3, 1.5, 0.25] and a padding token (w = 10, masked).
  # Row 1: w = 2.5 on all four tokens.
  w = np.array([[3.0, 1.5, 0.25, 10.0], [2.5, 2.5, 2.5, 2.5]])
  sampler = np.full_like(w, -2.0)
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], np.float32)
  return _f32(sampler + np.log(w), sampler, mask)


# (level, mode, kwargs, weights, is_weight_mean, is_clipped_frac); 7 valid tokens.
IS_HAND_CASES = [
  # token: min(w, 2). mean of w = (3 + 1.5 + 0.25 + 4·2.5)/7 = 14.75/7; 1 + 4 capped.
  ('token', 'truncate', {}, [[2, 1.5, 0.25, 0], [2, 2, 2, 2]], 14.75 / 7, 5 / 7),
  # token mask, low = 1/2: keep 0.5 ≤ w ≤ 2 -> only 1.5 survives; 2 + 4 dropped.
  ('token', 'mask', {}, [[0, 1.5, 0, 0], [0, 0, 0, 0]], 14.75 / 7, 6 / 7),
  ('token', 'mask', dict(low=0.2, high=4.0), [[3, 1.5, 0.25, 0], [2.5] * 4], 14.75 / 7, 0.0),
  # sequence: row 0: 3·1.5·0.25 = 1.125 (padding excluded); row 1: 2.5^4 = 39.0625 -> 2.
  # mean = (3·1.125 + 4·39.0625)/7 = 159.625/7.
  ('sequence', 'truncate', {}, [[1.125] * 3 + [0], [2] * 4], 159.625 / 7, 4 / 7),
  ('sequence', 'mask', {}, [[1.125] * 3 + [0], [0] * 4], 159.625 / 7, 4 / 7),
  # geometric: row 0: 1.125^(1/3) = 1.040042; row 1: 2.5 -> 2 (truncate) or 0 (mask).
  # mean = (3·1.040042 + 4·2.5)/7 = 1.874304.
  ('geometric', 'truncate', {}, [[1.040042] * 3 + [0], [2] * 4], 1.874304, 4 / 7),
  ('geometric', 'mask', {}, [[1.040042] * 3 + [0], [0] * 4], 1.874304, 4 / 7),
]


@pytest.mark.parametrize('level, mode, kw, want, weight_mean, clipped_frac', IS_HAND_CASES)
def test_importance_weights_hand_computed(level, mode, kw, want, weight_mean, clipped_frac):
  old, sampler, mask = _is_inputs()
  w, metrics = L.importance_weights(old, sampler, mask, level=level, mode=mode, **kw)
  np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-7)
  _assert_metrics(metrics, {'is_weight_mean': weight_mean, 'is_clipped_frac': clipped_frac})


def test_importance_weights_log_ratio_abs_max_ignores_padding():
  old, sampler, mask = _is_inputs()
  # token: the largest valid |log w| is |log 0.25| = 1.386294 (padding log 10 ignored).
  _, m = L.importance_weights(old, sampler, mask)
  np.testing.assert_allclose(m['is_log_ratio_abs_max'], math.log(4.0), rtol=1e-5)
  # sequence: row 1: log 39.0625 = 3.665163.
  _, m = L.importance_weights(old, sampler, mask, level='sequence')
  np.testing.assert_allclose(m['is_log_ratio_abs_max'], math.log(39.0625), rtol=1e-5)


def _np_importance_weights(old, sampler, mask, level, mode, high, low):
  old, sampler, mask = _f64(old, sampler, mask)
  log_w = (old - sampler) * mask
  if level != 'token':
    total = log_w.sum(-1, keepdims=True)
    if level == 'geometric':
      total = total / np.maximum(mask.sum(-1, keepdims=True), 1.0)
    log_w = np.broadcast_to(total, log_w.shape)
  w = np.exp(log_w)
  if mode == 'truncate':
    out, clipped = np.minimum(w, high), w > high
  else:
    low = 1.0 / high if low is None else low
    keep = (w >= low) & (w <= high)
    out, clipped = np.where(keep, w, 0.0), ~keep
  return out * mask, _np_masked_mean(w, mask), _np_masked_mean(clipped, mask)


@pytest.mark.parametrize('level', ['token', 'sequence', 'geometric'])
@pytest.mark.parametrize(
  'mode, high, low', [('truncate', 1.5, None), ('mask', 1.5, None), ('mask', 1.3, 0.0)]
)
def test_importance_weights_match_numpy_reference(level, mode, high, low):
  rng = np.random.default_rng(9)
  b, t = 32, 6
  sampler = rng.normal(-2.0, 1.0, (b, t))
  scale = {'token': 0.4, 'sequence': 0.25, 'geometric': 0.6}[level]
  old = sampler + rng.normal(0.0, scale, (b, t))
  mask = _right_padded_mask(rng.integers(1, t + 1, size=b), t)
  old, sampler, mask = _f32(old, sampler, mask)
  kw = dict(level=level, mode=mode, high=high, low=low)
  w, metrics = L.importance_weights(old, sampler, mask, **kw)
  want, weight_mean, clipped_frac = _np_importance_weights(old, sampler, mask, **kw)
  np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-7)
  _assert_metrics(metrics, {'is_weight_mean': weight_mean, 'is_clipped_frac': clipped_frac})
  assert 0.0 < clipped_frac < 1.0  # both branches are exercised


def test_importance_weights_sequence_is_product_and_geometric_is_mean():
  rng = np.random.default_rng(10)
  sampler = rng.normal(-2.0, 1.0, (32, 6))
  old = sampler + rng.normal(0.0, 0.2, (32, 6))
  lengths = rng.integers(1, 7, size=32)
  mask = _right_padded_mask(lengths, 6)
  old, sampler, mask = _f32(old, sampler, mask)
  no_cap = dict(mode='truncate', high=1e6)
  tok, _ = L.importance_weights(old, sampler, mask, level='token', **no_cap)
  seq, _ = L.importance_weights(old, sampler, mask, level='sequence', **no_cap)
  geo, _ = L.importance_weights(old, sampler, mask, level='geometric', **no_cap)
  valid = np.asarray(mask)
  prod = np.prod(np.where(valid > 0, np.asarray(tok, np.float64), 1.0), axis=-1)
  np.testing.assert_allclose(seq, prod[:, None] * valid, rtol=1e-5)
  np.testing.assert_allclose(geo, (prod ** (1.0 / lengths))[:, None] * valid, rtol=1e-5)


def test_importance_weights_are_stop_gradient():
  old, sampler, mask = _is_inputs()

  def grads(o, s):
    # d/d(old_logp, sampler_logp) of the weights and every metric, each level and mode.
    total = lambda o, s: sum(
      jnp.sum(w) + sum(metrics.values())
      for level in ('token', 'sequence', 'geometric')
      for mode in ('truncate', 'mask')
      for w, metrics in [L.importance_weights(o, s, mask, level=level, mode=mode)]
    )
    return jax.grad(total, argnums=(0, 1))(o, s)

  g_old, g_sampler = grads(old, sampler)
  assert np.all(np.asarray(g_old) == 0.0)
  assert np.all(np.asarray(g_sampler) == 0.0)


@pytest.mark.parametrize('level', ['token', 'sequence', 'geometric'])
def test_importance_weights_jit_matches_no_jit(level):
  old, sampler, mask = _is_inputs()
  kw = dict(level=level, mode='mask', high=3.0)
  eager = L.importance_weights(old, sampler, mask, **kw)
  jitted = jax.jit(functools.partial(L.importance_weights, **kw))(old, sampler, mask)
  _tree_allclose(eager, jitted, rtol=1e-6, atol=1e-7)


def test_importance_weights_fully_masked_are_zero_and_finite():
  old, sampler, mask = _is_inputs()
  mask = jnp.zeros_like(mask)
  for level in ('token', 'sequence', 'geometric'):
    w, metrics = L.importance_weights(old, sampler, mask, level=level)
    assert np.all(np.asarray(w) == 0.0)
    assert _all_finite(metrics)


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------

_BT = np.zeros((2, 3), np.float32)
_BAD_SHAPE = np.zeros((2, 4), np.float32)


@pytest.mark.parametrize('fn', [L.ppo_clip_loss, L.gspo_loss, L.cispo_loss])
@pytest.mark.parametrize('which', ['old_logp', 'advantages', 'mask'])
def test_mismatched_shapes_name_the_argument(fn, which):
  args = dict(logp=_BT, old_logp=_BT, advantages=_BT, mask=_BT)
  args[which] = _BAD_SHAPE
  with pytest.raises(ValueError, match=f'`{which}` must have the same shape as `logp`'):
    fn(**args)


@pytest.mark.parametrize('fn', [L.ppo_clip_loss, L.gspo_loss, L.cispo_loss])
def test_rank_1_logp_raises(fn):
  x = np.zeros((3,), np.float32)
  with pytest.raises(ValueError, match=r'`logp` must have shape \[B, T\]'):
    fn(x, x, x, x)


@pytest.mark.parametrize(
  'fn, kw, name',
  [
    (L.ppo_clip_loss, dict(eps_low=0.0), 'eps_low'),
    (L.ppo_clip_loss, dict(eps_low=-0.1), 'eps_low'),
    (L.ppo_clip_loss, dict(eps_high=0.0), 'eps_high'),
    (L.ppo_clip_loss, dict(dual_clip_c=1.0), 'dual_clip_c'),
    (L.ppo_clip_loss, dict(dual_clip_c=0.5), 'dual_clip_c'),
    (L.ppo_clip_loss, dict(log_ratio_clamp=0.0), 'log_ratio_clamp'),
    (L.gspo_loss, dict(eps_low=0.0), 'eps_low'),
    (L.gspo_loss, dict(eps_high=-1e-4), 'eps_high'),
    (L.cispo_loss, dict(eps_low=0.0), 'eps_low'),
    (L.cispo_loss, dict(eps_high=0.0), 'eps_high'),
  ],
)
def test_bad_hyperparameters_name_the_argument(fn, kw, name):
  with pytest.raises(ValueError, match=f'`{name}` must be'):
    fn(_BT, _BT, _BT, _BT, **kw)


@pytest.mark.parametrize(
  'kw, pattern',
  [
    (dict(level='seq'), '`level` must be one of'),
    (dict(mode='clip'), '`mode` must be one of'),
    (dict(high=0.0), '`high` must be > 0'),
    (dict(mode='mask', low=3.0, high=2.0), r'`low` \(3.0\) must be <= `high` \(2.0\)'),
    (dict(mode='mask', high=0.5), r'`low` \(2.0\) must be <= `high`'),  # default low = 1/high
    (dict(mode='mask', low=-0.1), '`low` must be >= 0'),
    (dict(mode='truncate', low=0.5), "`low` applies only to mode='mask'"),
  ],
)
def test_importance_weights_bad_arguments(kw, pattern):
  with pytest.raises(ValueError, match=pattern):
    L.importance_weights(_BT, _BT, _BT, **kw)


@pytest.mark.parametrize('which', ['sampler_logp', 'mask'])
def test_importance_weights_mismatched_shapes(which):
  args = dict(old_logp=_BT, sampler_logp=_BT, mask=_BT)
  args[which] = _BAD_SHAPE
  with pytest.raises(ValueError, match=f'`{which}` must have the same shape as `old_logp`'):
    L.importance_weights(**args)
