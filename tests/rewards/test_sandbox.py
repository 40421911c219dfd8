"""Tests for the code sandbox (`jrl.rewards.sandbox`) and the code reward
(`jrl.rewards.code`).

Scoring: correct, partially correct and broken programs. Containment: an
adversarial suite, each program run under tight limits (1 s CPU, 2 s wall),
checked for its status and for what it tried to do, after which a correct
program must still score 1.0. Every adversarial program re-executes itself
with a unique marker in its argv, so that it and everything it forks can be
found in /proc; the last test asserts none is left. What is asserted
depends on `capabilities()`: where a mechanism is missing, the test asserts
the degraded behaviour the module documents instead of skipping.
"""

import ast
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from jrl.rewards import code, sandbox
from jrl.rewards.base import get_reward_fn
from jrl.rewards.sandbox import launcher, rootfs
from jrl.rewards.sandbox import plan as sandbox_plan
from jrl.rewards.service import RewardService

CAPS = sandbox.capabilities()
MiB = sandbox.MiB
FAST = sandbox.Limits(
  wall_seconds=2,
  cpu_seconds=1,
  memory_bytes=256 * MiB,
  max_processes=16,
  max_output_bytes=16 * 1024,
  max_disk_bytes=4 * MiB,
)
FAST_META = dataclasses.asdict(FAST)  # the same limits, as metadata['limits']
RUN_ID = uuid.uuid4().hex[:12]
MARKERS = []  # one per adversarial program made
SEEN_WORKDIRS = []  # workdirs reported by programs; all must be gone
ESCAPES = [  # paths the escape program tries to create
  f'/tmp/jrl_escape_{RUN_ID}',
  os.path.join(os.getcwd(), f'jrl_escape_{RUN_ID}'),
  f'/dev/shm/jrl_escape_{RUN_ID}',
  f'/var/tmp/jrl_escape_{RUN_ID}',
]


def marked(body):
  """`body` prefixed by a re-exec that puts a unique marker into argv."""
  marker = f'jrlmark_{RUN_ID}_{len(MARKERS)}'
  MARKERS.append(marker)
  head = (
    'import os, sys\n'
    f'if {marker!r} not in sys.argv:\n'
    f'  os.execv(sys.executable, [sys.executable, "-I", os.path.abspath(__file__), {marker!r}])\n'
  )
  return head + body, marker


def processes_with(needle):
  """PIDs whose command line contains `needle`."""
  found = []
  for pid in os.listdir('/proc'):
    if not pid.isdigit() or int(pid) == os.getpid():
      continue
    try:
      with open(f'/proc/{pid}/cmdline', 'rb') as f:
        if needle.encode() in f.read():
          found.append(int(pid))
    except OSError:
      pass
  return found


def still_works():
  """A correct program scores 1.0 after whatever ran before."""
  assert code.score_program('print(input()[::-1])', [{'input': 'abc', 'output': 'cba'}]) == 1.0


def run(body, stdin='', limits=FAST):
  """Runs a marked adversarial program; returns (result, marker)."""
  source, marker = marked(body)
  result = sandbox.run_program(source, stdin, limits=limits)
  assert result.status != 'sandbox_error', result.stderr
  return result, marker


def assert_gone(marker, wait_s=1.0):
  """No process carrying `marker` is alive (allowing `wait_s` for the kernel)."""
  deadline = time.monotonic() + wait_s
  while processes_with(marker) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert processes_with(marker) == []


# Capabilities ------------------------------------------------------------------------


def test_capabilities_are_reported_and_the_sandbox_works():
  for key in ('network_namespace', 'pid_namespace', 'uid_drop', 'rlimits', 'mount_namespace'):
    assert isinstance(CAPS[key], bool), key
  assert CAPS['rlimits'] and CAPS['process_group']
  assert CAPS['self_test'] == 'ok', CAPS
  assert CAPS['cgroup'] in ('cgroup2', 'cgroup1', None)
  assert CAPS['memory_total'] == ('cgroup' if CAPS['cgroup'] else CAPS['memory_total'])
  assert CAPS['memory_total'] in ('cgroup', 'watchdog', 'per_process')
  assert sandbox.isolation_level() == CAPS['isolation'] in sandbox.ISOLATION_LEVELS
  assert sandbox.isolation_metric() == sandbox.ISOLATION_LEVELS.index(CAPS['isolation'])
  if CAPS['isolation'] in ('full', 'no_cgroup'):
    assert CAPS['mount_namespace'] and CAPS['private_proc'] and CAPS['network_namespace']
  else:
    assert CAPS['notes']
  assert CAPS['root'] or not CAPS['uid_drop']  # only root can drop to another uid
  notes = ' '.join(CAPS['notes'])
  if CAPS['root'] and not CAPS['uid_drop']:
    assert 'RUNS AS ROOT' in notes
  if not CAPS['network_namespace']:
    assert 'network' in notes
  if not CAPS['mount_namespace']:
    assert 'not read-only' in notes
  if not CAPS['contains_signals']:
    assert 'signal every process' in notes
  assert sandbox.capabilities() == CAPS  # probed once


