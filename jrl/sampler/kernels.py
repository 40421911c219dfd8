"""Pallas kernels for decode attention over the paged KV cache.

Both have the contract of `jrl.sampler.attention.paged_attention_gather`
(one query per slot, [K, N, P, d] page pools, a page table and a length per
slot; no sliding window) and are checked against it in Pallas interpret
mode on the CPU (tests/sampler/test_attention.py).

* `paged_attention_gpu`: written here for GPUs (the Triton lowering of
  Pallas). One program per (slot, query head) walks the slot's pages in
  order, `ceil(length / P)` of them, keeping an online softmax in float32
  (running maximum, running sum, weighted values), so no [S, M, P, d]
  gather is materialised and no page past a slot's length is read. Scores,
  soft-cap and masking are those of the gather path; values at positions a
  slot cannot see are zeroed before they are weighted, so garbage in a page
  (the scratch page, a stale tail) cannot leak. Triton needs power-of-two
  tiles: `gpu_supported` says whether a page size and head width fit.
* `paged_attention_tpu`: JAX's Pallas TPU paged-attention kernel
  (`jax.experimental.pallas.ops.tpu.paged_attention`), which reads the same
  page layout.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _is_pow2(n):
  return n > 0 and n & (n - 1) == 0


def gpu_supported(page_size, head_dim):
  """Whether `paged_attention_gpu` takes pages of `page_size` tokens and
  heads of `head_dim` (Triton tiles are powers of two)."""
  return _is_pow2(page_size) and _is_pow2(head_dim)


def _decode_kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *, group, scale, softcap):
  """Program (s, h): slot s's query head h over its pages (online softmax)."""
  s, h = pl.program_id(0), pl.program_id(1)
  kv = h // group
  page_size = k_ref.shape[2]
  length = lengths_ref[s]
  q_d = q_ref[s, h, :].astype(jnp.float32)
  offsets_P = jnp.arange(page_size, dtype=jnp.int32)

  def page(j, carry):
    m, total, acc_d = carry
    p = table_ref[s, j]
    k_Pxd = k_ref[kv, p, :, :].astype(jnp.float32)
    v_Pxd = v_ref[kv, p, :, :].astype(jnp.float32)
    scores_P = jnp.sum(k_Pxd * q_d[None, :], axis=1)
    # As `attention_scores`: divided by sqrt(d), or times an explicit scale.
    scores_P = scores_P / jnp.sqrt(jnp.float32(q_d.shape[0])) if scale is None else scores_P * scale
    if softcap is not None:
      scores_P = softcap * jnp.tanh(scores_P / softcap)
    visible_P = j * page_size + offsets_P < length
    scores_P = jnp.where(visible_P, scores_P, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores_P))
    alpha = jnp.exp(m - m_new)
    probs_P = jnp.where(visible_P, jnp.exp(scores_P - m_new), 0.0)
    v_Pxd = jnp.where(visible_P[:, None], v_Pxd, 0.0)
    acc_d = acc_d * alpha + jnp.sum(probs_P[:, None] * v_Pxd, axis=0)
    return m_new, total * alpha + jnp.sum(probs_P), acc_d

  num_pages = (length + page_size - 1) // page_size
  init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros(q_d.shape, jnp.float32))
  _, total, acc_d = jax.lax.fori_loop(0, num_pages, page, init)
  o_ref[s, h, :] = (acc_d / total).astype(o_ref.dtype)


def paged_attention_gpu(
  q_SxHxd, k_pages, v_pages, page_table_SxM, lengths_S, *, scale=None, softcap=None, interpret=None
):
  """Decode attention over the paged cache, one Pallas program per (slot, head).

  Args:
    q_SxHxd: one query per slot.
    k_pages, v_pages: [K, N, P, d].
    page_table_SxM: int32 page ids.
    lengths_S: int32 cached tokens per slot (>= 1: idle slots read one
      position of the scratch page, as on the gather path).
    scale, softcap: as `jrl.models.attention.attention_scores`.
    interpret: Pallas interpret mode (default: off a GPU).

  Returns:
    [S, H, d] in q's dtype.
  """
  s, h, d = q_SxHxd.shape
  k = k_pages.shape[0]
  if interpret is None:
    interpret = jax.default_backend() != 'gpu'
  # Imported here: a jax build without the Triton lowering still samples on
  # the gather path (and fails only if this kernel is asked for).
  from jax.experimental.pallas import triton

  kernel = functools.partial(
    _decode_kernel,
    group=h // k,
    scale=scale,
    softcap=softcap,
  )
  return pl.pallas_call(
    kernel,
    grid=(s, h),
    out_shape=jax.ShapeDtypeStruct((s, h, d), q_SxHxd.dtype),
    interpret=interpret,
    # The Triton lowering (not Mosaic GPU, which would stage whole operands in
    # shared memory): each program reads its pages from global memory.
    compiler_params=triton.CompilerParams(num_warps=4, num_stages=2),
  )(lengths_S.astype(jnp.int32), page_table_SxM.astype(jnp.int32), q_SxHxd, k_pages, v_pages)


def paged_attention_tpu(
  q_SxHxd, k_pages, v_pages, page_table_SxM, lengths_S, *, scale=None, softcap=None
):
  """JAX's TPU Pallas kernel with the gather path's contract (no window).
  Off a TPU it runs only inside `pltpu.force_tpu_interpret_mode()` (tests)."""
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
