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


# seccomp (<linux/seccomp.h>, <linux/filter.h>, <linux/audit.h>): the program
# may not create AF_VSOCK sockets (no network namespace confines them) or
# AF_NETLINK ones, nor set up io_uring (which creates sockets without the
# socket() call); other architectures' system call conventions get ENOSYS.
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, RET|K
_ENOSYS, _EAFNOSUPPORT = 38, 97
AF_NETLINK, AF_VSOCK = 16, 40
# machine -> (AUDIT_ARCH, socket, io_uring_setup); little-endian only (args[0] at offset 16)
SECCOMP_ARCH = {'x86_64': (0xC000003E, 41, 425), 'aarch64': (0xC00000B7, 198, 425)}


class _SockFilter(ctypes.Structure):
  _fields_ = [('code', ctypes.c_uint16), ('jt', ctypes.c_uint8), ('jf', ctypes.c_uint8),
              ('k', ctypes.c_uint32)]  # fmt: skip


class _SockFprog(ctypes.Structure):
  _fields_ = [('len', ctypes.c_uint16), ('filter', ctypes.POINTER(_SockFilter))]


def socket_filter():
  """The BPF program (a list of (code, jt, jf, k)) or None on an unknown architecture."""
  arch = SECCOMP_ARCH.get(os.uname().machine)
  if arch is None:
    return None
  audit_arch, nr_socket, nr_io_uring_setup = arch
  return [
    (_LD_ABS, 0, 0, 4),  # 0: the architecture
    (_JEQ, 1, 0, audit_arch),  # 1: ours -> 3
    (_RET, 0, 0, _RET_ERRNO | _ENOSYS),  # 2: another convention (e.g. int 0x80)
    (_LD_ABS, 0, 0, 0),  # 3: the system call number
    (_JGE, 0, 1, 0x40000000),  # 4: the x32 ABI -> 5
    (_RET, 0, 0, _RET_ERRNO | _ENOSYS),  # 5
    (_JEQ, 0, 1, nr_io_uring_setup),  # 6 -> 7
    (_RET, 0, 0, _RET_ERRNO | _ENOSYS),  # 7
    (_JEQ, 0, 3, nr_socket),  # 8: socket() -> 9, else -> 12
    (_LD_ABS, 0, 0, 16),  # 9: its domain (args[0], low half)
    (_JEQ, 2, 0, AF_VSOCK),  # 10 -> 13
    (_JEQ, 1, 0, AF_NETLINK),  # 11 -> 13
    (_RET, 0, 0, _RET_ALLOW),  # 12
    (_RET, 0, 0, _RET_ERRNO | _EAFNOSUPPORT),  # 13
  ]


def refuse_sockets(lib):
  """Installs `socket_filter` on this process and its children (after
  PR_SET_NO_NEW_PRIVS); False on an unknown architecture."""
  program = socket_filter()
  if program is None:
    return False
  filters = (_SockFilter * len(program))(*[_SockFilter(*ins) for ins in program])
  fprog = _SockFprog(len(program), filters)
  ret = lib.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0)
  check(ret, 'prctl(PR_SET_SECCOMP)')
  return True
