"""The program's new root, as the caller plans it: which host paths it shows
(bound read-only at the same paths), which it hides under an empty tmpfs,
which packages its interpreter finds, and which links it holds. The
launcher builds it (`launcher.new_root`). See README.md beside this file.

The interpreter a program runs is the trainer's own binary and standard
library, never the trainer's packages: every directory Python installs
packages into that a bound tree would show (site-packages and dist-packages
of the venv, of the base interpreter, of the system's Pythons, and all of
/usr/local but the interpreter's own directories) is masked, and the
interpreter's site-packages shows the sandbox's environment instead: the
standard library alone, or the packages `JRL_SANDBOX_PACKAGES` names
(`reward.code.packages`), copied from the trainer's environment with their
dependencies into a read-only directory of their own (`package_env`).
"""

import glob
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import threading

# The host paths the new root shows (when they exist), besides the interpreter's.
SYSTEM = ('/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32')
ETC = ('/etc/ld.so.cache', '/etc/ld.so.conf', '/etc/ld.so.conf.d', '/etc/localtime')
# Hidden under an empty tmpfs where a bound tree holds them: where packages,
# data and tools get installed by hand (the interpreter's own directories
# inside them are bound again).
HIDDEN_TREES = ('/usr/local',)
# Where Python packages live on a host (glob patterns, below each lib root).
PACKAGE_DIRS = ('python3*/site-packages', 'python3*/dist-packages', 'python3/dist-packages')
PACKAGES_ENV = 'JRL_SANDBOX_PACKAGES'  # comma-separated distributions the programs may import


def inside(path, parent):
  """Whether `path` is `parent` or lies below it."""
  return path == parent or path.startswith(parent.rstrip('/') + '/')


def site_packages():
  """The directories the interpreter imports installed packages from."""
  paths = sysconfig.get_paths()
  return sorted({paths['purelib'], paths['platlib']})


def interpreter_paths():
  """Host paths the interpreter needs to start and import the standard
  library: [path, is_dir], no package directory among them."""
  exe = os.path.abspath(sys.executable)
  dirs = set()
  p = exe
  for _ in range(40):  # every link on the way to the real binary
    dirs.add(os.path.dirname(p))
    if not os.path.islink(p):
      break
    p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
  dirs.add(os.path.dirname(os.path.realpath(exe)))
  dirs.add(sysconfig.get_paths()['stdlib'])
  dirs.add(sysconfig.get_config_var('DESTSHARED'))  # lib-dynload
  if sysconfig.get_config_var('Py_ENABLE_SHARED'):
    dirs.add(sysconfig.get_config_var('LIBDIR'))
  files = set()
  if sys.prefix != sys.base_prefix:
    files.add(os.path.join(sys.prefix, 'pyvenv.cfg'))
  kept = [[p, True] for p in dirs if p and os.path.isdir(p)]
  kept += [[p, False] for p in files if os.path.isfile(p)]
  return kept


def package_dirs():
  """Every host directory Python packages are installed into, that we know of."""
  roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, '/usr', '/usr/local'}
  found = set(site_packages())
  for root in roots:
    for lib in ('lib', 'lib64'):
      for pattern in PACKAGE_DIRS:
        found.update(glob.glob(os.path.join(root, lib, pattern)))
  stdlib = sysconfig.get_paths()['stdlib']
  found.add(os.path.join(stdlib, 'site-packages'))
  found.add(os.path.join(stdlib, 'dist-packages'))
  return sorted(os.path.realpath(p) for p in found if os.path.isdir(p))


def _shows(path, binds, masks):
  """Whether the deepest bind or mask holding `path` is a bind."""
  best, shown = '', False
  for p, _ in binds:
    if inside(path, p) and len(p) > len(best):
      best, shown = p, True
  for m in masks:
    if inside(path, m) and len(m) > len(best):
      best, shown = m, False
  return shown


