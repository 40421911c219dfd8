"""Where and when rollouts are generated: a topology is a small strategy
object between the trainer's parameters and a rollout worker.

    topology.next_rollout(params, iteration) -> Rollout   # host arrays
    topology.rollout_params(params)                       # what the sampler reads
    topology.checkpoint(streams) -> (streams' states, behaviour params or None)
    topology.in_flight() -> [[iteration, version], ...]     # checkpoint metadata
    topology.restore(checkpointer, step, meta, params)
    topology.close()

- `Colocated` (the default): the sampler reads the trainer's own arrays (no
  copy, no weight sync) and generates now.
- `Disaggregated`: the last `topology.rollout_devices` devices sample on a
  mesh of their own; one device-to-device reshard per policy version.
- `StepsOff` (`one_step_off`, and `async` with `topology.max_staleness` = k):
  the rollouts of the next k iterations are generated in a background
  thread while the updates run, iteration i + k's by the parameters before
  update i; with `rollout_devices` it is disaggregated as well. A
  checkpoint keeps the parameters the rollouts in flight read and the
  streams' positions from before the oldest drew, so that a resumed run
  regenerates them exactly.

A remote rollout is one more class with these methods.
"""

import collections
import concurrent.futures
import contextlib
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jrl import checkpoint as ckpt_lib
from jrl import models, parallel
from jrl.losses import off_policy
from jrl.trainers import checks
from jrl.trainers.rollouts import engines

KINDS = ('colocated', 'disaggregated', 'one_step_off', 'async')


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


