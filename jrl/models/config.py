"""Model configuration: the Llama 3 and Qwen2 / Qwen2.5 / Qwen3 families.

`ModelConfig` is a frozen dataclass of plain values; it is hashable and lives
in the model's static graph. `ModelConfig.from_hf(dict)` reads a Hugging Face
`config.json` (old style with `rope_theta` / `rope_scaling`, or the newer
`rope_parameters`), and refuses what it cannot run exactly (an unknown
architecture, sliding-window attention, an activation other than SiLU, a
rope type other than default / llama3) with an error naming the field.
"""

import dataclasses
import math

import jax.numpy as jnp

ARCHITECTURES = {
  'LlamaForCausalLM': 'llama',
  'Qwen2ForCausalLM': 'qwen2',
  'Qwen3ForCausalLM': 'qwen3',
  'LlamaForSequenceClassification': 'llama',
  'Qwen2ForSequenceClassification': 'qwen2',
  'Qwen3ForSequenceClassification': 'qwen3',
}
DTYPES = ('float32', 'bfloat16', 'float16')


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 frequency scaling (rope_type 'llama3')."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_positions: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer.

  Dimension letters: V vocab, D width, F MLP width, L layers, H query heads,
  K key/value heads, d head width.
  """

  vocab_size: int  # V
  width: int  # D
  mlp_width: int  # F
  num_layers: int  # L
  num_heads: int  # H
  num_kv_heads: int  # K; H % K == 0 (grouped-query attention)
  head_dim: int  # d
  family: str = 'llama'  # 'llama' | 'qwen2' | 'qwen3', for messages only
  rms_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  qkv_bias: bool = False  # Qwen2 / Qwen2.5
  qk_norm: bool = False  # Qwen3: RMSNorm over d on queries and keys
  tie_embeddings: bool = False  # unembedding = embedding transposed
  max_positions: int = 4096
  init_std: float = 0.02  # normal init of kernels and embeddings
  param_dtype: str = 'float32'  # storage dtype of the parameters
  compute_dtype: str = 'float32'  # matmul dtype; norms, softmax and logits stay float32

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

  @property
  def param_jnp_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def compute_jnp_dtype(self):
    return jnp.dtype(self.compute_dtype)

  def replace(self, **changes):
    return dataclasses.replace(self, **changes)

  def num_params(self, with_lm_head=True):
    """Parameter count (embedding counted once when tied)."""
    d, f, v = self.width, self.mlp_width, self.vocab_size
    q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    attn = d * q + 2 * d * kv + q * d
    if self.qkv_bias:
      attn += q + 2 * kv
    if self.qk_norm:
      attn += 2 * self.head_dim
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings or not with_lm_head else d * v
    return v * d + self.num_layers * layer + d + head

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

    def need(key):
      if key not in hf:
        raise ValueError(f'{source}: missing field `{key}`.')
      return hf[key]

    archs = hf.get('architectures') or []
    model_type = hf.get('model_type')
    family = None
    for arch in archs:
      family = ARCHITECTURES.get(arch)
      if family:
        break
    if family is None and not archs and model_type in ('llama', 'qwen2', 'qwen3'):
      family = model_type
    if family is None:
      raise ValueError(
        f'{source}: unsupported architecture `architectures`={archs!r} '
        f'(model_type={model_type!r}); supported: {sorted(ARCHITECTURES)}.'
      )
    if model_type is not None and model_type != family:
      raise ValueError(
        f'{source}: `model_type`={model_type!r} contradicts `architectures`={archs!r} '
        f'(a {family} model); fix one of them.'
      )
    act = hf.get('hidden_act', 'silu')
    if act != 'silu':
      raise ValueError(f'{source}: `hidden_act`={act!r} is not supported (only "silu").')
    # Qwen2 applies the window to layers >= max_window_layers only.
    if hf.get('use_sliding_window', False) and hf.get('max_window_layers', 0) < hf.get(
      'num_hidden_layers', 0
    ):
      raise ValueError(
        f'{source}: `use_sliding_window`=true with `max_window_layers` below '
        '`num_hidden_layers` (sliding-window attention) is not supported.'
      )
    if hf.get('mlp_bias', False):
      raise ValueError(f'{source}: `mlp_bias`=true is not supported.')

    num_heads = need('num_attention_heads')
    width = need('hidden_size')
    head_dim = hf.get('head_dim') or width // num_heads
    rope = dict(hf.get('rope_parameters') or {})
    legacy = hf.get('rope_scaling') or {}
    rope_theta = rope.get('rope_theta', hf.get('rope_theta', 10000.0))
    rope_type = rope.get('rope_type') or legacy.get('rope_type') or legacy.get('type') or 'default'
    scaling_src = rope if rope.get('rope_type') == 'llama3' else legacy
    scaling = None
    if rope_type == 'llama3':
      try:
        scaling = RopeScaling(
          factor=float(scaling_src['factor']),
          low_freq_factor=float(scaling_src['low_freq_factor']),
          high_freq_factor=float(scaling_src['high_freq_factor']),
          original_max_positions=int(scaling_src['original_max_position_embeddings']),
        )
      except KeyError as e:
        raise ValueError(f'{source}: llama3 rope scaling is missing `{e.args[0]}`.') from None
    elif rope_type != 'default':
      raise ValueError(
        f'{source}: rope type {rope_type!r} (`rope_scaling`/`rope_parameters`) is not '
        'supported; supported: default, llama3.'
      )
    fields = {
      'vocab_size': need('vocab_size'),
      'width': width,
      'mlp_width': need('intermediate_size'),
      'num_layers': need('num_hidden_layers'),
      'num_heads': num_heads,
      'num_kv_heads': hf.get('num_key_value_heads', num_heads),
      'head_dim': head_dim,
      'family': family,
      'rms_eps': float(hf.get('rms_norm_eps', 1e-6)),
      'rope_theta': float(rope_theta),
      'rope_scaling': scaling,
      'qkv_bias': bool(hf.get('attention_bias', family == 'qwen2')),
      'qk_norm': family == 'qwen3',
      'tie_embeddings': bool(hf.get('tie_word_embeddings', False)),
      'max_positions': int(hf.get('max_position_embeddings', 4096)),
      'init_std': float(hf.get('initializer_range', 0.02)),
    }
    fields.update(overrides)
    try:
      return cls(**fields)
    except ValueError as e:
      raise ValueError(f'{source}: {e}') from None

  def to_hf(self, base=None):
    """A Hugging Face `config.json` dict; `base` (the dict read) is kept and updated."""
    arch = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM'}
    out = dict(base or {})
    out.setdefault('architectures', [arch[self.family]])
    out.setdefault('model_type', self.family)
    out.update(
      {
        'vocab_size': self.vocab_size,
        'hidden_size': self.width,
        'intermediate_size': self.mlp_width,
        'num_hidden_layers': self.num_layers,
        'num_attention_heads': self.num_heads,
        'num_key_value_heads': self.num_kv_heads,
        'head_dim': self.head_dim,
        'rms_norm_eps': self.rms_eps,
        'tie_word_embeddings': self.tie_embeddings,
        'max_position_embeddings': self.max_positions,
        'hidden_act': 'silu',
        'initializer_range': self.init_std,
      }
    )
    if self.family != 'qwen3':
      out['attention_bias'] = self.qkv_bias
    if base is None or 'rope_parameters' in base or 'rope_theta' not in base:
      rope = {'rope_type': 'default', 'rope_theta': self.rope_theta}
      if self.rope_scaling is not None:
        rope = {'rope_type': 'llama3', 'rope_theta': self.rope_theta, **self._scaling_dict()}
      out['rope_parameters'] = rope
    else:
      out['rope_theta'] = self.rope_theta
      if self.rope_scaling is not None:
        out['rope_scaling'] = {'rope_type': 'llama3', **self._scaling_dict()}
    # The dtype the tensors are written in (newer files say `dtype`, older `torch_dtype`).
    if 'torch_dtype' in out:
      out['torch_dtype'] = self.param_dtype
    if 'dtype' in out or 'torch_dtype' not in out:
      out['dtype'] = self.param_dtype
    return out

  def _scaling_dict(self):
    s = self.rope_scaling
    return {
      'factor': s.factor,
      'low_freq_factor': s.low_freq_factor,
      'high_freq_factor': s.high_freq_factor,
      'original_max_position_embeddings': s.original_max_positions,
    }


def _positive_int(value, name):
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f'`{name}` must be a positive int, got {value!r}.')


def rope_inv_freq(config):
  """[d/2] float32 inverse frequencies θ^(−2i/d), with Llama 3 scaling if set.

  Llama 3 scaling (Meta, 2024) leaves high frequencies (wavelength below
  original_max / high_freq_factor) alone, divides low frequencies
  (wavelength above original_max / low_freq_factor) by `factor`, and blends
  linearly in between.
  """
  import numpy as np

  # float32 throughout, as Hugging Face computes it, so positions match bitwise.
  f32 = np.float32
  d = config.head_dim
  inv = f32(1.0) / (f32(config.rope_theta) ** (np.arange(0, d, 2).astype(f32) / f32(d)))
  s = config.rope_scaling
  if s is not None:
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