# Scoring -----------------------------------------------------------------------------

ADD = 'a, b = map(int, input().split())\nprint(a + b)\n'
ADD_TESTS = [
  {'input': '1 2\n', 'output': '3\n'},
  {'input': '-5 5', 'output': '0'},
  {'input': '10 20\n', 'output': '30   \n\n'},  # trailing whitespace and blank lines
  {'input': '7 8\n', 'output': '15'},
]


def test_correct_program_scores_one():
  assert code.score_program(ADD, ADD_TESTS, limits=FAST) == 1.0


def test_partially_correct_program_scores_the_fraction():
  wrong_on_negatives = 'a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n'
  assert code.score_program(wrong_on_negatives, ADD_TESTS, limits=FAST) == 0.75
  wrong_on_big = 'a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n'
  assert code.score_program(wrong_on_big, ADD_TESTS, limits=FAST) == 0.5


def test_syntax_error_and_crash_score_zero():
  assert code.score_program('print(1 +\n', ADD_TESTS, limits=FAST) == 0.0
  r = sandbox.run_program('print(1 +\n', limits=FAST)
  assert r.status == 'error' and r.returncode == 1 and 'SyntaxError' in r.stderr
  r = sandbox.run_program('print("partial")\nraise ValueError("boom")\n', limits=FAST)
  assert (r.status, r.returncode, r.stdout) == ('error', 1, 'partial\n')
  assert 'ValueError: boom' in r.stderr


def test_output_comparison_is_line_by_line():
  assert code.normalize_output('a  \r\nb\t\n\n\n') == 'a\nb'
  assert code.score_program('print("a b")', [{'input': '', 'output': 'a  b'}]) == 0.0
  assert code.score_program('print("x\\n")', [{'input': '', 'output': 'x'}]) == 1.0


def test_extract_code():
  text = 'Idea.\n```python\nprint(1)\n```\nBetter:\n```python\nprint(2)\n```\nDone.'
  assert code.extract_code(text) == 'print(2)\n'
  assert code.extract_code('```py\nx = 1\n```') == 'x = 1\n'
  assert code.extract_code('print(3)') == 'print(3)'  # no fence: the whole text
  assert code.extract_code('  \n') is None


def test_code_tests_reward_is_registered_and_batched():
  fn = get_reward_fn('code_tests')
  completions = [
    f'Here:\n```python\n{ADD}```',
    '```python\nprint(1)\n```',
    '',
    'a, b = map(int, input().split())\nprint(a - -b)',
  ]
  meta = [{'tests': ADD_TESTS, 'limits': FAST_META}] * 3 + [{'tests': ADD_TESTS}]
  # No code is the policy's doing: 0.0, never unscored (left out of the loss).
  assert fn(['p'] * 4, completions, meta) == [1.0, 0.0, 0.0, 1.0]
  with pytest.raises(ValueError, match='no test case'):
    fn(['p'], ['print(1)'], [{'tests': []}])


def test_stdin_stdout_and_a_fresh_scrubbed_workdir(monkeypatch):
  monkeypatch.setenv('JRL_TEST_SECRET', f'secret_{RUN_ID}')
  src = (
    'import os, sys\n'
    'data = sys.stdin.read()\n'
    'print(len(data), os.getcwd(), sorted(os.environ), sorted(os.listdir(".")))\n'
    'open("scratch", "w").write("x")\n'
  )
  big = 'x' * (3 * MiB) + '\n'  # more than a pipe buffer holds
  first = sandbox.run_program(src, big, limits=FAST)
  second = sandbox.run_program(src, '', limits=FAST)
  assert first.status == second.status == 'ok', (first, second)
  n, cwd1, *_ = first.stdout.split(' ', 2)
  _, cwd2, rest = second.stdout.split(' ', 2)
  assert int(n) == len(big)
  # A fresh tmpfs each run (at the same path for the runs of one zygote), not the host's.
  assert not os.path.exists(cwd1) and not os.path.exists(cwd2)
  assert rest.strip() == "['HOME', 'LANG', 'PATH', 'TMPDIR'] ['main.py', 'tmp']"
  assert f'secret_{RUN_ID}' not in first.stdout + second.stdout
  r = sandbox.run_program('print(1)', language='c')
  assert r.status == 'sandbox_error' and 'unsupported language' in r.stderr


