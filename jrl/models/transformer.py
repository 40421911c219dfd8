"""One decoder-only transformer for policy, reference, critic and reward model.

Covers the Llama 3 and Qwen2 / Qwen2.5 / Qwen3 families: RMSNorm, rotary
embeddings (rope_theta, Llama 3 scaling), grouped-query attention, a SwiGLU
MLP, Qwen2's q/k/v biases, Qwen3's q/k RMSNorm, tied or untied embeddings,
and an optional scalar head (`score`, as in Hugging Face's
`*ForSequenceClassification`) for critics and reward models.

The module tree is Flax NNX; everything outside this file uses the pure
boundary `graphdef, params = create(config, key)` and functions of
`(graphdef, params, arrays)` (`hidden_states`, `logits`,
`next_token_logprobs`, `values`), which are safe to `jax.jit` with
`graphdef` static.

Attention is pluggable. Each layer computes rotated q, k and v and hands
them to `attention(layer, q, k, v, cache) -> (out, cache)`. Training uses
`causal_attention(mask)` (dense, no cache); the sampler passes a function
that writes k, v into its paged KV cache and attends over the pages. Both
run these same layers on the same parameters.

Numerics: parameters are stored in `config.param_dtype` and cast to
`config.compute_dtype` for matmuls; RMSNorm statistics, rotary angles,
attention softmax and logits are float32.

Shapes: B batch, T tokens, S keys, D width, F MLP width, H query heads,
K kv heads, d head width, V vocabulary.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl import losses
from jrl.models.config import ModelConfig, rope_inv_freq

# attention(layer, q_BxTxHxd, k_BxTxKxd, v_BxTxKxd, cache) -> (out_BxTxHxd, cache)
AttentionFn = Callable

NEG_INF = -0.7 * float(np.finfo(np.float32).max)  # finite: fully masked rows stay NaN-free


class Dense(nnx.Module):
  """y = x @ kernel (+ bias); kernel [in, out] stored in param dtype."""

  def __init__(self, in_dim, out_dim, config, *, rngs, bias=False):
    init = nnx.initializers.normal(config.init_std)
    self.kernel = nnx.Param(init(rngs.params(), (in_dim, out_dim), config.param_jnp_dtype))
    self.bias = nnx.Param(jnp.zeros((out_dim,), config.param_jnp_dtype)) if bias else None
    self.compute_dtype = config.compute_jnp_dtype

  def __call__(self, x):
    y = jnp.dot(x.astype(self.compute_dtype), self.kernel[...].astype(self.compute_dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.compute_dtype)
    return y


class RMSNorm(nnx.Module):
  """x / sqrt(mean(x²) + ε) · scale, the statistics in float32."""

  def __init__(self, dim, config):
    self.scale = nnx.Param(jnp.ones((dim,), config.param_jnp_dtype))
    self.eps = config.rms_eps

  def __call__(self, x):
    dtype = x.dtype
    # Norm statistics in float32 whatever the compute dtype.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return normed.astype(dtype) * self.scale[...].astype(dtype)


class Embed(nnx.Module):
  """Token embedding table [V, D]."""

  def __init__(self, config, *, rngs):
    init = nnx.initializers.normal(config.init_std)
    self.embedding = nnx.Param(
      init(rngs.params(), (config.vocab_size, config.width), config.param_jnp_dtype)
    )
    self.compute_dtype = config.compute_jnp_dtype

  def __call__(self, tokens_BxT):
    return jnp.take(self.embedding[...], tokens_BxT, axis=0).astype(self.compute_dtype)


def apply_rope(x_BxTxNxd, positions_BxT, inv_freq):
  """Rotary embedding in the "rotate half" layout used by Llama and Qwen.

  Args:
    x_BxTxNxd: queries or keys.
    positions_BxT: int positions.
    inv_freq: [d/2] float32 inverse frequencies.

  Returns:
    [B, T, N, d] in x's dtype.
  """
  # Angles in float32, then cast: the same order of operations as Hugging Face.
  angles_BxTxh = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  angles_BxTxd = jnp.concatenate([angles_BxTxh, angles_BxTxh], axis=-1)
  cos = jnp.cos(angles_BxTxd)[:, :, None, :].astype(x_BxTxNxd.dtype)
  sin = jnp.sin(angles_BxTxd)[:, :, None, :].astype(x_BxTxNxd.dtype)
  x1, x2 = jnp.split(x_BxTxNxd, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxTxNxd * cos + rotated * sin


def dot_attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, allowed_BxTxS):
  """Softmax attention with grouped kv heads and a boolean visibility mask.

  Query head h reads kv head h // (H / K). Scores and softmax are float32.
  A query with no visible key gets a uniform average (finite), never NaN.

  Returns:
    [B, T, H, d] in v's dtype.
  """
  b, t, h, d = q_BxTxHxd.shape
  k = k_BxSxKxd.shape[2]
  q_BxTxKxGxd = q_BxTxHxd.reshape(b, t, k, h // k, d)
  scores = jnp.einsum(
    'btkgd,bskd->bkgts', q_BxTxKxGxd, k_BxSxKxd, preferred_element_type=jnp.float32
  )
  scores = scores.astype(jnp.float32) / np.sqrt(d).astype(np.float32)
  scores = jnp.where(allowed_BxTxS[:, None, None, :, :], scores, NEG_INF)
  # Softmax in float32.
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxd.dtype)
  out = jnp.einsum('bkgts,bskd->btkgd', probs, v_BxSxKxd)
  return out.reshape(b, t, h, d)


def causal_attention(mask_BxT):
  """Dense causal attention for full sequences: key s is visible to query t iff
  s ≤ t and (mask[s] or s = t); left or right padding both work."""
  mask_BxT = mask_BxT.astype(bool)
  t = mask_BxT.shape[1]
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  # Every query also sees itself, so a padding query (which has no real key
  # before it) stays causal instead of averaging over every key.
  allowed_BxTxT = causal_TxT[None] & (mask_BxT[:, None, :] | jnp.eye(t, dtype=bool)[None])

  def attend(layer, q, k, v, cache):
    del layer
    return dot_attention(q, k, v, allowed_BxTxT), cache

  return attend


class Attention(nnx.Module):
  """Grouped-query self-attention: projections, q/k norm, RoPE; the attention
  itself is the caller's `attention` function."""

  def __init__(self, config, *, rngs):
    d, h, k, w = config.head_dim, config.num_heads, config.num_kv_heads, config.width
    self.q = Dense(w, h * d, config, rngs=rngs, bias=config.qkv_bias)
    self.k = Dense(w, k * d, config, rngs=rngs, bias=config.qkv_bias)
    self.v = Dense(w, k * d, config, rngs=rngs, bias=config.qkv_bias)
    self.o = Dense(h * d, w, config, rngs=rngs)
    self.q_norm = RMSNorm(d, config) if config.qk_norm else None
    self.k_norm = RMSNorm(d, config) if config.qk_norm else None
    self.config = config

  def __call__(self, x_BxTxD, positions_BxT, attention, layer, cache):
    cfg = self.config
    b, t, _ = x_BxTxD.shape
    q = self.q(x_BxTxD).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = self.k(x_BxTxD).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = self.v(x_BxTxD).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions_BxT, inv_freq)
    k = apply_rope(k, positions_BxT, inv_freq)
    out_BxTxHxd, cache = attention(layer, q, k, v, cache)
    return self.o(out_BxTxHxd.reshape(b, t, cfg.num_heads * cfg.head_dim)), cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) · up(x))."""

  def __init__(self, config, *, rngs):
    self.gate = Dense(config.width, config.mlp_width, config, rngs=rngs)
    self.up = Dense(config.width, config.mlp_width, config, rngs=rngs)
    self.down = Dense(config.mlp_width, config.width, config, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config, *, rngs):
    self.attn_norm = RMSNorm(config.width, config)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = RMSNorm(config.width, config)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, positions, attention, layer, cache):
    h, cache = self.attn(self.attn_norm(x), positions, attention, layer, cache)
    x = x + h
    x = x + self.mlp(self.mlp_norm(x))
    return x, cache


class Transformer(nnx.Module):
  """Embedding, L blocks, final norm; an LM head unless tied or disabled, and
  an optional scalar head `score` [D, 1] for values and rewards."""

  def __init__(self, config: ModelConfig, *, rngs, lm_head=True, scalar_head=False):
    self.config = config
    self.embed = Embed(config, rngs=rngs)
    self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.width, config)
    untied = lm_head and not config.tie_embeddings
    self.lm_head = Dense(config.width, config.vocab_size, config, rngs=rngs) if untied else None
    self.score = Dense(config.width, 1, config, rngs=rngs) if scalar_head else None
    self.has_lm_head = lm_head

  def __call__(self, tokens_BxT, positions_BxT, attention, caches=None):
    """Final normed hidden states [B, T, D] (compute dtype) and the caches."""
    x = self.embed(tokens_BxT)
    new_caches = []
    for i, layer in enumerate(self.layers):
      x, c = layer(x, positions_BxT, attention, i, None if caches is None else caches[i])
      new_caches.append(c)
    return self.final_norm(x), (None if caches is None else new_caches)

  def unembed(self):
    """[D, V] output projection in compute dtype (embedding transposed when tied)."""
    if not self.has_lm_head:
      raise ValueError('this model was built without an LM head (lm_head=False).')
    cd = self.config.compute_jnp_dtype
    if self.lm_head is None:
      return self.embed.embedding[...].T.astype(cd)
    return self.lm_head.kernel[...].astype(cd)

  def scalar(self, hidden_BxTxD):
    """[B, T] float32 scalar head output."""
    if self.score is None:
      raise ValueError('this model was built without a scalar head (scalar_head=False).')
    # The head is tiny: float32 for values and rewards.
    kernel = self.score.kernel[...].astype(jnp.float32)
    return (hidden_BxTxD.astype(jnp.float32) @ kernel)[..., 0]


# The pure boundary -----------------------------------------------------------


def create(config, key, *, lm_head=True, scalar_head=False):
  """Randomly initialised model as `(graphdef, params)`.

  Args:
    config: ModelConfig.
    key: PRNG key.
    lm_head: build the LM head (policy and reference).
    scalar_head: build the scalar `score` head (critic, reward model).

  Returns:
    (graphdef, params) with params an `nnx.State` of arrays.
  """
  model = Transformer(config, rngs=nnx.Rngs(params=key), lm_head=lm_head, scalar_head=scalar_head)
  return nnx.split(model)


def abstract(config, *, lm_head=True, scalar_head=False):
  """`(graphdef, params)` with `jax.ShapeDtypeStruct` leaves; allocates nothing."""
  model = nnx.eval_shape(
    lambda: Transformer(config, rngs=nnx.Rngs(params=0), lm_head=lm_head, scalar_head=scalar_head)
  )
  return nnx.split(model)


def positions_from_mask(mask_BxT):
  """Positions that start at 0 on each row's first real token (left padding)."""
  mask = mask_BxT.astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)


