"""Per-sample controls on the device, all traced (one compiled step serves
every setting).

A sparse logit bias per slot (banned tokens are a bias of −1e30), a minimum
number of new tokens before which the slot's stop tokens are forbidden (their
logits −1e30) and its stop sequences are not honoured, and up to Q stop
sequences of up to Ls tokens matched against the last Ls tokens of the slot
(right-aligned, −1 padded). Logprobs are taken under the distribution sampled
from, so with a bias they are those of the biased logits.
"""

import jax
import jax.numpy as jnp

from jrl.sampler.sampling import _NEG


def model_logits(model, hidden_NxD):
  # Logits in float32 (soft-capped as the trainer's when the model says so).
  return model.logits(hidden_NxD)


def split_keys(rng_Sx2):
  """One fresh subkey per slot and the advanced key data."""
  keys = jax.random.wrap_key_data(rng_Sx2)
  pairs = jax.vmap(lambda k: jax.random.split(k))(keys)
  return jax.random.key_data(pairs[:, 0]), pairs[:, 1]


def is_stop(tokens_S, stop_SxK):
  """[S] bool: the slot's token is one of its stop tokens (−1 padded)."""
  return jnp.any(tokens_S[:, None] == stop_SxK, axis=-1)


def controlled_logits(logits_SxV, bias_ids_SxKb, bias_values_SxKb, stop_SxK, before_min_S):
  """The logits a slot samples from: its sparse bias added (−1e30 bans a
  token; −1 ids are ignored), and its stop tokens set to −1e30 while
  `before_min_S` (fewer than `min_new` tokens so far)."""
  s, v = logits_SxV.shape
  rows_Sx1 = jnp.arange(s)[:, None]
  ids = jnp.where(bias_ids_SxKb >= 0, bias_ids_SxKb, v)  # out of range: dropped
  logits_SxV = logits_SxV.at[rows_Sx1, ids].add(bias_values_SxKb, mode='drop')
  stop_ids = jnp.where((stop_SxK >= 0) & before_min_S[:, None], stop_SxK, v)
  return logits_SxV.at[rows_Sx1, stop_ids].set(_NEG, mode='drop')


def push_recent(recent_SxLs, tokens_S):
  """[S, Ls] the slots' last Ls tokens once `tokens_S` is appended."""
  return jnp.concatenate([recent_SxLs[:, 1:], tokens_S[:, None]], axis=1)


def stop_sequence_hit(recent_SxLs, seqs_SxQxLs):
  """Whether each slot's last tokens end with one of its stop sequences
  (right-aligned, −1 entries match anything, an all −1 row matches nothing)."""
  real = seqs_SxQxLs >= 0
  same = ~real | (recent_SxLs[:, None, :] == seqs_SxQxLs)
  return jnp.any(jnp.all(same, axis=-1) & jnp.any(real, axis=-1), axis=-1)