# The adversarial suite ----------------------------------------------------------------


def test_infinite_loop_hits_the_cpu_limit():
  result, marker = run('while True:\n  pass\n')
  assert result.status == 'timeout' and result.wall_seconds < FAST.wall_seconds + 1.5
  assert_gone(marker)
  still_works()


def test_sleep_hits_the_wall_clock_limit():
  result, marker = run('import time\nprint("sleeping", flush=True)\ntime.sleep(60)\n')
  assert result.status == 'timeout' and result.returncode is None
  assert result.stdout == 'sleeping\n'
  assert FAST.wall_seconds <= result.wall_seconds < FAST.wall_seconds + 1.5
  assert_gone(marker)
  still_works()


def test_fork_bomb_is_bounded_and_killed():
  if CAPS['root'] and not CAPS['uid_drop']:
    # Documented: root ignores RLIMIT_NPROC, so without a uid drop a fork bomb
    # is bounded only by the wall clock; it must not run here.
    assert 'RLIMIT_NPROC is not enforced' in ' '.join(CAPS['notes'])
    return
  body = 'while True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n'
  source, marker = marked(body)
  box, peak = {}, 0
  thread = threading.Thread(target=lambda: box.update(r=sandbox.run_program(source, limits=FAST)))
  thread.start()
  while thread.is_alive():
    peak = max(peak, len(processes_with(marker)))
    time.sleep(0.02)
  thread.join()
  assert box['r'].status == 'timeout', box['r']
  assert 1 <= peak <= FAST.max_processes
  assert_gone(marker)
  still_works()


def test_memory_bomb_is_stopped():
  # Filling 256 MiB page by page costs CPU time (page faults, cgroup reclaim),
  # about 1 s on a loaded CI runner: the CPU limit is raised so that the
  # memory bound, the thing under test, is what stops the program.
  limits = dataclasses.replace(FAST, cpu_seconds=8, wall_seconds=10)
  result, marker = run(
    'chunks = []\nwhile True:\n  chunks.append(bytearray(8 << 20))\n', limits=limits
  )
  assert result.status == 'memory', result
  assert result.wall_seconds < 8, result
  result, _ = run('x = bytearray(1 << 34)\n', limits=limits)
  assert result.status == 'memory' and 'MemoryError' in result.stderr
  assert_gone(marker)
  still_works()


def test_deep_recursion_is_contained():
  body = 'sys.setrecursionlimit(10**8)\ndef f(n):\n  return f(n + 1) + 1\nprint(f(0))\n'
  result, marker = run(body)
  # Python 3.11 keeps Python frames off the C stack: the frames fill memory or
  # the CPU limit comes first; a C-stack overflow would be SIGSEGV.
  assert result.status in ('killed', 'error', 'memory', 'timeout'), result
  result, _ = run('def f(n):\n  return f(n + 1)\nf(0)\n')
  assert result.status == 'error' and 'RecursionError' in result.stderr
  assert_gone(marker)
  still_works()


def test_huge_output_is_cut_and_killed():
  result, marker = run('while True:\n  print("y" * 1000)\n')
  assert result.status == 'output_limit' and result.returncode is None
  assert 0 < len(result.stdout) <= FAST.max_output_bytes
  result, _ = run('while True:\n  sys.stderr.write("z" * 1000)\n')
  assert result.status == 'output_limit' and len(result.stderr) <= FAST.max_output_bytes
  assert_gone(marker)
  still_works()


ESCAPE = """
print(os.getcwd())
print('LIST', sorted(os.listdir('/tmp')))
for path in {escapes!r} + [os.path.join(os.path.dirname(os.getcwd()), 'jrl_escape_{run_id}'),
                           os.path.join(sys.prefix, 'jrl_escape_{run_id}')]:
  try:
    with open(path, 'w') as f:
      f.write('escaped')
    print('WROTE', path)
  except OSError as e:
    print('refused', path, type(e).__name__)
for path in ['/etc/passwd', sys.executable]:
  try:
    open(path, 'a').close()
    print('WROTE', path)
  except OSError as e:
    print('refused', path, type(e).__name__)
try:
  os.setuid(0)
  print('BECAME ROOT')
except OSError as e:
  print('refused setuid', type(e).__name__)
"""