def _check_batch(tokens, mask, positions):
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f'`tokens` must be an int [B, T] array, got {tokens.dtype}{tokens.shape}.')
  if mask is not None and mask.shape != tokens.shape:
    raise ValueError(f'`mask` must have shape {tokens.shape}, got {mask.shape}.')
  if positions is not None and positions.shape != tokens.shape:
    raise ValueError(f'`positions` must have shape {tokens.shape}, got {positions.shape}.')


def hidden_states(graphdef, params, tokens, mask=None, positions=None):
  """Final normed hidden states for full sequences (training forward).

  Args:
    graphdef, params: from `create` / `abstract` / `jrl.models.hf.load`.
    tokens: [B, T] int.
    mask: [B, T] 1 on real tokens (None: all real). Left or right padding.
    positions: [B, T] int (None: `positions_from_mask(mask)`).

  Returns:
    [B, T, D] in compute dtype.
  """
  _check_batch(tokens, mask, positions)
  if mask is None:
    mask = jnp.ones(tokens.shape, bool)
  if positions is None:
    positions = positions_from_mask(mask)
  model = nnx.merge(graphdef, params)
  hidden, _ = model(tokens, positions, causal_attention(mask))
  return hidden


def logits(graphdef, params, tokens, mask=None, positions=None):
  """[B, T, V] float32 logits; position t scores token t + 1. Materialises the
  full logits: use `next_token_logprobs` for training."""
  hidden = hidden_states(graphdef, params, tokens, mask, positions)
  model = nnx.merge(graphdef, params)
  # Logits in float32.
  return jnp.dot(hidden, model.unembed(), preferred_element_type=jnp.float32).astype(jnp.float32)


