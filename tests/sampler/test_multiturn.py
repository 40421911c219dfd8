"""Multi-turn sampling: environment tokens appended on the cached pages
(`Sampler.generate(on_turn_end=...)`, `paged.resume`).

The reference is the same trajectory recomputed from scratch: the prompt,
the model's first turn and the environment's tokens prefilled as one new
prompt, then decoded greedily. Continuing on the cached pages must give the
same tokens (and logprobs to float tolerance), without recomputing the
prefix.
"""

import time

import jax
import numpy as np
import pytest

import jrl.models as M
from jrl.sampler import Continuation, Request, Sampler, SamplerConfig
from tests.sampler import margins

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
GRAPHDEF, PARAMS = M.create(CFG, jax.random.key(3))
PAGE, MAX_PROMPT, MAX_NEW, FORCED = 4, 40, 24, 6
ECFG = SamplerConfig(
  num_slots=4,
  num_pages=96,
  page_size=PAGE,
  max_prompt_len=MAX_PROMPT,
  max_new_tokens=MAX_NEW,
  max_forced_tokens=FORCED,
)
SAMPLER = Sampler(GRAPHDEF, CFG, ECFG, steps_per_dispatch=3)
PROMPTS = [[5, 9, 13, 2, 40, 41, 7], [1, 2, 3], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
ENV = [50, 51, 52, 53]


def greedy(prompt, stop=(), max_new=MAX_NEW):
  (c,) = SAMPLER.generate(
    PARAMS, [Request(prompt=prompt, max_new_tokens=max_new, greedy=True, stop_tokens=stop)]
  )[0]
  return c


def stop_token_for(prompt):
  """A token greedy decoding emits as its 3rd token (so the first turn ends there)."""
  return int(greedy(prompt).tokens[2])


@pytest.mark.parametrize('p', range(len(PROMPTS)))
def test_continuing_on_cached_pages_equals_recomputing_the_prefix(p):
  prompt = PROMPTS[p]
  stop = stop_token_for(prompt)
  calls = []

  def on_turn_end(i, g, tokens, logprobs):
    calls.append((list(tokens), np.array(logprobs)))
    return ENV if len(calls) == 1 else 'done'

  request = Request(prompt=prompt, max_new_tokens=MAX_NEW, greedy=True, stop_tokens=(stop,))
  (c,) = SAMPLER.generate(PARAMS, [request], on_turn_end=on_turn_end)[0]
  first, first_logprobs = calls[0]
  assert first[-1] == stop
  n1 = len(first)
  # The turn's logprobs, as the completion records them.
  np.testing.assert_array_equal(first_logprobs, c.logprobs[:n1])
  # Trajectory layout: first turn, the environment's tokens, then the next turn.
  np.testing.assert_array_equal(c.tokens[:n1], first)
  np.testing.assert_array_equal(c.tokens[n1 : n1 + len(ENV)], ENV)
  assert c.env_mask.tolist() == [False] * n1 + [True] * len(ENV) + [False] * (
    len(c.tokens) - n1 - len(ENV)
  )
  assert np.all(c.logprobs[n1 : n1 + len(ENV)] == 0.0)
  # Recompute: prefill prompt + first turn + environment tokens as one prompt.
  second = c.tokens[n1 + len(ENV) :]
  redo = greedy(prompt + first + ENV, stop=(stop,), max_new=len(second))
  # Two programs: the same tokens up to a near-tie rounding could flip (margins.py).
  (((upto,),)) = margins.fragile_points(GRAPHDEF, PARAMS, [request], [[c]])
  k = max(upto - n1 - len(ENV), 0)
  assert k >= 0.75 * len(second)
  np.testing.assert_array_equal(second[:k], redo.tokens[:k])
  np.testing.assert_allclose(c.logprobs[n1 + len(ENV) :][:k], redo.logprobs[:k], atol=1e-5)
  if len(calls) > 1:  # the second turn also stopped and the episode ended
    assert c.finish_reason == 'done'


def test_groups_and_queueing_with_turns_complete_every_request():
  stops = [stop_token_for(p) for p in PROMPTS]
  requests = [
    Request(prompt=p, max_new_tokens=MAX_NEW, temperature=1.0, stop_tokens=(s,), seed=k)
    for k, (p, s) in enumerate(zip(PROMPTS, stops, strict=True))
  ]
  turns = {}

  def on_turn_end(i, g, tokens, logprobs):
    turns[(i, g)] = turns.get((i, g), 0) + 1
    return ENV[: 1 + turns[(i, g)]] if turns[(i, g)] < 3 else 'max_turns'

  groups = SAMPLER.generate(PARAMS, requests, group_size=2, on_turn_end=on_turn_end)
  spans = 0
  for group in groups:
    for c in group:
      assert c is not None and c.env_mask.shape == c.tokens.shape
      assert c.finish_reason in ('max_turns', 'length', 'stop')
      assert len(c.tokens) <= MAX_NEW
      # Every environment span holds exactly what the environment returned.
      edges = np.flatnonzero(np.diff(np.concatenate([[0], c.env_mask.astype(int), [0]])))
      for start, end in zip(edges[::2], edges[1::2], strict=True):
        assert c.tokens[start:end].tolist() == ENV[: end - start]
        assert c.tokens[start - 1] in stops  # right after the model's turn-ending token
        spans += 1
  assert spans == SAMPLER.stats.env_turns > 0
  assert max(turns.values()) >= 2


def test_environment_answer_too_long_ends_the_sample_with_length():
  prompt = PROMPTS[0]
  stop = stop_token_for(prompt)
  (c,) = SAMPLER.generate(
    PARAMS,
    [Request(prompt=prompt, max_new_tokens=MAX_NEW, greedy=True, stop_tokens=(stop,))],
    on_turn_end=lambda i, g, tokens, logprobs: [50] * (FORCED + 1),
  )[0]
  assert c.finish_reason == 'length' and not c.env_mask.any()


def test_a_turn_limit_ends_the_turn_and_the_answer_sets_the_next():
  """`turn_max_tokens` cuts every turn (no stop token here), a plain answer
  keeps it, a `Continuation` sets the next turn's (0: none, up to the
  sample's budget, which ends the sample with 'length', not a turn)."""
  ends = []

  def on_turn_end(i, g, tokens, logprobs):
    ends.append(len(tokens))
    return [
      Continuation(ENV, max_tokens=5),  # next turn: 5 tokens
      ENV[:2],  # the request's limit again: 3
      Continuation([50], max_tokens=0),  # no limit: the budget ends the sample
    ][len(ends) - 1]

  request = Request(prompt=PROMPTS[0], max_new_tokens=MAX_NEW, seed=1, turn_max_tokens=3)
  (c,) = SAMPLER.generate(PARAMS, [request], on_turn_end=on_turn_end)[0]
  assert ends == [3, 3 + 4 + 5, 12 + 2 + 3]
  assert c.finish_reason == 'length' and len(c.tokens) == MAX_NEW
  assert np.flatnonzero(c.env_mask).tolist() == [3, 4, 5, 6, 12, 13, 17]
  # Without environments the limit is the first turn's: it ends the sample.
  (c,) = SAMPLER.generate(PARAMS, [request])[0]
  assert c.finish_reason == 'length' and len(c.tokens) == 3


def test_temperature_zero_is_greedy_and_an_answer_sets_the_next_turns():
  """Sample 1 stays greedy (temperature 0, then an answer asking 0) and so
  equals a greedy run's sample; sample 0's answer asks temperature 5, so
  its next turn is drawn, not greedy. Both runs have the same batches, so
  the same programs: equal greedy tokens are exact here."""
  prompt = PROMPTS[1]

  def run(request, temperatures):
    def on_turn_end(i, g, tokens, logprobs):
      if len(tokens) > 4:
        return 'done'
      return Continuation(ENV, max_tokens=6, temperature=temperatures[g])

    return SAMPLER.generate(PARAMS, [request], group_size=2, on_turn_end=on_turn_end)[0]

  greedy_run = run(
    Request(prompt=prompt, max_new_tokens=MAX_NEW, greedy=True, turn_max_tokens=4), [1.0, 1.0]
  )
  mixed = run(
    Request(prompt=prompt, max_new_tokens=MAX_NEW, temperature=0.0, turn_max_tokens=4, seed=3),
    [5.0, 0.0],
  )
  for c in (*greedy_run, *mixed):
    assert c.finish_reason == 'done' and len(c.tokens) == 4 + len(ENV) + 6
  np.testing.assert_array_equal(greedy_run[0].tokens, greedy_run[1].tokens)
  np.testing.assert_array_equal(mixed[1].tokens, greedy_run[1].tokens)
  np.testing.assert_array_equal(mixed[0].tokens[:8], greedy_run[0].tokens[:8])  # greedy, then ENV
  assert mixed[0].tokens[8:].tolist() != greedy_run[0].tokens[8:].tolist()


def test_single_turn_sampling_is_unchanged_by_the_multiturn_state():
  # Without on_turn_end the forced-token queue stays empty: same tokens as before.
  c = greedy(PROMPTS[1])
  assert c.env_mask is None and c.finish_reason == 'length' and len(c.tokens) == MAX_NEW


# Parked samples: the environment's answer as a Future (`jrl.envs.EnvPool`).


def _turn_requests():
  stops = [stop_token_for(p) for p in PROMPTS]
  return [
    Request(prompt=p, max_new_tokens=MAX_NEW, temperature=1.0, stop_tokens=(s,), seed=11 + k)
    for k, (p, s) in enumerate(zip(PROMPTS, stops, strict=True))
  ]


def _answer(i, g, tokens, logprobs=None):
  """A deterministic environment: its answer depends on the turn only."""
  n = int(np.sum(tokens)) % 3
  return ENV[: 1 + n] if len(tokens) < MAX_NEW - 8 else 'done'


def _same(got, want, requests):
  """Same samples, each up to its first draw that rounding could flip (the
  batches differ while samples are parked: tests/sampler/margins.py)."""
  upto = margins.fragile_points(GRAPHDEF, PARAMS, requests, want)
  total = sum(len(b.tokens) for wg in want for b in wg)
  assert sum(map(sum, upto)) >= 0.75 * total
  for gg, wg, ng in zip(got, want, upto, strict=True):
    for a, b, n in zip(gg, wg, ng, strict=True):
      np.testing.assert_array_equal(a.tokens[:n], b.tokens[:n])
      np.testing.assert_array_equal(a.env_mask[:n], b.env_mask[:n])
      np.testing.assert_allclose(a.logprobs[:n], b.logprobs[:n], atol=1e-6)
      if n == len(b.tokens):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert a.finish_reason == b.finish_reason


def test_parked_samples_sample_what_inline_answers_sample():
  import concurrent.futures
  import random
  import threading

  requests = _turn_requests()
  want = SAMPLER.generate(PARAMS, requests, group_size=2, on_turn_end=_answer)
  inline_turns = SAMPLER.stats.env_turns
  pool = concurrent.futures.ThreadPoolExecutor(4)
  rng, lock, calls = random.Random(0), threading.Lock(), []
  # The first two answers wait for each other and then 0.2 s more, so two
  # samples are parked at once whatever the compile times (the others keep
  # decoding meanwhile).
  both = threading.Barrier(2)

  def later(i, g, tokens, logprobs):
    with lock:
      calls.append(i)
      first_two = len(calls) <= 2
      delay = rng.choice([0.0, 0.01, 0.05, 0.2])

    def answer():
      if first_two:
        try:
          both.wait(timeout=60)
        except threading.BrokenBarrierError:
          pass  # the parked-peak assertion below says what went wrong
      time.sleep(0.2 if first_two else delay)
      return _answer(i, g, tokens, logprobs)

    return pool.submit(answer)

  got = SAMPLER.generate(PARAMS, requests, group_size=2, on_turn_end=later)
  pool.shutdown()
  _same(got, want, requests)
  stats = SAMPLER.stats
  assert stats.env_turns == inline_turns > 0
  assert stats.env_parked_peak >= 2  # several samples waited at once
  assert stats.pages_free_at_end == ECFG.num_pages - 1 and stats.pages_referenced_at_end == 0
  assert stats.slots_active_at_end == 0


def test_other_samples_keep_decoding_while_one_waits_for_its_environment():
  import concurrent.futures

  # Request 0's first turn is answered only once two more decode dispatches
  # have run: they run only if the other samples decode while request 0 is
  # parked (inline, the sampler's loop would be blocked on it and the wait
  # would time out).
  requests = _turn_requests()
  pool = concurrent.futures.ThreadPoolExecutor(4)
  seen = {}

  def wait_for_dispatches():
    deadline = time.perf_counter() + 30
    while time.perf_counter() < deadline:
      if SAMPLER.stats.dispatches >= seen['parked_at'] + 2:
        seen['answered_at'] = SAMPLER.stats.dispatches
        return ENV[:2]
      time.sleep(0.002)
    return 'env_timeout'

  def on_turn_end(i, g, tokens, logprobs):
    if (i, g) == (0, 0) and 'parked_at' not in seen:
      seen['parked_at'] = SAMPLER.stats.dispatches
      return pool.submit(wait_for_dispatches)
    return _answer(i, g, tokens, logprobs)

  groups = SAMPLER.generate(PARAMS, requests, group_size=2, on_turn_end=on_turn_end)
  pool.shutdown()
  first = groups[0][0]
  assert first.finish_reason != 'env_timeout'
  assert seen['answered_at'] >= seen['parked_at'] + 2
  assert first.env_mask.any()  # it continued after its environment answered
  assert SAMPLER.stats.env_parked_peak >= 1


def test_an_answer_that_raises_reaches_the_caller():
  import concurrent.futures

  def broken(i, g, tokens, logprobs):
    future = concurrent.futures.Future()
    future.set_exception(RuntimeError('bug in the answer'))
    return future

  with pytest.raises(RuntimeError, match='bug in the answer'):
    SAMPLER.generate(PARAMS, _turn_requests(), group_size=2, on_turn_end=broken)
