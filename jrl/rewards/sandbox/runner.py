"""One sandboxed run, the caller's side: writes the program, starts the
launcher (`python -I -S launcher/__main__.py`, never a fork of the caller)
with its config on a pipe, feeds stdin, reads stdout, stderr and the status
pipe under the wall clock and the output caps, and cleans up. See README.md
beside this file."""

import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from jrl.rewards.sandbox import launcher
from jrl.rewards.sandbox.cgroups import Cgroup
from jrl.rewards.sandbox.results import classify
from jrl.rewards.sandbox.rootfs import root_spec

# The launcher's entry point, run by path (see launcher/__main__.py).
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(launcher.__file__)), '__main__.py')
PATH = '/usr/local/bin:/usr/bin:/bin'


def minimal_env(workdir):
  """The program's whole environment."""
  return {
    'PATH': PATH,
    'HOME': workdir,
    'TMPDIR': os.path.join(workdir, 'tmp'),
    'LANG': 'C.UTF-8',
  }


def private_proc(plan):
  """Whether the program gets a /proc of its own PID namespace."""
  return plan['mount_namespace'] and plan['pid_namespace'] and plan['_proc_options'] is not None


def pick_uid(plan):
  """A random uid of the sandbox's range, for one run."""
  lo, span = plan['_uid_range']
  return lo + int.from_bytes(os.urandom(4), 'little') % span


def to_bytes(text):
  return text if isinstance(text, bytes) else text.encode('utf-8', 'surrogatepass')


