"""Hostile completions against every registered reward and every parser of
model text: nothing executes, nothing exceeds its bound, no false positive.

The corpus (tests/rewards/hostile.py) holds code injection through every
syntax sympy or LaTeX parsing accepts, dunder access, exponent towers, deep
nesting, megabyte answers, unicode confusables, odd characters and
prompt-injection text for the judge.
"""

import builtins

import pytest
import sympy.parsing.sympy_parser

from jrl import rewards
from jrl.envs import tools
from jrl.rewards import judge, symbolic
from jrl.rewards import math as math_reward
from tests.rewards import hostile

ANSWER = '42'


@pytest.fixture
def canary(tmp_path):
  path = tmp_path / 'executed'
  yield path
  assert not path.exists(), 'a hostile completion ran code'


def test_the_corpus_is_large_enough(tmp_path):
  assert len(hostile.corpus(tmp_path / 'c')) >= 100


def test_math_answer_never_evaluates_model_text(canary, monkeypatch):
  """In-process, with eval / exec / sympy's string parsers trapped: none is
  reached with model text, and no completion scores 1.0."""
  calls = []
  real_eval, real_exec = builtins.eval, builtins.exec
  markers = (str(canary), '__import__', 'system(', '__subclasses__', 'exec(', 'open(')
  math_reward.is_equivalent('\\sqrt{8}', '2\\sqrt{2}')  # libraries' own lazy set-up first

  def trap(real, name):
    def fn(source, *args, **kwargs):
      text = source.decode(errors='replace') if isinstance(source, bytes) else source
      if isinstance(text, str) and any(m in text for m in markers):
        calls.append((name, text[:80]))
      return real(source, *args, **kwargs)

    return fn

  real_parse = sympy.parsing.sympy_parser.parse_expr

  def refuse(source, *args, **kwargs):
    # The libraries parse their own constant strings (sympy's unit prefixes)
    # and the LaTeX grammar's NUMBER tokens (digits only) this way; model text
    # carrying a payload must never get here.
    if any(m in str(source) for m in markers):
      calls.append(('parse_expr', str(source)[:80]))
      raise AssertionError('parse_expr reached')
    return real_parse(source, *args, **kwargs)

  monkeypatch.setattr(builtins, 'eval', trap(real_eval, 'eval'))
  monkeypatch.setattr(builtins, 'exec', trap(real_exec, 'exec'))
  monkeypatch.setattr(sympy.parsing.sympy_parser, 'parse_expr', refuse)
  import math_verify.parser

  monkeypatch.setattr(math_verify.parser, 'parse_expr', refuse)
  corpus = hostile.corpus(canary)
  texts = [t for _, t in corpus]
  scores = math_reward.math_answer([''] * len(texts), texts, [{'answer': ANSWER}] * len(texts))
  assert not calls, calls[:5]
  wrong = [label for (label, _), s in zip(corpus, scores, strict=True) if s == 1.0]
  assert not wrong, wrong


@pytest.mark.parametrize(
  'answer',
  [
    '2^{2^{2^{2^{100}}}}',
    '9^{9^{9^9}}',
    '10^{10^{10}}',
    'e^{e^{e^{10}}}',
    '(10^{1000})^{1000}',
    '99999999!',
    '(1000!)!',
    '\\binom{10^9}{10^8}',
    '(' * 40 + '1' + ')' * 40,
  ],
)
def test_expensive_answers_are_refused_before_they_are_computed(answer, monkeypatch):
  """Towers, huge factorials and deep nesting never reach sympy's simplifier
  (which would not return): the bounds refuse them first."""
  import math_verify

  reached = []
  monkeypatch.setattr(math_verify, 'verify', lambda *a, **k: reached.append(a) or False)
  assert not math_reward.is_equivalent(answer, ANSWER)
  assert not reached


def test_bounded_answers_still_compare_symbolically():
  """The bounds leave ordinary answers alone."""
  assert math_reward.is_equivalent('2^{10}', '1024')
  assert math_reward.is_equivalent('\\frac{10^{3}}{10}', '100')
  assert math_reward.is_equivalent('5!', '120')
  assert math_reward.is_equivalent('\\binom{5}{2}', '10')
  assert math_reward.is_equivalent('\\sqrt{8}', '2\\sqrt{2}')


