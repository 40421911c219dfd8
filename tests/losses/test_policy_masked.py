"""Tests for the importance-sampling losses of jrl.losses.policy_masked: the
plain one (`importance_sampling_loss`) and those whose trust region is a
token mask (`icepop_loss`, `dppo_loss`, `kpop_loss`), with their masks.

Hand-computed values; the peers' definitions re-derived in float64 NumPy as
golden references (prime-rl's default loss, value and gradient; AReaL's
ratio and binary-KL rejection masks); a dropped token's gradient is exactly
0 (or exactly the squared-log-ratio penalty's); the unbounded loss's
gradient grows with the ratio where the masked ones cut it; padding holding
garbage and jit change nothing; the registry says which losses are bounded.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrl.losses as L

MASKED = {
  'icepop': (L.icepop_loss, {'low': 0.5, 'high': 5.0}),
  'dppo': (L.dppo_loss, {'delta_low': 0.2, 'delta_high': 0.2}),
  'kpop': (L.kpop_loss, {'threshold': 0.1}),
}


def _f32(*xs):
  return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _token_sum(fn, **kw):
  """loss, grad of Σ_t ℓ_t: each token's own gradient, unscaled."""

  def total(logp, old, adv, mask):
    loss_BxT, _ = fn(logp, old, adv, mask, **kw)
    return jnp.sum(loss_BxT)

  return jax.value_and_grad(total)


# Masks, by hand ------------------------------------------------------------------


def test_ratio_band_mask_hand_computed():
  ratio = np.array([[0.4, 0.6, 1.0, 4.9, 5.2]])
  old = np.full_like(ratio, -2.0)
  logp, old, mask = _f32(old + np.log(ratio), old, np.ones_like(ratio))
  np.testing.assert_array_equal(L.ratio_band_mask(logp, old, mask), [[0, 1, 1, 1, 0]])
  no_low = L.ratio_band_mask(logp, old, mask, low=0.0, high=math.inf)
  np.testing.assert_array_equal(no_low, [[1, 1, 1, 1, 1]])
  masked = L.ratio_band_mask(logp, old, mask.at[0, 1].set(0.0))
  np.testing.assert_array_equal(masked, [[0, 0, 1, 1, 0]])


def test_prob_diff_mask_hand_computed():
  # (π, π_old, A): kept iff π − π_old ≤ 0.2 when A > 0, ≥ −0.2 when A ≤ 0.
  cases = [
    (0.5, 0.4, 1.0, 1),  # +0.1
    (0.7, 0.4, 1.0, 0),  # +0.3: pushed up too far
    (0.1, 0.5, 1.0, 1),  # −0.4 with A > 0: the upper test only
    (0.2, 0.5, -1.0, 0),  # −0.3: pushed down too far
    (0.45, 0.5, -1.0, 1),  # −0.05
    (0.9, 0.2, -1.0, 1),  # +0.7 with A < 0: the lower test only
    (0.2, 0.5, 0.0, 0),  # A = 0 takes the A ≤ 0 test
  ]
  p, q, a, want = (np.array([[c[i] for c in cases]]) for i in range(4))
  logp, old, adv, mask = _f32(np.log(p), np.log(q), a, np.ones_like(p))
  np.testing.assert_array_equal(L.prob_diff_mask(logp, old, adv, mask), want)


def test_binary_kl_hand_computed():
  # p = 0.5, q = 0.25: D(p‖q) = 0.5 ln 2 + 0.5 ln(2/3), D(q‖p) = 0.25 ln 0.5 + 0.75 ln 1.5.
  fwd = 0.5 * math.log(2.0) + 0.5 * math.log(0.5 / 0.75)
  rev = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
  lp, lq = _f32([[math.log(0.5)]], [[math.log(0.25)]])
  assert float(L.binary_kl(lp, lq)[0, 0]) == pytest.approx(fwd, rel=1e-6)
  assert float(L.binary_kl(lq, lp)[0, 0]) == pytest.approx(rev, rel=1e-6)
  mask = jnp.ones((1, 1))
  assert float(L.binary_kl_mask(lp, lq, mask, threshold=0.1)[0, 0]) == 0.0  # max 0.1438
  assert float(L.binary_kl_mask(lp, lq, mask, threshold=0.15)[0, 0]) == 1.0


