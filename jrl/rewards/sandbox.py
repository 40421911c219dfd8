"""Runs untrusted, model-written Python in a sandbox.

    result = run_program('print(input()[::-1])', 'abc\\n', limits=Limits(wall_seconds=2))
    result.status, result.stdout      # ('ok', 'cba\\n')
    isolation_level()                 # 'full': see "Isolation levels" below

Treat every program as hostile: in RL the policy is optimised to find any way
to raise its reward (read the hidden tests, kill the trainer, starve its
neighbours). `run_program` never raises for anything the program does: the
outcome is a `RunResult` status, and a failure of the sandbox itself is
status 'sandbox_error' with a message in `stderr`.

What the program sees (with a mount namespace, i.e. isolation 'full' or
'no_cgroup'). A root of its own: an empty tmpfs holding, read-only and at
their usual paths, only

* /usr, and /bin, /sbin, /lib, /lib32, /lib64, /libx32 (bound, or the same
  symlinks into /usr where the host has merged /usr);
* from /etc only ld.so.cache, ld.so.conf, ld.so.conf.d and localtime;
* the interpreter: the directories of sys.executable and of every link on
  the way to the real binary, the standard library, the shared libpython's
  directory, and for a venv its pyvenv.cfg and site-packages only (a venv
  inside a checkout shows the venv's bin and lib, not the checkout; the
  directories on the way hold nothing else);
* /dev/null, zero, full, random, urandom, the /dev/fd and stdio links, and a
  private 1 MiB /dev/shm;
* a fresh /proc of its PID namespace, mounted hidepid=invisible, so with a
  uid drop the program sees its own processes only (not the init, whose
  command line is the launcher's); an empty /sys;
* its working directory: a fresh tmpfs of `max_disk_bytes` at the same
  path as on the host (/tmp/jrl_sandbox_XXXX; /tmp holds nothing else).

Nothing else of the host exists there: not the caller's data, tests or
checkout, no home directory, no runs, no /tmp, /var, /run, /home, /opt,
/root or /mnt (but for the interpreter's own directories inside them), no
host /sys (no interfaces, no cgroups). The root is a new mount (pivot_root),
and the old one is detached, so no path leads back to it.

What the program does not get: a network (a network namespace with a down
loopback only), any process outside its PID namespace to signal or trace,
System V IPC of the host (IPC namespace), the caller's environment
(PATH, HOME and TMPDIR inside the workdir, LANG; nothing else), privileges
(a per-call uid from a high range with no groups, or the caller's uid in a
user namespace without capabilities; no_new_privs), and more resources than
`Limits`: rlimits per process (RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC,
RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0), the wall clock (enforced by the
caller), output caps, and for all its processes together a cgroup (below).

What remains visible, by design: the system libraries and tools under /usr
(world-readable files of the distribution; anything an operator put under
/usr is visible too), the interpreter's site-packages (installed packages),
the kernel's view through /proc (/proc/cpuinfo, /proc/meminfo, uptime), and
the wall clock. With a user namespace instead of a uid drop (a non-root
caller), hidepid cannot hide the init, whose command line names the
launcher's path (`python -I -S .../_sandbox_launcher.py --config-fd 3`; the
config itself travels on a pipe).

Memory of all the program's processes together. Where a cgroup can be made
(root, or a delegated cgroup v2 subtree): a child cgroup per run, with
memory.max = `memory_bytes` (no swap) and pids.max = `max_processes`
(cgroup v2; on a v1 hierarchy, memory.limit_in_bytes, memsw and the pids
hierarchy), removed after the run, its processes killed first; an OOM kill
inside it makes the status 'memory'. Without a cgroup but with a PID
namespace, the init sums the resident memory of every process in the
namespace every 20 ms and kills them all when the sum exceeds
`memory_bytes` (status 'memory'): a bound that a fast allocator can overrun
for up to one period, and at most `max_processes x memory_bytes`
(RLIMIT_AS x RLIMIT_NPROC) at any time. With neither, only that last bound
holds. `capabilities()['memory_total']` says which: 'cgroup', 'watchdog' or
'per_process'.

Isolation levels (`isolation_level()`; `isolation_metric()` is its index in
`ISOLATION_LEVELS`, for the trainer's metrics):

  'full' (3)       mount (new root), PID (private /proc), network and IPC
                   namespaces; an unprivileged uid; a cgroup.
  'no_cgroup' (2)  the same, total memory bounded by the watchdog.
  'degraded' (1)   a namespace or the uid drop is missing: the program may
                   read the host's files (the hidden tests included), reach
                   the network, or signal the caller. `notes` says what.
  'broken' (0)     the self-test failed; nothing runs.

`jrl.rewards.code` refuses to score below 'no_cgroup' unless told to run
unsafely (`reward.sandbox_unsafe=True`, or JRL_SANDBOX_UNSAFE=1).

Process tree. The caller starts `_sandbox_launcher.py` (`python -I -S`,
never a fork of the caller, which may be running JAX threads) with its
config on a pipe; the launcher enters the user (not root), PID, network and
IPC namespaces and forks an init; the init (PID 1) enters a mount namespace,
builds the new root, and forks the program, which joins the cgroup, sets its
rlimits, drops its privileges and execs `sys.executable -I WORKDIR/main.py`
in a session of its own. The init reaps every orphan and, when the program
exits, reports the exit status and CPU time on a status pipe and exits; the
kernel then kills everything left in the namespace, including daemons that
double-forked and called setsid. The caller enforces the wall-clock limit,
reads stdout and stderr concurrently up to a byte cap, and at the end always
kills the launcher's process group and everything in the cgroup. If the
caller dies mid-run (e.g. a reward worker killed on a timeout), the launcher
gets SIGTERM (PR_SET_PDEATHSIG), kills the sandbox and removes the workdir
and the cgroup, and a hard deadline of wall_seconds + 2 in the launcher
backs up the caller's.

Where a mechanism is missing (`capabilities()` says which ones this machine
enforces; they are probed once per process, and a self-test runs a program
through the chosen set before it is used, falling back one step at a time):

* no uid drop (root, but the self-test as another uid fails): the program
  RUNS AS ROOT and can undo every other mechanism; RLIMIT_NPROC does not
  apply.
* no user namespace (not root; container seccomp profiles commonly refuse
  CLONE_NEWUSER): no namespace at all; rlimits and a session only.
* no network namespace: the program has the caller's network.
* no mount namespace: the program sees the whole host filesystem and writes
  wherever its uid may (everything the caller's user owns when there is no
  uid drop); only RLIMIT_FSIZE bounds a single file, there is no disk quota.
* no PID namespace: leftovers are killed by uid at the end (a process with
  the sandbox uid calls `kill(-1, SIGKILL)`) when there is a uid drop; with
  neither, a setsid daemon survives, and the program may signal every
  process of the caller's user, including the caller.
* no cgroup: see "Memory" above.

Needs Linux >= 5.12 (mount_setattr) for the mount namespace; on older
kernels the probe finds it missing.
"""

