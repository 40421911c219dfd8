"""The machine a benchmark ran on, for its record: CPU model, cores, the flags
that decide the speed of the matmuls (AVX-512, bfloat16, AMX), memory, and
the versions of the array libraries installed.

Standard library only, so that a peer's benchmark (launch/bench_trl.py, in a
virtual environment of its own) records the same facts.

    python launch/machine.py          # prints the record as JSON
"""

import importlib.metadata
import json
import os
import platform

# CPU flags that change what a float32 or bfloat16 matmul costs.
FLAGS = ('avx2', 'fma', 'avx512f', 'avx512_bf16', 'avx512_vnni', 'amx_bf16', 'amx_int8', 'amx_tile')
PACKAGES = ('jax', 'jaxlib', 'torch', 'transformers', 'trl', 'vllm')


def cpu_facts(cpuinfo_text):
  """(model name, vendor, sorted flags of FLAGS present) from /proc/cpuinfo text."""
  model = vendor = ''
  flags = set()
  for line in cpuinfo_text.splitlines():
    key, _, value = line.partition(':')
    key, value = key.strip(), value.strip()
    if key == 'model name' and not model:
      model = value
    elif key == 'vendor_id' and not vendor:
      vendor = value
    elif key == 'flags' and not flags:
      flags = set(value.split())
  return model, vendor, [f for f in FLAGS if f in flags]


def _read(path):
  try:
    with open(path, encoding='utf-8') as f:
      return f.read()
  except OSError:
    return ''


def _memory_bytes():
  for line in _read('/proc/meminfo').splitlines():
    if line.startswith('MemTotal:'):
      return int(line.split()[1]) * 1024
  return None


def record():
  """The machine's facts as a JSON-ready dict (see the module)."""
  model, vendor, flags = cpu_facts(_read('/proc/cpuinfo'))
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return {
    'cpu_model': model or platform.processor() or platform.machine(),
    'cpu_vendor': vendor,
    'cores': len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(),
    'cpu_flags': flags,
    'memory_bytes': _memory_bytes(),
    'python': platform.python_version(),
    'packages': versions,
  }


def describe(facts=None):
  """One line for a benchmark's header: model, cores, flags, versions."""
  f = facts or record()
  versions = ' '.join(f'{k} {v}' for k, v in f['packages'].items())
  flags = ','.join(f['cpu_flags']) or 'none of ' + ','.join(FLAGS)
  return f'machine: {f["cpu_model"]}, {f["cores"]} cores, flags {flags}; {versions}'


if __name__ == '__main__':
  print(json.dumps(record(), indent=2))
