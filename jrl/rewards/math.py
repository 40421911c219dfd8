"""Answer checking for math tasks: extraction, normalisation, equivalence.

`extract_answer(text)` finds the final answer of a completion: the content
of the last `\\boxed{...}` (or `\\fbox{...}`), else what follows the last
`####`, else what follows the last "the answer is" / "answer:", else the
last number in the text.

`normalize(answer)` removes what does not change the value: surrounding
`$`, `\\left` / `\\right`, `\\!` and `\\,`, `\\text{...}` / `\\mathrm{...}`
wrappers, degree signs, a leading "x =", units and trailing words
("12 apples", "5 cm", "$5.00 dollars"), thousands separators ("1,234").

`is_equivalent(a, b)` is true when the normalised strings are equal, or
both are numbers equal within a relative tolerance (fractions, decimals,
`\\frac` / `\\dfrac` / `\\tfrac`, mixed signs, percentages: "50%" equals
both "50" and "0.5"), or both parse as expressions that math-verify (the
verifier TRL, veRL and MaxText use) finds equal (`\\sqrt{2}/2` and
`1/\\sqrt{2}`, `2\\pi` and `\\pi+\\pi`). Tuples and intervals are compared
element by element.

Model output is hostile data, and nothing here evaluates it as code: numbers
are read with `Fraction` / `float`, expressions with math-verify's LaTeX
grammar (never `sympy.parse_expr` / `sympify`, which run Python). Every step
is bounded: an extracted answer over `MAX_ANSWER_CHARS` is wrong; symbolic
comparison (`jrl.rewards.symbolic`) only for answers up to
`MAX_SYMBOLIC_CHARS` whose parsed tree passes its bounds (no exponent
towers, huge factorials or numbers of more than `MAX_DIGITS` digits), under
a `SYMBOLIC_DEADLINE_S` deadline in every thread: a SIGALRM timer in a
process's main thread (the reward workers), a helper process killed at the
deadline elsewhere (reward modes 'thread' and 'inline'). The tests run a
corpus of hostile completions
(tests/rewards/hostile.py) against every registered reward.

Registered rewards: `math_answer` (1 / 0; 0 when no answer is found, the
policy's doing; None only when the chunk's time budget ran out before the
answer was compared, which unscored completions are left out of the loss
for) and `exact_match`
(the stripped completion equals the answer).
"""

import logging
import math
import re
import time
from fractions import Fraction

from jrl.rewards import symbolic
from jrl.rewards.base import register, time_left

_log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 1000  # a longer extracted answer is wrong, never parsed
_NUMBER = re.compile(r'-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?|-?\.\d+')
_UNIT_WORDS = re.compile(r'(?<=[\d.}%])\s+[a-zA-Z][a-zA-Z .²³/^-]*$')


def _braced(text, start):
  """Content of the {...} group opening at text[start] == '{', or None."""
  depth = 0
  for j in range(start, len(text)):
    if text[j] == '{':
      depth += 1
    elif text[j] == '}':
      depth -= 1
      if depth == 0:
        return text[start + 1 : j]
  return None


def _last_boxed(text):
  for key in ('\\boxed', '\\fbox'):
    start = text.rfind(key + '{')
    if start >= 0:
      return _braced(text, start + len(key))
  start = text.rfind('\\boxed ')
  if start >= 0:
    return text[start + len('\\boxed ') :].split('$')[0].strip()
  return None


