"""Which mechanisms work on this machine, each tried in a forked child:
`launcher --probe` prints them as JSON for `jrl.rewards.sandbox.plan`."""

import json
import os
import shutil
import sys
import tempfile

from .linux import (
  CLONE_NEWIPC,
  CLONE_NEWNET,
  CLONE_NEWNS,
  CLONE_NEWPID,
  CLONE_NEWUSER,
  MS_NODEV,
  MS_NOSUID,
  MS_PRIVATE,
  MS_REC,
  libc,
  mount,
  unshare,
  write_maps,
)
from .new_root import enter_new_root, proc_mount_options


def probe():
  """Which mechanisms work here, each tried in a forked child; prints JSON."""
  lib = libc()
  root = os.geteuid() == 0
  found, errors = {'root': root}, {}
  base = 0 if root else CLONE_NEWUSER
  scratch = tempfile.mkdtemp(prefix='jrl_sandbox_probe_')

  def attempt(name, fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
      os.close(r)
      try:
        result = fn()
        os.write(w, json.dumps(result).encode())
        os._exit(0)
      except BaseException as e:
        os.write(w, f'{type(e).__name__}: {e}'.encode())
        os._exit(1)
    os.close(w)
    message = os.read(r, 4096).decode(errors='replace')
    os.close(r)
    _, status = os.waitpid(pid, 0)
    found[name] = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    if not found[name]:
      errors[name] = message or f'wait status {status}'
    elif message and json.loads(message) is not None:
      found[name] = json.loads(message)

  def enter(flags):
    unshare(lib, base | flags)
    if base:
      write_maps()

  def new_root():  # every call `setup_filesystem` makes, on an empty root
    enter(CLONE_NEWNS)
    spec = {'binds': [[sys.base_prefix, True]], 'links': []}
    enter_new_root(lib, scratch, spec, None)
    os.makedirs('/dev/shm', exist_ok=True)
    mount(lib, 'tmpfs', '/dev/shm', 'tmpfs', MS_NOSUID | MS_NODEV, 'size=64k')
    if os.listdir('/') == [] or not os.path.isdir(sys.base_prefix):
      raise OSError('the new root is not as built')

  def pid_ns(with_proc):
    def fn():
      enter(CLONE_NEWPID | (CLONE_NEWNS if with_proc else 0))
      if with_proc:
        mount(lib, None, '/', None, MS_REC | MS_PRIVATE)
      r, w = os.pipe()
      child = os.fork()
      if child == 0:
        ok = os.getpid() == 1
        options = proc_mount_options(lib) if ok and with_proc else ''
        os.write(w, options.encode())
        os._exit(0 if ok else 1)
      os.close(w)
      options = os.read(r, 256).decode()
      _, status = os.waitpid(child, 0)
      if status != 0:
        raise OSError(f'the first child in the PID namespace failed ({status})')
      return options if with_proc else None

    return fn

  def drop_uid():
    uid = found['uid_range'][0]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)

  try:
    if not root:
      attempt('user', lambda: enter(0))
    attempt('net', lambda: enter(CLONE_NEWNET))
    attempt('ipc', lambda: enter(CLONE_NEWIPC))
    attempt('mount', new_root)
    attempt('pid', pid_ns(False))
    attempt('proc', pid_ns(True))
    found['uid_range'] = uid_range()
    if root:
      attempt('uid', drop_uid)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  found['errors'] = errors
  print(json.dumps(found))
  return 0


UID_BASE, UID_SPAN = 1 << 30, 1 << 20  # per-call sandbox uids, when the uid map allows


def uid_range():
  """(first, count) of sandbox uids mapped in this (possibly nested) namespace."""
  extents = []
  for name in ('uid_map', 'gid_map'):
    with open(f'/proc/self/{name}') as f:
      extents.append([tuple(int(x) for x in line.split()) for line in f if line.strip()])

  def mapped(lo, hi):  # every id in [lo, hi) mapped in both maps
    return all(any(s <= lo and hi <= s + n for s, _, n in ext) for ext in extents)

  if mapped(UID_BASE, UID_BASE + UID_SPAN):
    return [UID_BASE, UID_SPAN]
  for s, _, n in sorted(extents[0], key=lambda e: -e[2]):
    hi = min(s + n, 65534)
    lo = max(s, 1000, hi - 4096)
    if hi > lo and mapped(lo, hi):
      return [lo, hi - lo]
  return [65534, 1]
