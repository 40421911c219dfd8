"""The host-side driver: a request queue, continuous batching, GRPO groups.

    sampler = Sampler(graphdef, model_config, EngineConfig(...))
    groups = sampler.generate(params, requests, group_size=8)   # [B][G] Completion
    batch = to_rollout_batch(groups, max_new_tokens)             # arrays for the trainer

`params` is the trainer's parameter pytree, passed as it is (never donated
or copied), with whatever sharding it has. Each call runs the queue to
completion: the groups admitted in one round are prefilled together in one
call (a batch of 1 or of the most groups a replica holds, padded to one
bucket length; with `prefill_chunk`, one bucket and a traced number of
chunks), inserted into free slots, decoded `steps_per_dispatch` tokens per
jitted call, and finished slots are freed and refilled from the queue
between dispatches. Once the queue is empty, the live slots are compacted
into a state with fewer slots, so the long tail of a batch does not run
finished slots through the model.

Data-parallel replicas (`replicas=R`): every decode-state array has a
leading [R] axis sharded over the mesh's batch axes; replica r owns S/R
slots and its own page pool and page tables; whole groups (which share
their prompt's pages) are spread over the replicas. With one replica the
state is replicated over the batch axes, as the trainer's default.

Compiled programs: `enable_compilation_cache(workdir + '/xla_cache')` once at
start-up keeps them on disk, so a restarted run loads instead of compiling.

Admission: a group is admitted when enough slots are idle and its
worst-case page count (prompt plus `max_new_tokens` per sample, prompt
pages counted once when shared) fits in the pages not already promised to
running groups. Pages are still allocated lazily, one at a time, as tokens
are written, so memory in use follows the real lengths; the promise only
guarantees that a running sequence never finds the pool empty. A request
whose worst case exceeds the whole pool is refused up front with an error;
any smaller pool works, with requests waiting for pages to be freed.

Randomness: sample g of a request with seed s uses the key
fold_in(PRNGKey(s), g), advanced once per token, whatever slot it lands in
and whatever else is in flight; so a run is reproducible from its seeds and
continuous batching gives the same tokens as decoding each request alone.
"""

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jrl import trace
from jrl.sampler import engine
from jrl.sampler.engine import EngineConfig
from jrl.sampler.sampling import _NEG


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt and how to sample from it.

  `max_new_tokens` and `min_new_tokens` take an int (every sample) or one
  value per sample of the group (a GRPO group with its own budgets). Until a
  sample has `min_new_tokens` tokens its stop tokens cannot be drawn (their
  logits are −inf, as Hugging Face's `min_new_tokens` does to EOS) and its
  stop sequences are not honoured. `banned_tokens` are never drawn and
  `logit_bias` ({token: bias} or (token, bias) pairs) is added to the logits
  before the temperature; logprobs are those of the distribution sampled
  from, so with a bias they differ from the trainer's recomputed ones (as
  with top-k). A stop sequence ends the sample right after its last token,
  which is kept, like a stop token.
  """

  prompt: Sequence[int]  # token ids
  max_new_tokens: int | Sequence[int]  # ≤ EngineConfig.max_new_tokens; or one per sample
  temperature: float = 1.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  greedy: bool = False
  stop_tokens: Sequence[int] = ()  # ≤ EngineConfig.max_stop_tokens ids
  seed: int = 0
  min_new_tokens: int | Sequence[int] = 0  # stop tokens forbidden before; or one per sample
  banned_tokens: Sequence[int] = ()  # never sampled
  logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()  # added to the logits
  stop_sequences: Sequence[Sequence[int]] = ()  # ≤ max_stop_sequences, each ≤ max_stop_len ids

  def per_sample(self, field, group_size):
    """`max_new_tokens` or `min_new_tokens` as a list of `group_size` ints."""
    value = getattr(self, field)
    if isinstance(value, (int, np.integer)):
      return [int(value)] * group_size
    values = [int(v) for v in value]
    if len(values) != group_size:
      raise ValueError(f'`{field}` has {len(values)} values for a group of {group_size} samples.')
    return values

  def bias_items(self):
    """[(token, bias)] of `logit_bias` then the banned tokens (bias −1e30)."""
    items = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
    pairs = [(int(t), float(b)) for t, b in items]
    return pairs + [(int(t), float(_NEG)) for t in self.banned_tokens]


class Completion(NamedTuple):
  """One sampled continuation."""

  tokens: np.ndarray  # [n] int32, the stop token included when it ended the sample
  logprobs: np.ndarray  # [n] float32 under the distribution sampled from (0 on env tokens)
  finish_reason: str  # 'stop' | 'length' | what `on_turn_end` reported
  env_mask: np.ndarray | None = None  # [n] bool: tokens the environment appended (multi-turn)


class RolloutBatch(NamedTuple):
  """Completions as padded arrays, row b·G + g for sample g of prompt b."""

  tokens: np.ndarray  # [B·G, T] int32, pad 0
  logprobs: np.ndarray  # [B·G, T] float32, 0 on padding
  mask: np.ndarray  # [B·G, T] bool, True on generated tokens
  finish_reason: list  # [B·G] str


@dataclasses.dataclass
class SamplerStats:
  """Figures of the last `generate` call."""

  prefills: int = 0
  dispatches: int = 0
  generated_tokens: int = 0
  peak_pages: int = 0  # most pages in use at once (scratch page excluded)
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0
  env_turns: int = 0  # environment turns appended (multi-turn)
  prefill_calls: int = 0  # batched prefill calls (`prefills` counts prompts)
  compactions: int = 0  # times the live slots were moved into a smaller state


def default_buckets(max_prompt_len, smallest=16):
  """Powers of two from `smallest` up to and including `max_prompt_len`."""
  buckets, b = [], smallest
  while b < max_prompt_len:
    buckets.append(b)
    b *= 2
  buckets.append(max_prompt_len)
  return tuple(buckets)


@jax.jit
def _sample_keys(seed, samples_G):
  """[G, 2] key data: fold_in(PRNGKey(seed), g) for each sample index g."""
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda g: jax.random.fold_in(base, g))(samples_G)


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


def _pow2_at_least(n):
  return 1 << max(0, math.ceil(math.log2(max(1, n))))


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
    compaction: when the queue is empty, copy the live slots into a state
      with fewer slots (a power of two per replica, at most a quarter of the
      current count) so that finished slots stop costing decode work.
  """

  def __init__(
    self,
    graphdef,
    model_config,
    engine_config: EngineConfig,
    *,
    steps_per_dispatch=8,
    prefill_buckets=None,
    mesh=None,
    replicas=1,
    prefill_chunk=None,
    max_prefill_batch=None,
    compaction=True,
  ):
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
    self.graphdef = graphdef
    self.model_config = model_config
    self.cfg = engine_config
    self.steps_per_dispatch = steps_per_dispatch
    self.buckets = tuple(prefill_buckets or default_buckets(engine_config.max_prompt_len))
    if max(self.buckets) < engine_config.max_prompt_len:
      raise ValueError(
        f'`prefill_buckets` {self.buckets} must reach `max_prompt_len` '
        f'{engine_config.max_prompt_len}.'
      )
    if prefill_chunk is not None:
      if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f'`prefill_chunk` must be a positive int, got {prefill_chunk!r}.')
      # One bucket: the chunk count is traced, so one program serves every length.
      self.buckets = (-(-engine_config.max_prompt_len // prefill_chunk) * prefill_chunk,)
    self.prefill_chunk = prefill_chunk
    self.replicas = replicas
    self.slots_per_replica = engine_config.num_slots // replicas
    self.max_prefill_batch = max_prefill_batch or self.slots_per_replica
    self.compaction = compaction
    self.mesh = mesh
    self.stats = SamplerStats()
    self.tracer = trace.NULL  # the controller sets its own to record prefill/decode spans
    self._shardings = self._state_shardings()
    cfg = engine_config
    rcfg = cfg._replace(num_slots=self.slots_per_replica)  # one replica's engine
    self._rcfg = rcfg
    # Single-replica steps, for driving the engine by hand (tests, tools).
    self._prefill = jax.jit(functools.partial(engine.prefill, graphdef))
    self._insert = jax.jit(functools.partial(engine.insert, cfg=cfg), donate_argnums=(0,))
    # The driver's steps: every state array has a leading [R] replica axis.
    out = {} if self._shardings is None else {'out_shardings': self._shardings}
    chunk = prefill_chunk

    per_replica = self._per_replica

    def admit(params, state, tokens, lengths, slots, request, valid, num_chunks, truncate):
      step = lambda st, t, n, sl, rq, ok: engine.admit(
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

    def generate(params, state, num_steps, max_pages, truncate):
      step = lambda st: engine.generate(
        graphdef, params, st, rcfg, num_steps, max_pages=max_pages, truncate=truncate
      )
      return per_replica(step)(state)

    self._admit = jax.jit(admit, static_argnames=('truncate',), donate_argnums=(1,), **out)
    self._generate = jax.jit(
      generate,
      static_argnames=('num_steps', 'max_pages', 'truncate'),
      donate_argnums=(1,),
      **out,
    )
    self._free = jax.jit(per_replica(engine.free), donate_argnums=(0,), **out)
    self._resume = jax.jit(per_replica(engine.resume), donate_argnums=(0,), **out)
    # Compaction gathers the per-slot fields only; the pools are passed through
    # untouched (no copy, and no donated buffer of the wrong shape).
    slot_out = {}
    if self._shardings is not None:
      slot_out = {'out_shardings': self._shardings.page_table}
    take = lambda fields, index_Sc: jax.tree.map(lambda x: jnp.take(x, index_Sc, axis=0), fields)
    self._take_slots = jax.jit(per_replica(take), **slot_out)
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

  def _batch_axes(self):
    """Mesh axes the replica axis is split over (None: not split)."""
    if self.mesh is None or self.replicas == 1:
      return None
    shape = self.mesh.shape
    data, fsdp = shape.get('data', 1), shape.get('fsdp', 1)
    if self.replicas == data:
      return 'data'
    if self.replicas == data * fsdp:
      return ('data', 'fsdp')
    raise ValueError(
      f'`replicas`={self.replicas} must be 1, the data axis ({data}) or data x fsdp '
      f'({data * fsdp}) of the mesh.'
    )

  def _state_shardings(self):
    if self.mesh is None:
      return None
    batch = self._batch_axes()
    # kv heads over the tensor axis when they split evenly.
    tensor = self.mesh.shape.get('tensor', 1)
    heads = self.model_config.num_kv_heads
    split_heads = tensor > 1 and heads % tensor == 0
    pool_spec = (batch, 'tensor') if split_heads else (batch,)
    while pool_spec and pool_spec[-1] is None:  # P() rather than P(None)
      pool_spec = pool_spec[:-1]
    pool = NamedSharding(self.mesh, P(*pool_spec))
    rest = NamedSharding(self.mesh, P() if batch is None else P(batch))
    fields = engine.DecodeState._fields
    return engine.DecodeState(
      **{f: rest for f in fields if f not in ('k_pages', 'v_pages')},
      k_pages=tuple(pool for _ in range(self.model_config.num_layers)),
      v_pages=tuple(pool for _ in range(self.model_config.num_layers)),
    )

  def _init_replicas(self):
    one = engine.init_state(self.model_config, self._rcfg)
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

  # Checks --------------------------------------------------------------------

  def _check(self, requests, group_size):
    cfg = self.cfg
    if not isinstance(group_size, int) or group_size < 1:
      raise ValueError(f'`group_size` must be a positive int, got {group_size!r}.')
    if group_size > cfg.num_slots:
      raise ValueError(f'`group_size` {group_size} exceeds `num_slots` {cfg.num_slots}.')
    if group_size > self.slots_per_replica:
      raise ValueError(
        f'`group_size` {group_size} exceeds the {self.slots_per_replica} slots of a replica '
        f'(`num_slots` {cfg.num_slots} / `replicas` {self.replicas}).'
      )
    vocab = self.model_config.vocab_size
    for i, r in enumerate(requests):
      n = len(r.prompt)
      if n < 1 or n > cfg.max_prompt_len:
        raise ValueError(
          f'request {i}: prompt length {n} must be in [1, max_prompt_len={cfg.max_prompt_len}].'
        )
      ids = np.asarray(r.prompt)
      if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f'request {i}: prompt token ids must be in [0, {vocab}).')
      max_new = r.per_sample('max_new_tokens', group_size)
      min_new = r.per_sample('min_new_tokens', group_size)
      for m in max_new:
        if not 1 <= m <= cfg.max_new_tokens:
          raise ValueError(
            f'request {i}: `max_new_tokens`={m} must be in '
            f'[1, {cfg.max_new_tokens}] (EngineConfig.max_new_tokens).'
          )
      for lo, hi in zip(min_new, max_new, strict=True):
        if not 0 <= lo <= hi:
          raise ValueError(f'request {i}: `min_new_tokens`={lo} must be in [0, max_new_tokens].')
      if len(r.stop_tokens) > cfg.max_stop_tokens:
        raise ValueError(
          f'request {i}: {len(r.stop_tokens)} stop tokens, more than '
          f'`max_stop_tokens`={cfg.max_stop_tokens}.'
        )
      bias = r.bias_items()
      if len(bias) > cfg.max_bias_tokens:
        raise ValueError(
          f'request {i}: {len(bias)} logit_bias / banned_tokens entries, more than '
          f'`max_bias_tokens`={cfg.max_bias_tokens}.'
        )
      if any(not 0 <= t < vocab or not np.isfinite(b) for t, b in bias):
        raise ValueError(
          f'request {i}: logit_bias / banned_tokens ids must be in [0, {vocab}) with finite biases.'
        )
      if len(r.stop_sequences) > cfg.max_stop_sequences:
        raise ValueError(
          f'request {i}: {len(r.stop_sequences)} stop sequences, more than '
          f'`max_stop_sequences`={cfg.max_stop_sequences}.'
        )
      for seq in r.stop_sequences:
        if not 1 <= len(seq) <= cfg.max_stop_len or not all(0 <= t < vocab for t in seq):
          raise ValueError(
            f'request {i}: stop sequence {list(seq)} must have 1 to '
            f'`max_stop_len`={cfg.max_stop_len} ids in [0, {vocab}).'
          )
      if not 0 <= int(r.seed) < 2**32:
        raise ValueError(f'request {i}: `seed` must be in [0, 2**32), got {r.seed}.')
      if not r.greedy and not r.temperature > 0:
        raise ValueError(f'request {i}: `temperature` must be > 0, got {r.temperature}.')
      if not 0 < r.top_p <= 1 or r.top_k < 0:
        raise ValueError(f'request {i}: need 0 < top_p <= 1 and top_k >= 0.')
      need = engine.group_pages(n, max_new, cfg.page_size)
      if need > cfg.num_pages - 1:
        raise ValueError(
          f'request {i} needs up to {need} pages (prompt {n}, max_new_tokens '
          f'{r.max_new_tokens}, group {group_size}) but the pool has '
          f'{cfg.num_pages - 1} usable pages: raise `num_pages`.'
        )

  def _slot_request(self, request, samples):
    """Per-slot settings as host arrays (one jitted call for the keys; eager
    JAX ops here cost milliseconds per request). `samples`: the sample
    indices g within the request's group."""
    cfg = self.cfg
    g = len(samples)
    rng = np.asarray(_sample_keys(np.uint32(request.seed), np.asarray(samples, np.uint32)))
    stop = np.full((g, cfg.max_stop_tokens), -1, np.int32)
    stop[:, : len(request.stop_tokens)] = np.asarray(request.stop_tokens, np.int32)
    bias = request.bias_items()
    bias_ids = np.full((g, cfg.max_bias_tokens), -1, np.int32)
    bias_values = np.zeros((g, cfg.max_bias_tokens), np.float32)
    bias_ids[:, : len(bias)] = [t for t, _ in bias]
    bias_values[:, : len(bias)] = [b for _, b in bias]
    seqs = np.full((g, cfg.max_stop_sequences, cfg.max_stop_len), -1, np.int32)
    for q, seq in enumerate(request.stop_sequences):
      seqs[:, q, cfg.max_stop_len - len(seq) :] = seq
    # An int for every sample, or one value per sample g of the group.
    pick = lambda v: np.asarray([v] * g if np.ndim(v) == 0 else [v[k] for k in samples], np.int32)
    max_new, min_new = pick(request.max_new_tokens), pick(request.min_new_tokens)
    return engine.SlotRequest(
      rng=rng.astype(np.uint32),
      temperature=np.full(g, request.temperature, np.float32),
      top_k=np.full(g, request.top_k, np.int32),
      top_p=np.full(g, request.top_p, np.float32),
      greedy=np.full(g, request.greedy, bool),
      stop_tokens=stop,
      max_new=max_new,
      min_new=min_new,
      bias_ids=bias_ids,
      bias_values=bias_values,
      stop_seqs=seqs,
    )

  def _compact(self, state, index_RxSc):
    """`engine.compact` per replica: the per-slot fields of the slots in
    `index_RxSc` (local ids), the pools as they are."""
    slots = {f: getattr(state, f) for f in state._fields if f not in engine.POOL_FIELDS}
    return state._replace(**self._take_slots(slots, index_RxSc))

  def _admit_round(self, params, state, admitted, truncate, max_batch):
    """One prefill call for the groups admitted this round.

    `admitted[r]`: [(request, prompt length, local slots, SlotRequest)] for
    replica r. Rows are padded to a power-of-two batch and one bucket length.
    """
    r_count = self.replicas
    # Power-of-two batch sizes: a refill of a few groups costs a few prefills
    # (not `max_batch`), and at most log2(max_batch) + 1 programs compile.
    b = min(max_batch, _pow2_at_least(max(len(rows) for rows in admitted)))
    pb = self.bucket(max(n for rows in admitted for _, n, _, _ in rows))
    g = len(next(rows for rows in admitted if rows)[0][2])
    tokens = np.zeros((r_count, b, pb), np.int32)
    lengths = np.ones((r_count, b), np.int32)
    slots = np.tile(np.arange(g, dtype=np.int32), (r_count, b, 1))
    valid = np.zeros((r_count, b), bool)
    template = next(rows for rows in admitted if rows)[0][3]
    request = jax.tree.map(lambda x: np.broadcast_to(x, (r_count, b, *x.shape)).copy(), template)
    for r, rows in enumerate(admitted):
      for j, (req, n, local, slot_request) in enumerate(rows):
        tokens[r, j, :n] = req.prompt
        lengths[r, j] = n
        slots[r, j] = local
        valid[r, j] = True
        for field, value in zip(request, slot_request, strict=True):
          field[r, j] = value
    num_chunks = np.int32(-(-int(lengths.max()) // (self.prefill_chunk or pb)))
    return self._admit(
      params, state, tokens, lengths, slots, request, valid, num_chunks, truncate=truncate
    )

  # The loop ------------------------------------------------------------------

  def generate(
    self, params, requests, *, group_size=1, share_prompt=True, state=None, on_turn_end=None
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
      on_turn_end: multi-turn. Called as `on_turn_end(i, g, tokens)` when
        sample g of request i stops on one of its stop tokens (`tokens`:
        everything after the prompt so far, the stop token last). It
        returns environment tokens to append (the sample then continues on
        its cached pages: the tokens are fed through the decode loop, the
        prefix is not recomputed), or a finish reason (str) to end the
        sample. Environment tokens count towards `max_new_tokens` and must
        fit `EngineConfig.max_forced_tokens`.

    Returns:
      [len(requests)][G] Completion, in request order.

    Whole groups go to one replica each (their samples share the prompt's
    pages), the one with the most idle slots among those with room; every
    round of admissions is one prefill call over all replicas.
    """
    requests = list(requests)
    self._check(requests, group_size)
    cfg = self.cfg
    self.stats = stats = SamplerStats()
    state = self.init_state() if state is None else state
    truncate = any((r.top_k > 0 or r.top_p < 1.0) and not r.greedy for r in requests)
    capacity = cfg.num_pages - 1  # per replica
    num_r = self.replicas
    sr = self.slots_per_replica  # slots per replica (fewer after a compaction)
    max_new = [r.per_sample('max_new_tokens', group_size) for r in requests]
    per_group = group_size if share_prompt else 1
    max_batch = min(self.max_prefill_batch, sr // per_group)  # groups per prefill call
    pending = collections.deque()
    for i in range(len(requests)):
      if share_prompt:
        pending.append((i, tuple(range(group_size))))
      else:
        pending.extend((i, (g,)) for g in range(group_size))
    results = [[None] * group_size for _ in requests]
    free_slots = [list(range(sr)) for _ in range(num_r)]  # local slot ids per replica
    reserved = [0] * num_r
    slot_owner = {}  # global slot r·sr + j -> (request, sample, group id, private pages)
    groups = {}  # group id -> [replica, shared pages, samples left]
    next_group = 0
    held_pages = np.zeros(num_r * sr, np.int32)  # host copy of state.num_pages
    env_spans = collections.defaultdict(list)  # slot -> [(start, end)] of environment tokens
    generated = np.zeros(num_r * sr, np.int64)  # host copy of state.num_generated

    while pending or slot_owner:
      # Admit what fits, in order, each group into the replica with most idle slots.
      admitted = [[] for _ in range(num_r)]
      while pending:
        i, samples = pending[0]
        r = requests[i]
        n = len(r.prompt)
        news = [max_new[i][g] for g in samples]
        need = engine.group_pages(n, news, cfg.page_size)
        fits = [
          k
          for k in range(num_r)
          if len(free_slots[k]) >= len(samples)
          and reserved[k] + need <= capacity
          and len(admitted[k]) < max_batch
        ]
        if not fits:
          break
        k = max(fits, key=lambda k: (len(free_slots[k]), -k))
        pending.popleft()
        local = [free_slots[k].pop(0) for _ in samples]
        admitted[k].append((r, n, local, self._slot_request(r, samples)))
        reserved[k] += need
        shared = n // cfg.page_size
        groups[next_group] = [k, shared, len(samples)]
        for j, g, m in zip(local, samples, news, strict=True):
          slot = k * sr + j
          private = -(-(n + m - 1) // cfg.page_size) - shared
          slot_owner[slot] = (i, g, next_group, private)
          held_pages[slot] = -(-n // cfg.page_size)
          generated[slot] = 1  # insert samples the first token
        next_group += 1
      if any(admitted):
        start = time.perf_counter()
        t_start = self.tracer.now()
        state = self._admit_round(params, state, admitted, truncate, max_batch)
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

      # Finished slots cost nothing: with the queue empty, keep the live slots only.
      if self.compaction and not pending and slot_owner:
        live = [[s % sr for s in slot_owner if s // sr == k] for k in range(num_r)]
        target = _pow2_at_least(max(len(x) for x in live))
        if target <= sr // 4:  # a 4x cut at least: few compiled slot counts
          index = np.zeros((num_r, target), np.int32)
          remap = {}
          for k in range(num_r):
            keep = sorted(live[k])
            idle = [j for j in range(sr) if j not in set(keep)]
            index[k] = keep + idle[: target - len(keep)]
            for new, old in enumerate(keep):
              remap[k * sr + old] = k * target + new
          state = self._compact(state, index)
          flat = (np.arange(num_r)[:, None] * sr + index).reshape(-1)
          held_pages, generated = held_pages[flat], generated[flat]
          slot_owner = {remap[s]: v for s, v in slot_owner.items()}
          env_spans = collections.defaultdict(list, {remap[s]: v for s, v in env_spans.items()})
          sr = target
          free_slots = [
            [j for j in range(sr) if k * sr + j not in slot_owner] for k in range(num_r)
          ]
          stats.compactions += 1

      start = time.perf_counter()
      t_start = self.tracer.now()
      active = len(slot_owner)
      max_pages = engine.attend_pages(held_pages, self.steps_per_dispatch, cfg)
      state = self._generate(
        params,
        state,
        num_steps=self.steps_per_dispatch,
        max_pages=max_pages,
        truncate=truncate,
      )
      done, free_top, held, gen = (
        np.asarray(a).reshape(-1)
        for a in jax.device_get((state.done, state.free_top, state.num_pages, state.num_generated))
      )
      held_pages = np.array(held)
      gen = np.asarray(gen, np.int64)
      steps_run = int(max(0, (gen - generated).max()))  # the loop stops when no slot is live
      generated = gen
      stats.decode_seconds += time.perf_counter() - start
      self.tracer.add(
        'decode',
        t_start,
        self.tracer.now(),
        'sampler',
        active=active,
        steps=steps_run,
        max_pages=int(max_pages),
      )
      stats.dispatches += 1
      stats.peak_pages = max(stats.peak_pages, int(np.sum(capacity - free_top)))

      finished = [s for s in slot_owner if done[s]]
      if not finished:
        continue
      # Whole [R, S/R, ...] arrays, indexed on the host: indexing on the device
      # would compile one gather per number of finished slots.
      idx = np.asarray(finished)
      out_tokens, out_logp, num_gen, reasons = (
        np.asarray(a).reshape(num_r * sr, *np.shape(a)[2:])[idx]
        for a in jax.device_get(
          (state.out_tokens, state.out_logprobs, state.num_generated, state.finish_reason)
        )
      )
      continuing = {}
      for row, slot in enumerate(finished):
        i, g, group, private = slot_owner[slot]
        n_out = int(num_gen[row])
        reason = engine.FINISH_REASONS[int(reasons[row])]
        if on_turn_end is not None and reason == 'stop':
          answer = on_turn_end(i, g, out_tokens[row, :n_out].copy())
          if not isinstance(answer, str):
            env = list(answer)
            room = max_new[i][g] - n_out - 1  # one model token after them
            if len(env) > cfg.max_forced_tokens or len(env) > room:
              reason = 'length'
            else:
              continuing[slot] = env
              env_spans[slot].append((n_out, n_out + len(env)))
              continue
          else:
            reason = answer
        slot_owner.pop(slot)
        env_mask = None
        if on_turn_end is not None:
          env_mask = np.zeros(n_out, bool)
          for a, b in env_spans.pop(slot, []):
            env_mask[a:b] = True
        results[i][g] = Completion(
          tokens=out_tokens[row, :n_out].copy(),
          logprobs=out_logp[row, :n_out].copy(),
          finish_reason=reason,
          env_mask=env_mask,
        )
        stats.generated_tokens += n_out
        k, shared, left = groups[group]
        reserved[k] -= private
        if left == 1:
          reserved[k] -= shared
          del groups[group]
        else:
          groups[group][2] = left - 1
      if continuing:
        f = max(1, cfg.max_forced_tokens)
        forced = np.zeros((num_r * sr, f), np.int32)
        forced_len = np.zeros(num_r * sr, np.int32)
        resume_mask = np.zeros(num_r * sr, bool)
        for slot, env in continuing.items():
          forced[slot, : len(env)] = env
          forced_len[slot] = len(env)
          resume_mask[slot] = True
        state = self._resume(
          state,
          resume_mask.reshape(num_r, sr),
          forced.reshape(num_r, sr, f),
          forced_len.reshape(num_r, sr),
        )
        stats.env_turns += len(continuing)
      finished = [s for s in finished if s not in continuing]
      if not finished:
        continue
      mask = np.zeros(num_r * sr, bool)
      mask[finished] = True
      state = self._free(state, mask.reshape(num_r, sr))
      for slot in finished:
        free_slots[slot // sr].append(slot % sr)
    self.last_state = state
    return results


def to_rollout_batch(groups, max_new_tokens):
  """Pads completions ([B][G] Completion) into RolloutBatch arrays of width T."""
  flat = [c for group in groups for c in group]
  n = len(flat)
  tokens = np.zeros((n, max_new_tokens), np.int32)
  logprobs = np.zeros((n, max_new_tokens), np.float32)
  mask = np.zeros((n, max_new_tokens), bool)
  for row, c in enumerate(flat):
    k = len(c.tokens)
    tokens[row, :k] = c.tokens
    logprobs[row, :k] = c.logprobs
    mask[row, :k] = True
  return RolloutBatch(tokens, logprobs, mask, [c.finish_reason for c in flat])
