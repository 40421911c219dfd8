"""Attention of the full-sequence forward, and what the sampler shares with it.

Rotary embeddings (`apply_rope`), each layer's window / scale / soft-cap
(`attention_options`), the float32 scores (`attention_scores`), softmax
attention under a boolean mask with grouped kv heads (`dot_attention`), and
the causal mask of training rows, padded or packed (`causal_attention`:
with `segment_ids` no token attends across a sequence boundary; positions
restart with `positions_from_segments`; `implementation` picks the XLA,
cuDNN or splash kernel, see `jrl.models.attention_kernels`). The paged
attention of the sampler (`jrl/sampler/attention.py`) reuses the scores and
the options, so trainer and sampler compute the same numbers.

Shapes: B batch, T queries, S keys, H query heads, K kv heads, d head width.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl import precision
from jrl.models import attention_kernels
from jrl.models.lse_attention import lse_attention

NEG_INF = -0.7 * float(np.finfo(np.float32).max)  # finite: fully masked rows stay NaN-free


def apply_rope(x_BxTxNxd, positions_BxT, inv_freq):
  """Rotary embedding in the "rotate half" layout used by Llama and Qwen.

  Args:
    x_BxTxNxd: queries or keys.
    positions_BxT: int positions.
    inv_freq: [d/2] float32 inverse frequencies.

  Returns:
    [B, T, N, d] in x's dtype.
  """
  # Angles in float32, then cast: the same order of operations as Hugging Face.
  angles_BxTxh = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  angles_BxTxd = jnp.concatenate([angles_BxTxh, angles_BxTxh], axis=-1)
  cos = jnp.cos(angles_BxTxd)[:, :, None, :].astype(x_BxTxNxd.dtype)
  sin = jnp.sin(angles_BxTxd)[:, :, None, :].astype(x_BxTxNxd.dtype)
  x1, x2 = jnp.split(x_BxTxNxd, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxTxNxd * cos + rotated * sin


class AttentionOptions(NamedTuple):
  """What differs between the attention of one layer and another's."""

  window: int | None  # sliding window W (None: global)
  scale: float | None  # score scale (None: 1 / sqrt(d))
  softcap: float | None  # scores -> c·tanh(scores / c) (None: off)


def attention_options(config, layer):
  """The AttentionOptions of layer `layer` of `config`."""
  return AttentionOptions(config.window(layer), config.attn_scale, config.attn_softcap)


def attention_scores(scores, d, scale=None, softcap=None):
  """float32 scores q·k scaled (1/sqrt(d) or `scale`) and soft-capped.

  Shared by the dense and the paged attention, so the sampler and the
  trainer compute the very same numbers.
  """
  scores = scores.astype(jnp.float32)
  if scale is None:
    scores = scores / np.sqrt(d).astype(np.float32)
  else:
    scores = scores * np.float32(scale)
  if softcap is not None:
    scores = np.float32(softcap) * jnp.tanh(scores / np.float32(softcap))
  return scores


def dot_attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, allowed_BxTxS, *, scale=None, softcap=None):
  """Softmax attention with grouped kv heads and a boolean visibility mask.

  Query head h reads kv head h // (H / K). Scores and softmax are float32;
  `scale` (default 1 / sqrt(d)) and `softcap` as in `attention_scores`.
  A query with no visible key gets a uniform average (finite), never NaN.

  Returns:
    [B, T, H, d] in v's dtype.
  """
  b, t, h, d = q_BxTxHxd.shape
  k = k_BxSxKxd.shape[2]
  q_BxTxKxGxd = q_BxTxHxd.reshape(b, t, k, h // k, d)
  # float32 scores from compute-dtype operands; compute-dtype matmuls backwards.
  scores = precision.einsum_f32('btkgd,bskd->bkgts', q_BxTxKxGxd, k_BxSxKxd)
  scores = attention_scores(scores, d, scale, softcap)
  scores = jnp.where(allowed_BxTxS[:, None, None, :, :], scores, NEG_INF)
  # Softmax in float32.
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxd.dtype)
  out = jnp.einsum('bkgts,bskd->btkgd', probs, v_BxSxKxd)
  return out.reshape(b, t, h, d)


def within_window(q_pos, k_pos, window):
  """Key position k_pos is inside the sliding window of query position q_pos
  (q_pos − k_pos < W; Hugging Face's convention). True everywhere when
  `window` is None. Broadcasts."""
  if window is None:
    return jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), bool)
  return q_pos - k_pos < window


IMPLEMENTATIONS = ('auto', 'xla', 'lse', 'cudnn', 'splash')