def test_binary_kl_of_a_nearly_certain_token_is_exact():
  """π = 1 − 3e−8 and π_old = 1 − 5e−8 both round to 1 in float32. Computed
  from logs, their binary KL is the float64 value (about 4.7e−9) and the token
  is kept; computed from the rounded probabilities (AReaL's form run in
  float32), (1 − π) log((1 − π)/(1 − π_old)) is 0 · log(0/0) = NaN, which
  fails the threshold test and drops the token."""
  lp, lq = -3e-8, -5e-8
  p, q = math.exp(lp), math.exp(lq)
  want = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
  got = float(L.binary_kl(*_f32([[lp]], [[lq]]))[0, 0])
  assert got == pytest.approx(want, rel=1e-3)
  assert float(L.binary_kl_mask(*_f32([[lp]], [[lq]]), jnp.ones((1, 1)))[0, 0]) == 1.0
  areal_f32 = _areal_keep_binary_kl(
    np.float32([lp]), np.float32([lq]), np.array([True]), 0.1, dtype=np.float32
  )
  assert not areal_f32[0]


# Losses, by hand -------------------------------------------------------------------


def test_dppo_loss_hand_computed_value_and_gradient():
  """Four tokens (π, π_old, A) with τ = 1e−3: kept ones get −ρA + τ(ln ρ)², dropped
  ones τ(ln ρ)²; the gradient is −ρA + 2τ ln ρ, or 2τ ln ρ when dropped."""
  p = np.array([[0.5, 0.7, 0.2, 0.45]])
  q = np.array([[0.4, 0.4, 0.5, 0.5]])
  a = np.array([[1.0, 1.0, -1.0, -1.0]])
  keep = np.array([[1.0, 0.0, 0.0, 1.0]])  # +0.1, +0.3 (A > 0), −0.3, −0.05 (A < 0)
  rho, tau = p / q, 1e-3
  want_loss = -keep * rho * a + tau * np.log(rho) ** 2
  want_grad = -keep * rho * a + 2 * tau * np.log(rho)
  loss, grad = _token_sum(L.dppo_loss)(*_f32(np.log(p), np.log(q), a, np.ones_like(p)))
  assert float(loss) == pytest.approx(want_loss.sum(), rel=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-9)
  _, metrics = L.dppo_loss(*_f32(np.log(p), np.log(q), a, np.ones_like(p)))
  assert float(metrics['maskfrac']) == pytest.approx(0.5)
  assert float(metrics['maskfrac_high']) == pytest.approx(0.25)  # ρ = 1.75
  assert float(metrics['maskfrac_low']) == pytest.approx(0.25)  # ρ = 0.4


def test_importance_sampling_loss_hand_computed_and_on_policy_is_reinforce():
  logp, old = _f32([[-1.0, -2.0]], [[-1.5, -2.0]])
  adv, mask = _f32([[2.0, -1.0]], [[1.0, 1.0]])
  loss, grad = _token_sum(L.importance_sampling_loss)(logp, old, adv, mask)
  rho = math.exp(0.5)
  assert float(loss) == pytest.approx(-2.0 * rho + 1.0, rel=1e-6)
  np.testing.assert_allclose(grad, [[-2.0 * rho, 1.0]], rtol=1e-6)
  # On-policy (ρ = 1): the REINFORCE gradient −A ∇logp.
  _, grad = _token_sum(L.importance_sampling_loss)(logp, logp, adv, mask)
  np.testing.assert_allclose(grad, -adv, rtol=1e-6)


