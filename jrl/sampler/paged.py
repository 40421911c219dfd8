"""The paged decode steps: pure, jittable functions on an explicit state.

The `Sampler` (jrl.sampler.sampler, jrl's `contracts.Engine`) drives them.
As in JetStream, parameters are passed explicitly to every call and nothing
here holds weights:

    prefix = prefill(graphdef, params, tokens, length)     one prompt
    state  = insert(state, prefix, slots, ...)             into G free slots
    state  = admit(graphdef, params, state, ...)           B prompts: prefill_batch + insert_batch
    state  = generate(graphdef, params, state, steps)      several decode steps
    state  = generate_slots(graphdef, params, state, index, steps)   the same on some slots only
    state  = free(state, slot_mask)                        release finished slots

This module holds the slot lifecycle (`insert`, `admit`, `generate_slots`, `free`)
and re-exports the rest of the steps: the state and its sizes
(`jrl.sampler.state`), prefill (`jrl.sampler.prefill`), the decode loop
(`jrl.sampler.decode`), per-sample controls (`jrl.sampler.controls`) and
page-pool sizing (`jrl.sampler.pages`).

GRPO prompt sharing: `insert` puts the G samples of one prompt in G slots
that point at the same full prompt pages (reference count G); each slot gets
a private copy of the partial last page, so no slot ever writes into a
shared page. The G first tokens are drawn from the one set of prefill logits,
each with the slot's own key.
"""

import jax
import jax.numpy as jnp

from jrl.sampler.attention import needs_page_bound
from jrl.sampler.controls import (
  controlled_logits,
  is_stop,
  push_recent,
  split_keys,
  stop_sequence_hit,
)
from jrl.sampler.decode import decode_step, generate, resume
from jrl.sampler.pages import attend_pages, group_pages, pages_needed, pool_pages
from jrl.sampler.prefill import prefill, prefill_batch
from jrl.sampler.sampling import SamplingParams, sample
from jrl.sampler.state import (
  FINISH_REASONS,
  LENGTH,
  NO_TOKEN,
  POOL_FIELDS,
  RUNNING,
  STOP,
  DecodeState,
  Prefix,
  SamplerConfig,
  SlotRequest,
  init_state,
)


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
    cfg: SamplerConfig (static).
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
  rng, subkeys = split_keys(request.rng)
  params = SamplingParams(request.temperature, request.top_k, request.top_p, request.greedy)
  logits_GxV = jnp.broadcast_to(prefix.logits, (g, prefix.logits.shape[0]))
  logits_GxV = controlled_logits(
    logits_GxV, request.bias_ids, request.bias_values, request.stop_tokens, request.min_new > 0
  )
  tok_G, logp_G = sample(logits_GxV, subkeys, params, truncate)
  recent_G = push_recent(jnp.full((g, cfg.max_stop_len), NO_TOKEN, jnp.int32), tok_G)
  stop_G = is_stop(tok_G, request.stop_tokens) | stop_sequence_hit(recent_G, request.stop_seqs)
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


def generate_slots(
  graphdef, params, state, index_Sc, cfg, num_steps, max_pages=None, truncate=None, until_live=0
):
  """`generate` on the slots in `index_Sc` only: finished and idle slots cost nothing.

  The per-slot fields of those Sc slots are gathered into a state of Sc
  slots that shares the page pools, decoded for up to `num_steps` steps, and
  scattered back; the other slots are left as they are. `index_Sc` holds
  distinct slot ids, every live slot among them (the rest idle ones, which
  a decode step neither writes nor samples), so the result equals
  `generate` on the whole state while each step runs Sc rows, not S.
  """
  slots = [f for f in state._fields if f not in POOL_FIELDS]
  view = state._replace(**{f: jnp.take(getattr(state, f), index_Sc, axis=0) for f in slots})
  view = generate(graphdef, params, view, cfg, num_steps, max_pages, truncate, until_live)
  return view._replace(**{f: getattr(state, f).at[index_Sc].set(getattr(view, f)) for f in slots})


__all__ = [
  'FINISH_REASONS',
  'LENGTH',
  'NO_TOKEN',
  'POOL_FIELDS',
  'RUNNING',
  'STOP',
  'DecodeState',
  'Prefix',
  'SamplerConfig',
  'SlotRequest',
  'admit',
  'attend_pages',
  'controlled_logits',
  'decode_step',
  'free',
  'generate',
  'generate_slots',
  'group_pages',
  'init_state',
  'insert',
  'insert_batch',
  'needs_page_bound',
  'pages_needed',
  'pool_pages',
  'prefill',
  'prefill_batch',
  'resume',
  'stop_sequence_hit',
]
