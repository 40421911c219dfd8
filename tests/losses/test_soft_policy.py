"""Tests for SAPO, VESPO and the off-policy sequence mask (jrl.losses.policy).

Each is tested four ways (STYLE.md point 14): values computed by hand (the
arithmetic is in the comments), a float64 NumPy reference written in TRL's
own form (`GRPOTrainer._compute_loss`, `get_gamma_weights`,
`get_off_policy_mask`, as its documentation states them) for golden
vectors on random batches, gradient checks (analytic expectations and
`jax.test_util.check_grads`), and jit vs no-jit plus masked vs sliced.
Shapes stay few ([1, 8] rows, [6, 8] and [8, 16] batches) so eager ops
compile once.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jrl.losses as L

ROW_T = 8
TOL = dict(rtol=1e-5, atol=1e-6)


def _f32(*xs):
  return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _f64(*xs):
  return tuple(np.asarray(x, np.float64) for x in xs)


def _right_padded_mask(lengths, t):
  return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float64)


def _row(log_ratios, advantages, mask=None, old=-1.0):
  """A [1, 8] batch: the given log-ratios around a constant old_logp, then padding."""
  n = len(log_ratios)
  lr, adv, m = np.zeros((1, ROW_T)), np.zeros((1, ROW_T)), np.zeros((1, ROW_T))
  lr[0, :n], adv[0, :n] = log_ratios, advantages
  m[0, :n] = 1.0 if mask is None else np.asarray(mask, np.float64)
  return _f32(old + lr, np.full_like(lr, old), adv, m)


def _seq_batch(seed, seq_log_ratio_scale=0.3, lengths=(8, 5, 3, 1, 6, 2), t=8):
  """[6, 8] right-padded rows, sequence advantages, garbage on the padding."""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  mask = _right_padded_mask(lengths, t)
  old = rng.normal(-2.0, 1.0, (b, t))
  lr = rng.normal(0.0, seq_log_ratio_scale, (b, t)) * mask
  lr += (1.0 - mask) * rng.normal(0.0, 5.0, (b, t))  # garbage on padding
  adv_B = np.array([1.0, -1.0, 0.5, -2.0, -0.7, 1.5])[:b]
  return _f32(old + lr, old, adv_B[:, None] * mask, mask)


def _token_batch(seed, scale=0.6, b=8, t=16):
  rng = np.random.default_rng(seed)
  old = rng.normal(-2.0, 1.0, (b, t))
  lr = rng.normal(0.0, scale, (b, t))
  adv = rng.normal(size=(b, t))
  mask = _right_padded_mask(rng.integers(1, t + 1, size=b), t)
  return _f32(old + lr, old, adv, mask)


def _run(fn, logp, old_logp, advantages, mask, **kw):
  """(loss, metrics, d(sum loss)/d logp)."""

  def total(lp):
    loss, metrics = fn(lp, old_logp, advantages, mask, **kw)
    return jnp.sum(loss), (loss, metrics)

  grad, (loss, metrics) = jax.grad(total, has_aux=True)(logp)
  return loss, metrics, grad


def _all_finite(tree):
  return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree))


def _tree_allclose(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, **tol)


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


# ----------------------------------------------------------------------------
# SAPO.
# ----------------------------------------------------------------------------


def test_sapo_hand_computed():
  # τ_pos = 1, τ_neg = 1.05. f = (4/τ)σ(τ(ρ − 1)), ℓ = −f·A; gradient
  # d ℓ / d logp = −w·ρ·A with w = 4σ(1 − σ).
  #  0 (ρ = 1,   A = +1): σ(0) = 0.5, f = 2, ℓ = −2; w = 1, grad = −1.
  #  1 (ρ = 1.5, A = +2): σ(0.5) = 0.6224593, f = 2.4898373, ℓ = −4.9796746;
  #     w = 4·0.6224593·0.3775407 = 0.9400148, grad = −0.9400148·1.5·2 = −2.8200445.
  #  2 (ρ = 0.5, A = −1): τ = 1.05, σ(−0.525) = 0.3716838,
  #     f = 3.8095238·0.3716838 = 1.4159383, ℓ = +1.4159383;
  #     w = 4·0.3716838·0.6283162 = 0.9341398, grad = +0.9341398·0.5 = 0.4670699.
  #  3 (ρ = 100, A = +1): masked: 0, no gradient, not in the metrics.
  logp, old, adv, mask = _row(np.log([1.0, 1.5, 0.5, 100.0]), [1.0, 2.0, -1.0, 1.0], [1, 1, 1, 0])
  loss, metrics, grad = _run(L.sapo_loss, logp, old, adv, mask)
  np.testing.assert_allclose(loss[0, :4], [-2.0, -4.9796746, 1.4159383, 0.0], rtol=1e-6)
  np.testing.assert_allclose(grad[0, :4], [-1.0, -2.8200445, 0.4670699, 0.0], rtol=1e-5)
  # gate_weight_mean = (1 + 0.9400148 + 0.9341398)/3 = 0.9580515.
  np.testing.assert_allclose(metrics['gate_weight_mean'], 0.9580515, rtol=1e-6)
  # approx_kl = mean((ρ − 1) − log ρ) = (0 + 0.0945349 + 0.1931472)/3 = 0.0958940.
  np.testing.assert_allclose(metrics['approx_kl'], 0.0958940, rtol=1e-5)


def test_sapo_zero_advantage_uses_tau_neg_and_contributes_nothing():
  logp, old, adv, mask = _row([0.3], [0.0])
  loss, _, grad = _run(L.sapo_loss, logp, old, adv, mask)
  assert float(loss[0, 0]) == 0.0 and float(grad[0, 0]) == 0.0


@pytest.mark.parametrize('tau', [0.1, 1.0, 10.0])
def test_sapo_on_policy_gradient_is_the_policy_gradient_for_every_tau(tau):
  # ρ = 1: w = 4σ(0)(1 − σ(0)) = 1 whatever τ, so d ℓ/d logp = −A.
  logp, _, adv, mask = _token_batch(0)
  _, metrics, grad = _run(L.sapo_loss, logp, logp, adv, mask, tau_pos=tau, tau_neg=tau)
  np.testing.assert_allclose(grad, -np.asarray(adv) * np.asarray(mask), rtol=1e-6)
  np.testing.assert_allclose(metrics['gate_weight_mean'], 1.0, rtol=1e-6)


def _np_sapo_trl(logp, old, adv, mask, tau_pos, tau_neg):
  """TRL's form in float64: (per-token loss, 'grpo' aggregation, d(sum)/dlogp)."""
  logp, old, adv, mask = _f64(logp, old, adv, mask)
  coef_1 = np.exp(logp - old)
  temperatures = np.where(adv > 0, tau_pos, tau_neg)
  s = _sigmoid(temperatures * (coef_1 - 1.0))
  per_token_loss = -(s * 4.0 / temperatures) * adv
  loss = ((per_token_loss * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean()
  grad = -4.0 * s * (1.0 - s) * coef_1 * adv * mask
  return per_token_loss * mask, loss, grad


@pytest.mark.parametrize('tau_pos, tau_neg', [(1.0, 1.05), (0.5, 2.0), (3.0, 3.0)])
def test_sapo_matches_trl_form_golden_and_analytic_gradient(tau_pos, tau_neg):
  logp, old, adv, mask = _token_batch(1)
  kw = dict(tau_pos=tau_pos, tau_neg=tau_neg)
  loss, _, grad = _run(L.sapo_loss, logp, old, adv, mask, **kw)
  want_tok, want_loss, want_grad = _np_sapo_trl(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, want_tok, **TOL)
  np.testing.assert_allclose(grad, want_grad, **TOL)
  # TRL's loss_type="sapo" aggregation is seq-mean-token-mean.
  got = L.seq_mean_token_mean(loss, mask)
  np.testing.assert_allclose(float(got), want_loss, rtol=1e-5)


def test_sapo_check_grads():
  logp, old, adv, mask = _token_batch(2)
  f = lambda lp: L.sapo_loss(lp, old, adv, mask, tau_pos=1.0, tau_neg=1.05)[0]
  check_grads(f, (logp,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


def test_sapo_gate_decays_smoothly_where_ppo_cuts():
  # A = +1, ρ = 1.25 and 1.5: PPO with ε = 0.2 gives gradient 0 for both
  # (clipped); SAPO keeps w = sech²(τ(ρ − 1)/2) > 0, decreasing in |ρ − 1|.
  logp, old, adv, mask = _row(np.log([1.1, 1.25, 1.5, 3.0]), [1.0] * 4)
  _, _, g_ppo = _run(L.ppo_clip_loss, logp, old, adv, mask, eps_low=0.2)
  _, _, g_sapo = _run(L.sapo_loss, logp, old, adv, mask, tau_pos=2.0)
  assert np.all(np.asarray(g_ppo)[0, 1:4] == 0.0)
  rho = np.array([1.1, 1.25, 1.5, 3.0])
  w = 1.0 / np.cosh(2.0 * (rho - 1.0) / 2.0) ** 2
  np.testing.assert_allclose(np.asarray(g_sapo)[0, :4], -w * rho, rtol=1e-5)
  assert np.all(np.diff(w) < 0) and w[-1] > 0


def test_sapo_extreme_log_ratios_finite():
  # log ρ = ±50, ±1000: the default clamp at 20 keeps ρ finite; σ saturates,
  # so A = +1 gives ℓ = −4/τ_pos = −4 at log ρ > 0 and −(4/τ)σ(−τ) at log ρ ≪ 0.
  lrs = [50.0, 1000.0, -50.0, -1000.0]
  logp, old, adv, mask = _row(lrs, [1.0] * 4)
  loss, metrics, grad = _run(L.sapo_loss, logp, old, adv, mask)
  assert _all_finite((loss, metrics, grad))
  low = -4.0 * _sigmoid(-1.0)
  np.testing.assert_allclose(loss[0, :4], [-4.0, -4.0, low, low], rtol=1e-6)
  assert np.all(np.asarray(grad)[0, :2] == 0.0)


# ----------------------------------------------------------------------------
# VESPO.
# ----------------------------------------------------------------------------


def test_vespo_hand_computed():
  # Three valid tokens with log-ratios 0.2, −0.1, 0.3 (+ padding with 9):
  # log W = 0.4, W = e^0.4 = 1.4918247 (a product, not a mean).
  #  A = +1 (k = 2, λ = 3): φ = W² e^(3(1 − W)) = 2.2255409 · e^(−1.4754741) = 0.5089151.
  #  A = −1 (k = 3, λ = 2): φ = W³ e^(2(1 − W)) = 3.3201169 · e^(−0.9836494) = 1.2415376.
  # ℓ_t = −φ·A·logp_t with old_logp = −1, logp = [−0.8, −1.1, −0.7]; gradient −φ·A.
  for a, phi in [(1.0, 0.5089151), (-1.0, 1.2415376)]:
    logp, old, adv, mask = _row([0.2, -0.1, 0.3, 9.0], [a, a, a, 0.0], [1, 1, 1, 0])
    loss, metrics, grad = _run(L.vespo_loss, logp, old, adv, mask)
    np.testing.assert_allclose(
      loss[0, :4], [phi * a * -v for v in (-0.8, -1.1, -0.7)] + [0], rtol=1e-5
    )
    np.testing.assert_allclose(grad[0, :4], [-phi * a] * 3 + [0.0], rtol=1e-5)
    np.testing.assert_allclose(metrics['vespo_weight_mean'], phi, rtol=1e-5)
    np.testing.assert_allclose(metrics['vespo_log_w_abs_max'], 0.4, rtol=1e-5)


def test_vespo_kernel_shape():
  # φ(1) = 1 for any (k, λ); φ peaks at W = k/λ; φ → 0 at both ends.
  lrs = np.log([1.0, 2.0 / 3.0, 0.6, 0.75, 1e-3, 50.0])
  rows = [[lr] for lr in lrs]
  weights = []
  for r in rows:
    logp, old, adv, mask = _row(r, [1.0])
    w, _ = L.vespo_weights(logp, old, adv, mask, k_pos=2.0, lambda_pos=3.0)
    weights.append(float(w[0, 0]))
  one, peak, below, above, tiny, huge = weights
  assert one == pytest.approx(1.0, rel=1e-6)
  # At W = 2/3: (2/3)² e^(3·1/3) = 0.4444·e = 1.2079.
  assert peak == pytest.approx((2 / 3) ** 2 * math.e, rel=1e-5)
  assert peak > below and peak > above and peak > one
  # W = 1e−3: 1e−6 · e^(3·0.999) = 2.0025e−5; W = 50: 2500 · e^(−147) underflows to 0.
  assert tiny == pytest.approx(1e-6 * math.exp(2.997), rel=1e-4)
  assert huge == 0.0


def test_vespo_sequence_weight_is_a_product_over_the_sequence():
  # Same per-token log-ratio 0.1, lengths 2 and 6: W = e^0.2 and e^0.6.
  lengths = [2, 6]
  mask = _right_padded_mask(lengths, ROW_T)
  old = np.full((2, ROW_T), -1.0)
  logp, old, adv, mask = _f32(old + 0.1 * mask, old, mask, mask)
  w, _ = L.vespo_weights(logp, old, adv, mask)
  for i, n in enumerate(lengths):
    wi = math.exp(0.1 * n)
    np.testing.assert_allclose(w[i, :n], wi**2 * math.exp(3.0 * (1.0 - wi)), rtol=1e-5)
    assert np.all(np.asarray(w)[i, n:] == 0.0)


def _np_vespo_trl(logp, old, adv, mask, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
  """TRL's get_gamma_weights and per-token loss in float64: (loss, phi, grad)."""
  logp, old, adv, mask = _f64(logp, old, adv, mask)
  lower = math.log(1e-8)
  log_ratio = np.clip(logp - old, -20.0, 20.0)
  seq = np.sum(log_ratio * mask, axis=-1, keepdims=True)
  log_w = np.clip(seq, lower, 20.0)
  nonneg = adv >= 0
  k = np.where(nonneg, k_pos, k_neg)
  lam = np.where(nonneg, lambda_pos, lambda_neg)
  phi = np.exp(lam + k * log_w - lam * np.exp(log_w))
  return -phi * adv * logp * mask, phi * mask, -phi * adv * mask


VESPO_PARAMS = [
  {},
  dict(k_pos=1.0, lambda_pos=1.0, k_neg=0.5, lambda_neg=4.0),
  dict(k_pos=0.0, lambda_pos=2.0, k_neg=0.0, lambda_neg=2.0),
]


@pytest.mark.parametrize('kw', VESPO_PARAMS)
def test_vespo_matches_trl_form_golden_and_gradient(kw):
  logp, old, adv, mask = _seq_batch(3)
  loss, metrics, grad = _run(L.vespo_loss, logp, old, adv, mask, **kw)
  want_loss, want_phi, want_grad = _np_vespo_trl(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(loss, want_loss, **TOL)
  np.testing.assert_allclose(grad, want_grad, **TOL)
  w, _ = L.vespo_weights(logp, old, adv, mask, **kw)
  np.testing.assert_allclose(w, want_phi, **TOL)
  seq_phi = want_phi.sum(-1) / np.asarray(mask).sum(-1)
  np.testing.assert_allclose(metrics['vespo_weight_mean'], seq_phi.mean(), rtol=1e-5)
  assert len(np.unique(np.round(seq_phi, 4))) == len(seq_phi)  # the batch is not degenerate


def test_vespo_weights_are_constants_and_check_grads():
  logp, old, adv, mask = _seq_batch(4)
  g_logp, g_old = jax.grad(
    lambda lp, o: jnp.sum(L.vespo_weights(lp, o, adv, mask)[0]), argnums=(0, 1)
  )(logp, old)
  assert np.all(np.asarray(g_logp) == 0.0) and np.all(np.asarray(g_old) == 0.0)
  # The loss is sg[φ]·A·logp: its numerical derivative equals the gradient only
  # where φ is locally constant; check_grads on φ·A·logp with φ held fixed.
  w, _ = L.vespo_weights(logp, old, adv, mask)
  f = lambda lp: -w * adv * lp * mask
  check_grads(f, (logp,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)
  _, _, grad = _run(L.vespo_loss, logp, old, adv, mask)
  np.testing.assert_allclose(grad, jax.grad(lambda lp: jnp.sum(f(lp)))(logp), rtol=1e-6)


def test_vespo_extreme_log_ratios_finite():
  # Σ log ρ = +160 (clamped to 20: W = 4.85e8, φ = 0) and −160 (clamped to
  # log 1e−8: φ = e^3·1e−16·e^(−3e−8) ≈ 2e−15).
  logp, old, adv, mask = _row([20.0] * 8, [1.0] * 8)
  loss, metrics, grad = _run(L.vespo_loss, logp, old, adv, mask)
  assert _all_finite((loss, metrics, grad)) and np.all(np.asarray(loss) == 0.0)
  logp, old, adv, mask = _row([-20.0] * 8, [1.0] * 8)
  w, _ = L.vespo_weights(logp, old, adv, mask)
  np.testing.assert_allclose(w[0, 0], math.exp(3.0) * 1e-16, rtol=1e-4)


# ----------------------------------------------------------------------------
# SAPO and VESPO: jit, masks.
# ----------------------------------------------------------------------------

LOSSES = [
  pytest.param(L.sapo_loss, dict(tau_pos=1.0, tau_neg=1.05), id='sapo'),
  pytest.param(L.vespo_loss, {}, id='vespo'),
]


@pytest.mark.parametrize('fn, kw', LOSSES)
def test_jit_matches_no_jit(fn, kw):
  args = _seq_batch(5)
  eager = _run(fn, *args, **kw)
  jitted = jax.jit(functools.partial(_run, fn, **kw))(*args)
  _tree_allclose(eager, jitted, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('fn, kw', LOSSES)
def test_masked_matches_sliced_rows(fn, kw):
  # Garbage on the padding must not reach values, gradients or metrics: rows
  # of equal length cut to that length give the same per-token losses; the
  # token metrics are token-weighted, vespo_weight_mean sequence-weighted.
  lengths = np.array([8, 3, 3, 8, 3, 8])
  logp, old, adv, mask = _seq_batch(6, lengths=tuple(lengths))
  loss, metrics, grad = _run(fn, logp, old, adv, mask, **kw)
  sliced_run = jax.jit(functools.partial(_run, fn, **kw))
  want = {k: 0.0 for k in metrics if k != 'vespo_log_w_abs_max'}
  for n in np.unique(lengths):
    rows = np.flatnonzero(lengths == n)
    sl = lambda x, rows=rows, n=n: jnp.asarray(np.asarray(x)[rows, :n])
    s_loss, s_metrics, s_grad = sliced_run(sl(logp), sl(old), sl(adv), sl(mask))
    np.testing.assert_allclose(loss[rows, :n], s_loss, **TOL)
    np.testing.assert_allclose(grad[rows, :n], s_grad, **TOL)
    for k in want:
      share = (
        len(rows) / len(lengths) if k == 'vespo_weight_mean' else len(rows) * n / lengths.sum()
      )
      want[k] += share * float(s_metrics[k])
  for k, v in want.items():
    np.testing.assert_allclose(float(metrics[k]), v, err_msg=k, **TOL)
  pad = np.asarray(mask) == 0
  assert np.all(np.asarray(loss)[pad] == 0.0) and np.all(np.asarray(grad)[pad] == 0.0)


@pytest.mark.parametrize('fn, kw', LOSSES)
def test_fully_masked_input_gives_zero_loss_and_finite_gradients(fn, kw):
  logp, old, adv, mask = _seq_batch(7)
  mask = jnp.zeros_like(mask)
  loss, metrics, grad = _run(fn, logp, old, adv, mask, **kw)
  assert np.all(np.asarray(loss) == 0.0) and np.all(np.asarray(grad) == 0.0)
  assert _all_finite(metrics)


# ----------------------------------------------------------------------------
# off_policy_sequence_mask.
# ----------------------------------------------------------------------------


def _opsm_hand_batch():
  # Six sequences, δ = 0.5; D_i = mean over valid tokens of (sampler − logp).
  #  0: A = +1, D = 1.0              keep (A ≥ 0)
  #  1: A = −1, D = 1.0 > δ          drop
  #  2: A = −1, D = 0.25 ≤ δ         keep
  #  3: A = −1, D = −2 (π went up)   keep (the bound is one-sided)
  #  4: A = 0,  D = 5                keep (A ≥ 0)
  #  5: A = −1, D = 0.5 = δ          keep (≤): tokens 0.25 and 0.75
  diffs = [[1.0, 1.0], [0.5, 1.5], [0.25, 0.25], [-2.0, -2.0], [5.0, 5.0], [0.25, 0.75]]
  adv_B = np.array([1.0, -1.0, -1.0, -1.0, 0.0, -1.0])
  t = 4
  mask = _right_padded_mask([2] * 6, t)
  logp = np.full((6, t), -1.0)
  sampler = logp.copy()
  sampler[:, :2] += np.array(diffs)
  sampler[:, 2:] = 50.0  # garbage on the padding
  return logp, sampler, adv_B, mask


def test_off_policy_sequence_mask_hand_computed():
  logp, sampler, adv_B, mask = _opsm_hand_batch()
  keep, metrics = L.off_policy_sequence_mask(*_f32(logp, sampler, adv_B, mask), threshold=0.5)
  np.testing.assert_array_equal(keep, [1, 0, 1, 1, 1, 1])
  np.testing.assert_allclose(metrics['opsm_dropped_frac'], 1 / 6, rtol=1e-6)
  # mean D = (1 + 1 + 0.25 − 2 + 5 + 0.5)/6 = 5.75/6.
  np.testing.assert_allclose(metrics['opsm_seq_kl_mean'], 5.75 / 6, rtol=1e-6)
  # Token advantages: the same rule per token, zero on the padding.
  adv_BxT = adv_B[:, None] * mask
  keep_t, metrics_t = L.off_policy_sequence_mask(*_f32(logp, sampler, adv_BxT, mask), threshold=0.5)
  np.testing.assert_array_equal(keep_t, np.asarray(keep)[:, None] * mask)
  np.testing.assert_allclose(metrics_t['opsm_dropped_frac'], 2 / 12, rtol=1e-6)


def _np_opsm_trl(logp, sampler, adv, mask, delta):
  """TRL's get_off_policy_mask in float64 (advantages [B, 1] or [B, T])."""
  logp, sampler, adv, mask = _f64(logp, sampler, adv, mask)
  kl_div = sampler - logp
  avg = (kl_div * mask).sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1.0)
  return ((adv >= 0) | (avg <= delta)).astype(np.float64)


@pytest.mark.parametrize('delta', [0.0, 0.05, 0.3])
def test_off_policy_sequence_mask_matches_trl_form(delta):
  rng = np.random.default_rng(8)
  b, t = 32, 6
  logp = rng.normal(-2.0, 1.0, (b, t))
  sampler = logp + rng.normal(0.05, 0.4, (b, t))
  adv_B = rng.normal(size=b)
  mask = _right_padded_mask(rng.integers(1, t + 1, size=b), t)
  want_B = _np_opsm_trl(logp, sampler, adv_B[:, None], mask, delta)[:, 0]
  keep, _ = L.off_policy_sequence_mask(*_f32(logp, sampler, adv_B, mask), threshold=delta)
  np.testing.assert_array_equal(keep, want_B)
  assert 0 < want_B.sum() < b  # both outcomes occur
  adv_BxT = rng.normal(size=(b, t)) * mask  # per-token signs
  want_BxT = _np_opsm_trl(logp, sampler, adv_BxT, mask, delta) * mask
  keep_t, _ = L.off_policy_sequence_mask(*_f32(logp, sampler, adv_BxT, mask), threshold=delta)
  np.testing.assert_array_equal(keep_t, want_BxT)


def test_off_policy_sequence_mask_composes_with_a_policy_loss():
  # Multiplying PPO's per-token loss by the mask: dropped rows get no loss
  # and no gradient; token-mean keeps their tokens in the denominator (TRL).
  logp, sampler, adv_B, mask = _opsm_hand_batch()
  logp, sampler, adv_B, mask = _f32(logp, sampler, adv_B, mask)
  adv = L.broadcast_to_tokens(adv_B, mask)
  keep, _ = L.off_policy_sequence_mask(logp, sampler, adv_B, mask, threshold=0.5)

  def masked_loss(lp):
    pg, _ = L.ppo_clip_loss(lp, sampler, adv, mask)
    return L.token_mean(pg * keep[:, None], mask)

  loss, grad = jax.value_and_grad(masked_loss)(logp)
  pg, _ = L.ppo_clip_loss(logp, sampler, adv, mask)
  np.testing.assert_allclose(loss, float(jnp.sum(pg * keep[:, None])) / 12.0, rtol=1e-6)
  # Row 1 is dropped; row 3 (A < 0, ρ = e² unclipped) is kept and learns.
  assert np.all(np.asarray(grad)[1] == 0.0) and np.all(np.asarray(grad)[3, :2] != 0.0)


def test_off_policy_sequence_mask_is_constant_and_jits():
  logp, sampler, adv_B, mask = _f32(*_opsm_hand_batch())
  f = functools.partial(L.off_policy_sequence_mask, threshold=0.5)
  _tree_allclose(f(logp, sampler, adv_B, mask), jax.jit(f)(logp, sampler, adv_B, mask))
  grads = jax.grad(
    lambda lp, s: jnp.sum(f(lp, s, adv_B, mask)[0]) + sum(f(lp, s, adv_B, mask)[1].values()),
    argnums=(0, 1),
  )(logp, sampler)
  assert all(np.all(np.asarray(g) == 0.0) for g in grads)
  # Fully masked: every sequence kept, metrics finite.
  keep, metrics = f(logp, sampler, adv_B, jnp.zeros_like(mask))
  assert np.all(np.asarray(keep) == 1.0) and _all_finite(metrics)


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------

_BT = np.zeros((2, 3), np.float32)


@pytest.mark.parametrize(
  'fn, kw, pattern',
  [
    (L.sapo_loss, dict(tau_pos=0.0), '`tau_pos` must be > 0'),
    (L.sapo_loss, dict(tau_neg=-1.0), '`tau_neg` must be > 0'),
    (L.sapo_loss, dict(log_ratio_clamp=0.0), '`log_ratio_clamp` must be > 0'),
    (L.vespo_loss, dict(k_pos=-1.0), '`k_pos` must be >= 0'),
    (L.vespo_loss, dict(lambda_neg=0.0), '`lambda_neg` must be > 0'),
    (L.vespo_weights, dict(lambda_pos=-1.0), '`lambda_pos` must be > 0'),
  ],
)
def test_bad_hyperparameters_name_the_argument(fn, kw, pattern):
  with pytest.raises(ValueError, match=pattern):
    fn(_BT, _BT, _BT, _BT, **kw)


@pytest.mark.parametrize('fn', [L.sapo_loss, L.vespo_loss, L.vespo_weights])
def test_mismatched_shapes_name_the_argument(fn):
  with pytest.raises(ValueError, match='`advantages` must have the same shape as `logp`'):
    fn(_BT, _BT, np.zeros((2, 4), np.float32), _BT)


@pytest.mark.parametrize(
  'adv, kw, pattern',
  [
    (np.zeros(3, np.float32), {}, r'`advantages` must have shape \[B=2\] or \[B, T\]'),
    (np.zeros((2, 4), np.float32), {}, '`advantages` must have the same shape as `logp`'),
    (np.zeros((2, 3, 1), np.float32), {}, r'`advantages` must have shape \[B\] or \[B, T\]'),
    (np.zeros(2, np.float32), dict(threshold=-0.1), '`threshold` must be >= 0'),
  ],
)
def test_off_policy_sequence_mask_bad_input(adv, kw, pattern):
  kw = {'threshold': 0.5, **kw}
  with pytest.raises(ValueError, match=pattern):
    L.off_policy_sequence_mask(_BT, _BT, adv, _BT, **kw)