def test_unbounded_gradient_grows_with_the_ratio_where_the_others_cut_it():
  """A > 0 and ρ = 50: the plain importance-sampled gradient is −50·A; PPO's
  clip, GMPO's and every mask here give 0 (with τ = 0)."""
  logp, old, adv, mask = _f32([[math.log(0.5)]], [[math.log(0.01)]], [[1.0]], [[1.0]])
  _, grad = _token_sum(L.importance_sampling_loss)(logp, old, adv, mask)
  assert float(grad[0, 0]) == pytest.approx(-50.0, rel=1e-5)
  bounded = [
    (L.ppo_clip_loss, {}),
    (L.gmpo_loss, {}),
    (L.icepop_loss, {}),
    (L.dppo_loss, {'kl_tau': 0.0}),
    (L.kpop_loss, {}),
  ]
  for fn, kw in bounded:
    assert float(_token_sum(fn, **kw)(logp, old, adv, mask)[1][0, 0]) == 0.0, fn.__name__


# A dropped token's gradient ---------------------------------------------------------


def _drift_batch(seed, b=6, t=9):
  """Log-ratios spread so that every mask drops some tokens and keeps others."""
  rng = np.random.default_rng(seed)
  old = np.log(rng.uniform(0.05, 0.95, size=(b, t)))
  logp = np.minimum(old + rng.normal(0.0, 1.0, size=(b, t)), -1e-3)
  adv = np.repeat(rng.normal(0.0, 1.0, size=(b, 1)), t, axis=1)
  lengths = rng.integers(2, t + 1, size=b)
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
  return logp, old, adv, mask


def _keep(name, logp, old, adv, mask):
  if name == 'icepop':
    return L.ratio_band_mask(logp, old, mask)
  if name == 'dppo':
    return L.prob_diff_mask(logp, old, adv, mask)
  return L.binary_kl_mask(logp, old, mask)


@pytest.mark.parametrize('name', sorted(MASKED))
def test_dropped_tokens_get_no_gradient(name):
  fn, kw = MASKED[name]
  logp, old, adv, mask = _f32(*_drift_batch(1))
  keep = np.asarray(_keep(name, logp, old, adv, mask))
  dropped, kept = (mask > 0) & (keep == 0), keep > 0
  assert dropped.sum() >= 3 and kept.sum() >= 3, (dropped.sum(), kept.sum())
  _, grad = _token_sum(fn, **kw, kl_tau=0.0)(logp, old, adv, mask)
  grad = np.asarray(grad)
  assert np.all(grad[dropped] == 0.0)
  assert np.all(grad[np.asarray(mask) == 0] == 0.0)
  rho = np.exp(np.asarray(logp - old))
  np.testing.assert_allclose(grad[kept], (-rho * np.asarray(adv))[kept], rtol=1e-5, atol=1e-7)
  # With τ > 0 a dropped token gets exactly the penalty's gradient 2τ log ρ.
  _, grad = _token_sum(fn, **kw, kl_tau=0.01)(logp, old, adv, mask)
  log_rho = np.asarray(logp - old)
  np.testing.assert_allclose(np.asarray(grad)[dropped], 0.02 * log_rho[dropped], rtol=1e-5)


@pytest.mark.parametrize('name', sorted(MASKED))
def test_padding_garbage_changes_nothing_and_jit_matches_eager(name):
  fn, kw = MASKED[name]
  logp, old, adv, mask = _f32(*_drift_batch(2))
  f = _token_sum(fn, **kw, kl_tau=0.01)
  clean = f(logp, old, adv, mask)
  pad = mask == 0
  garbage = f(jnp.where(pad, 90.0, logp), jnp.where(pad, -jnp.inf, old), adv, mask)
  np.testing.assert_array_equal(clean[0], garbage[0])
  np.testing.assert_array_equal(clean[1], garbage[1])
  jitted = jax.jit(f)(logp, old, adv, mask)
  np.testing.assert_allclose(jitted[0], clean[0], rtol=1e-6)
  np.testing.assert_allclose(jitted[1], clean[1], rtol=1e-6, atol=1e-9)


# Peers, re-derived in NumPy ---------------------------------------------------------


