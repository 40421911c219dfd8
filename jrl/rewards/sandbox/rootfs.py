"""The program's new root, as the caller plans it: which host paths it shows
(bound read-only at the same paths) and which links it holds. The launcher
builds it (`launcher.new_root`). See README.md beside this file."""

import os
import sys
import sysconfig

# The host paths the new root shows (when they exist), besides the interpreter's.
SYSTEM = ('/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32')
ETC = ('/etc/ld.so.cache', '/etc/ld.so.conf', '/etc/ld.so.conf.d', '/etc/localtime')


def inside(path, parent):
  """Whether `path` is `parent` or lies below it."""
  return path == parent or path.startswith(parent.rstrip('/') + '/')


def interpreter_paths():
  """Host paths the interpreter needs to start and import its libraries:
  [path, is_dir], none inside another."""
  exe = os.path.abspath(sys.executable)
  dirs = set()
  p = exe
  for _ in range(40):  # every link on the way to the real binary
    dirs.add(os.path.dirname(p))
    if not os.path.islink(p):
      break
    p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
  dirs.add(os.path.dirname(os.path.realpath(exe)))
  paths = sysconfig.get_paths()
  dirs.update(paths[k] for k in ('stdlib', 'platstdlib', 'purelib', 'platlib'))
  if sysconfig.get_config_var('Py_ENABLE_SHARED'):
    dirs.add(sysconfig.get_config_var('LIBDIR'))
  files = set()
  if sys.prefix != sys.base_prefix:
    files.add(os.path.join(sys.prefix, 'pyvenv.cfg'))
  kept = [[p, True] for p in dirs if p and os.path.isdir(p)]
  kept += [[p, False] for p in files if os.path.isfile(p)]
  return kept


def root_spec(workdir):
  """What `launcher.new_root.enter_new_root` builds: binds, links, dirs."""
  binds, links = [], []
  for p in SYSTEM + ETC:
    if os.path.islink(p):
      links.append([p, os.readlink(p)])
    elif os.path.exists(p):
      binds.append([p, os.path.isdir(p)])
  for path, is_dir in interpreter_paths():
    if any(inside(path, link) for link, _ in links):
      path = os.path.realpath(path)  # e.g. /lib/python3 where /lib -> usr/lib
    binds.append([path, is_dir])
  binds.sort(key=lambda b: (len(b[0]), b[0]))
  kept = []
  for path, is_dir in binds:  # drop what an outer bind or a link already shows
    if not any(inside(path, p) for p, _ in kept + links):
      kept.append([path, is_dir])
  if any(inside(workdir, p) for p, _ in kept + links):
    raise RuntimeError(f'the workdir {workdir} lies inside a path bound into the sandbox')
  return {'binds': kept, 'links': links, 'dirs': [workdir]}
