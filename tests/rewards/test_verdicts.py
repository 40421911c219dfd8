"""Verdicts no program can forge, and failures that are the program's own
(`jrl.rewards.code.judge`, `sandbox/driver.py`).

Asserts mode: the check runs in a process the program never ran in, and
only that process can report a pass; forged reports on every descriptor,
memory searches for the check's expected values, always-equal objects and
killing the check all fail. Failures: a program that stops, kills or
outlives its driver scores 0.0 under every score and budget, in about one
case's time; looping programs cost their own limits and never unscore
their correct neighbours.
"""

import time
import uuid

import pytest

from jrl.rewards import code
from jrl.rewards.code import formats
from jrl.rewards.sandbox import Limits

FAST = Limits(wall_seconds=1.0, cpu_seconds=1)
SECRETS = [uuid.uuid4().hex for _ in range(3)]  # computable by nothing but the check


@pytest.fixture(autouse=True)
def _isolated():
  code.check_sandbox()  # refuses where the sandbox is degraded: these tests need it


# Asserts mode -------------------------------------------------------------------------

ASSERT_ROW = {
  'test': (
    'def check(candidate):\n'
    f'  want = {SECRETS!r}\n'
    '  for x in range(3):\n'
    '    assert candidate(x) == want[x]\n'
  ),
  'entry_point': 'f',
  'prompt': 'def f(x):\n',
}

# One forged report written to every descriptor the program may hold.
FORGE = """
import os
def f(x):
  return 0
for fd in range(3, 256):
  try:
    os.write(fd, {line!r}.encode())
  except OSError:
    pass
os._exit(0)
"""
FORGE_VALUE = FORGE.format(line='{"value": "0"}')
FORGE_OK = FORGE.format(line='{"ok": true}')

SEARCH_MEMORY = """
import gc, re, sys
def f(x):
  texts = [o for o in gc.get_objects() if isinstance(o, str) and 'want' in o]
  frame, names = sys._getframe(), []
  while frame is not None:
    for scope in (frame.f_globals, frame.f_locals):
      texts += [repr(v) for v in scope.values()]
    frame = frame.f_back
  for text in texts:
    found = re.findall(r"'([0-9a-f]{32})'", text)
    if len(found) >= 3:
      return found[x]
  return 'not found'
"""

KILL_THE_CHECK = """
import os, signal
def f(x):
  for pid in os.listdir('/proc'):
    if pid.isdigit() and int(pid) != os.getpid():
      try:
        os.kill(int(pid), signal.SIGKILL)
      except OSError:
        pass
  return x
"""

ALWAYS_EQUAL = """
class A(str):
  def __eq__(self, other):
    return True
  __hash__ = str.__hash__
def f(x):
  return A('x')
"""

PATCH_THE_CHECK = """
import builtins
builtins.AssertionError = type('Quiet', (Exception,), {})
builtins.isinstance = lambda *a: True
def f(x):
  return 'wrong'
"""


def _asserts(body, **settings):
  tests = formats.parse(ASSERT_ROW, asserts='in_program')
  assert tests.kind == 'asserts'
  source = code.program_source(f'```python\n{body}```', tests)
  return code.score_program(source, tests, limits=FAST, **settings)


def test_the_check_passes_a_right_program_and_reads_its_helpers():
  right = f'def f(x):\n  return {SECRETS!r}[x]\n'
  assert _asserts(right) == 1.0
  # Names the program defines besides the entry point are called over the pipe too.
  helper = f'def g(x):\n  return {SECRETS!r}[x]\ndef f(x):\n  return g(x)\n'
  row = dict(ASSERT_ROW, test=ASSERT_ROW['test'].replace('candidate(x)', 'g(x)'))
  tests = formats.parse(row, asserts='in_program')
  assert code.score_program(code.program_source(f'```python\n{helper}```', tests), tests) == 1.0


