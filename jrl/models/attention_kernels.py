"""Attention kernels of each backend, and the one function that picks among them.

`attention_implementation` maps a backend and the static facts of a layer
(compute dtype, head width, sequence length, soft-cap) and of the program
(devices, the mesh it is traced under, rows) to one of

  'xla'     `jrl.models.attention.dot_attention`: einsums on a dense boolean
            mask; runs everywhere, takes every option.
  'cudnn'   cuDNN flash attention through `jax.nn.dot_product_attention`
            (`cudnn_attention`), on the same boolean mask.
  'splash'  the Pallas TPU splash-attention kernel (`splash_attention`):
            causal or local mask, segment ids for packing and padding; on a
            mesh, one call per shard (`sharded_splash_attention`).

`causal_attention(..., implementation='auto')` in `jrl.models.attention`
asks `auto_implementation` once per layer at trace time. This module imports
nothing from `jrl.models.attention`, which imports it.

Shapes: B batch, T queries, S keys, H query heads, K kv heads, d head width.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jrl import parallel

SPLASH_BLOCKS = (512, 256, 128)  # tile sizes tried, largest first; the smallest is the lane width


def attention_implementation(
  backend,
  *,
  dtype,
  head_dim,
  seq_len,
  softcap=None,
  cudnn_max_head_dim=128,
  devices=1,
  mesh_shape=None,
  batch=None,
):
  """'xla', 'cudnn' or 'splash': the fastest kernel that takes this attention.

  A pure function of its arguments:

    'cpu' (and any backend not named below): 'xla'.
    'gpu' / 'cuda': 'cudnn' iff cuDNN flash attention takes the layer —
      `dtype` float16 or bfloat16 (it has no float32 kernel), no `softcap`
      (`jax.nn.dot_product_attention` has none), `head_dim` a multiple of 8
      and ≤ `cudnn_max_head_dim` (128 on Ampere, 256 from Hopper on; see
      `cudnn_max_head_dim()`), and `seq_len` even (cuDNN trains with a mask
      only on even lengths). Any boolean mask is expressible: it goes in as
      an additive bias. Otherwise 'xla'.
    'rocm': 'xla' (no cuDNN).
    'tpu': 'splash' iff `seq_len` is a multiple of the smallest splash tile
      (128) and the kernel can run on every device of the program: the
      program runs on one device, or it is traced under a jrl mesh
      (`mesh_shape`, see `splash_partition`) whose batch shards divide
      `batch`. The kernel takes any dtype, head width, sliding window and
      soft-cap. A Mosaic kernel is not partitioned by `jax.jit`, so on a mesh
      `causal_attention` runs it under `shard_map` (`sharded_splash_attention`);
      a sharded program traced without a mesh (no `jax.set_mesh`, see
      `jrl.parallel.on_mesh`) keeps 'xla'.

  Args:
    backend: `jax.default_backend()` or a platform name.
    dtype: compute dtype of q, k and v.
    head_dim: d.
    seq_len: T (= S: self-attention over full rows).
    softcap: the layer's score soft-cap, or None.
    cudnn_max_head_dim: the widest head cuDNN flash attention takes on this
      GPU (0: none).
    devices: devices the program runs on (when no mesh is known).
    mesh_shape: {axis name: size} of the mesh the program is traced under,
      or None.
    batch: B, the rows of the attention (needed with a mesh).
  """
  if backend in ('gpu', 'cuda'):
    low_precision = jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
    head_ok = head_dim % 8 == 0 and head_dim <= cudnn_max_head_dim
    if low_precision and softcap is None and head_ok and seq_len % 2 == 0:
      return 'cudnn'
    return 'xla'
  if backend == 'tpu':
    if seq_len % SPLASH_BLOCKS[-1]:
      return 'xla'
    if mesh_shape is None:
      return 'splash' if devices == 1 else 'xla'
    if math.prod(mesh_shape.values()) == 1:
      return 'splash'
    fits = batch is not None and splash_partition(mesh_shape, batch, 1, 1) is not None
    return 'splash' if fits else 'xla'
  return 'xla'


def splash_partition(mesh_shape, batch, heads, kv_heads):
  """How `sharded_splash_attention` splits the attention over a mesh: the
  (batch axes, head axis) of its `shard_map`, or None where it cannot.

  Only jrl's meshes (axis names within `jrl.parallel.MESH_AXES`) are split:
  rows over the batch axes (`parallel.BATCH_AXES`, data x fsdp, as the
  trainers lay out every batch), which must divide `batch`; query and kv
  heads over 'tensor' when its size divides both `heads` and `kv_heads`
  (each shard then holds whole GQA groups), else the heads stay whole on
  every tensor shard. The expert axis (and tensor, unsplit) hold copies.

  Args:
    mesh_shape: {axis name: size}.
    batch, heads, kv_heads: B, H, K.

  Returns:
    (batch_axes, head_axis): a tuple of mesh axis names and 'tensor' or None.
  """
  if not set(mesh_shape) <= set(parallel.MESH_AXES):
    return None
  batch_axes = tuple(a for a in parallel.BATCH_AXES if mesh_shape.get(a, 1) > 1)
  if batch % math.prod(mesh_shape[a] for a in batch_axes):
    return None
  tensor = mesh_shape.get('tensor', 1)
  split_heads = tensor > 1 and heads % tensor == 0 and kv_heads % tensor == 0
  return batch_axes, ('tensor' if split_heads else None)


def cudnn_max_head_dim(device=None):
  """The widest head cuDNN flash attention takes on `device` (default: the
  first device): 256 from Hopper (sm90) on, 128 on Ampere / Ada, 0 elsewhere
  (CPU, TPU, ROCm, older GPUs)."""
  device = jax.devices()[0] if device is None else device
  capability = getattr(device, 'compute_capability', None)
  if not capability:
    return 0
  major = int(str(capability).split('.')[0])
  return 256 if major >= 9 else 128 if major >= 8 else 0


def context_mesh():
  """The mesh the caller traces under (`jax.set_mesh`), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def auto_implementation(*, dtype, head_dim, seq_len, softcap=None, batch=None):
  """`attention_implementation` for `jax.default_backend()`, its first device
  and the mesh in context (`context_mesh`)."""
  backend = jax.default_backend()
  max_head_dim = cudnn_max_head_dim() if backend in ('gpu', 'cuda') else 0
  mesh = context_mesh()
  return attention_implementation(
    backend,
    dtype=dtype,
    head_dim=head_dim,
    seq_len=seq_len,
    softcap=softcap,
    cudnn_max_head_dim=max_head_dim,
    devices=jax.device_count(),
    mesh_shape=None if mesh is None else dict(mesh.shape),
    batch=batch,
  )


