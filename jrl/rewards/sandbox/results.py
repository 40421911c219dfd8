"""What one sandboxed run is given and gives back: `Limits` in, `RunResult`
out, and `classify`, which reads the launcher's report into a RunResult.
See README.md beside this file."""

import dataclasses
import json
import signal
from typing import NamedTuple

MiB = 1 << 20
KiB = 1 << 10

STATUSES = (
  'ok',
  'error',
  'timeout',
  'stalled',
  'memory',
  'output_limit',
  'killed',
  'sandbox_error',
)


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
  # > 0: the run ends ('stalled') when stdout stays silent this long (enforced by
  # the caller), e.g. a test driver that reports each case and was stopped
  quiet_seconds: float = 0.0


class RunResult(NamedTuple):
  """The outcome of one run.

  status: 'ok' (exit 0), 'error' (nonzero exit), 'timeout' (wall clock or
    CPU limit), 'stalled' (stdout silent for `quiet_seconds`), 'memory'
    (MemoryError, an OOM kill in the cgroup, the memory watchdog, or killed
    near the memory limit), 'output_limit' (stdout or
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


def classify(status, reason, launcher_rc, stdout, stderr, limits, wall, oom_kills=0):
  """The RunResult of a run, from the launcher's `status` pipe (JSON lines), the
  caller's `reason` to stop it (None, 'timeout', 'stalled' or 'output_limit'), the
  launcher's exit code, the decoded output and the cgroup's OOM kill count."""
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