def program_config(plan, workdir, uid, limits, cgroup):
  """The part of the launcher's config that says how the program runs: its
  command, environment, uid, namespaces, limits."""
  mem = int(limits.memory_bytes)
  cpu = max(1, int(limits.cpu_seconds))
  flags = launcher.CLONE_NEWUSER if plan['user_namespace'] else 0
  for key, flag in [
    ('network_namespace', launcher.CLONE_NEWNET),
    ('pid_namespace', launcher.CLONE_NEWPID),
    ('ipc_namespace', launcher.CLONE_NEWIPC),
  ]:
    if plan[key]:
      flags |= flag
  return {
    'workdir': workdir,
    'argv': [sys.executable, '-I', os.path.join(workdir, 'main.py')],
    'env': minimal_env(workdir),
    'uid': uid,
    'unshare': flags,
    'watchdog_bytes': mem if private_proc(plan) and cgroup is None else 0,
    'disk_bytes': int(limits.max_disk_bytes),
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


def check_file_name(name):
  if os.path.basename(name) != name or name in ('main.py', 'tmp', '', '.', '..'):
    raise ValueError(f'a sandbox file is named by a plain file name, not {name!r}')


def run(plan, source, stdin, limits, t0, files=None):
  """Runs `source` once under `plan` (see `plan.make_plan`); raises if the sandbox
  fails before the program runs. `t0`: the caller's time.monotonic() at the start;
  `files`: {name: text} written beside the program (main.py) in its workdir."""
  workdir = tempfile.mkdtemp(prefix='jrl_sandbox_')
  uid = pick_uid(plan) if plan['uid_drop'] else None
  proc = status_r = cgroup = None
  try:
    main = os.path.join(workdir, 'main.py')
    written = [main]
    with open(main, 'w', encoding='utf-8', errors='surrogatepass') as f:
      f.write(source)
    for name, text in (files or {}).items():
      check_file_name(name)
      written.append(os.path.join(workdir, name))
      with open(written[-1], 'w', encoding='utf-8', errors='surrogatepass') as f:
        f.write(text)
    os.mkdir(os.path.join(workdir, 'tmp'))
    if uid is not None and not plan['mount_namespace']:
      for p in (workdir, *written, os.path.join(workdir, 'tmp')):
        os.chown(p, uid, uid)
    if plan['_cgroup']:
      cgroup = Cgroup(plan['_cgroup'], limits)
    own_proc = private_proc(plan)
    status_r, status_w = os.pipe()
    config = dict(
      program_config(plan, workdir, uid, limits, cgroup),
      parent_pid=os.getpid(),
      status_fd=status_w,
      userns=plan['user_namespace'],
      mount=plan['mount_namespace'],
      root=root_spec(workdir) if plan['mount_namespace'] else None,
      proc_options=plan['_proc_options'] if own_proc else None,
      cgroup_procs=cgroup.procs if cgroup else [],
      cgroup_dirs=cgroup.dirs if cgroup else [],
      sweep=uid is not None and not plan['pid_namespace'],
    )
    config_r, config_w = os.pipe()
    try:
      os.write(config_w, json.dumps(config).encode())  # far below a pipe's buffer
      os.close(config_w)
      proc = subprocess.Popen(
        [sys.executable, '-I', '-S', LAUNCHER, '--config-fd', str(config_r)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(status_w, config_r),
        start_new_session=True,
        env={'PATH': PATH, 'LANG': 'C.UTF-8'},
        cwd='/',
      )
    finally:
      os.close(status_w)
      os.close(config_r)
    inputs = [(proc.stdin, to_bytes(stdin))]
    fds = proc.stdout.fileno(), proc.stderr.fileno(), status_r
    out, err, status, reason = pump(*fds, inputs, limits, t0)
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
        [sys.executable, '-I', '-S', LAUNCHER, '--sweep', str(uid)], timeout=30, cwd='/'
      )
    launcher.remove_tree(workdir)
  return result(status, reason, proc.returncode, out, err, limits, t0, oom_kills)


def result(status, reason, launcher_rc, out, err, limits, t0, oom_kills):
  """The RunResult of a run that started at `t0`, its output as bytes (see `classify`)."""
  wall = time.monotonic() - t0
  stdout = out.decode('utf-8', errors='replace')
  stderr = err.decode('utf-8', errors='replace')
  return classify(status, reason, launcher_rc, stdout, stderr, limits, wall, oom_kills)


def pump(fd_out, fd_err, status_r, inputs, limits, t0):
  """Feeds `inputs` ([(file object or fd, bytes)], each closed once written)
  and reads stdout, stderr and the status pipe until the status pipe closes,
  the wall-clock limit passes, stdout stays silent for `limits.quiet_seconds`
  (when > 0), or an output cap is hit. Returns (stdout, stderr, status,
  reason: None | 'timeout' | 'stalled' | 'output_limit')."""
  cap = int(limits.max_output_bytes)
  sel = selectors.DefaultSelector()
  bufs = {fd_out: bytearray(), fd_err: bytearray(), status_r: bytearray()}
  for fd in bufs:
    os.set_blocking(fd, False)
    sel.register(fd, selectors.EVENT_READ)
  writers = {}  # fd -> [stream, data, position]
  for stream, data in inputs:
    if data:
      fd = stream if isinstance(stream, int) else stream.fileno()
      os.set_blocking(fd, False)
      sel.register(fd, selectors.EVENT_WRITE)
      writers[fd] = [stream, data, 0]
    else:
      _close(stream)
  deadline = t0 + float(limits.wall_seconds)
  quiet = float(limits.quiet_seconds)
  reason, done_at, heard = None, None, t0
  try:
    while sel.get_map() and reason is None:
      now = time.monotonic()
      if now >= deadline:
        reason = 'timeout'
        break
      if quiet > 0 and done_at is None and now - heard >= quiet:
        reason = 'stalled'
        break
      if done_at is not None and now - done_at > 0.5:
        break  # the launcher has exited; what still holds the pipes is killed below
      wait = deadline - now if done_at is None else min(deadline - now, 0.1)
      if quiet > 0:
        wait = max(0.0, min(wait, heard + quiet - now))
      for key, _ in sel.select(wait):
        fd = key.fd
        if fd in writers:
          stream, data, pos = writers[fd]
          try:
            pos += os.write(fd, data[pos : pos + 65536])
          except BlockingIOError:
            continue
          except OSError:  # the program closed stdin or exited
            pos = len(data)
          writers[fd][2] = pos
          if pos >= len(data):
            sel.unregister(fd)
            _close(writers.pop(fd)[0])
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
        if fd == fd_out:
          heard = time.monotonic()
        buf = bufs[fd]
        room = cap - len(buf) if fd != status_r else 65536 - len(buf)
        buf += chunk[: max(room, 0)]
        if len(chunk) > room and fd != status_r:
          reason = 'output_limit'
          break
  finally:
    sel.close()
    for stream, _, _ in writers.values():
      _close(stream)
  return bytes(bufs[fd_out]), bytes(bufs[fd_err]), bytes(bufs[status_r]), reason


def _close(stream):
  try:
    if isinstance(stream, int):
      os.close(stream)
    else:
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
