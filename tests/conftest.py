"""Test set-up: 8 fake CPU devices, set once before JAX is imported.

Multi-device behaviour (shard_map / pmap with `axis_name`, jit with
NamedSharding) is tested on these fake devices, so the suite needs no
accelerator.
"""

import os

# The fake devices, and a cheaper LLVM back end: the suite's programs are
# tiny, so their time is mostly compiling; without LLVM's expensive passes the
# suite runs about a fifth faster (tests compare numbers, never speed).
# Subprocesses the tests start inherit these flags.
_FLAGS = (
  '--xla_force_host_platform_device_count=8',
  '--xla_backend_optimization_level=0',
  '--xla_llvm_disable_expensive_passes=true',
)
for _flag in _FLAGS:
  if _flag.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _flag).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402

assert jax.device_count() == 8, f'expected 8 fake CPU devices, got {jax.devices()}'