def test_writing_outside_the_workdir_and_escalating_fail():
  result, marker = run(ESCAPE.format(escapes=ESCAPES, run_id=RUN_ID))
  assert result.status == 'ok', result
  workdir = result.stdout.splitlines()[0]
  SEEN_WORKDIRS.append(workdir)
  assert not os.path.exists(workdir)
  if CAPS['uid_drop'] or not CAPS['root']:
    assert 'BECAME ROOT' not in result.stdout
  outside = ESCAPES + [os.path.join(os.path.dirname(workdir), f'jrl_escape_{RUN_ID}')]
  if CAPS['mount_namespace']:  # read-only but for the tmpfs workdir and a private /dev/shm
    # An empty /tmp but for the workdir and, when the interpreter lives under
    # /tmp (a checkout there), the directory holding its tree (documented).
    kept = {
      p.split('/')[2]
      for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
      if p.startswith('/tmp/')
    }
    expected = sorted({os.path.basename(workdir), *kept})
    listed = result.stdout.splitlines()[1]
    assert sorted(ast.literal_eval(listed[len('LIST ') :])) == expected, listed
    wrote = [line for line in result.stdout.splitlines() if line.startswith('WROTE')]
    assert wrote == [f'WROTE /dev/shm/jrl_escape_{RUN_ID}'], result.stdout
    assert not any(os.path.exists(p) for p in outside)
  else:  # documented: the program writes wherever its uid may
    assert 'not read-only' in ' '.join(CAPS['notes'])
    for p in outside:
      if os.path.exists(p):
        os.remove(p)
  assert_gone(marker)
  still_works()


def test_environment_secrets_are_not_visible(monkeypatch):
  secret = f'hunter2_{RUN_ID}'
  monkeypatch.setenv('JRL_TEST_SECRET', secret)
  body = f"""
print(dict(os.environ))
for pid in ['1', str(os.getppid()), '{os.getpid()}', 'self']:
  try:
    print(pid, open(f'/proc/{{pid}}/environ', 'rb').read())
  except OSError as e:
    print(pid, type(e).__name__)
"""
  result, marker = run(body)
  assert result.status == 'ok', result
  assert secret not in result.stdout and 'JRL_TEST_SECRET' not in result.stdout
  assert_gone(marker)
  still_works()


NETWORK = """
import socket
for host, port in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:
  try:
    socket.create_connection((host, port), timeout=1).close()
    print('CONNECTED', host, flush=True)
  except OSError as e:
    print('blocked', host, type(e).__name__, flush=True)
try:
  print('RESOLVED', socket.gethostbyname('example.com'), flush=True)
except OSError as e:
  print('blocked dns', type(e).__name__, flush=True)
"""


SOCKETS = """
import ctypes, errno, socket
got = []
for family, kind in [(socket.AF_VSOCK, socket.SOCK_STREAM), (socket.AF_NETLINK, socket.SOCK_RAW),
                     (socket.AF_INET, socket.SOCK_STREAM), (socket.AF_UNIX, socket.SOCK_STREAM)]:
  try:
    socket.socket(family, kind).close()
    got.append('made')
  except OSError as e:
    got.append(errno.errorcode[e.errno])
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
ring = libc.syscall(425, 4, params)  # io_uring_setup (425 on x86_64 and aarch64)
got.append('made' if ring >= 0 else errno.errorcode[ctypes.get_errno()])
print(*got)
"""


def test_vsock_netlink_and_io_uring_are_refused():
  """vsock reaches a VM's host whatever the network namespace; io_uring makes sockets
  without socket(): a seccomp filter refuses them (x86_64 and aarch64)."""
  if launcher.linux.socket_filter() is None:
    pytest.skip(f'no seccomp socket filter for {os.uname().machine}: documented')
  result, _ = run(SOCKETS)
  assert result.status == 'ok', result
  assert result.stdout.split() == ['EAFNOSUPPORT', 'EAFNOSUPPORT', 'made', 'made', 'ENOSYS']


def test_network_is_unreachable():
  listener = socket.socket()
  listener.bind(('127.0.0.1', 0))
  listener.listen(8)
  listener.setblocking(False)
  try:
    result, marker = run(NETWORK.format(port=listener.getsockname()[1]))
    try:
      conn, _ = listener.accept()
      conn.close()
      accepted = True
    except BlockingIOError:
      accepted = False
  finally:
    listener.close()
  assert result.status in ('ok', 'timeout'), result
  if CAPS['network_namespace']:
    assert not accepted
    assert 'CONNECTED' not in result.stdout and 'RESOLVED' not in result.stdout
    assert result.stdout.count('blocked') == 4
  else:  # documented: the program has the caller's network
    assert accepted and 'CONNECTED 127.0.0.1' in result.stdout
  assert_gone(marker)
  still_works()


KILLER = """
import signal
for name, pid in [('test', {test_pid}), ('parent', os.getppid()), ('pid1', 1)]:
  try:
    os.kill(pid, signal.SIGKILL)
    print('KILLED', name, flush=True)
  except OSError as e:
    print('refused', name, type(e).__name__, flush=True)
try:
  os.kill(-1, signal.SIGKILL)  # every process this one may signal
except OSError as e:
  print('kill(-1)', type(e).__name__, flush=True)
print('still here', flush=True)
"""


