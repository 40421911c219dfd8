"""Math answer extraction and equivalence: a hand-written table of pairs.

Each row is (reference, candidate, expected). Equivalent pairs cover
thousands separators, fractions, decimals, percent, LaTeX \\frac / \\dfrac /
\\tfrac, units and trailing text, "x =" prefixes, signs, degrees, tuples and
(with sympy) symbolic forms; non-equivalent pairs are near misses of the same
kinds, so a normaliser that is too lenient fails them.
"""

import pytest

from jrl.rewards import extract_answer, is_equivalent, math_answer, normalize

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


def test_math_answer_reward_scores_and_unscored():
  completions = [
    'Adding gives \\boxed{1,234}.',
    'The answer is 0.75',
    'I think it is 13.',
    'I do not know.',
  ]
  metadata = [{'answer': '1234'}, {'answer': '3/4'}, {'answer': '12'}, {'answer': '5'}]
  assert math_answer([''] * 4, completions, metadata) == [1.0, 1.0, 0.0, None]


def test_normalize_is_idempotent():
  for reference, candidate in EQUIVALENT + NOT_EQUIVALENT:
    for text in (reference, candidate):
      once = normalize(text)
      assert normalize(once) == once
