"""Test set-up: 8 fake CPU devices, set once before JAX is imported.

Multi-device behaviour (shard_map / pmap with `axis_name`, jit with
NamedSharding) is tested on these fake devices, so the suite needs no
accelerator.
"""

import gc
import os

import pytest

# The fake devices, and cheaper code generation: the suite's programs are
# tiny, so their time is mostly compiling. Without LLVM's expensive passes the
# suite ran about a fifth faster; without XLA:CPU's new fusion emitters
# (`xla_cpu_use_fusion_emitters`) the same programs compile in about a third
# less time (three tests of the layouts: 30.8 s -> 17.4 s; two of sharded
# sampling and a PPO run: 68.4 s -> 56.6 s; a 2-core AMD EPYC, Zen 3, jaxlib
# 0.10.2). Tests compare numbers, never speed. Subprocesses the tests start
# inherit these flags.
_FLAGS = (
  '--xla_force_host_platform_device_count=8',
  '--xla_backend_optimization_level=0',
  '--xla_llvm_disable_expensive_passes=true',
  '--xla_cpu_use_fusion_emitters=false',
)
for _flag in _FLAGS:
  if _flag.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _flag).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402

assert jax.device_count() == 8, f'expected 8 fake CPU devices, got {jax.devices()}'


# One persistent compilation cache for the whole run, shared by the xdist
# workers: many tests compile the same programs (the smoke configs' models,
# samplers and updates), and a hit loads the executable instead of compiling
# it again. `JRL_TEST_XLA_CACHE=0` turns it off. Runs started as subprocesses
# (launch/train.py) keep their own cache in their workdir.
_MADE_CACHE = 'JRL_TEST_XLA_CACHE_DIR' not in os.environ  # the controller (workers inherit it)
if _MADE_CACHE:
  import tempfile

  os.environ['JRL_TEST_XLA_CACHE_DIR'] = tempfile.mkdtemp(prefix='jrl-test-xla-cache-')
if os.environ.get('JRL_TEST_XLA_CACHE', '1') != '0':
  jax.config.update('jax_compilation_cache_dir', os.environ['JRL_TEST_XLA_CACHE_DIR'])
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.2)


def pytest_sessionfinish(session):
  if _MADE_CACHE and not hasattr(session.config, 'workerinput'):  # after every worker
    import shutil

    shutil.rmtree(os.environ['JRL_TEST_XLA_CACHE_DIR'], ignore_errors=True)


# Each XLA:CPU executable holds three memory mappings per compiled kernel
# (code, read-only data, data) for as long as a cache keeps it. One process
# running tests/models, tests/sampler and tests/trainers/test_algorithms.py
# (about 600 tests) reached 58,000 mappings, about 14,800 kernels, near
# Linux's `vm.max_map_count` (65,530 by default); past it an mmap fails inside
# LLVM's JIT and the process dies with a segmentation fault in whichever
# compile comes next. After any test that leaves more than this many mappings, every
# compiled program is dropped (the persistent cache above reloads the slow
# ones): 30% of the limit. Measured on fresh clones on a 2-core AMD EPYC
# (2026-12-06), the suite took 28:17 at 20,000, and 30:02 and 30:41 at 60% of
# the limit (39,318): keeping more programs alive did not save their compiles.


def max_map_count():
  """Linux's per-process limit on memory mappings (65,530 by default)."""
  try:
    with open('/proc/sys/vm/max_map_count', encoding='ascii') as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65_530


MAX_MAPPINGS = int(0.3 * max_map_count())


def mappings():
  """How many memory mappings this process has."""
  with open('/proc/self/maps', 'rb') as f:
    return f.read().count(b'\n')


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  yield
  if os.path.exists('/proc/self/maps') and mappings() > MAX_MAPPINGS:
    jax.clear_caches()
    gc.collect()
