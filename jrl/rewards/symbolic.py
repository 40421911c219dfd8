"""Symbolic equivalence of two answers, bounded: what `jrl.rewards.math` asks
when strings and numbers cannot decide.

Answers are model output: hostile data. They are parsed by math-verify's LaTeX
grammar (latex2sympy2_extended, an ANTLR parser that builds sympy objects
from a fixed set of tokens and never evaluates text as Python) and compared
with math-verify's `verify`. Before anything is simplified, the parsed tree
must pass `_within_bounds`: a bounded number of nodes and a bounded size of
every number it denotes, so that exponent towers (2^{2^{2^{100}}}), huge
factorials and deep nesting are refused without being computed. The
comparison itself runs under a deadline (`SYMBOLIC_DEADLINE_S`). In a
process's main thread (the reward worker processes) that is a SIGALRM timer
around the comparison; a signal reaches only the main thread, so any other
thread (reward modes 'thread' and 'inline') hands the comparison to a helper
process (`serve_symbolic`) and kills it if it has not answered by the
deadline; the next comparison starts a fresh one.
"""

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from multiprocessing import connection

from jrl.rewards.service import read_message, write_message

# math-verify warns once per process that its own (SIGALRM) timeouts are off; ours
# are on (see `_deadline`).
logging.getLogger('math_verify').setLevel(logging.ERROR)

MAX_SYMBOLIC_CHARS = 200  # longer answers are compared as strings and numbers only
MAX_DEPTH = 10  # nesting of brackets in a symbolic answer (the parser slows with depth)
MAX_NODES = 400  # nodes of a parsed expression
MAX_DIGITS = 20_000  # decimal digits any number in an expression may denote
MAX_EXPONENT = 1000  # |exponent| of a power, |n| of a factorial or binomial
SYMBOLIC_DEADLINE_S = 2.0  # per symbolic comparison
HELPER_START_S = 30.0  # at most this long for a helper process to import math-verify
_HELPER_GRACE_S = 0.25  # a helper silent this long past its own deadline is killed
# Comparisons a helper makes before it says 'ready': the first comparison of
# each kind loads parts of sympy lazily (0.6 s for the first polynomial here),
# which would otherwise count against a caller's deadline and score a correct
# answer as wrong.
_WARM_UP = (
  ('1', '1'),
  ('(x+1)^2', 'x^2+2x+1'),
  ('\\frac{\\sqrt{8}}{2}', '\\sqrt{2}'),
  ('\\sin(x)^2+\\cos(x)^2', '1'),
  ('\\{1,2\\}', '\\{2,1\\}'),
  ('[0,1)', '[0,1)'),
  ('\\begin{pmatrix}1\\\\2\\end{pmatrix}', '\\begin{pmatrix}1\\\\2\\end{pmatrix}'),
)
_HELPER_COMMAND = (
  sys.executable,
  '-c',
  'from jrl.rewards.symbolic import serve_symbolic; serve_symbolic()',
)


class Deadline(BaseException):
  """The symbolic comparison ran out of time. A BaseException, so that the
  `except Exception` blocks inside sympy and math-verify do not swallow it."""


@contextlib.contextmanager
def _deadline(seconds):
  """Raises `Deadline` inside the block after `seconds` (a SIGALRM timer: the
  main thread only)."""
  if seconds <= 0:
    raise Deadline('no time left for a symbolic comparison')

  def expire(signum, frame):
    del signum, frame
    raise Deadline(f'symbolic comparison exceeded {seconds:g} s')

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
  """`compare` in this process, under SIGALRM (main thread only)."""
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
  for a, b in _WARM_UP:  # imports math-verify, builds its grammar, loads sympy's lazy parts
    _compare_here(a, b, HELPER_START_S)
  try:
    write_message(answers, 'ready')
    while (request := read_message(sys.stdin.buffer)) is not None:
      a, b, seconds = request
      try:
        verdict = _compare_here(a, b, seconds)
      except Deadline:
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
      raise Deadline(f'no answer from the symbolic helper within {seconds:g} s')
    answer = read_message(self.process.stdout)
    if answer is None:
      raise OSError(f'the symbolic helper exited (code {self.process.poll()})')
    return answer

  def compare(self, a, b, seconds, start_s):
    """True / False / 'deadline' (the helper stopped itself at `seconds`);
    raises Deadline when it does not answer in time (`start_s` more for a
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
  """`compare` in an idle helper process (started if there is none);
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
    raise Deadline(f'symbolic comparison exceeded {seconds:g} s')
  return verdict


def close_helpers():
  """Stops the idle helper processes (the next comparison outside a main
  thread starts a fresh one)."""
  with _helpers_lock:
    helpers, _idle_helpers[:] = list(_idle_helpers), []
  for helper in helpers:
    helper.kill()


def compare(a, b, seconds, start_s=HELPER_START_S):
  """Whether normalised answers `a` (prediction) and `b` (reference) are equal
  as expressions; False whenever that cannot be decided within bounds.

  Raises `Deadline` when `seconds` run out first. In a process's main thread
  the comparison runs here; in any other thread in a helper process (whose
  start, the first time, may take up to `start_s` more).
  """
  for text in (a, b):
    if len(text) > MAX_SYMBOLIC_CHARS or _nesting_depth(text) > MAX_DEPTH:
      return False
  if threading.current_thread() is threading.main_thread():
    return _compare_here(a, b, seconds)
  return _compare_in_helper(a, b, seconds, start_s)


def equal(a, b):
  """`compare` with `SYMBOLIC_DEADLINE_S`; False when it runs out."""
  try:
    return compare(a, b, SYMBOLIC_DEADLINE_S)
  except Deadline:
    return False
