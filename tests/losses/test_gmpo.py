"""Tests for jrl.losses.gmpo_loss (Geometric-Mean Policy Optimization) and the
'trl_gmpo' preset.

Hand-computed values on a small batch; TRL's GMPOTrainer loss re-derived in
float64 NumPy (its value, and its gradient by central differences) on random
batches, alone and inside the full preset with advantages and KL; the
per-token form against the sequence form it stands for; padding that holds
garbage; jit against eager.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrl.losses as L

# A batch of two: row 0 has A = +1 and three tokens, row 1 A = −2 and two.
LOG_RATIO = np.array([[0.1, 0.5, -0.6], [0.5, -0.5, 0.0]])
ADV = np.array([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def _hand_batch():
  old = jnp.full((2, 3), -1.0, jnp.float32)
  return old + jnp.asarray(LOG_RATIO, jnp.float32), old, jnp.asarray(ADV), jnp.asarray(MASK)


def _seq_loss(logp, old, adv, mask, **kw):
  loss_BxT, metrics = L.gmpo_loss(logp, old, adv, mask, **kw)
  return L.aggregate(loss_BxT, mask, 'seq-mean-token-mean'), (loss_BxT, metrics)


def test_hand_computed_values_gradient_and_clip_fractions():
  logp, old, adv, mask = _hand_batch()
  (loss, (loss_BxT, metrics)), grad = jax.value_and_grad(_seq_loss, has_aux=True)(
    logp, old, adv, mask
  )
  # Row 0, A > 0: min(r, clip(r, -0.4, 0.4)) = [0.1, 0.4, -0.6] (the low side
  # stays unclipped); s0 = exp(-0.1 / 3). Row 1, A < 0: max(r, clip(r)) =
  # [0.5, -0.4]; s1 = exp(0.1 / 2).
  s0, s1 = math.exp(-0.1 / 3), math.exp(0.1 / 2)
  want_BxT = [[-s0, -s0, -s0], [2 * s1, 2 * s1, 0.0]]
  np.testing.assert_allclose(loss_BxT, want_BxT, rtol=1e-6)
  np.testing.assert_allclose(loss, (-s0 + 2 * s1) / 2, rtol=1e-6)
  # d/dlogp of mean_i(-A_i s_i): -A_i s_i / (B |y_i|) on unclipped tokens, 0 on clipped.
  want_grad = [[-s0 / 6, 0.0, -s0 / 6], [2 * s1 / 4, 0.0, 0.0]]
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)
  assert float(metrics['clipfrac_high']) == pytest.approx(1 / 5)  # row 0, r = 0.5
  assert float(metrics['clipfrac_low']) == pytest.approx(1 / 5)  # row 1, r = -0.5
  assert float(metrics['clipfrac']) == pytest.approx(2 / 5)
  assert float(metrics['seq_ratio_mean']) == pytest.approx((s0 + s1) / 2, rel=1e-6)


def test_epsilon_is_in_log_space():
  """At ε = 0.4 a ratio of 1.45 is inside GMPO's range (e^-0.4, e^0.4) =
  (0.67, 1.49) but outside PPO's (0.6, 1.4): GMPO passes its gradient, PPO
  clips it."""
  old = jnp.zeros((1, 1))
  logp, adv, mask = jnp.full((1, 1), math.log(1.45)), jnp.ones((1, 1)), jnp.ones((1, 1))
  gmpo = jax.grad(lambda lp: L.gmpo_loss(lp, old, adv, mask, eps_low=0.4, eps_high=0.4)[0].sum())
  ppo = jax.grad(lambda lp: L.ppo_clip_loss(lp, old, adv, mask, eps_low=0.4)[0].sum())
  assert float(gmpo(logp)[0, 0]) == pytest.approx(-1.45, rel=1e-6)
  assert float(ppo(logp)[0, 0]) == 0.0


# TRL's GMPO, re-derived in NumPy -----------------------------------------------


def _trl_gmpo(logp, old, ref, adv_B, mask, eps_low, eps_high, beta):
  """trl/experimental/gmpo/gmpo_trainer.py, GMPOTrainer._compute_loss (TRL
  1.10.0.dev0), float64, one gradient-accumulation step: per-token log-ratio
  clamped to [-ε_low, ε_high], min with it where A > 0 and max elsewhere; the
  mean over the sequence's tokens (count clamped to 1), exponentiated; times
  -A; plus β times the per-sequence mean of exp(ref - logp) - (ref - logp) - 1;
  mean over sequences."""
  log_ratio = logp - old
  clamped = np.clip(log_ratio, -eps_low, eps_high)
  a = adv_B[:, None]
  clipped = np.where(a > 0, np.minimum(log_ratio, clamped), np.maximum(log_ratio, clamped))
  count = np.maximum(mask.sum(-1), 1.0)
  coef = np.exp((clipped * mask).sum(-1) / count)
  per_seq = -coef * adv_B
  if beta:
    d = ref - logp
    per_seq = per_seq + beta * ((np.exp(d) - d - 1) * mask).sum(-1) / count
  return per_seq.mean()


def _trl_advantages(rewards, g):
  """TRL GRPOTrainer, scale_rewards='group': (r - group mean) / (group std + 1e-4),
  torch.std (unbiased)."""
  r = rewards.reshape(-1, g)
  return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)


def _random_batch(seed, b=8, t=7):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, size=b)
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
  old = -rng.uniform(0.2, 3.0, size=(b, t))
  log_ratio = rng.normal(0.0, 0.5, size=(b, t))
  # Keep every log-ratio 0.02 away from the kinks at ±0.4, where the
  # derivative jumps and a central difference straddles it.
  for kink in (-0.4, 0.4):
    near = np.abs(log_ratio - kink) < 0.02
    log_ratio = np.where(near, kink + np.sign(log_ratio - kink + 1e-12) * 0.04, log_ratio)
  ref = old + rng.normal(0.0, 0.3, size=(b, t))
  rewards = rng.integers(0, 2, size=b).astype(np.float64)
  return old + log_ratio, old, ref, rewards, mask


def _central_difference(f, x, h=1e-6):
  out = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    up, down = x.copy(), x.copy()
    up[idx] += h
    down[idx] -= h
    out[idx] = (f(up) - f(down)) / (2 * h)
  return out


@pytest.mark.parametrize('seed', range(3))
def test_matches_trls_gmpo_loss_and_gradient(seed):
  logp, old, _, rewards, mask = _random_batch(seed)
  adv_B = _trl_advantages(rewards, 4)
  adv_BxT = np.broadcast_to(adv_B[:, None], logp.shape)

  def jrl_loss(lp):
    loss_BxT, _ = L.gmpo_loss(lp, jnp.asarray(old), jnp.asarray(adv_BxT), jnp.asarray(mask))
    return L.aggregate(loss_BxT, jnp.asarray(mask), 'seq-mean-token-mean')

  loss, grad = jax.value_and_grad(jrl_loss)(jnp.asarray(logp, jnp.float32))
  trl = lambda lp: _trl_gmpo(lp, old, None, adv_B, mask, 0.4, 0.4, 0.0)
  assert float(loss) == pytest.approx(trl(logp), rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(grad, _central_difference(trl, logp), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('seed', range(2))
def test_trl_gmpo_preset_matches_trl_with_advantages_and_kl(seed):
  """`grpo_loss(preset='trl_gmpo')`: TRL's advantages, GMPO, and with β set,
  TRL's sequence-averaged k3 (value and gradient)."""
  logp, old, ref, rewards, mask = _random_batch(10 + seed)
  beta = 0.04
  as32 = lambda x: jnp.asarray(x, jnp.float32)

  def jrl_loss(lp):
    return L.grpo_loss(
      lp,
      as32(old),
      as32(ref),
      as32(rewards),
      as32(mask),
      group_size=4,
      preset='trl_gmpo',
      kl_coef=beta,
    )[0]

  loss, grad = jax.value_and_grad(jrl_loss)(as32(logp))
  adv_B = _trl_advantages(rewards, 4)
  trl = lambda lp: _trl_gmpo(lp, old, ref, adv_B, mask, 0.4, 0.4, beta)
  assert float(loss) == pytest.approx(trl(logp), rel=1e-5, abs=1e-6)
  np.testing.assert_allclose(grad, _central_difference(trl, logp), rtol=1e-4, atol=1e-6)


