"""jrl.models: one transformer for policy, reference, critic and reward model."""

from jrl.models.config import LinearRopeScaling, LoraConfig, ModelConfig, RopeScaling
from jrl.models.transformer import (
  abstract,
  causal_attention,
  create,
  create_sharded,
  dot_attention,
  hidden_states,
  logits,
  next_token_logprobs,
  param_logical_axes,
  positions_from_mask,
  positions_from_segments,
  router_load_balancing_loss,
  segment_starts,
  sequence_scores,
  values,
)