def test_killing_the_parent_pid1_and_everything_fails():
  if not CAPS['contains_signals']:
    # Documented: without a PID namespace or a uid drop the program may kill
    # the caller, so this program must not run here.
    assert 'signal every process' in ' '.join(CAPS['notes'])
    return
  bystander = subprocess.Popen(['sleep', '30'])  # a process of the caller's user
  try:
    result, marker = run(KILLER.format(test_pid=os.getpid()))
    assert bystander.poll() is None  # kill(-1) did not reach it
  finally:
    bystander.kill()
    bystander.wait()
  assert result.status == 'ok', result
  assert 'refused test' in result.stdout  # not visible, or not ours to signal
  # Had the parent (the sandbox's init) died, so would the program: the kernel
  # ignores SIGKILL sent to a PID namespace's init from inside it, and a
  # dropped uid may not signal it at all.
  assert result.stdout.endswith('still here\n')
  if CAPS['uid_drop'] or not CAPS['root']:
    assert 'KILLED parent' not in result.stdout and 'KILLED pid1' not in result.stdout
  assert_gone(marker)
  still_works()


DAEMON = """
import time
for keep_stdout in (True, False):
  if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
      if not keep_stdout:
        os.close(1)
        os.close(2)
      while True:  # beats until killed, even once the workdir is gone
        try:
          with open('heartbeat', 'a') as f:
            f.write('beat')
        except OSError:
          pass
        time.sleep(0.05)
    os._exit(0)
  os.wait()
time.sleep(0.2)
print('parent done', os.path.getsize('heartbeat') > 0, flush=True)
"""


def test_background_daemon_does_not_survive():
  result, marker = run(DAEMON)
  assert result.status == 'ok', result
  assert result.stdout == 'parent done True\n'
  if CAPS['kills_escaped_processes']:
    assert result.wall_seconds < FAST.wall_seconds  # no waiting for the daemon's stdout
    time.sleep(0.3)  # the daemons would beat again by now
    assert processes_with(marker) == []
  else:  # documented: a setsid daemon outlives the run; clean up after it
    assert 'outlives the run' in ' '.join(CAPS['notes'])
    for pid in processes_with(marker):
      os.kill(pid, 9)
  assert_gone(marker)
  still_works()


CALLER = """
import sys
from jrl.rewards import sandbox
print(sandbox.run_program(open(sys.argv[1]).read(), limits=sandbox.Limits(wall_seconds=60)))
"""


def test_killing_the_caller_kills_the_sandbox(tmp_path):
  """A reward worker killed mid-run (e.g. by the service's timeout) leaves nothing."""
  body = 'import time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\ntime.sleep(60)\n'
  source, marker = marked(body)
  (tmp_path / 'program.py').write_text(source)
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  caller = subprocess.Popen([sys.executable, '-c', CALLER, str(tmp_path / 'program.py')], cwd=repo)
  deadline = time.monotonic() + 30
  while len(processes_with(marker)) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
  pids = processes_with(marker)
  assert len(pids) == 2
  with open(f'/proc/{pids[0]}/cmdline', 'rb') as f:
    workdir = os.path.dirname(f.read().split(b'\0')[2].decode())
  assert os.path.basename(workdir).startswith('jrl_sandbox_')
  caller.kill()
  caller.wait()
  if not CAPS['kills_escaped_processes']:  # documented: the setsid child survives
    time.sleep(0.5)
    assert len(processes_with(marker)) <= 1
    for pid in processes_with(marker):
      os.kill(pid, 9)
  assert_gone(marker, wait_s=2.0)
  deadline = time.monotonic() + 5  # the launcher cleans up after its caller is gone
  while os.path.exists(workdir) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not os.path.exists(workdir) or (CAPS['mount_namespace'] and CAPS['user_namespace'])
  still_works()


DISK = """
print(os.getcwd(), flush=True)
size = 0
try:
  with open('big', 'wb') as f:
    while True:
      f.write(b'x' * 65536)
      f.flush()
except OSError as e:
  print('stopped', type(e).__name__)
total = os.path.getsize('big')
for i in range(64):
  try:
    with open(f'more{i}', 'wb') as f:
      f.write(b'y' * (1 << 20))
  except OSError as e:
    print('stopped', type(e).__name__)
    break
total = sum(os.path.getsize(n) for n in os.listdir('.') if n.startswith(('big', 'more')))
print(os.path.getsize('big'), total)
"""


