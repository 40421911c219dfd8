"""Recomputing the cached keys and values of sequences in flight with new
weights (partial rollouts, `Sampler.generate(weights_at=..., kv_on_swap=
'recompute')`).

When the policy's weights change between decode dispatches, the pages of a
sample in flight still hold keys and values computed by the old weights.
Kept ('keep'), the next tokens are sampled by the new weights attending to
the old cache: cheap, but the distribution sampled from is neither
version's. Recomputed ('recompute'), every active slot's sequence so far
(prompt and generated tokens) is prefilled again with the new weights and
written over its pages, so each token is sampled from exactly the version
it is recorded with, at the cost of one prefill of every sequence in flight.
"""

import jax.numpy as jnp

from jrl.sampler.prefill import prefill_batch


def refresh_kv(graphdef, params, state, tokens_SxT, cfg):
  """Rewrites the cached keys and values of every active slot with `params`.

  Args:
    graphdef, params: the new weights.
    state: DecodeState of one replica (S slots).
    tokens_SxT: int32, each slot's sequence so far, the prompt then its
      generated tokens, padded on the right; its first `state.lengths[s]`
      tokens are the ones in the cache (the last sampled token is not yet).
    cfg: SamplerConfig (static).

  Returns:
    The DecodeState with the pages rewritten; nothing else changes. Shared
    prompt pages are written by every slot that holds them, with the same
    values; positions of inactive slots go to the scratch page 0.
  """
  s, t = tokens_SxT.shape
  p, m = cfg.page_size, cfg.max_pages_per_slot
  lengths_S = jnp.clip(state.lengths, 1, t)
  prefix = prefill_batch(graphdef, params, tokens_SxT, lengths_S)  # k, v: [S, L, K, T, d]
  pos_T = jnp.arange(t)
  valid_SxT = (pos_T[None, :] < state.lengths[:, None]) & state.active[:, None]
  page_SxT = jnp.where(valid_SxT, state.page_table[:, jnp.clip(pos_T // p, 0, m - 1)], 0)
  pages_flat = page_SxT.reshape(-1)
  offsets_flat = jnp.tile(pos_T % p, s)
  k_pages, v_pages = [], []
  for layer in range(len(state.k_pages)):
    # [S, K, T, d] -> [K, S·T, d], the order of (pages_flat, offsets_flat).
    k_new = jnp.swapaxes(prefix.k[:, layer], 0, 1).reshape(prefix.k.shape[2], s * t, -1)
    v_new = jnp.swapaxes(prefix.v[:, layer], 0, 1).reshape(prefix.v.shape[2], s * t, -1)
    k_pages.append(
      state.k_pages[layer]
      .at[:, pages_flat, offsets_flat, :]
      .set(k_new.astype(state.k_pages[layer].dtype))
    )
    v_pages.append(
      state.v_pages[layer]
      .at[:, pages_flat, offsets_flat, :]
      .set(v_new.astype(state.v_pages[layer].dtype))
    )
  return state._replace(k_pages=tuple(k_pages), v_pages=tuple(v_pages))
