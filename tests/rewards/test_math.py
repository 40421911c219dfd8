"""Math answer extraction and equivalence: a hand-written table of pairs.

Each row is (reference, candidate, expected). Equivalent pairs cover
thousands separators, fractions, decimals, percent, LaTeX \\frac / \\dfrac /
\\tfrac, units and trailing text, "x =" prefixes, signs, degrees, tuples and
(with sympy) symbolic forms; non-equivalent pairs are near misses of the same
kinds, so a normaliser that is too lenient fails them.

The last tests cover time: a chunk of slow symbolic answers keeps its plain
answers scored, and a comparison outside the main thread stops at its
deadline.
"""

import os
import sys
import threading

import numpy as np
import pytest

from jrl.rewards import (
  RewardService,
  extract_answer,
  is_equivalent,
  math_answer,
  normalize,
  symbolic,
)

EQUIVALENT = [
  # Integers, signs, separators.
  ('1234', '1,234'),
  ('1234567', '1,234,567'),
  ('-42', '-42'),
  ('42', '+42'),
  ('0', '-0'),
  ('1000', '1,000.0'),
  ('7', '007'),
  ('12', ' 12 '),
  ('12', '12.'),
  ('3', '3.000'),
  # Decimals.
  ('0.5', '.5'),
  ('0.5', '0.50'),
  ('2.25', '2.250'),
  ('-0.75', '-.75'),
  ('1000', '1e3'),
  ('0.001', '1e-3'),
  # Fractions.
  ('3/4', '0.75'),
  ('0.75', '\\frac{3}{4}'),
  ('1/2', '\\dfrac{1}{2}'),
  ('1/2', '\\tfrac{1}{2}'),
  ('\\frac{2}{4}', '\\frac{1}{2}'),
  ('-\\frac{1}{2}', '-0.5'),
  ('\\frac34', '3/4'),
  ('6/3', '2'),
  ('\\frac{10}{4}', '2.5'),
  ('\\frac{-3}{6}', '-1/2'),
  # Percent: equal to the number and to its fraction of one.
  ('50%', '50'),
  ('50%', '0.5'),
  ('12.5%', '0.125'),
  ('100%', '1'),
  ('25', '25\\%'),
  # Money, units and trailing words.
  ('5', '$5'),
  ('5', '$5.00'),
  ('5', '\\$5'),
  ('12', '12 apples'),
  ('12', '12 apples.'),
  ('5', '5 cm'),
  ('5', '\\text{5 cm}'),
  ('18', '18 dollars'),
  ('3.5', '3.5 hours'),
  ('60', '60 km/h'),
  ('90', '90^\\circ'),
  ('90', '90°'),
  ('90', '90^{\\circ}'),
  ('7', '\\text{7}'),
  ('7', '\\mathrm{7}'),
  ('7', '\\boxed{7}'),
  # Variables and formatting noise.
  ('5', 'x = 5'),
  ('5', 'x=5'),
  ('-2', 'y = -2'),
  ('1/3', '\\left(\\frac{1}{3}\\right)'),
  ('10', '1\\!0'),
  ('1000000', '1\\,000\\,000'),
  # Tuples and intervals.
  ('(1, 2)', '(1,2)'),
  ('(1/2, 3)', '(0.5, 3)'),
  ('[0, 1]', '[0,1.0]'),
  ('(-1, 2, 3)', '(-1,2,3)'),
  # Symbolic (sympy).
  ('\\sqrt{2}/2', '1/\\sqrt{2}'),
  ('2\\pi', '\\pi+\\pi'),
  ('2\\sqrt{3}', '\\sqrt{12}'),
  ('x^2+2x+1', '(x+1)^2'),
  ('\\frac{\\pi}{2}', '\\pi/2'),
  ('3\\sqrt{2}', '\\sqrt{18}'),
]