def extract_answer(text):
  """The final answer string of a completion, or None."""
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed.strip()
  if '####' in text:
    tail = text.rsplit('####', 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None
  lower = text.lower()
  for key in ('the answer is', 'answer:'):
    at = lower.rfind(key)
    if at >= 0:
      tail = text[at + len(key) :].strip()
      if tail:
        line = tail.splitlines()[0].strip().rstrip('.').strip()
        number = _NUMBER.match(line.lstrip('$'))
        return number.group(0) if number and number.end() == len(line.lstrip('$')) else line
  numbers = _NUMBER.findall(text)
  return numbers[-1] if numbers else None


def _unwrap(text, command):
  """Replaces every `\\command{x}` by `x`."""
  key = '\\' + command + '{'
  while key in text:
    start = text.find(key)
    inner = _braced(text, start + len(key) - 1)
    if inner is None:
      break
    text = text[:start] + inner + text[start + len(key) + len(inner) + 1 :]
  return text


def normalize(answer):
  """A canonical string for `answer` (see the module docstring)."""
  if answer is None:
    return None
  t = str(answer).strip()
  t = t.strip('$').strip()
  for command in ('text', 'textbf', 'mathrm', 'mathbf', 'boxed', 'mbox'):
    t = _unwrap(t, command)
  t = t.replace('\\%', '%')
  for token in ('\\left', '\\right', '\\!', '\\,', '\\;', '\\:', '\\displaystyle', '\\$'):
    t = t.replace(token, '')
  t = t.replace('^\\circ', '').replace('^{\\circ}', '').replace('°', '')
  t = t.replace('dfrac', 'frac').replace('tfrac', 'frac')
  t = t.rstrip('.').strip()
  # "x = 5" -> "5" (a single variable on the left).
  if re.fullmatch(r'[a-zA-Z]\s*=\s*.+', t):
    t = t.split('=', 1)[1].strip()
  # Units and trailing words after a number: "12 apples", "5 cm".
  if re.match(r'^-?[\d.,]', t):
    t = _UNIT_WORDS.sub('', t).strip()
  # Thousands separators: 1,234,567 (not tuples like 1,2).
  if re.fullmatch(r'-?\d{1,3}(,\d{3})+(\.\d+)?%?', t):
    t = t.replace(',', '')
  return t.replace(' ', '')


def to_number(text):
  """A Fraction (exact) or float for a normalised numeric answer, or None."""
  if text is None:
    return None
  t = normalize(text)
  sign = 1
  if t.startswith('-'):
    sign, t = -1, t[1:]
  frac = re.fullmatch(r'\\frac\{([^{}]+)\}\{([^{}]+)\}', t) or re.fullmatch(r'\\frac(\d)(\d)', t)
  if frac:
    num, den = to_number(frac.group(1)), to_number(frac.group(2))
    if num is None or den is None or den == 0:
      return None
    return sign * Fraction(num) / Fraction(den) if _exact(num, den) else sign * num / den
  percent = t.endswith('%')
  t = t.rstrip('%')
  if len(t) > symbolic.MAX_SYMBOLIC_CHARS or re.search(r'[eE][+-]?\d{4,}', t):
    return None  # '1e999999999' would build a number of a billion digits
  try:
    value = Fraction(t)
  except (ValueError, ZeroDivisionError):
    try:
      value = float(t)
    except ValueError:
      return None
    if not math.isfinite(value):
      return None
  return sign * (value / 100 if percent else value)


def _exact(*values):
  return all(isinstance(v, Fraction | int) for v in values)


def _numbers_equal(a, b, rel_tol):
  if _exact(a, b):
    return a == b
  return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)


def _split_tuple(t):
  if len(t) >= 2 and t[0] in '([' and t[-1] in ')]':
    return t[0], t[-1], t[1:-1].split(',')
  return None


def is_equivalent(a, b, rel_tol=1e-6):
  """Whether two answers denote the same value (see the module docstring)."""
  return _equivalent(a, b, rel_tol, symbolic.equal)