def test_the_deadline_stops_a_slow_comparison(monkeypatch):
  """A comparison that does not finish is cut at the deadline and is 'not
  equal' (main thread: the reward workers' case)."""
  import time

  import math_verify

  def slow(*args, **kwargs):
    while True:
      time.sleep(0.01)

  monkeypatch.setattr(math_verify, 'verify', slow)
  monkeypatch.setattr(symbolic, 'SYMBOLIC_DEADLINE_S', 0.2)
  assert not math_reward.is_equivalent('\\sqrt{8}', '2\\sqrt{2}')


def test_huge_exponents_in_numbers_are_not_expanded():
  assert math_reward.to_number('1e999999999') is None
  assert not math_reward.is_equivalent('1e-999999999', '0')


@pytest.mark.parametrize(
  'name', ['math_answer', 'exact_match', 'format_think_answer', 'boxed_format', 'code_tests']
)
def test_every_registered_reward_survives_the_corpus(name, canary):
  """Each registered reward, run as the trainer runs it (worker processes with
  a deadline): no chunk fails or times out, nothing executes, and the
  answer-checking rewards give no false positive."""
  assert name in rewards.REGISTRY
  corpus = hostile.corpus(canary)
  texts = [t for _, t in corpus]
  meta = [{'answer': ANSWER, 'tests': [{'input': '', 'output': ANSWER + '\n'}]}] * len(texts)
  with rewards.RewardService([name], mode='process', workers=2, timeout_s=60, chunk_size=8) as s:
    scored = s([''] * len(texts), texts, meta)
  assert scored.failures[name] == 0, scored.errors
  assert scored.timeouts[name] == 0, scored.errors
  if name in ('math_answer', 'exact_match', 'code_tests'):
    wrong = [label for (label, _), v in zip(corpus, scored.per_fn[name], strict=True) if v == 1.0]
    assert not wrong, wrong


def test_registry_is_covered():
  """A newly registered built-in reward must be added to the corpus test."""
  covered = {'math_answer', 'exact_match', 'format_think_answer', 'boxed_format', 'code_tests'}
  covered.add('reasoning_gym')  # its rows carry a dataset: tests/rewards/test_reasoning_gym.py
  builtin = {n for n, fn in rewards.REGISTRY.items() if fn.__module__.startswith('jrl.')}
  assert builtin <= covered, builtin - covered


def test_judge_parsers_and_prompts_hold(canary):
  """The judge's verdict parsers return a verdict or None for every hostile
  text, and the judge prompt keeps each one inside its block (the delimiters
  it could forge are escaped)."""
  for label, text in hostile.corpus(canary):
    verdict = judge.parse_pairwise(text)
    assert verdict is None or verdict in ('a', 'b', 'tie', 'A', 'B'), (label, verdict)
    score = judge.parse_score(text)
    assert score is None or 1 <= score <= 10, (label, score)
    prompt = judge.pairwise_prompt('rubric', 'question', text, 'other')
    assert prompt.count('</response_a>') == 1, label


def test_calculator_tool_refuses_the_corpus(canary):
  for label, text in hostile.corpus(canary):
    try:
      value = tools.calculator(text)
    except tools.ToolError:
      continue
    assert abs(float(value)) <= tools.MAX_MAGNITUDE, (label, value)


def test_think_answer_format_is_the_regular_language_in_linear_time():
  """`format_think_answer` accepts exactly what the R1-style regex accepts
  (checked against the regex on every short string over the tags), without
  the regex's quadratic backtracking (the corpus has the inputs for that)."""
  import itertools
  import re

  from jrl.rewards.format import _think_answer

  regex = re.compile(r'\s*<think>.*?</think>\s*<answer>.*?</answer>\s*', re.DOTALL)
  atoms = ['<think>', '</think>', '<answer>', '</answer>', ' ', 'x']
  checked = 0
  for k in range(7):
    for parts in itertools.product(atoms, repeat=k):
      text = ''.join(parts)
      assert _think_answer(text) == (regex.fullmatch(text) is not None), text
      checked += 1
  assert checked > 50_000
