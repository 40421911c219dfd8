"""Off-policy corrections: the off-policy sequence mask (DeepSeek-V3.2) and
importance weights for a sampler whose distribution differs from the
trainer's (TIS / MIS). Both return constants (stop-gradient) to multiply a
per-token policy loss by (`jrl.losses.policy`), and a dict of scalar metrics
(over devices when `axis_name` is given).
"""

import jax
import jax.numpy as jnp

from jrl.losses import reductions
from jrl.losses._checks import as_f32, check_choice, check_positive, check_rank, check_same_shape
from jrl.losses._policy_common import _max, _mean


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
