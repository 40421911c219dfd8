"""Importance-sampling policy losses whose trust region is a token mask, not a clip.

PPO keeps an update near the behaviour policy by clipping the ratio
ρ_t = π(y_t)/π_old(y_t). The losses here weight the policy gradient by the
unclipped ratio and instead drop the tokens that have moved too far, by a
test of (π_t, π_old,t) that depends on the method, optionally with a squared
log-ratio penalty on every response token (Kimi K2.5; prime-rl's `kl_tau`):

    keep_t = the method's band test of (π_t, π_old,t)     (0/1, a constant)
    ℓ_t    = −keep_t · ρ_t · A_t + τ · (log ρ_t)²
    ∇ℓ_t   = (−keep_t · ρ_t · A_t + 2τ · log ρ_t) · ∇logp_t

| loss     | keep_t (the mask function)                           | peers                          |
|----------|------------------------------------------------------|--------------------------------|
| `icepop` | low ≤ ρ_t ≤ high (`ratio_band_mask`)                 | IcePop (Ring-1T); AReaL        |
|          |                                                      | `rejection_sampling` 'ratio'   |
| `dppo`   | π_t − π_old,t ≤ δ_high if A_t > 0, else ≥ −δ_low     | DPPO-Binary-TV; prime-rl's     |
|          | (`prob_diff_mask`)                                   | default loss (τ = 1e−3)        |
| `kpop`   | max(D_B(π‖π_old), D_B(π_old‖π)) ≤ φ, D_B the binary  | KPop; AReaL `rejection_        |
|          | KL of the token's probability (`binary_kl_mask`)     | sampling` 'binary_kl'          |

A dropped token gets no policy gradient at all, in either direction; a
clipped PPO token still gets it on the side that moves its ratio back. The
masks are computed from the current logprobs, so they change as the policy
moves within an iteration (with one update per rollout and the colocated
sampler, ρ = 1 and nothing is dropped).

`importance_sampling_loss` is the same loss with nothing dropped: the
importance-sampled policy gradient −ρ_t A_t (tinker's `importance_sampling`
loss; REINFORCE on-policy). Nothing bounds it, so an asynchronous run refuses
it unless told otherwise (`rl.allow_unbounded_async`, `unbounded_reason` in
`jrl.losses.registry`).

Same interface as `jrl.losses.policy`: `[B, T]` inputs, `(loss [B, T],
metrics)` out, the per-token loss zero where the mask is 0, arithmetic in
float32. The metrics add `maskfrac` (response tokens dropped), and
`maskfrac_high` / `maskfrac_low` (dropped with ρ > 1 / ρ < 1).
"""

import math

import jax
import jax.numpy as jnp

from jrl.losses._checks import as_f32, check_positive, check_rank, check_same_shape
from jrl.losses._policy_common import _check_inputs, _kl_metrics, _log_ratio, _max, _mean

# Probabilities are kept in [ε, 1 − ε] for the binary KL, as AReaL's
# `compute_binary_kl_divergence` does.
_BINARY_KL_EPS = 1e-8


# Masks -----------------------------------------------------------------------


def _mask_inputs(logp, old_logp, mask, advantages=None):
  """Shapes checked; float32 (log π, log π_old) zeroed off the mask, as constants."""
  check_rank(logp, 2, 'logp', '[B, T]')
  check_same_shape('logp', logp, old_logp=old_logp, advantages=advantages, mask=mask)
  m = as_f32(mask)
  clean = lambda x: jax.lax.stop_gradient(jnp.where(m > 0, as_f32(x), 0.0))
  return clean(logp), clean(old_logp), m


