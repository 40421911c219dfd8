"""mean@n and pass@k against their closed forms and against enumeration."""

import itertools
import math

import numpy as np
import pytest

from jrl.trainers.evaluation import scores as evaluation


@pytest.mark.parametrize('n', [1, 2, 5, 8])
def test_pass_at_k_equals_enumeration_of_k_subsets(n):
  """pass@k is the share of k-subsets of the n samples holding a correct one."""
  for c in range(n + 1):
    samples = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(range(n), k))
      hit = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
      assert evaluation.pass_at_k(n, c, k) == pytest.approx(hit, abs=1e-12)


def test_pass_at_k_closed_form_and_edge_cases():
  assert evaluation.pass_at_k(100, 10, 1) == pytest.approx(0.1)
  want = 1 - math.comb(90, 10) / math.comb(100, 10)
  assert evaluation.pass_at_k(100, 10, 10) == pytest.approx(want, rel=1e-12)
  assert evaluation.pass_at_k(5, 0, 5) == 0.0
  assert evaluation.pass_at_k(5, 1, 5) == 1.0
  with pytest.raises(ValueError, match='k'):
    evaluation.pass_at_k(4, 1, 5)
  with pytest.raises(ValueError, match='c'):
    evaluation.pass_at_k(4, 5, 1)


def test_summarize_by_hand():
  scores = np.asarray(
    [
      [1.0, 0.0, 0.0, 0.0],  # c = 1
      [1.0, 1.0, 0.0, np.nan],  # c = 2, one unscored (wrong)
      [0.0, 0.0, 0.0, 0.0],  # c = 0
    ]
  )
  got = evaluation.summarize(scores, ks=(1, 2))
  assert got['eval/mean@4'] == pytest.approx(3 / 12)
  assert got['eval/pass@1'] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
  # pass@2: 1 - C(n-c,2)/C(4,2): c=1 -> 1 - 3/6, c=2 -> 1 - 1/6, c=0 -> 0.
  assert got['eval/pass@2'] == pytest.approx((0.5 + 5 / 6) / 3)
  assert got['eval/pass@4'] == pytest.approx(2 / 3)
  assert got['eval/unscored'] == pytest.approx(1 / 12)


def test_pass_at_1_is_mean_at_n():
  rng = np.random.default_rng(0)
  scores = (rng.random((50, 6)) < 0.3).astype(np.float64)
  got = evaluation.summarize(scores, ks=(1,))
  assert got['eval/pass@1'] == pytest.approx(got['eval/mean@6'])


def test_per_example_rows():
  rows = evaluation.per_example(
    [{'prompt': 'p', 'answer': '1'}], [['a', 'b']], np.asarray([[1.0, np.nan]])
  )
  assert rows == [{'prompt': 'p', 'answer': '1', 'completions': ['a', 'b'], 'scores': [1.0, None]}]


def test_bad_shapes_are_refused():
  with pytest.raises(ValueError, match='problems, samples'):
    evaluation.summarize(np.zeros(3))
