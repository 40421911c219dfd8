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

Drawing is by inverse CDF in two levels (`draw`): one uniform picks a block
of BLOCK tokens by the blocks' masses, a second picks the token inside it
by the block's cumulative masses. Its cost is one exp over [S, V] and two
short cumulative sums, against V Gumbel draws per row for
`jax.random.categorical` (64 rows x 49,152 tokens: 3 ms against 64 ms a
decode step on two CPU cores). The float32 partial sums are over at most
BLOCK terms, so a token's drawn probability is exact to float32 rounding
of its block's mass.

Truncation rules: top-k keeps every logit ≥ the k-th largest (ties at the
boundary are kept); top-p keeps the smallest prefix of tokens in descending
order whose probability mass reaches p (at least one token).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG = -1e30
BLOCK = 1024  # tokens per block of the two-level draw


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


def _last_positive(mass_SxN):
  """Index of each row's last entry > 0 (0 if none)."""
  n = mass_SxN.shape[-1]
  return n - 1 - jnp.argmax(mass_SxN[:, ::-1] > 0, axis=-1)


def _pick(mass_SxN, u_S):
  """The entry whose cumulative-mass interval holds u x the row's total,
  never one of zero mass (the rounding of u x total up to it included)."""
  c_SxN = jnp.cumsum(mass_SxN, axis=-1)
  at_S = jnp.sum(c_SxN <= (u_S * c_SxN[:, -1])[:, None], axis=-1)
  return jnp.minimum(at_S, _last_positive(mass_SxN))


def draw(z_SxV, keys_S):
  """One token per row from softmax(z) (rows of float32 scores, −1e30 or
  −inf for excluded tokens), by a two-level inverse CDF over blocks of
  BLOCK tokens; `keys_S` [S] typed PRNG keys, one uniform pair each."""
  s, v = z_SxV.shape
  nb = -(-v // BLOCK)
  z = jnp.pad(z_SxV, ((0, 0), (0, nb * BLOCK - v)), constant_values=-jnp.inf)
  p_SxNxB = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True)).reshape(s, nb, BLOCK)
  u_Sx2 = jax.vmap(lambda k: jax.random.uniform(k, (2,)))(keys_S)
  block_S = _pick(jnp.sum(p_SxNxB, axis=-1), u_Sx2[:, 0])
  inside_SxB = jnp.take_along_axis(p_SxNxB, block_S[:, None, None], axis=1)[:, 0]
  return (block_S * BLOCK + _pick(inside_SxB, u_Sx2[:, 1])).astype(jnp.int32)


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
  drawn_S = draw(z_SxV, keys_S)
  # The argmax over [S, V] only when some slot is greedy (a cond; under vmap
  # a select that computes it anyway).
  argmax_S = jax.lax.cond(
    jnp.any(params.greedy),
    lambda z: jnp.argmax(z, axis=-1).astype(jnp.int32),
    lambda z: jnp.zeros(z.shape[:1], jnp.int32),
    logits_SxV,
  )
  tokens_S = jnp.where(params.greedy, argmax_S, drawn_S).astype(jnp.int32)
  # Log-probabilities in float32, under the distribution sampled from.
  logp_SxV = jax.nn.log_softmax(z_SxV, axis=-1)
  logp_S = jnp.take_along_axis(logp_SxV, tokens_S[:, None], axis=-1)[:, 0]
  return tokens_S, logp_S
