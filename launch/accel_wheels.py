"""The wheels `launch/accel_check.py` needs beyond an accelerator image that
has JAX, flax, optax, orbax-checkpoint, numpy and transformers (and their
requirements), for Python 3.12 on manylinux x86-64.

    python launch/accel_wheels.py fetch [--dest .accel/wheels]    # here, from the registry
    python launch/accel_wheels.py install --target /tmp/jrl-site  # there, offline

`fetch` downloads exactly the pinned `CARRY` wheels (no dependencies
resolved: the list is the closure already) into an ignored folder and
prints their size; `--check` then installs them into a scratch folder the
way `install` does, as Python 3.12 on manylinux x86-64. `install` puts
every wheel whose distribution the interpreter lacks into `--target` with
`pip install --no-index --no-deps --target` (by unpacking the wheel where
pip is missing), so nothing of the image is shadowed. Then:

    PYTHONPATH=/tmp/jrl-site:. python launch/accel_check.py --out $OUT/accel_check.json

How the list was found: the distributions of every module imported by a
tiny-mode run of the check, less the image's packages and their
requirements.
"""

import argparse
import glob
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import zipfile

# distribution: version (those the test suite runs against)
CARRY = {
  'grain': '0.2.18',
  'array-record': '0.8.6',  # grain's record files
  'cloudpickle': '3.1.2',  # grain
  'portpicker': '1.6.0',  # grain
  'ml-collections': '1.1.0',  # configs/
  'jinja2': '3.1.6',  # chat templates
  'markupsafe': '3.0.3',  # jinja2
  'waitress': '3.0.2',  # the reward server (imported with jrl.rewards)
}
PYTHON = '3.12'
PLATFORMS = ('manylinux_2_17_x86_64', 'manylinux2014_x86_64', 'manylinux_2_28_x86_64')
DEFAULT_DEST = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '.accel', 'wheels'
)


def _platform_args():
  args = ['--only-binary=:all:', '--python-version', PYTHON, '--implementation', 'cp']
  for p in PLATFORMS:
    args += ['--platform', p]
  return args


def fetch(dest):
  """Downloads the CARRY wheels into `dest`; returns their paths."""
  os.makedirs(dest, exist_ok=True)
  specs = [f'{name}=={version}' for name, version in CARRY.items()]
  subprocess.run(
    [sys.executable, '-m', 'pip', 'download', '--no-deps', '-d', dest, *_platform_args(), *specs],
    check=True,
  )
  return wheels(dest)


def wheels(folder):
  """The CARRY wheels in `folder`, one per distribution; a missing one is an error."""
  found = {}
  for path in sorted(glob.glob(os.path.join(folder, '*.whl'))):
    found[_normal(os.path.basename(path).split('-')[0])] = path
  missing = [name for name in CARRY if _normal(name) not in found]
  if missing:
    raise SystemExit(f'{folder}: no wheel for {missing}; run `accel_wheels.py fetch` first.')
  return [found[_normal(name)] for name in CARRY]


def _normal(name):
  return re.sub(r'[-_.]+', '_', name).lower()


def _installed(name):
  try:
    importlib.metadata.version(name)
    return True
  except importlib.metadata.PackageNotFoundError:
    return False


def install(folder, target, emulate=False):
  """Installs each wheel of `folder` whose distribution is missing here into
  `target` (all of them with `emulate`: as Python 3.12 on manylinux, for the
  check on another interpreter). Returns the names installed."""
  os.makedirs(target, exist_ok=True)
  chosen = [
    (n, w) for n, w in zip(CARRY, wheels(folder), strict=True) if emulate or not _installed(n)
  ]
  has_pip = (
    subprocess.run([sys.executable, '-m', 'pip', '--version'], capture_output=True).returncode == 0
  )
  for _, wheel in chosen:
    if has_pip:
      extra = _platform_args() if emulate else []
      cmd = [
        sys.executable,
        '-m',
        'pip',
        'install',
        '--no-index',
        '--no-deps',
        '--upgrade',
        '--target',
        target,
      ]
      subprocess.run([*cmd, *extra, '--quiet', wheel], check=True)
    else:  # a wheel is a zip of its files laid out for site-packages
      with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
  return [n for n, _ in chosen]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  sub = p.add_subparsers(dest='command', required=True)
  f = sub.add_parser('fetch', help='download the wheels (network: the package registry)')
  f.add_argument('--dest', default=DEFAULT_DEST)
  f.add_argument('--check', action='store_true', help='then install them into a scratch folder')
  i = sub.add_parser('install', help='install the missing ones offline')
  i.add_argument('--wheels', default=DEFAULT_DEST)
  i.add_argument('--target', required=True)
  args = p.parse_args(argv)
  if args.command == 'fetch':
    paths = fetch(args.dest)
    size = sum(os.path.getsize(x) for x in paths)
    print(f'{len(paths)} wheels, {size / 2**20:.1f} MiB in {args.dest}')
    if args.check:
      with tempfile.TemporaryDirectory() as scratch:
        names = install(args.dest, scratch, emulate=True)
        print(f'installed {len(names)} into a scratch folder as Python {PYTHON}: {names}')
  else:
    names = install(args.wheels, args.target)
    print(f'installed into {args.target}: {names or "nothing (all present)"}')


if __name__ == '__main__':
  main()