def ratio_band_mask(logp, old_logp, mask, *, low=0.5, high=5.0):
  """IcePop's token mask: keep a token whose ratio lies in a band.

    ρ_t    = exp(logp_t − old_logp_t)
    keep_t = 1 if low ≤ ρ_t ≤ high else 0     (both bounds inclusive)

  IcePop (inclusionAI, Ring-1T, 2025) uses [0.5, 5] for the trainer /
  inference-engine ratio; AReaL's `rejection_sampling` with `level='token'`,
  `action='mask'`, `metric='ratio'` and (`lower`, `upper`) is this test (its
  `lower=None` is `low=0`). `importance_weights(mode='mask')` applies the
  same band to the behaviour correction; here it is the loss's trust region.

  Args:
    logp: [B, T] current-policy logprobs (not differentiated here).
    old_logp: [B, T] behaviour-policy logprobs.
    mask: [B, T] 0/1.
    low: ≥ 0.  high: > low (math.inf: no upper bound).

  Returns:
    keep [B, T] float32 0/1, zero where mask is 0 (a constant).
  """
  logp, old_logp, m = _mask_inputs(logp, old_logp, mask)
  check_positive(low, 'low', allow_zero=True)
  if not high > low:
    raise ValueError(f'`high` ({high!r}) must be > `low` ({low!r}).')
  log_ratio = logp - old_logp
  # Compared in log space: exp() of a large log-ratio would overflow.
  above = log_ratio > math.log(high) if math.isfinite(high) else jnp.zeros_like(m, bool)
  below = log_ratio < math.log(low) if low > 0 else jnp.zeros_like(m, bool)
  return jnp.where(above | below, 0.0, 1.0) * m


def prob_diff_mask(logp, old_logp, advantages, mask, *, delta_low=0.2, delta_high=0.2):
  """DPPO's binary total-variation mask, conditioned on the advantage's sign.

    d_t    = π_t − π_old,t                     (probabilities of the sampled token)
    keep_t = d_t ≤ δ_high    if A_t > 0          (drop tokens pushed up too far)
             d_t ≥ −δ_low    if A_t ≤ 0          (drop tokens pushed down too far)

  The token's probability moving by more than δ is a bound on the total
  variation between the two policies restricted to {y_t, not y_t} (DPPO,
  "Rethinking the trust region in LLM RL", arXiv:2602.04879, the binary-TV
  variant). prime-rl's default loss (`default_loss_fn`, `dppo_mask_low` /
  `dppo_mask_high`, 0.2 each) is this mask; A = 0 takes the A ≤ 0 test as
  there (its policy gradient is 0 either way). δ_high ≥ 1 drops no token
  with A > 0, since d ≤ 1 always.

  Args:
    logp, old_logp: [B, T] logprobs (not differentiated here).
    advantages: [B, T].
    mask: [B, T] 0/1.
    delta_low, delta_high: ≥ 0, in probability.

  Returns:
    keep [B, T] float32 0/1, zero where mask is 0 (a constant).
  """
  logp, old_logp, m = _mask_inputs(logp, old_logp, mask, advantages)
  check_positive(delta_low, 'delta_low', allow_zero=True)
  check_positive(delta_high, 'delta_high', allow_zero=True)
  adv = jax.lax.stop_gradient(as_f32(advantages))
  diff = jnp.exp(logp) - jnp.exp(old_logp)
  keep = jnp.where(adv > 0, diff <= delta_high, diff >= -delta_low)
  return keep.astype(jnp.float32) * m


def binary_kl(logp, logq):
  """D_B(p‖q) = p log(p/q) + (1 − p) log((1 − p)/(1 − q)): the KL divergence
  between the Bernoulli distributions (p, 1 − p) and (q, 1 − q), from log p
  and log q (any shape, float32).

  p and q are clamped to [1e−8, 1 − 1e−8] (AReaL's ε). The clamp and the
  complements are taken in log space (log(1 − p) = log(−expm1(log p))), so
  that a probability within 6e−8 of 1, which rounds to 1 in float32, keeps its
  exact complement: computed from the rounded p, (1 − p) log(1 − p) is
  0 · (−∞) = NaN, and a NaN fails every threshold test.
  """
  lo, hi = math.log(_BINARY_KL_EPS), math.log1p(-_BINARY_KL_EPS)
  lp = jnp.clip(as_f32(logp), lo, hi)
  lq = jnp.clip(as_f32(logq), lo, hi)
  log1m = lambda x: jnp.log(-jnp.expm1(x))
  return jnp.exp(lp) * (lp - lq) - jnp.expm1(lp) * (log1m(lp) - log1m(lq))


