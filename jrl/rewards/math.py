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
comparison only for answers up to `MAX_SYMBOLIC_CHARS` whose parsed tree
passes `_within_bounds` (no exponent towers, huge factorials or numbers of
more than `MAX_DIGITS` digits), under a `SYMBOLIC_DEADLINE_S` deadline in
every thread: a SIGALRM timer in a process's main thread (the reward
workers), a helper process killed at the deadline elsewhere (reward modes
'thread' and 'inline'). The tests run a corpus of hostile completions
(tests/rewards/hostile.py) against every registered reward.

Registered rewards: `math_answer` (1 / 0, None when no answer is found or
the chunk's time budget ran out before it was compared) and `exact_match`
(the stripped completion equals the answer).
"""

import contextlib
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from multiprocessing import connection

from jrl.rewards.base import register, time_left
from jrl.rewards.service import read_message, write_message

# math-verify warns once per process that its own (SIGALRM) timeouts are off; ours
# are on (see `_deadline`).
logging.getLogger('math_verify').setLevel(logging.ERROR)
_log = logging.getLogger(__name__)

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
  if len(t) > MAX_SYMBOLIC_CHARS or re.search(r'[eE][+-]?\d{4,}', t):
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


# Symbolic equivalence ------------------------------------------------------------
#
# Answers are model output: hostile data. They are parsed by math-verify's LaTeX
# grammar (latex2sympy2_extended, an ANTLR parser that builds sympy objects
# from a fixed set of tokens and never evaluates text as Python) and compared
# with math-verify's `verify`. Before anything is simplified, the parsed tree
# must pass `_within_bounds`: a bounded number of nodes and a bounded size of
# every number it denotes, so that exponent towers (2^{2^{2^{100}}}), huge
# factorials and deep nesting are refused without being computed. The
# comparison itself runs under a deadline (`SYMBOLIC_DEADLINE_S`). In a
# process's main thread (the reward worker processes) that is a SIGALRM timer
# around the comparison; a signal reaches only the main thread, so any other
# thread (reward modes 'thread' and 'inline') hands the comparison to a helper
# process (`serve_symbolic`) and kills it if it has not answered by the
# deadline; the next comparison starts a fresh one.

MAX_ANSWER_CHARS = 1000  # a longer extracted answer is wrong, never parsed
MAX_SYMBOLIC_CHARS = 200  # longer answers are compared as strings and numbers only
MAX_DEPTH = 10  # nesting of brackets in a symbolic answer (the parser slows with depth)
MAX_NODES = 400  # nodes of a parsed expression
MAX_DIGITS = 20_000  # decimal digits any number in an expression may denote
MAX_EXPONENT = 1000  # |exponent| of a power, |n| of a factorial or binomial
SYMBOLIC_DEADLINE_S = 2.0  # per symbolic comparison
HELPER_START_S = 30.0  # at most this long for a helper process to import math-verify
_HELPER_GRACE_S = 0.25  # a helper silent this long past its own deadline is killed
_HELPER_COMMAND = (
  sys.executable,
  '-c',
  'from jrl.rewards.math import serve_symbolic; serve_symbolic()',
)


class _Deadline(BaseException):
  """The symbolic comparison ran out of time. A BaseException, so that the
  `except Exception` blocks inside sympy and math-verify do not swallow it."""


@contextlib.contextmanager
def _deadline(seconds):
  """Raises `_Deadline` inside the block after `seconds` (a SIGALRM timer: the
  main thread only)."""
  if seconds <= 0:
    raise _Deadline('no time left for a symbolic comparison')

  def expire(signum, frame):
    del signum, frame
    raise _Deadline(f'symbolic comparison exceeded {seconds:g} s')

  previous = signal.signal(signal.SIGALRM, expire)
  # Fires again every 50 ms until cleared, in case one is swallowed anyway.
  signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def _nesting_depth(text):
  depth = deepest = 0
  for ch in text:
    if ch in '([{':
      depth += 1
      deepest = max(deepest, depth)
    elif ch in ')]}':
      depth -= 1
  return deepest


def _digits(number):
  """Decimal digits of a sympy Rational's numerator and denominator."""
  p, q = abs(int(number.p)), abs(int(number.q))
  return max(1, p.bit_length() * 30103 // 100000 + 1) + max(0, q.bit_length() * 30103 // 100000)


def _number_atoms(expr):
  import sympy

  return [a for a in sympy.preorder_traversal(expr) if isinstance(a, sympy.Number)]


def _within_bounds(expr):
  """Whether simplifying `expr` (a parsed sympy object) stays small.

  Sums, products, integrals, limits and derivatives are refused. Every
  power's exponent and every factorial's argument must be free of powers and
  factorials and hold numbers of magnitude <= MAX_EXPONENT; the numbers under
  a power count that many times over (scale), and no number may then denote
  more than MAX_DIGITS digits.
  """
  import sympy
  from sympy.concrete.expr_with_limits import ExprWithLimits
  from sympy.functions.combinatorial.factorials import CombinatorialFunction

  unbounded = (ExprWithLimits, sympy.Limit, sympy.Derivative)  # sums, products, integrals
  nodes = 0
  stack = [(expr, 1)]
  while stack:
    node, scale = stack.pop()
    nodes += 1
    if nodes > MAX_NODES or isinstance(node, unbounded):
      return False
    if isinstance(node, sympy.Rational):
      if _digits(node) * scale > MAX_DIGITS:
        return False
      continue
    if isinstance(node, sympy.Float):
      if abs(node) > 10**MAX_EXPONENT:
        return False
      continue
    if isinstance(node, sympy.Pow | sympy.exp | CombinatorialFunction):
      inner = node.args[1:] if isinstance(node, sympy.Pow) else node.args
      for arg in inner:
        if arg.has(sympy.Pow, sympy.exp, CombinatorialFunction):
          return False  # towers: 2^{2^{n}}, (n!)!, e^{e^{n}}
        numbers = _number_atoms(arg)
        magnitude = max([1] + [abs(float(n)) for n in numbers])
        if magnitude > MAX_EXPONENT or len(numbers) > MAX_NODES:
          return False
        scale *= max(1, int(magnitude))
        if scale > MAX_DIGITS:
          return False
      if isinstance(node, sympy.Pow):
        stack.append((node.base, scale))
      continue
    stack.extend((arg, scale) for arg in getattr(node, 'args', ()))
  return True


def _parse_symbolic(text):
  """The sympy object math-verify's LaTeX grammar makes of `text`, or None."""
  import math_verify

  parsed = math_verify.parse(
    '$' + text + '$',
    extraction_config=[math_verify.LatexExtractionConfig()],
    parsing_timeout=None,  # our own deadline is around the caller
  )
  return parsed[0] if parsed and not isinstance(parsed[0], str) else None


def _compare_here(a, b, seconds):
  """`_symbolic_compare` in this process, under SIGALRM (main thread only)."""
  import math_verify

  try:
    with _deadline(seconds):
      pred, gold = _parse_symbolic(a), _parse_symbolic(b)
      if pred is None or gold is None:
        return False
      if not (_within_bounds(pred) and _within_bounds(gold)):
        return False
      return bool(math_verify.verify(gold, pred, timeout_seconds=None))
  except Exception:  # anything the parser or sympy cannot decide (recursion, memory) is "not equal"
    return False


def serve_symbolic():
  """The loop of a helper process (`_Helper`): reads (a, b, seconds) requests
  on stdin and answers each with True / False, or 'deadline' when the
  comparison ran out of `seconds`; 'ready' first, once math-verify is loaded."""
  answers = os.fdopen(os.dup(1), 'wb')
  os.dup2(2, 1)  # anything the libraries print goes to stderr, never into the answers
  _compare_here('1', '1', HELPER_START_S)  # imports math-verify and builds its grammar
  try:
    write_message(answers, 'ready')
    while (request := read_message(sys.stdin.buffer)) is not None:
      a, b, seconds = request
      try:
        verdict = _compare_here(a, b, seconds)
      except _Deadline:
        verdict = 'deadline'
      write_message(answers, verdict)
  except BrokenPipeError:  # the caller has gone
    pass


class _Helper:
  """A `serve_symbolic` process, used by one thread at a time."""

  def __init__(self):
    self.process = subprocess.Popen(
      _HELPER_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    self.ready = False

  def _answer(self, seconds):
    if not connection.wait([self.process.stdout], timeout=max(0.0, seconds)):
      raise _Deadline(f'no answer from the symbolic helper within {seconds:g} s')
    answer = read_message(self.process.stdout)
    if answer is None:
      raise OSError(f'the symbolic helper exited (code {self.process.poll()})')
    return answer

  def compare(self, a, b, seconds, start_s):
    """True / False / 'deadline' (the helper stopped itself at `seconds`);
    raises _Deadline when it does not answer in time (`start_s` more for a
    helper that is still starting)."""
    if not self.ready:
      if self._answer(start_s) != 'ready':
        raise OSError('the symbolic helper did not start')
      self.ready = True
    write_message(self.process.stdin, (a, b, seconds))
    return self._answer(seconds + _HELPER_GRACE_S)

  def kill(self):
    self.process.kill()
    self.process.wait()
    for stream in (self.process.stdin, self.process.stdout):
      with contextlib.suppress(OSError):
        stream.close()


_idle_helpers = []  # started helpers no thread is using
_helpers_lock = threading.Lock()


def _compare_in_helper(a, b, seconds, start_s):
  """`_symbolic_compare` in an idle helper process (started if there is none);
  a helper that misses its deadline is killed and a fresh one started."""
  with _helpers_lock:
    helper = _idle_helpers.pop() if _idle_helpers else None
  helper = helper or _Helper()
  try:
    verdict = helper.compare(a, b, seconds, start_s)
  except BaseException as e:  # late, dead or interrupted: never reused
    helper.kill()
    with _helpers_lock:
      _idle_helpers.append(_Helper())  # starts now, ready for the next comparison
    if isinstance(e, Exception):  # the helper failed (crashed, out of memory): "not equal"
      return False
    raise
  with _helpers_lock:
    _idle_helpers.append(helper)
  if verdict == 'deadline':
    raise _Deadline(f'symbolic comparison exceeded {seconds:g} s')
  return verdict


def close_helpers():
  """Stops the idle helper processes (the next comparison outside a main
  thread starts a fresh one)."""
  with _helpers_lock:
    helpers, _idle_helpers[:] = list(_idle_helpers), []
  for helper in helpers:
    helper.kill()


def _symbolic_compare(a, b, seconds, start_s=HELPER_START_S):
  """Whether normalised answers `a` (prediction) and `b` (reference) are equal
  as expressions; False whenever that cannot be decided within bounds.

  Raises `_Deadline` when `seconds` run out first. In a process's main thread
  the comparison runs here; in any other thread in a helper process (whose
  start, the first time, may take up to `start_s` more).
  """
  for text in (a, b):
    if len(text) > MAX_SYMBOLIC_CHARS or _nesting_depth(text) > MAX_DEPTH:
      return False
  if threading.current_thread() is threading.main_thread():
    return _compare_here(a, b, seconds)
  return _compare_in_helper(a, b, seconds, start_s)


def _symbolic_equal(a, b):
  """`_symbolic_compare` with `SYMBOLIC_DEADLINE_S`; False when it runs out."""
  try:
    return _symbolic_compare(a, b, SYMBOLIC_DEADLINE_S)
  except _Deadline:
    return False


def _split_tuple(t):
  if len(t) >= 2 and t[0] in '([' and t[-1] in ')]':
    return t[0], t[-1], t[1:-1].split(',')
  return None


def is_equivalent(a, b, rel_tol=1e-6):
  """Whether two answers denote the same value (see the module docstring)."""
  return _equivalent(a, b, rel_tol, _symbolic_equal)


def _equivalent(a, b, rel_tol, symbolic):
  """`is_equivalent`, with `symbolic(na, nb)` deciding the pairs of normalised
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
      and all(_equivalent(x, y, rel_tol, symbolic) for x, y in zip(ta[2], tb[2], strict=True))
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
  return symbolic(na, nb)


class _Undecided(Exception):
  """Only a symbolic comparison can decide this pair."""


def _undecided(a, b):
  raise _Undecided(a, b)


CHUNK_BUDGET = 0.8  # share of a chunk's time in the reward service that math_answer spends


@register('math_answer')
def math_answer(prompts, completions, metadata):
  """1.0 if the extracted answer is equivalent to metadata['answer'], 0.0 if
  not, None if no answer can be found in the completion, or if the chunk's
  budget ran out before its answer could be compared.

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

  def symbolic(a, b):
    remaining = end - time.monotonic()
    if remaining <= 0:
      raise _Deadline("the chunk's budget is spent")
    seconds = min(SYMBOLIC_DEADLINE_S, remaining)
    return _symbolic_compare(a, b, seconds, start_s=min(HELPER_START_S, remaining))

  out, deferred = [], []
  for i, (completion, meta) in enumerate(zip(completions, metadata, strict=True)):
    got = extract_answer(completion)
    try:
      out.append(None if got is None else float(_equivalent(got, meta['answer'], 1e-6, _undecided)))
    except _Undecided:
      out.append(None)
      deferred.append((i, got))
  for i, got in deferred:
    try:
      out[i] = float(_equivalent(got, metadata[i]['answer'], 1e-6, symbolic))
    except _Deadline:
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