def cudnn_attention(
  q_BxTxHxd,
  k_BxSxKxd,
  v_BxSxKxd,
  allowed_BxTxS,
  *,
  scale=None,
  is_causal=False,
  implementation='cudnn',
):
  """Softmax attention by `jax.nn.dot_product_attention` under a boolean mask.

  The numbers of `dot_attention(q, k, v, allowed, scale=scale)`: query head h
  reads kv head h // (H / K), scores q·k · scale (default 1 / sqrt(d)) and
  their softmax in float32. No soft-cap (dot_product_attention has none).
  Every query must see at least one key (our masks keep the diagonal).

  Args:
    q_BxTxHxd, k_BxSxKxd, v_BxSxKxd: one dtype; float16 / bfloat16 for cuDNN.
    allowed_BxTxS: bool, key s visible to query t. cuDNN reads it as an
      additive bias, broadcast over heads.
    scale: score scale (None: 1 / sqrt(d)).
    is_causal: also apply the causal mask, which lets cuDNN skip the tiles
      above the diagonal; `allowed` is and-ed with it.
    implementation: 'cudnn' (GPU) or 'xla' (any backend: tests).

  Returns:
    [B, T, H, d] in q's dtype.
  """
  b, t, h, d = q_BxTxHxd.shape
  _, s, kv_heads, _ = k_BxSxKxd.shape
  if k_BxSxKxd.shape != (b, s, kv_heads, d) or v_BxSxKxd.shape != k_BxSxKxd.shape:
    raise ValueError(f'k, v must be [B, S, K, {d}], got {k_BxSxKxd.shape}, {v_BxSxKxd.shape}.')
  if h % kv_heads:
    raise ValueError(f'{h} query heads are not a multiple of {kv_heads} kv heads.')
  if allowed_BxTxS.shape != (b, t, s):
    raise ValueError(f'`allowed` must be {(b, t, s)}, got {allowed_BxTxS.shape}.')
  return jax.nn.dot_product_attention(
    q_BxTxHxd,
    k_BxSxKxd,
    v_BxSxKxd,
    mask=allowed_BxTxS.astype(bool)[:, None, :, :],
    scale=scale,
    is_causal=is_causal,
    implementation=implementation,
  )


def splash_block(seq_len):
  """The largest of SPLASH_BLOCKS that divides `seq_len` (None: none does)."""
  return next((blk for blk in SPLASH_BLOCKS if seq_len % blk == 0), None)


