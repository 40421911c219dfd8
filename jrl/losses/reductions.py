"""Masked reductions: how a per-token loss becomes one scalar.

The same per-token loss gives different gradients depending on how it is
averaged, and the RL frameworks disagree on the default. Each mode is one
function here; `aggregate(x, mask, mode)` dispatches by name.

For a per-token loss `x[i, t]` and a 0/1 mask `m[i, t]` over B sequences:

| mode                      | value                                   |
|---------------------------|-----------------------------------------|
| `token-mean`              | Σ_it m x / Σ_it m                       |
| `token-sum`               | Σ_it m x                                |
| `seq-mean-token-mean`     | Σ_i (Σ_t m x / Σ_t m) / num_seqs        |
| `seq-mean-token-sum`      | Σ_i (Σ_t m x) / num_seqs                |
| `seq-mean-token-sum-norm` | Σ_it m x / (num_seqs · norm)            |

`num_seqs` defaults to B, the number of rows (over all devices with
`axis_name`): a fully masked row is a sequence with loss 0, as in veRL and
TRL. Pass the number of real sequences to leave padding rows out.

Conventions:
* `token-mean` is veRL's default (`loss_agg_mode="token-mean"`), TRL's
  `loss_type="dapo"` (global token count; the default) and `"bnpo"` (the
  local one: no `axis_name`), OpenRLHF's default and NeMo-RL's
  `token_level_loss=True`. DAPO (Yu et al., 2025) argues for it: long
  responses are not down-weighted.
* `seq-mean-token-mean` is the original GRPO objective (Shao et al., 2024),
  TRL's `loss_type="grpo"`, veRL's mode of that name, NeMo-RL's
  `token_level_loss=False`; GSPO uses it.
* `seq-mean-token-sum-norm` is Dr. GRPO (Liu et al., 2025): a constant
  normaliser `norm` (the generation budget) instead of each response's
  length. TRL's `loss_type="dr_grpo"` (norm = `max_completion_length`) and
  veRL's mode of that name (norm = `loss_scale_factor`, by default the
  padded response length) are both Σ / (B · norm). Early veRL releases
  divided by norm alone; pass `num_seqs=1` for that.
* Token denominators are at least 1: a fully masked batch gives 0 with
  finite (zero) gradients, never NaN.

Data parallelism: with `axis_name` set, every sum and count is `psum`-med over
that mapped axis (under `shard_map` or `pmap`), so each device returns the
loss of the *global* batch, equal to the single-device value on the whole
batch; `num_seqs` then defaults to the global row count. Without
`axis_name`, under `jax.jit` with sharded inputs, the reduction is global
already (GSPMD inserts the collectives).

Gradients: under `shard_map` (which checks replication) the gradient of a
reduction with `axis_name` is each device's share of the global gradient,
as it should be. Under `pmap`, JAX transposes `psum` to `psum`, so
`jax.grad` inside the pmapped function returns the global gradient times
the device count on every device: average such gradients over devices
(`pmean`), do not sum them.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jrl.losses._checks import as_f32, check_choice, check_rank, check_same_shape

AGGREGATION_MODES = (
  'token-mean',
  'token-sum',
  'seq-mean-token-mean',
  'seq-mean-token-sum',
  'seq-mean-token-sum-norm',
)


def _psum(x, axis_name):
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def _check(x, mask):
  check_rank(x, 2, 'x', '[B, T]')
  check_same_shape('x', x, mask=mask)
  return as_f32(x), as_f32(mask)


def _safe_div(num, den):
  """num / max(den, 1): den is a count, so 0 only when nothing is counted."""
  return num / jnp.maximum(den, 1.0)


def token_sum(x, mask, *, axis_name=None):
  """Σ_it mask·x.

  Args:
    x: [B, T] per-token values.
    mask: [B, T] 0/1 (bool or float) validity mask.
    axis_name: optional mapped axis to sum over devices.

  Returns:
    [] float32.
  """
  x, mask = _check(x, mask)
  return _psum(jnp.sum(x * mask), axis_name)


def token_mean(x, mask, *, axis_name=None):
  """Σ_it mask·x / Σ_it mask, the mean over every valid token of the batch.

  Args:
    x: [B, T] per-token values.
    mask: [B, T] 0/1 validity mask.
    axis_name: optional mapped axis; numerator and token count are both
      summed over it, giving the global token mean on every device.

  Returns:
    [] float32; 0 when no token is valid.
  """
  x, mask = _check(x, mask)
  num = _psum(jnp.sum(x * mask), axis_name)
  den = _psum(jnp.sum(mask), axis_name)
  return _safe_div(num, den)


def _num_seqs(x, num_seqs, axis_name):
  if num_seqs is None:
    return _psum(jnp.float32(x.shape[0]), axis_name)
  if not isinstance(num_seqs, jax.core.Tracer) and not np.all(np.asarray(num_seqs) > 0):
    raise ValueError(f'`num_seqs` must be > 0, got {num_seqs!r}.')
  return as_f32(num_seqs)


def _seq_mean(per_seq_B, num_seqs, axis_name):
  return _psum(jnp.sum(per_seq_B), axis_name) / _num_seqs(per_seq_B, num_seqs, axis_name)


def seq_mean_token_mean(x, mask, *, num_seqs=None, axis_name=None):
  """Mean over sequences of each sequence's token mean (original GRPO).

  Args:
    x: [B, T] per-token values.
    mask: [B, T] 0/1 validity mask.
    num_seqs: sequences to divide by (default: B over all devices).
    axis_name: optional mapped axis for the sequence mean.

  Returns:
    [] float32.
  """
  x, mask = _check(x, mask)
  per_seq_B = _safe_div(jnp.sum(x * mask, axis=-1), jnp.sum(mask, axis=-1))
  return _seq_mean(per_seq_B, num_seqs, axis_name)


def seq_mean_token_sum(x, mask, *, num_seqs=None, axis_name=None):
  """Mean over sequences of each sequence's token sum.

  Args:
    x: [B, T] per-token values.
    mask: [B, T] 0/1 validity mask.
    num_seqs: sequences to divide by (default: B over all devices).
    axis_name: optional mapped axis for the sequence mean.

  Returns:
    [] float32.
  """
  x, mask = _check(x, mask)
  per_seq_B = jnp.sum(x * mask, axis=-1)
  return _seq_mean(per_seq_B, num_seqs, axis_name)


def seq_mean_token_sum_norm(x, mask, *, norm, num_seqs=None, axis_name=None):
  """Σ_it mask·x / (num_seqs · norm): Dr. GRPO's constant normaliser.

  Args:
    x: [B, T] per-token values.
    mask: [B, T] 0/1 validity mask.
    norm: positive Python number, the constant token normaliser (usually the
      maximum response length, the generation budget).
    num_seqs: the number of rows to divide by; defaults to B (summed over
      `axis_name` when given).
    axis_name: optional mapped axis.

  Returns:
    [] float32.
  """
  x, mask = _check(x, mask)
  if not norm > 0:
    raise ValueError(f'`norm` must be > 0, got {norm!r}.')
  total = _psum(jnp.sum(x * mask), axis_name)
  return total / (_num_seqs(x, num_seqs, axis_name) * norm)


def aggregate(x, mask, mode, *, norm=None, num_seqs=None, axis_name=None):
  """Reduces a per-token loss with the named mode (see the module table).

  Args:
    x: [B, T] per-token values.
    mask: [B, T] 0/1 validity mask.
    mode: one of `AGGREGATION_MODES`.
    norm: required by 'seq-mean-token-sum-norm', refused by the others.
    num_seqs: for the 'seq-mean-*' modes; refused by the token modes.
    axis_name: optional mapped axis for cross-device sums.

  Returns:
    [] float32.
  """
  check_choice(mode, 'mode', AGGREGATION_MODES)
  if mode == 'seq-mean-token-sum-norm':
    if norm is None:
      raise ValueError("`norm` is required when `mode` is 'seq-mean-token-sum-norm'.")
    return seq_mean_token_sum_norm(x, mask, norm=norm, num_seqs=num_seqs, axis_name=axis_name)
  if norm is not None:
    raise ValueError(f"`norm` applies only to 'seq-mean-token-sum-norm', not {mode!r}.")
  if mode.startswith('seq-mean'):
    fn = seq_mean_token_mean if mode == 'seq-mean-token-mean' else seq_mean_token_sum
    return fn(x, mask, num_seqs=num_seqs, axis_name=axis_name)
  if num_seqs is not None:
    raise ValueError(f"`num_seqs` applies only to the 'seq-mean-*' modes, not {mode!r}.")
  fn = token_mean if mode == 'token-mean' else token_sum
  return fn(x, mask, axis_name=axis_name)
