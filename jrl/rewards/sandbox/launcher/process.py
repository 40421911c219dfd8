"""The three processes of a run, started by `launcher --config-fd N`:
the launcher (namespaces, clean-up if the caller dies, a hard deadline), the
init (PID 1: new root, reaping, memory watchdog, report) and the program
(cgroup, rlimits, uid drop, exec)."""

import json
import os
import resource
import shutil
import signal
import sys
import time

from .linux import (
  CLONE_NEWNS,
  MS_NODEV,
  MS_NOEXEC,
  MS_NOSUID,
  PR_SET_NO_NEW_PRIVS,
  PR_SET_PDEATHSIG,
  libc,
  mount,
  prctl,
  refuse_sockets,
  report,
  unshare,
  write_maps,
)
from .new_root import mount_workdir, setup_filesystem

WATCHDOG_PERIOD_S = 0.02  # no cgroup: how often init sums the memory of the sandbox


def exec_program(lib, config, cgroup_fds, entry=None):
  """The program's process: cgroup, limits, privileges, then exec, or (zygote
  runs) `entry()`, the driver already loaded in this interpreter, with only
  stdin, stdout and stderr open. Never returns."""
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
    refuse_sockets(lib)  # vsock, netlink, io_uring (see linux.socket_filter)
    prctl(lib, PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    os.chdir(config['workdir'])
    os.umask(0o077)
    if entry is None:
      if config.get('close_fds'):  # a zygote run: received descriptors are inheritable
        _close_fds_but(0, 1, 2, config['status_fd'])
      argv = config['argv']
      os.execve(argv[0], argv, config['env'])
  except BaseException as e:
    report(config['status_fd'], setup_error=f'{type(e).__name__}: {e}')
    os._exit(127)
  run_entry(entry, config)


def _close_fds_but(*keep):
  top = max(resource.getrlimit(resource.RLIMIT_NOFILE)[0], max(keep) + 1)
  low = 0
  for fd in [*sorted(keep), max(top, 1 << 16)]:
    if low < fd:  # closerange(n, n) would close every fd from n (close_range(n, n - 1))
      os.closerange(low, fd)
    low = fd + 1


def run_entry(entry, config):
  """Runs `entry()` as the program (after the privileges are gone), with only
  fds 0-2 open and the program's environment. Never returns."""
  code = 1
  try:
    _close_fds_but(0, 1, 2)  # the status pipe too: nothing it could forge a report on
    os.environ.clear()
    os.environ.update(config['env'])
    sys.argv = [os.path.join(config['workdir'], 'main.py')]
    entry()
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
  except BaseException:
    code = 1
  os._exit(code)


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


def init(lib, config, cgroup_fds, files=None, entry=None):
  """PID 1 of the sandbox: forks the program, reaps everything, reports. Never
  returns. `files` ({name: bytes}): a zygote run, already inside the new root,
  whose workdir and /proc this init mounts; `entry`: see `exec_program`."""
  fd = config['status_fd']
  try:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 ignores signals it has no handler for
    prctl(lib, PR_SET_PDEATHSIG, signal.SIGKILL)
    if files is not None:
      unshare(lib, CLONE_NEWNS)  # a copy of the zygote's new root
      mount_workdir(lib, config, files)
      if config['proc_options'] is not None:
        mount(
          lib, 'proc', '/proc', 'proc', MS_NOSUID | MS_NODEV | MS_NOEXEC, config['proc_options']
        )
    elif config['mount']:
      unshare(lib, CLONE_NEWNS)
      setup_filesystem(lib, config)
    pid = os.fork()
    if pid == 0:
      exec_program(lib, config, cgroup_fds, entry)
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