@pytest.mark.parametrize(
  'body',
  [FORGE_VALUE, FORGE_OK, SEARCH_MEMORY, KILL_THE_CHECK, ALWAYS_EQUAL, PATCH_THE_CHECK],
  ids=['forged_value', 'forged_ok', 'memory_search', 'kill_check', 'always_equal', 'patched'],
)
def test_no_program_forges_an_asserts_pass(body):
  for score in ('all', 'fraction'):
    assert _asserts(body, score=score) == 0.0, score


# Failures are the program's own ----------------------------------------------------------

CALL_ROW = {'tests': {'fn_name': 'f', 'cases': [{'args': [i], 'output': i * i} for i in range(8)]}}

RIGHT = 'def f(x):\n  return x * x\n'
STOP_DRIVER = 'import os, signal\ndef f(x):\n  os.kill(os.getppid(), signal.SIGSTOP)\n  return -1\n'
KILL_DRIVER = 'import os, signal\ndef f(x):\n  os.kill(os.getppid(), signal.SIGKILL)\n  return -1\n'
KILL_ALL = 'import os, signal\ndef f(x):\n  os.kill(-1, signal.SIGKILL)\n  return -1\n'
# Right on case 0; a daemon it left behind stops the driver during case 1.
DAEMON = """
import os, signal, time
def f(x):
  if x == 0:
    driver = os.getppid()
    if os.fork() == 0:
      os.setsid()
      time.sleep(0.3)
      os.kill(driver, signal.SIGSTOP)
      os._exit(0)
    return 0
  time.sleep(0.5)
  return x * x
"""
LOOPER = 'def f(x):\n  while True:\n    pass\n'


def _calls(sources, *, score, budget_s, concurrency=4):
  fields = {'score': score, 'budget_s': budget_s, 'concurrency': concurrency, 'case_wall_s': 1.0}
  code.configure_sandbox(False, code.Settings(**fields))
  try:
    t0 = time.monotonic()
    got = code.code_tests(None, [f'```python\n{s}```' for s in sources], [CALL_ROW] * len(sources))
    return got, time.monotonic() - t0
  finally:
    code.configure_sandbox(False, code.Settings())


@pytest.mark.parametrize('name', ['stop_driver', 'kill_driver', 'kill_all', 'daemon', 'looper'])
def test_a_program_that_ends_or_stops_its_driver_fails_whatever_the_budget(name):
  body = {
    'stop_driver': STOP_DRIVER,
    'kill_driver': KILL_DRIVER,
    'kill_all': KILL_ALL,
    'daemon': DAEMON,
    'looper': LOOPER,
  }[name]
  for score in ('all', 'fraction'):
    # A budget that fits one case (+ the slack) and one that fits them all.
    for budget_s in (3.5, 40.0):
      (got,), wall = _calls([body], score=score, budget_s=budget_s)
      # The daemon's program passed case 0 before its daemon stopped the driver.
      want = 1 / 8 if name == 'daemon' and score == 'fraction' else 0.0
      assert got == want, (score, budget_s)
      if score == 'all':  # one failing case fixes the score: it costs one case's time
        assert wall < 8.0, (name, budget_s, wall)


@pytest.mark.parametrize('score', ['all', 'fraction'])
def test_loopers_never_unscore_their_correct_neighbours(score):
  """4 problems x 8 samples, the first two of each group loop forever."""
  clean = [RIGHT] * 32
  loopy = ([LOOPER] * 2 + [RIGHT] * 6) * 4
  got, wall_clean = _calls(clean, score=score, budget_s=40.0)
  assert got == [1.0] * 32
  got, wall = _calls(loopy, score=score, budget_s=10.0)
  assert got == ([0.0] * 2 + [1.0] * 6) * 4
  # Under 'all' a looper stops at its first case; under 'fraction' at its
  # share of the budget (10 s x 4 / 32 programs): at most its own limits.
  own_limits = 8 * (8 * 1.05 + code.judge.STARTUP_S + code.judge.REPORT_SLACK_S) / 4
  print(f'{score}: 32 programs at concurrency 4: {wall_clean:.1f} s; with 8 loopers {wall:.1f} s')
  assert wall <= wall_clean + own_limits, (wall, wall_clean)
