"""Critic and entropy terms.

value_loss: the PPO clipped value loss (Schulman et al. 2017; the form used
by OpenAI baselines, veRL `compute_value_loss`, OpenRLHF `ValueLoss`, TRL
PPO):

  V_clip = V_old + clip(V − V_old, −ε_v, ε_v)
  ℓ_t = ½ · max((V − R)², (V_clip − R)²)

`clip_eps=None` gives the plain ½(V − R)². The default ε_v = 0.5 is veRL's
`cliprange_value` and OpenRLHF's `value_clip`; TRL's PPO uses 0.2. The
reduction (token-mean in all three) is the caller's, as for policy losses.

entropy_loss: −H per token; add `coef · aggregate(entropy_loss(H), mask)` to
maximise entropy (veRL `entropy_coeff`, OpenRLHF `entropy_loss_coef`; 0 by
default in veRL, TRL and OpenRLHF).
"""

import jax
import jax.numpy as jnp

from jrl.losses import reductions
from jrl.losses._checks import as_f32, check_positive, check_rank, check_same_shape


def value_loss(values, old_values, returns, mask, *, clip_eps=0.5, axis_name=None):
  """Clipped value loss per token.

  Args:
    values: [B, T] current critic values (differentiated).
    old_values: [B, T] critic values at rollout time (constants).
    returns: [B, T] targets, e.g. from `jrl.losses.gae` (constants).
    mask: [B, T] 0/1.
    clip_eps: ε_v > 0, or None for no clipping.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics) with `vf_clipfrac`
    (tokens where |V − V_old| > ε_v and the clipped term was the larger,
    i.e. where the clip set the loss) and `vpred_mean`.
  """
  check_rank(values, 2, 'values', '[B, T]')
  check_same_shape('values', values, old_values=old_values, returns=returns, mask=mask)
  m = as_f32(mask)
  clean = lambda x: jnp.where(m > 0, as_f32(x), 0.0)  # padding may hold anything
  v = clean(values)
  old_v = jax.lax.stop_gradient(clean(old_values))
  ret = jax.lax.stop_gradient(clean(returns))
  unclipped = (v - ret) ** 2
  if clip_eps is None:
    loss = 0.5 * unclipped
    clipped_more = jnp.zeros_like(loss)
  else:
    check_positive(clip_eps, 'clip_eps')
    delta = v - old_v
    v_clip = old_v + jnp.clip(delta, -clip_eps, clip_eps)
    clipped = (v_clip - ret) ** 2
    loss = 0.5 * jnp.maximum(unclipped, clipped)
    # Inside the range V_clip is V up to rounding (V_old + (V − V_old) need
    # not be V in float32), so `clipped > unclipped` alone counts tokens that
    # no clip touched; count only where the clip is active.
    outside = jnp.abs(delta) > clip_eps
    clipped_more = (outside & (clipped > unclipped)).astype(jnp.float32)
  stop = jax.lax.stop_gradient
  metrics = {
    'vf_clipfrac': reductions.token_mean(clipped_more, m, axis_name=axis_name),
    'vpred_mean': reductions.token_mean(stop(v), m, axis_name=axis_name),
  }
  return loss * m, metrics


def entropy_loss(entropy, mask):
  """−H per token, to be reduced and scaled by an entropy coefficient.

  Args:
    entropy: [B, T] token entropies (see `jrl.losses.token_entropy`).
    mask: [B, T] 0/1.

  Returns:
    [B, T] float32, zero where mask is 0.
  """
  check_rank(entropy, 2, 'entropy', '[B, T]')
  check_same_shape('entropy', entropy, mask=mask)
  return -as_f32(entropy) * as_f32(mask)