def test_filling_the_disk_is_bounded():
  result, marker = run(DISK)
  assert result.status == 'ok', result
  lines = result.stdout.splitlines()
  workdir, biggest, total = lines[0], *map(int, lines[-1].split())
  SEEN_WORKDIRS.append(workdir)
  assert biggest <= FAST.max_file_bytes  # RLIMIT_FSIZE
  assert 'stopped' in lines[1]
  if CAPS['mount_namespace']:  # the tmpfs workdir is the quota
    assert total <= FAST.max_disk_bytes and lines[2].startswith('stopped')
  else:  # documented: no quota across files
    assert total > FAST.max_disk_bytes
  assert not os.path.exists(workdir)
  assert_gone(marker)
  still_works()


def test_every_adversarial_program_scores_zero():
  """The suite again, through the batched reward, concurrently."""
  bodies = [
    'while True:\n  pass\n',
    'import time\ntime.sleep(60)\n',
    'while True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n',
    'chunks = []\nwhile True:\n  chunks.append(bytearray(8 << 20))\n',
    'sys.setrecursionlimit(10**8)\ndef f(n):\n  return f(n + 1) + 1\nprint(f(0))\n',
    'while True:\n  print("SAFE" * 1000)\n',
    ESCAPE.format(escapes=ESCAPES, run_id=RUN_ID),
    'print(dict(os.environ))\n',
    NETWORK.format(port=9),
    DAEMON,
    DISK,
  ]
  if CAPS['contains_signals']:
    bodies.append(KILLER.format(test_pid=os.getpid()))
  sources = [marked(b)[0] for b in bodies]
  completions = [f'```python\n{s}```' for s in sources]
  meta = [{'tests': [{'input': '', 'output': 'SAFE'}], 'limits': FAST_META}] * len(sources)
  scores = get_reward_fn('code_tests')([''] * len(sources), completions, meta)
  assert scores == [0.0] * len(sources)
  still_works()


# What the program sees ----------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLOW = dataclasses.replace(FAST, wall_seconds=10, cpu_seconds=5)

FINDER = """
import json
want = sys.stdin.read()
for path in {paths!r}:  # where the test put them, if the program could guess
  try:
    print('READ', path, open(path).read(), flush=True)
  except OSError as e:
    pass
skip = {{'proc', 'sys', 'dev', 'usr', 'lib', 'lib64', '.venv', '.pyenv', 'site-packages',
         '.git', 'node_modules', '__pycache__', '.cache'}}
def scan(top):
  for root, dirs, files in os.walk(top):
    dirs[:] = [d for d in dirs if d not in skip]
    for name in files:
      if name.endswith('.jsonl'):
        try:
          for line in open(os.path.join(root, name), errors='replace'):
            row = json.loads(line)
            if isinstance(row, dict) and row.get('input') == want:
              return row['output']
        except Exception:
          pass
for top in ['/tmp', {repo!r}, '/']:
  found = scan(top)
  if found is not None:
    print(found)
    break
else:
  print('nothing found')
"""


def test_hidden_tests_on_disk_cannot_be_found():
  """A program that walks the disk for its own hidden tests finds nothing and scores 0."""
  secret = f'expected_{uuid.uuid4().hex}'
  question = f'q_{RUN_ID}'
  row = json.dumps({'input': question, 'output': secret}) + '\n'
  dirs = [tempfile.mkdtemp(prefix='jrl_hidden_', dir=REPO), tempfile.mkdtemp(prefix='jrl_hidden_')]
  paths = [os.path.join(d, 'hidden_tests.jsonl') for d in dirs]
  try:
    for p in paths:
      with open(p, 'w') as f:
        f.write(row)
      os.chmod(p, 0o644)
      os.chmod(os.path.dirname(p), 0o755)  # world-readable, as data sets usually are
    source = FINDER.format(paths=paths, repo=REPO)
    result, marker = run(source, stdin=question, limits=SLOW)
    assert result.status == 'ok', result
    assert secret not in result.stdout and 'READ' not in result.stdout, result.stdout
    assert result.stdout == 'nothing found\n'
    meta = [{'tests': [{'input': question, 'output': secret}], 'limits': dataclasses.asdict(SLOW)}]
    assert get_reward_fn('code_tests')([''], [f'```python\n{source}```'], meta) == [0.0]
  finally:
    for d in dirs:
      shutil.rmtree(d, ignore_errors=True)
  assert_gone(marker)


PROC = """
import json
me = {str(os.getpid())}
seen = {}
for pid in os.listdir('/proc'):
  if pid.isdigit() and pid not in me:
    try:
      seen[pid] = open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace')
    except OSError as e:
      seen[pid] = type(e).__name__
try:
  one = open('/proc/1/cmdline', 'rb').read().decode(errors='replace')
except OSError as e:
  one = type(e).__name__
print(json.dumps({'others': seen, 'pid1': one}))
"""


