"""Token log-probabilities and entropies from logits, in float32, in chunks.

For a vocabulary of 150k tokens, float32 logits for a [B, T] batch are
B·T·600 KB: 8 × 4096 tokens make 20 GB. These functions never hold that
tensor whole. They flatten the B·T positions, split them into chunks of
`chunk_size` rows, and compute each chunk's float32 log-softmax inside a
`jax.lax.map` whose body is rematerialised (`jax.checkpoint`), so that the
backward pass also works one chunk at a time. Peak float32 memory is
`chunk_size · V`.

Two entry points:
* `token_logprobs(logits, targets)`: the logits exist already (in the model's
  compute dtype, e.g. bfloat16); only the float32 upcast is chunked.
* `token_logprobs_from_hidden(hidden, unembed, targets)`: the final hidden
  states and the unembedding matrix; the [B, T, V] logits themselves are
  never materialised, in any dtype. The matmul reads the compute dtype and
  returns float32 (`jrl.precision.einsum_f32`). This is what a trainer
  should call.

With temperature τ the distribution is softmax(z / τ), the one a sampler at
temperature τ draws from. Matching the trainer's temperature to the
sampler's is what makes the sampler's logprobs and the trainer's equal
(veRL and TRL both divide the logits by the rollout temperature before the
log-softmax when computing old and new logprobs).

Entropy is H = logsumexp(z) − Σ_v softmax(z)_v z_v for z = logits / τ.
"""

import functools

import jax
import jax.numpy as jnp

from jrl import precision
from jrl.losses._checks import check_rank

_DEFAULT_CHUNK = 1024


def _check_temperature(temperature):
  if isinstance(temperature, int | float) and not temperature > 0:
    raise ValueError(f'`temperature` must be > 0, got {temperature!r}.')


def _check_chunk(chunk_size):
  bad = isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
  if chunk_size is not None and bad:
    raise ValueError(f'`chunk_size` must be a positive int or None, got {chunk_size!r}.')


def _stats_from_logits(logits_NxV, targets_N, temperature, with_entropy):
  """Float32 target logprob (and entropy) for N rows of logits."""
  # Softmax statistics are always computed in float32.
  z_NxV = logits_NxV.astype(jnp.float32) / temperature
  # Shift by the row max so that lse − Σ p·z does not cancel large numbers.
  z_max_Nx1 = jax.lax.stop_gradient(jnp.max(z_NxV, axis=-1, keepdims=True))
  z_NxV = z_NxV - z_max_Nx1
  lse_N = jax.nn.logsumexp(z_NxV, axis=-1)
  target_z_N = jnp.take_along_axis(z_NxV, targets_N[:, None], axis=-1)[:, 0]
  logp_N = target_z_N - lse_N
  if not with_entropy:
    return logp_N, jnp.zeros_like(logp_N)
  p_NxV = jnp.exp(z_NxV - lse_N[:, None])
  entropy_N = lse_N - jnp.sum(p_NxV * z_NxV, axis=-1)
  return logp_N, entropy_N


