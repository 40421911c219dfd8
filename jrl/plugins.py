"""Your own code, named in config by import path.

Reward functions (`reward.functions`), environments (`agent.env`) and data
sources (`task.kind`) may be given as 'package.module:name' (or
'package.module.name') instead of a built-in name. The module must be
importable from the directory the run starts in or from PYTHONPATH.
"""

import functools
import importlib
import os
import sys


def is_import_path(name):
  """Whether `name` reads as an import path rather than a built-in name."""
  return '.' in name or ':' in name


def load_object(path, what):
  """The object at a dotted import path: 'package.module:name' or
  'package.module.name'. Raises ValueError naming `what`, the path and the cause.

  The directory the run starts in is appended to `sys.path` (if missing), so
  that a module next to where the run starts is found even when the script
  that runs is elsewhere (`python launch/train.py`, the `jrl` command).
  """
  module_name, sep, attr = path.partition(':')
  if not sep:
    module_name, _, attr = path.rpartition('.')
  if not module_name or not attr:
    raise ValueError(f'{what} {path!r} is not an import path like "package.module:name".')
  cwd = os.getcwd()
  if cwd not in sys.path:
    sys.path.append(cwd)
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f'{what} {path!r}: cannot import {module_name!r} ({e}).') from e
  try:
    return functools.reduce(getattr, attr.split('.'), module)
  except AttributeError as e:
    raise ValueError(f'{what} {path!r}: {module_name!r} has no {attr!r}.') from e