def test_proc_shows_nothing_of_the_caller():
  result, marker = run(PROC)
  assert result.status == 'ok', result
  seen = json.loads(result.stdout)
  text = result.stdout
  for leak in ('pytest', '"workdir"', 'rlimits', 'config-fd', 'parent_pid', REPO):
    assert leak not in text, (leak, text)
  if CAPS['uid_drop'] and CAPS['private_proc']:  # hidepid: the root-owned init is invisible
    assert seen['others'] == {} and seen['pid1'] in ('FileNotFoundError', 'PermissionError')
  assert_gone(marker)


SYSFS = """
for path in ['/sys/class/net', '/sys/fs/cgroup', '/sys']:
  try:
    print(path, sorted(os.listdir(path)))
  except OSError as e:
    print(path, type(e).__name__)
"""


def test_host_sys_and_its_network_interfaces_are_hidden():
  result, marker = run(SYSFS)
  assert result.status == 'ok', result
  net, cgroups, sys_root = result.stdout.splitlines()
  if net.endswith(']'):
    assert set(ast.literal_eval(net.split(' ', 1)[1])) <= {'lo'}, net
  assert cgroups == '/sys/fs/cgroup FileNotFoundError' or cgroups.endswith(' []'), cgroups
  assert sys_root == '/sys []', sys_root
  assert_gone(marker)


VIEW = """
import json
out = {{}}
for d in {dirs!r}:
  try:
    out[d] = sorted(os.listdir(d))
  except OSError as e:
    out[d] = type(e).__name__
for p in {files!r}:
  out[p] = os.path.exists(p)
print(json.dumps(out))
"""


def visible_children(directory):
  """What the new root must show in `directory`: the next step to a bound path."""
  spec = rootfs.root_spec('/tmp/jrl_sandbox_x')
  shown = set()
  for p, _ in spec['binds'] + spec['links']:
    if p.startswith(directory.rstrip('/') + '/'):
      shown.add(os.path.relpath(p, directory).split('/')[0])
  return sorted(shown)


def test_checkout_and_home_are_not_visible():
  home = os.path.expanduser('~')
  files = [
    os.path.join(REPO, 'pyproject.toml'),
    os.path.join(REPO, 'jrl', 'rewards', 'code', '__init__.py'),
  ]
  result, marker = run(VIEW.format(dirs=[REPO, home], files=files))
  assert result.status == 'ok', result
  out = json.loads(result.stdout)
  assert not any(out[p] for p in files), out
  for d in (REPO, home):  # nothing but the way to the interpreter (e.g. .venv, .pyenv)
    assert out[d] == 'FileNotFoundError' or out[d] == visible_children(d), (d, out[d])
  assert 'pyproject.toml' not in str(out[REPO]) and 'jrl' not in out[REPO]
  assert_gone(marker)


MEMORY = """
import time
barrier = time.time() + 2.0
kids = []
for _ in range({n}):
  pid = os.fork()
  if pid == 0:
    try:
      block = b'x' * ({mib} << 20)  # written, so resident
    except MemoryError:
      os._exit(2)
    if time.time() > barrier:
      os._exit(3)  # allocated too late to overlap with the others
    time.sleep(barrier - time.time() + 0.5)
    os._exit(0)
  kids.append(pid)
held = 0
for pid in kids:
  _, status = os.waitpid(pid, 0)
  held += os.waitstatus_to_exitcode(status) == 0
print('held', held, flush=True)
"""
MEMORY_LIMITS = dataclasses.replace(FAST, wall_seconds=10, cpu_seconds=5, memory_bytes=256 * MiB)


def held_blocks(result):
  """Children that held their block at the same time (0 if the parent was killed)."""
  lines = [line for line in result.stdout.splitlines() if line.startswith('held ')]
  return int(lines[0].split()[1]) if lines else 0


def test_memory_of_all_processes_together_is_bounded():
  """Six children of 100 MiB each, at once, under a 256 MiB limit: at most two hold theirs."""
  result, marker = run(MEMORY.format(n=6, mib=100), limits=MEMORY_LIMITS)
  assert result.status in ('ok', 'memory'), result
  held = held_blocks(result)
  if CAPS['memory_total'] == 'per_process':  # documented: RLIMIT_AS x RLIMIT_NPROC only
    assert 'max_processes x memory_bytes' in ' '.join(CAPS['notes'])
    assert held * 100 * MiB <= MEMORY_LIMITS.max_processes * MEMORY_LIMITS.memory_bytes
  else:
    assert held * 100 * MiB <= MEMORY_LIMITS.memory_bytes, result
  assert_gone(marker)
  still_works()


