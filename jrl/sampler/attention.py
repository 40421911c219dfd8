"""Attention over a paged KV cache.

Layout, per layer: `k_pages`, `v_pages` of shape [K, N, P, d] (kv heads,
pages, tokens per page, head width) — the layout of JAX's Pallas TPU
paged-attention kernel. A slot's `page_table` row lists the pages holding
its tokens in order: token i of the slot lives in page `table[i // P]` at
offset `i % P`. Page 0 is a scratch page: unused table entries and the
writes of idle slots point there, and it is never read unmasked.

Two implementations:
* 'gather' (CPU, GPU, and the reference everywhere): gather the slot's pages
  as [K, S, M, P, d] and compute the same float32 softmax attention as the
  model's `dot_attention`, with a strict length mask. Values at masked positions are zeroed before
  the weighted sum, so garbage in any page a slot does not own (NaN, inf)
  cannot leak into its output.
* 'pallas' (TPU): `jax.experimental.pallas.ops.tpu.paged_attention`.

Sliding-window layers (Mistral, Gemma) gather only the pages that overlap
the slot's window: a slot at length n with window W reads the
ceil((W − 1) / P) + 1 pages from the one holding position n − W on, never
the pages before; these layers always take the gather path. The score
scale and soft-cap of `jrl.models.attention.attention_scores` apply on
both paths.
"""

import jax
import jax.numpy as jnp

from jrl.models.attention import NEG_INF, attention_scores

IMPLEMENTATIONS = ('auto', 'gather', 'pallas')


def resolve_impl(impl):
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'`attention_impl` must be one of {IMPLEMENTATIONS}, got {impl!r}.')
  if impl == 'auto':
    return 'pallas' if jax.default_backend() == 'tpu' else 'gather'
  return impl


def write_token(k_pages, v_pages, k_SxKxd, v_SxKxd, page_S, offset_S):
  """Writes one token's k, v per slot at (page, offset); returns the pools."""
  k_KxSxd = jnp.swapaxes(k_SxKxd, 0, 1).astype(k_pages.dtype)
  v_KxSxd = jnp.swapaxes(v_SxKxd, 0, 1).astype(v_pages.dtype)
  k_pages = k_pages.at[:, page_S, offset_S, :].set(k_KxSxd)
  v_pages = v_pages.at[:, page_S, offset_S, :].set(v_KxSxd)
  return k_pages, v_pages


def window_pages(window, page_size, max_pages):
  """Pages that can overlap a window of W consecutive positions (static)."""
  return min(max_pages, (window + page_size - 2) // page_size + 1)


def paged_attention_gather(
  q_SxHxd, k_pages, v_pages, page_table_SxM, lengths_S, *, scale=None, softcap=None, window=None
):
  """Each slot's query attends to its first `lengths` cached tokens (the last
  `window` of them when set).

  The slot's pages are gathered as [K, S, M, P, d] and contracted in that
  layout (no transposed copy); scores and softmax are float32 as in
  `jrl.models.attention.dot_attention`, which this equals (tested). With a
  window only the Mw = `window_pages` pages that overlap it are gathered.

  Args:
    q_SxHxd: one query per slot.
    k_pages, v_pages: [K, N, P, d].
    page_table_SxM: int32 page ids.
    lengths_S: int32 number of valid cached tokens per slot (≥ 1 for live slots).
    scale, softcap: as `jrl.models.attention.attention_scores`.
    window: sliding window W: keys at positions ≥ lengths − W only (None: all).

  Returns:
    [S, H, d].
  """
  s, h, d = q_SxHxd.shape
  k, _, p, _ = k_pages.shape
  m = page_table_SxM.shape[1]
  first_S = jnp.zeros(s, jnp.int32)
  if window is not None:
    mw = window_pages(window, p, m)
    first_S = jnp.clip(jnp.maximum(lengths_S - window, 0) // p, 0, m - mw).astype(jnp.int32)
    cols_SxMw = first_S[:, None] + jnp.arange(mw)[None, :]
    page_table_SxM = jnp.take_along_axis(page_table_SxM, cols_SxMw, axis=1)
    m = mw
  keys_KxSxMxPxd = k_pages[:, page_table_SxM]
  vals_KxSxMxPxd = v_pages[:, page_table_SxM]
  pos_SxMP = first_S[:, None] * p + jnp.arange(m * p)[None, :]
  visible_SxMP = pos_SxMP < lengths_S[:, None]
  if window is not None:
    visible_SxMP = visible_SxMP & (pos_SxMP >= lengths_S[:, None] - window)
  visible_SxMxP = visible_SxMP.reshape(s, m, p)
  # Zero what is not visible: masked probabilities are 0, but 0 · NaN is not.
  vals_KxSxMxPxd = jnp.where(visible_SxMxP[None, :, :, :, None], vals_KxSxMxPxd, 0)
  q_SxKxGxd = q_SxHxd.reshape(s, k, h // k, d)
  scores = jnp.einsum(
    'skgd,ksmpd->skgmp', q_SxKxGxd, keys_KxSxMxPxd, preferred_element_type=jnp.float32
  )
  scores = attention_scores(scores, d, scale, softcap)
  scores = jnp.where(visible_SxMxP[:, None, None], scores, NEG_INF)
  # Softmax in float32 over all of the slot's positions.
  probs = jax.nn.softmax(scores.reshape(s, k, h // k, m * p), axis=-1)
  probs = probs.reshape(s, k, h // k, m, p).astype(v_pages.dtype)
  out = jnp.einsum('skgmp,ksmpd->skgd', probs, vals_KxSxMxPxd)
  return out.reshape(s, h, d)


def paged_attention_pallas(
  q_SxHxd, k_pages, v_pages, page_table_SxM, lengths_S, *, scale=None, softcap=None
):
  """TPU Pallas kernel; same contract as `paged_attention_gather` (no window)."""
  try:
    from jax.experimental.pallas.ops.tpu import paged_attention as pallas_paged
  except ImportError as e:  # pragma: no cover - depends on the jax build
    raise RuntimeError(
      'attention_impl="pallas" needs jax.experimental.pallas.ops.tpu.paged_attention; '
      'use attention_impl="gather".'
    ) from e
  if scale is None:
    scale = q_SxHxd.shape[-1] ** -0.5
  pages_per_block = min(8, page_table_SxM.shape[1])
  while page_table_SxM.shape[1] % pages_per_block:
    pages_per_block -= 1
  out = pallas_paged.paged_attention(
    (q_SxHxd * scale).astype(k_pages.dtype),
    k_pages,
    v_pages,
    lengths_S,
    page_table_SxM,
    pages_per_compute_block=pages_per_block,
    attn_logits_soft_cap=softcap,
  )
  return out.astype(q_SxHxd.dtype)


def paged_attention(
  impl,
  q_SxHxd,
  k_pages,
  v_pages,
  page_table_SxM,
  lengths_S,
  *,
  scale=None,
  softcap=None,
  window=None,
):
  """Dispatch on `impl`; sliding-window layers always take the gather path."""
  if impl == 'pallas' and window is None:
    return paged_attention_pallas(
      q_SxHxd, k_pages, v_pages, page_table_SxM, lengths_S, scale=scale, softcap=softcap
    )
  return paged_attention_gather(
    q_SxHxd,
    k_pages,
    v_pages,
    page_table_SxM,
    lengths_S,
    scale=scale,
    softcap=softcap,
    window=window,
  )
