"""The layers of jrl's transformer (`jrl/models/transformer.py` assembles them).

One set of layers covers every family; the variants are fields of
`ModelConfig`: RMSNorm (w or 1 + w scaling), rotary embeddings (rope_theta,
linear or Llama 3 scaling, a second base for local layers), grouped-query
attention with an optional sliding window per layer, score scale and
soft-capping, Qwen2's q/k/v biases, q/k RMSNorm, SwiGLU or GeGLU MLPs or
top-k routed experts (a MoE layer returns its router logits next to its
output), post-attention and post-MLP norms, a scaled embedding.

Attention is pluggable. Each layer computes rotated q, k and v and hands
them to `attention(layer, q, k, v, cache) -> (out, cache)`. Training uses
`causal_attention(mask, positions, config)` (dense, no cache); the sampler
passes a function that writes k, v into its paged KV cache and attends over
the pages. Both run these same layers on the same parameters, and both read
the layer's window, scale and soft-cap from `attention_options(config, layer)`.

Numerics: parameters are stored in `config.param_dtype` and cast to
`config.compute_dtype` for matmuls; RMSNorm statistics, rotary angles,
attention softmax and router softmax are float32.

LoRA: with `config.lora`, the targeted projections carry adapters
`lora_a` [in, r] and `lora_b` [r, out] (`nnx.LoRAParam`) and compute
x W + (alpha / r)·(x A) B; `jrl/models/lora.py` splits, merges and exports them.

Shapes: B batch, T tokens, D width, F MLP width, H query heads, K kv heads,
d head width, E experts, N = B·T token rows.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jrl.models.attention import apply_rope
from jrl.models.config import rope_inv_freq
from jrl.models.moe import experts_dense, experts_ragged, mlp_activation, route

# attention(layer, q_BxTxHxd, k_BxTxKxd, v_BxTxKxd, cache) -> (out_BxTxHxd, cache)
AttentionFn = Callable


class Dense(nnx.Module):
  """y = x @ kernel (+ bias); kernel [in, out] stored in param dtype.

  With `lora` (the config's `lora` must be set), also low-rank adapters
  A [in, r] ~ N(0, 1/in) and B [r, out] = 0, drawn from the `lora` stream of
  `rngs` (so the base weights do not depend on them), and
  y = x W (+ bias) + (alpha / r)·(x A) B: A B is never formed.
  """

  def __init__(self, in_dim, out_dim, config, *, rngs, bias=False, lora=False):
    init = nnx.initializers.normal(config.init_std)
    dtype = config.param_jnp_dtype
    self.kernel = nnx.Param(init(rngs.params(), (in_dim, out_dim), dtype))
    self.bias = nnx.Param(jnp.zeros((out_dim,), dtype)) if bias else None
    self.compute_dtype = config.compute_jnp_dtype
    self.lora_a = self.lora_b = None
    self.lora_scale = config.lora.scale if lora else None
    if lora:
      r = config.lora.rank
      a_init = nnx.initializers.normal(1.0 / math.sqrt(in_dim))
      self.lora_a = nnx.data(nnx.LoRAParam(a_init(rngs.lora(), (in_dim, r), dtype)))
      self.lora_b = nnx.data(nnx.LoRAParam(jnp.zeros((r, out_dim), dtype)))

  def __call__(self, x):
    cd = self.compute_dtype
    x = x.astype(cd)
    y = jnp.dot(x, self.kernel[...].astype(cd))
    if self.bias is not None:
      y = y + self.bias[...].astype(cd)
    if self.lora_a is not None:
      xa = jnp.dot(x, self.lora_a[...].astype(cd))
      y = y + jnp.dot(xa, self.lora_b[...].astype(cd)) * jnp.asarray(self.lora_scale, cd)
    return y


def _lora(config, target):
  """Whether the projection `target` (a Hugging Face name) gets adapters."""
  return config.lora is not None and target in config.lora.targets


class RMSNorm(nnx.Module):
  """x / sqrt(mean(x²) + ε) · scale, the statistics in float32.

  With `config.norm_plus_one` (Gemma) the factor is (1 + scale), applied in
  float32 before the cast back (Llama casts first, then scales); the stored
  scale starts at 0.
  """

  def __init__(self, dim, config):
    init = jnp.zeros if config.norm_plus_one else jnp.ones
    self.scale = nnx.Param(init((dim,), config.param_jnp_dtype))
    self.eps = config.rms_eps
    self.plus_one = config.norm_plus_one

  def __call__(self, x):
    dtype = x.dtype
    # Norm statistics in float32 whatever the compute dtype.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    if self.plus_one:
      return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(dtype)
    return normed.astype(dtype) * self.scale[...].astype(dtype)


class Embed(nnx.Module):
  """Token embedding table [V, D]."""

  def __init__(self, config, *, rngs):
    init = nnx.initializers.normal(config.init_std)
    self.embedding = nnx.Param(
      init(rngs.params(), (config.vocab_size, config.width), config.param_jnp_dtype)
    )
    self.compute_dtype = config.compute_jnp_dtype
    self.scale = math.sqrt(config.width) if config.embed_scale else None

  def __call__(self, tokens_BxT):
    x = jnp.take(self.embedding[...], tokens_BxT, axis=0).astype(self.compute_dtype)
    if self.scale is not None:
      # Gemma: sqrt(D) rounded to the compute dtype first, as Hugging Face does.
      x = x * jnp.asarray(self.scale, self.compute_dtype)
    return x


class Attention(nnx.Module):
  """Grouped-query self-attention: projections, q/k norm, RoPE; the attention
  itself is the caller's `attention` function."""

  def __init__(self, config, layer, *, rngs):
    d, h, k, w = config.head_dim, config.num_heads, config.num_kv_heads, config.width
    bias = config.qkv_bias
    self.q = Dense(w, h * d, config, rngs=rngs, bias=bias, lora=_lora(config, 'q_proj'))
    self.k = Dense(w, k * d, config, rngs=rngs, bias=bias, lora=_lora(config, 'k_proj'))
    self.v = Dense(w, k * d, config, rngs=rngs, bias=bias, lora=_lora(config, 'v_proj'))
    self.o = Dense(h * d, w, config, rngs=rngs, lora=_lora(config, 'o_proj'))
    self.q_norm = RMSNorm(d, config) if config.qk_norm else None
    self.k_norm = RMSNorm(d, config) if config.qk_norm else None
    self.config = config
    self.sliding = config.is_sliding(layer)  # selects the local rope base (Gemma 3)

  def __call__(self, x_BxTxD, positions_BxT, attention, layer, cache):
    cfg = self.config
    b, t, _ = x_BxTxD.shape
    q = self.q(x_BxTxD).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = self.k(x_BxTxD).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = self.v(x_BxTxD).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(cfg, sliding=self.sliding)
    q = apply_rope(q, positions_BxT, inv_freq)
    k = apply_rope(k, positions_BxT, inv_freq)
    out_BxTxHxd, cache = attention(layer, q, k, v, cache)
    return self.o(out_BxTxHxd.reshape(b, t, cfg.num_heads * cfg.head_dim)), cache


class MLP(nnx.Module):
  """Gated MLP: down(act(gate(x)) · up(x)); SwiGLU (silu) or GeGLU (gelu, tanh
  approximation)."""

  def __init__(self, config, *, rngs):
    d, f = config.width, config.mlp_width
    self.gate = Dense(d, f, config, rngs=rngs, lora=_lora(config, 'gate_proj'))
    self.up = Dense(d, f, config, rngs=rngs, lora=_lora(config, 'up_proj'))
    self.down = Dense(f, d, config, rngs=rngs, lora=_lora(config, 'down_proj'))
    self.activation = config.activation

  def __call__(self, x):
    return self.down(mlp_activation(self.activation, self.gate(x)) * self.up(x))


class MoE(nnx.Module):
  """Top-k routed experts (Qwen3-MoE layout): a linear router [D, E], and
  per-expert gated MLPs stacked as gate, up [E, D, F] and down [E, F, D].

  Routing weights are the float32 softmax probabilities of the top k
  (renormalised with `norm_topk_prob`), cast to the compute dtype. Every
  token reaches its k experts (no capacity, no dropped tokens).
  """

  def __init__(self, config, *, rngs):
    e, d, f = config.num_experts, config.width, config.moe_mlp_width
    init = nnx.initializers.normal(config.init_std)
    dtype = config.param_jnp_dtype
    self.router = Dense(d, e, config, rngs=rngs)
    self.gate = nnx.Param(init(rngs.params(), (e, d, f), dtype))
    self.up = nnx.Param(init(rngs.params(), (e, d, f), dtype))
    self.down = nnx.Param(init(rngs.params(), (e, f, d), dtype))
    self.config = config

  def __call__(self, x_BxTxD):
    """(output [B, T, D], router logits [B·T, E] in compute dtype)."""
    cfg = self.config
    b, t, d = x_BxTxD.shape
    cd = cfg.compute_jnp_dtype
    x_NxD = x_BxTxD.reshape(b * t, d)
    logits_NxE = self.router(x_NxD)
    weights_NxK, experts_NxK = route(logits_NxE, cfg.experts_per_token, cfg.norm_topk_prob)
    weights_NxK = weights_NxK.astype(cd)
    fn = experts_ragged if cfg.moe_impl == 'ragged' else experts_dense
    y_NxD = fn(
      x_NxD,
      weights_NxK,
      experts_NxK,
      self.gate[...].astype(cd),
      self.up[...].astype(cd),
      self.down[...].astype(cd),
      cfg.activation,
    )
    return y_NxD.reshape(b, t, d), logits_NxE


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

  With `config.post_norms` (Gemma) the attention and MLP outputs are normed
  again before the residual add: x + post_norm(attn(pre_norm(x))). The MLP is
  a MoE layer where `config.is_moe(layer)`.
  """

  def __init__(self, config, layer, *, rngs):
    self.attn_norm = RMSNorm(config.width, config)
    self.attn = Attention(config, layer, rngs=rngs)
    post = config.post_norms
    self.mlp_norm = None if post else RMSNorm(config.width, config)
    self.post_attn_norm = RMSNorm(config.width, config) if post else None
    self.pre_mlp_norm = RMSNorm(config.width, config) if post else None
    self.post_mlp_norm = RMSNorm(config.width, config) if post else None
    moe = config.is_moe(layer)
    self.mlp = None if moe else MLP(config, rngs=rngs)
    self.moe = MoE(config, rngs=rngs) if moe else None

  def __call__(self, x, positions, attention, layer, cache):
    """(x [B, T, D], cache, router logits [B·T, E] or None)."""
    h, cache = self.attn(self.attn_norm(x), positions, attention, layer, cache)
    if self.post_attn_norm is not None:
      h = self.post_attn_norm(h)
    x = x + h
    h = self.mlp_norm(x) if self.mlp_norm is not None else self.pre_mlp_norm(x)
    router_logits = None
    if self.moe is not None:
      h, router_logits = self.moe(h)
    else:
      h = self.mlp(h)
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    return x + h, cache, router_logits
