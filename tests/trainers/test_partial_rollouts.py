"""Partial rollouts (`topology.partial_rollouts`): an async rollout moves to
newer policy versions while it decodes, one version every
`topology.swap_every` decode dispatches, up to the version that trains on
it. Checked on the shrunken default job with k = 2: every token's recorded
version and behaviour logprob (recomputed with that version's parameters),
the per-token staleness metrics, and an exact resume with partial rollouts
in flight."""

import itertools

import jax
import numpy as np
import pytest

import jrl.models as M
from jrl import trainers
from jrl.sampler import Sampler
from tests.helpers import assert_trees_equal, shrunk_config
from tests.trainers.test_topologies import BASE, history, preempt_and_resume, run

PARTIAL = {
  'topology.kind': 'async',
  'topology.max_staleness': 2,
  'topology.partial_rollouts': True,
  'topology.swap_every': 1,
  'sampler.steps_per_dispatch': 2,  # several dispatches per rollout, so several versions
}


class Recorder:
  """Keeps every version's weights as the sampler loads them, and every
  rollout's requests and completions."""

  def __init__(self, monkeypatch):
    self.weights, self.rollouts = {}, []
    load, generate = Sampler.load_weights, Sampler.generate
    recorder = self

    def recording_load(sampler, params, version):
      recorder.weights.setdefault(version, jax.tree.map(np.asarray, params))
      recorder.graphdef = sampler.graphdef
      return load(sampler, params, version)

    def recording_generate(sampler, params, requests, **kwargs):
      groups = generate(sampler, params, requests, **kwargs)
      if kwargs.get('weights_at') is not None:
        recorder.rollouts.append((list(requests), groups))
      return groups

    monkeypatch.setattr(Sampler, 'load_weights', recording_load)
    monkeypatch.setattr(Sampler, 'generate', recording_generate)


@pytest.fixture(scope='module')
def partial_run(tmp_path_factory):
  mp = pytest.MonkeyPatch()
  recorder = Recorder(mp)
  params, records = run(str(tmp_path_factory.mktemp('partial')), PARTIAL)
  mp.undo()
  return params, records, recorder


def test_every_token_carries_its_version_and_that_versions_logprob(partial_run):
  _, _, recorder = partial_run
  temperature = shrunk_config('/tmp/unused', BASE).sampling.temperature
  logprobs = jax.jit(M.next_token_logprobs, static_argnums=0)
  moved = 0
  for requests, groups in recorder.rollouts:
    pairs = [(r, c) for r, g in zip(requests, groups, strict=True) for c in g]
    width = max(len(r.prompt) + len(c.tokens) for r, c in pairs)
    tokens = np.zeros((len(pairs), width), np.int32)
    mask = np.zeros((len(pairs), width), bool)
    for i, (r, c) in enumerate(pairs):
      row = list(r.prompt) + [int(t) for t in c.tokens]
      tokens[i, : len(row)], mask[i, : len(row)] = row, True
    by_version = {
      v: np.asarray(
        logprobs(recorder.graphdef, recorder.weights[v], tokens, mask, temperature=temperature)[0]
      )
      for v in sorted({int(v) for _, c in pairs for v in c.versions})
    }
    for i, (r, c) in enumerate(pairs):
      s = len(r.prompt)
      want = np.asarray([by_version[int(v)][i, s + t] for t, v in enumerate(c.versions)])
      np.testing.assert_allclose(c.logprobs, want, atol=1e-5)
      assert np.all(np.diff(c.versions) >= 0)
      moved += len(np.unique(c.versions)) > 1
  assert moved > 0, 'no sample moved to a newer version: the test would be vacuous'
  # ... to weights that differ from its first version's.
  leaves = [jax.tree.leaves(recorder.weights[v]) for v in sorted(recorder.weights)]
  assert any(
    not all(np.array_equal(a, b) for a, b in zip(x, y, strict=True))
    for x, y in itertools.pairwise(leaves)
  )


def test_staleness_per_token_is_logged_and_never_above_k(partial_run):
  _, records, _ = partial_run
  rl = [r for r in records if r.get('phase') == 1.0]
  assert len(rl) == 4
  for r in rl:
    shares = {k: v for k, v in r.items() if k.startswith('rollout/token_staleness/')}
    assert shares and max(int(k.rsplit('/', 1)[1]) for k in shares) <= 2
    assert sum(shares.values()) == pytest.approx(1.0)
    assert 0.0 <= r['rollout/token_staleness_mean'] <= r['rollout/staleness']
  # Later rollouts move to newer versions while they decode: fresher tokens
  # than their first version.
  assert any(r['rollout/token_staleness_mean'] < r['rollout/staleness'] for r in rl)
  assert max(r['rollout/versions_per_sample_max'] for r in rl) >= 2


def test_resumes_exactly_with_partial_rollouts_in_flight(partial_run, tmp_path, monkeypatch):
  stopped_at, in_flight, params, records = preempt_and_resume(
    monkeypatch, str(tmp_path), PARTIAL, 1
  )
  first = stopped_at - 2
  assert in_flight == [[first + 2, first], [first + 3, first + 1]]
  assert_trees_equal(params, partial_run[0])
  assert history(records) == history(partial_run[1])


@pytest.mark.parametrize(
  'fields, field',
  [
    ({'topology.partial_rollouts': True}, 'topology.partial_rollouts'),
    ({**PARTIAL, 'topology.max_staleness': 0}, 'topology.partial_rollouts'),
    ({**PARTIAL, 'rl.dynamic_sampling': True}, 'topology.partial_rollouts'),
    ({**PARTIAL, 'topology.kv_on_swap': 'drop'}, 'topology.kv_on_swap'),
    ({**PARTIAL, 'topology.swap_every': 0}, 'topology.swap_every'),
  ],
)
def test_bad_partial_rollout_settings_name_the_field(tmp_path, fields, field):
  with pytest.raises(ValueError, match=field.replace('.', r'\.')):
    trainers.build(shrunk_config(str(tmp_path), {**BASE, **fields}))


def test_held_out_evaluation_runs_while_partial_rollouts_wait_for_versions(tmp_path):
  # A rollout waiting for a version the next update makes releases the
  # worker's lock, so evaluating after every update does not deadlock.
  _, records = run(str(tmp_path), {**PARTIAL, 'eval.every': 1})
  rl = [r for r in records if r.get('phase') == 1.0]
  assert len(rl) == 4 and all('eval/accuracy' in r for r in rl)


def test_partial_rollouts_on_rollout_devices_of_their_own(partial_run, tmp_path):
  # The sampler on the last 4 of the 8 devices, each version resharded onto
  # them: the same rollouts and updates as on the training devices.
  params, records = run(str(tmp_path), {**PARTIAL, 'topology.rollout_devices': 4})
  colocated = {r['step']: r for r in partial_run[1]}
  rl = [r for r in records if r.get('phase') == 1.0]
  assert [r['rollout/staleness'] for r in rl] == [0.0, 1.0, 2.0, 2.0]
  for r in rl:
    for key in ('reward/mean', 'rollout/token_staleness_mean'):
      assert r[key] == colocated[r['step']][key], (r['step'], key)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(partial_run[0]), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-6)