NOT_EQUIVALENT = [
  ('1234', '1243'),
  ('1234', '123'),
  ('42', '-42'),
  ('12', '13'),
  ('0.5', '0.05'),
  ('0.333', '1/3'),
  ('3/4', '4/3'),
  ('\\frac{3}{4}', '0.7'),
  ('1/2', '\\frac{2}{1}'),
  ('50%', '5'),
  ('50%', '0.05'),
  ('5', '$50'),
  ('12', '120 apples'),
  ('5', '5.1 cm'),
  ('90', '9^\\circ'),
  ('5', 'x = 6'),
  ('(1, 2)', '(2, 1)'),
  ('(1, 2)', '[1, 2]'),
  ('(1, 2)', '(1, 2, 3)'),
  ('[0, 1]', '(0, 1)'),
  ('\\sqrt{2}', '2'),
  ('2\\pi', '\\pi'),
  ('x^2+1', '(x+1)^2'),
  ('1,2', '12'),
  ('1e3', '100'),
  ('7', 'seven apples'),
  ('7', ''),
  ('-0.75', '0.75'),
  ('2.5', '\\frac{5}{3}'),
  ('100%', '10'),
  ('1000', '1,000,001'),
  ('3', '3x'),
  ('\\frac{1}{2}', '\\frac{1}{3}'),
  ('0.001', '1e-2'),
  ('18', '18.5 dollars'),
  ('60', '6'),
  ('(1/2, 3)', '(0.5, 4)'),
  ('2\\sqrt{3}', '\\sqrt{13}'),
  ('\\pi/2', '\\pi/3'),
  ('12', '1.2'),
]


def test_the_table_is_large_enough():
  assert len(EQUIVALENT) + len(NOT_EQUIVALENT) >= 100


@pytest.mark.parametrize('reference, candidate', EQUIVALENT)
def test_equivalent_pairs(reference, candidate):
  assert is_equivalent(candidate, reference), (candidate, reference)
  assert is_equivalent(reference, candidate), (reference, candidate)


@pytest.mark.parametrize('reference, candidate', NOT_EQUIVALENT)
def test_non_equivalent_pairs(reference, candidate):
  assert not is_equivalent(candidate, reference), (candidate, reference)
  assert not is_equivalent(reference, candidate), (reference, candidate)


EXTRACTION = [
  ('The sum is \\boxed{42}.', '42'),
  ('first \\boxed{1} then \\boxed{\\frac{3}{4}}', '\\frac{3}{4}'),
  ('nested \\boxed{\\frac{1}{\\sqrt{2}}} done', '\\frac{1}{\\sqrt{2}}'),
  ('\\fbox{9}', '9'),
  ('She pays 3 + 4 = 7.\n#### 7', '7'),
  ('#### 1,234\nextra text', '1,234'),
  ('So the answer is 15.', '15'),
  ('Thus, the answer is $12.50.', '12.50'),
  ('The answer is x = 3', 'x = 3'),
  ('Answer: 7 apples', '7 apples'),
  ('We get 3, then 4, and finally 45.', '45'),
  ('It is -2.5 degrees', '-2.5'),
  ('A ratio of 3/4', '3/4'),
  ('no digits here', None),
  ('', None),
]


@pytest.mark.parametrize('text, expected', EXTRACTION)
def test_extraction(text, expected):
  assert extract_answer(text) == expected


def test_math_answer_scores_and_no_answer_is_wrong():
  completions = [
    'Adding gives \\boxed{1,234}.',
    'The answer is 0.75',
    'I think it is 13.',
    'I do not know.',
  ]
  metadata = [{'answer': '1234'}, {'answer': '3/4'}, {'answer': '12'}, {'answer': '5'}]
  # No answer is the policy's doing: 0.0, never unscored (left out of the loss).
  assert math_answer([''] * 4, completions, metadata) == [1.0, 1.0, 0.0, 0.0]


def test_normalize_is_idempotent():
  for reference, candidate in EQUIVALENT + NOT_EQUIVALENT:
    for text in (reference, candidate):
      once = normalize(text)
      assert normalize(once) == once


