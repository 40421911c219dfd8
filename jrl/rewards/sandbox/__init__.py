"""jrl.rewards.sandbox: runs untrusted, model-written Python in a sandbox.

    result = run_program('print(input()[::-1])', 'abc\\n', limits=Limits(wall_seconds=2))
    result.status, result.stdout      # ('ok', 'cba\\n')
    isolation_level()                 # 'full' | 'no_cgroup' | 'degraded' | 'broken'

Treat every program as hostile. `run_program` never raises for anything the
program does: the outcome is a `RunResult` status, and a failure of the
sandbox itself is status 'sandbox_error' with a message in `stderr`.

See README.md beside this file: what the program sees and does not get, the
isolation levels, the process tree, what is lost where a mechanism is
missing, and which module holds what.
"""

import importlib.metadata
import json
import logging
import os
import threading
import time

from jrl.rewards.sandbox import rootfs, zygote
from jrl.rewards.sandbox.plan import ISOLATION_LEVELS, make_plan
from jrl.rewards.sandbox.results import STATUSES, KiB, Limits, MiB, RunResult
from jrl.rewards.sandbox.runner import run

_log = logging.getLogger(__name__)


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
  """'full' | 'no_cgroup' | 'degraded' | 'broken' (see README.md)."""
  return _get_plan()['isolation']


def isolation_metric():
  """`isolation_level()` as a number for metrics: 3 full, 2 no_cgroup, 1 degraded, 0 broken."""
  return ISOLATION_LEVELS.index(isolation_level())


UNSAFE_ENV = 'JRL_SANDBOX_UNSAFE'  # '1': run programs in a degraded sandbox
PACKAGES_ENV = rootfs.PACKAGES_ENV
SAFE_LEVELS = ('full', 'no_cgroup')
_warned = set()


class SandboxUnavailableError(RuntimeError):
  """The sandbox may not run model-written programs here (see `require_isolation`)."""


def _env_flag(name):
  return os.environ.get(name, '').strip().lower() not in ('', '0', 'false', 'no')


def require_isolation(unsafe=None, who='the sandbox'):
  """The isolation level, if programs may run here; else raises.

  The one check every reward, environment or tool that runs a model-written
  program goes through (`run_program` calls it on every run).

  Args:
    unsafe: run programs even in a 'degraded' sandbox (None: the
      JRL_SANDBOX_UNSAFE environment variable, which `reward.sandbox_unsafe`
      sets for the reward workers).
    who: named in the refusal.
  Returns:
    'full' | 'no_cgroup' | 'degraded' (the last only when `unsafe`).
  Raises:
    SandboxUnavailableError: the sandbox is 'broken', or 'degraded' and not `unsafe`.
  """
  unsafe = _env_flag(UNSAFE_ENV) if unsafe is None else bool(unsafe)
  caps = capabilities()
  level = caps['isolation']
  if level == 'broken':
    raise SandboxUnavailableError(f'the code sandbox cannot run programs here: {caps["self_test"]}')
  if level in SAFE_LEVELS:
    return level
  unprivileged = caps['uid_drop'] or caps['user_namespace']
  missing = [
    name
    for name, ok in [
      ('a mount namespace (new root)', caps['mount_namespace']),
      ('a PID namespace with a private /proc', caps['private_proc']),
      ('a network namespace', caps['network_namespace']),
      ('an IPC namespace', caps['ipc_namespace']),
      ('an unprivileged uid (uid drop or user namespace)', unprivileged),
    ]
    if not ok
  ]
  if not unsafe:
    raise SandboxUnavailableError(
      f'{who} refuses to run model-written programs: the sandbox is {level!r} here, '
      f'missing {", ".join(missing)}, so a program could read its hidden tests, reach the '
      'network or signal the trainer. Run where namespaces are allowed (root, or unprivileged '
      'user namespaces), or set reward.sandbox_unsafe=True (JRL_SANDBOX_UNSAFE=1) to run them '
      f'anyway. Sandbox notes: {"; ".join(caps["notes"])}'
    )
  if level not in _warned:
    _warned.add(level)
    _log.warning('%s runs programs in a %r sandbox (UNSAFE), missing %s', who, level, missing)
  return level


