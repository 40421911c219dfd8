"""The host-side driver: a request queue, continuous batching, GRPO groups.

    sampler = Sampler(graphdef, model_config, EngineConfig(...))
    groups = sampler.generate(params, requests, group_size=8)   # [B][G] Completion
    batch = to_rollout_batch(groups, max_new_tokens)             # arrays for the trainer

`params` is the trainer's parameter pytree, passed as it is (never donated
or copied), with whatever sharding it has. Each call runs the queue to
completion: prompts are prefilled one at a time (padded to a bucket length,
so only a few shapes compile), inserted into free slots, decoded
`steps_per_dispatch` tokens per jitted call, and finished slots are freed and
refilled from the queue between dispatches.

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
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jrl import trace
from jrl.sampler import engine
from jrl.sampler.engine import EngineConfig


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt and how to sample from it."""

  prompt: Sequence[int]  # token ids
  max_new_tokens: int  # ≤ EngineConfig.max_new_tokens
  temperature: float = 1.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  greedy: bool = False
  stop_tokens: Sequence[int] = ()  # ≤ EngineConfig.max_stop_tokens ids
  seed: int = 0


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


class Sampler:
  """Paged, continuously batched sampling on explicit parameters."""

  def __init__(
    self,
    graphdef,
    model_config,
    engine_config: EngineConfig,
    *,
    steps_per_dispatch=8,
    prefill_buckets=None,
    mesh=None,
  ):
    engine_config.validate()
    if steps_per_dispatch < 1:
      raise ValueError(f'`steps_per_dispatch` must be >= 1, got {steps_per_dispatch}.')
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
    self.mesh = mesh
    self.stats = SamplerStats()
    self.tracer = trace.NULL  # the controller sets its own to record prefill/decode spans
    cfg = engine_config
    self._prefill = jax.jit(functools.partial(engine.prefill, graphdef))
    self._insert = jax.jit(functools.partial(engine.insert, cfg=cfg), donate_argnums=(0,))
    self._generate = jax.jit(
      functools.partial(engine.generate, graphdef, cfg=cfg),
      static_argnames=('num_steps', 'max_pages'),
      donate_argnums=(1,),
    )
    self._free = jax.jit(engine.free, donate_argnums=(0,))
    self._resume = jax.jit(engine.resume, donate_argnums=(0,))

  # State ---------------------------------------------------------------------

  def init_state(self):
    state = engine.init_state(self.model_config, self.cfg)
    if self.mesh is None:
      return state
    # kv heads over the tensor axis when they split evenly; everything else replicated.
    tensor = self.mesh.shape.get('tensor', 1)
    heads = self.model_config.num_kv_heads
    pool_spec = P('tensor') if tensor > 1 and heads % tensor == 0 else P()
    pool = NamedSharding(self.mesh, pool_spec)
    rep = NamedSharding(self.mesh, P())
    shardings = state._replace(
      k_pages=tuple(pool for _ in state.k_pages),
      v_pages=tuple(pool for _ in state.v_pages),
      **{
        f: jax.tree.map(lambda _: rep, getattr(state, f))
        for f in state._fields
        if f not in ('k_pages', 'v_pages')
      },
    )
    return jax.device_put(state, shardings)

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
      if not 1 <= r.max_new_tokens <= cfg.max_new_tokens:
        raise ValueError(
          f'request {i}: `max_new_tokens`={r.max_new_tokens} must be in '
          f'[1, {cfg.max_new_tokens}] (EngineConfig.max_new_tokens).'
        )
      if len(r.stop_tokens) > cfg.max_stop_tokens:
        raise ValueError(
          f'request {i}: {len(r.stop_tokens)} stop tokens, more than '
          f'`max_stop_tokens`={cfg.max_stop_tokens}.'
        )
      if not 0 <= int(r.seed) < 2**32:
        raise ValueError(f'request {i}: `seed` must be in [0, 2**32), got {r.seed}.')
      if not r.greedy and not r.temperature > 0:
        raise ValueError(f'request {i}: `temperature` must be > 0, got {r.temperature}.')
      if not 0 < r.top_p <= 1 or r.top_k < 0:
        raise ValueError(f'request {i}: need 0 < top_p <= 1 and top_k >= 0.')
      need = engine.pages_needed(n, r.max_new_tokens, group_size, cfg.page_size)
      if need > cfg.num_pages - 1:
        raise ValueError(
          f'request {i} needs up to {need} pages (prompt {n}, max_new_tokens '
          f'{r.max_new_tokens}, group {group_size}) but the pool has '
          f'{cfg.num_pages - 1} usable pages: raise `num_pages`.'
        )

  def _slot_request(self, request, samples):
    """Per-slot settings as host arrays (one jitted call for the keys; eager
    JAX ops here cost milliseconds per request)."""
    cfg = self.cfg
    g = len(samples)
    rng = np.asarray(_sample_keys(np.uint32(request.seed), np.asarray(samples, np.uint32)))
    stop = np.full((g, cfg.max_stop_tokens), -1, np.int32)
    stop[:, : len(request.stop_tokens)] = np.asarray(request.stop_tokens, np.int32)
    return engine.SlotRequest(
      rng=rng.astype(np.uint32),
      temperature=np.full(g, request.temperature, np.float32),
      top_k=np.full(g, request.top_k, np.int32),
      top_p=np.full(g, request.top_p, np.float32),
      greedy=np.full(g, request.greedy, bool),
      stop_tokens=stop,
      max_new=np.full(g, request.max_new_tokens, np.int32),
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
      state: a DecodeState to start from (default: a fresh one).
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
    """
    requests = list(requests)
    self._check(requests, group_size)
    cfg = self.cfg
    self.stats = stats = SamplerStats()
    state = self.init_state() if state is None else state
    capacity = cfg.num_pages - 1
    pending = collections.deque()
    for i in range(len(requests)):
      if share_prompt:
        pending.append((i, tuple(range(group_size))))
      else:
        pending.extend((i, (g,)) for g in range(group_size))
    results = [[None] * group_size for _ in requests]
    free_slots = list(range(cfg.num_slots))
    slot_owner = {}  # slot -> (request index, sample index, group id)
    groups = {}  # group id -> [shared pages, private pages per slot, slots left]
    reserved = 0
    next_group = 0
    held_pages = np.zeros(cfg.num_slots, np.int32)  # host copy of state.num_pages
    env_spans = collections.defaultdict(list)  # slot -> [(start, end)] of environment tokens
    generated = np.zeros(cfg.num_slots, np.int64)  # host copy of state.num_generated

    while pending or slot_owner:
      # Admit what fits, in order.
      while pending:
        i, samples = pending[0]
        r = requests[i]
        n = len(r.prompt)
        need = engine.pages_needed(n, r.max_new_tokens, len(samples), cfg.page_size)
        if len(free_slots) < len(samples) or reserved + need > capacity:
          break
        pending.popleft()
        start = time.perf_counter()
        t_start = self.tracer.now()
        pb = self.bucket(n)
        tokens = np.zeros(pb, np.int32)
        tokens[:n] = r.prompt
        prefix = self._prefill(params, jnp.asarray(tokens), jnp.int32(n))
        slots = [free_slots.pop(0) for _ in samples]
        state = self._insert(
          state, prefix, jnp.asarray(slots, jnp.int32), self._slot_request(r, samples)
        )
        stats.prefill_seconds += time.perf_counter() - start
        t_end = self.tracer.now()
        self.tracer.add('prefill', t_start, t_end, 'sampler', tokens=n, samples=len(samples))
        stats.prefills += 1
        reserved += need
        shared = n // cfg.page_size
        groups[next_group] = [shared, (need - shared) // len(samples), len(samples)]
        for slot, g in zip(slots, samples, strict=True):
          slot_owner[slot] = (i, g, next_group)
          held_pages[slot] = -(-n // cfg.page_size)
          generated[slot] = 1  # insert samples the first token
        next_group += 1

      start = time.perf_counter()
      t_start = self.tracer.now()
      active = len(slot_owner)
      max_pages = engine.attend_pages(held_pages, self.steps_per_dispatch, cfg)
      state = self._generate(params, state, num_steps=self.steps_per_dispatch, max_pages=max_pages)
      done, free_top, held, gen = jax.device_get(
        (state.done, state.free_top, state.num_pages, state.num_generated)
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
      stats.peak_pages = max(stats.peak_pages, capacity - int(free_top))

      finished = [s for s in slot_owner if done[s]]
      if not finished:
        continue
      # Whole [S, ...] arrays, indexed on the host: indexing on the device would
      # compile one gather per number of finished slots.
      idx = np.asarray(finished)
      out_tokens, out_logp, num_gen, reasons = (
        np.asarray(a)[idx]
        for a in jax.device_get(
          (state.out_tokens, state.out_logprobs, state.num_generated, state.finish_reason)
        )
      )
      continuing = {}
      for row, slot in enumerate(finished):
        i, g, group = slot_owner[slot]
        n_out = int(num_gen[row])
        reason = engine.FINISH_REASONS[int(reasons[row])]
        if on_turn_end is not None and reason == 'stop':
          answer = on_turn_end(i, g, out_tokens[row, :n_out].copy())
          if not isinstance(answer, str):
            env = list(answer)
            room = requests[i].max_new_tokens - n_out - 1  # one model token after them
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
        shared, private, left = groups[group]
        reserved -= private
        if left == 1:
          reserved -= shared
          del groups[group]
        else:
          groups[group][2] = left - 1
      if continuing:
        f = max(1, cfg.max_forced_tokens)
        forced = np.zeros((cfg.num_slots, f), np.int32)
        forced_len = np.zeros(cfg.num_slots, np.int32)
        resume_mask = np.zeros(cfg.num_slots, bool)
        for slot, env in continuing.items():
          forced[slot, : len(env)] = env
          forced_len[slot] = len(env)
          resume_mask[slot] = True
        state = self._resume(
          state, jnp.asarray(resume_mask), jnp.asarray(forced), jnp.asarray(forced_len)
        )
        stats.env_turns += len(continuing)
      finished = [s for s in finished if s not in continuing]
      if not finished:
        continue
      mask = np.zeros(cfg.num_slots, bool)
      mask[finished] = True
      state = self._free(state, jnp.asarray(mask))
      free_slots.extend(finished)
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
