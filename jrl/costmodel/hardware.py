"""Chips: vendor peak figures (`HARDWARE`) and a measurement of this machine."""

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One chip type, and the utilisation assumed for it.

  Peak, bandwidth and memory are per chip. `link_bw` is the per-chip
  bandwidth of collectives among chips of one node (ICI on TPU, NVLink on
  GPU); `node_bw` between nodes (TPU slices: ICI again; GPU: the NIC).
  """

  name: str
  peak_flops: float  # FLOP/s in the compute dtype (bfloat16 on accelerators)
  mem_bw: float  # bytes/s
  mem_bytes: float  # bytes
  link_bw: float  # bytes/s per chip within a node
  node_bw: float  # bytes/s per chip across nodes
  chips_per_node: int
  train_mfu: float = 0.4  # achieved / peak FLOP/s of training matmuls
  prefill_mfu: float = 0.5
  decode_mfu: float = 0.3
  bw_eff: float = 0.7  # achieved / peak memory bandwidth when decoding
  step_overhead_s: float = 2e-3  # host time per decode step (dispatch, sampling, read-back)
  collective_latency_s: float = 10e-6  # fixed cost of one all-reduce
  source: str = ''


# Vendor peak figures (dense bfloat16 FLOP/s, HBM bandwidth and size, interconnect).
HARDWARE = {
  'tpu-v5e': Hardware('TPU v5e', 197e12, 819e9, 16 * GiB, 200e9, 200e9, 256, source='spec'),
  'tpu-v5p': Hardware('TPU v5p', 459e12, 2765e9, 95 * GiB, 600e9, 600e9, 8960, source='spec'),
  'tpu-v6e': Hardware('TPU v6e', 918e12, 1640e9, 32 * GiB, 400e9, 400e9, 256, source='spec'),
  'h100': Hardware('NVIDIA H100 SXM', 989e12, 3350e9, 80e9, 450e9, 50e9, 8, source='spec'),
  'h200': Hardware('NVIDIA H200 SXM', 989e12, 4800e9, 141e9, 450e9, 50e9, 8, source='spec'),
}


def measure_this_machine(matmul_n=1024, copy_mib=256):
  """A Hardware for the default JAX device of this process, measured:
  float32 matmul peak, copy bandwidth, physical memory."""
  import time

  import jax
  import jax.numpy as jnp

  a = jnp.ones((matmul_n, matmul_n), jnp.float32)
  f = jax.jit(jnp.dot)
  jax.block_until_ready(f(a, a))
  best = min(_timed(lambda: jax.block_until_ready(f(a, a)), time) for _ in range(5))
  peak = 2 * matmul_n**3 / best
  x = jnp.ones(copy_mib * 2**20 // 4, jnp.float32)
  g = jax.jit(lambda v: v + 1.0)
  jax.block_until_ready(g(x))
  best = min(_timed(lambda: jax.block_until_ready(g(x)), time) for _ in range(5))
  bw = 2 * x.nbytes / best  # read + write
  try:
    import os

    mem = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    mem = 8 * GiB
  kind = jax.devices()[0].device_kind
  return Hardware(
    f'this machine ({kind})', peak, bw, mem, bw, bw, jax.device_count(), source='measured'
  )


def _timed(fn, time):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start