import dataclasses
import json
import logging
import os
import resource
import selectors
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from typing import NamedTuple

from jrl.rewards import _sandbox_launcher as _launcher

MiB = 1 << 20
KiB = 1 << 10

STATUSES = ('ok', 'error', 'timeout', 'memory', 'output_limit', 'killed', 'sandbox_error')
ISOLATION_LEVELS = ('broken', 'degraded', 'no_cgroup', 'full')  # index: `isolation_metric()`


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-run limits. CPU is per process; memory per process and in total."""

  wall_seconds: float = 5.0  # enforced by the caller
  cpu_seconds: int = 5  # RLIMIT_CPU, per process
  memory_bytes: int = 512 * MiB  # RLIMIT_AS per process; all processes together (cgroup)
  max_processes: int = 32  # RLIMIT_NPROC and pids.max (threads count too)
  max_file_bytes: int = 1 * MiB  # RLIMIT_FSIZE, per file
  max_output_bytes: int = 64 * KiB  # stdout and stderr each; more kills the run
  max_open_files: int = 64  # RLIMIT_NOFILE
  max_disk_bytes: int = 16 * MiB  # size of the tmpfs workdir (mount namespace only)


class RunResult(NamedTuple):
  """The outcome of one run.

  status: 'ok' (exit 0), 'error' (nonzero exit), 'timeout' (wall clock or
    CPU limit), 'memory' (MemoryError, an OOM kill in the cgroup, the memory
    watchdog, or killed near the memory limit), 'output_limit' (stdout or
    stderr over `max_output_bytes`), 'killed' (a signal, e.g. SIGSEGV),
    'sandbox_error' (the sandbox failed; see stderr).
  returncode: the exit code, -signal if a signal ended the program, None when
    the sandbox ended it (timeout, output limit) or could not run it.
  """

  status: str
  returncode: int | None
  stdout: str  # at most max_output_bytes, decoded as UTF-8 with replacement
  stderr: str
  wall_seconds: float


_LAUNCHER = os.path.abspath(_launcher.__file__)
_PATH = '/usr/local/bin:/usr/bin:/bin'
# The host paths the new root shows (when they exist), besides the interpreter's.
_SYSTEM = ('/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32')
_ETC = ('/etc/ld.so.cache', '/etc/ld.so.conf', '/etc/ld.so.conf.d', '/etc/localtime')
_CGROUP_PREFIX = 'jrl_sandbox_'
_log = logging.getLogger(__name__)


# The caller's side ------------------------------------------------------------


def capabilities():
  """Which mechanisms this machine enforces (probed once per process).

  Keys: root, uid_drop, user_namespace, network_namespace, pid_namespace,
  mount_namespace (a new root of only the interpreter and system libraries,
  read-only; a tmpfs workdir with a disk quota), private_proc (a /proc of
  the PID namespace, hidepid), ipc_namespace, cgroup ('cgroup2', 'cgroup1'
  or None), memory_total ('cgroup' | 'watchdog' | 'per_process': what bounds
  the memory of all processes together), rlimits, process_group,
  no_new_privs, kills_escaped_processes (a setsid daemon cannot outlive the
  run), contains_signals (the program cannot signal the caller), self_test
  ('ok' or why the sandbox cannot run programs), isolation (see
  `isolation_level`), notes (what is not enforced).
  """
  plan = _get_plan()
  caps = {k: v for k, v in plan.items() if not k.startswith('_')}
  caps['notes'] = list(plan['notes'])
  return caps


def isolation_level():
  """'full' | 'no_cgroup' | 'degraded' | 'broken' (see the module docstring)."""
  return _get_plan()['isolation']


def isolation_metric():
  """`isolation_level()` as a number for metrics: 3 full, 2 no_cgroup, 1 degraded, 0 broken."""
  return ISOLATION_LEVELS.index(isolation_level())


def run_program(source, stdin='', *, limits=Limits(), language='python'):
  """Runs `source` with `stdin` under `limits`; returns a RunResult, never raises."""
  t0 = time.monotonic()
  try:
    if language != 'python':
      raise ValueError(f'unsupported language {language!r}; only python runs in the sandbox')
    plan = _get_plan()
    if plan['self_test'] != 'ok':
      raise RuntimeError(f'the sandbox cannot run programs here: {plan["self_test"]}')
    return _run(plan, source, stdin, limits, t0)
  except Exception as e:
    message = f'sandbox: {type(e).__name__}: {e}'
    return RunResult('sandbox_error', None, '', message, time.monotonic() - t0)


_PLAN = None
_PLAN_LOCK = threading.Lock()


def _get_plan():
  global _PLAN
  with _PLAN_LOCK:
    if _PLAN is None:
      _PLAN = _make_plan()
      _log.info('code sandbox: isolation %r; %s', _PLAN['isolation'], '; '.join(_PLAN['notes']))
    return _PLAN


def _minimal_env(workdir):
  return {
    'PATH': _PATH,
    'HOME': workdir,
    'TMPDIR': os.path.join(workdir, 'tmp'),
    'LANG': 'C.UTF-8',
  }


def _make_plan():
  """Probes the mechanisms in a fresh process, then self-tests the chosen set."""
  found = _probe_in_subprocess()
  found['cgroup'], why = _find_cgroup()
  if why:
    found.setdefault('errors', {})['cgroup'] = why
  return _plan_from(found)


def _probe_in_subprocess():
  probe = subprocess.run(
    [sys.executable, '-I', '-S', _LAUNCHER, '--probe'],
    capture_output=True,
    timeout=60,
    env={'PATH': _PATH, 'LANG': 'C.UTF-8'},
    cwd='/',
  )
  try:
    found = json.loads(probe.stdout.decode().strip().splitlines()[-1])
  except (ValueError, IndexError):
    found = {'root': os.geteuid() == 0, 'errors': {'probe': probe.stderr.decode()[-2000:]}}
  return found


_NAMESPACES = {  # name in notes -> (plan key, probe key)
  'network namespace': ('network_namespace', 'net'),
  'PID namespace': ('pid_namespace', 'pid'),
  'mount namespace': ('mount_namespace', 'mount'),
  'IPC namespace': ('ipc_namespace', 'ipc'),
}


def _plan_from(found):
  """The mechanisms to use, given what the probe `found` to work."""
  root = bool(found.get('root'))
  userns = not root and bool(found.get('user'))
  proc = found.get('proc')
  plan = {
    'root': root,
    'uid_drop': root and bool(found.get('uid')),
    'user_namespace': userns,
    'network_namespace': bool(found.get('net')),
    'pid_namespace': bool(found.get('pid')),
    'mount_namespace': bool(found.get('mount')),
    'ipc_namespace': bool(found.get('ipc')),
    'cgroup': (found.get('cgroup') or {}).get('kind'),
    'rlimits': True,
    'process_group': True,
    'no_new_privs': True,
    '_proc_options': proc if isinstance(proc, str) else None,
    '_cgroup': found.get('cgroup'),
    '_uid_range': found.get('uid_range'),
    '_errors': dict(found.get('errors', {})),
  }
  # Fall back one step at a time while the self-test fails: first without the
  # cgroup, then without the uid drop, then (not root) without the user
  # namespace and all it enables.
  plan['self_test'] = _self_test(plan)
  if plan['self_test'] != 'ok' and plan['cgroup']:
    plan['_errors']['cgroup'] = f'a program could not run in a cgroup: {plan["self_test"]}'
    plan['cgroup'] = plan['_cgroup'] = None
    plan['self_test'] = _self_test(plan)
  if plan['self_test'] != 'ok' and plan['uid_drop']:
    plan['_errors']['uid'] = f'a program could not run as an unprivileged uid: {plan["self_test"]}'
    plan['uid_drop'] = False
    plan['self_test'] = _self_test(plan)
  if plan['self_test'] != 'ok' and plan['user_namespace']:
    why = f'namespaces inside a user namespace failed the self-test: {plan["self_test"]}'
    for key, probe_key in _NAMESPACES.values():
      plan[key] = False
      plan['_errors'][probe_key] = why
    plan['user_namespace'] = False
    plan['self_test'] = _self_test(plan)
  _derive(plan)
  return plan


def _derive(plan):
  """The keys that follow from the mechanisms: summaries, level, notes."""
  plan['private_proc'] = _private_proc(plan)
  plan['memory_total'] = (
    'cgroup' if plan['cgroup'] else 'watchdog' if plan['private_proc'] else 'per_process'
  )
  plan['kills_escaped_processes'] = plan['pid_namespace'] or plan['uid_drop']
  plan['contains_signals'] = plan['pid_namespace'] or plan['uid_drop']
  unprivileged = plan['uid_drop'] or plan['user_namespace']
  namespaces = all(plan[key] for key, _ in _NAMESPACES.values()) and plan['private_proc']
  if plan['self_test'] != 'ok':
    plan['isolation'] = 'broken'
  elif not (namespaces and unprivileged):
    plan['isolation'] = 'degraded'
  else:
    plan['isolation'] = 'full' if plan['cgroup'] else 'no_cgroup'
  plan['notes'] = _notes(plan)


def _private_proc(plan):
  return plan['mount_namespace'] and plan['pid_namespace'] and plan['_proc_options'] is not None


def _self_test(plan):
  t0 = time.monotonic()
  try:
    r = _run(plan, 'import sys\nprint(sys.stdin.read()[::-1])\n', 'kcos', Limits(), t0)
  except Exception as e:
    return f'{type(e).__name__}: {e}'
  if r.status == 'ok' and r.stdout == 'sock\n':
    return 'ok'
  return f'status {r.status!r}, stdout {r.stdout[:200]!r}, stderr {r.stderr[-2000:]!r}'


def _notes(plan):
  notes = []
  if plan['memory_total'] == 'watchdog':
    why = plan['_errors'].get('cgroup', '')
    notes.append(
      'no cgroup' + (f' ({why})' if why else '') + ': the memory of all processes together '
      'is polled every 20 ms and bounded by max_processes x memory_bytes in between'
    )
  elif plan['memory_total'] == 'per_process':
    notes.append('no cgroup and no private /proc: all processes together may use '
                 'max_processes x memory_bytes')  # fmt: skip
  for name, (key, probe_key) in _NAMESPACES.items():
    if not plan[key]:
      why = plan['_errors'].get(probe_key, '')
      notes.append(f'no {name}' + (f' ({why})' if why else ''))
  if plan['mount_namespace'] and plan['pid_namespace'] and not plan['private_proc']:
    notes.append(f'no private /proc ({plan["_errors"].get("proc", "")}): /proc is empty')
  if not plan['network_namespace']:
    notes.append('the program has the network of the caller')
  if not plan['mount_namespace']:
    notes.append(
      "the program sees the host's whole filesystem (the hidden tests included), and the "
      'filesystem is not read-only: the program may write wherever its uid may '
      '(e.g. /tmp, /dev/shm); only single files are size-limited, there is no disk quota'
    )
  if not plan['uid_drop']:
    if plan['root']:
      notes.append(f'no uid drop: {plan["_errors"].get("uid", "setuid failed")}')
      notes.append('RLIMIT_NPROC is not enforced (root ignores it)')
      notes.append('THE PROGRAM RUNS AS ROOT: it can undo every other mechanism')
    elif plan['user_namespace']:
      notes.append(
        "the program runs as the caller's uid, in a user namespace, without capabilities"
      )
    else:
      notes.append("the program runs as the caller's uid (RLIMIT_NPROC counts all its processes)")
  if not plan['kills_escaped_processes']:
    notes.append('a daemon that calls setsid to leave the process group outlives the run')
  if not plan['contains_signals']:
    notes.append("the program may signal every process of the caller's user, the caller too")
  if plan['self_test'] != 'ok':
    notes.append(f'self-test failed: {plan["self_test"]}')
  return notes


def _pick_uid(plan):
  lo, span = plan['_uid_range']
  return lo + int.from_bytes(os.urandom(4), 'little') % span


# The new root ----------------------------------------------------------------------


def _inside(path, parent):
  return path == parent or path.startswith(parent.rstrip('/') + '/')


def _interpreter_paths():
  """Host paths the interpreter needs to start and import its libraries:
  [path, is_dir], none inside another."""
  exe = os.path.abspath(sys.executable)
  dirs = set()
  p = exe
  for _ in range(40):  # every link on the way to the real binary
    dirs.add(os.path.dirname(p))
    if not os.path.islink(p):
      break
    p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
  dirs.add(os.path.dirname(os.path.realpath(exe)))
  paths = sysconfig.get_paths()
  dirs.update(paths[k] for k in ('stdlib', 'platstdlib', 'purelib', 'platlib'))
  if sysconfig.get_config_var('Py_ENABLE_SHARED'):
    dirs.add(sysconfig.get_config_var('LIBDIR'))
  files = set()
  if sys.prefix != sys.base_prefix:
    files.add(os.path.join(sys.prefix, 'pyvenv.cfg'))
  kept = [[p, True] for p in dirs if p and os.path.isdir(p)]
  kept += [[p, False] for p in files if os.path.isfile(p)]
  return kept


def _root_spec(workdir):
  """What `_sandbox_launcher.enter_new_root` builds: binds, links, dirs."""
  binds, links = [], []
  for p in _SYSTEM + _ETC:
    if os.path.islink(p):
      links.append([p, os.readlink(p)])
    elif os.path.exists(p):
      binds.append([p, os.path.isdir(p)])
  for path, is_dir in _interpreter_paths():
    if any(_inside(path, link) for link, _ in links):
      path = os.path.realpath(path)  # e.g. /lib/python3 where /lib -> usr/lib
    binds.append([path, is_dir])
  binds.sort(key=lambda b: (len(b[0]), b[0]))
  kept = []
  for path, is_dir in binds:  # drop what an outer bind or a link already shows
    if not any(_inside(path, p) for p, _ in kept + links):
      kept.append([path, is_dir])
  if any(_inside(workdir, p) for p, _ in kept + links):
    raise RuntimeError(f'the workdir {workdir} lies inside a path bound into the sandbox')
  return {'binds': kept, 'links': links, 'dirs': [workdir]}


# Cgroups ------------------------------------------------------------------------


def _read(path):
  with open(path) as f:
    return f.read()


def _write(path, text):
  with open(path, 'w') as f:
    f.write(text)


def _find_cgroup():
  """Where per-run cgroups can be made: ({'kind', 'bases'}, None) or (None, why)."""
  try:
    own = {}  # hierarchy controllers ('' for v2) -> path
    for line in _read('/proc/self/cgroup').splitlines():
      _, controllers, path = line.split(':', 2)
      for c in controllers.split(',') if controllers else ['']:
        own[c.removeprefix('name=')] = path
    mounts = []  # (fstype, root, mountpoint, super options)
    for line in _read('/proc/self/mountinfo').splitlines():
      left, right = line.split(' - ', 1)
      fields, tail = left.split(), right.split()
      mounts.append((tail[0], fields[3], fields[4], set(tail[2].split(','))))
  except (OSError, ValueError, IndexError) as e:
    return None, f'cannot read /proc/self/cgroup or mountinfo: {e}'

  def own_dir(controller, root, mountpoint):
    path = own.get(controller)
    if path is None or not _inside(path, root):
      return None
    return os.path.normpath(mountpoint + '/' + os.path.relpath(path, root))

  errors = []
  for fstype, root, mountpoint, _ in mounts:
    if fstype != 'cgroup2':
      continue
    d = own_dir('', root, mountpoint)
    while d and _inside(d, mountpoint):  # our cgroup, else its ancestors
      spec = {'kind': 'cgroup2', 'bases': [d]}
      why = _try_cgroup(spec)
      if why is None:
        return spec, None
      errors.append(why)
      d = os.path.dirname(d) if d != mountpoint else None
  bases = {}
  for fstype, root, mountpoint, options in mounts:
    for c in ('memory', 'pids'):
      if fstype == 'cgroup' and c in options and c not in bases:
        bases[c] = own_dir(c, root, mountpoint)
  if bases.get('memory'):
    spec = {'kind': 'cgroup1', 'bases': [b for b in (bases['memory'], bases.get('pids')) if b]}
    why = _try_cgroup(spec)
    if why is None:
      return spec, None
    errors.append(why)
  return None, '; '.join(errors) or 'no cgroup2 or cgroup1 memory hierarchy is mounted'


def _try_cgroup(spec):
  """None if a per-run cgroup can be made, limited and removed under `spec`; else why."""
  try:
    if spec['kind'] == 'cgroup2':
      base = spec['bases'][0]
      if 'memory' not in _read(os.path.join(base, 'cgroup.controllers')).split():
        return f'{base}: no memory controller'
      enabled = _read(os.path.join(base, 'cgroup.subtree_control')).split()
      for c in ('memory', 'pids'):
        if c not in enabled:
          _write(os.path.join(base, 'cgroup.subtree_control'), f'+{c}')
    _Cgroup(spec, Limits()).remove()
    _remove_stale(spec)
    return None
  except OSError as e:
    return f'{spec["kind"]} at {spec["bases"][0]}: {e}'


def _remove_stale(spec):
  """Removes the empty per-run cgroups of callers that died before removing theirs."""
  for base in spec['bases']:
    for name in os.listdir(base):
      owner = name.removeprefix(_CGROUP_PREFIX).split('_')[0]
      if not (name.startswith(_CGROUP_PREFIX) and owner.isdigit()):
        continue
      if os.path.exists(f'/proc/{owner}'):
        continue  # its caller may still be running
      try:
        os.rmdir(os.path.join(base, name))
      except OSError:
        pass


class _Cgroup:
  """A child cgroup for one run: made with its limits, killed and removed after."""

  def __init__(self, spec, limits):
    self.kind = spec['kind']
    name = f'{_CGROUP_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}'
    self.dirs = []
    try:
      for base in spec['bases']:
        os.mkdir(os.path.join(base, name), 0o700)
        self.dirs.append(os.path.join(base, name))
      self._limit(int(limits.memory_bytes), int(limits.max_processes))
    except BaseException:
      self.remove()
      raise

  def _limit(self, memory, processes):
    d = self.dirs[0]
    if self.kind == 'cgroup2':
      _write(os.path.join(d, 'memory.max'), str(memory))
      optional = [('memory.swap.max', '0'), ('pids.max', str(processes))]
    else:
      _write(os.path.join(d, 'memory.limit_in_bytes'), str(memory))
      optional = [('memory.memsw.limit_in_bytes', str(memory))]
      for p in self.dirs[1:]:
        _write(os.path.join(p, 'pids.max'), str(processes))
    for name, value in optional:
      if os.path.exists(os.path.join(d, name)):
        try:
          _write(os.path.join(d, name), value)
        except OSError:  # e.g. no swap accounting
          pass

  @property
  def procs(self):
    return [os.path.join(d, 'cgroup.procs') for d in self.dirs]

  def oom_kills(self):
    name = 'memory.events' if self.kind == 'cgroup2' else 'memory.oom_control'
    try:
      for line in _read(os.path.join(self.dirs[0], name)).splitlines():
        key, _, value = line.partition(' ')
        if key == 'oom_kill':
          return int(value)
    except (OSError, ValueError):
      pass
    return 0

  def remove(self, timeout_s=2.0):
    """Kills whatever is left in the cgroup and removes it."""
    deadline = time.monotonic() + timeout_s
    while self.dirs:
      if self.kind == 'cgroup2' and os.path.exists(os.path.join(self.dirs[0], 'cgroup.kill')):
        try:
          _write(os.path.join(self.dirs[0], 'cgroup.kill'), '1')
        except OSError:
          pass
      for path in self.procs:
        try:
          pids = [int(p) for p in _read(path).split()]
        except (OSError, ValueError):
          pids = []
        for pid in pids:
          try:
            os.kill(pid, signal.SIGKILL)
          except OSError:
            pass
      for d in list(self.dirs):
        try:
          os.rmdir(d)
          self.dirs.remove(d)
        except FileNotFoundError:
          self.dirs.remove(d)
        except OSError:
          pass
      if self.dirs:
        if time.monotonic() > deadline:
          _log.warning('sandbox: could not remove cgroups %s', self.dirs)
          return
        time.sleep(0.01)


# One run ------------------------------------------------------------------------


def _run(plan, source, stdin, limits, t0):
  workdir = tempfile.mkdtemp(prefix='jrl_sandbox_')
  uid = _pick_uid(plan) if plan['uid_drop'] else None
  proc = status_r = cgroup = None
  try:
    main = os.path.join(workdir, 'main.py')
    with open(main, 'w', encoding='utf-8', errors='surrogatepass') as f:
      f.write(source)
    os.mkdir(os.path.join(workdir, 'tmp'))
    if uid is not None and not plan['mount_namespace']:
      for p in (workdir, main, os.path.join(workdir, 'tmp')):
        os.chown(p, uid, uid)
    mem = int(limits.memory_bytes)
    cpu = max(1, int(limits.cpu_seconds))
    flags = _launcher.CLONE_NEWUSER if plan['user_namespace'] else 0
    for key, flag in [
      ('network_namespace', _launcher.CLONE_NEWNET),
      ('pid_namespace', _launcher.CLONE_NEWPID),
      ('ipc_namespace', _launcher.CLONE_NEWIPC),
    ]:
      if plan[key]:
        flags |= flag
    if plan['_cgroup']:
      cgroup = _Cgroup(plan['_cgroup'], limits)
    private_proc = _private_proc(plan)
    status_r, status_w = os.pipe()
    config = {
      'parent_pid': os.getpid(),
      'status_fd': status_w,
      'workdir': workdir,
      'argv': [sys.executable, '-I', main],
      'env': _minimal_env(workdir),
      'uid': uid,
      'unshare': flags,
      'userns': plan['user_namespace'],
      'mount': plan['mount_namespace'],
      'root': _root_spec(workdir) if plan['mount_namespace'] else None,
      'proc_options': plan['_proc_options'] if private_proc else None,
      'cgroup_procs': cgroup.procs if cgroup else [],
      'cgroup_dirs': cgroup.dirs if cgroup else [],
      'watchdog_bytes': mem if private_proc and cgroup is None else 0,
      'disk_bytes': int(limits.max_disk_bytes),
      'sweep': uid is not None and not plan['pid_namespace'],
      'hard_deadline': float(limits.wall_seconds) + 2.0,
      'nproc_counts_user': uid is None and not plan['user_namespace'],
      'rlimits': [
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_NPROC, int(limits.max_processes), int(limits.max_processes)),
        (resource.RLIMIT_FSIZE, int(limits.max_file_bytes), int(limits.max_file_bytes)),
        (resource.RLIMIT_NOFILE, int(limits.max_open_files), int(limits.max_open_files)),
      ],
    }
    config_r, config_w = os.pipe()
    try:
      os.write(config_w, json.dumps(config).encode())  # far below a pipe's buffer
      os.close(config_w)
      proc = subprocess.Popen(
        [sys.executable, '-I', '-S', _LAUNCHER, '--config-fd', str(config_r)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(status_w, config_r),
        start_new_session=True,
        env={'PATH': _PATH, 'LANG': 'C.UTF-8'},
        cwd='/',
      )
    finally:
      os.close(status_w)
      os.close(config_r)
    stdin_bytes = stdin if isinstance(stdin, bytes) else stdin.encode('utf-8', 'surrogatepass')
    out, err, status, reason = _pump(proc, status_r, stdin_bytes, limits, t0)
  finally:
    if proc is not None:
      _kill_group(proc)
    if status_r is not None:
      os.close(status_r)
    oom_kills = 0
    if cgroup is not None:
      oom_kills = cgroup.oom_kills()
      cgroup.remove()
    if uid is not None and not plan['pid_namespace']:
      subprocess.run(
        [sys.executable, '-I', '-S', _LAUNCHER, '--sweep', str(uid)], timeout=30, cwd='/'
      )
    _remove_tree(workdir)
  wall = time.monotonic() - t0
  stdout = out.decode('utf-8', errors='replace')
  stderr = err.decode('utf-8', errors='replace')
  return _classify(status, reason, proc.returncode, stdout, stderr, limits, wall, oom_kills)


def _pump(proc, status_r, stdin_bytes, limits, t0):
  """Feeds stdin and reads stdout, stderr and the status pipe until the
  launcher is done, the wall-clock limit passes, or an output cap is hit."""
  cap = int(limits.max_output_bytes)
  sel = selectors.DefaultSelector()
  fd_out, fd_err, fd_in = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
  bufs = {fd_out: bytearray(), fd_err: bytearray(), status_r: bytearray()}
  for fd in bufs:
    os.set_blocking(fd, False)
    sel.register(fd, selectors.EVENT_READ)
  pos = 0
  if stdin_bytes:
    os.set_blocking(fd_in, False)
    sel.register(fd_in, selectors.EVENT_WRITE)
  else:
    proc.stdin.close()
  deadline = t0 + float(limits.wall_seconds)
  reason, done_at = None, None
  try:
    while sel.get_map() and reason is None:
      now = time.monotonic()
      if now >= deadline:
        reason = 'timeout'
        break
      if done_at is not None and now - done_at > 0.5:
        break  # the launcher has exited; what still holds the pipes is killed below
      wait = deadline - now if done_at is None else min(deadline - now, 0.1)
      for key, _ in sel.select(wait):
        fd = key.fd
        if fd == fd_in:
          try:
            pos += os.write(fd, stdin_bytes[pos : pos + 65536])
          except BlockingIOError:
            continue
          except OSError:  # the program closed stdin or exited
            pos = len(stdin_bytes)
          if pos >= len(stdin_bytes):
            sel.unregister(fd)
            _close(proc.stdin)
          continue
        try:
          chunk = os.read(fd, 65536)
        except BlockingIOError:
          continue
        if not chunk:
          sel.unregister(fd)
          if fd == status_r:
            done_at = time.monotonic()
          continue
        buf = bufs[fd]
        room = cap - len(buf) if fd != status_r else 65536 - len(buf)
        buf += chunk[: max(room, 0)]
        if len(chunk) > room and fd != status_r:
          reason = 'output_limit'
          break
  finally:
    sel.close()
    _close(proc.stdin)
  return bytes(bufs[fd_out]), bytes(bufs[fd_err]), bytes(bufs[status_r]), reason


def _close(stream):
  try:
    stream.close()
  except OSError:
    pass


def _kill_group(proc):
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: launcher, init, program
  except (ProcessLookupError, PermissionError):
    pass
  proc.kill()
  proc.wait()
  _close(proc.stdout)
  _close(proc.stderr)


_remove_tree = _launcher.remove_tree


def _classify(status, reason, launcher_rc, stdout, stderr, limits, wall, oom_kills=0):
  reports = []
  for line in status.decode('utf-8', errors='replace').splitlines():
    try:
      reports.append(json.loads(line))
    except ValueError:
      pass
  for r in reports:
    for key in ('sandbox_error', 'setup_error'):
      if key in r:
        return RunResult('sandbox_error', None, stdout, f'sandbox: {r[key]}\n' + stderr, wall)
  if reason is not None:
    return RunResult(reason, None, stdout, stderr, wall)
  prog = next((r for r in reports if 'exit' in r or 'signal' in r), None)
  if prog is None:
    msg = f'sandbox: the launcher exited with {launcher_rc} without a report\n'
    return RunResult('sandbox_error', None, stdout, msg + stderr, wall)
  tail = stderr[-4096:]
  memory_error = 'MemoryError' in tail or 'Cannot allocate memory' in tail
  memory_error = memory_error or oom_kills > 0 or 'watchdog' in prog
  if 'exit' in prog:
    code = int(prog['exit'])
    status = 'ok' if code == 0 else 'memory' if memory_error else 'error'
    return RunResult(status, code, stdout, stderr, wall)
  sig = int(prog['signal'])
  cpu = float(prog.get('cpu', 0.0))
  if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_seconds - 0.05):
    status = 'timeout'
  elif memory_error or (
    sig == signal.SIGKILL and prog.get('maxrss', 0) >= 0.9 * limits.memory_bytes
  ):
    status = 'memory'
  else:
    status = 'killed'
  return RunResult(status, -sig, stdout, stderr, wall)
