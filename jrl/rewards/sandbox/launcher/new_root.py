"""The program's new root, built by the init in a fresh mount namespace from
the caller's spec (`jrl.rewards.sandbox.rootfs.root_spec`), and the writable
tmpfs workdir inside it."""

import os

from .linux import (
  MNT_DETACH,
  MS_BIND,
  MS_NODEV,
  MS_NOEXEC,
  MS_NOSUID,
  MS_PRIVATE,
  MS_REC,
  check,
  mount,
  pivot_root,
  read_only_tree,
)

# Device nodes bound into the new root's /dev (read-only mounts; writes to
# /dev/null still work, since a device's mount flags do not apply to it).
DEVICES = ('null', 'zero', 'full', 'random', 'urandom')
DEV_LINKS = (('fd', '/proc/self/fd'), ('stdin', '/proc/self/fd/0'),
             ('stdout', '/proc/self/fd/1'), ('stderr', '/proc/self/fd/2'))  # fmt: skip


def _make_target(path, is_dir):
  os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
  if is_dir:
    os.makedirs(path, mode=0o755, exist_ok=True)
  elif not os.path.exists(path):
    open(path, 'w').close()


def _check_spec(spec):
  """Refuses bad paths and anything inside a link (its mountpoint would be
  made through the link, in the host's directory bound where it points).
  Mounts inside binds are mounted on what exists there: `enter_new_root`
  never creates a mountpoint inside a host bind (the mounts are not
  read-only until the end), and refuses one that is missing."""
  paths = [p for p, _ in spec['binds']] + [p for p, _ in spec['links']]
  layered = list(spec.get('masks', ())) + [t for t, _ in spec.get('overlays', ())]
  for d in spec.get('dirs', ()):
    if any(d == p or d.startswith(p + '/') for p in paths + layered):
      raise ValueError(f'{d} lies inside a bind, link, mask or overlay of the root spec')
  for p in paths + layered:
    if not p.startswith('/') or os.path.normpath(p) != p or p == '/':
      raise ValueError(f'bad path in the root spec: {p!r}')
  for p in paths + layered:
    for q, _ in spec['links']:
      if p != q and p.startswith(q.rstrip('/') + '/'):
        raise ValueError(f'{p} lies inside the link {q} in the root spec')


def _layers(spec):
  """Every mount of the spec, outer first: (path, kind, is_dir, source),
  kind 'bind' (host `source` at `path`), 'mask' (an empty tmpfs)."""
  ops = [(p, 'bind', d, p) for p, d in spec['binds']]
  ops += [(p, 'mask', True, None) for p in spec.get('masks', ())]
  ops += [(t, 'bind', True, src) for t, src in spec.get('overlays', ())]
  return sorted(ops, key=lambda op: op[0].count('/'))


def _enclosing(path, done):
  """The kind of the deepest mount already made that holds `path` ('root': none)."""
  best, kind = '', 'root'
  for p, k in done:
    if path.startswith(p.rstrip('/') + '/') and len(p) > len(best):
      best, kind = p, k
  return kind


def enter_new_root(lib, mountpoint, spec, proc_options):
  """Builds a root of its own on a tmpfs at `mountpoint` and pivots into it.

  In a fresh mount namespace (the caller unshared it): the new root holds
  only `spec['binds']` ([host path, is_dir], bound at the same path,
  recursively), `spec['masks']` (paths hidden under an empty tmpfs, e.g. a
  package directory inside a bound tree), `spec['overlays']` ([path, host
  source directory] bound over `path`, e.g. the sandbox's own packages over
  the interpreter's site-packages), `spec['links']` ([path, target]
  symlinks), `spec['dirs']` (empty directories, mountpoints for later), a
  /dev of `DEVICES`, a fresh /proc (`proc_options`: mount options, or None
  for an empty /proc) and an empty /sys; the old root is detached and
  everything is made read-only. Mounts go outer first; a mountpoint inside
  a host bind must exist there (never created in the host's directory).
  The caller mounts the writable places afterwards.
  """
  _check_spec(spec)
  mount(lib, None, '/', None, MS_REC | MS_PRIVATE)
  mount(lib, 'tmpfs', mountpoint, 'tmpfs', MS_NOSUID | MS_NODEV, 'size=1m,nr_inodes=4096,mode=0755')
  os.chmod(mountpoint, 0o755)
  at = lambda p: mountpoint + p
  for path, target in spec['links']:
    os.makedirs(os.path.dirname(at(path)), mode=0o755, exist_ok=True)
    os.symlink(target, at(path))
  done = []
  for path, kind, is_dir, source in _layers(spec):
    if _enclosing(path, done) == 'bind':
      if not (os.path.isdir(at(path)) if is_dir else os.path.isfile(at(path))):
        raise ValueError(f'{path}: no such {"directory" if is_dir else "file"} to mount over')
    else:
      _make_target(at(path), is_dir)
    if kind == 'mask':
      mount(
        lib, 'tmpfs', at(path), 'tmpfs', MS_NOSUID | MS_NODEV, 'size=64k,nr_inodes=256,mode=0755'
      )
    else:
      mount(lib, source, at(path), None, MS_BIND | MS_REC)
    done.append((path, kind))
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
  workdir (`mount_workdir`) holding the files the caller left in the host's
  workdir."""
  workdir = config['workdir']
  files = {}  # main.py and the files the caller put beside it
  for name in sorted(os.listdir(workdir)):
    path = os.path.join(workdir, name)
    if os.path.isfile(path) and not os.path.islink(path):
      with open(path, 'rb') as f:
        files[name] = f.read()
  enter_new_root(lib, workdir, config['root'], config['proc_options'])
  mount_workdir(lib, config, files)


def mount_workdir(lib, config, files):
  """On the new root: a writable tmpfs workdir at `config['workdir']` (a disk
  quota of `disk_bytes`) holding `files` ({plain name: bytes}) and an empty
  tmp/, and a tiny private /dev/shm."""
  workdir = config['workdir']
  uid = config['uid'] if config['uid'] is not None else os.getuid()
  size, inodes = config['disk_bytes'], max(64, config['disk_bytes'] // 4096)
  opts = f'size={size},nr_inodes={inodes},mode=0700'
  if config['uid'] is not None:
    opts += f',uid={uid},gid={uid}'
  mount(lib, 'tmpfs', workdir, 'tmpfs', MS_NOSUID | MS_NODEV, opts)
  mount(lib, 'tmpfs', '/dev/shm', 'tmpfs', MS_NOSUID | MS_NODEV, 'size=1m,nr_inodes=64,mode=1777')
  paths = []
  for name, data in files.items():
    if os.path.basename(name) != name or name in ('', '.', '..', 'tmp'):
      raise ValueError(f'a sandbox file is named by a plain file name, not {name!r}')
    paths.append(os.path.join(workdir, name))
    with open(paths[-1], 'wb') as f:
      f.write(data)
  os.mkdir(os.path.join(workdir, 'tmp'))
  if config['uid'] is not None:
    for p in (*paths, os.path.join(workdir, 'tmp')):
      os.chown(p, uid, uid)