def splash_attention(
  q_BxTxHxd,
  k_BxTxKxd,
  v_BxTxKxd,
  segment_ids_BxT,
  *,
  window=None,
  scale=None,
  softcap=None,
  block_size=None,
  interpret=False,
):
  """Causal self-attention by the Pallas TPU splash-attention kernel.

  Key s is visible to query t iff s ≤ t, segment[s] = segment[t] and (with a
  window W) t − s < W. Segment 0 (padding) is a segment like the others:
  padding queries read padding keys, so their outputs are finite; callers
  ignore them. The window counts tokens by index, which is the same as by
  position when positions advance by one per token within each sequence
  (`positions_from_mask` of contiguous rows, `positions_from_segments`).

  Splash does not scale: q is scaled in float32 and cast back before the
  kernel, which soft-caps c·tanh(s / c) the scaled float32 scores and takes
  a float32 softmax. Query head h reads kv head h // (H / K). One kernel call
  per row (vmap over B).

  Args:
    q_BxTxHxd, k_BxTxKxd, v_BxTxKxd: one dtype.
    segment_ids_BxT: int, 1, 2, ... per sequence, 0 on padding.
    window: sliding window W, or None (global).
    scale: score scale (None: 1 / sqrt(d)).
    softcap: scores -> c·tanh(scores / c), or None.
    block_size: q and kv tile, a multiple of 128 dividing T (None:
      `splash_block(T)`).
    interpret: run the kernel in Pallas interpret mode (CPU tests; slow).

  Returns:
    [B, T, H, d] in q's dtype.
  """
  # Imported here: Pallas adds half a second to `import jrl.models`.
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  b, t, h, d = q_BxTxHxd.shape
  kv_heads = k_BxTxKxd.shape[2]
  if k_BxTxKxd.shape != (b, t, kv_heads, d) or v_BxTxKxd.shape != k_BxTxKxd.shape:
    raise ValueError(f'k, v must be [{b}, {t}, K, {d}], got {k_BxTxKxd.shape}, {v_BxTxKxd.shape}.')
  if h % kv_heads:
    raise ValueError(f'{h} query heads are not a multiple of {kv_heads} kv heads.')
  if segment_ids_BxT.shape != (b, t):
    raise ValueError(f'`segment_ids` must be {(b, t)}, got {segment_ids_BxT.shape}.')
  block = splash_block(t) if block_size is None else block_size
  if block is None or t % block or block % SPLASH_BLOCKS[-1]:
    raise ValueError(f'splash tiles must be multiples of 128 dividing T = {t}, got {block}.')
  if window is not None and window < 1:
    raise ValueError(f'`window` must be ≥ 1, got {window}.')

  if window is None:
    head_mask = masks.CausalMask((t, t))
  else:
    head_mask = masks.LocalMask((t, t), window_size=(window - 1, 0), offset=0)
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  kernel = splash.make_splash_mha(
    masks.MultiHeadMask([head_mask] * h),
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    attn_logits_soft_cap=None if softcap is None else float(softcap),
    interpret=interpret,
  )

  scale = d**-0.5 if scale is None else scale
  # The scale in float32, then back to the compute dtype the kernel reads.
  q_scaled = (q_BxTxHxd.astype(jnp.float32) * np.float32(scale)).astype(q_BxTxHxd.dtype)
  q_BxHxTxd = q_scaled.transpose(0, 2, 1, 3)
  k_BxKxTxd = k_BxTxKxd.transpose(0, 2, 1, 3)
  v_BxKxTxd = v_BxTxKxd.transpose(0, 2, 1, 3)
  seg_BxT = jnp.asarray(segment_ids_BxT).astype(jnp.int32)

  def one_row(q_HxTxd, k_KxTxd, v_KxTxd, seg_T):
    return kernel(q_HxTxd, k_KxTxd, v_KxTxd, segment_ids=splash.SegmentIds(q=seg_T, kv=seg_T))

  out_BxHxTxd = jax.vmap(one_row)(q_BxHxTxd, k_BxKxTxd, v_BxKxTxd, seg_BxT)
  return out_BxHxTxd.transpose(0, 2, 1, 3)


def sharded_splash_attention(q_BxTxHxd, k_BxTxKxd, v_BxTxKxd, segment_ids_BxT, *, mesh, **kwargs):
  """`splash_attention` on every shard of `mesh` (a Mesh or AbstractMesh,
  e.g. `context_mesh()`): a `shard_map` that gives each device its rows and
  heads (`splash_partition`), so the kernel never sees another shard's rows
  and the result equals the unsharded call. `kwargs` go to
  `splash_attention`. Raises ValueError where the mesh cannot split B.
  """
  b, _, h, _ = q_BxTxHxd.shape
  kv_heads = k_BxTxKxd.shape[2]
  split = splash_partition(dict(mesh.shape), b, h, kv_heads)
  if split is None:
    raise ValueError(
      f'splash attention cannot split {b} rows over mesh {dict(mesh.shape)}: the batch axes '
      f'{parallel.BATCH_AXES} must divide the rows, and the mesh use only {parallel.MESH_AXES}.'
    )
  batch_axes, head_axis = split
  rows = batch_axes or None
  heads_spec = P(rows, None, head_axis, None)

  def local(q, k, v, seg):
    return splash_attention(q, k, v, seg, **kwargs)

  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(heads_spec, heads_spec, heads_spec, P(rows, None)),
    out_specs=heads_spec,
    check_vma=False,
  )(q_BxTxHxd, k_BxTxKxd, v_BxTxKxd, segment_ids_BxT)
