"""jrl.models: one transformer for policy, reference, critic and reward model."""

from jrl.models.attention import (
  causal_attention,
  dot_attention,
  positions_from_mask,
  positions_from_segments,
  segment_starts,
  shared_prompt_attention,
)
from jrl.models.config import LinearRopeScaling, LoraConfig, ModelConfig, RopeScaling
from jrl.models.logical_axes import head_units, param_logical_axes
from jrl.models.moe import router_load_balancing_loss
from jrl.models.transformer import (
  abstract,
  create,
  create_sharded,
  hidden_states,
  logits,
  logprobs_at,
  next_token_logprobs,
  sequence_scores,
  values,
)
