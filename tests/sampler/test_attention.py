"""Paged attention (gather path) against the model's dense attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models.attention import dot_attention
from jrl.sampler import attention, engine


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
  cfg = engine.EngineConfig(
    num_slots=2, num_pages=64, page_size=4, max_prompt_len=64, max_new_tokens=64
  )
  m = cfg.max_pages_per_slot  # ceil(127 / 4) = 32
  seen = set()
  for held in range(m + 1):
    bound = engine.attend_pages([held, 0], 8, cfg)
    # 8 steps can add at most 2 pages (3 when starting mid-page).
    assert bound >= min(held + 3, m)
    seen.add(bound)
  assert len(seen) <= 4  # powers of two: 4, 8, 16, 32
  assert engine.attend_pages([], 8, cfg) >= 3


def test_unknown_attention_impl_is_refused():
  with pytest.raises(ValueError, match='attention_impl'):
    attention.resolve_impl('flash')
  expected = 'pallas' if jax.default_backend() == 'tpu' else 'gather'
  assert attention.resolve_impl('auto') == expected