def causal_attention(
  mask_BxT, positions_BxT=None, config=None, segment_ids_BxT=None, *, implementation='auto'
):
  """Dense causal attention for full sequences: key s is visible to query t iff
  s ≤ t and (mask[s] or s = t); left or right padding both work.

  With `segment_ids` (packed rows: 1, 2, ... per sequence, 0 on padding) key s
  is visible to query t iff s ≤ t and segment[s] = segment[t] > 0 (or s = t),
  so no token attends across a sequence boundary.

  With `config`, each layer also applies its sliding window (on `positions`,
  which default to `positions_from_mask(mask)`; per-segment positions for
  packed rows), score scale and soft-cap.

  `implementation` picks the kernel (`jrl.models.attention_kernels`):
  'xla' is `dot_attention` on the dense mask; 'lse' the same numbers with a
  backward that stores O(T) per row instead of every layer's [H, T, S]
  probabilities (`jrl.models.lse_attention`); 'cudnn' the same mask through
  cuDNN flash attention (float16 / bfloat16, no soft-cap); 'splash' the
  Pallas TPU kernel (interpret mode off TPU: slow, for tests; under the
  `jax.set_mesh` mesh in context, if any, one call per shard), whose window
  counts tokens by index — the same as by `positions` when these advance by
  one per token within each sequence, as the defaults do. Real tokens get
  the same outputs from all three; padding queries get finite values that
  differ. 'auto' asks `attention_implementation` for `jax.default_backend()`,
  layer by layer at trace time ('xla' on CPU).
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'`implementation` must be one of {IMPLEMENTATIONS}, got {implementation!r}.')
  mask_BxT = mask_BxT.astype(bool)
  t = mask_BxT.shape[1]
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  visible_BxTxS = mask_BxT[:, None, :]
  if segment_ids_BxT is not None:
    seg = jnp.asarray(segment_ids_BxT)
    visible_BxTxS = visible_BxTxS & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
  # Every query also sees itself, so a padding query (which has no real key
  # before it) stays causal instead of averaging over every key.
  allowed_BxTxT = causal_TxT[None] & (visible_BxTxS | jnp.eye(t, dtype=bool)[None])

  def attend_with(opts, allowed, q, k, v):
    impl = implementation
    if impl == 'auto':
      impl = attention_kernels.auto_implementation(
        dtype=q.dtype, head_dim=q.shape[-1], seq_len=t, softcap=opts.softcap, batch=q.shape[0]
      )
    if impl == 'xla':
      return dot_attention(q, k, v, allowed, scale=opts.scale, softcap=opts.softcap)
    if impl == 'lse':
      return lse_attention(q, k, v, allowed, scale=opts.scale, softcap=opts.softcap)
    if impl == 'cudnn':
      if opts.softcap is not None:
        raise ValueError("implementation='cudnn' takes no attention soft-cap; use 'xla'.")
      return attention_kernels.cudnn_attention(q, k, v, allowed, scale=opts.scale, is_causal=True)
    # Splash reads the mask as segments: padding (and masked tokens) in segment 0.
    seg_BxT = jnp.where(mask_BxT, 1 if segment_ids_BxT is None else segment_ids_BxT, 0)
    kernel_args = dict(
      window=opts.window,
      scale=opts.scale,
      softcap=opts.softcap,
      interpret=jax.default_backend() != 'tpu',
    )
    mesh = attention_kernels.context_mesh()
    if mesh is not None and math.prod(mesh.shape.values()) > 1:
      # A Mosaic kernel is not partitioned by jit: one call per shard.
      return attention_kernels.sharded_splash_attention(q, k, v, seg_BxT, mesh=mesh, **kernel_args)
    return attention_kernels.splash_attention(q, k, v, seg_BxT, **kernel_args)

  if config is None:

    def attend(layer, q, k, v, cache):
      del layer
      return attend_with(AttentionOptions(None, None, None), allowed_BxTxT, q, k, v), cache

    return attend

  if positions_BxT is None:
    positions_BxT = positions_from_mask(mask_BxT)
  windowed = {}
  for w in {config.window(i) for i in range(config.num_layers)} - {None}:
    inside = within_window(positions_BxT[:, :, None], positions_BxT[:, None, :], w)
    windowed[w] = allowed_BxTxT & (inside | jnp.eye(t, dtype=bool)[None])

  def attend_layer(layer, q, k, v, cache):
    opts = attention_options(config, layer)
    allowed = allowed_BxTxT if opts.window is None else windowed[opts.window]
    return attend_with(opts, allowed, q, k, v), cache

  return attend_layer


def shared_prompt_attention(
  mask_RxL, positions_RxL, branches_RxGxU, config=None, *, implementation='auto'
):
  """Attention of shared-prompt rows (`jrl.data.layouts.shared_prompt`): each
  row holds one prompt in its first P = L − G·U columns, then G branches of
  U columns, each a completion of that prompt. A prompt token sees the
  prompt's real tokens before it; a branch token sees the whole prompt and
  its own branch's real tokens before it, never another branch. So every
  branch gets exactly the attention of its unshared row (prompt +
  completion), while the prompt's keys and values are computed once.

  The branch queries attend over [prompt ‖ own branch] keys (P + U), not
  the row's L: the cost is that of the unshared rows less the repeated
  prompts. `dot_attention`, or with `implementation` 'lse' (or 'auto'
  choosing it) `lse_attention`; the cuDNN and splash kernels do not take
  this mask, and stand for 'xla' here.

  Args:
    mask_RxL: [R, L] bool real tokens.
    positions_RxL: [R, L] int positions (a branch continues its prompt's).
    branches_RxGxU: [R, G, U] bool real branch tokens (its shape gives G, U).
    config: ModelConfig for each layer's window, scale and soft-cap (None: plain).
  """
  r, g, u = branches_RxGxU.shape
  length = mask_RxL.shape[1]
  p = length - g * u
  if p < 1:
    raise ValueError(f'shared-prompt rows of {length} columns hold no prompt before {g} x {u}.')
  mask_RxL = mask_RxL.astype(bool)
  eye_PxP = jnp.eye(p, dtype=bool)
  # Prompt queries: causal over the prompt's real keys (and themselves).
  prompt_RxPxP = jnp.tril(jnp.ones((p, p), bool))[None] & (mask_RxL[:, None, :p] | eye_PxP)
  # Branch queries: every real prompt key, then causal over the branch's real keys.
  own_UxU = jnp.tril(jnp.ones((u, u), bool))
  branch_real = branches_RxGxU.reshape(r * g, u)
  prompt_keys = jnp.broadcast_to(mask_RxL[:, None, None, :p], (r, g, u, p)).reshape(r * g, u, p)
  own = own_UxU[None] & (branch_real[:, None, :] | jnp.eye(u, dtype=bool)[None])
  branch_NxUxS = jnp.concatenate([prompt_keys, own], axis=-1)
  pos_prompt = positions_RxL[:, :p]
  pos_branch = positions_RxL[:, p:].reshape(r * g, u)
  pos_keys = jnp.concatenate(
    [jnp.broadcast_to(pos_prompt[:, None], (r, g, p)).reshape(r * g, p), pos_branch], axis=-1
  )

  def masks(window):
    if window is None:
      return prompt_RxPxP, branch_NxUxS
    inside_p = within_window(pos_prompt[:, :, None], pos_prompt[:, None, :], window) | eye_PxP
    inside_b = within_window(pos_branch[:, :, None], pos_keys[:, None, :], window)
    return prompt_RxPxP & inside_p, branch_NxUxS & inside_b

  def attend_layer(layer, q, k, v, cache):
    opts = (
      AttentionOptions(None, None, None) if config is None else attention_options(config, layer)
    )
    allowed_prompt, allowed_branch = masks(opts.window)
    kw = dict(scale=opts.scale, softcap=opts.softcap)
    impl = implementation
    if impl == 'auto':
      impl = attention_kernels.auto_implementation(
        dtype=q.dtype, head_dim=q.shape[-1], seq_len=length, softcap=opts.softcap, batch=r
      )
    attend = lse_attention if impl == 'lse' else dot_attention
    out_prompt = attend(q[:, :p], k[:, :p], v[:, :p], allowed_prompt, **kw)

    def keys(x_RxLxKxd):
      # [prompt ‖ own branch] per branch: the prompt's keys repeated G times.
      kd = x_RxLxKxd.shape[2:]
      shared = jnp.broadcast_to(x_RxLxKxd[:, None, :p], (r, g, p, *kd))
      return jnp.concatenate([shared, x_RxLxKxd[:, p:].reshape(r, g, u, *kd)], axis=2).reshape(
        r * g, p + u, *kd
      )

    q_branch = q[:, p:].reshape(r * g, u, *q.shape[2:])
    out_branch = attend(q_branch, keys(k), keys(v), allowed_branch, **kw)
    out = jnp.concatenate([out_prompt, out_branch.reshape(r, g * u, *q.shape[2:])], axis=1)
    return out, cache

  return attend_layer


def positions_from_mask(mask_BxT):
  """Positions that start at 0 on each row's first real token (left padding)."""
  mask = mask_BxT.astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


def positions_from_segments(segment_ids_BxT):
  """Positions that restart at 0 where each segment of a packed row begins
  (0 on padding). Segments are contiguous runs of one id."""
  seg = jnp.asarray(segment_ids_BxT)
  t = seg.shape[1]
  col_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), seg.shape)
  starts_BxT = segment_starts(seg)
  first_BxT = jax.lax.cummax(jnp.where(starts_BxT, col_BxT, 0), axis=1)
  return jnp.where(seg > 0, col_BxT - first_BxT, 0).astype(jnp.int32)


def segment_starts(segment_ids_BxT):
  """[B, T] bool: the first token of each segment (not on padding)."""
  seg = jnp.asarray(segment_ids_BxT)
  before = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return (seg != before) & (seg > 0)
