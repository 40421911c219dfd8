"""Multi-host start-up and the few collectives the controller needs.

jrl runs on JAX's multi-controller runtime: every host runs the same
program, `jax.devices()` lists the devices of all hosts, and the mesh spans
them. `initialize` joins the processes before anything touches a device:

* explicitly, from arguments or the environment (`JRL_COORDINATOR_ADDRESS`,
  `JRL_NUM_PROCESSES`, `JRL_PROCESS_ID`); this is what `launch/local.py`
  sets for N processes on one machine;
* automatically on Cloud TPU VM slices and under SLURM, where
  `jax.distributed.initialize()` finds the coordinator itself;
* not at all for a single process.

On CPU the processes exchange data through gloo collectives.

The controller keeps host-side decisions identical on every process (the
same sampler schedule, the same kept groups), so everything a host reads
back is either replicated or gathered with `gather_rows`.
"""

import os

import jax
import numpy as np

ENV_ADDRESS = 'JRL_COORDINATOR_ADDRESS'
ENV_NUM_PROCESSES = 'JRL_NUM_PROCESSES'
ENV_PROCESS_ID = 'JRL_PROCESS_ID'

_initialized = False


def _auto_cluster():
  """True on a multi-host Cloud TPU VM slice or a multi-task SLURM job."""
  hosts = os.environ.get('TPU_WORKER_HOSTNAMES', '')
  if len([h for h in hosts.split(',') if h]) > 1:
    return True
  return int(os.environ.get('SLURM_NTASKS', '1') or 1) > 1


def initialize(coordinator_address='', num_processes=0, process_id=-1, *, platform=None):
  """Joins this process to the others; a no-op for a single process.

  Arguments override the `JRL_*` environment variables. Must run before
  the first use of a device.

  Args:
    coordinator_address: 'host:port' of process 0.
    num_processes: the number of processes (0: from the environment).
    process_id: this process's index (-1: from the environment).
    platform: 'cpu' to use gloo collectives (default: from JAX_PLATFORMS).

  Returns:
    (process_index, process_count).
  """
  global _initialized
  if _initialized:
    return jax.process_index(), jax.process_count()
  address = coordinator_address or os.environ.get(ENV_ADDRESS, '')
  count = int(num_processes or os.environ.get(ENV_NUM_PROCESSES, 0) or 0)
  pid = int(process_id if process_id >= 0 else os.environ.get(ENV_PROCESS_ID, -1))
  platform = platform or os.environ.get('JAX_PLATFORMS', '')
  if address or count > 1:
    if not address:
      raise ValueError(f'`coordinator_address` (or ${ENV_ADDRESS}) is needed for {count} ranks.')
    if count < 1:
      raise ValueError(f'`num_processes` (or ${ENV_NUM_PROCESSES}) must be >= 1, got {count}.')
    if not 0 <= pid < count:
      raise ValueError(f'`process_id` (or ${ENV_PROCESS_ID}) must be in [0, {count}), got {pid}.')
    if count == 1:
      _initialized = True
      return 0, 1
    if platform.startswith('cpu'):
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(address, num_processes=count, process_id=pid)
  elif _auto_cluster():
    jax.distributed.initialize()
  _initialized = True
  return jax.process_index(), jax.process_count()


def is_main():
  """Process 0 writes logs, plots and exports."""
  return jax.process_index() == 0


def gather_rows(local):
  """Concatenates every process's host array along axis 0, in process order.

  Args:
    local: a NumPy array [n_local, ...]; the same shape on every process.

  Returns:
    [n_local · process_count, ...]; `local` itself for one process.
  """
  local = np.asarray(local)
  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def fetch(x):
  """The host value of a (possibly multi-host) jax.Array pytree."""

  def one(a):
    if isinstance(a, jax.Array) and not a.is_fully_addressable and not a.is_fully_replicated:
      from jax.experimental import multihost_utils

      return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(jax.device_get(a))

  return jax.tree.map(one, x)


def settle(tree):
  """Waits for `tree`'s values on several processes of the CPU backend;
  returns `tree`.

  There gloo pairs the collectives of the programs in flight at one time in
  the order each process's device threads reach them, which may differ
  between processes: two independent programs with collectives (an update
  step and the next minibatch's gather) then wait for each other forever.
  Waiting after each such program keeps one in flight. On one process, and
  on accelerators (whose collectives follow each device's stream), it
  returns at once."""
  if jax.process_count() > 1 and jax.default_backend() == 'cpu':
    jax.block_until_ready(tree)
  return tree


def any_process(flag):
  """True on every process when `flag` is true on any of them."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(gather_rows(np.asarray([int(bool(flag))], np.int32)).max())


def local_rows(sharding, num_rows):
  """The [lo, hi) range of batch rows that this process's devices hold.

  Args:
    sharding: the batch sharding (first dimension split over processes).
    num_rows: the global batch size.

  Raises:
    ValueError when this process's rows are not one contiguous range.
  """
  rows = set()
  for index in sharding.addressable_devices_indices_map((num_rows,)).values():
    sl = index[0]
    rows.update(range(*sl.indices(num_rows)))
  lo, hi = min(rows), max(rows) + 1
  if len(rows) != hi - lo:
    raise ValueError(
      f'process {jax.process_index()} holds batch rows that are not contiguous; put the '
      'processes on the outermost mesh axis (data or fsdp).'
    )
  return lo, hi


def put_rows(local, sharding, num_rows):
  """A global [num_rows, ...] array from this process's rows (see `local_rows`)."""
  local = np.asarray(local)
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  return jax.make_array_from_process_local_data(sharding, local, (num_rows, *local.shape[1:]))
