"""Attention kernels of each backend (`jrl.models.attention_kernels`).

The chooser is checked branch by branch with explicit backend strings. The
cuDNN wrapper runs here with implementation='xla' (the same
`jax.nn.dot_product_attention` call, the same mask), the splash kernel in
Pallas interpret mode; both against `dot_attention` under a brute-force mask.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import parallel
from jrl.models import attention as A
from jrl.models import attention_kernels as AK
from jrl.models.config import ModelConfig

TOL = {'rtol': 1e-5, 'atol': 1e-5}
MESH_4x2 = {'data': 4, 'fsdp': 1, 'expert': 1, 'tensor': 2}


def _segments(lengths, t):
  """[t] int: segment i + 1 over lengths[i] tokens, then 0 (padding)."""
  ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)]).astype(np.int32)
  return np.pad(ids, (0, t - len(ids)))


def _padded(t):
  """[2, t]: a left-padded row and a right-padded row (one sequence each)."""
  left = np.concatenate([np.zeros(30, np.int32), np.ones(t - 30, np.int32)])
  return np.stack([left, _segments([t - 28], t)])


def _packed(t):
  """[2, t]: packed rows, several segments, a padding tail on the first."""
  return np.stack([_segments([40, 50, 30], t), _segments([70, t - 70], t)])


def reference_allowed(seg_BxT, window=None, packed=True):
  """[B, T, T] bool, brute force: key s visible to query t iff s ≤ t,
  seg[s] > 0, seg[s] = seg[t] (only when `packed`: otherwise padding queries
  read the real keys before them) and (with W) t − s < W; and always s = t."""
  b, t = seg_BxT.shape
  allowed = np.zeros((b, t, t), bool)
  for i in range(b):
    for q in range(t):
      for s in range(q + 1):
        visible = seg_BxT[i, s] > 0 and (seg_BxT[i, q] == seg_BxT[i, s] or not packed)
        inside = window is None or q - s < window
        allowed[i, q, s] = (visible and inside) or q == s
  return allowed


def _qkv(t, heads=4, kv_heads=4, d=64, b=2, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, heads, d), jnp.float32)
  k = jax.random.normal(keys[1], (b, t, kv_heads, d), jnp.float32)
  v = jax.random.normal(keys[2], (b, t, kv_heads, d), jnp.float32)
  w = jax.random.normal(keys[3], (b, t, heads, d), jnp.float32)  # output cotangent
  return q, k, v, w


def _config(**changes):
  """Two layers, sliding then global, GQA, a score scale (a shrunk Gemma)."""
  sizes = {
    'vocab_size': 8,
    'width': 16,
    'mlp_width': 8,
    'num_layers': 2,
    'num_heads': 4,
    'num_kv_heads': 2,
    'head_dim': 64,
    'sliding_window': 24,
    'layer_types': ('sliding', 'full'),
    'attn_scale': 0.2,
  }
  return ModelConfig(**{**sizes, **changes})


def _out_and_grads(fn, q, k, v, w):
  """fn(q, k, v) and the gradients of sum(fn · w) w.r.t. q, k, v."""
  out, vjp = jax.vjp(fn, q, k, v)
  return out, vjp(w)


# ---------------------------------------------------------------- chooser


@pytest.mark.parametrize(
  'backend, kwargs, expected',
  [
    ('cpu', {'dtype': jnp.bfloat16}, 'xla'),
    ('cpu', {'dtype': jnp.float32, 'seq_len': 1024}, 'xla'),
    ('gpu', {}, 'cudnn'),
    ('cuda', {'dtype': jnp.float16}, 'cudnn'),
    ('gpu', {'dtype': jnp.float32}, 'xla'),  # cuDNN flash attention has no float32
    ('gpu', {'softcap': 50.0}, 'xla'),  # dot_product_attention has no soft-cap
    ('gpu', {'head_dim': 256}, 'xla'),  # over Ampere's 128
    ('gpu', {'head_dim': 256, 'cudnn_max_head_dim': 256}, 'cudnn'),  # Hopper
    ('gpu', {'head_dim': 60}, 'xla'),  # not a multiple of 8
    ('gpu', {'seq_len': 255}, 'xla'),  # odd length
    ('gpu', {'cudnn_max_head_dim': 0}, 'xla'),  # no cuDNN flash on this GPU
    ('rocm', {}, 'xla'),
    ('tpu', {}, 'splash'),
    ('tpu', {'dtype': jnp.float32, 'softcap': 50.0, 'head_dim': 256}, 'splash'),
    ('tpu', {'seq_len': 200}, 'xla'),  # not a multiple of the 128 tile
    ('tpu', {'seq_len': 64}, 'xla'),
    ('tpu', {'devices': 8}, 'xla'),  # sharded, no mesh known: jit cannot partition the kernel
    # Traced under a jrl mesh: one kernel call per shard when the batch axes divide B.
    ('tpu', {'devices': 8, 'mesh_shape': MESH_4x2, 'batch': 8}, 'splash'),
    ('tpu', {'devices': 8, 'mesh_shape': MESH_4x2, 'batch': 6}, 'xla'),  # 4 shards, 6 rows
    ('tpu', {'devices': 8, 'mesh_shape': MESH_4x2}, 'xla'),  # rows unknown
    ('tpu', {'devices': 8, 'mesh_shape': {'x': 8}, 'batch': 8}, 'xla'),  # not a jrl mesh
    ('tpu', {'devices': 8, 'mesh_shape': {'data': 1, 'tensor': 1}, 'batch': 3}, 'splash'),
    ('tpu', {'mesh_shape': MESH_4x2, 'batch': 8, 'seq_len': 200}, 'xla'),
    ('gpu', {'mesh_shape': MESH_4x2, 'batch': 8}, 'cudnn'),  # jit partitions cuDNN itself
  ],
)
def test_attention_implementation(backend, kwargs, expected):
  args = {'dtype': jnp.bfloat16, 'head_dim': 128, 'seq_len': 256, **kwargs}
  assert AK.attention_implementation(backend, **args) == expected


def test_auto_implementation_is_xla_on_cpu():
  assert AK.cudnn_max_head_dim() == 0
  assert AK.auto_implementation(dtype=jnp.bfloat16, head_dim=128, seq_len=256) == 'xla'


@pytest.mark.parametrize(
  'mesh_shape, batch, heads, kv_heads, expected',
  [
    (MESH_4x2, 8, 4, 2, (('data',), 'tensor')),  # whole GQA groups per tensor shard
    (MESH_4x2, 8, 4, 1, (('data',), None)),  # one kv head: heads stay whole
    (MESH_4x2, 8, 6, 3, (('data',), None)),  # 3 kv heads over 2 shards
    ({'data': 2, 'fsdp': 2, 'expert': 2, 'tensor': 1}, 4, 4, 4, (('data', 'fsdp'), None)),
    ({'data': 1, 'fsdp': 4, 'expert': 1, 'tensor': 2}, 12, 4, 4, (('fsdp',), 'tensor')),
    (MESH_4x2, 6, 4, 2, None),  # rows do not split over 4 shards
    ({'rows': 2, 'tensor': 4}, 8, 4, 4, None),  # an axis jrl does not lay out
  ],
)
def test_splash_partition(mesh_shape, batch, heads, kv_heads, expected):
  assert AK.splash_partition(mesh_shape, batch, heads, kv_heads) == expected


def test_auto_implementation_reads_the_mesh_in_context(monkeypatch):
  # The backend is faked to TPU: only the choice is made here, no kernel runs.
  monkeypatch.setattr(AK.jax, 'default_backend', lambda: 'tpu')
  args = {'dtype': jnp.bfloat16, 'head_dim': 128, 'seq_len': 256}
  assert AK.context_mesh() is None
  assert AK.auto_implementation(**args, batch=8) == 'xla'  # 8 devices, no mesh known
  with jax.set_mesh(parallel.make_mesh(data=4, tensor=2)):
    assert dict(AK.context_mesh().shape) == MESH_4x2
    assert AK.auto_implementation(**args, batch=8) == 'splash'
    assert AK.auto_implementation(**args, batch=6) == 'xla'
  with jax.set_mesh(parallel.make_mesh(data=1, devices=jax.devices()[:1])):
    assert AK.auto_implementation(**args, batch=3) == 'splash'


def test_splash_block():
  assert [AK.splash_block(t) for t in (128, 256, 384, 1024, 200)] == [128, 256, 128, 512, None]


# ------------------------------------------------------- the masks we test


@pytest.mark.parametrize('case', ['padded', 'packed', 'window'])
def test_reference_mask_is_causal_attention_mask(case):
  """The brute-force mask of these tests is the one `causal_attention` builds."""
  t = 128
  seg = _padded(t) if case == 'padded' else _packed(t)
  window = 24 if case == 'window' else None
  q, k, v, _ = _qkv(t, heads=2, kv_heads=2, d=8)
  shrunk = {'num_layers': 1, 'num_heads': 2, 'num_kv_heads': 2, 'head_dim': 8}
  config = _config(**shrunk, sliding_window=window, layer_types=None, attn_scale=None)
  positions = A.positions_from_segments(seg)
  segment_ids = None if case == 'padded' else seg
  attend = A.causal_attention(seg > 0, positions, config, segment_ids, implementation='xla')
  got, _ = attend(0, q, k, v, None)
  want = A.dot_attention(q, k, v, reference_allowed(seg, window, packed=case != 'padded'))
  np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------- cuDNN


@pytest.mark.parametrize(
  'case, kv_heads, window, scale',
  [
    ('padded', 4, None, None),
    ('packed', 4, None, 0.3),
    ('window', 4, 20, None),
    ('gqa', 2, 20, None),
  ],
)
def test_cudnn_wrapper_matches_dot_attention(case, kv_heads, window, scale):
  t = 128
  seg = _padded(t) if case == 'padded' else _packed(t)
  allowed = jnp.asarray(reference_allowed(seg, window, packed=case != 'padded'))
  q, k, v, w = _qkv(t, heads=4, kv_heads=kv_heads, d=32)
  cudnn = functools.partial(
    AK.cudnn_attention, allowed_BxTxS=allowed, scale=scale, is_causal=True, implementation='xla'
  )
  xla = functools.partial(A.dot_attention, allowed_BxTxS=allowed, scale=scale)
  got, got_grads = _out_and_grads(cudnn, q, k, v, w)
  want, want_grads = _out_and_grads(xla, q, k, v, w)
  np.testing.assert_allclose(got, want, **TOL)
  for g, h in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, h, **TOL)


def test_cudnn_wrapper_refuses_bad_shapes():
  q, k, v, _ = _qkv(16, heads=3, kv_heads=2, d=8)
  with pytest.raises(ValueError, match='multiple'):
    AK.cudnn_attention(q, k, v, jnp.ones((2, 16, 16), bool), implementation='xla')
  q, k, v, _ = _qkv(16, heads=4, kv_heads=2, d=8)
  with pytest.raises(ValueError, match='allowed'):
    AK.cudnn_attention(q, k, v, jnp.ones((16, 16), bool), implementation='xla')


# ---------------------------------------------------------------- splash


@pytest.mark.parametrize(
  't, case, kv_heads, window, scale, softcap',
  [
    (128, 'padded', 4, None, None, None),
    (256, 'packed', 4, None, None, None),
    (256, 'packed', 4, 40, None, None),  # sliding window over several tiles
    (128, 'packed', 2, 20, 0.2, None),  # GQA
    (128, 'packed', 4, None, 0.3, 2.0),  # scale and soft-cap
  ],
)
def test_splash_matches_dot_attention(t, case, kv_heads, window, scale, softcap):
  seg = _padded(t) if case == 'padded' else _packed(t)
  q, k, v, w = _qkv(t, heads=4, kv_heads=kv_heads, d=64)
  real = jnp.asarray(seg > 0)[:, :, None, None]
  splash = functools.partial(
    AK.splash_attention,
    segment_ids_BxT=jnp.asarray(seg),
    window=window,
    scale=scale,
    softcap=softcap,
    block_size=128,
    interpret=True,
  )
  xla = functools.partial(
    A.dot_attention,
    allowed_BxTxS=jnp.asarray(reference_allowed(seg, window, packed=case != 'padded')),
    scale=scale,
    softcap=softcap,
  )
  # Padding queries read other padding keys in splash: compare real tokens only.
  w = jnp.where(real, w, 0.0)
  got, got_grads = _out_and_grads(splash, q, k, v, w)
  want, want_grads = _out_and_grads(xla, q, k, v, w)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(jnp.where(real, got, 0.0), jnp.where(real, want, 0.0), **TOL)
  for g, h in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, h, **TOL)


def test_splash_segments_do_not_mix():
  t = 128
  seg = _packed(t)
  q, k, v, _ = _qkv(t, heads=4, kv_heads=2, d=64)
  attend = jax.jit(
    functools.partial(AK.splash_attention, window=32, block_size=128, interpret=True)
  )
  in_two = jnp.asarray(seg == 2)[:, :, None, None]
  noise = jax.random.normal(jax.random.key(9), q.shape)
  before = attend(q, k, v, jnp.asarray(seg))
  after = attend(
    jnp.where(in_two, q + noise, q),
    jnp.where(in_two, k - noise[:, :, :2], k),
    jnp.where(in_two, v + noise[:, :, 2:], v),
    jnp.asarray(seg),
  )
  other = jnp.asarray((seg > 0) & (seg != 2))[:, :, None, None]
  np.testing.assert_allclose(jnp.where(other, after, 0.0), jnp.where(other, before, 0.0), atol=1e-6)
  assert float(jnp.abs(jnp.where(in_two, after - before, 0.0)).max()) > 0.1


def test_splash_refuses_lengths_off_the_tile():
  q, k, v, _ = _qkv(200, heads=2, kv_heads=2, d=64)
  with pytest.raises(ValueError, match='multiples of 128'):
    AK.splash_attention(q, k, v, jnp.ones((2, 200), jnp.int32), interpret=True)


# --------------------------------------------------- causal_attention(impl)


def _layers(implementation, config, seg, q, k, v):
  """Both layers' outputs of causal_attention on packed rows, under jit."""
  positions = A.positions_from_segments(seg)

  @jax.jit
  def run(q, k, v):
    attend = A.causal_attention(seg > 0, positions, config, seg, implementation=implementation)
    return [attend(layer, q, k, v, None)[0] for layer in range(config.num_layers)]

  return run(q, k, v)


