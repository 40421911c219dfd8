"""jrl's C++ decode attention for the CPU: built on first use, called through
XLA's FFI.

On the CPU the gather path (`jrl.sampler.attention.paged_attention_gather`)
copies every slot's pages into a [K, S, M, P, d] array per layer and reads
the copy back: on SmolLM2-135M with 32 slots that was a third of a decode
step. `csrc/paged_attention.cc` reads each slot's keys and values where they
lie in the pool instead, over XLA's intra-op threads, with the gather path's
float32 scores and softmax (`launch/bench_decode.py` measures both).

The source is compiled once per machine with the C++ compiler the machine
has (`CXX`, default `g++`), against the FFI headers of the installed jaxlib,
for the CPU it runs on, into `$JRL_KERNEL_CACHE` (default
`~/.cache/jrl/kernels`), keyed by the source, jaxlib's version and the CPU's
flags. Where no compiler works, `available()` is False with the reason in
`unavailable_reason()`, and 'auto' keeps the gather path.
`JRL_CPU_KERNEL=0` turns the kernel off.
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

TARGET = 'jrl_paged_attention'
SOURCE = os.path.join(os.path.dirname(__file__), 'csrc', 'paged_attention.cc')
# Vectorised exp (glibc's libmvec) needs fast math; the kernel never reads a
# position a slot cannot see, so no masked infinity or NaN reaches it.
FLAGS = ('-O3', '-march=native', '-ffast-math', '-shared', '-fPIC', '-std=c++17')

_failure = None


def _cpu_flags():
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      return next((line for line in f if line.startswith('flags')), '')
  except OSError:
    return ''


def _cache_dir():
  return os.environ.get('JRL_KERNEL_CACHE') or os.path.join(
    os.path.expanduser('~'), '.cache', 'jrl', 'kernels'
  )


def _build(compiler):
  """Path of the shared library, compiled here unless already cached."""
  with open(SOURCE, 'rb') as f:
    source = f.read()
  key = hashlib.sha256(
    b'\0'.join(
      [source, jaxlib.__version__.encode(), _cpu_flags().encode(), ' '.join(FLAGS).encode()]
    )
  ).hexdigest()[:16]
  directory = _cache_dir()
  path = os.path.join(directory, f'paged_attention-{key}.so')
  if os.path.exists(path):
    return path
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix='.so', dir=directory)
  os.close(fd)
  cmd = [compiler, *FLAGS, f'-I{jax.ffi.include_dir()}', SOURCE, '-o', tmp, '-lmvec', '-lm']
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
      raise RuntimeError(f'{" ".join(cmd)} failed:\n{done.stderr[-2000:]}')
    os.replace(tmp, path)  # atomic: processes building at once each write a whole file
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


@functools.cache
def _register():
  """Builds, loads and registers the kernel once per process; False on failure."""
  global _failure
  if os.environ.get('JRL_CPU_KERNEL', '1') == '0':
    _failure = 'JRL_CPU_KERNEL=0'
    return False
  compiler = os.environ.get('CXX', 'g++')
  if shutil.which(compiler) is None:
    _failure = f'no C++ compiler {compiler!r} on PATH (set CXX)'
    return False
  try:
    library = ctypes.cdll.LoadLibrary(_build(compiler))
    jax.ffi.register_ffi_target(
      TARGET, jax.ffi.pycapsule(library.JrlPagedAttention), platform='cpu'
    )
  except (OSError, RuntimeError, subprocess.SubprocessError) as e:
    _failure = str(e)
    return False
  return True


def available():
  """Whether the kernel is built and registered (building it on first call)."""
  return _register()


def unavailable_reason():
  """Why `available()` is False (None when it is True or was not asked)."""
  return _failure


def supports(q_dtype, kv_dtype):
  """The kernel takes float32 queries and pages (sliding-window layers take
  the gather path in `paged_attention` whatever the implementation)."""
  f32 = jnp.dtype(jnp.float32)
  return jnp.dtype(q_dtype) == f32 and jnp.dtype(kv_dtype) == f32


def paged_attention_cpu(
  q_SxHxd, k_pages, v_pages, page_table_SxM, lengths_S, *, scale=None, softcap=None
):
  """`paged_attention_gather`'s contract (no window) on the C++ kernel.

  Args:
    q_SxHxd: float32 query per slot.
    k_pages, v_pages: float32 [K, N, P, d].
    page_table_SxM: int32 page ids.
    lengths_S: int32 visible tokens per slot.
    scale, softcap: as `jrl.models.attention.attention_scores`.

  Returns:
    [S, H, d] float32.
  """
  if not available():
    raise RuntimeError(f"attention_impl='cpu' needs jrl's CPU kernel: {unavailable_reason()}")
  call = jax.ffi.ffi_call(
    TARGET, jax.ShapeDtypeStruct(q_SxHxd.shape, jnp.float32), vmap_method='sequential'
  )
  return call(
    q_SxHxd,
    k_pages,
    v_pages,
    page_table_SxM.astype(jnp.int32),
    lengths_S.astype(jnp.int32),
    scale=np.float32(0.0 if scale is None else scale),
    softcap=np.float32(0.0 if softcap is None else softcap),
    divide=scale is None,
  )
