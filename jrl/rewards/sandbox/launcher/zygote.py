"""The warm launcher (a zygote): one process per caller that builds the new
root once and forks every run from there, so that a run costs forks and
namespaces, not interpreters (see `jrl.rewards.sandbox.zygote`, the caller's
side, and README.md in the sandbox package).

    zygote    `launcher --zygote`: loads the driver, enters a mount namespace
      |       and pivots into the new root (read-only, no /proc); then reads
      |       requests from its socket, forks a run for each and reaps them;
      |       exits when the caller's end of the socket closes.
      run     a session of its own; stdin, stdout and stderr from the request;
      |       enters the PID, network and IPC namespaces and forks the init;
      |       kills the init when the caller closes the lifeline, when the
      |       hard deadline passes, or (PR_SET_PDEATHSIG) when the zygote dies.
      init    PID 1 (`process.init`): a mount namespace of its own, the tmpfs
      |       workdir holding the request's files, a /proc of the namespace.
      program cgroup, rlimits, uid drop, no_new_privs; then execs Python on
              main.py, or runs the loaded driver (`entry: 'driver'`).

A request is one message on the socket: JSON (the run's config, as
`process.launch` reads it, without paths or descriptor numbers) and, as
SCM_RIGHTS, the descriptors `FDS` then the cgroup.procs files to join.
The zygote never reads a run's files or input: they travel on the run's own
pipes, read after the fork, so no run's data is in the memory a later run is
forked from.
"""

import importlib.util
import json
import os
import select
import signal
import socket

from .linux import CLONE_NEWNS, PR_SET_PDEATHSIG, libc, prctl, report, unshare
from .new_root import enter_new_root
from .process import init

FDS = ('stdin', 'stdout', 'stderr', 'status', 'files', 'lifeline')
MAX_REQUEST_BYTES = 1 << 16
MAX_FDS = len(FDS) + 4  # the cgroup.procs files: one per hierarchy


def load_driver(path):
  """The driver module (`jrl/rewards/sandbox/driver.py`), loaded by path."""
  spec = importlib.util.spec_from_file_location('_jrl_sandbox_driver', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def serve(config, sock_fd):
  """The zygote's life: set up, say ready, then serve requests until EOF."""
  lib = libc()
  sock = socket.socket(fileno=sock_fd)
  try:
    driver = load_driver(config['driver_path'])
    unshare(lib, CLONE_NEWNS)
    enter_new_root(lib, config['mountpoint'], config['root'], None)
  except BaseException as e:
    sock.send(json.dumps({'error': f'{type(e).__name__}: {e}'}).encode())
    return 1
  sock.send(b'{"ready": true}')
  children = set()
  try:
    while True:
      ready, _, _ = select.select([sock], [], [], 1.0)
      _reap(children)
      if not ready:
        continue
      try:
        message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, MAX_FDS)
      except OSError:
        break
      if not message:
        break  # the caller is gone
      try:
        request = json.loads(message)
        if len(fds) < len(FDS):
          raise ValueError(f'{len(fds)} descriptors')
      except ValueError:
        for fd in fds:
          os.close(fd)
        continue
      pid = os.fork()
      if pid == 0:
        sock.close()
        run(lib, request, fds, driver)
      for fd in fds:
        os.close(fd)
      children.add(pid)
  finally:
    for pid in children:
      _kill(pid)
    _reap(children, block=True)
  return 0


def _reap(children, block=False):
  for pid in list(children):
    try:
      done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
      done = pid
    if done:
      children.discard(pid)


def _kill(pid):
  try:
    os.killpg(pid, signal.SIGKILL)
  except OSError:
    pass


def _read_files(fd):
  chunks = []
  while True:
    chunk = os.read(fd, 1 << 16)
    if not chunk:
      break
    chunks.append(chunk)
  os.close(fd)
  files = json.loads(b''.join(chunks).decode('utf-8', 'surrogatepass'))
  return {name: text.encode('utf-8', 'surrogatepass') for name, text in files.items()}


def run(lib, request, fds, driver):
  """One run, in a child of the zygote. Never returns."""
  status = fds[FDS.index('status')]
  try:
    os.setsid()
    os.set_inheritable(status, False)  # closed when the program execs
    prctl(lib, PR_SET_PDEATHSIG, signal.SIGKILL)  # the zygote's death ends the run
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
      signal.signal(sig, signal.SIG_DFL)
    stdin, stdout, stderr, _, files_fd, lifeline = fds[: len(FDS)]
    cgroup_fds = fds[len(FDS) :]
    for target, fd in enumerate((stdin, stdout, stderr)):
      os.dup2(fd, target)
    for fd in (stdin, stdout, stderr):
      if fd > 2:
        os.close(fd)
    files = _read_files(files_fd)
    config = dict(request, status_fd=status, close_fds=True)
    entry = driver.main if request.get('entry') == 'driver' else None
    unshare(lib, config['unshare'])
  except BaseException as e:
    report(status, sandbox_error=f'zygote run: {type(e).__name__}: {e}')
    os._exit(1)
  pid = os.fork()
  if pid == 0:
    os.close(lifeline)
    init(lib, config, cgroup_fds, files=files, entry=entry)
  for fd in cgroup_fds:
    os.close(fd)
  os.close(status)
  try:
    pidfd = os.pidfd_open(pid)
    select.select([pidfd, lifeline], [], [], float(config['hard_deadline']))
  except OSError:
    pass
  try:
    os.kill(pid, signal.SIGKILL)  # a no-op for an init that exited (a zombie until reaped)
  except OSError:
    pass
  os.waitpid(pid, 0)  # returns once every process of the PID namespace is gone
  os._exit(0)
