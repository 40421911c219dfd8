"""The host-side driver: a request queue, continuous batching, GRPO groups.

    sampler = Sampler(graphdef, model_config, SamplerConfig(...))
    groups = sampler.generate(params, requests, group_size=8)   # [B][G] Completion

`params` is the trainer's parameter pytree, passed as it is (never donated
or copied), with whatever sharding it has. Each call runs the queue to
completion: the groups admitted in one round are prefilled together in one
call (a batch of 1 or of the most groups a replica holds, padded to one
bucket length; with `prefill_chunk`, one bucket and a traced number of
chunks), inserted into free slots, decoded `steps_per_dispatch` tokens per
jitted call, and finished slots are freed and refilled from the queue
between dispatches. A dispatch decodes only the occupied slots (gathered
into a `scheduler.row_width` of rows, `paged.generate_slots`), so idle
slots and a batch's long tail do not run through the model. The host
bookkeeping (admission, page promises, the slots each dispatch decodes) is
`jrl.sampler.scheduler`; requests, checks and seeds `jrl.sampler.requests`.

Data-parallel replicas (`replicas=R`): every decode-state array has a
leading [R] axis sharded over the mesh's batch axes; replica r owns S/R
slots and its own page pool and page tables; whole groups (which share
their prompt's pages) are spread over the replicas. With one replica the
state is replicated over the batch axes, as the trainer's default.

Compiled programs: `enable_compilation_cache(workdir + '/xla_cache')` once at
start-up keeps them on disk, so a restarted run loads instead of compiling.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jrl import trace
from jrl.sampler import paged
from jrl.sampler.paged import SamplerConfig
from jrl.sampler.prefill import default_buckets
from jrl.sampler.refresh import refresh_kv
from jrl.sampler.requests import (
  Completion,
  Continuation,
  Request,
  check_requests,
  slot_request,
)
from jrl.sampler.scheduler import SamplerStats, Scheduler, narrower_width, pack_admissions
from jrl.sampler.state import state_shardings


def enable_compilation_cache(directory):
  """Persists compiled programs under `directory` (e.g. `<workdir>/xla_cache`).

  A restarted run, or a second run of the same shapes, then loads the
  sampler's (and the trainer's) executables from disk instead of compiling
  them again. Call it once, before the first `jax.jit` call of the process
  (the cache is set up on the first compile); every program is cached,
  however fast it compiled. Returns the directory.
  """
  import os

  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  jax.config.update('jax_compilation_cache_dir', directory)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  return directory


def _checked(model_config, engine_config, steps_per_dispatch, mesh, replicas, prefill_chunk):
  """`engine_config` after the Sampler's argument checks (a ValueError names
  the argument), with the gather attention on a mesh of several devices."""
  engine_config.validate()
  if steps_per_dispatch < 1:
    raise ValueError(f'`steps_per_dispatch` must be >= 1, got {steps_per_dispatch}.')
  if not isinstance(replicas, int) or replicas < 1 or engine_config.num_slots % replicas:
    raise ValueError(
      f'`replicas` must be a positive divisor of `num_slots`={engine_config.num_slots}, '
      f'got {replicas!r}.'
    )
  if replicas > 1 and model_config.num_experts and model_config.moe_impl == 'ragged':
    # The replica axis is a vmap, and jax.lax.ragged_dot has no batching rule.
    raise ValueError(
      "`replicas` > 1 needs `moe_impl='dense'` on MoE models (ragged_dot cannot be vmapped)."
    )
  if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
    raise ValueError(f'`prefill_chunk` must be a positive int, got {prefill_chunk!r}.')
  if mesh is not None and mesh.size > 1 and engine_config.attention_impl == 'auto':
    # jax.jit does not partition a Pallas kernel (it would run on gathered
    # operands), so a sampler spread over several devices takes the gather path.
    engine_config = engine_config._replace(attention_impl='gather')
  return engine_config


def _prefill_buckets(max_prompt_len, buckets, chunk):
  """The prompt lengths that compile: `buckets` (default powers of two),
  which must reach `max_prompt_len`; with a prefill `chunk`, one bucket
  (the chunk count is traced, so one program serves every length)."""
  buckets = tuple(buckets or default_buckets(max_prompt_len))
  if max(buckets) < max_prompt_len:
    raise ValueError(f'`prefill_buckets` {buckets} must reach `max_prompt_len` {max_prompt_len}.')
  if chunk is not None:
    return (-(-max_prompt_len // chunk) * chunk,)
  return buckets


class Sampler:
  """Paged, continuously batched sampling on explicit parameters.

  Args:
    graphdef, model_config: the policy's structure.
    engine_config: sizes; `num_slots` is the total over replicas and
      `num_pages` the pool of each replica (scratch page included).
    steps_per_dispatch: decode steps per jitted call.
    prefill_buckets: prompt lengths that compile (default powers of two).
    mesh: the trainer's mesh (None: one device).
    replicas: R data-parallel rollout replicas. Each owns S/R slots and its
      own page pool; every decode-state array has a leading [R] axis sharded
      over the mesh's batch axes ('data', or ('data', 'fsdp') when R is
      their product), so each device decodes only its replica's slots.
      Default 1: today's layout, the state replicated over the batch axes.
    prefill_chunk: prefill C tokens at a time (None: one pass per bucket).
      Prompts are then padded to one bucket (max_prompt_len rounded up to
      C) and only the chunks up to the longest prompt of a call run (a
      traced count), so one prefill program serves every length.
    max_prefill_batch: most prompts per replica in one prefill call
      (default: as many as fit in its slots). A call's rows are padded to a
      power of two up to this (capped by the groups a replica can hold), so
      a refill of a few prompts costs a few prefills.
    compaction: each dispatch decodes only the occupied slots of each
      replica, in the `row_width` that holds them (`paged.generate_slots`);
      False decodes every slot every step.
  """

  parks_turns = True  # `on_turn_end` may answer with a Future (`generate`)

  def __init__(
    self,
    graphdef,
    model_config,
    engine_config: SamplerConfig,
    *,
    steps_per_dispatch=8,
    prefill_buckets=None,
    mesh=None,
    replicas=1,
    prefill_chunk=None,
    max_prefill_batch=None,
    compaction=True,
  ):
    engine_config = _checked(
      model_config, engine_config, steps_per_dispatch, mesh, replicas, prefill_chunk
    )
    self.graphdef = graphdef
    self.model_config = model_config
    self.cfg = engine_config
    self.steps_per_dispatch = steps_per_dispatch
    self.buckets = _prefill_buckets(engine_config.max_prompt_len, prefill_buckets, prefill_chunk)
    self.prefill_chunk = prefill_chunk
    self.replicas = replicas
    self.slots_per_replica = engine_config.num_slots // replicas
    self.max_prefill_batch = max_prefill_batch or self.slots_per_replica
    self.compaction = compaction
    self._page_bound = paged.needs_page_bound(engine_config, model_config)
    self.mesh = mesh
    self.stats = SamplerStats()
    self.tracer = trace.NULL  # the controller sets its own to record prefill/decode spans
    self.version = None  # the policy version `load_weights` was given last
    self.released = False  # between `release` and `resume`: `generate` is refused
    self._shardings = state_shardings(mesh, replicas, model_config)
    self._rcfg = engine_config._replace(num_slots=self.slots_per_replica)  # one replica's
    self._jit_steps()

  def _jit_steps(self):
    """The driver's jitted steps (`_admit`, `_generate`, `_generate_slots`,
    `_free`, `_resume`, `_refresh`, `_init`): the paged steps over the
    leading [R] replica axis of every state array, each donating the state
    it replaces and placing its result by `state_shardings`."""
    graphdef, rcfg, chunk = self.graphdef, self._rcfg, self.prefill_chunk
    out = {} if self._shardings is None else {'out_shardings': self._shardings}
    per_replica = self._per_replica

    def admit(params, state, tokens, lengths, slots, request, valid, num_chunks, truncate):
      step = lambda st, t, n, sl, rq, ok: paged.admit(
        graphdef,
        params,
        st,
        t,
        n,
        sl,
        rq,
        ok,
        rcfg,
        chunk=chunk,
        num_chunks=None if chunk is None else num_chunks,
        truncate=truncate,
      )
      return per_replica(step)(state, tokens, lengths, slots, request, valid)

    # `until_live`: a dispatch ends early once at most that many rows are
    # live (with compaction and one replica: the next narrower row width),
    # so that the next one decodes the rest on fewer rows. Not with several
    # replicas: each replica's loop would stop on its own count, idling it
    # while the others run.
    def generate(params, state, num_steps, max_pages, truncate, until_live=0):
      step = lambda st: paged.generate(
        graphdef, params, st, rcfg, num_steps, max_pages, truncate, until_live
      )
      return per_replica(step)(state)

    def generate_slots(params, state, index, num_steps, max_pages, truncate, until_live=0):
      step = lambda st, idx: paged.generate_slots(
        graphdef, params, st, idx, rcfg, num_steps, max_pages, truncate, until_live
      )
      return per_replica(step)(state, index)

    def refresh(params, state, tokens):
      return per_replica(lambda st, t: refresh_kv(graphdef, params, st, t, rcfg))(state, tokens)

    self._admit = jax.jit(admit, static_argnames=('truncate',), donate_argnums=(1,), **out)
    static = ('num_steps', 'max_pages', 'truncate', 'until_live')
    self._generate = jax.jit(generate, static_argnames=static, donate_argnums=(1,), **out)
    self._generate_slots = jax.jit(
      generate_slots, static_argnames=static, donate_argnums=(1,), **out
    )
    self._free = jax.jit(per_replica(paged.free), donate_argnums=(0,), **out)
    self._resume = jax.jit(per_replica(paged.resume), donate_argnums=(0,), **out)
    self._refresh = jax.jit(refresh, donate_argnums=(1,), **out)
    self._init = jax.jit(self._init_replicas, **out)

  def _per_replica(self, f):
    """`f` over the leading [R] axis of every argument: `vmap`, or with one
    replica a plain call on the squeezed arrays (no batched control flow)."""
    if self.replicas > 1:
      return jax.vmap(f)

    def one(*args):
      out = f(*(jax.tree.map(lambda x: x[0], a) for a in args))
      return jax.tree.map(lambda x: x[None], out)

    return one

  # State ---------------------------------------------------------------------

  def _init_replicas(self):
    one = paged.init_state(self.model_config, self._rcfg)
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.replicas, *x.shape)), one)

  def init_state(self):
    """An empty state: every field with a leading [R] replica axis."""
    return self._init()

  def bucket(self, length):
    for b in self.buckets:
      if length <= b:
        return b
    raise ValueError(
      f'prompt of {length} tokens exceeds `max_prompt_len`={self.cfg.max_prompt_len}.'
    )

  # Requests ------------------------------------------------------------------

  def _slot_request(self, request, samples):
    """`requests.slot_request` with this sampler's sizes."""
    return slot_request(request, samples, self.cfg)

  def _admit_round(self, params, state, admitted, truncate, max_batch):
    """One prefill call for the groups admitted this round (`admitted[r]`:
    [(request, prompt length, local slots, SlotRequest)] for replica r)."""
    rows = pack_admissions(admitted, max_batch, self.bucket, self.prefill_chunk)
    return self._admit(
      params,
      state,
      rows.tokens,
      rows.lengths,
      rows.slots,
      rows.request,
      rows.valid,
      rows.num_chunks,
      truncate=truncate,
    )

  def _swap(self, state, sched, weights, version, kv_on_swap):
    """Partial rollouts: `weights` of `version` from now on; the samples in
    flight keep or recompute their cache (`generate(kv_on_swap=...)`)."""
    start = time.perf_counter()
    sched.swap(version)
    self.stats.weight_swaps += 1
    if kv_on_swap == 'recompute' and sched.slot_owner:
      (out_tokens,) = _host((state.out_tokens,))
      cap = self.cfg.max_prompt_len + self.cfg.max_new_tokens
      tokens = sched.refresh_tokens(np.asarray(out_tokens).reshape(sched.num_slots, -1), cap)
      state = self._refresh(weights, state, tokens)
      jax.block_until_ready(state.k_pages)
    self.stats.swap_seconds += time.perf_counter() - start
    return weights, state

  # The engine contract (jrl.trainers.rollouts.contracts.Engine) --------------------------

  def load_weights(self, params, version):
    """The weights `generate` reads for the policy's version `version`: the
    trainer's own arrays, as they are (returned, never copied)."""
    self.version = version
    return params

  def release(self):
    """Before an update on the same devices. The KV pool and the decode state
    exist only inside `generate`, so nothing stays allocated; until `resume`,
    `generate` raises instead of allocating them beside the update's memory."""
    self.released = True

  def resume(self):
    """After the update: `generate` may run again."""
    self.released = False

  # The loop ------------------------------------------------------------------

  def generate(
    self,
    params,
    requests,
    *,
    group_size=1,
    share_prompt=True,
    state=None,
    on_turn_end=None,
    weights_at=None,
    kv_on_swap='keep',
  ):
    """Samples `group_size` completions for every request.

    Args:
      params: the policy parameters (as the trainer holds them).
      requests: a sequence of Request.
      group_size: G samples per request (GRPO group).
      share_prompt: one prefill per request and shared prompt pages for its
        G samples (True), or G independent prefills (False).
      state: a DecodeState to start from (default: a fresh one), with the
        leading [R] replica axis of `init_state`.
      on_turn_end: multi-turn. Called as `on_turn_end(i, g, tokens,
        logprobs)` when sample g of request i ends a turn: it stops on one
        of its stop tokens, or reaches its turn's token limit
        (`Request.turn_max_tokens`, `Continuation.max_tokens`) before its
        `max_new_tokens` (`tokens`: everything after the prompt so far;
        `logprobs`: theirs, as `Completion.logprobs`). It returns
        environment tokens to append, a list or a `Continuation` that also
        sets the next turn's limit and temperature (the sample then
        continues on its cached pages: the tokens are fed through the
        decode loop, the prefix is not recomputed), or a finish reason (str) to end the
        sample, or a `concurrent.futures.Future` of either: the sample is
        then parked with its pages and the other slots keep decoding until
        the Future is done (a sample's tokens depend on its seed and
        position, not on when it resumed). Environment tokens count towards
        `max_new_tokens` and must fit `SamplerConfig.max_forced_tokens`.
      weights_at: partial rollouts. Called as `weights_at(d)` before the
        d-th decode dispatch (and its admissions); returns None to keep the
        weights, or (weights, version) to decode with those from then on,
        samples in flight included. Every Completion then has `versions`,
        the version that produced each token (`params` is version
        `self.version`, as `load_weights` was given).
      kv_on_swap: what happens to the cache of samples in flight when the
        weights change: 'keep' (the next tokens attend to keys and values
        of the old weights) or 'recompute' (every sequence so far is
        prefilled again with the new weights; `jrl.sampler.refresh`).

    Returns:
      [len(requests)][G] Completion, in request order.

    Whole groups go to one replica each (their samples share the prompt's
    pages), the one with the most idle slots among those with room; every
    round of admissions is one prefill call over all replicas.
    """
    if self.released:
      raise RuntimeError(
        'the sampler was released for an update on its devices (`release`); '
        'call `resume` before `generate`.'
      )
    requests = list(requests)
    check_requests(
      requests,
      group_size,
      self.cfg,
      self.model_config.vocab_size,
      self.slots_per_replica,
      self.replicas,
    )
    if kv_on_swap not in ('keep', 'recompute'):
      raise ValueError(f"`kv_on_swap` must be 'keep' or 'recompute', got {kv_on_swap!r}.")
    self.stats = stats = SamplerStats()
    state = self.init_state() if state is None else state
    truncate = any((r.top_k > 0 or r.top_p < 1.0) and not r.greedy for r in requests)
    sched = Scheduler(
      requests,
      group_size,
      share_prompt,
      self.cfg,
      self.replicas,
      self.slots_per_replica,
      self.max_prefill_batch,
    )
    sched.version, sched.track_versions = self.version, weights_at is not None

    while sched.busy:
      new = None if weights_at is None else weights_at(stats.dispatches)
      if new is not None and new[1] != sched.version:
        params, state = self._swap(state, sched, *new, kv_on_swap)
      state = self._admit_step(params, state, sched, stats, truncate)
      finished = []
      if sched.decodable:
        state, finished = self._decode_step(params, state, sched, stats, truncate)
      else:  # every sample waits for its environment: nothing to decode
        self._wait_for_environments(sched, stats)
      answers = sched.unparked()
      finished += list(answers)
      if finished:
        state = self._retire_step(state, sched, stats, finished, answers, on_turn_end)
    free_top, refcount, active = _host((state.free_top, state.refcount, state.active))
    stats.pages_free_at_end = int(np.sum(free_top))
    stats.pages_referenced_at_end = int(np.count_nonzero(refcount))
    stats.slots_active_at_end = int(np.count_nonzero(active))
    self.stats = stats  # an evaluation run while a partial rollout waited replaced it
    return sched.results

  # One round of the loop: admit, decode (or wait), retire -----------------------
  # `stats` is the call's own SamplerStats: an evaluation run inside
  # `weights_at` replaces `self.stats` while this call is still running.

  def _admit_step(self, params, state, sched, stats, truncate):
    """Admits what fits, in order, each group into the replica with the most
    idle slots, as one prefill call; the new DecodeState."""
    admitted = sched.admit(self._slot_request)
    if not any(admitted):
      return state
    start = time.perf_counter()
    t_start = self.tracer.now()
    state = self._admit_round(params, state, admitted, truncate, sched.max_batch)
    stats.prefill_seconds += time.perf_counter() - start
    rows = [row for rows in admitted for row in rows]
    self.tracer.add(
      'prefill',
      t_start,
      self.tracer.now(),
      'sampler',
      tokens=sum(n for _, n, _, _ in rows),
      samples=sum(len(local) for _, _, local, _ in rows),
    )
    stats.prefills += len(rows)
    stats.prefill_calls += 1
    return state

  def _decode_step(self, params, state, sched, stats, truncate):
    """One decode dispatch of `steps_per_dispatch` steps over the occupied
    slots (all of them without compaction).

    Returns:
      (state, the global slots whose sample stopped).
    """
    cfg = self.cfg
    start = time.perf_counter()
    t_start = self.tracer.now()
    active = len(sched.slot_owner)
    max_pages = cfg.max_pages_per_slot
    if self._page_bound:
      max_pages = paged.attend_pages(sched.held_pages, self.steps_per_dispatch, cfg)
    decode = dict(num_steps=self.steps_per_dispatch, max_pages=max_pages, truncate=truncate)
    # Idle and finished slots cost nothing: decode the occupied ones only.
    index = sched.decode_index() if self.compaction else None
    early = self.compaction and self.replicas == 1
    if index is None:
      width = sched.num_slots
      until_live = early * narrower_width(sched.sr)
      state = self._generate(params, state, **decode, until_live=until_live)
    else:
      width = index.size
      until_live = early * narrower_width(index.shape[1])
      state = self._generate_slots(params, state, index, **decode, until_live=until_live)
      stats.compactions += 1
    done, free_top, held, gen = (
      np.asarray(a).reshape(-1)
      for a in _host((state.done, state.free_top, state.num_pages, state.num_generated))
    )
    steps_run = sched.decoded(held, gen)
    stats.decode_steps += steps_run
    stats.decode_rows += width * steps_run
    stats.decode_seconds += time.perf_counter() - start
    self.tracer.add(
      'decode',
      t_start,
      self.tracer.now(),
      'sampler',
      active=active,
      rows=width,
      steps=steps_run,
      max_pages=int(max_pages),
    )
    stats.dispatches += 1
    stats.peak_pages = max(stats.peak_pages, int(np.sum(sched.capacity - free_top)))
    return state, sched.finished(done)

  def _wait_for_environments(self, sched, stats):
    """Blocks until a parked sample's environment answers."""
    start = time.perf_counter()
    with self.tracer.span('env_wait', 'sampler', parked=len(sched.parked)):
      sched.wait_parked()
    stats.env_wait_seconds += time.perf_counter() - start

  def _retire_step(self, state, sched, stats, finished, answers, on_turn_end):
    """The stopped samples (`finished` slots; `answers`: the parked ones whose
    environment answered) end, or continue with their environment's tokens
    on their cached pages; the pages of those that end are freed."""
    # Whole [R, S/R, ...] arrays, indexed on the host: indexing on the device
    # would compile one gather per number of finished slots.
    idx = np.asarray(finished)
    out_tokens, out_logp, num_gen, reasons = (
      np.asarray(a).reshape(sched.num_slots, *np.shape(a)[2:])[idx]
      for a in _host(
        (state.out_tokens, state.out_logprobs, state.num_generated, state.finish_reason)
      )
    )
    continuing, ended, tokens = sched.retire(
      finished, out_tokens, out_logp, num_gen, reasons, on_turn_end, answers
    )
    stats.env_parked_peak = max(stats.env_parked_peak, len(sched.parked))
    stats.generated_tokens += tokens
    if continuing:
      state = self._resume(state, *sched.resume_args(continuing))
      stats.env_turns += len(continuing)
    if ended:
      state = self._free(state, sched.release(ended))
    return state


def _host(arrays):
  """NumPy copies of whole arrays. Replicas sharded over several processes'
  devices are gathered from every process (the same on each, so every
  process's driver takes the same decisions)."""
  if all(a.is_fully_addressable or a.is_fully_replicated for a in arrays):
    return jax.device_get(arrays)
  return multihost_utils.process_allgather(arrays, tiled=True)


__all__ = [
  'Completion',
  'Continuation',
  'Request',
  'Sampler',
  'SamplerConfig',
  'SamplerStats',
  'default_buckets',
  'enable_compilation_cache',
]