class Colocated:
  """Samples now, on the training devices, with the trainer's parameters:
  its very arrays, or with `decode` shardings (`engines.decode_shardings`) a copy in
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

  def in_flight(self):
    return []

  def publish(self, params, version):
    """After an update (partial rollouts only, `StepsOff`)."""
    del params, version

  def restore(self, checkpointer, step, meta, params):
    del checkpointer, step, meta, params

  def close(self):
    pass  # deliberate: the colocated topology holds no background rollout


class Disaggregated(Colocated):
  """Samples on devices of its own: one reshard per policy version."""

  def __init__(self, worker, tracer, shardings):
    super().__init__(worker, tracer, decode=shardings)

  def update_window(self):
    """The engine's devices are not the update's: it keeps its memory."""
    return contextlib.nullcontext()


class Flight(NamedTuple):
  """A rollout in flight: the iteration that will train on it, the policy
  version (iteration) whose parameters generate it, those parameters, and
  its Future (None until submitted)."""

  iteration: int
  version: int
  params: Any
  future: Any = None


class InlineExecutor:
  """`concurrent.futures.Executor`'s submit and shutdown, running each call
  in the caller's thread when its result is asked for (a rollout at its
  turn, once the versions a partial rollout moves to exist)."""

  def submit(self, fn, *args, **kwargs):
    return Deferred(lambda: fn(*args, **kwargs))

  def shutdown(self, wait=True):
    del wait


class Deferred(concurrent.futures.Future):
  """A Future whose call runs at the first `result()`; `cancel()` drops it."""

  def __init__(self, call):
    super().__init__()
    self.call = call

  def result(self, timeout=None):
    if not self.done():
      try:
        self.set_result(self.call())
      except BaseException as e:  # raised again below, as a thread's would be
        self.set_exception(e)
    return super().result(timeout)


class StepsOff:
  """Generates rollouts up to `staleness` = k iterations ahead in a background
  thread while the updates run: the rollout of iteration j is generated by
  the parameters of version max(first, j - k) (`first`: the iteration the
  pipeline started or resumed at), so no rollout is more than k versions
  older than the policy that trains on it, and every rollout generated is
  trained on (none is dropped for being late). Versions follow from
  iteration counts alone, never from timing: the same seeds give the same
  run. k = 1 is one-step-off; k = 0 samples in the background thread but
  waits for it, which is the synchronous run.

  Rollouts are generated one after another in one thread, each drawing its
  prompts when it starts; the thread records the streams' states after each
  draw. On more than one process they are generated in the main thread when
  their turn comes (the same rollouts, without the overlap).

  A checkpoint keeps the parameters of every version in flight and the
  streams' states from before the oldest rollout in flight drew, so that a
  resumed run regenerates the same rollouts."""

  def __init__(self, worker, tracer, shardings, streams, total, staleness=1, partial=None):
    self.staleness = staleness
    # Partial rollouts: (swap_every, kv_on_swap), and the parameters of every
    # version a rollout in flight may still move to, as the sampler reads them.
    self.partial = partial
    self.published = {}  # version -> parameters
    self.cond = threading.Condition()
    self.closing = False
    self.worker = worker
    self.tracer = tracer
    # The rollout mesh's, or the decode layout on the training devices; None:
    # the trainer's layout on its devices.
    self.shardings = shardings
    self.streams = streams
    self.total = total
    if jax.process_count() > 1:
      # Two threads issuing collectives across processes pair them up in
      # different orders on each process and deadlock: generate each rollout
      # at its turn in the main thread instead (the same rollouts, no overlap).
      self.executor = InlineExecutor()
    else:
      self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='rollout')
    self.flights = collections.deque()  # oldest first
    self.streams_before = None  # the streams' states before the oldest flight drew

  def update_window(self):
    """The next rollouts generate while the update runs: the engine keeps its memory."""
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

  def publish(self, params, version):
    """After an update: `params` are `version`'s; partial rollouts in flight
    may move to them (a copy: the next update donates the trainer's buffers)."""
    if not self.partial or not self.flights or version in self.published:
      return
    copy = self.rollout_params(params)
    with self.cond:
      self.published[version] = copy
      self.cond.notify_all()

  def _weights_at(self, flight):
    """`Sampler.generate`'s `weights_at` for a partial rollout: one version
    more every `swap_every` dispatches, from the flight's own up to the
    iteration that trains on it. Versions follow from dispatch counts, never
    timing: a version the update has not made yet is waited for, with the
    worker's lock released so that the held-out evaluation can run."""
    swap_every, _ = self.partial
    current = [flight.version]
    lock = self.worker.lock

    def weights_at(dispatch):
      target = min(flight.version + dispatch // swap_every, flight.iteration)
      if target <= current[0]:
        return None
      with self.cond:
        ready = target in self.published
      if not ready:
        lock.release()  # generate holds it: `weights_at` runs inside it
        try:
          with self.cond:
            self.cond.wait_for(lambda: target in self.published or self.closing)
        finally:
          lock.acquire()
      with self.cond:
        if target not in self.published:
          raise concurrent.futures.CancelledError('the run stopped')
        params = self.published[target]
      current[0] = target
      return self.worker.engine.load_weights(params, target), target

    return weights_at

  def _launch(self, flight):
    def generate():
      kwargs = {}
      if self.partial:
        kwargs = dict(weights_at=self._weights_at(flight), kv_on_swap=self.partial[1])
      generated = self.worker.sample(flight.params, flight.iteration, flight.version, **kwargs)
      return generated, {name: s.state() for name, s in self.streams.items()}

    return flight._replace(future=self.executor.submit(generate))

  def next_rollout(self, params, iteration):
    """The rollout of `iteration` (started up to k iterations ago); starts the
    one of iteration + k in the background."""
    it = iteration
    t_wait = time.perf_counter()
    t_reshard = 0.0
    if not self.flights or self.flights[0].future is None:
      if not self.flights:  # a fresh start: the next max(k, 1) rollouts, by these parameters
        start = time.perf_counter()
        behaviour = self.rollout_params(params)
        t_reshard = time.perf_counter() - start
        ahead = range(it, min(it + max(self.staleness, 1), self.total))
        self.flights.extend(Flight(j, it, behaviour) for j in ahead)
      # else: resumed with rollouts in flight, regenerated from their saved parameters
      if self.partial and it not in self.published:  # partial: this version may be moved to
        copy = self.flights[0].params if self.flights[0].version == it else None
        with self.cond:
          self.published[it] = copy if copy is not None else self.rollout_params(params)
      self.streams_before = {name: s.state() for name, s in self.streams.items()}
      self.flights = collections.deque(self._launch(f) for f in self.flights)
    flight = self.flights.popleft()
    if flight.iteration != it:
      raise RuntimeError(f'the rollout in flight is for iteration {flight.iteration}, not {it}.')
    generated, self.streams_before = flight.future.result()
    t_wait = time.perf_counter() - t_wait
    if self.staleness and it + self.staleness < self.total:
      last = self.flights[-1] if self.flights else None
      if last is not None and last.version == it:  # the same version: share its copy
        behaviour = last.params
      elif it in self.published:  # published after the last update
        behaviour = self.published[it]
      else:
        start = time.perf_counter()
        behaviour = self.rollout_params(params)
        t_reshard += time.perf_counter() - start
      self.flights.append(self._launch(Flight(it + self.staleness, it, behaviour)))
    if self.partial:  # versions no rollout in flight can move to any more
      low = min((f.version for f in self.flights), default=it + 1)
      with self.cond:
        for v in [v for v in self.published if v < low]:
          del self.published[v]
    generated.metrics['time/reshard'] = t_reshard
    generated.metrics['time/rollout_wait'] = t_wait
    generated.metrics['rollout/staleness'] = float(it - generated.version)
    generated.metrics['rollout/in_flight'] = float(len(self.flights))
    return generated

  def in_flight(self):
    """[[iteration, version], ...] of the rollouts in flight, oldest first (checkpoint metadata)."""
    return [[f.iteration, f.version] for f in self.flights]

  def checkpoint(self, streams):
    """The rollouts in flight are not saved; the parameters of each version
    they read are ({'v<version>': params}), with the streams' states from
    before the oldest one drew."""
    if not self.flights:
      return {name: s.state() for name, s in streams.items()}, None
    versions = {f'v{f.version}': f.params for f in self.flights}
    if self.partial:  # and every later version they may move to (the state's own among them)
      low = min(f.version for f in self.flights)
      with self.cond:
        versions.update({f'v{v}': p for v, p in self.published.items() if low <= v})
    return self.streams_before, versions

  def restore(self, checkpointer, step, meta, params):
    """Rollouts in flight when checkpoint `step` was saved, to regenerate:
    `rollouts_in_flight` [[iteration, version], ...] and the parameters of
    each version (older checkpoints: one rollout, of the iteration after
    `step`, by the parameters of version `step` - 1)."""
    self.flights.clear()
    if not (meta.get('pending_rollout') and self.staleness):
      return
    behaviour = ckpt_lib.abstract_like(params)
    if self.shardings is not None:
      behaviour = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        behaviour,
        self.shardings,
      )
    in_flight = meta.get('rollouts_in_flight')
    if in_flight is None:  # saved before k > 1: one rollout, a bare parameter tree
      params = checkpointer.restore_behaviour(step, behaviour)
      self.flights.append(Flight(int(meta['iteration']), int(meta['iteration']) - 1, params))
      return
    names = meta.get('behaviour_versions') or sorted({f'v{v}' for _, v in in_flight})
    saved = checkpointer.restore_behaviour(step, {name: behaviour for name in names})
    self.flights.extend(Flight(int(j), int(v), saved[f'v{v}']) for j, v in in_flight)
    if self.partial:
      with self.cond:
        self.published = {int(name[1:]): p for name, p in saved.items()}

  def close(self):
    """Waits for the background rollouts (their results are regenerated on
    resume); partial ones waiting for a version that will not come stop."""
    with self.cond:
      self.closing = True
      self.cond.notify_all()
    for flight in self.flights:
      if isinstance(flight.future, Deferred):
        flight.future.cancel()  # never started: nothing to wait for
    concurrent.futures.wait([f.future for f in self.flights if f.future is not None])
    self.executor.shutdown(wait=True)


def staleness(config):
  """k, the most policy versions a rollout may lag the update that trains on
  it: `topology.staleness` one-step-off, `topology.max_staleness` async, 0
  for the synchronous topologies."""
  topology_config = config.get('topology')
  kind = topology_config.kind if topology_config else 'colocated'
  if kind == 'one_step_off':
    return topology_config.staleness
  if kind == 'async':
    return topology_config.max_staleness
  return 0


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
    topology_config.kind not in ('one_step_off', 'async') or config.algorithm in online,
    'topology.kind',
    f'{topology_config.kind} runs the online algorithms {online} only (they train on rollouts).',
  )
  levels, modes = off_policy.IS_LEVELS, off_policy.IS_MODES
  need(topology_config.is_level in levels, 'topology.is_level', f'must be one of {levels}.')
  need(topology_config.is_mode in modes, 'topology.is_mode', f'must be one of {modes}.')
  need(
    topology_config.is_low < topology_config.is_cap,
    'topology.is_low',
    f'must be below `topology.is_cap` ({topology_config.is_cap}).',
  )
  partial = topology_config.partial_rollouts
  need(partial in (True, False), 'topology.partial_rollouts', 'must be True or False.')
  need(
    not partial or (topology_config.kind == 'async' and topology_config.max_staleness >= 1),
    'topology.partial_rollouts',
    "needs `topology.kind='async'` with `topology.max_staleness` >= 1.",
  )
  need(
    not partial or config.sampler.engine == 'jrl',
    'topology.partial_rollouts',
    "needs jrl's sampler (`sampler.engine='jrl'`), which takes weights between dispatches.",
  )
  need(
    not partial or not config.get('rl') or not config.rl.dynamic_sampling,
    'topology.partial_rollouts',
    'cannot be used with `rl.dynamic_sampling` (a rollout of several draws).',
  )
  need(
    topology_config.kv_on_swap in ('keep', 'recompute'),
    'topology.kv_on_swap',
    "must be 'keep' or 'recompute'.",
  )
  need(
    topology_config.is_mode == 'mask' or topology_config.is_low == 0,
    'topology.is_low',
    "bounds the weights of is_mode='mask' only; leave it 0 with 'truncate'.",
  )