def binary_kl_mask(logp, old_logp, mask, *, threshold=0.1):
  """KPop's token mask: keep a token whose probability moved by at most φ in
  binary KL, both ways.

    keep_t = 1 if max(D_B(π_t‖π_old,t), D_B(π_old,t‖π_t)) ≤ φ else 0

  with D_B the binary KL of `binary_kl`: the vocabulary seen as the two
  events {y_t, not y_t}. Unlike a ratio band the allowed ratio depends on
  the probability: wide for a rare token, narrow for a confident one (KPop,
  Guo et al. 2026, Ant Group). AReaL's `rejection_sampling` with
  `metric='binary_kl'` and `upper=φ` is this test (its GSM8K example sets
  φ = 2.0); the default 0.1 is the paper's, as prime-rl's proposed KPop loss
  type (PR #3283) reports it.

  Args:
    logp, old_logp: [B, T] logprobs (not differentiated here).
    mask: [B, T] 0/1.
    threshold: φ > 0 (math.inf: keep every token).

  Returns:
    keep [B, T] float32 0/1, zero where mask is 0 (a constant).
  """
  logp, old_logp, m = _mask_inputs(logp, old_logp, mask)
  check_positive(threshold, 'threshold')
  divergence = jnp.maximum(binary_kl(logp, old_logp), binary_kl(old_logp, logp))
  return (divergence <= threshold).astype(jnp.float32) * m


# Losses ----------------------------------------------------------------------


def _masked_is_loss(logp, old_logp, adv, m, keep, kl_tau, axis_name):
  """ℓ = −keep · ρ · A + τ (log ρ)² and the metrics, from checked inputs."""
  check_positive(kl_tau, 'kl_tau', allow_zero=True)
  log_ratio = logp - old_logp
  kept = keep > 0
  # A dropped token's ratio is never formed (exp(0) in its place): its value
  # and gradient stay 0 and finite however far it moved.
  ratio = jnp.exp(jnp.where(kept, log_ratio, 0.0))
  loss = -keep * ratio * adv
  if kl_tau:
    loss = loss + kl_tau * jnp.square(log_ratio)
  dropped = (m > 0) & ~kept
  metrics = {
    'maskfrac': _mean(dropped, m, axis_name),
    'maskfrac_high': _mean(dropped & (log_ratio > 0), m, axis_name),
    'maskfrac_low': _mean(dropped & (log_ratio < 0), m, axis_name),
    'sq_log_ratio_mean': _mean(jnp.square(log_ratio), m, axis_name),
    **_kl_metrics(log_ratio, m, axis_name),
  }
  return loss * m, metrics


