"""jrl.sampler: a paged-attention, continuously batched sampler in JAX that
runs on the trainer's own parameters (JetStream-style engine API)."""

from jrl.sampler.engine import (
  DecodeState,
  EngineConfig,
  Prefix,
  SlotRequest,
  decode_step,
  free,
  generate,
  init_state,
  insert,
  pages_needed,
  pool_pages,
  prefill,
)
from jrl.sampler.sampler import (
  Completion,
  Request,
  RolloutBatch,
  Sampler,
  SamplerStats,
  default_buckets,
  to_rollout_batch,
)
from jrl.sampler.sampling import SamplingParams, sample
