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
from jrl import parallel, trace
from jrl.sampler import (
  Request,
  Sampler,
  SamplerConfig,
  SamplingParams,
  baseline,
  default_buckets,
  paged,
  sample,
)
from tests.sampler import margins

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
KEY = jax.random.key(0)
PAGE = 4
MAX_PROMPT, MAX_NEW = 16, 12
WIDTH = MAX_PROMPT + MAX_NEW  # the one [R, WIDTH] shape of every reference forward
# 4 slots for 9 requests (continuous batching); 63 usable pages (never short).
ECFG = SamplerConfig(
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


def _assert_same(got, want, logp_atol=0.0, requests=None, params=None, graphdef=None):
  """Same tokens and finish reasons in the same [B][G] layout; logprobs close.

  Without `requests` the two runs come from one program (a rerun, a dirty
  pool) and must agree bitwise. With them the runs come from programs of
  different shapes, whose logits agree to float rounding only: each sample
  is compared up to its first draw whose margin rounding can cross
  (`margins.first_fragile` on the full-recompute logits of `want` under
  `params`), and must agree exactly there; at most a quarter of all tokens
  may lie past such a draw (else the settings make a poor test).
  """
  assert len(got) == len(want)
  upto = None if requests is None else _fragile(want, requests, params, graphdef)
  compared = total = 0
  for b, (g_row, w_row) in enumerate(zip(got, want, strict=True)):
    assert len(g_row) == len(w_row)
    for g, (c, w) in enumerate(zip(g_row, w_row, strict=True)):
      where = f'request {b} sample {g}'
      n = len(w.tokens) if upto is None else upto[b][g]
      total += len(w.tokens)
      compared += n
      if n < len(w.tokens):  # a fragile draw at n: the prefix before it must agree
        np.testing.assert_array_equal(c.tokens[:n], w.tokens[:n], err_msg=where)
        np.testing.assert_allclose(
          c.logprobs[:n], w.logprobs[:n], atol=logp_atol, rtol=0, err_msg=where
        )
        continue
      np.testing.assert_array_equal(c.tokens, w.tokens, err_msg=where)
      np.testing.assert_allclose(c.logprobs, w.logprobs, atol=logp_atol, rtol=0, err_msg=where)
      assert c.finish_reason == w.finish_reason, where
  assert compared >= 0.75 * total, f'only {compared} of {total} tokens before a fragile draw'


def _fragile(groups, requests, params=None, graphdef=None):
  """[B][G] index of each sample's first fragile draw (its length if none)."""
  params = _model()[1] if params is None else params
  logits = iter(_reference_logits(params, requests, groups, graphdef))
  return [
    [margins.first_fragile(next(logits), c.tokens, r, g) for g, c in enumerate(group)]
    for r, group in zip(requests, groups, strict=True)
  ]


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
  _assert_same(unshared, shared, logp_atol=1e-6, requests=requests)


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
  _assert_same(alone, together, logp_atol=1e-6, requests=requests)
  one_slot = _sampler(ECFG._replace(num_slots=1))
  _assert_same(one_slot.generate(params, requests), together, logp_atol=1e-6, requests=requests)
  assert one_slot.stats.dispatches >= len(requests)


# ----------------------------------------------------------------------------
# 4. Isolation: garbage in pages a slot does not hold changes nothing.
# ----------------------------------------------------------------------------


def _poison(state, value):
  """Overwrites every page not held by an active slot (page 0 included) with
  `value`, in every replica (state fields have a leading [R] axis)."""
  st = jax.device_get(state)
  r, n = st.refcount.shape
  held = np.zeros((r, n), bool)
  for k in range(r):
    for s in np.flatnonzero(st.active[k]):
      held[k, st.page_table[k, s, : st.num_pages[k, s]]] = True
  assert not held[:, 0].any()
  fill = lambda pages: np.where(held[:, None, :, None, None], pages, np.float32(value))
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
  original_free, original_admit = sampler._free, sampler._admit

  def free(state, mask):
    calls.append('free')
    return _poison(original_free(state, mask), value)

  def admit(params, state, *args, **kwargs):
    # Poisoned before the insert (its new pages are dirty) and after it (the
    # pages not yet grown into are dirty for the next dispatch).
    return _poison(original_admit(params, _poison(state, value), *args, **kwargs), value)

  monkeypatch.setattr(sampler, '_free', free)
  monkeypatch.setattr(sampler, '_admit', admit)
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


@functools.cache
def _engine_steps(ecfg=ECFG):
  """The engine's steps on one replica (no [R] axis), jitted as the driver does."""
  graphdef = _model()[0]
  generate = jax.jit(
    functools.partial(paged.generate, graphdef, cfg=ecfg), static_argnames=('num_steps',)
  )
  return (
    jax.jit(functools.partial(paged.init_state, CFG, ecfg)),
    jax.jit(functools.partial(paged.prefill, graphdef)),
    jax.jit(functools.partial(paged.insert, cfg=ecfg)),
    generate,
    jax.jit(paged.free),
  )


def test_engine_page_accounting():
  """Drives the engine's jitted steps by hand: sharing, growth, free, reuse."""
  sampler = _sampler()
  _, params = _model()
  cfg = sampler.cfg
  init, prefill, insert, generate, free_step = _engine_steps()
  n_pages = cfg.num_pages
  prompt = _prompts((9,), seed=2)[0]  # two full pages + one partial
  tokens = np.zeros(MAX_PROMPT, np.int32)
  tokens[:9] = prompt
  state = init()
  st = _snapshot(state)
  assert int(st.free_top) == n_pages - 1 and not st.refcount.any()
  assert sorted(st.free_stack[: n_pages - 1].tolist()) == list(range(1, n_pages))

  prefix = prefill(params, jnp.asarray(tokens), jnp.int32(9))
  request = sampler._slot_request(Request(prompt=prompt, max_new_tokens=12, seed=1), (0, 1, 2, 3))
  state = insert(state, prefix, jnp.arange(4, dtype=jnp.int32), request)
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
  state = generate(params, state, num_steps=STEPS)
  state = generate(params, state, num_steps=STEPS)
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
    return free_step(state, jnp.asarray(mask))

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


def test_state_is_clean_after_generate(monkeypatch):
  sampler = _sampler()
  states = []  # the state after each release of finished slots: the last is the final one
  free = sampler._free

  def keep(st, mask):
    states.append(free(st, mask))
    return states[-1]

  monkeypatch.setattr(sampler, '_free', keep)
  sampler.generate(_model()[1], _group_run()[0], group_size=4)
  st = jax.tree.map(lambda x: x[0], jax.device_get(states[-1]))  # the one replica
  assert sampler.stats.pages_free_at_end == int(st.free_top)
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
  assert paged.pages_needed(16, 12, 4, PAGE) == SMALL.num_pages - 1
  demand = sum(paged.pages_needed(len(r.prompt), r.max_new_tokens, 4, PAGE) for r in requests)
  assert demand > 3 * (SMALL.num_pages - 1)
  sampler = _sampler(SMALL)
  got = sampler.generate(_model()[1], requests, group_size=4)
  _assert_same(got, want, logp_atol=1e-6, requests=requests)
  # Never more than the pool; exactly the pool while the prompt-16 group runs
  # (its 4 samples have no stop token and all reach 12 tokens).
  assert sampler.stats.peak_pages == SMALL.num_pages - 1
  st = sampler.stats
  assert st.pages_free_at_end == SMALL.num_pages - 1 and st.pages_referenced_at_end == 0


def test_request_larger_than_pool_is_refused():
  sampler = _sampler(SMALL)
  big = Request(prompt=_prompts((16,))[0], max_new_tokens=12)
  with pytest.raises(ValueError, match='num_pages'):
    sampler.generate(_model()[1], [big], group_size=5)
  # One sample needs 7 pages (4 prompt + 3 completion): 6 usable pages are too few.
  assert paged.pages_needed(16, 12, 1, PAGE) == 7
  tight = Sampler(_model()[0], CFG, ECFG._replace(num_pages=7))
  with pytest.raises(ValueError, match='num_pages'):
    tight.generate(_model()[1], [Request(prompt=[1, 2], max_new_tokens=2), big])


# ----------------------------------------------------------------------------
# 6. Sharded sampling equals single-device sampling.
# ----------------------------------------------------------------------------

# name: (mesh (data, fsdp, tensor), model config, kv pool split over `tensor`).
MESHES = {
  'fsdp8': ((1, 8, 1), CFG, False),
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
  assert pool.sharding.spec == (P(None, 'tensor') if pool_split else P())
  got = sampler.generate(sparams, requests, group_size=2)
  _assert_same(got, want, logp_atol=1e-5, requests=requests, params=single)

  # The params are the caller's: neither donated nor changed.
  for leaf, before in zip(jax.tree.leaves(sparams), jax.tree.leaves(host), strict=True):
    assert not leaf.is_deleted()
    np.testing.assert_array_equal(np.asarray(leaf), before)
  _assert_same(
    sampler.generate(sparams, requests, group_size=2),
    want,
    logp_atol=1e-5,
    requests=requests,
    params=single,
  )


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
    (Request(prompt=[1], max_new_tokens=4, temperature=float('nan')), 1, 'temperature'),
    (Request(prompt=[1], max_new_tokens=4, temperature=-1.0), 1, 'temperature'),
    (Request(prompt=[1], max_new_tokens=4, temperature=[1.0, 0.5]), 1, 'temperature'),
    (Request(prompt=[1], max_new_tokens=4, turn_max_tokens=-1), 1, 'turn_max_tokens'),
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
      paged.init_state(CFG, bad)
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
  groups = _sampler().generate(params, requests, group_size=2)
  paged, upto = _flat(groups), _flat(_fragile(groups, requests))
  dense = baseline.dense_generate(graphdef, params, CFG, requests, 2, MAX_NEW)
  assert dense.tokens.shape == (2 * len(requests), MAX_NEW)
  assert {c.finish_reason for c in paged} == {'stop', 'length'}
  assert sum(upto) >= 0.75 * sum(len(c.tokens) for c in paged)
  for row, (c, k) in enumerate(zip(paged, upto, strict=True)):
    # Two programs: the same tokens up to a draw rounding could flip (margins.py).
    n = int(dense.mask[row].sum()) if k == len(c.tokens) else k
    assert len(c.tokens) == n or k < len(c.tokens), f'row {row}'
    np.testing.assert_array_equal(c.tokens[:n], dense.tokens[row, :n], err_msg=f'row {row}')
    np.testing.assert_allclose(
      c.logprobs[:n], dense.logprobs[row, :n], atol=1e-5, rtol=0, err_msg=f'row {row}'
    )


# ----------------------------------------------------------------------------
# 9. Per-sample controls: max / min new tokens, bias and bans, stop sequences.
# ----------------------------------------------------------------------------


def _first_end(tokens, sequences, min_new=0):
  """Length of `tokens` cut after the first stop sequence that ends at index ≥
  min_new (the written-out rule), or None."""
  for end in range(1, len(tokens) + 1):
    if end <= min_new:
      continue
    for seq in sequences:
      if end >= len(seq) and list(tokens[end - len(seq) : end]) == list(seq):
        return end
  return None


def test_per_sample_max_new_tokens_cut_each_sample_of_a_group():
  _, params = _model()
  budgets = [1, 12, 4, 7]
  for settings in ({'greedy': True}, {'temperature': 1.0}):
    uncut_requests = [
      Request(prompt=p, max_new_tokens=MAX_NEW, seed=40 + i, **settings)
      for i, p in enumerate(_prompts((3, 9, 16)))
    ]
    uncut = _sampler().generate(params, uncut_requests, group_size=4)
    cut_requests = [dataclasses.replace(r, max_new_tokens=budgets) for r in uncut_requests]
    sampler = _sampler()
    cut = sampler.generate(params, cut_requests, group_size=4)
    upto = _fragile(uncut, uncut_requests)
    for b, (row, full) in enumerate(zip(cut, uncut, strict=True)):
      for g, (c, w) in enumerate(zip(row, full, strict=True)):
        # Same key, same tokens (up to a draw rounding could flip: the batches
        # differ): the budget only cuts the sample.
        assert len(c.tokens) == budgets[g] and c.finish_reason == 'length', (b, g)
        n = min(budgets[g], upto[b][g])
        np.testing.assert_array_equal(c.tokens[:n], w.tokens[:n], err_msg=f'{b} {g}')
        np.testing.assert_allclose(c.logprobs[:n], w.logprobs[:n], atol=1e-6)
    assert sampler.stats.generated_tokens == 3 * sum(budgets)
  # Unshared prompts take the same budgets per sample.
  unshared = _sampler().generate(params, cut_requests, group_size=4, share_prompt=False)
  _assert_same(unshared, cut, logp_atol=1e-6, requests=cut_requests)
  with pytest.raises(ValueError, match='max_new_tokens'):
    _sampler().generate(params, cut_requests, group_size=3)


def test_min_new_tokens_forbids_stop_tokens_before_it():
  _, params = _model()
  # Four tokens of 64 stop: without a minimum some samples end in their first tokens.
  stop = tuple(range(0, 64, 16))
  base = _requests(({'temperature': 1.0},), seed=22, stop_tokens=stop)
  base = [dataclasses.replace(r, max_new_tokens=MAX_NEW) for r in base]
  free = _flat(_sampler().generate(params, base, group_size=4))
  assert sum(len(c.tokens) <= 3 for c in free) > 2  # the minimum has something to do
  requests = [dataclasses.replace(r, min_new_tokens=[0, 1, 3, 5]) for r in base]
  groups = _sampler().generate(params, requests, group_size=4)
  logits = _reference_logits(params, requests, groups)
  rows = [(r, g, c) for r, group in zip(requests, groups, strict=True) for g, c in enumerate(group)]
  stopped_after_min = 0
  for i, ((r, g, c), logits_nxV) in enumerate(zip(rows, logits, strict=True)):
    m = r.min_new_tokens[g]
    assert not set(c.tokens[:m].tolist()) & set(stop), f'row {i}: a stop token before {m}'
    stopped_after_min += m > 0 and c.finish_reason == 'stop'  # allowed from token m on
    for t, tok in enumerate(c.tokens):
      z = logits_nxV[t].copy()
      if t < m:
        z[list(stop)] = -np.inf  # the distribution sampled from
      np.testing.assert_allclose(
        c.logprobs[t], _np_log_softmax(z)[tok], atol=1e-5, rtol=0, err_msg=f'row {i} token {t}'
      )
  assert stopped_after_min > 0
  # Greedy: the minimum against the naive decoder with the stop logits masked.
  greedy = Request(prompt=_prompts((5,))[0], max_new_tokens=8, greedy=True)
  run = _naive_greedy(params, greedy.prompt, 8)[0]
  (c,) = _sampler().generate(
    params, [dataclasses.replace(greedy, stop_tokens=(run[0],), min_new_tokens=1)]
  )[0]
  assert c.tokens[0] != run[0]  # the argmax was a stop token: the runner-up is drawn
  (c,) = _sampler().generate(params, [dataclasses.replace(greedy, stop_tokens=(run[0],))])[0]
  assert c.tokens.tolist() == [run[0]] and c.finish_reason == 'stop'


def test_banned_tokens_and_logit_bias():
  _, params = _model()
  base = _requests(({'temperature': 1.0}, {'temperature': 0.7, 'top_k': 6}), seed=23)
  free = _flat(_sampler().generate(params, base, group_size=4))
  counts = np.bincount(np.concatenate([c.tokens for c in free]), minlength=CFG.vocab_size)
  banned = tuple(int(t) for t in np.argsort(-counts)[:4])  # the most drawn tokens
  bias = {7: 2.0, 11: -1.5}
  requests = [dataclasses.replace(r, banned_tokens=banned, logit_bias=bias) for r in base]
  groups = _sampler().generate(params, requests, group_size=4)
  logits = _reference_logits(params, requests, groups)
  rows = [(r, c) for r, group in zip(requests, groups, strict=True) for c in group]
  for i, ((r, c), logits_nxV) in enumerate(zip(rows, logits, strict=True)):
    assert not set(c.tokens.tolist()) & set(banned), f'row {i}'
    for t, tok in enumerate(c.tokens):
      z = logits_nxV[t].copy()
      z[list(banned)] = -np.inf
      for k, v in bias.items():
        z[k] += v
      _, logp = _np_truncated(z, r.temperature, r.top_k, r.top_p)
      np.testing.assert_allclose(c.logprobs[t], logp[tok], atol=1e-5, rtol=0, err_msg=f'{i} {t}')
  # Greedy: the argmax over the unbanned tokens; a large bias wins every step.
  prompt = _prompts((6,))[0]
  run = _naive_greedy(params, prompt, 6)[0]
  ban = Request(prompt=prompt, max_new_tokens=6, greedy=True, banned_tokens=(run[0],))
  (c,) = _sampler().generate(params, [ban])[0]
  want = int(np.argsort(_reference_logits(params, [ban], [[c]])[0][0])[-2])
  assert c.tokens[0] == want != run[0]
  forced = dataclasses.replace(ban, banned_tokens=(), logit_bias={13: 1e4})
  (c,) = _sampler().generate(params, [forced])[0]
  assert c.tokens.tolist() == [13] * 6
  np.testing.assert_allclose(c.logprobs, 0.0, atol=1e-6)


def test_stop_sequences_cut_exactly():
  _, params = _model()
  for settings in ({'greedy': True}, {'temperature': 1.0}):
    base = [
      Request(prompt=p, max_new_tokens=MAX_NEW, seed=60 + i, **settings)
      for i, p in enumerate(_prompts((2, 7, 13)))
    ]
    uncut = _sampler().generate(params, base, group_size=2)
    requests, want = [], []
    for b, (r, group) in enumerate(zip(base, uncut, strict=True)):
      toks = group[0].tokens.tolist()
      # A 3-token sequence from the middle and a 2-token one from later; for
      # b = 2 the first ends at token 3 < min_new = 5, so it is not honoured there.
      seqs = [toks[1:3] if b == 2 else toks[3 + b : 6 + b], toks[8:10]]
      min_new = 5 if b == 2 else 0
      requests.append(dataclasses.replace(r, stop_sequences=seqs, min_new_tokens=min_new))
      want.append([_first_end(c.tokens.tolist(), seqs, min_new) for c in group])
    groups = _sampler().generate(params, requests, group_size=2)
    assert all(w[0] is not None for w in want)  # every sequence occurs in sample 0
    assert _first_end(uncut[2][0].tokens.tolist(), requests[2].stop_sequences) <= 3 < want[2][0]
    upto = _fragile(uncut, base)
    for b, (row, full) in enumerate(zip(groups, uncut, strict=True)):
      for g, (c, w) in enumerate(zip(row, full, strict=True)):
        end = want[b][g]
        if upto[b][g] < (MAX_NEW if end is None else end):
          # The batches differ: a draw before the cut that rounding could flip.
          n = upto[b][g]
          np.testing.assert_array_equal(c.tokens[:n], w.tokens[:n])
          continue
        if end is None:
          assert c.finish_reason == 'length' and len(c.tokens) == MAX_NEW
        else:
          assert c.finish_reason == 'stop' and len(c.tokens) == end, (b, g, settings)
        np.testing.assert_array_equal(c.tokens, w.tokens[: len(c.tokens)])
  never = Request(prompt=[1, 2], max_new_tokens=4, greedy=True, stop_sequences=[[63, 63, 63, 63]])
  (c,) = _sampler().generate(params, [never])[0]
  assert c.finish_reason == 'length' and len(c.tokens) == 4


@pytest.mark.parametrize(
  'change, field',
  [
    ({'min_new_tokens': 5, 'max_new_tokens': 4}, 'min_new_tokens'),
    ({'max_new_tokens': [4, 4, 4]}, 'max_new_tokens'),
    ({'banned_tokens': tuple(range(9))}, 'max_bias_tokens'),
    ({'banned_tokens': (64,)}, 'banned_tokens'),
    ({'logit_bias': {3: float('inf')}}, 'logit_bias'),
    ({'stop_sequences': [[1], [2], [3]]}, 'max_stop_sequences'),
    ({'stop_sequences': [[1, 2, 3, 4, 5]]}, 'max_stop_len'),
    ({'stop_sequences': [[]]}, 'max_stop_len'),
  ],
)
def test_bad_controls_are_refused(change, field):
  bad = Request(prompt=[1], **{'max_new_tokens': 4, **change})
  with pytest.raises(ValueError, match=field):
    _sampler().generate(_model()[1], [bad], group_size=2)


# ----------------------------------------------------------------------------
# 10. Batched and chunked prefill.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('window', [None, 5])
def test_batched_and_chunked_prefill_equal_one_at_a_time(window):
  cfg = CFG if window is None else CFG.replace(family='mistral', sliding_window=window)
  graphdef, params = _model(cfg)
  lens = (1, 3, 4, 9, 16, 11)
  prompts = _prompts(lens)
  tokens = np.zeros((len(lens), MAX_PROMPT), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, : len(p)] = p
  one = jax.jit(functools.partial(paged.prefill, graphdef))
  batch = jax.jit(functools.partial(paged.prefill_batch, graphdef), static_argnames=('chunk',))
  alone = [one(params, jnp.asarray(tokens[i]), jnp.int32(n)) for i, n in enumerate(lens)]
  for chunk in (None, 4, 8):
    got = batch(params, jnp.asarray(tokens), jnp.asarray(lens, jnp.int32), chunk=chunk)
    assert got.k.shape == (len(lens), cfg.num_layers, cfg.num_kv_heads, MAX_PROMPT, cfg.head_dim)
    for i, (n, want) in enumerate(zip(lens, alone, strict=True)):
      where = f'prompt {i} chunk {chunk}'
      # Keys and values of the real tokens (padding positions are never read).
      np.testing.assert_allclose(got.k[i, :, :, :n], want.k[:, :, :n], atol=1e-5, err_msg=where)
      np.testing.assert_allclose(got.v[i, :, :, :n], want.v[:, :, :n], atol=1e-5, err_msg=where)
      np.testing.assert_allclose(got.logits[i], want.logits, atol=1e-5, rtol=0, err_msg=where)
      assert int(got.length[i]) == n
  # And the model's own full-sequence logits at the last prompt token.
  full = _logits(graphdef, params, *_padded(prompts))
  for i, n in enumerate(lens):
    np.testing.assert_allclose(alone[i].logits, full[i, n - 1], atol=1e-5, rtol=0)


def test_sampler_with_batched_chunked_prefill_samples_the_same():
  _, params = _model()
  requests = _requests(MIXED, seed=29, stop_tokens=(5, 17))
  want = _sampler().generate(params, requests, group_size=2)
  # Chunks of 5 tokens: one bucket of 20, as many chunks as the longest prompt needs.
  for kwargs in ({'prefill_chunk': 5}, {'prefill_chunk': 8, 'max_prefill_batch': 1}):
    sampler = Sampler(
      _model()[0], CFG, ECFG._replace(num_slots=8), steps_per_dispatch=STEPS, **kwargs
    )
    got = sampler.generate(params, requests, group_size=2)
    _assert_same(got, want, logp_atol=1e-5, requests=requests)
    assert sampler.stats.prefills == len(requests)
    if 'max_prefill_batch' not in kwargs:
      assert sampler.stats.prefill_calls < len(requests)  # several prompts per call
  with pytest.raises(ValueError, match='prefill_chunk'):
    Sampler(_model()[0], CFG, ECFG, prefill_chunk=0)


# ----------------------------------------------------------------------------
# 11. Data-parallel replicas and compaction.
# ----------------------------------------------------------------------------

# 16 slots: 2 per replica on 8 devices.
REPLICA_ECFG = ECFG._replace(num_slots=16)


@functools.cache
def _replica_run():
  """The single-device, single-replica reference for the replica tests."""
  _, params = _model()
  requests = _requests(MIXED, seed=31, stop_tokens=(5, 40))
  sampler = Sampler(_model()[0], CFG, REPLICA_ECFG, steps_per_dispatch=STEPS, compaction=False)
  return requests, sampler.generate(params, requests, group_size=2)


def test_replicas_on_one_device_sample_the_same_and_stay_isolated():
  _, params = _model()
  requests, want = _replica_run()
  sampler = Sampler(_model()[0], CFG, REPLICA_ECFG, steps_per_dispatch=STEPS, replicas=4)
  state = sampler.init_state()
  assert state.k_pages[0].shape[0] == 4 and state.page_table.shape[:2] == (4, 4)
  _assert_same(
    sampler.generate(params, requests, group_size=2), want, logp_atol=1e-6, requests=requests
  )
  # Garbage in every page no slot holds, the other replicas' included, changes nothing.
  dirty = sampler.generate(params, requests, group_size=2, state=_poison(state, np.nan))
  _assert_same(dirty, want, logp_atol=1e-6, requests=requests)
  with pytest.raises(ValueError, match='replicas'):
    sampler.generate(params, requests, group_size=8)
  with pytest.raises(ValueError, match='replicas'):
    Sampler(_model()[0], CFG, REPLICA_ECFG, replicas=3)


def test_replicas_on_eight_devices_equal_one_device():
  mesh_shape = (8, 1, 1)
  graphdef, sparams = _sharded_model(CFG, mesh_shape)
  mesh = parallel.make_mesh(*mesh_shape)
  requests, want = _replica_run()
  sampler = Sampler(graphdef, CFG, REPLICA_ECFG, steps_per_dispatch=STEPS, mesh=mesh, replicas=8)
  state = sampler.init_state()
  # Each device holds one replica: its 2 slots and its own page pool.
  for leaf in (state.k_pages[0], state.page_table, state.free_stack):
    assert leaf.sharding.spec == P('data')
    assert {s.data.shape[0] for s in leaf.addressable_shards} == {1}
  got = sampler.generate(sparams, requests, group_size=2)
  _assert_same(got, want, logp_atol=1e-5, requests=requests)
  # Every replica's pages went back to its own free stack.
  assert sampler.stats.pages_free_at_end == 8 * (REPLICA_ECFG.num_pages - 1)
  assert sampler.stats.pages_referenced_at_end == sampler.stats.slots_active_at_end == 0


def _decode_flops(replicas, num_slots=64):
  mesh_shape = (8, 1, 1)
  graphdef, sparams = _sharded_model(CFG, mesh_shape)
  mesh = parallel.make_mesh(*mesh_shape)
  ecfg = ECFG._replace(num_slots=num_slots)
  sampler = Sampler(graphdef, CFG, ecfg, mesh=mesh, replicas=replicas)
  m = ecfg.max_pages_per_slot
  lowered = sampler._generate.lower(
    sparams, sampler.init_state(), num_steps=1, max_pages=m, truncate=False
  )
  cost = lowered.compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return cost['flops'], cost['bytes accessed']


def test_decode_work_per_device_on_data8_is_an_eighth_of_the_replicated_layout():
  """Per-device FLOPs and bytes of one compiled decode dispatch (XLA's cost
  analysis of the partitioned program): 8 replicas against today's layout,
  where every device decodes all 64 slots. Bytes fall less than FLOPs: every
  device still reads all of the (replicated) weights each step."""
  flops_1, bytes_1 = _decode_flops(1)
  flops_8, bytes_8 = _decode_flops(8)
  print(
    f'per-device decode: flops {flops_1:.0f} -> {flops_8:.0f}, bytes {bytes_1:.0f} -> {bytes_8:.0f}'
  )
  assert flops_8 <= flops_1 / 6, (flops_8, flops_1)
  assert bytes_8 <= bytes_1 / 2, (bytes_8, bytes_1)


def test_compaction_samples_the_same():
  _, params = _model()
  # Long tail: one long sample per group, the rest short.
  requests = [
    dataclasses.replace(r, max_new_tokens=[MAX_NEW, 2, 3, 1]) for r in _requests(MIXED, seed=37)[:5]
  ]
  make = lambda compaction: Sampler(
    _model()[0], CFG, ECFG._replace(num_slots=16), steps_per_dispatch=2, compaction=compaction
  )
  plain, compacted = make(False), make(True)
  want = plain.generate(params, requests, group_size=4)
  got = compacted.generate(params, requests, group_size=4)
  assert plain.stats.compactions == 0 and compacted.stats.compactions >= 1
  _assert_same(got, want, logp_atol=1e-6, requests=requests)
  # Fewer rows run through the model: 16 per step without compaction. (A
  # dispatch also ends once half its rows have finished, so the two runs'
  # dispatches differ.)
  assert plain.stats.decode_rows == 16 * plain.stats.decode_steps
  assert compacted.stats.decode_rows < plain.stats.decode_rows
  for smp in (plain, compacted):
    st = smp.stats
    assert st.pages_free_at_end == ECFG.num_pages - 1 and st.pages_referenced_at_end == 0
    assert st.slots_active_at_end == 0


def test_the_kernels_sample_what_the_gather_path_samples():
  """The whole sampler with `attention_impl='pallas_gpu'` (interpret mode on
  the CPU) and with jrl's C++ CPU kernel (where a compiler builds it): the
  same tokens, logprobs to 1e-5."""
  from jrl.sampler import cpu_kernel

  graphdef, params = _model()
  requests = _requests(MIXED, seed=41)[:2]
  impls = ('gather', 'pallas_gpu') + (('cpu',) if cpu_kernel.available() else ())
  got = {}
  for impl in impls:
    smp = Sampler(graphdef, CFG, ECFG._replace(attention_impl=impl), steps_per_dispatch=4)
    got[impl] = smp.generate(params, requests, group_size=2)
  for impl in impls[1:]:
    _assert_same(got[impl], got['gather'], logp_atol=1e-5, requests=requests)
  # A kernel is not partitioned by jax.jit: 'auto' on a mesh of several
  # devices takes the gather path; on one device it stays 'auto' (by backend).
  mesh = parallel.make_mesh(8)
  assert Sampler(graphdef, CFG, ECFG, mesh=mesh).cfg.attention_impl == 'gather'
  assert (
    Sampler(
      graphdef, CFG, ECFG, mesh=parallel.make_mesh(1, devices=jax.devices()[:1])
    ).cfg.attention_impl
    == 'auto'
  )


def test_the_cpu_kernel_decodes_every_length_with_one_page_width():
  """The gather path bounds the page table's width by the pages in use (a
  program per bound); the C++ kernel reads each slot's pages up to its
  length, so every dispatch takes the whole table: the same samples, and
  no program per bound."""
  from jrl.sampler import cpu_kernel

  if not cpu_kernel.available():
    pytest.skip(f'no C++ compiler here: {cpu_kernel.unavailable_reason()}')
  graphdef, params = _model()
  requests = _requests(seed=43)
  got, widths = {}, {}
  for impl in ('gather', 'cpu'):
    smp = Sampler(graphdef, CFG, ECFG._replace(attention_impl=impl), steps_per_dispatch=STEPS)
    smp.tracer = trace.Tracer()
    got[impl] = smp.generate(params, requests, group_size=2)
    widths[impl] = {e['args']['max_pages'] for e in smp.tracer.events if e['name'] == 'decode'}
  _assert_same(got['cpu'], got['gather'], logp_atol=1e-5, requests=requests)
  assert len(widths['gather']) > 1
  assert widths['cpu'] == {ECFG.max_pages_per_slot}


def test_decode_index_keeps_the_occupied_slots_of_each_replica():
  """The rows a dispatch decodes: each replica's occupied slots in order, then
  idle ones up to a row width (a power of two or three quarters of one);
  None when that is every slot."""
  from jrl.sampler.scheduler import Scheduler

  cfg = ECFG._replace(num_slots=16)
  sched = Scheduler([], 1, True, cfg, 2, 8, 8)  # 2 replicas of 8 slots
  assert sched.decode_index() is not None  # nothing occupied: one row each
  sched.slot_owner = {s: None for s in (1, 6, 9, 10, 12)}  # replica 0: 1, 6; replica 1: 1, 2, 4
  np.testing.assert_array_equal(sched.decode_index(), [[1, 6, 0], [1, 2, 4]])
  sched.slot_owner = {s: None for s in (1, 6, 9, 10, 12, 13)}  # 4 on replica 1
  np.testing.assert_array_equal(sched.decode_index(), [[1, 6, 0, 2], [1, 2, 4, 5]])
  sched.slot_owner = {s: None for s in (0, 1, 2, 3, 4)}  # 5 on replica 0: 6 rows
  np.testing.assert_array_equal(sched.decode_index(), [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
  sched.slot_owner = {s: None for s in (0, 1, 2, 3, 4, 5, 6, 8)}  # 7 on replica 0: all 8
  assert sched.decode_index() is None
  sched.slot_owner = {3: None}
  np.testing.assert_array_equal(sched.decode_index(), [[3], [0]])


def test_row_widths_leave_under_a_third_idle():
  from jrl.sampler.scheduler import narrower_width, row_width

  assert [row_width(n) for n in range(1, 18)] == [
    1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24
  ]  # fmt: skip
  for n in range(1, 300):
    w = row_width(n)
    assert n <= w and (w - n) * 3 < w
    assert narrower_width(w) < n  # a dispatch that narrows never holds fewer rows than live
    assert row_width(narrower_width(w)) == narrower_width(w) or narrower_width(w) == 0
  assert [narrower_width(w) for w in (1, 2, 4, 8, 12, 16, 20, 32)] == [0, 1, 3, 6, 8, 12, 16, 24]


def test_compilation_cache_persists_programs(tmp_path):
  """A second process with the same cache directory loads the sampler's
  programs instead of compiling them (run in subprocesses: the cache is set
  up once per process)."""
  import subprocess
  import sys
  import textwrap

  script = textwrap.dedent(f"""
    import jax
    from jrl import sampler
    import jrl.models as M
    sampler.enable_compilation_cache({str(tmp_path / 'xla_cache')!r})
    hits = []
    jax.monitoring.register_event_listener(
      lambda name, **kw: hits.append(name) if name == '/jax/compilation_cache/cache_hits' else None
    )
    cfg = M.ModelConfig(vocab_size=64, width=32, mlp_width=64, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8)
    graphdef, params = M.create(cfg, jax.random.key(0))
    ecfg = sampler.SamplerConfig(num_slots=2, num_pages=16, page_size=4, max_prompt_len=8,
                                max_new_tokens=4)
    smp = sampler.Sampler(graphdef, cfg, ecfg)
    smp.generate(params, [sampler.Request(prompt=[1, 2, 3], max_new_tokens=4, greedy=True)])
    print('HITS', len(hits))
  """)
  runs = [
    subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=300)
    for _ in range(2)
  ]
  for r in runs:
    assert r.returncode == 0, r.stderr[-2000:]
  first, second = (int(r.stdout.split('HITS')[-1]) for r in runs)
  assert any((tmp_path / 'xla_cache').iterdir())
  assert first == 0 and second >= 3  # admit, generate, free at least came from disk


def test_the_two_level_draw_follows_the_softmax_and_never_an_excluded_token():
  from jrl.sampler import sampling

  v, n = 2 * sampling.BLOCK + 452, 100_000  # 3 blocks, the last one padded
  rng = np.random.default_rng(0)
  z = rng.normal(size=v).astype(np.float32) * 2
  z[rng.choice(v, 300, replace=False)] = -1e30  # excluded (top-k / top-p, stop rules)
  z[-5:] = -1e30  # the last tokens excluded: the padded block's tail has no mass
  only = np.full(v, -1e30, np.float32)
  only[sampling.BLOCK - 1] = 0.0  # a single allowed token at a block's edge
  keys = jax.random.split(jax.random.key(0), n)
  tokens = np.asarray(
    jax.jit(jax.vmap(lambda k, row: sampling.draw(row[None], k[None])[0], (0, None)))(
      keys, jnp.asarray(z)
    )
  )
  p = np.exp(z - z.max())
  p /= p.sum()
  freq = np.bincount(tokens, minlength=v) / n
  assert freq[p == 0].sum() == 0
  assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 2e-5)
  single = sampling.draw(jnp.asarray(np.stack([only] * 64)), keys[:64])
  assert set(np.asarray(single).tolist()) == {sampling.BLOCK - 1}
