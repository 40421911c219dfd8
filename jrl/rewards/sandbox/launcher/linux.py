"""Linux syscalls and constants the launcher needs, through ctypes (the
standard library has no mount, unshare, pivot_root or prctl)."""

import ctypes
import json
import os

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
