"""Partial rollouts: new weights taken between decode dispatches while
samples are in flight (`Sampler.generate(weights_at=..., kv_on_swap=...)`).

Every token is recorded with the version that produced it. With the cache
recomputed on a swap, each token's logprob is exactly its version's (the
trainer's logprobs of the whole sequence under that version's parameters);
with the cache kept, the tokens after a swap of a sample already in flight
come from the new weights attending to the old weights' keys and values,
which is neither version's distribution.
"""

import jax
import numpy as np
import pytest

import jrl.models as M
from jrl.sampler import Request, Sampler, SamplerConfig
from tests.sampler import margins
from tests.sampler.test_multiturn import CFG, GRAPHDEF, PARAMS

PARAMS_A = PARAMS  # version 0
# Version 1: every weight moved, enough to change sampled tokens.
PARAMS_B = jax.tree.map(
  lambda x, k: x + 0.05 * jax.random.normal(k, x.shape, x.dtype),
  PARAMS_A,
  jax.tree.unflatten(
    jax.tree.structure(PARAMS_A),
    list(jax.random.split(jax.random.key(9), len(jax.tree.leaves(PARAMS_A)))),
  ),
)
MAX_NEW = 20
ECFG = SamplerConfig(
  num_slots=4, num_pages=64, page_size=4, max_prompt_len=16, max_new_tokens=MAX_NEW
)
PROMPTS = [[5, 9, 13, 2, 40, 41, 7], [1, 2, 3], [30, 31, 32, 33, 34, 35, 36, 37, 38], [8, 8, 9]]
REQUESTS = [
  Request(prompt=p, max_new_tokens=MAX_NEW, temperature=1.0, seed=20 + k)
  for k, p in enumerate(PROMPTS)
]
SWAP_AT = 2  # the dispatch before which version 1 is taken
_logprobs = jax.jit(M.next_token_logprobs, static_argnums=0)


def _sampler():
  smp = Sampler(GRAPHDEF, CFG, ECFG, steps_per_dispatch=3)
  smp.load_weights(PARAMS_A, 0)
  return smp


def _generate(smp, new_weights, kv_on_swap):
  def weights_at(d):
    return (new_weights, 1) if d >= SWAP_AT else None

  return smp.generate(
    PARAMS_A, REQUESTS, group_size=2, weights_at=weights_at, kv_on_swap=kv_on_swap
  )


def _trainer_logprobs(params, groups):
  pairs = [(r, c) for r, g in zip(REQUESTS, groups, strict=True) for c in g]
  rows = [list(r.prompt) + [int(t) for t in c.tokens] for r, c in pairs]
  width = max(len(r) for r in rows)
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for i, row in enumerate(rows):
    tokens[i, : len(row)] = row
    mask[i, : len(row)] = True
  logp = np.asarray(_logprobs(GRAPHDEF, params, tokens, mask, temperature=1.0)[0])
  return [logp[i, len(r.prompt) : len(r.prompt) + len(c.tokens)] for i, (r, c) in enumerate(pairs)]


def _flat(groups):
  return [c for g in groups for c in g]


def test_recomputed_cache_gives_every_token_its_versions_logprob():
  smp = _sampler()
  groups = _generate(smp, PARAMS_B, 'recompute')
  assert smp.stats.weight_swaps == 1
  flat = _flat(groups)
  want_a, want_b = _trainer_logprobs(PARAMS_A, groups), _trainer_logprobs(PARAMS_B, groups)
  mixed = 0
  for c, a, b in zip(flat, want_a, want_b, strict=True):
    v = c.versions
    assert v.shape == c.tokens.shape and set(v.tolist()) <= {0, 1}
    assert np.all(np.diff(v) >= 0)  # a sample only moves to newer versions
    mixed += 0 < v.sum() < len(v)
    np.testing.assert_allclose(c.logprobs, np.where(v == 0, a, b), atol=1e-5)
  assert mixed >= 2  # samples in flight across the swap
  assert any(c.versions[0] == 1 for c in flat)  # and samples admitted after it


def test_kept_cache_samples_neither_versions_distribution_after_the_swap():
  smp = _sampler()
  groups = _generate(smp, PARAMS_B, 'keep')
  flat = _flat(groups)
  want_a, want_b = _trainer_logprobs(PARAMS_A, groups), _trainer_logprobs(PARAMS_B, groups)
  gap = 0.0
  for c, a, b in zip(flat, want_a, want_b, strict=True):
    v = c.versions
    np.testing.assert_allclose(c.logprobs[v == 0], a[v == 0], atol=1e-5)
    if v[0] == 1:  # admitted after the swap: the whole cache is version 1's
      np.testing.assert_allclose(c.logprobs, b, atol=1e-5)
    elif v[-1] == 1:
      gap = max(gap, float(np.max(np.abs(c.logprobs[v == 1] - b[v == 1]))))
  assert gap > 1e-3


def test_tokens_before_the_swap_are_the_unswapped_runs_and_the_same_weights_change_nothing():
  plain = _flat(_sampler().generate(PARAMS_A, REQUESTS, group_size=2))
  for kv in ('keep', 'recompute'):
    swapped = _flat(_generate(_sampler(), PARAMS_B, kv))
    for c, p in zip(swapped, plain, strict=True):
      n = int(np.sum(c.versions == 0))
      np.testing.assert_array_equal(c.tokens[:n], p.tokens[:n])
  # Version 1 = version 0's weights, recomputed: the same tokens and logprobs,
  # up to a draw that rounding could flip (the recomputed cache comes from
  # another program: tests/sampler/margins.py).
  same = _flat(_generate(_sampler(), PARAMS_A, 'recompute'))
  groups = _sampler().generate(PARAMS_A, REQUESTS, group_size=2)
  upto = [n for row in margins.fragile_points(GRAPHDEF, PARAMS_A, REQUESTS, groups) for n in row]
  assert sum(upto) >= 0.75 * sum(len(p.tokens) for p in plain)
  for c, p, n in zip(same, plain, upto, strict=True):
    np.testing.assert_array_equal(c.tokens[:n], p.tokens[:n])
    np.testing.assert_allclose(c.logprobs[:n], p.logprobs[:n], atol=1e-5)
  assert plain[0].versions is None  # without weights_at nothing is tracked


def test_kv_on_swap_is_checked():
  with pytest.raises(ValueError, match='kv_on_swap'):
    _sampler().generate(PARAMS_A, REQUESTS, kv_on_swap='drop')
