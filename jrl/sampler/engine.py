"""The paged decode engine: pure, jittable steps on an explicit state.

Following JetStream's engine convention, parameters are passed explicitly to
every call and the engine holds no weights:

    prefix = prefill(graphdef, params, tokens, length)     one prompt
    state  = insert(state, prefix, slots, ...)             into G free slots
    state  = admit(graphdef, params, state, ...)           B prompts: prefill_batch + insert_batch
    state  = generate(graphdef, params, state, steps)      several decode steps
    state  = free(state, slot_mask)                        release finished slots
    state  = compact(state, index)                         keep some slots, drop the rest

The state is a pytree of static-shape arrays (`DecodeState`): per layer a
page pool [K, N, P, d] for keys and one for values, an int32 page table per
slot, per-page reference counts, a stack of free pages, and per-slot
sampling state. Page 0 is a scratch page that is never allocated: unused
page-table entries and the writes of idle slots point at it.

GRPO prompt sharing: `insert` puts the G samples of one prompt in G slots
that point at the same full prompt pages (reference count G); each slot gets
a private copy of the partial last page, so no slot ever writes into a
shared page. The G first tokens are drawn from the one set of prefill logits,
each with the slot's own key.

Batched and chunked prefill: `prefill_batch` runs B prompts padded to one
bucket length Pb in one call; with `chunk` C < Pb it runs them C tokens at a
time, each chunk attending to the keys and values of the chunks before it
(kept in a [B, Pb] buffer), so activations are bounded by C tokens. Both
give the keys, values and logits of one-at-a-time prefill (tested to 1e-5).

Per-sample controls, all traced (one compiled step serves every setting): a
sparse logit bias per slot (banned tokens are a bias of −1e30), a minimum
number of new tokens before which the slot's stop tokens are forbidden (their
logits −1e30) and its stop sequences are not honoured, and up to Q stop
sequences of up to Ls tokens matched against the last Ls tokens of the slot
(right-aligned, −1 padded). Logprobs are taken under the distribution sampled
from, so with a bias they are those of the biased logits.

Page growth happens inside `generate`: a slot whose next token starts a new
page pops one from the free stack. The host driver (`jrl.sampler.Sampler`)
only admits a request when its worst case fits in the pages not yet
promised to others, so the stack never runs dry mid-decode.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jrl.models.attention import attention_options, dot_attention, within_window
from jrl.sampler import attention as paged
from jrl.sampler.sampling import _NEG, SamplingParams, sample

RUNNING, STOP, LENGTH = 0, 1, 2
FINISH_REASONS = {RUNNING: 'running', STOP: 'stop', LENGTH: 'length'}


class EngineConfig(NamedTuple):
  """Static sizes of the decode state."""

  num_slots: int  # S: sequences decoded together
  num_pages: int  # N: pages per layer, page 0 being the scratch page
  page_size: int  # P: tokens per page
  max_prompt_len: int  # longest prompt accepted
  max_new_tokens: int  # longest completion (requests may ask for fewer)
  max_stop_tokens: int = 4  # stop tokens per request
  attention_impl: str = 'auto'  # 'auto' | 'gather' | 'pallas'
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
    paged.resolve_impl(self.attention_impl)


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


def _logits(model, hidden_NxD):
  # Logits in float32 (soft-capped as the trainer's when the model says so).
  return model.logits(hidden_NxD)


def prefill_batch(graphdef, params, tokens_BxPb, lengths_B, chunk=None, num_chunks=None):
  """Runs B prompts (each padded on the right to one bucket length Pb) through
  the model, `chunk` tokens at a time.

  Chunk c covers positions [c·C, (c + 1)·C): its keys and values are written
  into a [B, Pb] buffer per layer, and its queries attend to the buffer with
  key ≤ query and key < length (or key = query, so a padding query is never
  empty), which is the mask of a one-pass prefill. Masked keys weigh exactly
  0, so chunking changes only the summation order.

  Args:
    graphdef, params: the policy, as the trainer holds it.
    tokens_BxPb: int32 prompts, padded on the right.
    lengths_B: int32 true lengths, 1 ≤ length ≤ Pb.
    chunk: static tokens per chunk C (None or ≥ Pb: one pass); Pb % C == 0.
    num_chunks: [] int32, traced: run only the first chunks (default all
      Pb / C). Every prompt must end inside them. One compiled program then
      serves every prompt length, at a cost that follows the longest.

  Returns:
    Prefix with a leading [B] axis: k, v [B, L, K, Pb, d], logits [B, V]
    float32 at each prompt's last token, length [B].
  """
  model = nnx.merge(graphdef, params)
  mc = model.config
  b, pb = tokens_BxPb.shape
  c = pb if not chunk or chunk >= pb else int(chunk)
  if pb % c:
    raise ValueError(f'prefill bucket {pb} is not a multiple of the chunk {c}.')
  lengths_B = jnp.asarray(lengths_B, jnp.int32)
  key_pos_Pb = jnp.arange(pb, dtype=jnp.int32)
  key_valid_BxPb = key_pos_Pb[None, :] < lengths_B[:, None]
  dtype = mc.compute_jnp_dtype
  buf = lambda: jnp.zeros((b, pb, mc.num_kv_heads, mc.head_dim), dtype)

  def run_chunk(start, caches, last_BxD):
    tokens_BxC = jax.lax.dynamic_slice_in_dim(tokens_BxPb, start, c, axis=1)
    pos_C = start + jnp.arange(c, dtype=jnp.int32)
    positions_BxC = jnp.broadcast_to(pos_C[None], (b, c))
    causal_CxPb = key_pos_Pb[None, :] <= pos_C[:, None]
    self_CxPb = key_pos_Pb[None, :] == pos_C[:, None]
    allowed_BxCxPb = causal_CxPb[None] & (key_valid_BxPb[:, None, :] | self_CxPb[None])

    def attend(layer, q, k, v, cache):
      k_buf, v_buf = cache
      k_buf = jax.lax.dynamic_update_slice_in_dim(k_buf, k.astype(dtype), start, axis=1)
      v_buf = jax.lax.dynamic_update_slice_in_dim(v_buf, v.astype(dtype), start, axis=1)
      opts = attention_options(mc, layer)
      mask = allowed_BxCxPb
      if opts.window is not None:
        inside = within_window(pos_C[:, None], key_pos_Pb[None, :], opts.window)
        mask = mask & (inside | self_CxPb)[None]
      out = dot_attention(q, k_buf, v_buf, mask, scale=opts.scale, softcap=opts.softcap)
      return out, (k_buf, v_buf)

    hidden_BxCxD, caches = model(tokens_BxC, positions_BxC, attend, caches=caches)
    at_B = lengths_B - 1 - start
    inside_B = (at_B >= 0) & (at_B < c)
    h_BxD = jnp.take_along_axis(hidden_BxCxD, jnp.clip(at_B, 0, c - 1)[:, None, None], axis=1)
    return caches, jnp.where(inside_B[:, None], h_BxD[:, 0], last_BxD)

  caches = [(buf(), buf()) for _ in range(mc.num_layers)]
  last_BxD = jnp.zeros((b, mc.width), dtype)
  if c == pb:
    caches, last_BxD = run_chunk(0, caches, last_BxD)
  else:
    n = pb // c if num_chunks is None else num_chunks
    caches, last_BxD = jax.lax.fori_loop(
      0, n, lambda i, carry: run_chunk(i * c, *carry), (caches, last_BxD)
    )
  k = jnp.stack([jnp.swapaxes(kk, 1, 2) for kk, _ in caches], axis=1)  # [B, L, K, Pb, d]
  v = jnp.stack([jnp.swapaxes(vv, 1, 2) for _, vv in caches], axis=1)
  return Prefix(k=k, v=v, logits=_logits(model, last_BxD), length=lengths_B)


def prefill(graphdef, params, tokens_Pb, length, chunk=None):
  """Runs one prompt (padded to a bucket length Pb) through the model.

  Args:
    graphdef, params: the policy, as the trainer holds it.
    tokens_Pb: [Pb] int32 prompt, padded on the right.
    length: [] int32 true prompt length, 1 ≤ length ≤ Pb.
    chunk: as `prefill_batch`.

  Returns:
    Prefix with the keys/values of every layer and the last logits.
  """
  lengths_B = jnp.reshape(jnp.asarray(length, jnp.int32), (1,))
  batch = prefill_batch(graphdef, params, tokens_Pb[None], lengths_B, chunk)
  return jax.tree.map(lambda x: x[0], batch)


def _split_keys(rng_Sx2):
  """One fresh subkey per slot and the advanced key data."""
  keys = jax.random.wrap_key_data(rng_Sx2)
  pairs = jax.vmap(lambda k: jax.random.split(k))(keys)
  return jax.random.key_data(pairs[:, 0]), pairs[:, 1]


def _is_stop(tokens_S, stop_SxK):
  return jnp.any(tokens_S[:, None] == stop_SxK, axis=-1)


def controlled_logits(logits_SxV, bias_ids_SxKb, bias_values_SxKb, stop_SxK, before_min_S):
  """The logits a slot samples from: its sparse bias added (−1e30 bans a
  token; −1 ids are ignored), and its stop tokens set to −1e30 while
  `before_min_S` (fewer than `min_new` tokens so far)."""
  s, v = logits_SxV.shape
  rows_Sx1 = jnp.arange(s)[:, None]
  ids = jnp.where(bias_ids_SxKb >= 0, bias_ids_SxKb, v)  # out of range: dropped
  logits_SxV = logits_SxV.at[rows_Sx1, ids].add(bias_values_SxKb, mode='drop')
  stop_ids = jnp.where((stop_SxK >= 0) & before_min_S[:, None], stop_SxK, v)
  return logits_SxV.at[rows_Sx1, stop_ids].set(_NEG, mode='drop')


def _push_recent(recent_SxLs, tokens_S):
  return jnp.concatenate([recent_SxLs[:, 1:], tokens_S[:, None]], axis=1)


def stop_sequence_hit(recent_SxLs, seqs_SxQxLs):
  """Whether each slot's last tokens end with one of its stop sequences
  (right-aligned, −1 entries match anything, an all −1 row matches nothing)."""
  real = seqs_SxQxLs >= 0
  same = ~real | (recent_SxLs[:, None, :] == seqs_SxQxLs)
  return jnp.any(jnp.all(same, axis=-1) & jnp.any(real, axis=-1), axis=-1)


def insert(state, prefix, slots_G, request, cfg, truncate=None):
  """Puts G samples of one prefilled prompt into slots `slots_G`.

  Full prompt pages are shared by the G slots (reference count G); a partial
  last page is copied into a private page per slot. Pages come off the free
  stack; the caller guarantees there are enough.

  Args:
    state: DecodeState.
    prefix: Prefix of the prompt.
    slots_G: [G] int32 distinct idle slots.
    request: SlotRequest with [G] leading axes.
    cfg: EngineConfig (static).
    truncate: static, as `jrl.sampler.sample`.

  Returns:
    The new DecodeState, with each slot's first token already sampled.
  """
  g = slots_G.shape[0]
  p, m = cfg.page_size, cfg.max_pages_per_slot
  length = prefix.length
  n_full = length // p
  has_partial = (length % p > 0).astype(jnp.int32)
  n_need = n_full + g * has_partial

  # Pop n_need pages: rank r takes free_stack[free_top − 1 − r].
  r_max = cfg.max_prompt_pages + g
  ranks = jnp.arange(r_max)
  popped = state.free_stack[jnp.clip(state.free_top - 1 - ranks, 0, cfg.num_pages - 1)]
  popped = jnp.where(ranks < n_need, popped, 0)
  j_M = jnp.arange(m)
  shared_M = jnp.where(j_M < n_full, popped[jnp.clip(j_M, 0, r_max - 1)], 0)
  private_G = jnp.where(has_partial > 0, popped[jnp.clip(n_full + jnp.arange(g), 0, r_max - 1)], 0)
  table_GxM = jnp.where(
    (j_M[None, :] == n_full) & (has_partial > 0), private_G[:, None], shared_M[None, :]
  )
  refcount = state.refcount.at[shared_M].add(jnp.where(j_M < n_full, g, 0))
  refcount = refcount.at[private_G].add(has_partial)
  refcount = refcount.at[0].set(0)  # the scratch page is never counted

  # Write the prompt's keys and values into each slot's pages.
  pb = prefix.k.shape[2]
  t = jnp.arange(pb)
  valid = t < length
  page_GxPb = jnp.where(valid[None, :], table_GxM[:, jnp.clip(t // p, 0, m - 1)], 0)
  offset_Pb = t % p
  pages_flat = page_GxPb.reshape(-1)
  offsets_flat = jnp.tile(offset_Pb, g)
  k_pages, v_pages = [], []
  for layer in range(len(state.k_pages)):
    k_val = jnp.tile(prefix.k[layer], (1, g, 1)).astype(state.k_pages[layer].dtype)
    v_val = jnp.tile(prefix.v[layer], (1, g, 1)).astype(state.v_pages[layer].dtype)
    k_pages.append(state.k_pages[layer].at[:, pages_flat, offsets_flat, :].set(k_val))
    v_pages.append(state.v_pages[layer].at[:, pages_flat, offsets_flat, :].set(v_val))

  # G first tokens from the one set of prefill logits, each with its own key.
  rng, subkeys = _split_keys(request.rng)
  params = SamplingParams(request.temperature, request.top_k, request.top_p, request.greedy)
  logits_GxV = jnp.broadcast_to(prefix.logits, (g, prefix.logits.shape[0]))
  logits_GxV = controlled_logits(
    logits_GxV, request.bias_ids, request.bias_values, request.stop_tokens, request.min_new > 0
  )
  tok_G, logp_G = sample(logits_GxV, subkeys, params, truncate)
  recent_G = _push_recent(jnp.full((g, cfg.max_stop_len), NO_TOKEN, jnp.int32), tok_G)
  stop_G = _is_stop(tok_G, request.stop_tokens) | stop_sequence_hit(recent_G, request.stop_seqs)
  stop_G = stop_G & (request.min_new < 1)
  done_G = stop_G | (request.max_new <= 1)
  reason_G = jnp.where(stop_G, STOP, jnp.where(done_G, LENGTH, RUNNING))
  row_tokens = jnp.zeros((g, cfg.max_new_tokens), jnp.int32).at[:, 0].set(tok_G)
  row_logp = jnp.zeros((g, cfg.max_new_tokens), jnp.float32).at[:, 0].set(logp_G)

  s = slots_G
  return state._replace(
    k_pages=tuple(k_pages),
    v_pages=tuple(v_pages),
    page_table=state.page_table.at[s].set(table_GxM),
    num_pages=state.num_pages.at[s].set(n_full + has_partial),
    lengths=state.lengths.at[s].set(length),
    refcount=refcount,
    free_top=state.free_top - n_need,
    active=state.active.at[s].set(True),
    done=state.done.at[s].set(done_G),
    finish_reason=state.finish_reason.at[s].set(reason_G),
    next_token=state.next_token.at[s].set(tok_G),
    rng=state.rng.at[s].set(rng),
    temperature=state.temperature.at[s].set(request.temperature),
    top_k=state.top_k.at[s].set(request.top_k),
    top_p=state.top_p.at[s].set(request.top_p),
    greedy=state.greedy.at[s].set(request.greedy),
    stop_tokens=state.stop_tokens.at[s].set(request.stop_tokens),
    max_new=state.max_new.at[s].set(request.max_new),
    num_generated=state.num_generated.at[s].set(1),
    out_tokens=state.out_tokens.at[s].set(row_tokens),
    out_logprobs=state.out_logprobs.at[s].set(row_logp),
    forced_len=state.forced_len.at[s].set(0),
    forced_at=state.forced_at.at[s].set(0),
    min_new=state.min_new.at[s].set(request.min_new),
    bias_ids=state.bias_ids.at[s].set(request.bias_ids),
    bias_values=state.bias_values.at[s].set(request.bias_values),
    stop_seqs=state.stop_seqs.at[s].set(request.stop_seqs),
    recent=state.recent.at[s].set(recent_G),
  )


def insert_batch(state, prefix, slots_BxG, request, valid_B, cfg, truncate=None):
  """`insert` for B prefilled prompts in turn (rows with `valid_B` False are
  skipped). `prefix` has a leading [B] axis, `request` leading [B, G] axes."""

  def body(st, row):
    prefix_b, slots_G, request_b, valid = row
    st = jax.lax.cond(
      valid, lambda x: insert(x, prefix_b, slots_G, request_b, cfg, truncate), lambda x: x, st
    )
    return st, None

  state, _ = jax.lax.scan(body, state, (prefix, slots_BxG, request, valid_B))
  return state


def admit(
  graphdef,
  params,
  state,
  tokens_BxPb,
  lengths_B,
  slots_BxG,
  request,
  valid_B,
  cfg,
  *,
  chunk=None,
  num_chunks=None,
  truncate=None,
):
  """Prefills B prompts in one call and inserts each into its G slots."""
  prefix = prefill_batch(graphdef, params, tokens_BxPb, lengths_B, chunk, num_chunks)
  return insert_batch(state, prefix, slots_BxG, request, valid_B, cfg, truncate)


def _grow_pages(state, live_S, cfg):
  """Gives a new page to every live slot whose next token starts one."""
  p = cfg.page_size
  need_S = live_S & (state.lengths // p >= state.num_pages)
  rank_S = jnp.cumsum(need_S) - 1
  page_S = state.free_stack[jnp.clip(state.free_top - 1 - rank_S, 0, cfg.num_pages - 1)]
  page_S = jnp.where(need_S, page_S, 0)
  j_M = jnp.arange(cfg.max_pages_per_slot)
  at_end = need_S[:, None] & (j_M[None, :] == state.num_pages[:, None])
  return state._replace(
    page_table=jnp.where(at_end, page_S[:, None], state.page_table),
    num_pages=state.num_pages + need_S,
    refcount=state.refcount.at[page_S].add(need_S.astype(jnp.int32)).at[0].set(0),
    free_top=state.free_top - jnp.sum(need_S),
  )


def decode_step(graphdef, params, state, cfg, max_pages=None, truncate=None):
  """One token for every live slot: write its k/v, attend over its pages, sample.

  `max_pages` (static) limits attention to the first pages of every page
  table; the caller guarantees no live slot holds more (see `generate`).
  """
  impl = paged.resolve_impl(cfg.attention_impl)
  model = nnx.merge(graphdef, params)
  live_S = state.active & ~state.done
  state = _grow_pages(state, live_S, cfg)
  p = cfg.page_size
  pos_S = state.lengths
  write_page_S = jnp.where(
    live_S, jnp.take_along_axis(state.page_table, (pos_S // p)[:, None], axis=1)[:, 0], 0
  )
  offset_S = pos_S % p
  visible_S = jnp.where(live_S, pos_S + 1, 1)

  def attend(layer, q, k, v, cache):
    opts = attention_options(model.config, layer)
    k_pages, v_pages = paged.write_token(*cache, k[:, 0], v[:, 0], write_page_S, offset_S)
    table = jnp.where(live_S[:, None], state.page_table[:, :max_pages], 0)
    out = paged.paged_attention(
      impl,
      q[:, 0],
      k_pages,
      v_pages,
      table,
      visible_S,
      scale=opts.scale,
      softcap=opts.softcap,
      window=opts.window,
    )
    return out[:, None], (k_pages, v_pages)

  caches = list(zip(state.k_pages, state.v_pages, strict=True))
  hidden, caches = model(state.next_token[:, None], pos_S[:, None], attend, caches=caches)
  logits_SxV = _logits(model, hidden[:, 0])
  before_min_S = state.num_generated < state.min_new
  logits_SxV = controlled_logits(
    logits_SxV, state.bias_ids, state.bias_values, state.stop_tokens, before_min_S
  )
  rng, subkeys = _split_keys(state.rng)
  params_S = SamplingParams(state.temperature, state.top_k, state.top_p, state.greedy)
  tok_S, logp_S = sample(logits_SxV, subkeys, params_S, truncate)
  # Environment tokens replace the sample while a slot has some queued.
  forcing_S = live_S & (state.forced_at < state.forced_len)
  at_F = jnp.clip(state.forced_at, 0, state.forced.shape[1] - 1)
  forced_S = jnp.take_along_axis(state.forced, at_F[:, None], axis=1)[:, 0]
  tok_S = jnp.where(forcing_S, forced_S, tok_S)
  logp_S = jnp.where(forcing_S, 0.0, logp_S)

  at_S = state.num_generated
  write_SxT = live_S[:, None] & (jnp.arange(cfg.max_new_tokens)[None, :] == at_S[:, None])
  num_generated = state.num_generated + live_S
  recent = jnp.where(live_S[:, None], _push_recent(state.recent, tok_S), state.recent)
  stop_S = _is_stop(tok_S, state.stop_tokens) | stop_sequence_hit(recent, state.stop_seqs)
  stop_S = stop_S & ~forcing_S & (num_generated > state.min_new)
  finished_S = live_S & (stop_S | (num_generated >= state.max_new))
  return state._replace(
    k_pages=tuple(c[0] for c in caches),
    v_pages=tuple(c[1] for c in caches),
    lengths=state.lengths + live_S,
    done=state.done | finished_S,
    finish_reason=jnp.where(finished_S, jnp.where(stop_S, STOP, LENGTH), state.finish_reason),
    next_token=jnp.where(live_S, tok_S, state.next_token),
    rng=jnp.where(live_S[:, None], rng, state.rng),
    num_generated=num_generated,
    out_tokens=jnp.where(write_SxT, tok_S[:, None], state.out_tokens),
    out_logprobs=jnp.where(write_SxT, logp_S[:, None], state.out_logprobs),
    forced_at=state.forced_at + forcing_S,
    recent=recent,
  )


def resume(state, slot_mask_S, forced_SxF, forced_len_S):
  """Continues finished slots with environment tokens (multi-turn).

  Each slot in `slot_mask_S` stopped on a turn-ending token that is not in
  its cache yet; the next `forced_len_S` decode steps feed that token and
  then the environment's tokens `forced_SxF` (writing their keys and values
  on top of the cached prefix: nothing before them is recomputed), and the
  step after the last one samples the model's next turn. The tokens count
  towards the slot's `max_new`.
  """
  m = slot_mask_S
  return state._replace(
    done=state.done & ~m,
    finish_reason=jnp.where(m, RUNNING, state.finish_reason),
    forced=jnp.where(m[:, None], forced_SxF, state.forced),
    forced_len=jnp.where(m, forced_len_S, state.forced_len),
    forced_at=jnp.where(m, 0, state.forced_at),
  )


def generate(graphdef, params, state, cfg, num_steps, max_pages=None, truncate=None):
  """Up to `num_steps` decode steps; stops early when no slot is live.

  `max_pages` (static, default all) bounds the pages any slot can hold
  during these steps; attention then gathers only that many pages per slot.
  `attend_pages` computes a safe value.
  """

  def cond(carry):
    i, st = carry
    return (i < num_steps) & jnp.any(st.active & ~st.done)

  def body(carry):
    i, st = carry
    return i + 1, decode_step(graphdef, params, st, cfg, max_pages, truncate)

  _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
  return state


def free(state, slot_mask_S):
  """Releases the pages of the slots in `slot_mask_S` and resets those slots.

  A page returns to the free stack when its reference count reaches 0 (a
  shared prompt page only after all G slots are freed).
  """
  n = state.refcount.shape[0]
  m = state.page_table.shape[1]
  held_SxM = (jnp.arange(m)[None, :] < state.num_pages[:, None]) & slot_mask_S[:, None]
  dec_N = (
    jnp.zeros(n, jnp.int32)
    .at[state.page_table.reshape(-1)]
    .add(held_SxM.reshape(-1).astype(jnp.int32))
  )
  dec_N = dec_N.at[0].set(0)
  refcount = state.refcount - dec_N
  newly_free_N = (dec_N > 0) & (refcount == 0)
  slot_in_stack = state.free_top + jnp.cumsum(newly_free_N) - 1
  free_stack = state.free_stack.at[jnp.where(newly_free_N, slot_in_stack, n)].set(
    jnp.arange(n, dtype=jnp.int32), mode='drop'
  )
  keep = ~slot_mask_S
  return state._replace(
    page_table=jnp.where(keep[:, None], state.page_table, 0),
    num_pages=jnp.where(keep, state.num_pages, 0),
    lengths=jnp.where(keep, state.lengths, 0),
    refcount=refcount,
    free_stack=free_stack,
    free_top=state.free_top + jnp.sum(newly_free_N),
    active=state.active & keep,
    done=state.done & keep,
    finish_reason=jnp.where(keep, state.finish_reason, RUNNING),
    num_generated=jnp.where(keep, state.num_generated, 0),
    forced_len=jnp.where(keep, state.forced_len, 0),
    forced_at=jnp.where(keep, state.forced_at, 0),
  )


POOL_FIELDS = ('k_pages', 'v_pages', 'refcount', 'free_stack', 'free_top')


def compact(state, index_Sc):
  """A state of Sc = len(index) slots: slot i of the result is slot
  `index_Sc[i]` of `state`; the page pools, reference counts and free stack
  are kept as they are. The caller keeps every live slot and fills the rest
  of `index_Sc` with idle ones (whose pages, if any, must be freed first),
  so no page is lost or held twice."""
  return state._replace(
    **{
      f: jnp.take(getattr(state, f), index_Sc, axis=0)
      for f in state._fields
      if f not in POOL_FIELDS
    }
  )


def attend_pages(num_pages_S, num_steps, cfg):
  """A static page bound for `generate`: the most pages any slot can hold after
  `num_steps` more tokens, rounded up to a power of two (capped at M), so at
  most log2(M) + 1 compiled variants and usually one or two per call."""
  m = cfg.max_pages_per_slot
  bound = int(max(num_pages_S, default=0)) + math.ceil(num_steps / cfg.page_size) + 1
  return min(1 << max(0, math.ceil(math.log2(bound))), m)


def pool_pages(max_prompt_len, max_new, group_size, page_size, num_slots):
  """Pages (scratch included) for `num_slots // group_size` groups in flight at
  their worst case. A prompt that fills no whole page shares nothing, so the
  worst case is not always the longest prompt: take the maximum over lengths."""
  per_group = max(
    pages_needed(n, max_new, group_size, page_size) for n in range(1, max_prompt_len + 1)
  )
  return 1 + per_group * max(1, num_slots // group_size)


def pages_needed(prompt_len, max_new, group_size, page_size):
  """Worst-case pages a group of `group_size` samples of one prompt can hold:
  the shared full prompt pages plus each sample's private pages."""
  n_full = prompt_len // page_size
  per_slot = math.ceil((prompt_len + max_new - 1) / page_size)
  return n_full + group_size * (per_slot - n_full)


def group_pages(prompt_len, max_news, page_size):
  """Worst-case pages of a group whose samples have their own `max_news`:
  the shared full prompt pages plus each sample's private pages."""
  n_full = prompt_len // page_size
  return n_full + sum(math.ceil((prompt_len + m - 1) / page_size) - n_full for m in max_news)
