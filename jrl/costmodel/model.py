"""Models: presets with public architectures, and per-token arithmetic (matmul
weights, forward FLOPs, KV-cache bytes)."""

from jrl.models.config import ModelConfig

# Models with public architectures (for planning; the numbers are their config.json fields).
MODEL_PRESETS = {
  'qwen2.5-0.5b': dict(
    vocab_size=151936,
    width=896,
    mlp_width=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    tie_embeddings=True,
    qkv_bias=True,
  ),
  'qwen2.5-7b': dict(
    vocab_size=152064,
    width=3584,
    mlp_width=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    tie_embeddings=False,
    qkv_bias=True,
  ),
  'llama3-8b': dict(
    vocab_size=128256,
    width=4096,
    mlp_width=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    tie_embeddings=False,
  ),
  'qwen2.5-32b': dict(
    vocab_size=152064,
    width=5120,
    mlp_width=27648,
    num_layers=64,
    num_heads=40,
    num_kv_heads=8,
    head_dim=128,
    tie_embeddings=False,
    qkv_bias=True,
  ),
  'mistral-7b': dict(
    family='mistral',
    vocab_size=32000,
    width=4096,
    mlp_width=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    sliding_window=4096,
  ),
  'gemma2-2b': dict(
    family='gemma2',
    vocab_size=256000,
    width=2304,
    mlp_width=9216,
    num_layers=26,
    num_heads=8,
    num_kv_heads=4,
    head_dim=256,
    tie_embeddings=True,
    activation='gelu_tanh',
    sliding_window=4096,
    layer_types=tuple('sliding' if (i + 1) % 2 else 'full' for i in range(26)),
    attn_scale=256**-0.5,
    attn_softcap=50.0,
    final_softcap=30.0,
    norm_plus_one=True,
    embed_scale=True,
    post_norms=True,
  ),
  'gemma3-1b': dict(
    family='gemma3',
    vocab_size=262144,
    width=1152,
    mlp_width=6912,
    num_layers=26,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    tie_embeddings=True,
    activation='gelu_tanh',
    qk_norm=True,
    sliding_window=512,
    layer_types=tuple('sliding' if (i + 1) % 6 else 'full' for i in range(26)),
    rope_theta=1e6,
    local_rope_theta=1e4,
    attn_scale=256**-0.5,
    norm_plus_one=True,
    embed_scale=True,
    post_norms=True,
  ),
  'qwen3-30b-a3b': dict(
    family='qwen3_moe',
    vocab_size=151936,
    width=2048,
    mlp_width=6144,
    num_layers=48,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    qk_norm=True,
    num_experts=128,
    experts_per_token=8,
    moe_mlp_width=768,
  ),
}


def model_preset(name, **overrides):
  if name not in MODEL_PRESETS:
    raise ValueError(f'unknown model preset {name!r}; have {sorted(MODEL_PRESETS)}.')
  return ModelConfig(**{**MODEL_PRESETS[name], **overrides})


# Model arithmetic ---------------------------------------------------------------


def matmul_params(model):
  """Weights that take part in a token's matmuls: all but the embedding lookup
  (a tied embedding takes part as the LM head); of a MoE layer, the router and
  the k experts the token is routed to."""
  active = model.num_params(active=True)
  return active - (0 if model.tie_embeddings else model.vocab_size * model.width)


def flops_per_token(model, context):
  """Forward FLOPs of one token attending to `context` keys (at most the
  window on sliding-window layers)."""
  q = model.num_heads * model.head_dim
  keys = sum(
    context if model.window(i) is None else min(context, model.window(i))
    for i in range(model.num_layers)
  )
  return 2 * matmul_params(model) + 4 * q * keys


def kv_bytes_per_token(model, dtype_bytes):
  return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes
