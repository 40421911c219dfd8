"""Policy-gradient losses: PPO clip (clip-higher, dual-clip), GSPO, GMPO,
CISPO, SAPO (soft gate), VESPO (reshaped sequence weights), the plain and
the masked importance-sampling losses (IcePop, DPPO, KPop), the off-policy
sequence mask, and importance-sampling corrections for sampler/trainer
mismatch.

The clipped surrogates (PPO, GSPO, GMPO) are here; the losses that reweight
the gradient instead of clipping it (CISPO, SAPO, VESPO) are in
`policy_weighted.py`, the importance-sampling losses whose trust region is a
token mask instead of a clip in `policy_masked.py`, the off-policy mask and
importance weights in `off_policy.py`; all are importable from this module.

Every loss takes per-token log-probabilities under the current policy
(`logp`, differentiated), the behaviour policy (`old_logp`, constants), token
advantages and a response mask, all `[B, T]`, and returns
`(loss [B, T], metrics)`: the *per-token* loss, zero where the mask is 0, to
be reduced by one of `jrl.losses.reductions`, and a dict of scalar
diagnostics (masked token means, over devices when `axis_name` is given):

* `clipfrac_high`: tokens with A > 0 whose ratio is above 1 + ε_high
  (the update is cut off on the upside);
* `clipfrac_low`: tokens with A < 0 whose ratio is below 1 − ε_low;
* `clipfrac`: either of the two (veRL's `pg_clipfrac`);
* `dual_clipfrac`: tokens with A < 0 where the dual clip bound is active
  (veRL's `pg_clipfrac_lower`);
* `ppo_kl`: mean of old_logp − logp, the k1 estimate of KL(old ‖ new)
  (veRL's `ppo_kl`);
* `approx_kl`: mean of (ρ − 1) − log ρ, the k3 estimate of KL(old ‖ new)
  (Schulman's low-variance estimator; TRL's and OpenRLHF's `approx_kl`).

The log-ratio log ρ = logp − old_logp is computed in float32.
"""

import jax
import jax.numpy as jnp

from jrl.losses import reductions
from jrl.losses._checks import check_below_one, check_positive
from jrl.losses._policy_common import _check_inputs, _kl_metrics, _log_ratio, _mean
from jrl.losses.off_policy import (
  IS_LEVELS,
  IS_MODES,
  importance_weights,
  off_policy_sequence_mask,
)
from jrl.losses.policy_masked import (
  binary_kl,
  binary_kl_mask,
  dppo_loss,
  icepop_loss,
  importance_sampling_loss,
  kpop_loss,
  prob_diff_mask,
  ratio_band_mask,
)
from jrl.losses.policy_weighted import cispo_loss, sapo_loss, vespo_loss, vespo_weights


def _clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip_c):
  """Per-token PPO loss and its clip indicators (see `ppo_clip_loss`)."""
  surr1 = -advantages * ratio
  surr2 = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(surr1, surr2)
  dual_active = jnp.zeros_like(loss, dtype=bool)
  if dual_clip_c is not None:
    # For A < 0 the ratio is unbounded above; cap the loss at −c·A.
    surr3 = -advantages * dual_clip_c
    dual_active = (advantages < 0) & (loss > surr3)
    loss = jnp.where(advantages < 0, jnp.minimum(loss, surr3), loss)
  high = (advantages > 0) & (ratio > 1.0 + eps_high)
  low = (advantages < 0) & (ratio < 1.0 - eps_low)
  return loss, high, low, dual_active