def _prime_rl_default_loss(trainer_logp, inference_logp, adv, loss_mask, mask_low, mask_high, tau):
  """prime-rl v0.8, src/prime_rl/trainer/rl/loss.py, default_loss_fn (one
  packed sample, float64): probs_diff = exp(trainer) − exp(inference); masked
  where A > 0 and probs_diff > mask_high, or A ≤ 0 and probs_diff < −mask_low;
  loss = Σ(−keep · A · ratio + τ · loss_mask · log_ratio²), keep = loss_mask
  and not masked; compute_loss divides by the global token count."""
  log_ratio = trainer_logp - inference_logp
  ratio = np.exp(log_ratio)
  diff = np.exp(trainer_logp) - np.exp(inference_logp)
  masked = np.where(adv > 0, diff > mask_high, diff < -mask_low)
  keep = loss_mask & ~masked
  per_token = -(keep * adv * ratio) + tau * (loss_mask * log_ratio**2)
  return per_token.sum()


@pytest.mark.parametrize('seed', range(3))
def test_dppo_matches_prime_rls_default_loss(seed):
  logp, old, adv, mask = _drift_batch(10 + seed)
  bool_mask = mask > 0

  def prime_rl(lp):
    total = sum(
      _prime_rl_default_loss(lp[i], old[i], adv[i], bool_mask[i], 0.2, 0.2, 1e-3)
      for i in range(len(lp))
    )
    return total / bool_mask.sum()

  def jrl_loss(lp):
    loss_BxT, _ = L.dppo_loss(lp, *_f32(old, adv, mask))
    return L.aggregate(loss_BxT, jnp.asarray(mask, jnp.float32), 'token-mean')

  loss, grad = jax.value_and_grad(jrl_loss)(jnp.asarray(logp, jnp.float32))
  assert float(loss) == pytest.approx(prime_rl(logp), rel=1e-5, abs=1e-7)
  # Its gradient by central differences; no token is within h of a mask
  # boundary here (checked), where a difference would straddle the jump.
  h, want = 1e-7, np.zeros_like(logp)
  keep_at = lambda lp: L.prob_diff_mask(*_f32(lp, old, adv, mask))
  for shifted in (logp + h, logp - h):
    np.testing.assert_array_equal(keep_at(shifted), keep_at(logp))
  for idx in np.ndindex(logp.shape):
    up, down = logp.copy(), logp.copy()
    up[idx] += h
    down[idx] -= h
    want[idx] = (prime_rl(up) - prime_rl(down)) / (2 * h)
  np.testing.assert_allclose(grad, want, rtol=1e-3, atol=1e-6)


def test_prime_rl_preset_matches_prime_rls_grpo():
  """`grpo_loss(preset='prime_rl')`: prime-rl's GRPO advantage (reward minus
  the group mean, orchestrator/algo/grpo.py) into its default loss, over
  the global token count."""
  logp, old, _, mask = _drift_batch(30, b=8)
  rewards = np.random.default_rng(30).integers(0, 2, size=8).astype(np.float64)
  groups = rewards.reshape(-1, 4)
  adv_B = (groups - groups.mean(1, keepdims=True)).reshape(-1)
  adv = np.repeat(adv_B[:, None], logp.shape[1], axis=1)
  bool_mask = mask > 0
  want = (
    sum(
      _prime_rl_default_loss(logp[i], old[i], adv[i], bool_mask[i], 0.2, 0.2, 1e-3)
      for i in range(len(logp))
    )
    / bool_mask.sum()
  )
  got, _ = L.grpo_loss(
    *_f32(logp, old), None, *_f32(rewards, mask), group_size=4, preset='prime_rl'
  )
  assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-7)


def _areal_keep_ratio(proximal, behave, loss_mask, lower, upper):
  """AReaL 2.0 areal/utils/functional/functional.py, apply_rejection_sampling
  with level='token', action='mask', metric='ratio' (float64): metric =
  exp(proximal − behave), in bounds iff lower ≤ metric ≤ upper (upper only
  when lower is None); the loss mask keeps in-bounds tokens."""
  metric = np.exp(proximal - behave)
  ok = metric <= upper if lower is None else (metric >= lower) & (metric <= upper)
  return loss_mask & ok