def next_token_logprobs(
  graphdef,
  params,
  tokens,
  mask=None,
  positions=None,
  *,
  temperature=1.0,
  chunk_size=1024,
  with_entropy=False,
):
  """log p(token_t | tokens_<t), aligned with the tokens.

  Entry [b, t] is the log-probability of `tokens[b, t]` given the tokens
  before it (0 at t = 0, which has no prediction); with `with_entropy` also
  the entropy of that predictive distribution. Computed in chunks from the
  hidden states with `jrl.losses.token_logprobs_from_hidden`, so the
  [B, T, V] float32 logits never exist.

  Returns:
    (logp [B, T] float32, entropy [B, T] float32 (zeros unless with_entropy)).
  """
  hidden = hidden_states(graphdef, params, tokens, mask, positions)
  model = nnx.merge(graphdef, params)
  logp, ent = losses.token_logprobs_from_hidden(
    hidden[:, :-1],
    model.unembed(),
    tokens[:, 1:],
    temperature=temperature,
    chunk_size=chunk_size,
    with_entropy=with_entropy,
  )
  pad = ((0, 0), (1, 0))
  return jnp.pad(logp, pad), jnp.pad(ent, pad)


def values(graphdef, params, tokens, mask=None, positions=None):
  """[B, T] float32 scalar-head outputs (critic values per token)."""
  hidden = hidden_states(graphdef, params, tokens, mask, positions)
  return nnx.merge(graphdef, params).scalar(hidden)