def ppo_clip_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  eps_low=0.2,
  eps_high=None,
  dual_clip_c=None,
  log_ratio_clamp=None,
  axis_name=None,
):
  """PPO clipped surrogate (Schulman et al. 2017), per token.

    ρ_t = exp(logp_t − old_logp_t)
    ℓ_t = max(−A_t ρ_t, −A_t clip(ρ_t, 1 − ε_low, 1 + ε_high))
    dual clip (Ye et al. 2020), for A_t < 0 only:  ℓ_t ← min(ℓ_t, −c·A_t)

  Clip-higher (DAPO, Yu et al. 2025) is ε_high > ε_low (DAPO: 0.2 / 0.28);
  `eps_high=None` means ε_high = ε_low. Dual clip needs c > 1 (veRL's
  default `clip_ratio_c` is 3). `log_ratio_clamp` clamps log ρ to [−c, c]
  before exp (veRL clamps at 20; TRL, OpenRLHF and NeMo-RL do not clamp).

  Args:
    logp: [B, T] current-policy token logprobs (differentiated).
    old_logp: [B, T] behaviour-policy logprobs (treated as constants).
    advantages: [B, T] (broadcast sequence advantages beforehand).
    mask: [B, T] 0/1 response mask.
    eps_low: ε_low > 0.  eps_high: ε_high > 0 or None.
    dual_clip_c: c > 1 or None.  log_ratio_clamp: > 0 or None.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics dict of [] float32).
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  eps_high = eps_low if eps_high is None else eps_high
  check_positive(eps_low, 'eps_low')
  check_below_one(eps_low, 'eps_low')
  check_positive(eps_high, 'eps_high')
  if dual_clip_c is not None and not dual_clip_c > 1.0:
    raise ValueError(f'`dual_clip_c` must be > 1, got {dual_clip_c!r}.')
  log_ratio = _log_ratio(logp, old_logp, log_ratio_clamp)
  ratio = jnp.exp(log_ratio)
  loss, high, low, dual = _clipped_surrogate(ratio, adv, eps_low, eps_high, dual_clip_c)
  metrics = {
    'clipfrac_high': _mean(high, m, axis_name),
    'clipfrac_low': _mean(low, m, axis_name),
    'clipfrac': _mean(high | low, m, axis_name),
    'dual_clipfrac': _mean(dual, m, axis_name),
    **_kl_metrics(log_ratio, m, axis_name),
  }
  return loss * m, metrics


def gspo_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  eps_low=3e-4,
  eps_high=4e-4,
  axis_name=None,
):
  """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025), per token.

  The importance ratio is the length-normalised sequence ratio
    s_i = exp( (1/|y_i|) Σ_t m_t (logp_t − old_logp_t) ),
  clipped as in PPO with the sequence advantage. The token-level form of
  the paper (GSPO-token) is used so that the loss can be reduced like any
  other:
    s_{i,t} = sg[s_i] · exp(logp_t − sg[logp_t])   (value s_i, gradient s_i ∇logp_t)
    ℓ_{i,t} = max(−A_{i,t} s_{i,t}, −A_{i,t} clip(s_{i,t}, 1 − ε_low, 1 + ε_high))
  With A constant over a sequence and the 'seq-mean-token-mean'
  aggregation this is exactly the sequence-level GSPO objective (veRL forces
  that aggregation for GSPO, and clamps log s at 10; TRL's
  `importance_sampling_level="sequence"` computes s_i without the
  token-level form, with the same value and gradient). The paper's ranges
  are tiny (3e-4 / 4e-4) because s_i is a geometric mean.

  Args:
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    eps_low, eps_high: > 0.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T], metrics) with the clip fractions counted per token and
    `seq_ratio_mean`, the mean of s_i over sequences.
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  check_positive(eps_low, 'eps_low')
  check_below_one(eps_low, 'eps_low')
  check_positive(eps_high, 'eps_high')
  log_ratio = logp - old_logp
  length_B = jnp.maximum(jnp.sum(m, axis=-1), 1.0)
  seq_log_ratio_B = jnp.sum(log_ratio * m, axis=-1) / length_B
  seq_log_ratio_B = jax.lax.stop_gradient(seq_log_ratio_B)
  logp_const = jax.lax.stop_gradient(logp)
  # Value s_i, gradient s_i · ∇logp_t.
  ratio = jnp.exp(seq_log_ratio_B[:, None] + logp - logp_const)
  loss, high, low, _ = _clipped_surrogate(ratio, adv, eps_low, eps_high, None)
  metrics = {
    'clipfrac_high': _mean(high, m, axis_name),
    'clipfrac_low': _mean(low, m, axis_name),
    'clipfrac': _mean(high | low, m, axis_name),
    'seq_ratio_mean': reductions.seq_mean_token_mean(
      jax.lax.stop_gradient(ratio), m, axis_name=axis_name
    ),
    **_kl_metrics(log_ratio, m, axis_name),
  }
  return loss * m, metrics


