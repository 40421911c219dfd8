"""Attention over a paged KV cache.

Layout, per layer: `k_pages`, `v_pages` of shape [K, N, P, d] (kv heads,
pages, tokens per page, head width) — the layout of JAX's Pallas TPU
paged-attention kernel. A slot's `page_table` row lists the pages holding
its tokens in order: token i of the slot lives in page `table[i // P]` at
offset `i % P`. Page 0 is a scratch page: unused table entries and the
writes of idle slots point there, and it is never read unmasked.

Four implementations (`resolve_impl` picks one by backend for 'auto'):
* 'gather' (the reference everywhere; the CPU's where the C++ kernel does
  not build): gather the slot's pages as [K, S, M, P, d] and compute the
  same float32 softmax attention as the model's `dot_attention`, with a
  strict length mask. Values at masked positions are zeroed before the
  weighted sum, so garbage in any page a slot does not own (NaN, inf)
  cannot leak into its output.
* 'cpu' (CPU): jrl's C++ kernel through XLA's FFI (`jrl.sampler.cpu_kernel`,
  built on first use), which reads each slot's pages where they lie instead
  of gathering a copy, and never reads a position a slot cannot see; float32
  queries and pages, no window ('auto' takes it where it builds).
* 'pallas_gpu' (GPU): jrl's Pallas kernel (`jrl.sampler.kernels`), one
  program per slot and head walking the slot's pages with an online softmax;
  pages and head widths must be powers of two, else 'auto' takes the gather
  path. Off a GPU it runs in Pallas interpret mode (tests).
* 'pallas_tpu' (TPU): `jax.experimental.pallas.ops.tpu.paged_attention`,
  which computes with keys and values in bfloat16 ('auto' takes it for a
  bfloat16 cache only) and does not zero masked values (the sampler never
  writes non-finite keys or values, so this is safe in the sampler).

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
from jrl.sampler import cpu_kernel, kernels

IMPLEMENTATIONS = ('auto', 'gather', 'cpu', 'pallas_gpu', 'pallas_tpu')


def resolve_impl(
  impl, page_size=None, head_dim=None, backend=None, kv_dtype=None, q_dtype=jnp.float32
):
  """The implementation `impl` names for pages of `page_size` tokens and
  heads of `head_dim` on `backend` (default: JAX's): 'auto' is 'pallas_tpu'
  on a TPU for a bfloat16 cache (the kernel reads keys and values as
  bfloat16, so a float32 cache keeps the exact gather path), 'pallas_gpu'
  on a GPU where the sizes suit it, 'cpu' on the CPU for float32 queries
  and pages where jrl's C++ kernel builds (`jrl.sampler.cpu_kernel`), else
  'gather'."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f'`attention_impl` must be one of {IMPLEMENTATIONS}, got {impl!r}.')
  fits_gpu = kernels.gpu_supported(page_size or 1, head_dim or 1)  # unknown sizes: no check
  if impl == 'pallas_gpu' and not fits_gpu:
    raise ValueError(
      f"`attention_impl`='pallas_gpu' needs a power-of-two `page_size` and head width, "
      f'got {page_size} and {head_dim}.'
    )
  if impl == 'cpu' and kv_dtype is not None and not cpu_kernel.supports(q_dtype, kv_dtype):
    raise ValueError(
      f"`attention_impl`='cpu' needs float32 queries and pages, got {jnp.dtype(q_dtype)} "
      f'and {jnp.dtype(kv_dtype)}.'
    )
  if impl == 'auto':
    backend = backend or jax.default_backend()
    if backend == 'tpu':
      bf16 = kv_dtype is None or jnp.dtype(kv_dtype) == jnp.bfloat16
      return 'pallas_tpu' if bf16 else 'gather'
    if backend == 'cpu' and cpu_kernel.supports(q_dtype, kv_dtype) and cpu_kernel.available():
      return 'cpu'
    return 'pallas_gpu' if backend == 'gpu' and fits_gpu else 'gather'
  return impl


def needs_page_bound(engine_config, model_config):
  """Whether decode dispatches bound the page table's width by the pages in
  use (`jrl.sampler.pages.attend_pages`, one program per bound). The gather
  path copies every column of the table, so the bound saves work; the C++
  kernel reads each slot's pages up to its length only, so with it one
  width (every page) serves every dispatch and nothing recompiles as
  sequences grow."""
  impl = resolve_impl(
    engine_config.attention_impl,
    engine_config.page_size,
    model_config.head_dim,
    kv_dtype=model_config.compute_jnp_dtype,
    q_dtype=model_config.compute_dtype,
  )
  return impl != 'cpu'


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
  kernel = {
    'cpu': cpu_kernel.paged_attention_cpu,
    'pallas_gpu': kernels.paged_attention_gpu,
    'pallas_tpu': kernels.paged_attention_tpu,
  }
  if impl in kernel and window is None:
    return kernel[impl](
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
