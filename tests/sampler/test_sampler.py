"""Tests for jrl.sampler: the paged engine, the continuous-batching driver and
the per-slot sampling function.

Every claim is checked against an obvious implementation (STYLE.md point 14):
greedy decoding against a full-recompute decoder with no cache; logprobs
against the trainer's `next_token_logprobs` and a float64 NumPy transcription
of top-k / top-p; paged against the dense baseline; shared against unshared
prompt pages; continuous batching against one request at a time; a garbage-
filled pool against a clean one; a small pool against a large one; sharded
against single-device. The model is tiny (V 64, D 32, 2 layers, 4 query and 2
kv heads of width 8) with pages of 4 tokens, so prompts of 1 to 16 tokens
cross page boundaries often. Sampler objects are built once and reused (their
jitted functions are cached per object) and prompts are padded to one bucket,
so the file compiles a handful of programs only.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jrl.models as M
from jrl import parallel
from jrl.sampler import (
  Completion,
  EngineConfig,
  Request,
  Sampler,
  SamplingParams,
  baseline,
  default_buckets,
  engine,
  sample,
  to_rollout_batch,
)

# V vocab, D width, F MLP width, H query heads, K kv heads, d head width.
# init_std 0.1 makes logits spread enough (std ≈ 0.6) that greedy argmaxes are
# far from ties, yet flat enough that temperature-1 samples are diverse.
CFG = M.ModelConfig(
  vocab_size=64,
  width=32,
  mlp_width=64,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  init_std=0.1,
)
CFG_KV4 = CFG.replace(num_heads=8, num_kv_heads=4)  # kv heads split by a tensor axis of 4
KEY = jax.random.key(0)
PAGE = 4
MAX_PROMPT, MAX_NEW = 16, 12
WIDTH = MAX_PROMPT + MAX_NEW  # the one [R, WIDTH] shape of every reference forward
# 4 slots for 9 requests (continuous batching); 63 usable pages (never short).
ECFG = EngineConfig(
  num_slots=4, num_pages=64, page_size=PAGE, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW
)
STEPS = 3  # decode steps per dispatch: slots finish and refill between dispatches

# Shorter than a page (1, 3), whole pages (4, 8, 12, 16), several pages plus a
# partial one (5, 9, 11); per-request completion caps including 1.
PROMPT_LENS = (1, 3, 4, 8, 11, 16, 5, 12, 9)
MAX_NEWS = (12, 5, 1, 12, 7, 12, 3, 12, 9)

_logits = jax.jit(M.logits, static_argnums=0)
_logprobs = jax.jit(M.next_token_logprobs, static_argnums=0)


@functools.cache
def _model(cfg=CFG):
  return M.create(cfg, KEY)


@functools.cache
def _sampler(ecfg=ECFG, cfg=CFG, mesh_shape=None):
  """One Sampler per (engine config, model, mesh), built once per session."""
  if mesh_shape is None:
    return Sampler(_model(cfg)[0], cfg, ecfg, steps_per_dispatch=STEPS)
  graphdef, _ = _sharded_model(cfg, mesh_shape)
  mesh = parallel.make_mesh(*mesh_shape)
  return Sampler(graphdef, cfg, ecfg, steps_per_dispatch=STEPS, mesh=mesh)


@functools.cache
def _sharded_model(cfg, mesh_shape):
  return M.create_sharded(cfg, KEY, parallel.make_mesh(*mesh_shape))


def _prompts(lens=PROMPT_LENS, seed=0, vocab=CFG.vocab_size):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(0, vocab, n)] for n in lens]


# Per-request sampling settings, cycled over the requests of a batch.
MIXED = (
  {'temperature': 1.0},
  {'temperature': 0.7},
  {'temperature': 0.8, 'top_k': 5},
  {'temperature': 1.0, 'top_p': 0.7},
  {'temperature': 1.3, 'top_k': 8, 'top_p': 0.9},
  {'greedy': True, 'temperature': 0.0},  # temperature is ignored when greedy
)


def _requests(settings=({'temperature': 1.0},), seed=0, stop_tokens=(), lens=PROMPT_LENS):
  """One Request per prompt length, settings cycled, seed `seed`·100 + i."""
  return [
    Request(
      prompt=prompt,
      max_new_tokens=MAX_NEWS[i % len(MAX_NEWS)],
      stop_tokens=stop_tokens,
      seed=seed * 100 + i,
      **settings[i % len(settings)],
    )
    for i, prompt in enumerate(_prompts(lens))
  ]


def _flat(groups):
  return [c for group in groups for c in group]


def _assert_same(got, want, logp_atol=0.0):
  """Same tokens and finish reasons in the same [B][G] layout; logprobs close."""
  assert len(got) == len(want)
  for b, (g_row, w_row) in enumerate(zip(got, want, strict=True)):
    assert len(g_row) == len(w_row)
    for g, (c, w) in enumerate(zip(g_row, w_row, strict=True)):
      where = f'request {b} sample {g}'
      np.testing.assert_array_equal(c.tokens, w.tokens, err_msg=where)
      np.testing.assert_allclose(c.logprobs, w.logprobs, atol=logp_atol, rtol=0, err_msg=where)
      assert c.finish_reason == w.finish_reason, where


def _padded(rows):
  """Right-padded [R', WIDTH] int32 tokens and mask, R' a multiple of 8 (few shapes)."""
  r = max(8, 8 * math.ceil(len(rows) / 8))
  tokens = np.zeros((r, WIDTH), np.int32)
  mask = np.zeros((r, WIDTH), np.int32)
  for i, row in enumerate(rows):
    tokens[i, : len(row)] = row
    mask[i, : len(row)] = 1
  return jnp.asarray(tokens), jnp.asarray(mask)


def _reference_logits(params, requests, groups, graphdef=None):
  """For every completion (row b·G + g), the [n, V] full-recompute logits that
  scored its n tokens: position len(prompt) − 1 + t scores token t."""
  graphdef = _model()[0] if graphdef is None else graphdef
  rows, spans = [], []
  for r, group in zip(requests, groups, strict=True):
    for c in group:
      rows.append(list(r.prompt) + [int(t) for t in c.tokens])
      spans.append((len(r.prompt) - 1, len(c.tokens)))
  tokens, mask = _padded(rows)
  logits = np.asarray(_logits(graphdef, params, tokens, mask), np.float64)
  return [logits[i, s : s + n] for i, (s, n) in enumerate(spans)]


def _np_log_softmax(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _np_truncated(logits_V, temperature, top_k, top_p):
  """The kept set and the renormalised log-distribution, in float64, written
  from the definitions: top-k keeps logits ≥ the k-th largest; then top-p keeps
  the shortest descending prefix of the top-k set whose mass reaches p."""
  z = np.asarray(logits_V, np.float64) / temperature
  v = z.shape[0]
  keep = np.ones(v, bool)
  if top_k > 0:
    keep &= z >= np.sort(z)[::-1][min(top_k, v) - 1]
  if top_p < 1.0:
    probs = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    probs /= probs.sum()
    order = np.argsort(-probs, kind='stable')
    mass_before = np.cumsum(probs[order]) - probs[order]
    in_p = np.zeros(v, bool)
    in_p[order[mass_before < top_p]] = True
    in_p[order[0]] = True
    keep &= in_p
  logp = np.full(v, -np.inf)
  logp[keep] = _np_log_softmax(z[keep])
  return keep, logp


# ----------------------------------------------------------------------------
# 1. Greedy decoding equals a full-recompute decoder.
# ----------------------------------------------------------------------------


def _naive_greedy(params, prompt, max_new, stop_tokens=()):
  """No cache: the whole sequence through `jrl.models.logits` every step.

  The sequence is right-padded to WIDTH so that one shape compiles; the mask
  and the causal mask keep the padding out of every real position.

  Returns:
    (tokens, finish reason).
  """
  seq, out = list(prompt), []
  while len(out) < max_new:
    tokens, mask = _padded([seq])
    row = np.asarray(_logits(_model()[0], params, tokens, mask))[0, len(seq) - 1]
    top2 = np.sort(row)[-2:]
    assert top2[1] - top2[0] > 1e-4, 'greedy reference too close to a tie to be a test'
    tok = int(np.argmax(row))
    out.append(tok)
    seq.append(tok)
    if tok in stop_tokens:
      return out, 'stop'
  return out, 'length'


@functools.cache
def _greedy_case():
  """Greedy requests with stop tokens that end some completions (at the first
  token, in the middle, at the very last allowed token) and not others.

  Returns:
    (requests, expected (tokens, reason) per request, the same requests
    without stop tokens, their expected tokens).
  """
  _, params = _model()
  prompts = _prompts()
  free_requests = [
    Request(prompt=p, max_new_tokens=MAX_NEWS[i], greedy=True) for i, p in enumerate(prompts)
  ]
  free_runs = [_naive_greedy(params, r.prompt, r.max_new_tokens)[0] for r in free_requests]
  requests, expected = [], []
  for i, (r, run) in enumerate(zip(free_requests, free_runs, strict=True)):
    absent = [t for t in range(CFG.vocab_size) if t not in run][:2]
    if i % 3 == 0:  # no stop token in the run: ends by length
      stop = absent
    elif i % 3 == 1:  # a stop token somewhere in the run (possibly its first token)
      stop = [absent[0], run[(i // 3) * len(run) // 3]]
    else:  # the stop token is exactly the last allowed token (the only one for max_new 1)
      stop = [run[-1]]
    requests.append(dataclasses.replace(r, stop_tokens=tuple(stop)))
    expected.append(_naive_greedy(params, r.prompt, r.max_new_tokens, stop))
  return requests, expected, free_requests, free_runs


def test_greedy_matches_full_recompute_decoder():
  requests, expected, free_requests, free_runs = _greedy_case()
  reasons = [reason for _, reason in expected]
  # The workload is what the test claims: both finish reasons, stops that end
  # completions early, more requests than slots.
  assert 'stop' in reasons and 'length' in reasons
  pairs = list(zip(expected, requests, strict=True))
  assert any(r == 'stop' and len(t) < q.max_new_tokens for (t, r), q in pairs)
  assert any(r == 'stop' and q.max_new_tokens == 1 for (_, r), q in pairs)  # ends in insert
  assert len(requests) > ECFG.num_slots
  sampler = _sampler()
  _, params = _model()

  # Without stop tokens: every completion runs to its own max_new_tokens.
  groups = sampler.generate(params, free_requests)
  for i, (want, (c,)) in enumerate(zip(free_runs, groups, strict=True)):
    np.testing.assert_array_equal(c.tokens, want, err_msg=f'request {i}')
    assert c.finish_reason == 'length' and len(c.tokens) == MAX_NEWS[i]
  assert sampler.stats.generated_tokens == sum(MAX_NEWS)

  # With stop tokens.
  groups = sampler.generate(params, requests)
  assert [len(g) for g in groups] == [1] * len(requests)
  for i, ((want_tokens, want_reason), (c,)) in enumerate(zip(expected, groups, strict=True)):
    np.testing.assert_array_equal(c.tokens, want_tokens, err_msg=f'request {i}')
    assert c.tokens.dtype == np.int32 and c.logprobs.shape == c.tokens.shape
    assert c.finish_reason == want_reason, f'request {i}'
    if want_reason == 'stop':
      assert int(c.tokens[-1]) in requests[i].stop_tokens  # the stop token is included
      assert not set(c.tokens[:-1].tolist()) & set(requests[i].stop_tokens)
    else:
      assert len(c.tokens) == requests[i].max_new_tokens
  assert sampler.stats.prefills == len(requests)
  assert sampler.stats.generated_tokens == sum(len(t) for t, _ in expected)


# ----------------------------------------------------------------------------
# 2. Zero rollout / train mismatch.
# ----------------------------------------------------------------------------


def _trainer_logprobs(params, requests, groups, temperature):
  """`next_token_logprobs` of prompt + completion, at the completion tokens."""
  rows, spans = [], []
  for r, group in zip(requests, groups, strict=True):
    for c in group:
      rows.append(list(r.prompt) + [int(t) for t in c.tokens])
      spans.append((len(r.prompt), len(c.tokens)))
  tokens, mask = _padded(rows)
  logp, _ = _logprobs(_model()[0], params, tokens, mask, temperature=temperature)
  logp = np.asarray(logp)
  return [logp[i, s : s + n] for i, (s, n) in enumerate(spans)]


def test_greedy_logprobs_equal_trainer_logprobs():
  _, _, requests, _ = _greedy_case()
  _, params = _model()
  groups = _sampler().generate(params, requests)
  want = _trainer_logprobs(params, requests, groups, temperature=1.0)
  for i, (c, w) in enumerate(zip(_flat(groups), want, strict=True)):
    assert c.logprobs.dtype == np.float32
    np.testing.assert_allclose(c.logprobs, w, atol=1e-5, rtol=0, err_msg=f'request {i}')
    assert np.all(c.logprobs < 0)


@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_sampled_logprobs_equal_trainer_logprobs(temperature):
  _, params = _model()
  requests = _requests(({'temperature': temperature},), seed=3)
  groups = _sampler().generate(params, requests, group_size=4)
  want = _trainer_logprobs(params, requests, groups, temperature=temperature)
  for i, (c, w) in enumerate(zip(_flat(groups), want, strict=True)):
    np.testing.assert_allclose(c.logprobs, w, atol=1e-5, rtol=0, err_msg=f'row {i}')
  # Not the temperature-1 logprobs (the temperature is really applied).
  if temperature != 1.0:
    plain = _trainer_logprobs(params, requests, groups, temperature=1.0)
    gap = max(np.abs(c.logprobs - w).max() for c, w in zip(_flat(groups), plain, strict=True))
    assert gap > 1e-2


TRUNCATED = (
  {'temperature': 0.8, 'top_k': 5},
  {'temperature': 1.0, 'top_p': 0.7},
  {'temperature': 1.3, 'top_k': 8, 'top_p': 0.9},
  {'temperature': 1.0, 'top_k': 1},
  {'temperature': 2.0, 'top_p': 0.3},
)


def test_top_k_top_p_logprobs_are_renormalised_truncated_distribution():
  _, params = _model()
  requests = _requests(TRUNCATED, seed=5)
  groups = _sampler().generate(params, requests, group_size=4)
  logits = _reference_logits(params, requests, groups)
  rows = [(r, c) for r, group in zip(requests, groups, strict=True) for c in group]
  truncation_mattered = 0
  for i, ((r, c), logits_nxV) in enumerate(zip(rows, logits, strict=True)):
    for t, tok in enumerate(c.tokens):
      keep, logp = _np_truncated(logits_nxV[t], r.temperature, r.top_k, r.top_p)
      where = f'row {i} token {t}'
      assert keep[tok], f'{where}: token {tok} outside the top-k / top-p set'
      if r.top_k:
        assert 1 <= keep.sum() <= r.top_k, where
      np.testing.assert_allclose(c.logprobs[t], logp[tok], atol=1e-5, rtol=0, err_msg=where)
      full = _np_log_softmax(logits_nxV[t] / r.temperature)[tok]
      truncation_mattered += c.logprobs[t] > full + 1e-3
  assert truncation_mattered > 20
  # top_k = 1 is greedy in disguise: the argmax, with log-probability 0.
  k1 = [c for r, group in zip(requests, groups, strict=True) if r.top_k == 1 for c in group]
  np.testing.assert_allclose(np.concatenate([c.logprobs for c in k1]), 0.0, atol=1e-6)


def test_sample_by_hand():
  logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0]] * 5, jnp.float32)
  # probs [.032, .087, .237, .644]: top_p .7 keeps {3, 2}; .6 keeps {3}; top_k 2 keeps {3, 2}.
  params = SamplingParams(
    temperature=jnp.asarray([1.0, 1.0, 1.0, 2.0, 5.0], jnp.float32),
    top_k=jnp.asarray([2, 0, 0, 0, 0], jnp.int32),
    top_p=jnp.asarray([1.0, 0.7, 0.6, 1.0, 1.0], jnp.float32),
    greedy=jnp.asarray([False, False, False, False, True]),
  )
  keys = jax.random.split(jax.random.key(1), (400, 5))
  tokens, logp = jax.jit(jax.vmap(sample, in_axes=(None, 0, None)))(logits, keys, params)
  tokens, logp = np.asarray(tokens), np.asarray(logp)
  lse = lambda xs: np.log(np.sum(np.exp(xs)))
  assert set(tokens[:, 0]) == {2, 3}
  np.testing.assert_allclose(logp[tokens[:, 0] == 3, 0], 3 - lse([2.0, 3.0]), rtol=1e-6)
  np.testing.assert_allclose(logp[tokens[:, 0] == 2, 0], 2 - lse([2.0, 3.0]), rtol=1e-6)
  assert set(tokens[:, 1]) == {2, 3}
  np.testing.assert_allclose(logp[tokens[:, 1] == 2, 1], 2 - lse([2.0, 3.0]), rtol=1e-6)
  np.testing.assert_allclose(logp[tokens[:, 2] == 3, 2], 0.0, atol=1e-6)
  assert set(tokens[:, 2]) == {3}
  assert set(tokens[:, 3]) == {0, 1, 2, 3}  # temperature 2, no truncation
  z = np.asarray([0.0, 1.0, 2.0, 3.0]) / 2
  np.testing.assert_allclose(logp[:, 3], _np_log_softmax(z)[tokens[:, 3]], rtol=1e-5)
  # Greedy ignores the temperature: argmax, scored at temperature 1.
  assert set(tokens[:, 4]) == {3}
  np.testing.assert_allclose(logp[:, 4], _np_log_softmax(np.arange(4.0))[3], rtol=1e-6)
  # Frequencies follow the renormalised distribution (top_k 2: p(3) = .731).
  assert 0.65 < np.mean(tokens[:, 0] == 3) < 0.81


# ----------------------------------------------------------------------------
# 3. Prompt sharing, continuous batching, seeds.
# ----------------------------------------------------------------------------


@functools.cache
def _group_run(seed=7):
  """G = 4 samples at temperature 1 (mixed truncation) from every prompt."""
  requests = _requests(MIXED[:5], seed=seed)
  return requests, _sampler().generate(_model()[1], requests, group_size=4)


def test_prompt_sharing_on_and_off_agree():
  requests, shared = _group_run()
  sampler = _sampler()
  unshared = sampler.generate(_model()[1], requests, group_size=4, share_prompt=False)
  assert sampler.stats.prefills == 4 * len(requests)
  _assert_same(unshared, shared, logp_atol=1e-6)


def test_group_samples_differ_and_seeds_reproduce():
  requests, first = _group_run()
  _, params = _model()
  again = _sampler().generate(params, requests, group_size=4)
  _assert_same(again, first)
  for b, group in enumerate(first):
    if requests[b].max_new_tokens < 3:
      continue
    seqs = {tuple(c.tokens.tolist()) for c in group}
    assert len(seqs) == 4, f'request {b}: the G samples coincide'
  other = _sampler().generate(
    params, [dataclasses.replace(r, seed=r.seed + 1) for r in requests], group_size=4
  )
  for b, (g_new, g_old) in enumerate(zip(other, first, strict=True)):
    if requests[b].max_new_tokens < 3:
      continue
    assert any(not np.array_equal(a.tokens, o.tokens) for a, o in zip(g_new, g_old, strict=True)), (
      f'request {b}: another seed gave the same samples'
    )


def test_continuous_batching_equals_one_request_at_a_time():
  _, params = _model()
  requests = _requests(MIXED, seed=11, stop_tokens=(5, 17, 40))
  together = _sampler().generate(params, requests)
  reasons = {c.finish_reason for c in _flat(together)}
  assert reasons == {'stop', 'length'}
  alone = [_sampler().generate(params, [r])[0] for r in requests]
  _assert_same(alone, together, logp_atol=1e-6)
  one_slot = _sampler(ECFG._replace(num_slots=1))
  _assert_same(one_slot.generate(params, requests), together, logp_atol=1e-6)
  assert one_slot.stats.dispatches >= len(requests)


# ----------------------------------------------------------------------------
# 4. Isolation: garbage in pages a slot does not hold changes nothing.
# ----------------------------------------------------------------------------


def _poison(state, value):
  """Overwrites every page not held by an active slot (page 0 included) with `value`."""
  st = jax.device_get(state)
  held = np.zeros(st.refcount.shape[0], bool)
  for s in np.flatnonzero(st.active):
    held[st.page_table[s, : st.num_pages[s]]] = True
  assert not held[0]
  fill = lambda pages: np.where(held[None, :, None, None], pages, np.float32(value))
  st = st._replace(
    k_pages=tuple(fill(k) for k in st.k_pages), v_pages=tuple(fill(v) for v in st.v_pages)
  )
  return jax.tree.map(jnp.asarray, st)


@pytest.mark.parametrize('value', [np.nan, 1e30])
def test_garbage_in_unheld_pages_changes_nothing(monkeypatch, value):
  _, params = _model()
  sampler = _sampler()
  greedy_requests = _greedy_case()[2]
  clean_greedy = sampler.generate(params, greedy_requests)
  group_requests, clean_groups = _group_run()

  calls = []
  original_free, original_insert = sampler._free, sampler._insert

  def free(state, mask):
    calls.append('free')
    return _poison(original_free(state, mask), value)

  def insert(state, *args):
    # Poisoned before the insert (its new pages are dirty) and after it (the
    # pages not yet grown into are dirty for the next dispatch).
    return _poison(original_insert(_poison(state, value), *args), value)

  monkeypatch.setattr(sampler, '_free', free)
  monkeypatch.setattr(sampler, '_insert', insert)
  dirty = _poison(sampler.init_state(), value)
  dirty_greedy = sampler.generate(params, greedy_requests, state=dirty)
  assert calls.count('free') >= 3  # frees happened, and the freed pages were reused dirty
  _assert_same(dirty_greedy, clean_greedy)
  dirty_groups = sampler.generate(
    params, group_requests, group_size=4, state=_poison(sampler.init_state(), value)
  )
  _assert_same(dirty_groups, clean_groups)
  for c in _flat(dirty_groups):
    assert np.all(np.isfinite(c.logprobs))


def _snapshot(state):
  return jax.device_get(state)


def test_engine_page_accounting():
  """Drives the engine's jitted steps by hand: sharing, growth, free, reuse."""
  sampler = _sampler()
  _, params = _model()
  cfg = sampler.cfg
  n_pages = cfg.num_pages
  prompt = _prompts((9,), seed=2)[0]  # two full pages + one partial
  tokens = np.zeros(MAX_PROMPT, np.int32)
  tokens[:9] = prompt
  state = sampler.init_state()
  st = _snapshot(state)
  assert int(st.free_top) == n_pages - 1 and not st.refcount.any()
  assert sorted(st.free_stack[: n_pages - 1].tolist()) == list(range(1, n_pages))

  prefix = sampler._prefill(params, jnp.asarray(tokens), jnp.int32(9))
  request = sampler._slot_request(Request(prompt=prompt, max_new_tokens=12, seed=1), (0, 1, 2, 3))
  state = sampler._insert(state, prefix, jnp.arange(4, dtype=jnp.int32), request)
  st = _snapshot(state)
  shared = st.page_table[0, :2]
  private = st.page_table[:, 2]
  assert np.all(st.page_table[:, :2] == shared)  # every slot points at the same prompt pages
  assert len(set(private.tolist())) == 4 and not set(private.tolist()) & set(shared.tolist())
  assert 0 not in shared and 0 not in private
  assert np.all(st.page_table[:, 3:] == 0)
  assert np.all(st.refcount[shared] == 4) and np.all(st.refcount[private] == 1)
  assert int(st.refcount.sum()) == 2 * 4 + 4 and st.refcount[0] == 0
  assert int(st.free_top) == n_pages - 1 - 6
  np.testing.assert_array_equal(st.num_pages, [3, 3, 3, 3])
  np.testing.assert_array_equal(st.lengths, [9, 9, 9, 9])

  # Two dispatches (6 tokens): positions 9..14, so each slot grows one page.
  state = sampler._generate(params, state, num_steps=STEPS)
  state = sampler._generate(params, state, num_steps=STEPS)
  st = _snapshot(state)
  np.testing.assert_array_equal(st.lengths, [15] * 4)
  np.testing.assert_array_equal(st.num_pages, [4] * 4)
  grown = st.page_table[:, 3]
  assert len(set(grown.tolist()) | set(private.tolist()) | set(shared.tolist())) == 10
  assert np.all(st.refcount[grown] == 1) and int(st.free_top) == n_pages - 1 - 10
  assert not st.done.any()

  def free(state, slots):
    mask = np.zeros(cfg.num_slots, bool)
    mask[list(slots)] = True
    return sampler._free(state, jnp.asarray(mask))

  top_before = int(st.free_top)
  state = free(state, [0])
  st = _snapshot(state)
  mine = {int(private[0]), int(grown[0])}
  assert int(st.free_top) == top_before + 2
  assert set(st.free_stack[top_before : top_before + 2].tolist()) == mine
  assert np.all(st.refcount[list(mine)] == 0)
  assert np.all(st.refcount[shared] == 3)  # still held by slots 1..3
  assert np.all(st.page_table[0] == 0) and st.num_pages[0] == 0 and not st.active[0]
  assert st.active[1:].all()

  state = free(state, [1, 2])
  st = _snapshot(state)
  assert np.all(st.refcount[shared] == 1)
  assert not set(st.free_stack[: st.free_top].tolist()) & set(shared.tolist())
  assert int(st.free_top) == top_before + 6

  state = free(state, [3])
  st = _snapshot(state)
  assert int(st.free_top) == n_pages - 1
  assert not st.refcount.any()
  assert sorted(st.free_stack[: n_pages - 1].tolist()) == list(range(1, n_pages))
  assert not st.page_table.any() and not st.num_pages.any() and not st.active.any()


def test_state_is_clean_after_generate():
  sampler = _sampler()
  sampler.generate(_model()[1], _group_run()[0], group_size=4)
  st = jax.device_get(sampler.last_state)
  assert int(st.free_top) == sampler.cfg.num_pages - 1
  assert not st.refcount.any() and not st.page_table.any() and not st.active.any()
  assert sorted(st.free_stack[: sampler.cfg.num_pages - 1].tolist()) == list(
    range(1, sampler.cfg.num_pages)
  )


# ----------------------------------------------------------------------------
# 5. A pool smaller than the workload.
# ----------------------------------------------------------------------------

# 8 slots (two groups of 4 fit by slots), 16 usable pages: exactly one worst-case
# group (prompt 16, 12 new tokens: 4 shared + 4 × 3 private pages).
SMALL = ECFG._replace(num_slots=8, num_pages=17)


def test_small_pool_completes_every_request():
  requests, want = _group_run()
  assert engine.pages_needed(16, 12, 4, PAGE) == SMALL.num_pages - 1
  demand = sum(engine.pages_needed(len(r.prompt), r.max_new_tokens, 4, PAGE) for r in requests)
  assert demand > 3 * (SMALL.num_pages - 1)
  sampler = _sampler(SMALL)
  got = sampler.generate(_model()[1], requests, group_size=4)
  _assert_same(got, want, logp_atol=1e-6)
  # Never more than the pool; exactly the pool while the prompt-16 group runs
  # (its 4 samples have no stop token and all reach 12 tokens).
  assert sampler.stats.peak_pages == SMALL.num_pages - 1
  st = jax.device_get(sampler.last_state)
  assert int(st.free_top) == SMALL.num_pages - 1 and not st.refcount.any()


def test_request_larger_than_pool_is_refused():
  sampler = _sampler(SMALL)
  big = Request(prompt=_prompts((16,))[0], max_new_tokens=12)
  with pytest.raises(ValueError, match='num_pages'):
    sampler.generate(_model()[1], [big], group_size=5)
  # One sample needs 7 pages (4 prompt + 3 completion): 6 usable pages are too few.
  assert engine.pages_needed(16, 12, 1, PAGE) == 7
  tight = Sampler(_model()[0], CFG, ECFG._replace(num_pages=7))
  with pytest.raises(ValueError, match='num_pages'):
    tight.generate(_model()[1], [Request(prompt=[1, 2], max_new_tokens=2), big])


# ----------------------------------------------------------------------------
# 6. Sharded sampling equals single-device sampling.
# ----------------------------------------------------------------------------

# name: (mesh (data, fsdp, tensor), model config, kv pool split over `tensor`).
MESHES = {
  'fsdp8': ((1, 8, 1), CFG, False),
  'fsdp2_tensor4': ((1, 2, 4), CFG_KV4, True),
  'all2': ((2, 2, 2), CFG, True),
}


@pytest.mark.parametrize('name', sorted(MESHES))
def test_sharded_sampling_matches_single_device(name):
  mesh_shape, cfg, pool_split = MESHES[name]
  _, sparams = _sharded_model(cfg, mesh_shape)
  host = jax.device_get(sparams)
  assert any(any(a is not None for a in leaf.sharding.spec) for leaf in jax.tree.leaves(sparams)), (
    'params are not sharded: the test would compare nothing'
  )
  # The reference: the very same values, on one device.
  single = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), host)
  requests = _requests(MIXED, seed=13, stop_tokens=(3, 30), lens=PROMPT_LENS[:6])
  want = _sampler(ECFG, cfg).generate(single, requests, group_size=2)

  sampler = _sampler(ECFG, cfg, mesh_shape)
  pool = sampler.init_state().k_pages[0]
  assert pool.sharding.spec == (P('tensor') if pool_split else P())
  got = sampler.generate(sparams, requests, group_size=2)
  _assert_same(got, want, logp_atol=1e-5)

  # The params are the caller's: neither donated nor changed.
  for leaf, before in zip(jax.tree.leaves(sparams), jax.tree.leaves(host), strict=True):
    assert not leaf.is_deleted()
    np.testing.assert_array_equal(np.asarray(leaf), before)
  _assert_same(sampler.generate(sparams, requests, group_size=2), want, logp_atol=1e-5)