# Time ------------------------------------------------------------------------------

# Symbolic, within the bounds, and far slower than SYMBOLIC_DEADLINE_S for sympy
# to compare with 1 (over 15 s on a laptop core).
SLOW = '\\sin(x)^{900}+\\cos(x)^{900}'
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize('mode', ['process', 'thread', 'inline'])
def test_slow_symbolic_answers_leave_the_rest_of_their_chunk_scored(mode):
  """One chunk of 32: 15 slow symbolic answers (30 s of deadlines) between 17
  correct plain ones, with a 5 s chunk timeout. Plain answers are scored
  first; the slow ones get what is left of the budget, and the chunk never
  times out."""
  slow = [i % 2 == 1 and i < 30 for i in range(32)]
  completions = [
    f'\\boxed{{{SLOW}}}' if s else f'So it is \\boxed{{{i}}}.' for i, s in enumerate(slow)
  ]
  metadata = [{'answer': '1' if s else str(i)} for i, s in enumerate(slow)]
  with RewardService(
    ['math_answer'], mode=mode, workers=1, timeout_s=5.0, chunk_size=32
  ) as service:
    scored = service([''] * 32, completions, metadata)
  assert scored.timeouts == {'math_answer': 0} and scored.failures == {'math_answer': 0}
  scores = scored.per_fn['math_answer']
  np.testing.assert_array_equal(scores[~np.asarray(slow)], np.ones(17))
  slow_scores = scores[np.asarray(slow)]
  assert np.all(np.isnan(slow_scores) | (slow_scores == 0.0)), slow_scores
  assert 1 <= scored.unscored['math_answer'] <= 15  # the budget stopped the slow ones


def _in_thread(fn, *args):
  """fn(*args) on a thread that is not the main thread; its result, or the
  test fails if it has not returned within 60 s."""
  result = []
  thread = threading.Thread(target=lambda: result.append(fn(*args)), daemon=True)
  thread.start()
  thread.join(60)
  assert not thread.is_alive(), 'the comparison did not stop at its deadline'
  return result[0]


def test_a_comparison_off_the_main_thread_stops_at_its_deadline(monkeypatch):
  """Outside the main thread (reward modes 'thread' and 'inline') symbolic
  comparisons run in a helper process; one that ignores its deadline (here
  every comparison of a helper that never finishes) is killed, scored not
  equal, and the next comparison gets a fresh helper."""
  monkeypatch.setenv('PYTHONPATH', os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  monkeypatch.setattr(symbolic, 'SYMBOLIC_DEADLINE_S', 0.5)
  symbolic.close_helpers()  # helpers of earlier tests
  killed = []
  real_kill = symbolic._Helper.kill

  def kill(helper):
    killed.append(helper.process)
    real_kill(helper)

  monkeypatch.setattr(symbolic._Helper, 'kill', kill)
  endless = 'from tests.rewards import fixtures; fixtures.serve_endless_symbolic()'
  try:
    with monkeypatch.context() as m:
      m.setattr(symbolic, '_HELPER_COMMAND', (sys.executable, '-c', endless))
      assert _in_thread(is_equivalent, '(x+1)^2', 'x^2+2x+1') is False
      assert len(killed) == 1 and killed[0].poll() is not None
      symbolic.close_helpers()
    # Real helpers: the same pair is equal (its first comparison pays no lazy
    # imports: the helper warmed up before it said 'ready'; the deadline leaves
    # room for a loaded CI machine), and a slow one stops at its deadline.
    monkeypatch.setattr(symbolic, 'SYMBOLIC_DEADLINE_S', 5.0)
    assert _in_thread(is_equivalent, '(x+1)^2', 'x^2+2x+1') is True
    monkeypatch.setattr(symbolic, 'SYMBOLIC_DEADLINE_S', 0.5)
    assert _in_thread(is_equivalent, SLOW, '1') is False
  finally:
    symbolic.close_helpers()