def test_memory_watchdog_bounds_the_total_without_a_cgroup(monkeypatch):
  """The fallback where no cgroup can be made: the init's watchdog kills the sandbox."""
  if not CAPS['private_proc']:
    assert CAPS['memory_total'] == 'per_process'
    return
  plan = dict(sandbox._get_plan(), cgroup=None, _cgroup=None)
  sandbox_plan.derive(plan)
  monkeypatch.setattr(sandbox, '_PLAN', plan)
  assert sandbox.capabilities()['memory_total'] == 'watchdog'
  assert sandbox.isolation_level() == 'no_cgroup' or CAPS['isolation'] == 'degraded'
  assert 'polled every 20 ms' in ' '.join(sandbox.capabilities()['notes'])
  result, marker = run(MEMORY.format(n=6, mib=100), limits=MEMORY_LIMITS)
  assert result.status == 'memory', result
  assert held_blocks(result) * 100 * MiB <= MEMORY_LIMITS.memory_bytes
  assert_gone(marker)
  still_works()


# The code reward ---------------------------------------------------------------------


def test_code_reward_refuses_without_namespaces_unless_told(monkeypatch):
  """A user who may not create namespaces: a clear refusal; opting in runs, reported degraded."""
  monkeypatch.delenv(code.UNSAFE_ENV, raising=False)
  refused = 'Operation not permitted (simulated)'
  found = {
    'root': False,
    'user': False,
    'uid_range': [65534, 1],
    'errors': dict.fromkeys(('user', 'net', 'ipc', 'mount', 'pid', 'proc'), refused),
  }
  plan = sandbox_plan.plan_from(found)  # self-tests rlimits-only runs, as such a user gets
  monkeypatch.setattr(sandbox, '_PLAN', plan)
  assert sandbox.isolation_level() == 'degraded' and sandbox.isolation_metric() == 1
  fn = get_reward_fn('code_tests')
  completions, meta = [f'```python\n{ADD}```'], [{'tests': ADD_TESTS, 'limits': FAST_META}]
  with pytest.raises(code.SandboxUnavailableError) as refusal:
    fn([''], completions, meta)
  message = str(refusal.value)
  for part in ('mount namespace', 'network namespace', 'sandbox_unsafe', code.UNSAFE_ENV):
    assert part in message, message
  with pytest.raises(code.SandboxUnavailableError):
    code.configure_sandbox(unsafe=False)
  assert code.configure_sandbox(unsafe=True) == 'degraded'  # sets the variable for workers
  assert os.environ[code.UNSAFE_ENV] == '1'
  assert fn([''], completions, meta) == [1.0]
  os.environ.pop(code.UNSAFE_ENV)
  monkeypatch.setattr(sandbox, '_PLAN', None)  # back to the real plan, probed afresh
  assert code.check_sandbox() == CAPS['isolation']


def test_slow_programs_do_not_zero_their_neighbours(monkeypatch):
  """4 correct programs and 4 infinite loops in one chunk, through the reward service:
  the chunk ends within the service's timeout, and only the loops score 0 (their
  first case times out; the budget has no room for a second: failed, not unscored)."""
  monkeypatch.setenv(code.SETTINGS_ENV, json.dumps({'budget_s': 8.0, 'concurrency': 4}))
  loop = '```python\nwhile True:\n  pass\n```'
  right = f'```python\n{ADD}```'
  completions = [right, loop] * 4
  meta = [{'tests': ADD_TESTS[:3]}] * 8  # default limits: 5 s of wall clock and CPU per case
  timeout_s = 14.0
  with RewardService(['code_tests'], mode='process', workers=1, timeout_s=timeout_s,
                     chunk_size=8) as service:  # fmt: skip
    t0 = time.monotonic()
    scored = service([''] * 8, completions, meta)
    elapsed = time.monotonic() - t0
  assert scored.timeouts['code_tests'] == 0 and scored.failures['code_tests'] == 0, scored
  assert list(scored.per_fn['code_tests']) == [1.0, 0.0] * 4
  assert elapsed < timeout_s


def test_nothing_is_left_behind():
  """Runs last: no marked process, escape file or workdir of this module remains."""
  if not CAPS['kills_escaped_processes']:  # documented: setsid daemons survive; clean up
    for pid in processes_with(f'jrlmark_{RUN_ID}'):
      os.kill(pid, 9)
  for marker in MARKERS:
    assert_gone(marker, wait_s=2.0)
  assert processes_with(f'jrlmark_{RUN_ID}') == []
  assert all(not os.path.exists(w) for w in SEEN_WORKDIRS) and SEEN_WORKDIRS
  if CAPS['mount_namespace']:
    assert not any(os.path.exists(p) for p in ESCAPES)
  else:  # documented: the escape program wrote where it could; clean up
    for p in ESCAPES:
      if os.path.exists(p):
        os.remove(p)
  still_works()