def set_packages(names):
  """The distributions programs may import besides the standard library
  (`JRL_SANDBOX_PACKAGES`, inherited by processes started later): the
  sandbox's interpreter sees them, with their dependencies, copied from this
  environment into a directory of their own, and no other package
  (rootfs.py). Raises ValueError naming one that is not installed here."""
  names = tuple(sorted({str(n).strip() for n in names if str(n).strip()}))
  rootfs.closure(names)
  if names:
    os.environ[PACKAGES_ENV] = ','.join(names)
  else:
    os.environ.pop(PACKAGES_ENV, None)


def check_packages(who='the sandbox'):
  """Runs a program that imports each of the sandbox's packages; raises
  ValueError naming `who` and the package when one does not import."""
  names = rootfs.packages()
  if not names:
    return
  rootfs.package_env()
  modules = {}
  for name in names:
    dist = importlib.metadata.distribution(name)
    top = (dist.read_text('top_level.txt') or '').split()
    modules[name] = top[0] if top else name.replace('-', '_')
  probe = (
    'import importlib, json\n'
    f'failed = {{}}\nfor name, module in {sorted(modules.items())!r}:\n'
    '  try:\n    importlib.import_module(module)\n'
    '  except BaseException as e:\n    failed[name] = f"{type(e).__name__}: {e}"[:300]\n'
    'print(json.dumps(failed))\n'
  )
  result = run_program(probe, limits=Limits(wall_seconds=60, cpu_seconds=30, memory_bytes=4 << 30))
  try:
    failed = json.loads(result.stdout.strip().splitlines()[-1])
  except (ValueError, IndexError):
    failed = {', '.join(names): f'status {result.status}: {result.stderr[-500:]}'}
  if failed:
    raise ValueError(
      f'{who}: in the sandbox, '
      + '; '.join(f'{n!r} does not import ({e})' for n, e in failed.items())
    )


def run_program(source, stdin='', *, limits=Limits(), language='python', files=None):  # noqa: B008
  """Runs `source` with `stdin` under `limits`; returns a RunResult and never
  raises for anything the program does. `files`: {file name: text} put beside
  the program in its working directory.

  Raises SandboxUnavailableError where the sandbox is degraded and the unsafe
  opt-in (JRL_SANDBOX_UNSAFE=1, `reward.sandbox_unsafe`) is not set.
  """
  if language != 'python':
    t0 = time.monotonic()
    message = f'sandbox: ValueError: unsupported language {language!r}; only python runs'
    return RunResult('sandbox_error', None, '', message, time.monotonic() - t0)
  return _run(source, stdin, limits, files, 'exec')


def run_driver(job, *, limits=Limits(), files=None):  # noqa: B008
  """Runs the fixed test driver (`driver.py`, see its docstring) on `job` (its
  stdin: JSON text) with `files` beside it, the program under test as
  'solution.py'; returns a RunResult (one JSON line per case on stdout).

  With a zygote the driver is already loaded in the warm process that each
  run is forked from, so no interpreter starts; elsewhere it runs as main.py.
  Raises SandboxUnavailableError as `run_program` does.
  """
  return _run(zygote.driver_source(), job, limits, files, 'driver')


def _run(source, stdin, limits, files, entry):
  require_isolation()
  t0 = time.monotonic()
  try:
    plan = _get_plan()
    if plan['self_test'] != 'ok':
      raise RuntimeError(f'the sandbox cannot run programs here: {plan["self_test"]}')
    warm = zygote.get() if zygote.eligible(plan) else None
    if warm is not None:
      return zygote.run(plan, warm, source, stdin, limits, t0, files, entry)
    return run(plan, source, stdin, limits, t0, files)
  except Exception as e:
    message = f'sandbox: {type(e).__name__}: {e}'
    return RunResult('sandbox_error', None, '', message, time.monotonic() - t0)


# The plan: probed once per process, on first use. Tests replace `_PLAN`.
_PLAN = None
_PLAN_LOCK = threading.Lock()


def _get_plan():
  global _PLAN
  with _PLAN_LOCK:
    if _PLAN is None:
      _PLAN = make_plan()
      _log.info('code sandbox: isolation %r; %s', _PLAN['isolation'], '; '.join(_PLAN['notes']))
    return _PLAN