def test_single_device_params_not_donated():
  graphdef, params = _model()
  before = jax.device_get(params)
  _sampler().generate(params, _greedy_case()[2])
  for leaf, want in zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True):
    assert not leaf.is_deleted()
    np.testing.assert_array_equal(np.asarray(leaf), want)
  # Still usable by the trainer.
  assert np.isfinite(np.asarray(_logits(graphdef, params, *_padded([[1, 2, 3]])))).all()


# ----------------------------------------------------------------------------
# 7. Layout, buckets, input checks.
# ----------------------------------------------------------------------------


def test_to_rollout_batch_layout():
  c = lambda toks, reason: Completion(
    np.asarray(toks, np.int32), -0.5 * np.arange(1, len(toks) + 1, dtype=np.float32), reason
  )
  groups = [
    [c([7, 8, 9], 'stop'), c([1], 'length')],
    [c([4, 5], 'stop'), c([6, 6, 6, 6], 'length')],
  ]
  batch = to_rollout_batch(groups, 5)
  np.testing.assert_array_equal(
    batch.tokens, [[7, 8, 9, 0, 0], [1, 0, 0, 0, 0], [4, 5, 0, 0, 0], [6, 6, 6, 6, 0]]
  )
  np.testing.assert_array_equal(batch.mask, batch.tokens > 0)
  np.testing.assert_allclose(
    batch.logprobs,
    [
      [-0.5, -1.0, -1.5, 0, 0],
      [-0.5, 0, 0, 0, 0],
      [-0.5, -1.0, 0, 0, 0],
      [-0.5, -1.0, -1.5, -2.0, 0],
    ],
  )
  assert batch.finish_reason == ['stop', 'length', 'stop', 'length']
  assert batch.tokens.dtype == np.int32 and batch.logprobs.dtype == np.float32
  assert batch.mask.dtype == bool

  # On real output: row b·G + g is sample g of prompt b.
  requests, groups = _group_run()
  batch = to_rollout_batch(groups, MAX_NEW)
  assert batch.tokens.shape == (4 * len(requests), MAX_NEW)
  for b, group in enumerate(groups):
    for g, comp in enumerate(group):
      n = len(comp.tokens)
      np.testing.assert_array_equal(batch.tokens[4 * b + g, :n], comp.tokens)
      assert batch.mask[4 * b + g].sum() == n and not batch.tokens[4 * b + g, n:].any()
      assert not batch.logprobs[4 * b + g, n:].any()


