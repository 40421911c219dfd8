"""Model configuration: Llama 3, Qwen2 / 2.5 / 3, Qwen3-MoE, Mistral, Gemma 2
and Gemma 3 (text).

`ModelConfig` is a frozen dataclass of plain values; it is hashable and lives
in the model's static graph. The families differ only in fields of this one
config (the model code is shared):

| family    | what its fields switch on                                            |
|-----------|----------------------------------------------------------------------|
| llama     | the base: RMSNorm, RoPE (Llama 3 scaling), GQA, SwiGLU               |
| qwen2     | + q/k/v biases                                                       |
| qwen3     | + q/k RMSNorm                                                        |
| qwen3_moe | + top-k routed experts (`num_experts`, `experts_per_token`, ...)     |
| mistral   | + a sliding window on every layer (`sliding_window`)                 |
| gemma2    | (1 + w) norms, sqrt(D) embedding scale, GeGLU, post-attention and    |
|           | post-MLP norms, query_pre_attn_scalar, attention and final logit     |
|           | soft-capping, local (sliding) and global layers (`layer_types`)      |
| gemma3    | gemma2 without soft-capping, + q/k norm and a second rope base for   |
|           | the local layers (`local_rope_theta`)                                |

`ModelConfig.from_hf(dict)` / `to_hf()` map a Hugging Face `config.json`
(`config_hf.py`); the fields' value sets and sub-configs are in
`config_fields.py`. Four fields change how the model trains, not what it
computes, and are never written to `config.json`: `remat` (per-layer
activation checkpointing), `scan_layers` (one `jax.lax.scan` over the layers),
`attention_impl` (the attention kernel of the training passes)
and `lora` (a `LoraConfig`, see `jrl/models/lora.py`). Pass them as
overrides: `ModelConfig.from_hf(hf, remat='full')`, `hf.load(path, remat=...)`.
"""

import dataclasses
import math

import jax.numpy as jnp

