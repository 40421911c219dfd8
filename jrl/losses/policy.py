"""Policy-gradient losses: PPO clip (clip-higher, dual-clip), GSPO, CISPO,
SAPO (soft gate), VESPO (reshaped sequence weights), the off-policy sequence
mask, and importance-sampling corrections for sampler/trainer mismatch.

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
from jrl.losses._checks import (
  as_f32,
  check_choice,
  check_positive,
  check_rank,
  check_same_shape,
)


def _check_inputs(logp, old_logp, advantages, mask):
  """Checks shapes, casts to float32 and zeroes every input at padding.

  Padding positions may hold anything (−inf, huge log-ratios); selecting 0
  there (not multiplying by the mask) keeps values, metrics and gradients
  finite whatever the padding holds.
  """
  check_rank(logp, 2, 'logp', '[B, T]')
  check_same_shape('logp', logp, old_logp=old_logp, advantages=advantages, mask=mask)
  m = as_f32(mask)
  valid = m > 0
  clean = lambda x: jnp.where(valid, as_f32(x), 0.0)
  return clean(logp), jax.lax.stop_gradient(clean(old_logp)), clean(advantages), m


def _log_ratio(logp, old_logp, log_ratio_clamp):
  log_ratio = logp - old_logp
  if log_ratio_clamp is not None:
    check_positive(log_ratio_clamp, 'log_ratio_clamp')
    # Keeps exp() finite when the policies drift far apart (veRL clamps at 20).
    log_ratio = jnp.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp)
  return log_ratio


def _mean(x, mask, axis_name):
  return reductions.token_mean(jax.lax.stop_gradient(as_f32(x)), mask, axis_name=axis_name)


def _kl_metrics(log_ratio, mask, axis_name):
  ratio = jnp.exp(log_ratio)
  return {
    'ppo_kl': _mean(-log_ratio, mask, axis_name),
    'approx_kl': _mean((ratio - 1.0) - log_ratio, mask, axis_name),
  }


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


def cispo_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  eps_low=None,
  eps_high=0.28,
  axis_name=None,
):
  """CISPO, clipped IS-weight policy optimisation (MiniMax-M1, 2025), per token.

    ℓ_t = −sg[clip(ρ_t, 1 − ε_low, 1 + ε_high)] · A_t · logp_t

  The importance weight is clipped and detached, and the gradient flows
  through logp for every token, including those PPO would clip away. The
  value of ℓ is not a surrogate of the return (it contains logp itself);
  only its gradient is meaningful. MiniMax-M1 leaves the lower bound off
  (`eps_low=None`) and tunes the upper one. veRL's CISPO takes both bounds
  as here; TRL's caps ρ at `epsilon_high` itself (an absolute cap, 5.0
  suggested), which is `eps_high = epsilon_high − 1` here.

  Args:
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    eps_low: > 0 or None (no lower bound).  eps_high: > 0.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T], metrics) with `clipfrac_high`/`clipfrac_low` counting
    tokens whose weight was clipped, whatever the sign of A.
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  check_positive(eps_high, 'eps_high')
  if eps_low is not None:
    check_positive(eps_low, 'eps_low')
  log_ratio = logp - old_logp
  ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
  lower = 0.0 if eps_low is None else 1.0 - eps_low
  weight = jnp.clip(ratio, lower, 1.0 + eps_high)
  weight = jax.lax.stop_gradient(weight)
  loss = -weight * adv * logp
  high = ratio > 1.0 + eps_high
  low = ratio < lower
  metrics = {
    'clipfrac_high': _mean(high, m, axis_name),
    'clipfrac_low': _mean(low, m, axis_name),
    'clipfrac': _mean(high | low, m, axis_name),
    **_kl_metrics(log_ratio, m, axis_name),
  }
  return loss * m, metrics


