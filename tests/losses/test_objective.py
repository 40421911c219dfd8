"""`jrl.losses.Objective`: its values checked by the kernels' own checks, and
`token_loss`, the one composition of its terms, against the terms composed
by hand from the kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrl.losses as L

B, T = 4, 5


@pytest.mark.parametrize(
  'fields, message',
  [
    ({'kl_input_clamp': 0.0}, '`rl.kl.input_clamp` must be > 0, got 0.0.'),
    ({'kl_output_clamp': -1.0}, '`rl.kl.output_clamp` must be > 0, got -1.0.'),
    ({'kl_estimator': 'k4'}, "`rl.kl.estimator` must be one of ('k1', 'abs', 'k2', 'k3'"),
    ({'loss_agg': 'mean'}, "`rl.reduction.mode` must be one of ('token-mean'"),
    ({'loss_norm': 0.0}, '`rl.reduction.loss_norm` must be > 0, got 0.0.'),
    ({'off_policy_mask_threshold': -0.5}, '`rl.off_policy_mask_threshold` must be >= 0'),
    ({'kl_input_clamp': '20'}, "`rl.kl.input_clamp` must be a number, got '20' (str)."),
  ],
)
def test_check_names_the_field_the_kernel_refuses(fields, message):
  with pytest.raises(ValueError) as info:
    L.Objective(**fields).check('rl')
  assert str(info.value).startswith(message)


def test_every_preset_passes_its_kernels_checks():
  for name, preset in L.PRESETS.items():
    assert preset.check(name) is preset
    assert L.PolicyLoss.make(preset.policy.name, preset.policy.kwargs) == preset.policy
    assert L.Advantage.make(preset.advantage.name, preset.advantage.kwargs) == preset.advantage


def _inputs():
  k = jax.random.split(jax.random.key(3), 6)
  mask = jnp.arange(T)[None, :] < jnp.asarray([5, 3, 4, 2])[:, None]
  logp = -jax.random.uniform(k[0], (B, T), minval=0.1, maxval=3.0)
  old = logp + 0.4 * jax.random.normal(k[1], (B, T))
  ref = logp + 0.3 * jax.random.normal(k[2], (B, T))
  adv = jax.random.normal(k[3], (B, 1)) * jnp.ones((B, T))
  entropy = jax.random.uniform(k[4], (B, T))
  weights = jax.random.uniform(k[5], (B, T), minval=0.5, maxval=1.5)
  return logp, old, ref, adv, mask, entropy, weights


def test_token_loss_is_the_terms_composed_by_hand():
  """ℓ = policy · M · w + β KL − c_H H, each kernel called directly."""
  logp, old, ref, adv, mask, entropy, weights = _inputs()
  objective = L.Objective(
    policy=L.PolicyLoss.make('sapo', {'tau_neg': 1.5}),
    kl_coef=0.1,
    kl_estimator='k2',
    kl_output_clamp=5.0,
    entropy_coef=0.01,
    off_policy_mask_threshold=0.05,
    loss_agg='seq-mean-token-mean',
  )
  total, pg, kl, metrics = L.token_loss(
    objective, logp, old, adv, mask, ref_logp=ref, entropy=entropy, is_weights=weights
  )
  want_pg, want_metrics = L.sapo_loss(logp, old, adv, mask, tau_neg=1.5)
  keep, _ = L.off_policy_sequence_mask(logp, old, adv, mask, threshold=0.05)
  assert float(jnp.sum(1 - keep)) > 0  # the mask drops a sequence here
  want_pg = want_pg * keep * weights
  want_kl = L.kl_penalty(logp, ref, estimator='k2', output_clamp=5.0, mask=mask)
  want = want_pg + 0.1 * want_kl + 0.01 * L.entropy_loss(entropy, mask)
  np.testing.assert_array_equal(pg, want_pg)
  np.testing.assert_array_equal(kl, want_kl)
  np.testing.assert_allclose(total, want, rtol=1e-6, atol=1e-7)
  assert set(want_metrics) <= set(metrics)
  np.testing.assert_allclose(
    objective.aggregate(total, mask), L.aggregate(want, mask, 'seq-mean-token-mean'), rtol=1e-6
  )


def test_token_loss_asks_for_what_its_terms_need():
  logp, old, _, adv, mask, *_ = _inputs()
  with pytest.raises(ValueError, match='`ref_logp` is required'):
    L.token_loss(L.Objective(kl_coef=0.1), logp, old, adv, mask)
  with pytest.raises(ValueError, match='`entropy` is required'):
    L.token_loss(L.Objective(entropy_coef=0.1), logp, old, adv, mask)
