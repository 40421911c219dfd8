"""Held-out evaluation: greedy accuracy with its standard error and per-group
breakdown, mean@n and pass@k of sampled completions, and the rows written to
workdir/eval_samples.jsonl, checked against each other on a shrunken run."""

import json
import math
import os

import numpy as np
import pytest

import tests.rewards.fixtures  # noqa: F401  (registers test_first_even)
from jrl import trainers
from jrl.data import sources
from jrl.trainers.evaluation import held_out
from jrl.trainers.evaluation import scores as evaluation
from tests.helpers import QUIET, records, shrunk_config


def _first_even(text):
  return float(bool(text) and ord(text[0]) % 2 == 0)


def test_pass_ks():
  assert held_out.pass_ks(1) == (1,)
  assert held_out.pass_ks(2) == (1, 2)
  assert held_out.pass_ks(6) == (1, 2, 4, 6)
  assert held_out.pass_ks(8) == (1, 2, 4, 8)


def test_grouped_accuracy():
  examples = [{'level': 1}, {'level': 1}, {'level': 2}, {}]
  got = held_out.grouped_accuracy([True, False, True, False], examples, 'level')
  assert got == {
    'eval/accuracy/level_1': 0.5,
    'eval/accuracy/level_2': 1.0,
    'eval/accuracy/level_none': 0.0,
  }
  assert held_out.grouped_accuracy([True], [{'level': 1}], '') == {}


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """One RL step with evaluation before and after: greedy and 3 samples per
  held-out row, scored by `test_first_even`, accuracy per `level`."""
  tmp = tmp_path_factory.mktemp('held_out')
  rows = [
    {'prompt': f'{a}+{b}=', 'answer': str(a + b), 'level': a % 3}
    for a, b in zip(range(10, 22), range(30, 42), strict=True)
  ]
  sources.write_jsonl(str(tmp / 'train.jsonl'), rows)
  sources.write_jsonl(str(tmp / 'eval.jsonl'), rows)
  config = shrunk_config(
    tmp / 'run',
    {
      **QUIET,
      'task.kind': 'file',
      'task.train_path': str(tmp / 'train.jsonl'),
      'task.eval_path': str(tmp / 'eval.jsonl'),
      'task.eval_size': 12,
      'sft.steps': 0,
      'rl.steps': 1,
      'eval.every': 1,
      'eval.reward': 'test_first_even',
      'eval.samples': 3,
      'eval.temperature': 1.5,
      'eval.group_key': 'level',
    },
  )
  trainers.run(config)
  return str(tmp / 'run'), rows


def test_metrics_agree_with_the_rows_written(run):
  workdir, examples = run
  metrics = [r for r in records(workdir) if 'eval/accuracy' in r]
  assert [m['step'] for m in metrics] == [0, 1]
  with open(os.path.join(workdir, held_out.EXAMPLES_FILE), encoding='utf-8') as f:
    written = [json.loads(line) for line in f]
  assert len(written) == 2 * len(examples)
  for m, chunk in zip(metrics, (written[:12], written[12:]), strict=True):
    assert [r['prompt'] for r in chunk] == [e['prompt'] for e in examples]
    assert [r['updates'] for r in chunk] == [chunk[0]['updates']] * 12
    # The scores are the reward's, recomputed here from the texts written.
    greedy = np.array([r['greedy_score'] for r in chunk])
    assert list(greedy) == [_first_even(r['greedy']) for r in chunk]
    scores = np.array([r['scores'] for r in chunk])
    assert scores.shape == (12, 3)
    assert [[_first_even(c) for c in r['completions']] for r in chunk] == scores.tolist()
    p = float(np.mean(greedy > 0.5))
    assert m['eval/accuracy'] == pytest.approx(p)
    assert m['eval/accuracy_se'] == pytest.approx(math.sqrt(p * (1 - p) / 12))
    for level in (0, 1, 2):
      sel = [r['level'] == level for r in chunk]
      assert m[f'eval/accuracy/level_{level}'] == pytest.approx(np.mean(greedy[sel] > 0.5))
    expected = evaluation.summarize(scores, (1, 2, 3), prefix='eval/sampled')
    for key, value in expected.items():
      assert m[key] == pytest.approx(value), key
  assert written[0]['updates'] == 0 and written[12]['updates'] > 0
  every_score = [r['greedy_score'] for r in written] + [s for r in written for s in r['scores']]
  assert 0 < np.mean(every_score) < 1  # the scores vary: the checks above compare something


def test_samples_differ_from_greedy(run):
  """At temperature 1.5 on a random model the three samples of a row are not
  all the greedy completion (the sampled pass really samples)."""
  workdir, _ = run
  with open(os.path.join(workdir, held_out.EXAMPLES_FILE), encoding='utf-8') as f:
    written = [json.loads(line) for line in f]
  assert any(set(r['completions']) != {r['greedy']} for r in written)
