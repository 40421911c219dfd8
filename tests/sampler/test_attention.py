"""Paged attention: the gather path against the model's dense attention, jrl's
C++ CPU kernel against the gather path, and the Pallas kernels (GPU, TPU)
against the gather path in interpret mode."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models.attention import dot_attention
from jrl.sampler import attention, cpu_kernel, paged


def _dense_reference(q, k_pages, v_pages, table, lengths):
  """Slot by slot: copy its pages into a dense [1, L, K, d] and run dot_attention."""
  outs = []
  for s in range(q.shape[0]):
    n = int(lengths[s])
    pages = np.asarray(table[s])
    k = np.concatenate([np.asarray(k_pages[:, p]) for p in pages], axis=1)[:, :n]  # [K, n, d]
    v = np.concatenate([np.asarray(v_pages[:, p]) for p in pages], axis=1)[:, :n]
    k, v = jnp.asarray(k.transpose(1, 0, 2))[None], jnp.asarray(v.transpose(1, 0, 2))[None]
    allowed = jnp.ones((1, 1, n), bool)
    outs.append(dot_attention(q[s][None, None], k, v, allowed)[0, 0])
  return np.stack(outs)


@pytest.mark.parametrize('heads, kv_heads', [(4, 2), (4, 4), (4, 1)])
def test_gather_path_equals_dense_attention_and_ignores_garbage(heads, kv_heads):
  rng = np.random.default_rng(0)
  n_pages, page, d, slots, m = 12, 4, 8, 3, 3
  k_pages = rng.normal(size=(kv_heads, n_pages, page, d)).astype(np.float32)
  v_pages = rng.normal(size=(kv_heads, n_pages, page, d)).astype(np.float32)
  table = np.array([[3, 7, 0], [1, 2, 9], [5, 0, 0]], np.int32)
  lengths = np.array([6, 12, 1], np.int32)
  q = jnp.asarray(rng.normal(size=(slots, heads, d)).astype(np.float32))
  expected = _dense_reference(q, k_pages, v_pages, table, lengths)
  # Garbage everywhere a slot may not read: unowned pages and past each length.
  dirty_k, dirty_v = k_pages.copy(), v_pages.copy()
  owned = np.zeros((n_pages, page), bool)
  for s in range(slots):
    for pos in range(lengths[s]):
      owned[table[s, pos // page], pos % page] = True
  dirty_k[:, ~owned] = np.nan
  dirty_v[:, ~owned] = np.nan
  for kp, vp in ((k_pages, v_pages), (dirty_k, dirty_v)):
    got = attention.paged_attention_gather(
      q, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), jnp.asarray(lengths)
    )
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)
  assert m == table.shape[1]


def test_attend_pages_bounds_growth_with_few_variants():
  cfg = paged.SamplerConfig(
    num_slots=2, num_pages=64, page_size=4, max_prompt_len=64, max_new_tokens=64
  )
  m = cfg.max_pages_per_slot  # ceil(127 / 4) = 32
  seen = set()
  for held in range(m + 1):
    bound = paged.attend_pages([held, 0], 8, cfg)
    # 8 steps can add at most 2 pages (3 when starting mid-page).
    assert bound >= min(held + 3, m)
    seen.add(bound)
  assert len(seen) <= 4  # powers of two: 4, 8, 16, 32
  assert paged.attend_pages([], 8, cfg) >= 3


def test_unknown_attention_impl_is_refused():
  with pytest.raises(ValueError, match='attention_impl'):
    attention.resolve_impl('flash')
  with pytest.raises(ValueError, match="'pallas_gpu' needs a power-of-two `page_size`"):
    attention.resolve_impl('pallas_gpu', page_size=12, head_dim=64)


@pytest.mark.parametrize(
  'backend, page_size, head_dim, expected',
  [
    ('cpu', 16, 64, 'gather'),
    ('gpu', 16, 64, 'pallas_gpu'),
    ('gpu', 12, 64, 'gather'),  # Triton tiles are powers of two: the gather path
    ('gpu', 16, 80, 'gather'),
    ('tpu', 16, 64, 'pallas_tpu'),
  ],
)
def test_auto_picks_the_kernel_of_the_backend(backend, page_size, head_dim, expected):
  pick = functools.partial(attention.resolve_impl, 'auto', page_size, head_dim)
  assert pick(backend=backend, kv_dtype=jnp.bfloat16) == expected
  if backend == jax.default_backend():
    assert pick(kv_dtype=jnp.bfloat16) == expected
  # The TPU kernel reads keys and values as bfloat16: a float32 cache stays exact.
  assert pick(backend='tpu', kv_dtype=jnp.float32) == 'gather'


def _paged_case(rng, heads, kv_heads, d=8, page=4, n_pages=12):
  """Pools, a table of 4 slots (one idle: length 1 on the scratch page) and
  queries, with NaN wherever no slot may read."""
  k_pages = rng.normal(size=(kv_heads, n_pages, page, d)).astype(np.float32)
  v_pages = rng.normal(size=(kv_heads, n_pages, page, d)).astype(np.float32)
  table = np.array([[3, 7, 0, 0], [1, 2, 9, 4], [5, 0, 0, 0], [0, 0, 0, 0]], np.int32)
  lengths = np.array([6, 15, 1, 1], np.int32)
  q = rng.normal(size=(4, heads, d)).astype(np.float32)
  owned = np.zeros((n_pages, page), bool)
  for s in range(4):
    for pos in range(lengths[s]):
      owned[table[s, pos // page], pos % page] = True
  k_dirty, v_dirty = k_pages.copy(), v_pages.copy()
  k_dirty[:, ~owned] = np.nan
  v_dirty[:, ~owned] = np.nan
  return [jnp.asarray(x) for x in (q, k_pages, v_pages, table, lengths, k_dirty, v_dirty)]


@pytest.mark.parametrize('heads, kv_heads', [(4, 2), (6, 2), (4, 4)])
@pytest.mark.parametrize('scale, softcap', [(None, None), (0.3, 5.0)])
def test_gpu_kernel_equals_the_gather_path_in_interpret_mode(heads, kv_heads, scale, softcap):
  from jrl.sampler import kernels

  q, k_pages, v_pages, table, lengths, k_dirty, v_dirty = _paged_case(
    np.random.default_rng(heads + kv_heads), heads, kv_heads
  )
  opts = dict(scale=scale, softcap=softcap)
  want = attention.paged_attention_gather(q, k_pages, v_pages, table, lengths, **opts)
  for kp, vp in ((k_pages, v_pages), (k_dirty, v_dirty)):
    got = kernels.paged_attention_gpu(q, kp, vp, table, lengths, interpret=True, **opts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  # Through the dispatcher, as the decode step calls it.
  got = attention.paged_attention('pallas_gpu', q, k_pages, v_pages, table, lengths, **opts)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_tpu_kernel_equals_the_gather_path_in_interpret_mode():
  """JAX's TPU kernel, run in TPU interpret mode, on keys and values that
  bfloat16 holds exactly (the kernel reads them as bfloat16), with finite
  garbage where no slot may read (it does not zero masked values)."""
  from jax.experimental.pallas import tpu as pltpu

  rng = np.random.default_rng(1)
  q, k_pages, v_pages, table, lengths, k_dirty, v_dirty = _paged_case(rng, 4, 2)
  as_bf16 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  k_pages, v_pages = as_bf16(k_pages), as_bf16(v_pages)
  garbage = lambda clean, dirty: jnp.where(jnp.isnan(dirty), 1e4, clean)
  opts = dict(scale=0.3, softcap=5.0)
  want = attention.paged_attention_gather(q, k_pages, v_pages, table, lengths, **opts)
  with pltpu.force_tpu_interpret_mode():
    for kp, vp in ((k_pages, v_pages), (garbage(k_pages, k_dirty), garbage(v_pages, v_dirty))):
      got = attention.paged_attention('pallas_tpu', q, kp, vp, table, lengths, **opts)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


needs_cpu_kernel = pytest.mark.skipif(
  not cpu_kernel.available(), reason=f'no C++ compiler here: {cpu_kernel.unavailable_reason()}'
)


@needs_cpu_kernel
@pytest.mark.parametrize('heads, kv_heads', [(4, 2), (6, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize('scale, softcap', [(None, None), (0.3, None), (None, 5.0)])
def test_cpu_kernel_equals_the_gather_path(heads, kv_heads, scale, softcap):
  q, k_pages, v_pages, table, lengths, k_dirty, v_dirty = _paged_case(
    np.random.default_rng(heads * kv_heads), heads, kv_heads, d=64, page=16
  )
  opts = dict(scale=scale, softcap=softcap)
  want = attention.paged_attention_gather(q, k_pages, v_pages, table, lengths, **opts)
  for kp, vp in ((k_pages, v_pages), (k_dirty, v_dirty)):
    got = jax.jit(functools.partial(cpu_kernel.paged_attention_cpu, **opts))(
      q, kp, vp, table, lengths
    )
    assert np.all(np.isfinite(np.asarray(got)))  # NaN where no slot reads stays unread
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
  got = attention.paged_attention('cpu', q, k_pages, v_pages, table, lengths, **opts)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@needs_cpu_kernel
def test_cpu_kernel_on_empty_slots_bad_tables_and_replicas():
  """A slot of length 0 gets zeros as on the gather path; page ids outside
  the pool and lengths past the table are read as JAX's indexing reads
  them (negative ids from the end, the rest clamped: nothing outside the
  buffers); under vmap (the sampler's replica axis) each replica is its
  own call."""
  rng = np.random.default_rng(7)
  q, k_pages, v_pages, table, lengths, _, _ = _paged_case(rng, 4, 2)
  table = table.at[1, 3].set(10**6).at[2, 0].set(-5)
  lengths = lengths.at[3].set(0).at[1].set(10**6)
  want = attention.paged_attention_gather(q, k_pages, v_pages, table, lengths)
  got = cpu_kernel.paged_attention_cpu(q, k_pages, v_pages, table, lengths)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
  np.testing.assert_array_equal(np.asarray(got[3]), 0.0)
  stack = lambda x: jnp.stack([x, jnp.flip(x, 0)])
  qs, ts, ls = stack(q), stack(table), stack(lengths)
  got = jax.vmap(cpu_kernel.paged_attention_cpu, in_axes=(0, None, None, 0, 0))(
    qs, k_pages, v_pages, ts, ls
  )
  for r in range(2):
    want = attention.paged_attention_gather(qs[r], k_pages, v_pages, ts[r], ls[r])
    np.testing.assert_allclose(np.asarray(got[r]), np.asarray(want), rtol=1e-5, atol=2e-6)


@needs_cpu_kernel
def test_auto_takes_the_cpu_kernel_for_float32_only():
  pick = functools.partial(attention.resolve_impl, 'auto', 16, 64, backend='cpu')
  assert pick(kv_dtype=jnp.float32) == 'cpu'
  assert pick(kv_dtype=jnp.float32, q_dtype=jnp.bfloat16) == 'gather'
  with pytest.raises(ValueError, match="'cpu' needs float32 queries and pages"):
    attention.resolve_impl('cpu', 16, 64, kv_dtype=jnp.bfloat16)


def test_cpu_kernel_build_failure_is_reported_and_auto_falls_back(tmp_path, monkeypatch):
  """No working compiler: `available()` is False with the failing command
  and its output, 'auto' keeps the gather path, and asking for the kernel
  raises that reason."""
  monkeypatch.setenv('JRL_KERNEL_CACHE', str(tmp_path))  # nothing cached there
  monkeypatch.setenv('CXX', 'false')
  was_built = cpu_kernel.available()
  cpu_kernel._register.cache_clear()
  try:
    assert not cpu_kernel.available()
    assert cpu_kernel.unavailable_reason().startswith('false -O3')
    assert attention.resolve_impl('auto', 16, 64, backend='cpu', kv_dtype=jnp.float32) == 'gather'
    with pytest.raises(RuntimeError, match="attention_impl='cpu' needs jrl's CPU kernel"):
      cpu_kernel.paged_attention_cpu(*_paged_case(np.random.default_rng(0), 4, 2)[:5])
    assert not list(tmp_path.iterdir())  # no half-written library left behind
    monkeypatch.setenv('JRL_CPU_KERNEL', '0')
    cpu_kernel._register.cache_clear()
    assert not cpu_kernel.available() and cpu_kernel.unavailable_reason() == 'JRL_CPU_KERNEL=0'
  finally:
    monkeypatch.undo()
    cpu_kernel._register.cache_clear()
    assert cpu_kernel.available() == was_built


def test_gpu_kernel_lowers_to_triton_without_a_gpu():
  """The kernel as a GPU would compile it: lowered for CUDA on this machine
  (no device needed) it is one Triton call over the (slot, head) grid, in
  SmolLM2's head layout (9 query heads over 3 kv heads) with a bfloat16 cache."""
  from jrl.sampler import kernels

  s, h, k, d, n, p, m = 8, 9, 3, 64, 64, 16, 8
  shapes = (
    jax.ShapeDtypeStruct((s, h, d), jnp.float32),
    jax.ShapeDtypeStruct((k, n, p, d), jnp.bfloat16),
    jax.ShapeDtypeStruct((k, n, p, d), jnp.bfloat16),
    jax.ShapeDtypeStruct((s, m), jnp.int32),
    jax.ShapeDtypeStruct((s,), jnp.int32),
  )
  fn = jax.jit(functools.partial(kernels.paged_attention_gpu, interpret=False, softcap=30.0))
  text = fn.trace(*shapes).lower(lowering_platforms=('cuda',)).as_text()
  calls = [line for line in text.splitlines() if 'custom_call' in line]
  assert len(calls) == 1 and '__gpu$xla.gpu.triton' in calls[0]
  assert 'grid_x = 8 : i32, grid_y = 9 : i32' in calls[0]
  assert '-> tensor<8x9x64xf32>' in calls[0]