def test_causal_attention_splash_matches_xla():
  config = _config(attn_softcap=2.0)
  seg = jnp.asarray(_packed(128))
  q, k, v, _ = _qkv(128, heads=4, kv_heads=2, d=64)
  real = (seg > 0)[:, :, None, None]
  got = _layers('splash', config, seg, q, k, v)
  want = _layers('xla', config, seg, q, k, v)
  for g, h in zip(got, want, strict=True):
    np.testing.assert_allclose(jnp.where(real, g, 0.0), jnp.where(real, h, 0.0), **TOL)
  # The window matters: the sliding layer differs from the global one.
  assert float(jnp.abs(jnp.where(real, want[0] - want[1], 0.0)).max()) > 0.1


def test_causal_attention_cudnn_path(monkeypatch):
  # cuDNN is not on CPU: the same wrapper, with dot_product_attention's XLA kernel.
  xla_kernel = functools.partial(AK.cudnn_attention, implementation='xla')
  monkeypatch.setattr(AK, 'cudnn_attention', xla_kernel)
  config = _config()
  seg = jnp.asarray(_packed(128))
  q, k, v, _ = _qkv(128, heads=4, kv_heads=2, d=64)
  got = _layers('cudnn', config, seg, q, k, v)
  want = _layers('xla', config, seg, q, k, v)
  for g, h in zip(got, want, strict=True):
    np.testing.assert_allclose(g, h, **TOL)
  with pytest.raises(ValueError, match='soft-cap'):
    _layers('cudnn', _config(attn_softcap=2.0), seg, q, k, v)


