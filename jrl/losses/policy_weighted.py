"""Policy losses that reweight the policy gradient instead of clipping a
surrogate: CISPO (clipped, detached IS weight), SAPO (soft sigmoid gate) and
VESPO (reshaped sequence-level weights).

Same interface and metrics as the losses of `jrl.losses.policy` (see its
docstring): `[B, T]` inputs, `(loss [B, T], metrics)` out, the per-token
loss zero where the mask is 0; the log-ratio is computed in float32.
"""

import jax
import jax.numpy as jnp

from jrl.losses import reductions
from jrl.losses._checks import check_below_one, check_positive
from jrl.losses._policy_common import _check_inputs, _kl_metrics, _log_ratio, _max, _mean


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
    check_below_one(eps_low, 'eps_low')
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
