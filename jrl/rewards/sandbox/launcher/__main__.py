"""Runs the launcher: `python -I -S .../launcher/__main__.py --probe | --sweep
UID | --config-fd FD` (see `jrl.rewards.sandbox.runner`).

With -I this directory is not on sys.path, and `jrl` is not imported (its
packages import numpy and JAX, and the launcher must start fast and on the
standard library alone), so the package is loaded from this directory under
a name of its own.
"""

import importlib.util
import os
import sys

_NAME = '_jrl_sandbox_launcher'


def _load():
  here = os.path.dirname(os.path.abspath(__file__))
  spec = importlib.util.spec_from_file_location(
    _NAME, os.path.join(here, '__init__.py'), submodule_search_locations=[here]
  )
  package = importlib.util.module_from_spec(spec)
  sys.modules[_NAME] = package
  spec.loader.exec_module(package)
  return package


if __name__ == '__main__':
  sys.exit(_load().main(sys.argv[1:]))