def importance_sampling_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  log_ratio_clamp=None,
  axis_name=None,
):
  """The importance-sampled policy gradient, unclipped and unmasked, per token.

    ρ_t = exp(logp_t − old_logp_t)
    ℓ_t = −ρ_t · A_t,      ∇ℓ_t = −ρ_t · A_t · ∇logp_t

  On-policy (ρ = 1) this is REINFORCE with the advantage as its return;
  off-policy it is unbiased, and nothing bounds ρ: a token the update has
  made much likelier than the behaviour policy made it weighs that much
  more. tinker's `importance_sampling` loss (its default); tinker-cookbook
  PR #822 measured that at staleness 3 this loss grew the sampler-trainer KL
  about 30x and collapsed the entropy, where `ppo` stayed stable, so
  asynchronous jrl runs refuse it unless `rl.allow_unbounded_async` is set.
  `log_ratio_clamp` only keeps exp() finite; it is not a trust region.

  Args:
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    log_ratio_clamp: > 0 or None.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics) with `ratio_max`
    (the largest ρ over the response tokens) and the KL metrics.
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  log_ratio = _log_ratio(logp, old_logp, log_ratio_clamp)
  ratio = jnp.exp(log_ratio)
  loss = -ratio * adv
  metrics = {
    'ratio_max': _max(jax.lax.stop_gradient(ratio) * m, axis_name),
    **_kl_metrics(log_ratio, m, axis_name),
  }
  return loss * m, metrics


def icepop_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  low=0.5,
  high=5.0,
  kl_tau=0.0,
  axis_name=None,
):
  """IcePop as a loss: the importance-sampled policy gradient on the tokens
  whose ratio lies in [low, high], per token.

    keep_t = `ratio_band_mask`(low, high)
    ℓ_t    = −keep_t · ρ_t · A_t + τ · (log ρ_t)²

  IcePop (Ring-1T, 2025) drops the tokens outside [0.5, 5] instead of
  truncating their weight (TIS). The Ring-1T paper and AReaL multiply a
  PPO-clipped surrogate by the band-masked trainer / engine weight (in jrl:
  `ppo` with `topology.is_mode='mask'`, `is_low=0.5`, `is_cap=5`); here the
  band is the trust region itself, as the probability mask is in prime-rl's
  default loss (`dppo_loss`), and τ = 0 by default (IcePop has no KL term).

  Args:
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    low: ≥ 0.  high: > low.  kl_tau: τ ≥ 0.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics): see the module.
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  keep = ratio_band_mask(logp, old_logp, m, low=low, high=high)
  return _masked_is_loss(logp, old_logp, adv, m, keep, kl_tau, axis_name)


def dppo_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  delta_low=0.2,
  delta_high=0.2,
  kl_tau=1e-3,
  axis_name=None,
):
  """DPPO-Binary-TV with a squared log-ratio penalty: prime-rl's default loss, per token.

    keep_t = `prob_diff_mask`(δ_low, δ_high)   (sign-conditioned probability change)
    ℓ_t    = −keep_t · ρ_t · A_t + τ · (log ρ_t)²

  prime-rl (`prime_rl/trainer/rl/loss.py`, `default_loss_fn`, v0.8) with its
  `DefaultLossConfig` defaults: δ_low = δ_high = 0.2, τ = `kl_tau` = 1e−3
  (Kimi K2.5's penalty, paid on every response token, dropped or not), and
  old_logp the inference engine's. prime-rl sums the per-token loss and
  divides by the global token count: `token-mean`. Its `adv_tau` scales A
  (a learning-rate factor; scale the advantages for it).

  Args:
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    delta_low, delta_high: ≥ 0 (δ_high ≥ 1: no token with A > 0 is dropped).
    kl_tau: τ ≥ 0.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics): see the module.
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  keep = prob_diff_mask(logp, old_logp, adv, m, delta_low=delta_low, delta_high=delta_high)
  return _masked_is_loss(logp, old_logp, adv, m, keep, kl_tau, axis_name)


def kpop_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  threshold=0.1,
  kl_tau=0.0,
  axis_name=None,
):
  """KPop as a loss: the importance-sampled policy gradient on the tokens
  whose probability moved by at most φ in binary KL, both ways, per token.

    keep_t = `binary_kl_mask`(φ)
    ℓ_t    = −keep_t · ρ_t · A_t + τ · (log ρ_t)²

  AReaL applies the KPop mask to the behaviour correction of decoupled PPO
  (`rejection_sampling.metric='binary_kl'`); prime-rl's proposed KPop loss
  type (PR #3283) puts it in this loss, with its `kl_tau`.

  Args:
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    threshold: φ > 0.  kl_tau: τ ≥ 0.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics): see the module.
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  keep = binary_kl_mask(logp, old_logp, m, threshold=threshold)
  return _masked_is_loss(logp, old_logp, adv, m, keep, kl_tau, axis_name)
