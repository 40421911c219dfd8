"""The in-trainer sampler as it is commonly written, kept as a baseline.

A dense, static-batch KV cache of [B·G, P_max + T_max] per layer; every
prompt repeated G times and left-padded to the longest; one prefill of the
whole padded batch; then decode steps for every row until the longest row
ends (finished rows keep being computed). It runs the same model code and
the same sampling function as `jrl.sampler`, so benchmarks compare the
engines, not the models. Used by `launch/bench.py sampler` and by tests as
an independent reference.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.models.attention import dot_attention
from jrl.sampler.sampling import SamplingParams, sample


class DenseResult(NamedTuple):
  tokens: np.ndarray  # [B·G, T_max] int32
  logprobs: np.ndarray  # [B·G, T_max] float32
  mask: np.ndarray  # [B·G, T_max] bool
  cache_bytes: int  # bytes of the dense KV cache


def _generate(
  graphdef, params, prompt_BxP, prompt_mask_BxP, max_new_B, keys_Bx2, sp, stop_BxK, t_max
):
  model = nnx.merge(graphdef, params)
  cfg = model.config
  b, p = prompt_BxP.shape
  s = p + t_max
  positions = jnp.maximum(jnp.cumsum(prompt_mask_BxP, axis=1) - 1, 0)
  allowed = jnp.tril(jnp.ones((p, p), bool))[None] & (
    prompt_mask_BxP[:, None, :].astype(bool) | jnp.eye(p, dtype=bool)[None]
  )

  def prefill_attend(layer, q, k, v, cache):
    del layer, cache
    return dot_attention(q, k, v, allowed), (k, v)

  hidden, kv = model(prompt_BxP, positions, prefill_attend, caches=[None] * cfg.num_layers)
  pad = ((0, 0), (0, t_max), (0, 0), (0, 0))
  cache = [(jnp.pad(k, pad), jnp.pad(v, pad)) for k, v in kv]
  key_valid = jnp.pad(prompt_mask_BxP.astype(bool), ((0, 0), (0, t_max)))
  lengths = jnp.sum(prompt_mask_BxP, axis=1).astype(jnp.int32)

  def logits_of(h):
    return jnp.dot(h, model.unembed(), preferred_element_type=jnp.float32).astype(jnp.float32)

  def draw(logits, keys):
    pairs = jax.vmap(jax.random.split)(jax.random.wrap_key_data(keys))
    return sample(logits, pairs[:, 1], sp), jax.random.key_data(pairs[:, 0])

  (tok, logp), keys = draw(logits_of(hidden[:, -1]), keys_Bx2)
  out_tok = jnp.zeros((b, t_max), jnp.int32).at[:, 0].set(tok)
  out_logp = jnp.zeros((b, t_max), jnp.float32).at[:, 0].set(logp)
  done = jnp.any(tok[:, None] == stop_BxK, axis=-1) | (max_new_B <= 1)
  n_gen = jnp.ones(b, jnp.int32)

  def cond(carry):
    step, *_, done = carry
    return (step < t_max - 1) & ~jnp.all(done)

  def body(carry):
    step, cache, key_valid, tok, keys, out_tok, out_logp, n_gen, done = carry
    col = p + step
    key_valid = key_valid.at[:, col].set(True)
    pos = (lengths + step)[:, None]

    def attend(layer, q, k, v, c):
      del layer
      ck, cv = c
      ck = jax.lax.dynamic_update_slice_in_dim(ck, k, col, axis=1)
      cv = jax.lax.dynamic_update_slice_in_dim(cv, v, col, axis=1)
      return dot_attention(q, ck, cv, key_valid[:, None, :]), (ck, cv)

    h, cache = model(tok[:, None], pos, attend, caches=cache)
    (new_tok, new_logp), keys = draw(logits_of(h[:, 0]), keys)
    live = ~done
    at = jnp.arange(t_max)[None, :] == n_gen[:, None]
    out_tok = jnp.where(live[:, None] & at, new_tok[:, None], out_tok)
    out_logp = jnp.where(live[:, None] & at, new_logp[:, None], out_logp)
    n_gen = n_gen + live
    stop = jnp.any(new_tok[:, None] == stop_BxK, axis=-1)
    done = done | (live & (stop | (n_gen >= max_new_B)))
    return step + 1, cache, key_valid, new_tok, keys, out_tok, out_logp, n_gen, done

  carry = (jnp.int32(0), cache, key_valid, tok, keys, out_tok, out_logp, n_gen, done)
  carry = jax.lax.while_loop(cond, body, carry)
  out_tok, out_logp, n_gen = carry[5], carry[6], carry[7]
  mask = jnp.arange(t_max)[None, :] < n_gen[:, None]
  del s
  return out_tok, out_logp, mask


@functools.lru_cache(maxsize=8)
def _jitted(graphdef, t_max):
  return jax.jit(functools.partial(_generate, graphdef, t_max=t_max))


def dense_generate(graphdef, params, model_config, requests, group_size, t_max):
  """Samples G completions per request the dense, static-batch way.

  Args:
    graphdef, params: the policy.
    model_config: its ModelConfig.
    requests: sequence of `jrl.sampler.Request` (sampling settings per request).
    group_size: G; each prompt is repeated G times.
    t_max: cache width for completions (≥ every request's max_new_tokens).

  Returns:
    DenseResult with rows ordered b·G + g.
  """
  rows = [(r, g) for r in requests for g in range(group_size)]
  p_max = max(len(r.prompt) for r in requests)
  n = len(rows)
  prompt = np.zeros((n, p_max), np.int32)
  pmask = np.zeros((n, p_max), np.int32)
  stop_k = max(1, max(len(r.stop_tokens) for r in requests))
  stop = np.full((n, stop_k), -1, np.int32)
  keys = []
  for i, (r, g) in enumerate(rows):
    prompt[i, p_max - len(r.prompt) :] = r.prompt  # left padding
    pmask[i, p_max - len(r.prompt) :] = 1
    stop[i, : len(r.stop_tokens)] = r.stop_tokens
    keys.append(np.asarray(jax.random.fold_in(jax.random.PRNGKey(r.seed), g)))
  temperature = np.asarray(
    [r.per_sample('temperature', group_size)[g] for r, g in rows], np.float32
  )
  sp = SamplingParams(
    temperature=jnp.asarray(np.where(temperature > 0, temperature, 1.0)),  # 0: greedy
    top_k=jnp.asarray([r.top_k for r, _ in rows], jnp.int32),
    top_p=jnp.asarray([r.top_p for r, _ in rows], jnp.float32),
    greedy=jnp.asarray([r.greedy for r, _ in rows]) | jnp.asarray(temperature == 0),
  )
  max_new = jnp.asarray([r.per_sample('max_new_tokens', group_size)[g] for r, g in rows], jnp.int32)
  fn = _jitted(graphdef, t_max)
  out = fn(
    params,
    jnp.asarray(prompt),
    jnp.asarray(pmask),
    max_new,
    jnp.asarray(np.stack(keys).astype(np.uint32)),
    sp,
    jnp.asarray(stop),
  )
  tokens, logprobs, mask = jax.device_get(out)
  itemsize = jnp.dtype(model_config.compute_dtype).itemsize
  cache_bytes = (
    2
    * model_config.num_layers
    * n
    * (p_max + t_max)
    * model_config.num_kv_heads
    * model_config.head_dim
    * itemsize
  )
  return DenseResult(tokens, logprobs, mask, cache_bytes)
