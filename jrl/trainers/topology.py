"""Where and when rollouts are generated: a topology is a small strategy
object between the trainer's parameters and a rollout worker.

    topology.next_rollout(params, iteration) -> Rollout   # host arrays
    topology.rollout_params(params)                       # what the sampler reads
    topology.checkpoint(streams) -> (streams' states, behaviour params or None)
    topology.restore(checkpointer, step, meta, params)
    topology.close()

- `Colocated` (the default): the sampler reads the trainer's own arrays (no
  copy, no weight sync) and generates now.
- `Disaggregated`: the last `topology.rollout_devices` devices sample on a
  mesh of their own; one device-to-device reshard per policy version.
- `OneStepOff`: the rollout for iteration i + 1 is generated in a background
  thread (by the parameters before update i) while update i runs; with
  `rollout_devices` it is disaggregated as well. A checkpoint keeps the
  parameters the rollout in flight reads and the streams' positions from
  before it drew, so that a resumed run regenerates it exactly.

An n-step-off or a remote rollout is one more class with these methods.
"""

import concurrent.futures
import contextlib
import time

import jax
import jax.numpy as jnp

from jrl import checkpoint as ckpt_lib
from jrl import models, parallel
from jrl.trainers import checks

KINDS = ('colocated', 'disaggregated', 'one_step_off')


# The gathered decode copy may take at most this share of a device's memory
# (`sampler.decode_weights='auto'`); the KV pool and the training state need the rest.
DECODE_WEIGHTS_MEMORY_SHARE = 0.25


def _rollout_shardings(mesh, rollout_mesh, model_config, params):
  """Parameter shardings on the rollout mesh (None when it is the training mesh)."""
  if rollout_mesh is mesh:
    return None
  return parallel.param_shardings(
    rollout_mesh,
    params,
    models.param_logical_axes,
    units=models.head_units(model_config),
  )


def decode_shardings(mode, mesh, model_config, params, memory_limit=None):
  """The layout a colocated sampler reads the policy in, or None for the
  trainer's own (`sampler.decode_weights`).

  With fsdp > 1 the trainer's weights are split over the batch shards, and
  every decode step of a sampler reading them runs collectives across the
  fsdp axis for every matmul. 'gathered' copies them once per policy version
  into `parallel.decode_shardings` (whole on each batch shard, still split
  over tensor and expert); 'auto' does so when that copy takes at most
  `DECODE_WEIGHTS_MEMORY_SHARE` of a device's memory (`memory_limit` bytes;
  None: the device's `bytes_limit`, unknown on the CPU, where it fits);
  'sharded' keeps the trainer's layout.
  """
  if mode == 'sharded' or mesh.shape['fsdp'] == 1:
    return None  # without fsdp the trainer's layout is the decode layout
  shardings = parallel.decode_shardings(
    mesh, params, models.param_logical_axes, units=models.head_units(model_config)
  )
  if mode == 'gathered':
    return shardings
  if memory_limit is None:
    stats = mesh.devices.flat[0].memory_stats() or {}
    memory_limit = stats.get('bytes_limit')
  if memory_limit is None:
    return shardings
  fits = parallel.bytes_per_device(params, shardings) <= DECODE_WEIGHTS_MEMORY_SHARE * memory_limit
  return shardings if fits else None


class Colocated:
  """Samples now, on the training devices, with the trainer's parameters:
  its very arrays, or with `decode` shardings (`decode_shardings`) a copy in
  the decode layout made once per policy version."""

  staleness = 0

  def __init__(self, worker, tracer, decode=None):
    self.worker = worker
    self.tracer = tracer
    self.decode = decode

  @contextlib.contextmanager
  def update_window(self):
    """Around the update: the engine shares the training devices, so it
    releases its KV pool for the update's memory, and resumes after."""
    engine = self.worker.engine
    engine.release()
    try:
      yield
    finally:
      engine.resume()

  def rollout_params(self, params):
    if self.decode is None:
      return params
    with self.tracer.span('reshard'):
      return jax.block_until_ready(jax.device_put(params, self.decode))

  def next_rollout(self, params, iteration):
    t_wait = time.perf_counter()
    start = time.perf_counter()
    params = self.rollout_params(params)
    t_reshard = time.perf_counter() - start
    generated = self.worker.sample(params, iteration)
    generated.metrics['time/reshard'] = t_reshard
    generated.metrics['time/rollout_wait'] = time.perf_counter() - t_wait
    generated.metrics['rollout/staleness'] = 0.0
    return generated

  def checkpoint(self, streams):
    """(the streams' states to save, behaviour parameters to save or None)."""
    return {name: s.state() for name, s in streams.items()}, None

  def restore(self, checkpointer, step, meta, params):
    del checkpointer, step, meta, params

  def close(self):
    pass


class Disaggregated(Colocated):
  """Samples on devices of its own: one reshard per policy version."""

  def __init__(self, worker, tracer, shardings):
    super().__init__(worker, tracer, decode=shardings)

  def update_window(self):
    """The engine's devices are not the update's: it keeps its memory."""
    return contextlib.nullcontext()


