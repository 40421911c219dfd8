"""A cgroup per run: where one can be made (`find_cgroup`), and the child cgroup
of one run with its memory and pids limits (`Cgroup`), killed and removed
after it. cgroup v2, or a v1 memory (and pids) hierarchy. See README.md
beside this file."""

import logging
import os
import signal
import time
import uuid

from jrl.rewards.sandbox.results import Limits
from jrl.rewards.sandbox.rootfs import inside

CGROUP_PREFIX = 'jrl_sandbox_'  # + the caller's pid + '_' + a random suffix
_log = logging.getLogger(__name__)


def _read(path):
  with open(path) as f:
    return f.read()


def _write(path, text):
  with open(path, 'w') as f:
    f.write(text)


def find_cgroup():
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
    if path is None or not inside(path, root):
      return None
    return os.path.normpath(mountpoint + '/' + os.path.relpath(path, root))

  errors = []
  for fstype, root, mountpoint, _ in mounts:
    if fstype != 'cgroup2':
      continue
    d = own_dir('', root, mountpoint)
    while d and inside(d, mountpoint):  # our cgroup, else its ancestors
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
    Cgroup(spec, Limits()).remove()
    _remove_stale(spec)
    return None
  except OSError as e:
    return f'{spec["kind"]} at {spec["bases"][0]}: {e}'


def _remove_stale(spec):
  """Removes the empty per-run cgroups of callers that died before removing theirs."""
  for base in spec['bases']:
    for name in os.listdir(base):
      owner = name.removeprefix(CGROUP_PREFIX).split('_')[0]
      if not (name.startswith(CGROUP_PREFIX) and owner.isdigit()):
        continue
      if os.path.exists(f'/proc/{owner}'):
        continue  # its caller may still be running
      try:
        os.rmdir(os.path.join(base, name))
      except OSError:
        pass


class Cgroup:
  """A child cgroup for one run: made with its limits, killed and removed after."""

  def __init__(self, spec, limits):
    self.kind = spec['kind']
    name = f'{CGROUP_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}'
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