def _chunked(row_fn, row_inputs, num_rows, chunk_size):
  """Applies `row_fn` to `row_inputs` (each [N, ...]) chunk by chunk.

  Rows are padded up to a multiple of `chunk_size`; each chunk's body is
  rematerialised so the backward pass never holds more than one chunk of
  float32 intermediates.
  """
  if chunk_size is None or chunk_size >= num_rows:
    return row_fn(*row_inputs)
  num_chunks = -(-num_rows // chunk_size)
  pad = num_chunks * chunk_size - num_rows

  def split(x):
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((num_chunks, chunk_size, *x.shape[1:]))

  body = jax.checkpoint(lambda args: row_fn(*args))
  outs = jax.lax.map(body, tuple(split(x) for x in row_inputs))
  return tuple(o.reshape((num_chunks * chunk_size, *o.shape[2:]))[:num_rows] for o in outs)


def _check_targets(targets, name='targets'):
  check_rank(targets, 2, name, '[B, T]')
  if not jnp.issubdtype(jnp.asarray(targets).dtype, jnp.integer):
    raise ValueError(f'`{name}` must be an integer array, got dtype {jnp.asarray(targets).dtype}.')


def token_logprobs_and_entropy(
  logits, targets, *, temperature=1.0, chunk_size=_DEFAULT_CHUNK, with_entropy=True
):
  """Log-probability of each target token, and the entropy at each position.

  Args:
    logits: [B, T, V] any float dtype; position t scores `targets[:, t]`.
    targets: [B, T] int token ids.
    temperature: Python float or [] array > 0; logits are divided by it.
    chunk_size: rows of B·T handled at once in float32 (None: all at once).
    with_entropy: when False the entropy output is zeros and not computed.

  Returns:
    (logp [B, T] float32, entropy [B, T] float32).
  """
  check_rank(logits, 3, 'logits', '[B, T, V]')
  _check_targets(targets)
  _check_temperature(temperature)
  _check_chunk(chunk_size)
  b, t, v = logits.shape
  if targets.shape != (b, t):
    raise ValueError(f'`targets` must have shape {(b, t)} to match `logits`, got {targets.shape}.')
  row_fn = functools.partial(_stats_from_logits, temperature=temperature, with_entropy=with_entropy)
  logp_N, entropy_N = _chunked(
    row_fn, (logits.reshape(b * t, v), targets.reshape(b * t)), b * t, chunk_size
  )
  return logp_N.reshape(b, t), entropy_N.reshape(b, t)


def token_logprobs(logits, targets, *, temperature=1.0, chunk_size=_DEFAULT_CHUNK):
  """Log-probability of each target token.

  Args:
    logits: [B, T, V]; targets: [B, T] int; see `token_logprobs_and_entropy`.

  Returns:
    logp: [B, T] float32.
  """
  return token_logprobs_and_entropy(
    logits, targets, temperature=temperature, chunk_size=chunk_size, with_entropy=False
  )[0]


def token_entropy(logits, *, temperature=1.0, chunk_size=_DEFAULT_CHUNK):
  """Entropy of softmax(logits / temperature) at each position.

  Args:
    logits: [B, T, V] any float dtype.

  Returns:
    entropy: [B, T] float32.
  """
  check_rank(logits, 3, 'logits', '[B, T, V]')
  targets = jnp.zeros(logits.shape[:2], jnp.int32)
  return token_logprobs_and_entropy(
    logits, targets, temperature=temperature, chunk_size=chunk_size
  )[1]


def token_logprobs_from_hidden(
  hidden,
  unembed,
  targets,
  *,
  temperature=1.0,
  chunk_size=_DEFAULT_CHUNK,
  with_entropy=False,
  bias=None,
  softcap=None,
):
  """Target-token logprobs (and entropy) from final hidden states.

  Computes logits = hidden @ unembed (+ bias) one chunk of rows at a time, so
  the [B, T, V] logits never exist whole. The matmul reads the dtype of
  `hidden`/`unembed` (the compute dtype) and accumulates and returns float32
  logits, as the sampler's; the softmax is float32. With
  `softcap` c the logits become c·tanh(logits / c) in float32 first (Gemma 2's
  final logit soft-capping), before the temperature.

  Args:
    hidden: [B, T, D] final (normed) hidden states.
    unembed: [D, V] output projection (the transposed embedding when tied).
    targets: [B, T] int token ids.
    temperature: > 0; logits are divided by it.
    chunk_size: rows of B·T per chunk (None: all at once).
    with_entropy: also return the entropy (else zeros).
    bias: optional [V] output bias.
    softcap: optional Python float > 0: logit soft-cap.

  Returns:
    (logp [B, T] float32, entropy [B, T] float32).
  """
  check_rank(hidden, 3, 'hidden', '[B, T, D]')
  if softcap is not None and not softcap > 0:
    raise ValueError(f'`softcap` must be > 0 or None, got {softcap!r}.')
  check_rank(unembed, 2, 'unembed', '[D, V]')
  _check_targets(targets)
  _check_temperature(temperature)
  _check_chunk(chunk_size)
  b, t, d = hidden.shape
  if unembed.shape[0] != d:
    raise ValueError(
      f'`unembed` must have shape [D={d}, V] to match `hidden`, got {unembed.shape}.'
    )
  if targets.shape != (b, t):
    raise ValueError(f'`targets` must have shape {(b, t)} to match `hidden`, got {targets.shape}.')
  if bias is not None and bias.shape != (unembed.shape[1],):
    raise ValueError(f'`bias` must have shape [V={unembed.shape[1]}], got {bias.shape}.')

  def row_fn(hidden_NxD, targets_N):
    # float32 logits from compute-dtype operands (as the sampler's), never
    # rounded to bfloat16; compute-dtype matmuls backwards.
    logits_NxV = precision.einsum_f32('nd,dv->nv', hidden_NxD, unembed)
    if bias is not None:
      logits_NxV = logits_NxV + bias
    if softcap is not None:
      # Soft-capping in float32.
      cap = jnp.float32(softcap)
      logits_NxV = cap * jnp.tanh(logits_NxV.astype(jnp.float32) / cap)
    return _stats_from_logits(logits_NxV, targets_N, temperature, with_entropy)

  logp_N, entropy_N = _chunked(
    row_fn, (hidden.reshape(b * t, d), targets.reshape(b * t)), b * t, chunk_size
  )
  return logp_N.reshape(b, t), entropy_N.reshape(b, t)