class OneStepOff:
  """Generates the next iteration's rollout while the current update runs
  (`topology.staleness` 1; with 0 it samples in the background thread but
  waits for it, which is the synchronous run)."""

  def __init__(self, worker, tracer, shardings, streams, total, staleness=1):
    self.staleness = staleness
    self.worker = worker
    self.tracer = tracer
    # The rollout mesh's, or the decode layout on the training devices; None:
    # the trainer's layout on its devices.
    self.shardings = shardings
    self.streams = streams
    self.total = total
    self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='rollout')
    self.pending = None  # the Future of the rollout in flight
    self.pending_params = None  # the parameters it reads
    self.pending_streams = None  # the streams' states from before it drew

  def update_window(self):
    """The next rollout generates while the update runs: the engine keeps its memory."""
    return contextlib.nullcontext()

  def rollout_params(self, params):
    """A copy (the update donates the trainer's buffers while generation
    runs), or a reshard onto the rollout devices."""
    if self.shardings is not None:
      with self.tracer.span('reshard'):
        return jax.block_until_ready(jax.device_put(params, self.shardings))
    if self.staleness:
      return jax.tree.map(jnp.copy, params)
    return params

  def next_rollout(self, params, iteration):
    """The rollout started during the previous iteration (generated by the
    parameters before that update); starts the next one in the background."""
    it = iteration
    t_wait = time.perf_counter()
    t_reshard = 0.0
    if self.pending is None:
      if self.pending_params is not None:  # resumed with a rollout in flight: regenerate it
        behaviour, version = self.pending_params, it - 1
      else:
        start = time.perf_counter()
        behaviour, version = self.rollout_params(params), it
        t_reshard = time.perf_counter() - start
      self.pending = self.executor.submit(self.worker.sample, behaviour, it, version)
    generated = self.pending.result()
    t_wait = time.perf_counter() - t_wait
    self.pending = self.pending_params = self.pending_streams = None
    if self.staleness and it + 1 < self.total:
      self.pending_streams = {name: s.state() for name, s in self.streams.items()}
      self.pending_params = self.rollout_params(params)
      self.pending = self.executor.submit(self.worker.sample, self.pending_params, it + 1, it)
    generated.metrics['time/reshard'] = t_reshard
    generated.metrics['time/rollout_wait'] = t_wait
    generated.metrics['rollout/staleness'] = float(it - generated.version)
    return generated

  def checkpoint(self, streams):
    """The rollout in flight is not saved; the parameters it reads are, with
    the streams' positions from before it drew."""
    if self.pending_streams is not None:
      return self.pending_streams, self.pending_params
    return {name: s.state() for name, s in streams.items()}, self.pending_params

  def restore(self, checkpointer, step, meta, params):
    if not (meta.get('pending_rollout') and self.staleness):
      return
    behaviour = ckpt_lib.abstract_like(params)
    if self.shardings is not None:
      behaviour = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        behaviour,
        self.shardings,
      )
    self.pending_params = checkpointer.restore_behaviour(step, behaviour)

  def close(self):
    """Waits for a background rollout (its result is regenerated on resume)."""
    if self.pending is not None:
      concurrent.futures.wait([self.pending])
    self.executor.shutdown(wait=True)


def check(config, batch_shards):
  """The `topology` section: a known kind, and devices left for both sides."""
  del batch_shards
  topology_config, need = config.topology, checks.need
  need(topology_config.kind in KINDS, 'topology.kind', f'must be one of {KINDS}.')
  need(
    topology_config.kind != 'disaggregated' or topology_config.rollout_devices >= 1,
    'topology.rollout_devices',
    'must be >= 1 for a disaggregated topology.',
  )
  need(
    topology_config.rollout_devices < jax.device_count(),
    'topology.rollout_devices',
    f'must leave devices for training (there are {jax.device_count()}).',
  )
  need(
    topology_config.kind != 'colocated' or topology_config.rollout_devices == 0,
    'topology.rollout_devices',
    "must be 0 for a colocated topology (use 'disaggregated').",
  )
  online = tuple(name for name, a in checks.REGISTRY.items() if a.online)
  need(
    topology_config.kind != 'one_step_off' or config.algorithm in online,
    'topology.kind',
    f'one_step_off runs the online algorithms {online} only (they train on rollouts).',
  )


SECTION = checks.Section(
  'topology',
  {
    'topology.rollout_devices': checks.count(0),
    'topology.staleness': checks.count(0, hi=1),
    'topology.is_cap': checks.Range(False, 1),
  },
  check,
)


def make(config, worker, resources, rollout_mesh, total):
  """The topology of `topology.kind` around `worker` (resources: setup.Resources)."""
  shardings = _rollout_shardings(
    resources.mesh, rollout_mesh, resources.model.config, resources.params
  )
  decode = None
  if shardings is None:  # colocated: the decode layout, where it helps and fits
    mode = config.sampler.decode_weights
    decode = decode_shardings(mode, resources.mesh, resources.model.config, resources.params)
  kind = config.topology.kind
  if kind == 'one_step_off':
    staleness = config.topology.staleness
    return OneStepOff(
      worker, resources.tracer, shardings or decode, resources.streams, total, staleness
    )
  if shardings is not None:
    return Disaggregated(worker, resources.tracer, shardings)
  return Colocated(worker, resources.tracer, decode)