def test_causal_attention_auto_is_xla_on_cpu():
  config = _config(attn_softcap=2.0)
  seg = jnp.asarray(_packed(128))
  q, k, v, _ = _qkv(128, heads=4, kv_heads=2, d=64)
  for g, h in zip(
    _layers('auto', config, seg, q, k, v), _layers('xla', config, seg, q, k, v), strict=True
  ):
    np.testing.assert_array_equal(g, h)
  with pytest.raises(ValueError, match='implementation'):
    A.causal_attention(seg > 0, implementation='flash')


# ------------------------------------------------ splash on a mesh (shard_map)


def test_on_mesh_scopes_the_mesh_to_its_calls():
  """`parallel.on_mesh`: the traced code sees the mesh, the caller does not
  before or after; jit's attributes read through, `lower` lowers under the
  mesh, and a copy of the wrapper works."""
  import copy

  mesh = parallel.make_mesh(data=4, tensor=2)
  seen = []

  def fn(x):
    seen.append(AK.context_mesh())
    return x + 1

  wrapped = parallel.on_mesh(mesh, jax.jit(fn))
  assert int(wrapped(1)) == 2 and AK.context_mesh() is None
  assert dict(seen[-1].shape) == MESH_4x2
  assert wrapped._cache_size() == 1
  wrapped(2)
  assert wrapped._cache_size() == 1 and len(seen) == 1  # traced once
  wrapped.lower(jnp.float32(1.0))
  assert dict(seen[-1].shape) == MESH_4x2 and AK.context_mesh() is None
  assert int(copy.copy(wrapped)(3)) == 4


