"""The value sets and sub-configs of `ModelConfig`'s fields
(`jrl/models/config.py`): the families and the Hugging Face architectures
that map to them, dtypes, activations, layer types, MoE dispatch, remat
policies and LoRA targets; the rope scalings and `LoraConfig`.
"""

import dataclasses

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
ATTENTION_IMPLS = ('auto', 'xla', 'lse', 'cudnn', 'splash')  # jrl.models.attention.IMPLEMENTATIONS
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


def _positive_int(value, name):
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f'`{name}` must be a positive int, got {value!r}.')