def sequence_scores(graphdef, params, tokens, mask):
  """[B] float32 reward-model scores: the scalar head at each row's last real token."""
  v_BxT = values(graphdef, params, tokens, mask)
  t = mask.shape[1]
  last_B = t - 1 - jnp.argmax(mask.astype(bool)[:, ::-1], axis=-1)
  return jnp.take_along_axis(v_BxT, last_B[:, None], axis=-1)[:, 0]


# Logical axes of every parameter ---------------------------------------------

_LOGICAL_AXES = {
  ('embed', 'embedding'): ('vocab', 'embed'),
  ('attn', 'q', 'kernel'): ('embed', 'q_heads'),
  ('attn', 'k', 'kernel'): ('embed', 'kv_heads'),
  ('attn', 'v', 'kernel'): ('embed', 'kv_heads'),
  ('attn', 'o', 'kernel'): ('q_heads', 'embed'),
  ('attn', 'q', 'bias'): ('q_heads',),
  ('attn', 'k', 'bias'): ('kv_heads',),
  ('attn', 'v', 'bias'): ('kv_heads',),
  ('attn', 'q_norm', 'scale'): ('norm',),
  ('attn', 'k_norm', 'scale'): ('norm',),
  ('attn_norm', 'scale'): ('norm',),
  ('mlp_norm', 'scale'): ('norm',),
  ('mlp', 'gate', 'kernel'): ('embed', 'mlp'),
  ('mlp', 'up', 'kernel'): ('embed', 'mlp'),
  ('mlp', 'down', 'kernel'): ('mlp', 'embed'),
  ('final_norm', 'scale'): ('norm',),
  ('lm_head', 'kernel'): ('embed', 'vocab'),
  ('score', 'kernel'): ('embed', 'head_out'),
}


def param_logical_axes(path):
  """Logical axis names of the parameter at `path` (e.g. ('layers', 0, 'attn', 'q', 'kernel')).

  Raises:
    ValueError for a path the table does not know (every parameter must have
    a rule).
  """
  key = tuple(k for k in path if not isinstance(k, int))
  if key and key[0] == 'layers':
    key = key[1:]
  if key not in _LOGICAL_AXES:
    raise ValueError(f'no logical axes for parameter {"/".join(map(str, path))}.')
  return _LOGICAL_AXES[key]


def head_units(config):
  """Head dimensions are flattened (H·d); shard them only in whole heads."""
  return {'q_heads': config.head_dim, 'kv_heads': config.head_dim}


def create_sharded(config, key, mesh, *, lm_head=True, scalar_head=False, rules=None):
  """Random init with every parameter created directly in its sharding.

  Returns:
    (graphdef, params) with params laid out on `mesh` by the logical rules.
  """
  from jrl import parallel

  graphdef, abstract_params = abstract(config, lm_head=lm_head, scalar_head=scalar_head)
  shardings = parallel.param_shardings(
    mesh, abstract_params, param_logical_axes, rules, units=head_units(config)
  )

  def init(k):
    return create(config, k, lm_head=lm_head, scalar_head=scalar_head)[1]

  params = jax.jit(init, out_shardings=shardings)(key)
  return graphdef, params
