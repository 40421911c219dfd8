"""Prompt prefill: keys, values and last logits of B prompts in one call.

`prefill_batch` runs B prompts padded to one bucket length Pb in one call;
with `chunk` C < Pb it runs them C tokens at a time, each chunk attending to
the keys and values of the chunks before it (kept in a [B, Pb] buffer), so
activations are bounded by C tokens. Both give the keys, values and logits
of one-at-a-time prefill (tested to 1e-5).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jrl.models.attention import attention_options, dot_attention, within_window
from jrl.sampler.controls import model_logits
from jrl.sampler.state import Prefix


def prefill_batch(graphdef, params, tokens_BxPb, lengths_B, chunk=None, num_chunks=None):
  """Runs B prompts (each padded on the right to one bucket length Pb) through
  the model, `chunk` tokens at a time.

  Chunk c covers positions [c·C, (c + 1)·C): its keys and values are written
  into a [B, Pb] buffer per layer, and its queries attend to the buffer with
  key ≤ query and key < length (or key = query, so a padding query is never
  empty), which is the mask of a one-pass prefill. Masked keys weigh exactly
  0, so chunking changes only the summation order.

  Args:
    graphdef, params: the policy, as the trainer holds it.
    tokens_BxPb: int32 prompts, padded on the right.
    lengths_B: int32 true lengths, 1 ≤ length ≤ Pb.
    chunk: static tokens per chunk C (None or ≥ Pb: one pass); Pb % C == 0.
    num_chunks: [] int32, traced: run only the first chunks (default all
      Pb / C). Every prompt must end inside them. One compiled program then
      serves every prompt length, at a cost that follows the longest.

  Returns:
    Prefix with a leading [B] axis: k, v [B, L, K, Pb, d], logits [B, V]
    float32 at each prompt's last token, length [B].
  """
  model = nnx.merge(graphdef, params)
  mc = model.config
  b, pb = tokens_BxPb.shape
  c = pb if not chunk or chunk >= pb else int(chunk)
  if pb % c:
    raise ValueError(f'prefill bucket {pb} is not a multiple of the chunk {c}.')
  lengths_B = jnp.asarray(lengths_B, jnp.int32)
  key_pos_Pb = jnp.arange(pb, dtype=jnp.int32)
  key_valid_BxPb = key_pos_Pb[None, :] < lengths_B[:, None]
  dtype = mc.compute_jnp_dtype
  buf = lambda: jnp.zeros((b, pb, mc.num_kv_heads, mc.head_dim), dtype)

  def run_chunk(start, caches, last_BxD):
    tokens_BxC = jax.lax.dynamic_slice_in_dim(tokens_BxPb, start, c, axis=1)
    pos_C = start + jnp.arange(c, dtype=jnp.int32)
    positions_BxC = jnp.broadcast_to(pos_C[None], (b, c))
    causal_CxPb = key_pos_Pb[None, :] <= pos_C[:, None]
    self_CxPb = key_pos_Pb[None, :] == pos_C[:, None]
    allowed_BxCxPb = causal_CxPb[None] & (key_valid_BxPb[:, None, :] | self_CxPb[None])

    def attend(layer, q, k, v, cache):
      k_buf, v_buf = cache
      k_buf = jax.lax.dynamic_update_slice_in_dim(k_buf, k.astype(dtype), start, axis=1)
      v_buf = jax.lax.dynamic_update_slice_in_dim(v_buf, v.astype(dtype), start, axis=1)
      opts = attention_options(mc, layer)
      mask = allowed_BxCxPb
      if opts.window is not None:
        inside = within_window(pos_C[:, None], key_pos_Pb[None, :], opts.window)
        mask = mask & (inside | self_CxPb)[None]
      out = dot_attention(q, k_buf, v_buf, mask, scale=opts.scale, softcap=opts.softcap)
      return out, (k_buf, v_buf)

    hidden_BxCxD, caches = model(tokens_BxC, positions_BxC, attend, caches=caches)
    at_B = lengths_B - 1 - start
    inside_B = (at_B >= 0) & (at_B < c)
    h_BxD = jnp.take_along_axis(hidden_BxCxD, jnp.clip(at_B, 0, c - 1)[:, None, None], axis=1)
    return caches, jnp.where(inside_B[:, None], h_BxD[:, 0], last_BxD)

  caches = [(buf(), buf()) for _ in range(mc.num_layers)]
  last_BxD = jnp.zeros((b, mc.width), dtype)
  if c == pb:
    caches, last_BxD = run_chunk(0, caches, last_BxD)
  else:
    n = pb // c if num_chunks is None else num_chunks
    caches, last_BxD = jax.lax.fori_loop(
      0, n, lambda i, carry: run_chunk(i * c, *carry), (caches, last_BxD)
    )
  k = jnp.stack([jnp.swapaxes(kk, 1, 2) for kk, _ in caches], axis=1)  # [B, L, K, Pb, d]
  v = jnp.stack([jnp.swapaxes(vv, 1, 2) for _, vv in caches], axis=1)
  return Prefix(k=k, v=v, logits=model_logits(model, last_BxD), length=lengths_B)


def prefill(graphdef, params, tokens_Pb, length, chunk=None):
  """Runs one prompt (padded to a bucket length Pb) through the model.

  Args:
    graphdef, params: the policy, as the trainer holds it.
    tokens_Pb: [Pb] int32 prompt, padded on the right.
    length: [] int32 true prompt length, 1 ≤ length ≤ Pb.
    chunk: as `prefill_batch`.

  Returns:
    Prefix with the keys/values of every layer and the last logits.
  """
  lengths_B = jnp.reshape(jnp.asarray(length, jnp.int32), (1,))
  batch = prefill_batch(graphdef, params, tokens_Pb[None], lengths_B, chunk)
  return jax.tree.map(lambda x: x[0], batch)


def default_buckets(max_prompt_len, smallest=16):
  """Powers of two from `smallest` up to and including `max_prompt_len`."""
  buckets, b = [], smallest
  while b < max_prompt_len:
    buckets.append(b)
    b *= 2
  buckets.append(max_prompt_len)
  return tuple(buckets)
