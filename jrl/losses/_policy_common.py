"""Helpers shared by the policy losses (`policy.py`, `policy_weighted.py`,
`off_policy.py`): input checks, the clamped log-ratio and the metrics."""

import jax
import jax.numpy as jnp

from jrl.losses import reductions
from jrl.losses._checks import as_f32, check_positive, check_rank, check_same_shape


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


def _max(x, axis_name):
  x = jnp.max(x)
  return x if axis_name is None else jax.lax.pmax(x, axis_name)
