"""The warm launcher (`jrl.rewards.sandbox.zygote`): runs forked from one
process that built the new root once give the same results as runs that
start their own launcher, keep nothing of one run for the next, and survive
the zygote's death. The isolation itself is tested through it by
test_sandbox.py, test_hostile.py and test_code_judge.py, whose runs go
through the zygote wherever it is used."""

import json
import os
import re
import secrets
import signal

import pytest

from jrl.rewards import sandbox
from jrl.rewards.sandbox import Limits, zygote

FAST = Limits(wall_seconds=3, cpu_seconds=2)
# The CPU limit must fire before the wall clock however loaded the machine is:
# one CPU second within a wall budget that even a quarter of a core meets.
CPU_BOUND = Limits(wall_seconds=20, cpu_seconds=1)
PLAN = sandbox._get_plan()
pytestmark = pytest.mark.skipif(
  not zygote.eligible(PLAN),
  reason='no zygote under this plan (not root with namespaces): every run starts a launcher',
)

PROGRAMS = {
  'stdin to stdout': ('import sys\nprint(sys.stdin.read()[::-1])\n', 'abc'),
  'exit code and stderr': ('import sys\nsys.stderr.write("oops")\nsys.exit(3)\n', ''),
  'exception': ('raise ValueError("boom")\n', ''),
  'cpu limit': ('while True:\n  pass\n', ''),
  'wall clock': ('import time\ntime.sleep(30)\n', ''),
  'memory': ('x = bytearray(1 << 34)\n', ''),
  'uid and workdir': (
    'import os\nprint(os.getuid() != 0, os.getgid() != 0, sorted(os.listdir(".")))\n',
    '',
  ),
  'output cap': ('print("x" * (1 << 20))\n', ''),
}


def _both(monkeypatch, source, stdin, limits=FAST):
  warm = sandbox.run_program(source, stdin, limits=limits)
  monkeypatch.setattr(zygote, 'ENABLED', False)
  cold = sandbox.run_program(source, stdin, limits=limits)
  monkeypatch.setattr(zygote, 'ENABLED', True)
  return warm, cold


@pytest.mark.parametrize('name', list(PROGRAMS))
def test_a_zygote_run_equals_a_run_with_its_own_launcher(monkeypatch, name):
  assert zygote.get() is not None
  limits = CPU_BOUND if name == 'cpu limit' else FAST
  warm, cold = _both(monkeypatch, *PROGRAMS[name], limits=limits)
  assert warm.status == cold.status, (warm, cold)
  assert warm.returncode == cold.returncode
  assert warm.stdout == cold.stdout
  workdir = re.compile(r'/tmp/jrl_sandbox_\w+')  # each path names its own workdir
  assert workdir.sub('WD', warm.stderr) == workdir.sub('WD', cold.stderr)


def test_the_driver_runs_warm_with_the_same_results(monkeypatch):
  job = {
    'mode': 'call',
    'fn': 'f',
    'cls': None,
    'cases': [{'args': [i], 'kwargs': {'$d': []}} for i in range(4)],
    'case_wall_s': 1.0,
    'case_cpu_s': 1,
    'deadline_s': 20,
    'max_output_bytes': 4096,
  }
  solution = 'def f(x):\n  while x == 2: pass\n  return [x, x * x]\n'
  runs = []
  for enabled in (True, False):
    monkeypatch.setattr(zygote, 'ENABLED', enabled)
    r = sandbox.run_driver(
      json.dumps(job), limits=Limits(wall_seconds=20), files={'solution.py': solution}
    )
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    starts = [row['start'] for row in rows if 'start' in row]
    assert starts == [0, 1, 2, 3]  # each case reported as it starts
    runs.append([(row.get('status'), row.get('value')) for row in rows if 'start' not in row])
  assert runs[0] == runs[1]
  assert runs[0][:4] == [('ok', '[0, 0]'), ('ok', '[1, 1]'), ('timeout', None), ('ok', '[3, 9]')]


SCAN = """
import ctypes
needle = bytes(reversed({reversed_needle!r}))
found = 0
for line in open('/proc/self/maps'):
  parts = line.split()
  if not parts[1].startswith('rw') or (len(parts) > 5 and parts[5].startswith('[v')):
    continue
  lo, hi = (int(x, 16) for x in parts[0].split('-'))
  found += ctypes.string_at(lo, hi - lo).count(needle)
print(found)
"""


def test_no_run_leaves_its_data_in_the_memory_a_later_run_is_forked_from():
  needle = f'LEAK-{secrets.token_hex(8)}'.encode()
  scan = SCAN.format(reversed_needle=bytes(reversed(needle)))
  mine = sandbox.run_program(f'keep = {needle!r} * 2\n' + scan, limits=FAST)
  assert mine.status == 'ok' and int(mine.stdout) >= 2  # the scan finds what is there
  secret = needle.decode() * 2000
  sandbox.run_program('import sys\nsys.stdin.read()\n', secret, limits=FAST, files={'t': secret})
  sandbox.run_driver('{"mode": "stdin"}', limits=FAST, files={'solution.py': secret})
  later = sandbox.run_program(scan, limits=FAST)
  assert later.status == 'ok' and int(later.stdout) <= 1, later  # only the needle itself


def test_a_dead_zygote_is_replaced():
  first = zygote.get()
  os.kill(first.proc.pid, signal.SIGKILL)
  first.proc.wait()
  r = sandbox.run_program('print(6 * 7)', limits=FAST)
  assert r.status == 'ok' and r.stdout == '42\n'
  assert zygote.get() is not first and zygote.get().alive()
