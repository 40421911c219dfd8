"""The warm launcher, the caller's side: one zygote process per caller
process (`launcher/zygote.py`) that has built the new root once and forks
each run from there, with the same namespaces, cgroup, rlimits and uid drop
as a run that starts its own launcher (`runner.run`), but without starting
an interpreter for the launcher, building the root again, or (code tests)
starting an interpreter for the driver. See README.md beside this file.

Used where the plan has everything it relies on: root with a uid drop, the
mount and PID namespaces with a private /proc. Elsewhere (a user namespace,
a degraded sandbox) every run starts its own launcher, as before.
"""

import io
import json
import logging
import os
import secrets
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time

from jrl.rewards.sandbox import rootfs
from jrl.rewards.sandbox.cgroups import Cgroup
from jrl.rewards.sandbox.launcher.zygote import FDS
from jrl.rewards.sandbox.rootfs import root_spec
from jrl.rewards.sandbox.runner import (
  LAUNCHER,
  PATH,
  check_file_name,
  pick_uid,
  program_config,
  pump,
  result,
  to_bytes,
)

DRIVER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'driver.py')
START_TIMEOUT_S = 30.0
ENABLED = True  # tests switch it off to run the one-launcher-per-run path
_log = logging.getLogger(__name__)


_DRIVER = []


def driver_source():
  """The driver's text (main.py where a run starts its own launcher)."""
  if not _DRIVER:
    with open(DRIVER_PATH, encoding='utf-8') as f:
      _DRIVER.append(f.read())
  return _DRIVER[0]


def eligible(plan):
  """Whether runs under `plan` may go through a zygote."""
  return bool(
    ENABLED
    and plan['self_test'] == 'ok'
    and plan['root']
    and plan['uid_drop']
    and plan['mount_namespace']
    and plan['pid_namespace']
    and plan['_proc_options'] is not None
  )


class Zygote:
  """One warm launcher process; `submit` hands it a run."""

  def __init__(self):
    self.workdir = f'/tmp/jrl_sandbox_{secrets.token_hex(6)}'  # the runs' cwd, in the new root
    self.owner = os.getpid()
    self.packages = rootfs.packages()  # the root it pivots into shows these
    self._lock = threading.Lock()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mountpoint = tempfile.mkdtemp(prefix='jrl_sandbox_root_')
    config_r, config_w = os.pipe()
    try:
      config = {
        'driver_path': DRIVER_PATH,
        'mountpoint': mountpoint,
        'root': root_spec(self.workdir),
      }
      os.write(config_w, json.dumps(config).encode())  # far below a pipe's buffer
      os.close(config_w)
      self.proc = subprocess.Popen(
        [sys.executable, '-I', LAUNCHER, '--zygote', str(config_r), str(theirs.fileno())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(config_r, theirs.fileno()),
        start_new_session=True,
        env={'PATH': PATH, 'LANG': 'C.UTF-8'},
        cwd='/',
      )
      theirs.close()
      ours.settimeout(START_TIMEOUT_S)
      try:
        reply = json.loads(ours.recv(1 << 16) or b'{"error": "it exited"}')
      except (TimeoutError, ValueError) as e:
        reply = {'error': f'{type(e).__name__}: {e}'}
      if not reply.get('ready'):
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f'the sandbox zygote did not start: {reply.get("error")}')
      ours.settimeout(None)
      self.sock = ours
    except BaseException:
      ours.close()
      raise
    finally:
      os.close(config_r)
      os.rmdir(mountpoint)  # the zygote's root is mounted in its own namespace only

  def alive(self):
    return self.owner == os.getpid() and self.proc.poll() is None

  def submit(self, request, fds):
    """Hands one run to the zygote: `request` (JSON-able) and the descriptors
    `launcher.zygote.FDS` followed by the cgroup.procs files."""
    with self._lock:
      socket.send_fds(self.sock, [json.dumps(request).encode()], fds)

  def close(self):
    self.sock.close()  # the zygote exits at EOF, killing its runs
    try:
      self.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


_ZYGOTE = None
_LOCK = threading.Lock()
_FAILED = []  # why a zygote could not start in this process (then: one launcher per run)


def get():
  """This process's zygote, started on first use (or again if it died); None
  where one could not start (logged once)."""
  global _ZYGOTE
  with _LOCK:
    if _ZYGOTE is not None and _ZYGOTE.alive() and _ZYGOTE.packages == rootfs.packages():
      return _ZYGOTE
    if _ZYGOTE is not None and _ZYGOTE.owner == os.getpid():
      _ZYGOTE.close()
    _ZYGOTE = None
    if _FAILED:
      return None
    try:
      _ZYGOTE = Zygote()
    except Exception as e:
      _FAILED.append(f'{type(e).__name__}: {e}')
      _log.warning('sandbox: no zygote (%s); every run starts its own launcher', _FAILED[0])
    return _ZYGOTE


def run(plan, zygote, source, stdin, limits, t0, files=None, entry='exec'):
  """Runs `source` as main.py (beside `files`) under `plan` through `zygote`;
  `entry='driver'` runs the driver loaded in the zygote instead of starting
  Python on main.py (main.py is then not read). Returns a RunResult; raises
  if the sandbox fails before the program runs."""
  payload = {'main.py': source}
  for name, text in (files or {}).items():
    check_file_name(name)
    payload[name] = text
  uid = pick_uid(plan)
  cgroup = Cgroup(plan['_cgroup'], limits) if plan['_cgroup'] else None
  ours, theirs = {}, []  # ours: name -> FileIO (closing twice is harmless)
  status = b''
  try:
    for name in FDS:
      r, w = os.pipe()
      mine, child = (w, r) if name in ('stdin', 'files', 'lifeline') else (r, w)
      ours[name] = io.FileIO(mine, 'wb' if mine == w else 'rb')
      theirs.append(child)
    if cgroup is not None:
      theirs += [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in cgroup.procs]
    request = dict(
      program_config(plan, zygote.workdir, uid, limits, cgroup),
      proc_options=plan['_proc_options'],
      mount=True,
      entry=entry,
    )
    zygote.submit(request, theirs)
    for fd in theirs:
      os.close(fd)
    theirs = []
    inputs = [(ours['files'], json.dumps(payload).encode()), (ours['stdin'], to_bytes(stdin))]
    fds = [ours[name].fileno() for name in ('stdout', 'stderr', 'status')]
    out, err, status, reason = pump(*fds, inputs, limits, t0)
  finally:
    for fd in theirs:
      os.close(fd)
    if 'lifeline' in ours:
      ours['lifeline'].close()  # the run kills its init, if it still runs
    if 'status' in ours and not ours['status'].closed:
      status += _drain(ours['status'].fileno(), 2.0)  # until every process has exited
    for f in ours.values():
      f.close()
    oom_kills = 0
    if cgroup is not None:
      oom_kills = cgroup.oom_kills()
      cgroup.remove()
  return result(status, reason, 0, out, err, limits, t0, oom_kills)


def _drain(fd, timeout_s):
  """Reads `fd` to EOF (at most `timeout_s`); what it read."""
  data = bytearray()
  os.set_blocking(fd, False)
  deadline = time.monotonic() + timeout_s
  with selectors.DefaultSelector() as sel:
    sel.register(fd, selectors.EVENT_READ)
    while (left := deadline - time.monotonic()) > 0:
      if not sel.select(left):
        continue
      try:
        chunk = os.read(fd, 65536)
      except BlockingIOError:
        continue
      if not chunk:
        break
      data += chunk[: max(0, 65536 - len(data))]
  return bytes(data)