def test_default_buckets():
  assert default_buckets(16) == (16,)
  assert default_buckets(8) == (8,)
  assert default_buckets(32) == (16, 32)
  assert default_buckets(100) == (16, 32, 64, 100)
  assert default_buckets(20, smallest=4) == (4, 8, 16, 20)
  sampler = Sampler(_model()[0], CFG, ECFG, prefill_buckets=(4, 16))
  assert [sampler.bucket(n) for n in (1, 4, 5, 16)] == [4, 4, 16, 16]
  with pytest.raises(ValueError, match='max_prompt_len'):
    sampler.bucket(17)


@pytest.mark.parametrize(
  'request_, group_size, field',
  [
    (Request(prompt=[1] * 17, max_new_tokens=4), 1, 'max_prompt_len'),
    (Request(prompt=[], max_new_tokens=4), 1, 'prompt length'),
    (Request(prompt=[1, 64], max_new_tokens=4), 1, 'prompt token ids'),
    (Request(prompt=[-1, 2], max_new_tokens=4), 1, 'prompt token ids'),
    (Request(prompt=[1], max_new_tokens=0), 1, 'max_new_tokens'),
    (Request(prompt=[1], max_new_tokens=MAX_NEW + 1), 1, 'max_new_tokens'),
    (Request(prompt=[1], max_new_tokens=4, stop_tokens=(1, 2, 3, 4, 5)), 1, 'max_stop_tokens'),
    (Request(prompt=[1], max_new_tokens=4, temperature=0.0), 1, 'temperature'),
    (Request(prompt=[1], max_new_tokens=4, temperature=-1.0), 1, 'temperature'),
    (Request(prompt=[1], max_new_tokens=4, top_p=0.0), 1, 'top_p'),
    (Request(prompt=[1], max_new_tokens=4, top_k=-1), 1, 'top_k'),
    (Request(prompt=[1], max_new_tokens=4), ECFG.num_slots + 1, 'num_slots'),
    (Request(prompt=[1], max_new_tokens=4), 0, 'group_size'),
  ],
)
def test_bad_requests_are_refused(request_, group_size, field):
  with pytest.raises(ValueError, match=field):
    good = Request(prompt=[1], max_new_tokens=2)
    _sampler().generate(_model()[1], [good, request_], group_size=group_size)


