"""The privileged half of `jrl.rewards.sandbox`: what runs inside the namespaces.

Run as `python -I -S _sandbox_launcher.py --config-fd N` by `sandbox.py`
(never imported for its side effects: importing it only defines functions
and constants, which `sandbox.py` uses). The config (JSON) comes on fd N,
not in argv, so that nothing of it shows in /proc/PID/cmdline. Depends on
the standard library only, since it runs with -I -S.

    launcher  enters the user (if not root), PID, network and IPC namespaces,
      |       opens the cgroup files the program joins, forks:
      init    PID 1: enters a mount namespace, builds the new root
      |       (`enter_new_root`), forks the program, reaps orphans, and (no
      |       cgroup) watches the memory of all processes; reports on the
      |       status pipe and exits, so the kernel kills what is left
      program joins the cgroup, sets rlimits, drops to the sandbox uid,
              sets no_new_privs and execs Python.

See `sandbox.py` for what each mechanism guarantees.
"""

import ctypes
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time

# Linux constants (<sched.h>, <sys/mount.h>, <linux/prctl.h>, <linux/mount.h>).
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# The new mount API has the same syscall numbers on every architecture.
SYS_MOUNT_SETATTR = 442
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
SYS_PIVOT_ROOT = {'x86_64': 155, 'aarch64': 41, 'arm64': 41, 'ppc64le': 203, 's390x': 217}

# Device nodes bound into the new root's /dev (read-only mounts; writes to
# /dev/null still work, since a device's mount flags do not apply to it).
DEVICES = ('null', 'zero', 'full', 'random', 'urandom')
DEV_LINKS = (('fd', '/proc/self/fd'), ('stdin', '/proc/self/fd/0'),
             ('stdout', '/proc/self/fd/1'), ('stderr', '/proc/self/fd/2'))  # fmt: skip
WATCHDOG_PERIOD_S = 0.02  # no cgroup: how often init sums the memory of the sandbox


def libc():
  return ctypes.CDLL(None, use_errno=True)


def check(ret, what):
  if ret != 0:
    errno = ctypes.get_errno()
    raise OSError(errno, f'{what}: {os.strerror(errno)}')


