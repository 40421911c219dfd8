"""Golden tests: each preset reproduces its framework's GRPO.

Each `_ref_*` below is written from that framework's own formulation (in its
own form: TRL's −min(ρA, clip(ρ)A), veRL's where(A < 0, dual-clipped, clipped),
NeMo-RL's leave-one-out std), in float64 NumPy, without calling jrl. The
presets must agree with them on random batches and on the edge cases where
the frameworks differ: singleton groups, zero-variance groups, fully masked
sequences and extreme log-ratios.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrl.losses as L

FRAMEWORKS = ('verl', 'trl', 'openrlhf', 'nemo_rl')


def _masked_mean(x, m):
  return (x * m).sum() / m.sum() if m.sum() > 0 else 0.0


def _ref_verl(logp, old, ref, rewards, mask, g, beta=0.001):
  adv = np.zeros_like(rewards)
  for start in range(0, len(rewards), g):
    s = rewards[start : start + g]
    mean, std = (0.0, 1.0) if g == 1 else (s.mean(), s.std(ddof=1))
    adv[start : start + g] = (s - mean) / (std + 1e-6)
  a = adv[:, None] * mask
  ratio = np.exp(np.clip(logp - old, -20.0, 20.0))
  l1 = -a * ratio
  l2 = -a * np.clip(ratio, 0.8, 1.2)
  clip1 = np.maximum(l1, l2)
  clip2 = np.minimum(-a * 3.0, clip1)
  pg = np.where(a < 0, clip2, clip1)
  x = np.clip(ref - logp, -20.0, 20.0)
  kl = np.clip(np.exp(x) - x - 1.0, -10.0, 10.0)
  return _masked_mean(pg + beta * kl, mask)


def _ref_trl(logp, old, ref, rewards, mask, g, beta=0.0, use_bias_correction_kl=True):
  grouped = rewards.reshape(-1, g)
  mean = grouped.mean(1).repeat(g)
  std = (grouped.std(1, ddof=1) if g > 1 else np.zeros(len(grouped))).repeat(g)
  adv = (rewards - mean) / (std + 1e-4)
  coef_1 = np.exp(logp - old)
  coef_2 = np.clip(coef_1, 0.8, 1.2)
  per_token = -np.minimum(coef_1 * adv[:, None], coef_2 * adv[:, None])
  d = ref - logp
  per_token_kl = np.exp(d) - d - 1.0
  if use_bias_correction_kl:
    per_token_kl = per_token_kl * coef_1
  per_token = per_token + beta * per_token_kl
  return (per_token * mask).sum() / max(mask.sum(), 1.0)


def _ref_openrlhf(logp, old, ref, rewards, mask, g, beta=0.01):
  assert g > 1
  grouped = rewards.reshape(-1, g)
  adv = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-9)
  adv = adv.reshape(-1)[:, None]
  ratio = np.exp(logp - old)
  surr1 = ratio * adv
  surr2 = np.clip(ratio, 0.8, 1.2) * adv
  pg = _masked_mean(-np.minimum(surr1, surr2), mask)
  lr = -(logp - ref)
  kl = np.clip(np.exp(lr) - 1.0 - lr, -10.0, 10.0)
  return pg + beta * _masked_mean(kl, mask)


def _ref_nemo(logp, old, ref, rewards, mask, g, beta=0.01):
  adv = np.zeros_like(rewards)
  for start in range(0, len(rewards), g):
    s = rewards[start : start + g]
    for i in range(g):
      others = np.delete(s, i)
      if len(others) == 0:
        continue  # baseline = the reward itself: advantage 0.
      baseline = others.mean()
      std = others.std(ddof=1) if len(others) > 1 else 0.0
      a = s[i] - baseline
      adv[start + i] = a / (std + 1e-6) if std > 0 else a
  a = adv[:, None]
  ratio = np.exp(logp - old)
  pg = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.2))
  logr = np.clip(ref - logp, -20.0, 20.0)
  kl = np.clip(np.exp(logr) - 1.0 - logr, -10.0, 10.0)
  return _masked_mean(pg + beta * kl, mask)


REFERENCES = {
  'verl': _ref_verl,
  'trl': _ref_trl,
  'openrlhf': _ref_openrlhf,
  'nemo_rl': _ref_nemo,
}


def _batch(seed, b=8, t=6, scale=0.3):
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 3.0, (b, t))
  old = logp + rng.normal(0, scale, (b, t))
  ref = logp + rng.normal(0, scale, (b, t))
  rewards = rng.integers(0, 3, b).astype(np.float64) / 2
  lengths = rng.integers(1, t + 1, b)
  mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
  return logp, old, ref, rewards, mask


def _jrl(name, logp, old, ref, rewards, mask, g, **kw):
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss, _ = L.grpo_loss(
    f32(logp), f32(old), f32(ref), f32(rewards), f32(mask), group_size=g, preset=name, **kw
  )
  return float(loss)


@pytest.mark.parametrize('name', FRAMEWORKS)
@pytest.mark.parametrize('seed', range(4))
def test_matches_framework_reference_on_random_batches(name, seed):
  args = _batch(seed)
  expected = REFERENCES[name](*args, g=4)
  np.testing.assert_allclose(_jrl(name, *args, g=4), expected, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize('name', FRAMEWORKS)
def test_kl_term_matches_with_the_framework_default_coefficient(name):
  # Large policy/reference gap so the KL clamps matter for veRL and NeMo-RL.
  logp, old, ref, rewards, mask = _batch(7, scale=3.0)
  ref[0, 0] = logp[0, 0] + 30.0  # exp(30) k3 is clamped to 10 by veRL, OpenRLHF, NeMo-RL.
  beta = 0.05
  expected = REFERENCES[name](logp, old, ref, rewards, mask, g=4, beta=beta)
  got = _jrl(name, logp, old, ref, rewards, mask, 4, kl_coef=beta)
  np.testing.assert_allclose(got, expected, rtol=2e-5)


def test_trl_preset_kl_is_ratio_corrected_k3_as_trls_default():
  # GRPOConfig(use_bias_correction_kl=True) is TRL 1.16's default: with β > 0
  # the preset's KL term is k3 times π/π_old; releases before it defaulted to
  # plain k3, which `_replace(kl_estimator='k3')` gives, and which differs on a
  # batch where old_logp ≠ logp.
  logp, old, ref, rewards, mask = _batch(12, scale=0.5)
  assert L.get_preset('trl').kl_estimator == 'k3_ratio_corrected'
  got = _jrl('trl', logp, old, ref, rewards, mask, 4, kl_coef=0.5)
  plain = _ref_trl(logp, old, ref, rewards, mask, 4, beta=0.5, use_bias_correction_kl=False)
  corrected = _ref_trl(logp, old, ref, rewards, mask, 4, beta=0.5)
  np.testing.assert_allclose(got, corrected, rtol=2e-5)
  assert abs(plain - corrected) > 1e-3
  old_default = L.get_preset('trl')._replace(kl_estimator='k3')
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  got_plain = L.grpo_loss(
    f32(logp), f32(old), f32(ref), f32(rewards), f32(mask), group_size=4,
    preset=old_default, kl_coef=0.5,
  )[0]  # fmt: skip
  np.testing.assert_allclose(float(got_plain), plain, rtol=2e-5)


@pytest.mark.parametrize('seed', range(3))
def test_trl_use_bias_correction_kl_is_k3_ratio_corrected(seed):
  # TRL's per_token_kl * coef_1 (coef_1 = exp(logp − old), differentiated):
  # value and gradient of the whole GRPO loss against TRL's form.
  logp, old, ref, rewards, mask = _batch(20 + seed, scale=0.5)
  preset = L.get_preset('trl')._replace(kl_estimator='k3_ratio_corrected')
  beta = 0.3
  want = _ref_trl(logp, old, ref, rewards, mask, 4, beta=beta, use_bias_correction_kl=True)
  f32 = lambda x: jnp.asarray(x, jnp.float32)

  def loss_fn(lp):
    return L.grpo_loss(
      lp, f32(old), f32(ref), f32(rewards), f32(mask), group_size=4, preset=preset, kl_coef=beta
    )[0]

  loss, grad = jax.value_and_grad(loss_fn)(f32(logp))
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  h = 1e-6
  for i, j in [(0, 0), (2, 1), (5, 0), (7, 3)]:
    if mask[i, j] == 0:
      continue
    up, down = logp.copy(), logp.copy()
    up[i, j] += h
    down[i, j] -= h
    ref_kw = dict(beta=beta, use_bias_correction_kl=True)
    fd = (
      _ref_trl(up, old, ref, rewards, mask, 4, **ref_kw)
      - _ref_trl(down, old, ref, rewards, mask, 4, **ref_kw)
    ) / (2 * h)
    assert float(grad[i, j]) == pytest.approx(fd, rel=1e-3, abs=1e-6)


def test_presets_differ_where_the_frameworks_do():
  # Same batch, four different numbers: the presets are not aliases.
  args = _batch(3)
  losses = {name: _jrl(name, *args, g=4) for name in FRAMEWORKS}
  assert len({round(v, 6) for v in losses.values()}) == len(FRAMEWORKS), losses


# Edge cases --------------------------------------------------------------------


def test_singleton_groups_follow_each_convention():
  logp, old, ref, rewards, mask = _batch(11, b=4)
  rewards = np.array([1.0, 0.0, 0.5, 1.0])
  old = logp.copy()  # ratio 1: the loss is −Σ A m / Σ m
  adv = {
    name: np.asarray(L.get_preset(name).advantage.outcome(jnp.asarray(rewards, jnp.float32), 1))
    for name in ('verl', 'trl', 'nemo_rl')
  }
  # veRL: mean := 0, std := 1, so A = r / (1 + 1e-6).
  np.testing.assert_allclose(adv['verl'], rewards / (1 + 1e-6), rtol=1e-6)
  # TRL sets std := 0 for a lone sample, A = 0 / 1e-4 = 0; NeMo-RL: baseline = reward.
  np.testing.assert_array_equal(adv['trl'], 0.0)
  np.testing.assert_array_equal(adv['nemo_rl'], 0.0)
  # OpenRLHF refuses G = 1.
  with pytest.raises(ValueError, match='group_size'):
    _jrl('openrlhf', logp, old, ref, rewards, mask, 1)
  for name in ('verl', 'trl', 'nemo_rl'):
    expected = REFERENCES[name](logp, old, ref, rewards, mask, g=1)
    np.testing.assert_allclose(_jrl(name, logp, old, ref, rewards, mask, 1), expected, rtol=2e-5)


@pytest.mark.parametrize('name', [*FRAMEWORKS, 'dr_grpo', 'dapo'])
def test_zero_variance_group_has_exactly_zero_advantage(name):
  # 0.1 is not representable: (r − mean) / ε would be float noise / 1e-6.
  rewards = jnp.array([0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 1.0], jnp.float32)
  adv = np.asarray(L.get_preset(name).advantage.outcome(rewards, 4))
  np.testing.assert_array_equal(adv[:4], 0.0)
  assert np.all(adv[4:] != 0.0)


@pytest.mark.parametrize('name', FRAMEWORKS)
def test_fully_masked_sequence_contributes_nothing(name):
  logp, old, ref, rewards, mask = _batch(5)
  mask[2] = 0.0
  expected = REFERENCES[name](logp, old, ref, rewards, mask, g=4)
  got = _jrl(name, logp, old, ref, rewards, mask, 4)
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6)
  # Changing anything in the masked row's tokens changes nothing.
  logp2 = logp.copy()
  logp2[2] += 5.0
  assert _jrl(name, logp2, old, ref, rewards, mask, 4) == pytest.approx(got, rel=1e-6)


@pytest.mark.parametrize('name', FRAMEWORKS)
def test_extreme_log_ratios(name):
  logp, old, ref, rewards, mask = _batch(9)
  # ±30 nats between policy and behaviour: only veRL clamps (at 20) and
  # dual-clips (A < 0 capped at 3|A|); the others follow exp(±30) as it is.
  old[:, 0] = logp[:, 0] - 30.0
  old[:, 1] = logp[:, 1] + 30.0
  expected = REFERENCES[name](logp, old, ref, rewards, mask, g=4)
  got = _jrl(name, logp, old, ref, rewards, mask, 4)
  assert np.isfinite(got)
  np.testing.assert_allclose(got, expected, rtol=1e-5)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  grad = jax.grad(
    lambda lp: L.grpo_loss(
      lp, f32(old), f32(ref), f32(rewards), f32(mask), group_size=4, preset=name
    )[0]
  )(f32(logp))
  assert np.all(np.isfinite(np.asarray(grad)))


def test_verl_dual_clip_caps_negative_advantage_tokens():
  # One token, A < 0 and ρ = e^5 ≈ 148: TRL's loss is −A ρ, veRL's is 3|A|.
  logp = np.array([[-1.0], [-1.0]])
  old = logp - 5.0
  rewards = np.array([1.0, 0.0])  # A = ±(0.5 / (0.7071 + ε)) ≈ ±0.7071
  mask = np.array([[0.0], [1.0]])  # only the negative-advantage row counts
  a = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-6)
  assert _jrl('verl', logp, old, logp, rewards, mask, 2, kl_coef=0.0) == pytest.approx(3.0 * a)
  a_trl = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-4)
  expected_trl = a_trl * np.exp(5.0)
  assert _jrl('trl', logp, old, logp, rewards, mask, 2) == pytest.approx(expected_trl, rel=1e-5)


# Hand-computed values ----------------------------------------------------------
#
# Rewards [1, 0, 0, 0] (G = 4), response lengths [1, 2, 3, 4] of T = 4, logp =
# old_logp (ρ = 1, nothing clips), so the policy loss per token is −A.
#
# Group-normalised: mean 0.25, unbiased std 0.5, A = [1.5, −.5, −.5, −.5]·0.5/(0.5 + ε).
#   token-mean: −(1.5·1 − .5·2 − .5·3 − .5·4) / 10 = 3/10 = 0.3, times 0.5/(0.5 + ε).
# Dr. GRPO: A = [.75, −.25, −.25, −.25]; Σ_t A·m = .75 − .25·9 = −1.5;
#   divided by B·T = 16: loss = 1.5/16 = 0.09375.
# NeMo-RL leave-one-out: sample 0 has siblings [0, 0, 0]: b = 0, σ = 0, A = 1 unscaled.
#   Samples 1-3 have siblings [1, 0, 0]: b = 1/3, σ = sqrt(((2/3)² + 2(1/3)²)/2)
#   = sqrt(1/3), A = −(1/3)/sqrt(1/3) = −sqrt(1/3) (+ε); loss = −(1 − 9·sqrt(1/3))/10.


def _hand_batch():
  logp = np.full((4, 4), -1.0)
  mask = (np.arange(4)[None, :] < np.array([1, 2, 3, 4])[:, None]).astype(np.float64)
  return logp, logp.copy(), logp.copy(), np.array([1.0, 0.0, 0.0, 0.0]), mask


@pytest.mark.parametrize(
  'name, expected',
  [
    ('verl', 0.3 * 0.5 / (0.5 + 1e-6)),
    ('trl', 0.3 * 0.5 / (0.5 + 1e-4)),
    ('openrlhf', 0.3 * 0.5 / (0.5 + 1e-9)),
    ('dapo', 0.3 * 0.5 / (0.5 + 1e-6)),
    ('dr_grpo', 0.09375),
    ('nemo_rl', -(1.0 - 9.0 * np.sqrt(1 / 3) / (1 + 1e-6 * np.sqrt(3))) / 10.0),
  ],
)
def test_hand_computed_values(name, expected):
  assert _jrl(name, *_hand_batch(), 4) == pytest.approx(expected, rel=1e-5)


def test_verl_kl_term_hand_computed():
  # logp − ref = 0.1 everywhere: k3 = e^−0.1 − 1 + 0.1 = 0.0048374; β = 0.001.
  logp, old, _, rewards, mask = _hand_batch()
  ref = logp - 0.1
  k3 = np.exp(-0.1) - 1 + 0.1
  expected = 0.3 * 0.5 / (0.5 + 1e-6) + 0.001 * k3
  assert _jrl('verl', logp, old, ref, rewards, mask, 4) == pytest.approx(expected, rel=1e-5)


# Mechanics ---------------------------------------------------------------------


@pytest.mark.parametrize('name', FRAMEWORKS)
def test_jit_matches_eager_and_gradients_finite_under_full_masking(name):
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  logp, old, ref, rewards, mask = map(f32, _batch(2))

  def loss_fn(lp, m):
    return L.grpo_loss(lp, old, ref, rewards, m, group_size=4, preset=name)[0]

  assert float(jax.jit(loss_fn)(logp, mask)) == pytest.approx(float(loss_fn(logp, mask)), rel=1e-6)
  zero_mask = jnp.zeros_like(mask)
  loss, grad = jax.value_and_grad(loss_fn)(logp, zero_mask)
  assert float(loss) == 0.0
  np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_gradient_matches_reference_finite_differences():
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  logp, old, ref, rewards, mask = _batch(4, scale=0.05)
  grad = np.asarray(
    jax.grad(
      lambda lp: L.grpo_loss(
        lp, f32(old), f32(ref), f32(rewards), f32(mask), group_size=4, preset='verl'
      )[0]
    )(f32(logp))
  )
  h = 1e-6
  for i, j in [(0, 0), (3, 1), (5, 0), (7, 2)]:
    if mask[i, j] == 0:
      continue
    up, down = logp.copy(), logp.copy()
    up[i, j] += h
    down[i, j] -= h
    fd = (
      _ref_verl(up, old, ref, rewards, mask, 4) - _ref_verl(down, old, ref, rewards, mask, 4)
    ) / (2 * h)
    assert grad[i, j] == pytest.approx(fd, rel=1e-3, abs=1e-6)


def test_bad_input():
  args = [jnp.zeros((8, 3))] * 3 + [jnp.zeros(8), jnp.ones((8, 3))]
  with pytest.raises(ValueError, match='preset'):
    L.grpo_loss(*args, group_size=4, preset='deepspeed')
  with pytest.raises(ValueError, match='group_size'):
    L.grpo_loss(*args, group_size=3, preset='verl')
  with pytest.raises(ValueError, match='rewards'):
    L.grpo_loss(*args[:3], jnp.zeros(6), args[4], group_size=2, preset='verl')
  with pytest.raises(ValueError, match='ref_logp'):
    L.grpo_loss(*args[:2], None, *args[3:], group_size=4, preset='verl')
  with pytest.raises(ValueError, match='mask'):
    L.grpo_loss(*args[:4], jnp.ones((8, 4)), group_size=4, preset='verl')


def test_verl_clamp_keeps_gradients_finite_beyond_float32_range():
  # exp(100) overflows float32. veRL clamps log ρ at 20 first, so value and
  # gradient stay finite; without the clamp the gradient through the
  # unselected branch is 0 · inf = NaN.
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  logp, old, ref, rewards, mask = _batch(13)
  old[:, 0] = logp[:, 0] - 100.0
  old[:, 1] = logp[:, 1] + 100.0

  def loss_fn(lp, preset):
    return L.grpo_loss(
      lp, f32(old), f32(ref), f32(rewards), f32(mask), group_size=4, preset=preset
    )[0]

  loss, grad = jax.value_and_grad(loss_fn)(f32(logp), L.get_preset('verl'))
  np.testing.assert_allclose(float(loss), _ref_verl(logp, old, ref, rewards, mask, 4), rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(grad)))
  verl = L.get_preset('verl')
  unclamped = verl._replace(policy=verl.policy.replace(log_ratio_clamp=None))
  assert not np.all(np.isfinite(np.asarray(jax.grad(loss_fn)(f32(logp), unclamped))))
