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

`ModelConfig.from_hf(dict)` reads a Hugging Face `config.json` (old style
with `rope_theta` / `rope_scaling`, or the newer `rope_parameters`), and
refuses what it cannot run exactly (an unknown architecture, an unsupported
activation, a rope type other than default / linear / llama3, Qwen2's
sliding window) with an error naming the field.

Three fields change how the model trains, not what it computes, and are
never written to `config.json`: `remat` (per-layer activation
checkpointing), `scan_layers` (one `jax.lax.scan` over the layers instead of
an unrolled loop) and `lora` (a `LoraConfig`: low-rank adapters on the
projections, see `jrl/models/lora.py`). Pass them as overrides:
`ModelConfig.from_hf(hf, remat='full')`, `jrl.models.hf.load(path, remat=...)`.
"""

import dataclasses
import math

import jax.numpy as jnp

ARCHITECTURES = {
  'LlamaForCausalLM': 'llama',
  'Qwen2ForCausalLM': 'qwen2',
  'Qwen3ForCausalLM': 'qwen3',
  'Qwen3MoeForCausalLM': 'qwen3_moe',
  'MistralForCausalLM': 'mistral',
  'Gemma2ForCausalLM': 'gemma2',
  'Gemma3ForCausalLM': 'gemma3',
  'LlamaForSequenceClassification': 'llama',
  'Qwen2ForSequenceClassification': 'qwen2',
  'Qwen3ForSequenceClassification': 'qwen3',
  'Qwen3MoeForSequenceClassification': 'qwen3_moe',
  'MistralForSequenceClassification': 'mistral',
  'Gemma2ForSequenceClassification': 'gemma2',
  'Gemma3TextForSequenceClassification': 'gemma3',
}
# family -> (Hugging Face model_type, class name prefix).
FAMILIES = {
  'llama': ('llama', 'Llama'),
  'qwen2': ('qwen2', 'Qwen2'),
  'qwen3': ('qwen3', 'Qwen3'),
  'qwen3_moe': ('qwen3_moe', 'Qwen3Moe'),
  'mistral': ('mistral', 'Mistral'),
  'gemma2': ('gemma2', 'Gemma2'),
  'gemma3': ('gemma3_text', 'Gemma3'),
}
_MODEL_TYPES = {model_type: family for family, (model_type, _) in FAMILIES.items()}
DTYPES = ('float32', 'bfloat16', 'float16')
ACTIVATIONS = ('silu', 'gelu_tanh')  # SwiGLU; GeGLU with the tanh approximation of GELU
LAYER_TYPES = ('full', 'sliding')
MOE_IMPLS = ('ragged', 'dense')
# Per-layer activation checkpointing: what the backward pass keeps of a block.
#   none           everything (no recomputation)
#   full           only the block's input; the whole block is recomputed
#   dots           every matmul output but the float32 attention scores
#                  (projections and probabilities · values)
#   dots_no_batch  the projection outputs (q, k, v, o, MLP), not the [B, H, T, T]
#                  attention scores and probabilities
REMAT_POLICIES = ('none', 'full', 'dots', 'dots_no_batch')
# LoRA targets by their Hugging Face module name -> the Dense of a jrl block.
LORA_TARGETS = {
  'q_proj': ('attn', 'q'),
  'k_proj': ('attn', 'k'),
  'v_proj': ('attn', 'v'),
  'o_proj': ('attn', 'o'),
  'gate_proj': ('mlp', 'gate'),
  'up_proj': ('mlp', 'up'),
  'down_proj': ('mlp', 'down'),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 frequency scaling (rope_type 'llama3')."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_positions: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Position interpolation (rope_type 'linear'): inverse frequencies / factor."""

  factor: float


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (Hu et al., 2021, "LoRA"): a target projection
  y = x W becomes y = x W + (alpha / r) · (x A) B with A [in, r], B [r, out].

  As PEFT's `LoraConfig` (r, lora_alpha, target_modules, lora_dropout); the
  scale is alpha / r (PEFT's default, not rsLoRA's alpha / sqrt(r)).
  """

  rank: int  # r
  alpha: float  # the adapter output is scaled by alpha / r
  targets: tuple[str, ...] = tuple(LORA_TARGETS)  # Hugging Face module names
  dropout: float = 0.0  # dropout on the adapter's input; only 0 is implemented

  def __post_init__(self):
    _positive_int(self.rank, 'lora.rank')
    if not isinstance(self.alpha, int | float) or not self.alpha > 0:
      raise ValueError(f'`lora.alpha` must be > 0, got {self.alpha!r}.')
    if not isinstance(self.targets, tuple) or not self.targets:
      raise ValueError(f'`lora.targets` must be a non-empty tuple, got {self.targets!r}.')
    bad = sorted(set(self.targets) - set(LORA_TARGETS))
    if bad or len(set(self.targets)) != len(self.targets):
      raise ValueError(
        f'`lora.targets` must be distinct names from {list(LORA_TARGETS)}, got {self.targets!r}.'
      )
    # One order (LORA_TARGETS'), so that equal target sets give equal configs and graphs.
    object.__setattr__(self, 'targets', tuple(t for t in LORA_TARGETS if t in self.targets))
    if self.dropout != 0.0:
      raise ValueError(
        f'`lora.dropout` must be 0.0 (dropout is not implemented), got {self.dropout!r}.'
      )

  @property
  def scale(self):
    """alpha / r."""
    return self.alpha / self.rank


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
    if family is None and not archs and model_type in _MODEL_TYPES:
      family = _MODEL_TYPES[model_type]
    if family is None:
      raise ValueError(
        f'{source}: unsupported architecture `architectures`={archs!r} '
        f'(model_type={model_type!r}); supported: {sorted(ARCHITECTURES)}.'
      )
    if model_type is not None and model_type != FAMILIES[family][0]:
      raise ValueError(
        f'{source}: `model_type`={model_type!r} contradicts `architectures`={archs!r} '
        f'(a {family} model); fix one of them.'
      )
    gemma = family in ('gemma2', 'gemma3')
    act_key = 'hidden_activation' if gemma and hf.get('hidden_activation') else 'hidden_act'
    act = hf.get(act_key) or ('gelu_pytorch_tanh' if gemma else 'silu')
    activation = {'silu': 'silu', 'gelu_pytorch_tanh': 'gelu_tanh'}.get(act)
    if activation is None:
      raise ValueError(
        f'{source}: `{act_key}`={act!r} is not supported (only "silu" and "gelu_pytorch_tanh").'
      )
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
    if gemma and hf.get('attention_bias', False):
      raise ValueError(f'{source}: `attention_bias`=true is not supported for {family}.')
    if hf.get('use_bidirectional_attention', False):
      raise ValueError(f'{source}: `use_bidirectional_attention`=true is not supported.')

    num_heads = need('num_attention_heads')
    num_layers = need('num_hidden_layers')
    width = need('hidden_size')
    head_dim = hf.get('head_dim') or width // num_heads
    rope = dict(hf.get('rope_parameters') or {})
    local_theta = None
    if family == 'gemma3':
      # Gemma 3 keeps one rope per layer type; rope_local_base_freq in older files.
      if 'full_attention' in rope or 'sliding_attention' in rope:
        local = dict(rope.get('sliding_attention') or {})
        rope = dict(rope.get('full_attention') or {})
        if local.get('rope_type', 'default') != 'default':
          raise ValueError(
            f'{source}: rope type {local["rope_type"]!r} on the sliding layers '
            '(`rope_parameters.sliding_attention`) is not supported; only default.'
          )
        local_theta = float(local.get('rope_theta', hf.get('rope_local_base_freq', 10000.0)))
      else:
        local_theta = float(hf.get('rope_local_base_freq', 10000.0))
    legacy = hf.get('rope_scaling') or {}
    rope_theta = rope.get('rope_theta', hf.get('rope_theta', 1e6 if family == 'gemma3' else 1e4))
    rope_type = rope.get('rope_type') or legacy.get('rope_type') or legacy.get('type') or 'default'
    scaling_src = rope if rope.get('rope_type') in ('llama3', 'linear') else legacy
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
    elif rope_type == 'linear':
      if 'factor' not in scaling_src:
        raise ValueError(f'{source}: linear rope scaling is missing `factor`.')
      scaling = LinearRopeScaling(factor=float(scaling_src['factor']))
    elif rope_type != 'default':
      raise ValueError(
        f'{source}: rope type {rope_type!r} (`rope_scaling`/`rope_parameters`) is not '
        'supported; supported: default, linear, llama3.'
      )

    window = hf.get('sliding_window') if family in ('mistral', 'gemma2', 'gemma3') else None
    layer_types = None
    if window is not None and gemma:
      names = hf.get('layer_types')
      if names is None:
        # Gemma 2 alternates local and global layers; Gemma 3 has one global in `pattern`.
        pattern = 2 if family == 'gemma2' else int(hf.get('sliding_window_pattern', 6))
        names = [
          'sliding_attention' if (i + 1) % pattern else 'full_attention' for i in range(num_layers)
        ]
      known = {'sliding_attention': 'sliding', 'full_attention': 'full'}
      if len(names) != num_layers or any(n not in known for n in names):
        raise ValueError(
          f'{source}: `layer_types` must list {num_layers} of {sorted(known)}, got {names!r}.'
        )
      layer_types = tuple(known[n] for n in names)
    elif (
      hf.get('layer_types') is not None
      and any(n != 'full_attention' for n in hf['layer_types'])
      and family not in ('qwen2', 'qwen3', 'qwen3_moe')
    ):
      raise ValueError(f'{source}: `layer_types` other than full attention are not supported.')

    query_scalar = hf.get('query_pre_attn_scalar', 256) if gemma else None
    num_experts = 0
    moe = {}
    if family == 'qwen3_moe':
      num_experts = int(hf.get('num_experts', hf.get('num_local_experts', 0)) or 0)
      moe = {
        'num_experts': num_experts,
        'experts_per_token': int(need('num_experts_per_tok')) if num_experts else 0,
        'moe_mlp_width': int(need('moe_intermediate_size')) if num_experts else 0,
        'norm_topk_prob': bool(hf.get('norm_topk_prob', False)),
        'moe_step': int(hf.get('decoder_sparse_step', 1)),
        'dense_layers': tuple(int(i) for i in hf.get('mlp_only_layers') or ()),
      }
    fields = {
      'vocab_size': need('vocab_size'),
      'width': width,
      'mlp_width': need('intermediate_size'),
      'num_layers': num_layers,
      'num_heads': num_heads,
      'num_kv_heads': hf.get('num_key_value_heads', num_heads),
      'head_dim': head_dim,
      'family': family,
      'rms_eps': float(hf.get('rms_norm_eps', 1e-6)),
      'rope_theta': float(rope_theta),
      'rope_scaling': scaling,
      'qkv_bias': bool(hf.get('attention_bias', family == 'qwen2')),
      'qk_norm': family in ('qwen3', 'qwen3_moe', 'gemma3'),
      'tie_embeddings': bool(hf.get('tie_word_embeddings', gemma)),
      'max_positions': int(hf.get('max_position_embeddings', 4096)),
      'init_std': float(hf.get('initializer_range', 0.02)),
      'activation': activation,
      'sliding_window': None if window is None else int(window),
      'layer_types': layer_types,
      'local_rope_theta': local_theta,
      'attn_scale': None if query_scalar is None else float(query_scalar) ** -0.5,
      'attn_softcap': _opt_float(hf.get('attn_logit_softcapping')) if gemma else None,
      'final_softcap': _opt_float(hf.get('final_logit_softcapping')) if gemma else None,
      'norm_plus_one': gemma,
      'embed_scale': gemma,
      'post_norms': gemma,
      **moe,
    }
    fields.update(overrides)
    try:
      return cls(**fields)
    except ValueError as e:
      raise ValueError(f'{source}: {e}') from None

  def to_hf(self, base=None):
    """A Hugging Face `config.json` dict; `base` (the dict read) is kept and updated."""
    model_type, prefix = FAMILIES[self.family]
    out = dict(base or {})
    out.setdefault('architectures', [f'{prefix}ForCausalLM'])
    out.setdefault('model_type', model_type)
    gemma = self.family in ('gemma2', 'gemma3')
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
        'initializer_range': self.init_std,
      }
    )
    act = {'silu': 'silu', 'gelu_tanh': 'gelu_pytorch_tanh'}[self.activation]
    out['hidden_activation' if gemma else 'hidden_act'] = act
    if self.family not in ('qwen3', 'qwen3_moe'):
      out['attention_bias'] = self.qkv_bias
    if self.family in ('mistral', 'gemma2', 'gemma3'):
      out['sliding_window'] = self.sliding_window
    if gemma:
      if self.layer_types is not None:
        names = {'sliding': 'sliding_attention', 'full': 'full_attention'}
        out['layer_types'] = [names[t] for t in self.layer_types]
      # attn_scale came from query_pre_attn_scalar; write back the value read when it still matches.
      scalar = out.get('query_pre_attn_scalar', 256)
      if self.attn_scale is None or not math.isclose(scalar**-0.5, self.attn_scale):
        scalar = self.head_dim if self.attn_scale is None else self.attn_scale**-2
        if math.isclose(scalar, round(scalar)):
          scalar = round(scalar)  # transformers wants an int
      out['query_pre_attn_scalar'] = scalar
      out['attn_logit_softcapping'] = self.attn_softcap
      out['final_logit_softcapping'] = self.final_softcap
    if self.num_experts:
      experts_key = 'num_local_experts' if 'num_local_experts' in out else 'num_experts'
      out[experts_key] = self.num_experts
      out.update(
        {
          'num_experts_per_tok': self.experts_per_token,
          'moe_intermediate_size': self.moe_mlp_width,
          'norm_topk_prob': self.norm_topk_prob,
          'decoder_sparse_step': self.moe_step,
          'mlp_only_layers': list(self.dense_layers),
        }
      )
    if self.family == 'gemma3' and (base is None or 'rope_parameters' in base):
      out['rope_parameters'] = {
        'full_attention': self._rope_dict(),
        'sliding_attention': {'rope_type': 'default', 'rope_theta': self.local_rope_theta},
      }
    elif self.family == 'gemma3':
      out['rope_theta'] = self.rope_theta
      out['rope_local_base_freq'] = self.local_rope_theta
      if self.rope_scaling is not None:
        out['rope_scaling'] = {k: v for k, v in self._rope_dict().items() if k != 'rope_theta'}
    elif base is None or 'rope_parameters' in base or 'rope_theta' not in base:
      out['rope_parameters'] = self._rope_dict()
    else:
      out['rope_theta'] = self.rope_theta
      if self.rope_scaling is not None:
        out['rope_scaling'] = {k: v for k, v in self._rope_dict().items() if k != 'rope_theta'}
    # The dtype the tensors are written in (newer files say `dtype`, older `torch_dtype`).
    if 'torch_dtype' in out:
      out['torch_dtype'] = self.param_dtype
    if 'dtype' in out or 'torch_dtype' not in out:
      out['dtype'] = self.param_dtype
    return out

  def _rope_dict(self):
    """rope_parameters of the global layers: type, theta and scaling fields."""
    s = self.rope_scaling
    if s is None:
      return {'rope_type': 'default', 'rope_theta': self.rope_theta}
    if isinstance(s, LinearRopeScaling):
      return {'rope_type': 'linear', 'rope_theta': self.rope_theta, 'factor': s.factor}
    return {
      'rope_type': 'llama3',
      'rope_theta': self.rope_theta,
      'factor': s.factor,
      'low_freq_factor': s.low_freq_factor,
      'high_freq_factor': s.high_freq_factor,
      'original_max_position_embeddings': s.original_max_positions,
    }


def _opt_float(value):
  return None if value is None else float(value)


def _positive_int(value, name):
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f'`{name}` must be a positive int, got {value!r}.')


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