def _equivalent(a, b, rel_tol, decide):
  """`is_equivalent`, with `decide(na, nb)` deciding the pairs of normalised
  answers that only a symbolic comparison can decide."""
  if a is None or b is None or len(str(a)) > MAX_ANSWER_CHARS or len(str(b)) > MAX_ANSWER_CHARS:
    return False
  na, nb = normalize(a), normalize(b)
  if na is None or nb is None or not na or not nb:
    return False
  if na == nb:
    return True
  ta, tb = _split_tuple(na), _split_tuple(nb)
  if ta and tb:
    return (
      ta[0] == tb[0]
      and ta[1] == tb[1]
      and len(ta[2]) == len(tb[2])
      and all(_equivalent(x, y, rel_tol, decide) for x, y in zip(ta[2], tb[2], strict=True))
    )
  va, vb = to_number(na), to_number(nb)
  if va is not None and vb is not None:
    if _numbers_equal(va, vb, rel_tol):
      return True
    # A percentage may be written as a fraction of 1: "50%" == "0.5".
    pa, pb = na.endswith('%'), nb.endswith('%')
    if pa != pb:
      return _numbers_equal(va * (100 if pa else 1), vb * (100 if pb else 1), rel_tol)
    return False
  # Not both plain numbers: only a symbolic comparison can still say equal
  # (2\sqrt{2} and \sqrt{8}, x^2+2x+1 and (x+1)^2).
  return decide(na, nb)


class _Undecided(Exception):
  """Only a symbolic comparison can decide this pair."""


def _undecided(a, b):
  raise _Undecided(a, b)


CHUNK_BUDGET = 0.8  # share of a chunk's time in the reward service that math_answer spends


@register('math_answer')
def math_answer(prompts, completions, metadata):
  """1.0 if the extracted answer is equivalent to metadata['answer'], 0.0 if
  not or if no answer can be found in the completion (writing none is the
  policy's doing: it must not escape the loss as unscored), None if the
  chunk's budget ran out before its answer could be compared.

  The budget: inside the reward service, CHUNK_BUDGET of the time the service
  waits for the call (`time_left()`: a chunk's `reward.timeout_s`); no budget
  outside it. Answers that strings and numbers decide are scored first;
  those that need a symbolic comparison follow, each under
  SYMBOLIC_DEADLINE_S or what is left of the budget if that is less. One
  that runs out of its full SYMBOLIC_DEADLINE_S is 0.0 (too costly to check
  is wrong); one cut short by the budget, or not reached, is None. So slow
  answers never leave the rest of their chunk unscored.
  """
  del prompts
  left = time_left()
  end = math.inf if left is None else time.monotonic() + CHUNK_BUDGET * left

  def within_budget(a, b):
    remaining = end - time.monotonic()
    if remaining <= 0:
      raise symbolic.Deadline("the chunk's budget is spent")
    seconds = min(symbolic.SYMBOLIC_DEADLINE_S, remaining)
    return symbolic.compare(a, b, seconds, start_s=min(symbolic.HELPER_START_S, remaining))

  out, deferred = [], []
  for i, (completion, meta) in enumerate(zip(completions, metadata, strict=True)):
    got = extract_answer(completion)
    try:
      out.append(0.0 if got is None else float(_equivalent(got, meta['answer'], 1e-6, _undecided)))
    except _Undecided:
      out.append(None)
      deferred.append((i, got))
  for i, got in deferred:
    try:
      out[i] = float(_equivalent(got, metadata[i]['answer'], 1e-6, within_budget))
    except symbolic.Deadline:
      out[i] = None if time.monotonic() >= end else 0.0
  unscored = sum(out[i] is None for i, _ in deferred)
  if unscored:
    _log.warning(
      "math_answer: %d of %d answers unscored: the chunk's budget (%.3g s, %d%% of the reward "
      "service's timeout) ran out during symbolic comparisons",
      unscored,
      len(out),
      CHUNK_BUDGET * left,
      round(100 * CHUNK_BUDGET),
    )
  return out


@register('exact_match')
def exact_match(prompts, completions, metadata):
  """1.0 if the completion, stripped of surrounding whitespace, is the answer."""
  del prompts
  return [
    float(c.strip() == str(m['answer']).strip()) for c, m in zip(completions, metadata, strict=True)
  ]
