"""jrl.sampler: a paged-attention, continuously batched sampler in JAX that
runs on the trainer's own parameters; its pure decode steps, JetStream-style,
are in jrl.sampler.paged."""

from jrl.sampler.paged import (
  DecodeState,
  Prefix,
  SamplerConfig,
  SlotRequest,
  admit,
  decode_step,
  free,
  generate,
  generate_slots,
  group_pages,
  init_state,
  insert,
  insert_batch,
  pages_needed,
  pool_pages,
  prefill,
  prefill_batch,
)
from jrl.sampler.sampler import (
  Completion,
  Continuation,
  Request,
  Sampler,
  SamplerStats,
  default_buckets,
  enable_compilation_cache,
)
from jrl.sampler.sampling import SamplingParams, sample