SECTION = checks.Section(
  'topology',
  {
    'topology.rollout_devices': checks.count(0),
    'topology.staleness': checks.count(0, hi=1),
    'topology.max_staleness': checks.count(0),
    'topology.is_cap': checks.Range(False, 1),
    'topology.is_low': checks.Range(False, 0),
    'topology.swap_every': checks.count(1),
  },
  check,
)


def make(topology_config, decode_weights, worker, resources, rollout_mesh, total):
  """The topology of `topology_config.kind` (the config's `topology` section)
  around `worker`; `decode_weights`: `sampler.decode_weights`, the layout a
  colocated sampler decodes from; `total`: the run's iterations
  (resources: setup.Resources)."""
  shardings = _rollout_shardings(
    resources.mesh, rollout_mesh, resources.model.config, resources.params
  )
  decode = None
  if shardings is None:  # colocated: the decode layout, where it helps and fits
    decode = engines.decode_shardings(
      decode_weights, resources.mesh, resources.model.config, resources.params
    )
  kind = topology_config.kind
  if kind in ('one_step_off', 'async'):
    k = topology_config.staleness if kind == 'one_step_off' else topology_config.max_staleness
    partial = None
    if kind == 'async' and topology_config.partial_rollouts:
      partial = (topology_config.swap_every, topology_config.kv_on_swap)
    return StepsOff(
      worker, resources.tracer, shardings or decode, resources.streams, total, k, partial
    )
  if shardings is not None:
    return Disaggregated(worker, resources.tracer, shardings)
  return Colocated(worker, resources.tracer, decode)
