"""Test set-up: 8 fake CPU devices, set once before JAX is imported.

Multi-device behaviour (shard_map / pmap with `axis_name`, jit with
NamedSharding) is tested on these fake devices, so the suite needs no
accelerator.
"""

import os

_FLAG = '--xla_force_host_platform_device_count=8'
if _FLAG not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402

assert jax.device_count() == 8, f'expected 8 fake CPU devices, got {jax.devices()}'