def _on_mesh(mesh, fn, *args):
  """fn(*args) jitted under `mesh` (as `parallel.on_mesh` runs the trainers'
  steps), the arrays laid out as the trainers lay out a batch: rows over
  data x fsdp."""
  placed = [jax.device_put(a, parallel.batch_sharding(mesh, a.ndim)) for a in args]
  return parallel.on_mesh(mesh, jax.jit(fn))(*placed)


@pytest.mark.parametrize(
  'data, tensor, heads, kv_heads, case, window',
  [
    (4, 2, 4, 2, 'packed', None),  # rows over data, whole GQA groups over tensor
    (4, 2, 4, 1, 'packed', 20),  # heads not split (1 kv head): whole on each tensor shard
    (2, 4, 4, 4, 'padded', None),  # 4 tensor shards of one head each
    (8, 1, 2, 2, 'packed', 40),
  ],
)
def test_sharded_splash_matches_dot_attention(data, tensor, heads, kv_heads, case, window):
  mesh = parallel.make_mesh(data=data, tensor=tensor)
  t, b = 128, 8
  seg = np.concatenate([_packed(t) if case == 'packed' else _padded(t)] * (b // 2))
  q, k, v, w = _qkv(t, heads=heads, kv_heads=kv_heads, d=64, b=b)
  real = jnp.asarray(seg > 0)[:, :, None, None]
  w = jnp.where(real, w, 0.0)
  allowed = jnp.asarray(reference_allowed(seg, window, packed=case != 'padded'))

  def sharded(q, k, v, w, seg):
    kernel = functools.partial(
      AK.sharded_splash_attention,
      segment_ids_BxT=seg,
      mesh=AK.context_mesh(),
      window=window,
      scale=0.2,
      block_size=128,
      interpret=True,
    )
    return _out_and_grads(kernel, q, k, v, w)

  got, got_grads = _on_mesh(mesh, sharded, q, k, v, w, jnp.asarray(seg))
  xla = functools.partial(A.dot_attention, allowed_BxTxS=allowed, scale=0.2)
  want, want_grads = _out_and_grads(xla, q, k, v, w)
  np.testing.assert_allclose(jnp.where(real, got, 0.0), jnp.where(real, want, 0.0), **TOL)
  for g, h in zip(got_grads, want_grads, strict=True):
    np.testing.assert_allclose(g, h, **TOL)


def test_sharded_splash_refuses_rows_the_mesh_cannot_split():
  mesh = parallel.make_mesh(data=4, tensor=2)
  q, k, v, _ = _qkv(128, heads=4, kv_heads=2, d=64, b=6)
  with pytest.raises(ValueError, match='cannot split 6 rows'):
    AK.sharded_splash_attention(q, k, v, jnp.ones((6, 128), jnp.int32), mesh=mesh, interpret=True)


def test_causal_attention_splash_under_a_mesh_matches_xla():
  """causal_attention(implementation='splash') traced under a mesh runs the
  kernel per shard (a bare Mosaic kernel would not partition): both layers
  (sliding and global, soft-cap) equal the XLA path on real tokens."""
  mesh = parallel.make_mesh(data=4, tensor=2)
  config = _config(attn_softcap=2.0)
  seg = jnp.asarray(np.concatenate([_packed(128)] * 4))
  q, k, v, _ = _qkv(128, heads=4, kv_heads=2, d=64, b=8)
  real = (seg > 0)[:, :, None, None]

  def layers(implementation):
    def run(q, k, v, seg):
      positions = A.positions_from_segments(seg)
      attend = A.causal_attention(seg > 0, positions, config, seg, implementation=implementation)
      return [attend(layer, q, k, v, None)[0] for layer in range(config.num_layers)]

    return _on_mesh(mesh, run, q, k, v, seg)

  for g, h in zip(layers('splash'), layers('xla'), strict=True):
    np.testing.assert_allclose(jnp.where(real, g, 0.0), jnp.where(real, h, 0.0), **TOL)
  # In interpret mode jit could partition the kernel's ops itself, so look for the
  # shard_map: one per layer under the mesh, none without one.
  attend = A.causal_attention(seg > 0, None, config, seg, implementation='splash')
  trace = jax.make_jaxpr(lambda q, k, v: attend(0, q, k, v, None)[0])
  with jax.set_mesh(mesh):
    assert 'shard_map' in str(trace(q, k, v))
  assert 'shard_map' not in str(trace(q, k, v))
