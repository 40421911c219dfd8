"""The decode loop: one token per live slot per step, pages grown as needed.

Page growth happens inside `decode_step`: a slot whose next token starts a
new page pops one from the free stack. The host driver
(`jrl.sampler.Sampler`) only admits a request when its worst case fits in the
pages not yet promised to others, so the stack never runs dry mid-decode.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jrl.models.attention import attention_options
from jrl.sampler import attention as paged
from jrl.sampler.controls import (
  controlled_logits,
  is_stop,
  model_logits,
  push_recent,
  split_keys,
  stop_sequence_hit,
)
from jrl.sampler.sampling import SamplingParams, sample
from jrl.sampler.state import LENGTH, RUNNING, STOP


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
  model = nnx.merge(graphdef, params)
  impl = paged.resolve_impl(
    cfg.attention_impl,
    cfg.page_size,
    model.config.head_dim,
    kv_dtype=state.k_pages[0].dtype,
    q_dtype=model.config.compute_dtype,
  )
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
  logits_SxV = model_logits(model, hidden[:, 0])
  before_min_S = state.num_generated < state.min_new
  logits_SxV = controlled_logits(
    logits_SxV, state.bias_ids, state.bias_values, state.stop_tokens, before_min_S
  )
  rng, subkeys = split_keys(state.rng)
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
  recent = jnp.where(live_S[:, None], push_recent(state.recent, tok_S), state.recent)
  stop_S = is_stop(tok_S, state.stop_tokens) | stop_sequence_hit(recent, state.stop_seqs)
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


def resume(state, slot_mask_S, forced_SxF, forced_len_S, max_new_S, temperature_S, greedy_S):
  """Continues finished slots with environment tokens (multi-turn).

  Each slot in `slot_mask_S` ended a turn (a turn-ending token, or its
  turn's token limit) with a token that is not in its cache yet; the next
  `forced_len_S` decode steps feed that token and then the environment's
  tokens `forced_SxF` (writing their keys and values on top of the cached
  prefix: nothing before them is recomputed), and the step after the last
  one samples the model's next turn. The tokens count towards the slot's
  `max_new`, which becomes `max_new_S` (the next turn's limit, counted
  from the completion's start); the next turn samples with `temperature_S`
  and `greedy_S`. Shapes: masks and counts [S], forced tokens [S, F].
  """
  m = slot_mask_S
  return state._replace(
    done=state.done & ~m,
    finish_reason=jnp.where(m, RUNNING, state.finish_reason),
    forced=jnp.where(m[:, None], forced_SxF, state.forced),
    forced_len=jnp.where(m, forced_len_S, state.forced_len),
    forced_at=jnp.where(m, 0, state.forced_at),
    max_new=jnp.where(m, max_new_S, state.max_new),
    temperature=jnp.where(m, temperature_S, state.temperature),
    greedy=jnp.where(m, greedy_S, state.greedy),
  )


def generate(graphdef, params, state, cfg, num_steps, max_pages=None, truncate=None, until_live=0):
  """Up to `num_steps` decode steps; stops early when at most `until_live`
  slots are live (default: none).

  `max_pages` (static, default all) bounds the pages any slot can hold
  during these steps; attention then gathers only that many pages per slot.
  `attend_pages` computes a safe value. `until_live` (static) hands control
  back once half the rows have finished, so the driver can decode the rest
  on fewer rows (`paged.generate_slots`).
  """

  def cond(carry):
    i, st = carry
    return (i < num_steps) & (jnp.sum(st.active & ~st.done) > until_live)

  def body(carry):
    i, st = carry
    return i + 1, decode_step(graphdef, params, st, cfg, max_pages, truncate)

  _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
  return state