def root_spec(workdir):
  """What `launcher.new_root.enter_new_root` builds: binds, masks, overlays,
  links, dirs."""
  binds, links = [], []
  for p in SYSTEM + ETC:
    if os.path.islink(p):
      links.append([p, os.readlink(p)])
    elif os.path.exists(p):
      binds.append([p, os.path.isdir(p)])
  real = lambda path: (
    os.path.realpath(path) if any(inside(path, link) for link, _ in links) else path
  )
  inner = [[real(path), is_dir] for path, is_dir in interpreter_paths()]
  binds.sort(key=lambda b: (len(b[0]), b[0]))
  kept = []
  for path, is_dir in binds:  # drop what an outer bind or a link already shows
    if not any(inside(path, p) for p, _ in kept + links):
      kept.append([path, is_dir])
  masks = [t for t in HIDDEN_TREES if _shows(t, kept, []) and os.path.isdir(t)]
  for path, is_dir in sorted(inner, key=lambda b: (len(b[0]), b[0])):
    if not _shows(path, kept, masks):  # outside every bind, or hidden by a mask
      kept.append([path, is_dir])
  overlays = [[real(p), package_env()] for p in site_packages()]
  covered = [p for p, _ in overlays]
  for d in package_dirs():
    if _shows(real(d), kept, masks) and real(d) not in covered:
      masks.append(real(d))
  masks = sorted(set(masks))
  if any(inside(workdir, p) for p, _ in kept + links) or any(inside(workdir, m) for m in masks):
    raise RuntimeError(f'the workdir {workdir} lies inside a path bound into the sandbox')
  return {'binds': kept, 'masks': masks, 'overlays': overlays, 'links': links, 'dirs': [workdir]}


# -- the sandbox's own packages ------------------------------------------------

_ENVS = {}
_ENVS_LOCK = threading.Lock()


def packages():
  """The distributions programs may import (`JRL_SANDBOX_PACKAGES`), sorted."""
  raw = os.environ.get(PACKAGES_ENV, '')
  return tuple(sorted({p.strip() for p in raw.split(',') if p.strip()}))


def _name(requirement):
  return re.split(r'[\s;<>=!~\[(]', requirement.strip(), maxsplit=1)[0]


def _wanted(requirement):
  """Whether a Requires-Dist line applies without extras on this machine."""
  try:
    from packaging.requirements import Requirement
  except ImportError:  # no marker evaluation: every requirement without an extra
    return 'extra' not in requirement.partition(';')[2]
  try:
    req = Requirement(requirement)
  except ValueError:
    return False
  return req.marker is None or req.marker.evaluate({'extra': ''})


def closure(names):
  """The installed distributions `names` need, dependencies included:
  {normalised name: Distribution}. Raises ValueError naming a listed
  package that is not installed in the trainer's environment."""
  out, todo = {}, [(n, True) for n in names]
  while todo:
    name, listed = todo.pop()
    key = re.sub(r'[-_.]+', '-', name).lower()
    if key in out:
      continue
    try:
      dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
      if listed:
        raise ValueError(
          f"reward.code.packages: {name!r} is not installed in the trainer's environment "
          f"({sys.prefix}); install it there so that jrl can copy it into the sandbox's"
        ) from None
      continue  # an optional dependency that is absent here
    out[key] = dist
    todo += [(_name(r), False) for r in (dist.requires or ()) if _wanted(r)]
  return out


def _copy(src, dst):
  os.makedirs(os.path.dirname(dst), exist_ok=True)
  try:
    os.link(src, dst)
  except OSError:
    shutil.copy2(src, dst)


def package_env(names=None):
  """The host directory the sandbox's interpreter sees as its site-packages:
  the files of `names` (default `packages()`) and their dependencies, copied
  (hard-linked where possible) from the trainer's site-packages, nothing
  else. Made once per set of names and versions and reused; never written
  by a program (the sandbox binds it read-only)."""
  names = packages() if names is None else tuple(sorted(names))
  with _ENVS_LOCK:
    if names in _ENVS and os.path.isdir(_ENVS[names]):
      return _ENVS[names]
    dists = closure(names)
    key = json.dumps([sys.executable, sorted((k, d.version) for k, d in dists.items())])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f'jrl_sandbox_env_{os.getuid()}_{digest}')
    if not os.path.isdir(path):
      build = tempfile.mkdtemp(prefix='jrl_sandbox_env_build_')
      try:
        for dist in dists.values():
          base = os.path.realpath(dist.locate_file(''))
          for rel in dist.files or ():
            src = os.path.realpath(dist.locate_file(rel))
            if inside(src, base) and os.path.isfile(src) and '__pycache__' not in src:
              _copy(src, os.path.join(build, os.path.relpath(src, base)))
        os.chmod(build, 0o755)
        try:
          os.rename(build, path)
        except OSError:  # another process made it first
          shutil.rmtree(build, ignore_errors=True)
      except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    _ENVS[names] = path
    return path