def test_bad_engine_config_is_refused():
  graphdef, _ = _model()
  for field, change in [
    ('num_pages', {'num_pages': 1}),
    ('attention_impl', {'attention_impl': 'flash'}),
    ('page_size', {'page_size': 0}),
    ('num_slots', {'num_slots': 0}),
  ]:
    bad = ECFG._replace(**change)
    with pytest.raises(ValueError, match=field):
      bad.validate()
    with pytest.raises(ValueError, match=field):
      engine.init_state(CFG, bad)
    with pytest.raises(ValueError, match=field):
      Sampler(graphdef, CFG, bad)
  with pytest.raises(ValueError, match='steps_per_dispatch'):
    Sampler(graphdef, CFG, ECFG, steps_per_dispatch=0)
  with pytest.raises(ValueError, match='prefill_buckets'):
    Sampler(graphdef, CFG, ECFG, prefill_buckets=(4, 8))


# ----------------------------------------------------------------------------
# 8. The dense baseline.
# ----------------------------------------------------------------------------


def test_paged_equals_dense_baseline():
  graphdef, params = _model()
  requests = _requests(MIXED, seed=17, stop_tokens=(9, 33, 50))
  paged = _flat(_sampler().generate(params, requests, group_size=2))
  dense = baseline.dense_generate(graphdef, params, CFG, requests, 2, MAX_NEW)
  assert dense.tokens.shape == (2 * len(requests), MAX_NEW)
  assert {c.finish_reason for c in paged} == {'stop', 'length'}
  for row, c in enumerate(paged):
    n = int(dense.mask[row].sum())
    assert len(c.tokens) == n, f'row {row}'
    np.testing.assert_array_equal(c.tokens, dense.tokens[row, :n], err_msg=f'row {row}')
    np.testing.assert_allclose(
      c.logprobs, dense.logprobs[row, :n], atol=1e-5, rtol=0, err_msg=f'row {row}'
    )