# The token form, padding, jit ------------------------------------------------------


def test_token_form_is_the_sequence_objective():
  """Σ_i mean_t ℓ_{i,t} / B has the value and gradient of mean_i(-A_i s_i),
  written directly with the clipped log-ratios' mean."""
  logp, old, _, rewards, mask = _random_batch(5)
  logp, old, mask = (jnp.asarray(x, jnp.float32) for x in (logp, old, mask))
  adv_B = jnp.asarray(_trl_advantages(rewards, 4), jnp.float32)
  adv = L.broadcast_to_tokens(adv_B, mask)

  def sequence_form(lp):
    r = lp - old
    clamped = jnp.clip(r, -0.4, 0.4)
    c = jnp.where(adv > 0, jnp.minimum(r, clamped), jnp.maximum(r, clamped))
    s = jnp.exp(jnp.sum(c * mask, -1) / jnp.maximum(mask.sum(-1), 1.0))
    return jnp.mean(-adv_B * s)

  token = jax.value_and_grad(lambda lp: _seq_loss(lp, old, adv, mask)[0])(logp)
  seq = jax.value_and_grad(sequence_form)(logp)
  np.testing.assert_allclose(token[0], seq[0], rtol=1e-6)
  np.testing.assert_allclose(token[1], seq[1], rtol=1e-5, atol=1e-8)


def test_padding_garbage_changes_nothing_and_jit_matches_eager():
  logp, old, _, rewards, mask = _random_batch(6)
  logp, old, mask = (jnp.asarray(x, jnp.float32) for x in (logp, old, mask))
  adv = L.broadcast_to_tokens(jnp.asarray(_trl_advantages(rewards, 4), jnp.float32), mask)
  f = jax.value_and_grad(lambda lp, o: _seq_loss(lp, o, adv, mask)[0])
  clean = f(logp, old)
  pad = mask == 0
  garbage = f(jnp.where(pad, 80.0, logp), jnp.where(pad, -jnp.inf, old))
  np.testing.assert_array_equal(clean[0], garbage[0])
  np.testing.assert_array_equal(clean[1], garbage[1])
  jitted = jax.jit(f)(logp, old)
  np.testing.assert_allclose(jitted[0], clean[0], rtol=1e-6)
  np.testing.assert_allclose(jitted[1], clean[1], rtol=1e-6, atol=1e-9)


def test_bad_arguments_are_named():
  logp, old, adv, mask = _hand_batch()
  with pytest.raises(ValueError, match='`eps_low` must be > 0'):
    L.gmpo_loss(logp, old, adv, mask, eps_low=0.0)
  with pytest.raises(ValueError, match='`advantages` must have the same shape'):
    L.gmpo_loss(logp, old, adv[:, :2], mask)