def mount(lib, source, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  ret = lib.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
  check(ret, f'mount {fstype or source} on {target}')


class _MountAttr(ctypes.Structure):
  _fields_ = [
    ('attr_set', ctypes.c_uint64),
    ('attr_clr', ctypes.c_uint64),
    ('propagation', ctypes.c_uint64),
    ('userns_fd', ctypes.c_uint64),
  ]


def read_only_tree(lib, path='/'):
  """Makes every mount under `path` read-only and nosuid, recursively, in one call."""
  attr = _MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
  ret = lib.syscall(
    ctypes.c_long(SYS_MOUNT_SETATTR),
    ctypes.c_long(AT_FDCWD),
    ctypes.c_char_p(path.encode()),
    ctypes.c_long(AT_RECURSIVE),
    ctypes.byref(attr),
    ctypes.c_long(ctypes.sizeof(attr)),
  )
  check(ret, f'mount_setattr({path}, AT_RECURSIVE, RDONLY)')


def unshare(lib, flags):
  check(lib.unshare(ctypes.c_int(flags)), f'unshare({flags:#x})')


def write_maps():
  """Maps the caller's uid and gid to themselves in a new user namespace."""
  uid, gid = os.getuid(), os.getgid()
  maps = [('setgroups', 'deny'), ('uid_map', f'{uid} {uid} 1'), ('gid_map', f'{gid} {gid} 1')]
  for name, text in maps:
    with open(f'/proc/self/{name}', 'w') as f:
      f.write(text)


def prctl(lib, option, value):
  check(lib.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f'prctl({option})')


def report(fd, **message):
  try:
    os.write(fd, (json.dumps(message) + '\n').encode())
  except OSError:
    pass


def pivot_root(lib, new_root, put_old):
  number = SYS_PIVOT_ROOT.get(os.uname().machine)
  if number is None:
    raise OSError(f'pivot_root: unknown syscall number on {os.uname().machine}')
  ret = lib.syscall(
    ctypes.c_long(number), ctypes.c_char_p(new_root.encode()), ctypes.c_char_p(put_old.encode())
  )
  check(ret, f'pivot_root({new_root})')


def _make_target(path, is_dir):
  os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
  if is_dir:
    os.makedirs(path, mode=0o755, exist_ok=True)
  elif not os.path.exists(path):
    open(path, 'w').close()


def _check_spec(spec):
  """Refuses a bind or link inside another: creating its mountpoint would
  write into the host's directory bound there (the mounts are not read-only
  until the end)."""
  paths = [p for p, _ in spec['binds']] + [p for p, _ in spec['links']]
  for d in spec.get('dirs', ()):
    if any(d == p or d.startswith(p + '/') for p in paths):
      raise ValueError(f'{d} lies inside a bind or link of the root spec')
  for p in paths:
    if not p.startswith('/') or os.path.normpath(p) != p or p == '/':
      raise ValueError(f'bad path in the root spec: {p!r}')
    for q in paths:
      if p != q and p.startswith(q.rstrip('/') + '/'):
        raise ValueError(f'{p} lies inside {q} in the root spec')


def enter_new_root(lib, mountpoint, spec, proc_options):
  """Builds a root of its own on a tmpfs at `mountpoint` and pivots into it.

  In a fresh mount namespace (the caller unshared it): the new root holds
  only `spec['binds']` ([host path, is_dir], bound at the same path,
  recursively), `spec['links']` ([path, target] symlinks), `spec['dirs']`
  (empty directories, mountpoints for later), a /dev of
  `DEVICES`, a fresh /proc (`proc_options`: mount options, or None for an
  empty /proc) and an empty /sys; the old root is detached and everything is
  made read-only. The caller mounts the writable places afterwards.
  """
  _check_spec(spec)
  mount(lib, None, '/', None, MS_REC | MS_PRIVATE)
  mount(lib, 'tmpfs', mountpoint, 'tmpfs', MS_NOSUID | MS_NODEV, 'size=1m,nr_inodes=4096,mode=0755')
  os.chmod(mountpoint, 0o755)
  at = lambda p: mountpoint + p
  for path, target in spec['links']:
    os.makedirs(os.path.dirname(at(path)), mode=0o755, exist_ok=True)
    os.symlink(target, at(path))
  for path, is_dir in sorted(spec['binds'], key=lambda b: b[0].count('/')):  # outer first
    _make_target(at(path), is_dir)
    mount(lib, path, at(path), None, MS_BIND | MS_REC)
  for name in DEVICES:
    if os.path.exists(f'/dev/{name}'):
      _make_target(at(f'/dev/{name}'), False)
      mount(lib, f'/dev/{name}', at(f'/dev/{name}'), None, MS_BIND)
  for name, target in DEV_LINKS:
    os.symlink(target, at(f'/dev/{name}'))
  for d in (*spec.get('dirs', ()), '/dev/shm', '/proc', '/sys', '/.old'):
    os.makedirs(at(d), mode=0o755, exist_ok=True)
  pivot_root(lib, mountpoint, at('/.old'))
  os.chdir('/')
  if proc_options is not None:  # while the old /proc is still attached (user namespaces need it)
    mount(lib, 'proc', '/proc', 'proc', MS_NOSUID | MS_NODEV | MS_NOEXEC, proc_options)
  check(lib.umount2(b'/.old', MNT_DETACH), 'umount2(/.old)')
  os.rmdir('/.old')
  read_only_tree(lib, '/')


def proc_mount_options(lib):
  """hidepid: processes of other uids (the init, as root) are invisible."""
  for data in ('hidepid=invisible', 'hidepid=2'):
    try:
      mount(lib, 'proc', '/proc', 'proc', MS_NOSUID | MS_NODEV | MS_NOEXEC, data)
      return data
    except OSError:
      continue
  mount(lib, 'proc', '/proc', 'proc', MS_NOSUID | MS_NODEV | MS_NOEXEC)
  return ''


def setup_filesystem(lib, config):
  """In init, in a new mount namespace: the new root, then the writable tmpfs
  workdir (same path as the caller's, a disk quota of `disk_bytes`) and a
  tiny private /dev/shm."""
  workdir = config['workdir']
  with open(os.path.join(workdir, 'main.py'), 'rb') as f:
    source = f.read()
  enter_new_root(lib, workdir, config['root'], config['proc_options'])
  uid = config['uid'] if config['uid'] is not None else os.getuid()
  size, inodes = config['disk_bytes'], max(64, config['disk_bytes'] // 4096)
  opts = f'size={size},nr_inodes={inodes},mode=0700'
  if config['uid'] is not None:
    opts += f',uid={uid},gid={uid}'
  mount(lib, 'tmpfs', workdir, 'tmpfs', MS_NOSUID | MS_NODEV, opts)
  mount(lib, 'tmpfs', '/dev/shm', 'tmpfs', MS_NOSUID | MS_NODEV, 'size=1m,nr_inodes=64,mode=1777')
  main = os.path.join(workdir, 'main.py')
  with open(main, 'wb') as f:
    f.write(source)
  os.mkdir(os.path.join(workdir, 'tmp'))
  if config['uid'] is not None:
    for p in (main, os.path.join(workdir, 'tmp')):
      os.chown(p, uid, uid)


def exec_program(lib, config, cgroup_fds):
  """The program's process: cgroup, limits, privileges, exec. Never returns."""
  try:
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGALRM, signal.SIGTERM):
      signal.signal(sig, signal.SIG_DFL)
    for fd in cgroup_fds:  # before the uid drop; everything it forks stays in the cgroup
      os.write(fd, b'0')
      os.close(fd)
    for res, soft, hard in config['rlimits']:
      if res == resource.RLIMIT_NPROC and config['nproc_counts_user']:
        soft = hard = soft + tasks_of(os.getuid())  # the user's processes count too
      cur_hard = resource.getrlimit(res)[1]
      if os.geteuid() != 0 and cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)  # only root may raise a hard limit
        soft = min(soft, hard)
      resource.setrlimit(res, (soft, hard))
    uid = config['uid']
    if uid is not None:
      os.setgroups([])
      os.setgid(uid)
      os.setuid(uid)
    prctl(lib, PR_SET_NO_NEW_PRIVS, 1)
    prctl(lib, PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    os.chdir(config['workdir'])
    os.umask(0o077)
    argv = config['argv']
    os.execve(argv[0], argv, config['env'])
  except BaseException as e:
    report(config['status_fd'], setup_error=f'{type(e).__name__}: {e}')
  os._exit(127)


def tasks_of(uid):
  """The number of tasks (threads) of `uid`, which RLIMIT_NPROC counts."""
  n = 0
  for pid in os.listdir('/proc'):
    if not pid.isdigit():
      continue
    try:
      with open(f'/proc/{pid}/status') as f:
        fields = dict(line.split(':', 1) for line in f if ':' in line)
      if int(fields['Uid'].split()[0]) == uid:
        n += int(fields['Threads'])
    except (OSError, KeyError, ValueError):
      pass
  return n


def sandbox_rss():
  """Resident bytes of every process but this one (init) in this PID namespace."""
  total, me, page = 0, str(os.getpid()), os.sysconf('SC_PAGE_SIZE')
  for pid in os.listdir('/proc'):
    if pid.isdigit() and pid != me:
      try:
        with open(f'/proc/{pid}/statm') as f:
          total += int(f.read().split()[1]) * page
      except (OSError, IndexError, ValueError):
        pass
  return total


def init(lib, config, cgroup_fds):
  """PID 1 of the sandbox: forks the program, reaps everything, reports. Never returns."""
  fd = config['status_fd']
  try:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 ignores signals it has no handler for
    prctl(lib, PR_SET_PDEATHSIG, signal.SIGKILL)
    if config['mount']:
      unshare(lib, CLONE_NEWNS)
      setup_filesystem(lib, config)
    pid = os.fork()
    if pid == 0:
      exec_program(lib, config, cgroup_fds)
    for cg in cgroup_fds:
      os.close(cg)
    watch = config['watchdog_bytes']
    over = False
    while True:
      child, status, usage = os.wait4(-1, os.WNOHANG if watch else 0)
      if child == pid:
        break
      if watch and child == 0:
        if sandbox_rss() > watch:
          over = True
          os.kill(-1, signal.SIGKILL)  # in a PID namespace: everything but init
        time.sleep(WATCHDOG_PERIOD_S)
    cpu = usage.ru_utime + usage.ru_stime
    maxrss = usage.ru_maxrss * 1024
    extra = {'watchdog': 'memory'} if over else {}
    if os.WIFSIGNALED(status):
      report(fd, signal=os.WTERMSIG(status), cpu=cpu, maxrss=maxrss, **extra)
    else:
      report(fd, exit=os.waitstatus_to_exitcode(status), cpu=cpu, maxrss=maxrss, **extra)
  except BaseException as e:
    report(fd, sandbox_error=f'init: {type(e).__name__}: {e}')
  os._exit(0)  # in a PID namespace, the kernel now kills everything left in it


def sweep(uid):
  """Kills every process of `uid` from a process of that uid (kill(-1) skips the sender)."""
  pid = os.fork()
  if pid == 0:
    try:
      os.setgroups([])
      os.setgid(uid)
      os.setuid(uid)
      for _ in range(1000):
        os.kill(-1, signal.SIGKILL)
    except BaseException:
      pass
    os._exit(0)
  os.waitpid(pid, 0)


def remove_tree(path):
  def retry(fn, p, _):
    try:
      os.chmod(os.path.dirname(p), 0o700)
      os.chmod(p, 0o700)
      fn(p)
    except OSError:
      pass

  shutil.rmtree(path, onerror=retry)


def read_config(fd):
  chunks = []
  while True:
    chunk = os.read(fd, 65536)
    if not chunk:
      break
    chunks.append(chunk)
  os.close(fd)
  return json.loads(b''.join(chunks))


def launch(config):
  lib = libc()
  fd = config['status_fd']
  os.set_inheritable(fd, False)  # the program's exec closes it
  children = []  # the init, once forked

  def caller_died(*_):  # PR_SET_PDEATHSIG: clean up what the caller no longer will
    # The signal comes again as each thread of a dying caller exits; once is enough.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
      for pid in children:
        try:
          os.kill(pid, signal.SIGKILL)
          os.waitpid(pid, 0)
        except OSError:
          pass
      if config['sweep']:
        sweep(config['uid'])
      remove_tree(config['workdir'])  # the launcher stays in the caller's mount namespace
      for _ in range(100):  # the killed processes leave the cgroups
        for d in config['cgroup_dirs']:
          try:
            os.rmdir(d)
          except OSError:
            pass
        if not any(os.path.exists(d) for d in config['cgroup_dirs']):
          break
        time.sleep(0.01)
      os.killpg(0, signal.SIGKILL)  # the session's group, this process last
    finally:
      os._exit(1)

  try:
    signal.signal(signal.SIGTERM, caller_died)
    prctl(lib, PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != config['parent_pid']:
      caller_died()  # the caller was gone before the line above
    cgroup_fds = [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in config['cgroup_procs']]
    if config['unshare']:
      unshare(lib, config['unshare'])
    if config['userns']:
      write_maps()
  except BaseException as e:
    report(fd, sandbox_error=f'launcher: {type(e).__name__}: {e}')
    return 1
  pid = os.fork()
  if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    init(lib, config, cgroup_fds)
  for cg in cgroup_fds:
    os.close(cg)
  children.append(pid)
  signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
  signal.setitimer(signal.ITIMER_REAL, config['hard_deadline'])
  os.waitpid(pid, 0)
  children.clear()
  signal.setitimer(signal.ITIMER_REAL, 0)
  if config['sweep']:
    sweep(config['uid'])
  return 0


# The probe ------------------------------------------------------------------------


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


def main(argv):
  if argv[:1] == ['--probe']:
    return probe()
  if argv[:1] == ['--sweep']:
    sweep(int(argv[1]))
    return 0
  if argv[:1] == ['--config-fd']:
    return launch(read_config(int(argv[1])))
  print(f'usage: {sys.argv[0]} --probe | --sweep UID | --config-fd FD', file=sys.stderr)
  return 2


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
