"""Per-slot token sampling with traced parameters.

Every slot has its own temperature, top-k, top-p, greedy flag and RNG key,
all traced arrays, so one compiled decode step serves every setting (no
recompilation per request).

The log-probability returned for each drawn token is taken under the
distribution that was actually sampled from: softmax(logits / T) restricted
to the top-k / top-p set and renormalised. With top_k = 0 and top_p = 1 that
is log_softmax(logits / T), exactly what the trainer recomputes with
`jrl.models.next_token_logprobs(..., temperature=T)`. A greedy slot returns
log_softmax(logits) at the argmax (temperature 1, no truncation), so that
greedy rollouts are scored like the trainer scores them.

Truncation rules: top-k keeps every logit ≥ the k-th largest (ties at the
boundary are kept); top-p keeps the smallest prefix of tokens in descending
order whose probability mass reaches p (at least one token).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e30


class SamplingParams(NamedTuple):
  """Per-slot sampling settings, each [S] (or scalars before broadcasting)."""

  temperature: jnp.ndarray  # [S] float32 > 0; ignored when greedy
  top_k: jnp.ndarray  # [S] int32, 0 = off
  top_p: jnp.ndarray  # [S] float32 in (0, 1], 1 = off
  greedy: jnp.ndarray  # [S] bool


def _truncate(z_SxV, top_k_S, top_p_S):
  """Sets logits outside each row's top-k / top-p set to −1e30."""
  v = z_SxV.shape[-1]
  sorted_SxV = jnp.sort(z_SxV, axis=-1)[:, ::-1]
  # top-k: threshold at the k-th largest value.
  k_S = jnp.clip(top_k_S, 1, v)
  kth_S = jnp.take_along_axis(sorted_SxV, (k_S - 1)[:, None], axis=-1)[:, 0]
  kth_S = jnp.where(top_k_S > 0, kth_S, _NEG)
  # top-p over what top-k kept: keep token i if the mass strictly before it < p.
  sorted_SxV = jnp.where(sorted_SxV >= kth_S[:, None], sorted_SxV, _NEG)
  probs_SxV = jax.nn.softmax(sorted_SxV, axis=-1)
  before_SxV = jnp.cumsum(probs_SxV, axis=-1) - probs_SxV
  keep_SxV = before_SxV < top_p_S[:, None]
  keep_SxV = keep_SxV.at[:, 0].set(True)
  last_kept_S = jnp.sum(keep_SxV, axis=-1) - 1
  pth_S = jnp.take_along_axis(sorted_SxV, last_kept_S[:, None], axis=-1)[:, 0]
  pth_S = jnp.where(top_p_S < 1.0, pth_S, _NEG)
  threshold_S = jnp.maximum(kth_S, pth_S)
  return jnp.where(z_SxV >= threshold_S[:, None], z_SxV, _NEG)


def sample(logits_SxV, keys_S, params, truncate=None):
  """Draws one token per slot.

  Args:
    logits_SxV: float32 logits.
    keys_S: [S] typed PRNG keys (one per slot; each is used once).
    params: SamplingParams of [S] arrays.
    truncate: static. None: a `lax.cond` skips the top-k / top-p sort when no
      slot needs it; True: always apply it (rows with top_k 0 and top_p 1 are
      unchanged); False: never (the caller knows no slot asks for it). Under
      `vmap` a cond becomes a select that runs the sort anyway, so the
      batched sampler passes a static value.

  Returns:
    (tokens [S] int32, logprobs [S] float32 under the sampled distribution).
  """
  logits_SxV = logits_SxV.astype(jnp.float32)
  temperature_S = jnp.where(params.greedy, 1.0, jnp.maximum(params.temperature, 1e-6))
  z_SxV = logits_SxV / temperature_S[:, None]
  if truncate is None:
    needs_truncation = jnp.any(((params.top_k > 0) | (params.top_p < 1.0)) & ~params.greedy)
    z_SxV = jax.lax.cond(
      needs_truncation,
      lambda z: _truncate(z, params.top_k, params.top_p),
      lambda z: z,
      z_SxV,
    )
  elif truncate:
    z_SxV = _truncate(z_SxV, params.top_k, params.top_p)
  z_SxV = jnp.where(params.greedy[:, None], logits_SxV, z_SxV)
  drawn_S = jax.vmap(lambda k, z: jax.random.categorical(k, z))(keys_S, z_SxV)
  tokens_S = jnp.where(params.greedy, jnp.argmax(logits_SxV, axis=-1), drawn_S).astype(jnp.int32)
  # Log-probabilities in float32, under the distribution sampled from.
  logp_SxV = jax.nn.log_softmax(z_SxV, axis=-1)
  logp_S = jnp.take_along_axis(logp_SxV, tokens_S[:, None], axis=-1)[:, 0]
  return tokens_S, logp_S