from jrl.models import config_hf
from jrl.models.config_fields import (
  ACTIVATIONS,
  ARCHITECTURES,
  ATTENTION_IMPLS,
  DTYPES,
  FAMILIES,
  LAYER_TYPES,
  LORA_TARGETS,
  MOE_IMPLS,
  REMAT_POLICIES,
  LinearRopeScaling,
  LoraConfig,
  RopeScaling,
  _positive_int,
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer.

  Dimension letters: V vocab, D width, F MLP width, L layers, H query heads,
  K key/value heads, d head width, E experts.
  """

  vocab_size: int  # V
  width: int  # D
  mlp_width: int  # F
  num_layers: int  # L
  num_heads: int  # H
  num_kv_heads: int  # K; H % K == 0 (grouped-query attention)
  head_dim: int  # d
  family: str = 'llama'  # a key of FAMILIES: the names written by `to_hf`
  rms_eps: float = 1e-6
  rope_theta: float = 10000.0  # rope base (of the global layers when local_rope_theta is set)
  rope_scaling: RopeScaling | LinearRopeScaling | None = None  # global layers only
  qkv_bias: bool = False  # Qwen2 / Qwen2.5
  qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over d on queries and keys
  tie_embeddings: bool = False  # unembedding = embedding transposed
  activation: str = 'silu'  # MLP gate: 'silu' (SwiGLU) | 'gelu_tanh' (GeGLU, Gemma)
  # Attention variants.
  sliding_window: int | None = None  # W: a query sees keys < W positions back (None: all)
  layer_types: tuple[str, ...] | None = None  # per layer 'full' | 'sliding' (None: all
  # sliding when sliding_window is set, else all full)
  local_rope_theta: float | None = None  # Gemma 3: rope base of the sliding layers
  attn_scale: float | None = None  # score scale; Gemma: query_pre_attn_scalar**-0.5 (None: d**-0.5)
  attn_softcap: float | None = None  # Gemma 2: scores -> c·tanh(scores / c)
  final_softcap: float | None = None  # Gemma 2: logits -> c·tanh(logits / c)
  # Gemma block numerics.
  norm_plus_one: bool = False  # RMSNorm scales by (1 + w), in float32 before the cast
  embed_scale: bool = False  # embeddings times sqrt(D), rounded to the compute dtype
  post_norms: bool = False  # RMSNorm on the attention and MLP outputs before the residual add
  # Mixture of experts (Qwen3-MoE layout); num_experts = 0: every MLP is dense.
  num_experts: int = 0  # E
  experts_per_token: int = 0  # k: top-k routing
  moe_mlp_width: int = 0  # F of one expert
  norm_topk_prob: bool = True  # renormalise the k routing weights to sum to 1
  moe_step: int = 1  # layer i is MoE iff (i + 1) % moe_step == 0 (HF decoder_sparse_step) ...
  dense_layers: tuple[int, ...] = ()  # ... and i not in dense_layers (HF mlp_only_layers)
  moe_impl: str = 'ragged'  # dispatch: 'ragged' (sorted tokens, k/E of the FLOPs) | 'dense'
  max_positions: int = 4096
  init_std: float = 0.02  # normal init of kernels and embeddings
  param_dtype: str = 'float32'  # storage dtype of the parameters
  compute_dtype: str = 'float32'  # matmul dtype; norms, softmax and logits stay float32
  # Training memory and speed (not written to config.json).
  remat: str = 'none'  # per-layer activation checkpointing policy: one of REMAT_POLICIES
  # Run the layers in one jax.lax.scan (every layer alike). The weights are stacked per
  # step: a copy of them and of their gradients (SmolLM2-135M: +0.8 GiB temp at 2x256
  # tokens with remat='full'), for a 6x shorter trace; XLA:CPU compiles it no faster.
  scan_layers: bool = False
  # Attention kernel of the training passes: one of ATTENTION_IMPLS ('auto': by backend,
  # see jrl/models/attention_kernels.py; the sampler's paged attention is separate).
  attention_impl: str = 'auto'
  lora: LoraConfig | None = None  # low-rank adapters on the projections (None: off)

  def __post_init__(self):
    for name in ('vocab_size', 'width', 'mlp_width', 'num_layers', 'num_heads'):
      _positive_int(getattr(self, name), name)
    _positive_int(self.num_kv_heads, 'num_kv_heads')
    _positive_int(self.head_dim, 'head_dim')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
        f'`num_heads` ({self.num_heads}) must be a multiple of `num_kv_heads` '
        f'({self.num_kv_heads}).'
      )
    if self.head_dim % 2:
      raise ValueError(f'`head_dim` must be even for rotary embeddings, got {self.head_dim}.')
    _positive_int(self.max_positions, 'max_positions')
    if not self.init_std > 0:
      raise ValueError(f'`init_std` must be > 0, got {self.init_std}.')
    for name in ('param_dtype', 'compute_dtype'):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f'`{name}` must be one of {DTYPES}, got {getattr(self, name)!r}.')
    if not self.rms_eps > 0:
      raise ValueError(f'`rms_eps` must be > 0, got {self.rms_eps}.')
    if not self.rope_theta > 0:
      raise ValueError(f'`rope_theta` must be > 0, got {self.rope_theta}.')
    if self.family not in FAMILIES:
      raise ValueError(f'`family` must be one of {sorted(FAMILIES)}, got {self.family!r}.')
    if self.activation not in ACTIVATIONS:
      raise ValueError(f'`activation` must be one of {ACTIVATIONS}, got {self.activation!r}.')
    if self.sliding_window is not None:
      _positive_int(self.sliding_window, 'sliding_window')
    if self.layer_types is not None:
      if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
        raise ValueError(
          f'`layer_types` must be a tuple of {self.num_layers} entries, got {self.layer_types!r}.'
        )
      bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
      if bad:
        raise ValueError(f'`layer_types` entries must be in {LAYER_TYPES}, got {bad}.')
      if 'sliding' in self.layer_types and self.sliding_window is None:
        raise ValueError('`layer_types` has sliding layers but `sliding_window` is None.')
    for name in ('local_rope_theta', 'attn_scale', 'attn_softcap', 'final_softcap'):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f'`{name}` must be > 0 or None, got {value!r}.')
    if self.num_experts:
      for name in ('num_experts', 'experts_per_token', 'moe_mlp_width', 'moe_step'):
        _positive_int(getattr(self, name), name)
      if self.experts_per_token > self.num_experts:
        raise ValueError(
          f'`experts_per_token` ({self.experts_per_token}) exceeds `num_experts` '
          f'({self.num_experts}).'
        )
      if self.moe_impl not in MOE_IMPLS:
        raise ValueError(f'`moe_impl` must be one of {MOE_IMPLS}, got {self.moe_impl!r}.')
    if not isinstance(self.dense_layers, tuple):
      raise ValueError(
        f'`dense_layers` must be a tuple of layer indices, got {self.dense_layers!r}.'
      )
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'`remat` must be one of {REMAT_POLICIES}, got {self.remat!r}.')
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
        f'`attention_impl` must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}.'
      )
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f'`scan_layers` must be a bool, got {self.scan_layers!r}.')
    if self.scan_layers:
      kinds = {(self.window(i), self.is_sliding(i), self.is_moe(i)) for i in range(self.num_layers)}
      if len(kinds) > 1:
        raise ValueError(
          '`scan_layers`=True needs every layer alike, but this model mixes sliding and '
          'global attention or dense and MoE layers; use scan_layers=False.'
        )
    if self.lora is not None:
      if not isinstance(self.lora, LoraConfig):
        raise ValueError(f'`lora` must be a LoraConfig or None, got {self.lora!r}.')
      mlp = {'gate_proj', 'up_proj', 'down_proj'} & set(self.lora.targets)
      if mlp and any(self.is_moe(i) for i in range(self.num_layers)):
        raise ValueError(
          f'`lora.targets` {sorted(mlp)}: adapters on MoE experts are not supported; '
          'target the attention projections only.'
        )

  @property
  def param_jnp_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def compute_jnp_dtype(self):
    return jnp.dtype(self.compute_dtype)

  def replace(self, **changes):
    return dataclasses.replace(self, **changes)

  # Per-layer structure.

  def is_sliding(self, layer):
    """Whether layer `layer` attends within the sliding window."""
    if self.sliding_window is None:
      return False
    if self.layer_types is None:
      return True
    return self.layer_types[layer] == 'sliding'

  def window(self, layer):
    """The sliding window W of layer `layer`, or None (global attention)."""
    return self.sliding_window if self.is_sliding(layer) else None

  def is_moe(self, layer):
    """Whether layer `layer` has routed experts instead of a dense MLP."""
    return (
      self.num_experts > 0 and layer not in self.dense_layers and (layer + 1) % self.moe_step == 0
    )

  def num_params(self, with_lm_head=True, active=False):
    """Parameter count (embedding counted once when tied).

    With `active`, only the parameters one token uses: k of the E experts of
    each MoE layer (the router counted whole).
    """
    d, f, v = self.width, self.mlp_width, self.vocab_size
    q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    attn = d * q + 2 * d * kv + q * d
    if self.qkv_bias:
      attn += q + 2 * kv
    if self.qk_norm:
      attn += 2 * self.head_dim
    norms = (4 if self.post_norms else 2) * d
    total = 0
    for layer in range(self.num_layers):
      if self.is_moe(layer):
        experts = self.experts_per_token if active else self.num_experts
        mlp = d * self.num_experts + experts * 3 * d * self.moe_mlp_width
      else:
        mlp = 3 * d * f
      total += attn + mlp + norms
    head = 0 if self.tie_embeddings or not with_lm_head else d * v
    return v * d + total + d + head

  @classmethod
  def from_hf(cls, hf, *, source='config.json', **overrides):
    """Builds a config from a Hugging Face `config.json` dict.

    Args:
      hf: the parsed JSON.
      source: the file name used in error messages.
      **overrides: fields to set on top (e.g. param_dtype, compute_dtype).

    Raises:
      ValueError naming the field and `source` for anything unsupported.
    """
    return config_hf.from_hf(cls, hf, source=source, overrides=overrides)

  def to_hf(self, base=None):
    """A Hugging Face `config.json` dict; `base` (the dict read) is kept and updated."""
    return config_hf.to_hf(self, base)


def rope_inv_freq(config, sliding=False):
  """[d/2] float32 inverse frequencies θ^(−2i/d), with the config's scaling.

  `sliding` selects the rope of the sliding-window layers: base
  `local_rope_theta` and no scaling when that is set (Gemma 3), else the
  same rope as every other layer.

  Linear scaling (position interpolation) divides every frequency by
  `factor`. Llama 3 scaling (Meta, 2024) leaves high frequencies (wavelength
  below original_max / high_freq_factor) alone, divides low frequencies
  (wavelength above original_max / low_freq_factor) by `factor`, and blends
  linearly in between.
  """
  import numpy as np

  # float32 throughout, as Hugging Face computes it, so positions match bitwise.
  f32 = np.float32
  d = config.head_dim
  local = sliding and config.local_rope_theta is not None
  theta = config.local_rope_theta if local else config.rope_theta
  inv = f32(1.0) / (f32(theta) ** (np.arange(0, d, 2).astype(f32) / f32(d)))
  s = None if local else config.rope_scaling
  if isinstance(s, LinearRopeScaling):
    inv = inv / f32(s.factor)
  elif s is not None:
    wavelen = f32(2 * math.pi) / inv
    low_wavelen = f32(s.original_max_positions / s.low_freq_factor)
    high_wavelen = f32(s.original_max_positions / s.high_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / f32(s.factor), inv)
    smooth = (f32(s.original_max_positions) / wavelen - f32(s.low_freq_factor)) / f32(
      s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / f32(s.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    inv = np.where(medium, blended, scaled)
  return np.asarray(inv, f32)


__all__ = [
  'ACTIVATIONS',
  'ARCHITECTURES',
  'DTYPES',
  'FAMILIES',
  'LAYER_TYPES',
  'LORA_TARGETS',
  'MOE_IMPLS',
  'REMAT_POLICIES',
  'LinearRopeScaling',
  'LoraConfig',
  'ModelConfig',
  'RopeScaling',
  'rope_inv_freq',
]