def _areal_keep_binary_kl(proximal, behave, loss_mask, upper, eps=1e-8, dtype=np.float64):
  """The same with metric='binary_kl': compute_binary_kl_divergence clamps
  p, q to [eps, 1 − eps] and takes p log(p/q) + (1 − p) log((1 − p)/(1 − q));
  the metric is the larger of the two directions, in bounds iff ≤ upper."""

  def kl(lp, lq):
    lo, hi = dtype(eps), dtype(1 - eps)  # in float32, 1 − 1e−8 rounds to 1
    p = np.clip(np.exp(lp.astype(dtype)), lo, hi)
    q = np.clip(np.exp(lq.astype(dtype)), lo, hi)
    with np.errstate(divide='ignore', invalid='ignore'):
      return p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))

  return loss_mask & (np.maximum(kl(proximal, behave), kl(behave, proximal)) <= upper)


@pytest.mark.parametrize('seed', range(3))
def test_masks_match_areals_rejection_sampling(seed):
  logp, old, _, mask = _drift_batch(20 + seed, b=16, t=32)
  bool_mask = mask > 0
  args = _f32(logp, old, mask)
  for lower, upper in ((0.5, 5.0), (None, 2.0)):
    got = L.ratio_band_mask(*args, low=lower or 0.0, high=upper)
    want = _areal_keep_ratio(logp, old, bool_mask, lower, upper)
    np.testing.assert_array_equal(np.asarray(got) > 0, want)
  for upper in (0.1, 0.5, 2.0):
    got = L.binary_kl_mask(*args, threshold=upper)
    want = _areal_keep_binary_kl(logp, old, bool_mask, upper)
    np.testing.assert_array_equal(np.asarray(got) > 0, want)
    assert 0 < want.sum() < bool_mask.sum() or upper == 2.0


# The registry: which losses bound the update ---------------------------------------


def test_unbounded_reason():
  defaults = L.default_args(L.POLICY_LOSSES, L.POLICY_LOSS_ARGS)
  for name, args in defaults.items():
    reason = L.unbounded_reason(L.PolicyLoss.of(name, args))
    assert (reason is None) == (name != 'importance_sampling'), (name, reason)
  reason = lambda name, args: L.unbounded_reason(L.PolicyLoss.of(name, args))
  assert 'neither clipped nor masked' in reason('importance_sampling', {})
  # DPPO drops no token with A > 0 once δ_high ≥ 1 (π − π_old ≤ 1 always).
  assert reason('dppo', {'delta_high': 0.99}) is None
  assert 'delta_high=1.0' in reason('dppo', {'delta_high': 1.0})
  assert reason('icepop', {'high': math.inf}) is not None
  assert reason('ppo', {'eps_low': 0.2, 'eps_high': None}) is None
  assert 'eps_high=inf' in reason('ppo', {'eps_low': math.inf})  # eps_high defaults to it
  with pytest.raises(ValueError, match='`policy_loss` must be one of'):
    L.unbounded_reason(L.PolicyLoss('reinforce'))


def test_bad_arguments_are_named():
  logp, old, adv, mask = _f32(*_drift_batch(3))
  with pytest.raises(ValueError, match=r'`high` \(0.5\) must be > `low` \(0.5\)'):
    L.icepop_loss(logp, old, adv, mask, low=0.5, high=0.5)
  with pytest.raises(ValueError, match='`delta_high` must be >= 0'):
    L.dppo_loss(logp, old, adv, mask, delta_high=-0.1)
  with pytest.raises(ValueError, match='`threshold` must be > 0'):
    L.kpop_loss(logp, old, adv, mask, threshold=0.0)
  with pytest.raises(ValueError, match='`kl_tau` must be >= 0'):
    L.icepop_loss(logp, old, adv, mask, kl_tau=-1.0)
  with pytest.raises(ValueError, match='`mask` must have the same shape'):
    L.ratio_band_mask(logp, old, mask[:, :2])