def sapo_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  tau_pos=1.0,
  tau_neg=1.05,
  log_ratio_clamp=20.0,
  axis_name=None,
):
  """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347), per token.

    ρ_t = exp(logp_t − old_logp_t)
    τ_t = τ_pos if A_t > 0 else τ_neg
    f(ρ) = (4 / τ) · σ(τ · (ρ − 1))              (σ the logistic sigmoid)
    ℓ_t = −f(ρ_t) · A_t

  The hard clip of PPO is replaced by a smooth gate: the gradient is
    ∇ℓ_t = −w(ρ_t) · ρ_t · A_t · ∇logp_t,   w(ρ) = 4 σ(τ(ρ − 1)) (1 − σ(τ(ρ − 1))),
  i.e. w(ρ) = sech²(τ(ρ − 1)/2): w(1) = 1 (on-policy tokens get exactly the
  policy gradient; the 4/τ makes this hold for every τ) and w decays
  smoothly as ρ leaves 1 in either direction; a larger τ narrows this soft
  trust region. PPO's weight is instead 1 inside [1 − ε, 1 + ε] (on the
  side the advantage pushes) and 0 outside.
  The paper sets τ_neg > τ_pos (1.05 / 1.0, TRL's defaults
  `sapo_temperature_neg` / `sapo_temperature_pos`) because negative
  advantages push up the logits of many unsampled tokens. A_t = 0 takes
  τ_neg (as TRL; its loss is 0 either way). The paper and TRL
  (`loss_type="sapo"`) average tokens within a sequence, then sequences:
  reduce with `seq_mean_token_mean` to match them. Unlike PPO's, the value
  at ρ = 1 is −(2/τ)·A, not −A; only the gradient matters.

  `log_ratio_clamp` (20 by default; None for none) clamps log ρ to [−c, c]
  before exp: σ is already 1 in float32 far below e^20 for any τ ≥ 1e−6 and
  e^−20 is 0 to within 2e−9, so the value is unchanged, and the gradient
  stays 0 instead of 0 · ∞ = NaN where ρ would overflow. TRL does not clamp.

  Args:
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    tau_pos, tau_neg: temperatures > 0.
    log_ratio_clamp: > 0 or None.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics) with `gate_weight_mean`
    (mean of w(ρ), 1 when on-policy) and the KL metrics.
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  check_positive(tau_pos, 'tau_pos')
  check_positive(tau_neg, 'tau_neg')
  log_ratio = _log_ratio(logp, old_logp, log_ratio_clamp)
  ratio = jnp.exp(log_ratio)
  tau = jnp.where(adv > 0, tau_pos, tau_neg)
  gate_in = tau * (ratio - 1.0)
  gate = _sigmoid(gate_in) * (4.0 / tau)
  loss = -gate * adv
  metrics = {
    'gate_weight_mean': _mean(
      4.0 * jax.nn.sigmoid(gate_in) * jax.nn.sigmoid(-gate_in), m, axis_name
    ),
    **_kl_metrics(log_ratio, m, axis_name),
  }
  return loss * m, metrics


@jax.custom_jvp
def _sigmoid(z):
  """σ(z), whose derivative is computed as σ(z)·σ(−z).

  The built-in derivative σ(1 − σ) loses the small factor to cancellation
  once σ rounds near 1 (z ≳ 10 in float32); σ(−z) keeps it exact.
  """
  return jax.nn.sigmoid(z)


@_sigmoid.defjvp
def _sigmoid_jvp(primals, tangents):
  (z,), (dz,) = primals, tangents
  return jax.nn.sigmoid(z), dz * jax.nn.sigmoid(z) * jax.nn.sigmoid(-z)


# TRL clamps the summed log-ratio to [log 1e−8, 20] and each token's to ±20.
_VESPO_LOG_W_MIN = -18.420680743952367  # log(1e−8)
_VESPO_LOG_W_MAX = 20.0


def vespo_weights(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  k_pos=2.0,
  lambda_pos=3.0,
  k_neg=3.0,
  lambda_neg=2.0,
  axis_name=None,
):
  """VESPO's reshaped sequence-level importance weights, as constants.

  VESPO (Shen et al. 2026, "Variational Sequence-Level Soft Policy
  Optimization", arXiv:2602.10693) reshapes the sequence importance weight
  W_i = π(y_i)/π_old(y_i) = exp(Σ_t m_t (logp_t − old_logp_t)) (the product
  over the sequence, not length-normalised) with a Gamma-shaped kernel:

    φ(W) = W^k · exp(λ · (1 − W)),   (k, λ) = (k_pos, λ_pos) if A ≥ 0
                                              (k_neg, λ_neg) if A < 0

  (c1 = k, c2 = λ in the paper's Sec. 3.4). φ(1) = 1, φ peaks at W = k/λ and
  goes to 0 as W → 0 (like W^k) and as W → ∞ (like e^(−λW)), so stale or
  mismatched sequences are down-weighted smoothly instead of clipped. The
  defaults are TRL's (`vespo_k_pos=2`, `vespo_lambda_pos=3`, `vespo_k_neg=3`,
  `vespo_lambda_neg=2`). The sign of A is taken per token, which for
  advantages broadcast over a sequence is the sequence's sign.

  Computed in log space, log φ = λ + k·log W − λ·W, with TRL's clamps: each
  token's log-ratio to [−20, 20] before the sum, log W to [log 1e−8, 20].
  Returned under stop-gradient: φ scales a gradient, see `vespo_loss`.

  Args:
    logp: [B, T] current-policy logprobs (not differentiated here).
    old_logp: [B, T] behaviour-policy logprobs.
    advantages: [B, T].
    mask: [B, T] 0/1.
    k_pos, k_neg: exponents ≥ 0.  lambda_pos, lambda_neg: decay rates > 0.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (weights [B, T] float32, φ of the token's sequence, zero where mask is 0;
    metrics with `vespo_weight_mean` (mean of φ over sequences) and
    `vespo_log_w_abs_max` (largest |log W| before clamping)).
  """
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  check_positive(k_pos, 'k_pos', allow_zero=True)
  check_positive(k_neg, 'k_neg', allow_zero=True)
  check_positive(lambda_pos, 'lambda_pos')
  check_positive(lambda_neg, 'lambda_neg')
  log_ratio = jax.lax.stop_gradient(logp - old_logp)
  log_ratio = jnp.clip(log_ratio, -_VESPO_LOG_W_MAX, _VESPO_LOG_W_MAX)
  raw_log_w_Bx1 = jnp.sum(log_ratio * m, axis=-1, keepdims=True)
  log_w_Bx1 = jnp.clip(raw_log_w_Bx1, _VESPO_LOG_W_MIN, _VESPO_LOG_W_MAX)
  nonneg = adv >= 0
  k = jnp.where(nonneg, k_pos, k_neg)
  lam = jnp.where(nonneg, lambda_pos, lambda_neg)
  log_phi = lam + k * log_w_Bx1 - lam * jnp.exp(log_w_Bx1)
  phi = jax.lax.stop_gradient(jnp.exp(log_phi) * m)
  metrics = {
    'vespo_weight_mean': reductions.seq_mean_token_mean(phi, m, axis_name=axis_name),
    'vespo_log_w_abs_max': _max(jnp.abs(raw_log_w_Bx1[:, 0]) * (jnp.sum(m, -1) > 0), axis_name),
  }
  return phi, metrics


def vespo_loss(
  logp,
  old_logp,
  advantages,
  mask,
  *,
  k_pos=2.0,
  lambda_pos=3.0,
  k_neg=3.0,
  lambda_neg=2.0,
  axis_name=None,
):
  """VESPO policy loss (Shen et al. 2026, arXiv:2602.10693), per token.

    ℓ_{i,t} = −sg[φ(W_i)] · A_{i,t} · logp_{i,t}       (φ, W_i: `vespo_weights`)

  Summed over a sequence the gradient is −φ(W_i) · A_i · ∇log π(y_i): the
  sequence-level importance-sampled policy gradient −W_i · A_i · ∇log π(y_i)
  with W replaced by its reshaped φ(W). As for CISPO, the value contains
  logp itself; only the gradient is meaningful. TRL (`loss_type="vespo"`)
  reduces it with a token mean over the batch (`token-mean`), and folds the
  sampler's token-level IS correction into W rather than multiplying the
  loss by it; here W is π/π_old only (multiply by `importance_weights`
  separately if needed).

  Args:
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    k_pos, lambda_pos, k_neg, lambda_neg: kernel parameters (`vespo_weights`).
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics): the
    `vespo_weights` metrics and the KL metrics.
  """
  phi, metrics = vespo_weights(
    logp,
    old_logp,
    advantages,
    mask,
    k_pos=k_pos,
    lambda_pos=lambda_pos,
    k_neg=k_neg,
    lambda_neg=lambda_neg,
    axis_name=axis_name,
  )
  logp, old_logp, adv, m = _check_inputs(logp, old_logp, advantages, mask)
  loss = -phi * adv * logp
  metrics.update(_kl_metrics(logp - old_logp, m, axis_name))
  return loss * m, metrics


def off_policy_sequence_mask(logp, sampler_logp, advantages, mask, *, threshold, axis_name=None):
  """Off-policy sequence mask (DeepSeek-AI 2025, "DeepSeek-V3.2", Eq. 9).

  Drops the sequences that have a negative advantage and that the current
  policy has moved away from by more than δ, measured as the mean
  log-ratio of the sampler to the current policy over the sequence:

    D_i  = (1/|y_i|) Σ_t m_t (sampler_logp_t − logp_t)
         = −log of the geometric mean of π/π_sampler over the sequence
    M_i  = 0  if A_i < 0 and D_i > δ,   else 1

  i.e. a negative-advantage sequence is dropped when the geometric mean of
  π/π_sampler falls below e^(−δ); the bound is one-sided (a sequence whose
  probability went up is kept). Learning from one's own negative samples
  that the policy no longer produces adds variance and no signal. This is
  TRL's `off_policy_mask_threshold` (δ, e.g. 0.5; off by default), which
  keeps a token where A ≥ 0 or D ≤ δ; TRL measures D against the sampler's
  logprobs when they are available and otherwise against old_logp, as the
  caller chooses here. The mask is a constant; multiply any per-token
  policy loss by it (before the reduction, so masked sequences still count
  in the token normaliser, as in TRL).

  Args:
    logp: [B, T] current-policy logprobs (not differentiated here).
    sampler_logp: [B, T] logprobs of the policy that sampled the tokens.
    advantages: [B] sequence advantages, or [B, T] token advantages (the
      sign is then taken per token, as TRL does when it broadcasts).
    mask: [B, T] 0/1 response mask.
    threshold: δ ≥ 0.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (keep, metrics): keep is [B] 0/1 float32 for [B] advantages, [B, T]
    (zero where mask is 0) for [B, T]; metrics has `opsm_dropped_frac`
    (sequences, or tokens, dropped) and `opsm_seq_kl_mean` (mean D_i).
  """
  check_rank(logp, 2, 'logp', '[B, T]')
  check_same_shape('logp', logp, sampler_logp=sampler_logp, mask=mask)
  per_token = jnp.ndim(advantages) == 2
  if per_token:
    check_same_shape('logp', logp, advantages=advantages)
  else:
    check_rank(advantages, 1, 'advantages', '[B] or [B, T]')
    if jnp.shape(advantages)[0] != jnp.shape(logp)[0]:
      raise ValueError(
        f'`advantages` must have shape [B={jnp.shape(logp)[0]}] or [B, T], '
        f'got {tuple(jnp.shape(advantages))}.'
      )
  check_positive(threshold, 'threshold', allow_zero=True)
  m = as_f32(mask)
  valid = m > 0
  diff = jnp.where(valid, as_f32(sampler_logp) - as_f32(logp), 0.0)
  diff = jax.lax.stop_gradient(diff)
  length_B = jnp.maximum(jnp.sum(m, axis=-1), 1.0)
  seq_kl_B = jnp.sum(diff, axis=-1) / length_B
  adv = jax.lax.stop_gradient(as_f32(advantages))
  has_tokens_B = (jnp.sum(m, axis=-1) > 0).astype(jnp.float32)
  if per_token:
    keep = ((adv >= 0) | (seq_kl_B[:, None] <= threshold)).astype(jnp.float32) * m
    dropped = reductions.token_mean(m - keep, m, axis_name=axis_name)
  else:
    keep = ((adv >= 0) | (seq_kl_B <= threshold)).astype(jnp.float32)
    dropped = _seq_mean(1.0 - keep, has_tokens_B, axis_name)
  metrics = {
    'opsm_dropped_frac': dropped,
    'opsm_seq_kl_mean': _seq_mean(seq_kl_B, has_tokens_B, axis_name),
  }
  return keep, metrics


def _seq_mean(x_B, weight_B, axis_name):
  """Σ w x / Σ w over sequences (over devices with `axis_name`); 0 if Σ w = 0."""
  total = jnp.sum(x_B * weight_B)
  count = jnp.sum(weight_B)
  if axis_name is not None:
    total = jax.lax.psum(total, axis_name)
    count = jax.lax.psum(count, axis_name)
  return total / jnp.maximum(count, 1.0)


IS_LEVELS = ('token', 'sequence', 'geometric')
IS_MODES = ('truncate', 'mask')


def importance_weights(
  old_logp,
  sampler_logp,
  mask,
  *,
  level='token',
  mode='truncate',
  high=2.0,
  low=None,
  axis_name=None,
):
  """Weights that correct for the sampler's distribution differing from the trainer's.

  When tokens are drawn by an inference engine whose logprobs differ from
  the trainer's (other kernels, other precision, a stale policy), the
  policy gradient is biased. With w = π_trainer / π_sampler (Yao et al.
  2025, "Your efficient RL framework secretly brings you off-policy RL"):

  * level='token': w_t = exp(old_logp_t − sampler_logp_t);
  * level='sequence': w_i = exp(Σ_t m_t (old_logp_t − sampler_logp_t)),
    the same for every token of the sequence;
  * level='geometric': the per-token geometric mean of the sequence ratio,
    w_i = exp(mean_t (old_logp_t − sampler_logp_t)).

  mode='truncate' (TIS) gives min(w, high); mode='mask' (MIS, IcePop) gives
  w where low ≤ w ≤ high and 0 elsewhere (the token or whole sequence is
  dropped). `low` defaults to 1/high for 'mask' and is not used by
  'truncate'. veRL's `rollout_is` (threshold 2.0) is level 'token' or
  'sequence' with mode 'truncate', or 'mask' with its low/high pair; TRL's
  `vllm_importance_sampling_mode` `{token,sequence}_{truncate,mask}` is
  level/mode with high = `vllm_importance_sampling_cap` (3.0) and, for
  'mask', low = 0.
  The weights are constants (stop-gradient): multiply the per-token policy
  loss by them. jrl's colocated sampler runs the trainer's model on the
  trainer's parameters, so w ≈ 1; this is for the other topologies and for
  outside engines.

  Args:
    old_logp: [B, T] trainer logprobs of the sampled tokens (before update).
    sampler_logp: [B, T] the sampler's logprobs of the same tokens.
    mask: [B, T] 0/1.
    level: 'token' | 'sequence' | 'geometric'.
    mode: 'truncate' | 'mask'.
    high: upper threshold > 0.  low: lower threshold (mode='mask' only).
    axis_name: optional mapped axis for the metrics.

  Returns:
    (weights [B, T] float32 zero where mask is 0, metrics) with
    `is_weight_mean` (before truncation/masking), `is_clipped_frac` (tokens
    whose weight was truncated or masked) and `is_log_ratio_abs_max`.
  """
  check_rank(old_logp, 2, 'old_logp', '[B, T]')
  check_same_shape('old_logp', old_logp, sampler_logp=sampler_logp, mask=mask)
  check_choice(level, 'level', IS_LEVELS)
  check_choice(mode, 'mode', IS_MODES)
  check_positive(high, 'high')
  if mode == 'truncate' and low is not None:
    raise ValueError("`low` applies only to mode='mask'.")
  if mode == 'mask':
    low = 1.0 / high if low is None else low
    check_positive(low, 'low', allow_zero=True)
    if low > high:
      raise ValueError(f'`low` ({low}) must be <= `high` ({high}).')
  m = as_f32(mask)
  log_w = jnp.where(m > 0, as_f32(old_logp) - as_f32(sampler_logp), 0.0)
  log_w = jax.lax.stop_gradient(log_w)
  if level == 'sequence':
    log_w = jnp.broadcast_to(jnp.sum(log_w, axis=-1, keepdims=True), log_w.shape)
  elif level == 'geometric':
    length_Bx1 = jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1.0)
    log_w = jnp.broadcast_to(jnp.sum(log_w, axis=-1, keepdims=True) / length_Bx1, log_w.shape)
  # Clamp in log space so exp() stays finite (veRL clamps at ±20 too).
  w = jnp.exp(jnp.clip(log_w, -20.0, 20.0))
  if mode == 'truncate':
    out = jnp.minimum(w, high)
    clipped = w > high
  else:
    keep = (w >= low) & (w <= high)
    out = jnp.where(keep, w, 0.0)
    clipped = ~keep
  metrics = {
    'is_weight_mean': _mean(w, m, axis_name),
    'is_clipped_frac': _mean(clipped, m, axis_name),
    'is_log_ratio_abs_max': _max(jnp.abs(log_w) * m, axis_name),
  }
  return out * m, metrics


def _max(x, axis_name):
  x = jnp.max(x)
  return x if axis_name is None else jax.lax.pmax(x, axis_name)
