"""The decode state: static sizes (`SamplerConfig`), the pytree the decode loop
carries (`DecodeState`), a prefilled prompt (`Prefix`), per-slot settings
(`SlotRequest`), an empty state (`init_state`) and its layout on a mesh
(`state_shardings`).

Per layer a page pool [K, N, P, d] for keys and one for values, an int32
page table per slot, per-page reference counts, a stack of free pages, and
per-slot sampling state. Page 0 is a scratch page that is never allocated:
unused page-table entries and the writes of idle slots point at it.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jrl.sampler import attention as paged

RUNNING, STOP, LENGTH = 0, 1, 2
FINISH_REASONS = {RUNNING: 'running', STOP: 'stop', LENGTH: 'length'}


class SamplerConfig(NamedTuple):
  """Static sizes of the decode state."""

  num_slots: int  # S: sequences decoded together
  num_pages: int  # N: pages per layer, page 0 being the scratch page
  page_size: int  # P: tokens per page
  max_prompt_len: int  # longest prompt accepted
  max_new_tokens: int  # longest completion (requests may ask for fewer)
  max_stop_tokens: int = 4  # stop tokens per request
  attention_impl: str = 'auto'  # 'auto' | 'gather' | 'pallas_gpu' | 'pallas_tpu'
  max_forced_tokens: int = 1  # longest environment turn appended by `resume` (multi-turn)
  max_bias_tokens: int = 8  # Kb: logit-bias and banned-token entries per request
  max_stop_sequences: int = 2  # Q: multi-token stop sequences per request
  max_stop_len: int = 4  # Ls: tokens per stop sequence

  @property
  def max_pages_per_slot(self):
    # The last sampled token is never written to the cache.
    return math.ceil((self.max_prompt_len + self.max_new_tokens - 1) / self.page_size)

  @property
  def max_prompt_pages(self):
    return math.ceil(self.max_prompt_len / self.page_size)

  def validate(self):
    for name in (
      'num_slots',
      'num_pages',
      'page_size',
      'max_prompt_len',
      'max_new_tokens',
      'max_bias_tokens',
      'max_stop_sequences',
      'max_stop_len',
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f'`{name}` must be a positive int, got {value!r}.')
    if self.num_pages < 2:
      raise ValueError(f'`num_pages` must be >= 2 (page 0 is scratch), got {self.num_pages}.')
    paged.resolve_impl(self.attention_impl, self.page_size)


class DecodeState(NamedTuple):
  """Everything the decode loop carries. S slots, N pages, M pages per slot."""

  k_pages: tuple  # L × [K, N, P, d]
  v_pages: tuple  # L × [K, N, P, d]
  page_table: jax.Array  # [S, M] int32; entries past num_pages are 0 (scratch)
  num_pages: jax.Array  # [S] int32 pages held by each slot
  lengths: jax.Array  # [S] int32 tokens in each slot's cache
  refcount: jax.Array  # [N] int32
  free_stack: jax.Array  # [N] int32; free page ids in [0, free_top)
  free_top: jax.Array  # [] int32
  active: jax.Array  # [S] bool: the slot holds a sequence
  done: jax.Array  # [S] bool: that sequence has finished
  finish_reason: jax.Array  # [S] int32 (RUNNING, STOP, LENGTH)
  next_token: jax.Array  # [S] int32: last sampled token, not yet in the cache
  rng: jax.Array  # [S, 2] uint32 raw key data, advanced once per sampled token
  temperature: jax.Array  # [S] float32
  top_k: jax.Array  # [S] int32
  top_p: jax.Array  # [S] float32
  greedy: jax.Array  # [S] bool
  stop_tokens: jax.Array  # [S, max_stop_tokens] int32, −1 padded
  max_new: jax.Array  # [S] int32
  num_generated: jax.Array  # [S] int32
  out_tokens: jax.Array  # [S, max_new_tokens] int32
  out_logprobs: jax.Array  # [S, max_new_tokens] float32
  # Multi-turn: environment tokens fed through the decode loop in place of
  # sampled ones (written to the cache, recorded with logprob 0, never a stop).
  forced: jax.Array  # [S, max_forced_tokens] int32
  forced_len: jax.Array  # [S] int32
  forced_at: jax.Array  # [S] int32: forced tokens already fed
  min_new: jax.Array  # [S] int32: stop tokens forbidden while num_generated < min_new
  bias_ids: jax.Array  # [S, Kb] int32 token ids, −1 padded
  bias_values: jax.Array  # [S, Kb] float32 added to those logits (−1e30: banned)
  stop_seqs: jax.Array  # [S, Q, Ls] int32 stop sequences, right-aligned, −1 padded
  recent: jax.Array  # [S, Ls] int32 the slot's last Ls tokens (−2 before its first)


class Prefix(NamedTuple):
  """A prefilled prompt: its keys and values and the logits after it (with a
  leading [B] axis on every field when it comes from `prefill_batch`)."""

  k: jax.Array  # [L, K, Pb, d]
  v: jax.Array  # [L, K, Pb, d]
  logits: jax.Array  # [V] float32 at the last prompt token
  length: jax.Array  # [] int32 prompt length (≤ Pb)


class SlotRequest(NamedTuple):
  """Per-slot settings for `insert`, each with a leading [G] axis."""

  rng: jax.Array  # [G, 2] uint32 key data
  temperature: jax.Array  # [G] float32
  top_k: jax.Array  # [G] int32
  top_p: jax.Array  # [G] float32
  greedy: jax.Array  # [G] bool
  stop_tokens: jax.Array  # [G, max_stop_tokens] int32
  max_new: jax.Array  # [G] int32
  min_new: jax.Array  # [G] int32
  bias_ids: jax.Array  # [G, Kb] int32, −1 padded
  bias_values: jax.Array  # [G, Kb] float32
  stop_seqs: jax.Array  # [G, Q, Ls] int32, right-aligned, −1 padded


NO_TOKEN = -2  # `recent` before a slot's first token: equals no stop-sequence entry


def init_state(model_config, cfg):
  """An empty decode state (every page free, every slot idle)."""
  cfg.validate()
  s, n, p, m = cfg.num_slots, cfg.num_pages, cfg.page_size, cfg.max_pages_per_slot
  pool_shape = (model_config.num_kv_heads, n, p, model_config.head_dim)
  dtype = model_config.compute_jnp_dtype
  zeros_pool = lambda: tuple(jnp.zeros(pool_shape, dtype) for _ in range(model_config.num_layers))
  # Free pages 1..N−1, popped from the top in increasing order.
  free_stack = jnp.concatenate([jnp.arange(n - 1, 0, -1), jnp.zeros(1)]).astype(jnp.int32)
  return DecodeState(
    k_pages=zeros_pool(),
    v_pages=zeros_pool(),
    page_table=jnp.zeros((s, m), jnp.int32),
    num_pages=jnp.zeros(s, jnp.int32),
    lengths=jnp.zeros(s, jnp.int32),
    refcount=jnp.zeros(n, jnp.int32),
    free_stack=free_stack,
    free_top=jnp.int32(n - 1),
    active=jnp.zeros(s, bool),
    done=jnp.zeros(s, bool),
    finish_reason=jnp.zeros(s, jnp.int32),
    next_token=jnp.zeros(s, jnp.int32),
    rng=jnp.zeros((s, 2), jnp.uint32),
    temperature=jnp.ones(s, jnp.float32),
    top_k=jnp.zeros(s, jnp.int32),
    top_p=jnp.ones(s, jnp.float32),
    greedy=jnp.zeros(s, bool),
    stop_tokens=jnp.full((s, cfg.max_stop_tokens), -1, jnp.int32),
    max_new=jnp.zeros(s, jnp.int32),
    num_generated=jnp.zeros(s, jnp.int32),
    out_tokens=jnp.zeros((s, cfg.max_new_tokens), jnp.int32),
    out_logprobs=jnp.zeros((s, cfg.max_new_tokens), jnp.float32),
    forced=jnp.zeros((s, max(1, cfg.max_forced_tokens)), jnp.int32),
    forced_len=jnp.zeros(s, jnp.int32),
    forced_at=jnp.zeros(s, jnp.int32),
    min_new=jnp.zeros(s, jnp.int32),
    bias_ids=jnp.full((s, cfg.max_bias_tokens), -1, jnp.int32),
    bias_values=jnp.zeros((s, cfg.max_bias_tokens), jnp.float32),
    stop_seqs=jnp.full((s, cfg.max_stop_sequences, cfg.max_stop_len), -1, jnp.int32),
    recent=jnp.full((s, cfg.max_stop_len), NO_TOKEN, jnp.int32),
  )


# Shared by every slot: `generate_slots` passes them through whole.
POOL_FIELDS = ('k_pages', 'v_pages', 'refcount', 'free_stack', 'free_top')


def batch_axes(mesh, replicas):
  """Mesh axes the [R] replica axis is split over (None: not split)."""
  if mesh is None or replicas == 1:
    return None
  shape = mesh.shape
  data, fsdp = shape.get('data', 1), shape.get('fsdp', 1)
  if replicas == data:
    return 'data'
  if replicas == data * fsdp:
    return ('data', 'fsdp')
  raise ValueError(
    f'`replicas`={replicas} must be 1, the data axis ({data}) or data x fsdp '
    f'({data * fsdp}) of the mesh.'
  )


def state_shardings(mesh, replicas, model_config):
  """A DecodeState of NamedShardings for a state with a leading [R] replica
  axis on every field (None without a mesh)."""
  if mesh is None:
    return None
  batch = batch_axes(mesh, replicas)
  # kv heads over the tensor axis when they split evenly.
  tensor = mesh.shape.get('tensor', 1)
  heads = model_config.num_kv_heads
  split_heads = tensor > 1 and heads % tensor == 0
  pool_spec = (batch, 'tensor') if split_heads else (batch,)
  while pool_spec and pool_spec[-1] is None:  # P() rather than P(None)
    pool_spec = pool_spec[:-1]
  pool = NamedSharding(mesh, P(*pool_spec))
  rest = NamedSharding(mesh, P() if batch is None else P(batch))
  fields = DecodeState._fields
  return DecodeState(
    **{f: rest for f in fields if f not in ('k_pages', 'v_pages')},
    k_pages=tuple(pool for _ in range(model_config.num_layers)),
    v_pages=tuple(pool for _ in range(model_config.num_layers)),
  )