def gmpo_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  eps_low=0.4,
  eps_high=0.4,
  axis_name=None,
):
  """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673), per token.

  GRPO maximises the arithmetic mean of the clipped token ratios; GMPO the
  geometric mean, which an outlier ratio moves far less. Each token's
  log-ratio is clipped on the side its advantage pushes (PPO's pessimistic
  min, written in log space) *before* the mean:

    r_t   = logp_t − old_logp_t
    c_t   = min(r_t, clip(r_t, −ε_low, ε_high))   if A_t > 0
            max(r_t, clip(r_t, −ε_low, ε_high))   if A_t ≤ 0
    s_i   = exp( (1/|y_i|) Σ_t m_t c_t )            (geometric mean of the clipped ratios)
    J_i   = −A_i · s_i                               (sequence loss; L = mean_i J_i)

  so the ratio range is (e^(−ε_low), e^(ε_high)): ε is in log space, and the
  paper's (and TRL's `GMPOConfig`) default 0.4 / 0.4 is wider than PPO's
  because the geometric mean already damps single tokens. GSPO
  (`gspo_loss`) clips the sequence ratio after the mean instead.

  Written per token, like GSPO-token, so that it reduces like any other loss:

    ℓ_{i,t} = −A_{i,t} · sg[s_i] · exp(c_t − sg[c_t])   (value −A s_i, gradient −A s_i ∇c_t)

  With A constant over a sequence and the 'seq-mean-token-mean'
  aggregation, Σ_i mean_t ℓ_{i,t} / B = mean_i J_i in value and gradient:
  exactly TRL's `GMPOTrainer` loss (trl/experimental/gmpo, which divides by
  B without a token normaliser). With per-token advantages each token
  clips by its own sign. A_t = 0 takes the max branch (as TRL); its loss is
  0 either way.

  Args:
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    eps_low, eps_high: > 0, in log space.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics) with
    `clipfrac_high` (A > 0 and r > ε_high), `clipfrac_low` (A < 0 and
    r < −ε_low), `clipfrac`, `seq_ratio_mean` (mean of s_i over sequences)
    and the KL metrics.
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  check_positive(eps_low, 'eps_low')
  check_positive(eps_high, 'eps_high')
  log_ratio = logp - old_logp
  clamped = jnp.clip(log_ratio, -eps_low, eps_high)
  clipped = jnp.where(adv > 0, jnp.minimum(log_ratio, clamped), jnp.maximum(log_ratio, clamped))
  length_Bx1 = jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1.0)
  log_s_Bx1 = jnp.sum(clipped * m, axis=-1, keepdims=True) / length_Bx1
  log_s_Bx1 = jax.lax.stop_gradient(log_s_Bx1)
  clipped_const = jax.lax.stop_gradient(clipped)
  # Value s_i, gradient s_i · ∇c_t.
  ratio = jnp.exp(log_s_Bx1 + clipped - clipped_const)
  loss = -adv * ratio
  high = (adv > 0) & (log_ratio > eps_high)
  low = (adv < 0) & (log_ratio < -eps_low)
  metrics = {
    'clipfrac_high': _mean(high, m, axis_name),
    'clipfrac_low': _mean(low, m, axis_name),
    'clipfrac': _mean(high | low, m, axis_name),
    'seq_ratio_mean': reductions.seq_mean_token_mean(
      jax.lax.stop_gradient(ratio), m, axis_name=axis_name
    ),
    **_kl_metrics(log_ratio, m, axis_name),
  }
  return loss * m, metrics


__all__ = [
  'IS_LEVELS',
  'IS_MODES',
  'binary_kl',
  'binary_kl_mask',
  'cispo_loss',
  'dppo_loss',
  'gmpo_loss',
  'gspo_loss',
  'icepop_loss',
  'importance_sampling_loss',
  'importance_weights',
  'kpop_loss',
  'off_policy_sequence_mask',
  'ppo_clip_loss',
  'prob_diff_mask',
  'ratio_band_mask',
  'sapo_loss',
  'vespo_loss',
  'vespo_weights',
]
