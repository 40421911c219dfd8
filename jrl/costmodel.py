"""A cost model of one RL step: memory per device and seconds per stage.

Inputs are plain values:

* the model: a `jrl.models.ModelConfig` (a jrl config, an HF `config.json`
  through `ModelConfig.from_hf`, or one of `MODEL_PRESETS`);
* the hardware: a `Hardware` (the `HARDWARE` presets carry vendor peak
  figures; `measure_this_machine()` measures the machine at hand);
* the workload: a `Workload` (prompts per step, G, prompt and response
  lengths, epochs, minibatch, whether a reference model runs);
* the layout: a `Layout` (topology, chips for training and for rollout,
  tensor-parallel degrees, micro-batch rows).

Stage times come from `Coefficients`, either from the roofline of the
hardware (`Coefficients.from_hardware`: FLOPs over peak x an assumed
utilisation, bytes over bandwidth x an assumed efficiency, plus a per-step
host overhead) or fitted to the spans of a measured run
(`Coefficients.from_trace`, the calibration). Generation is simulated
slot by slot the way `jrl.sampler` schedules it (a group of G is admitted
when G slots are free; decode runs `steps_per_dispatch` steps per dispatch
over every slot up to a page bound), so the long tail of response lengths
costs what it costs the real sampler.

Step composition by topology (stages in seconds):

* colocated:      generate + reward + reference + update;
* disaggregated:  reshard + generate + reward + reference + update, with
  rollout and training on separate chips (each side idles while the other
  works: the bubbles);
* one_step_off:   max(generate + reward, reference + proximal + update)
  (+ reshard on separate chips); on shared chips the device work of both
  sides still adds up, so only host time (dispatch, reward scoring)
  overlaps.

Everything here is arithmetic on floats: no JAX, no devices.
"""

import dataclasses
import math

import numpy as np

from jrl.models.config import ModelConfig

GiB = 2**30
TOPOLOGIES = ('colocated', 'disaggregated', 'one_step_off')


# Hardware --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One chip type, and the utilisation assumed for it.

  Peak, bandwidth and memory are per chip. `link_bw` is the per-chip
  bandwidth of collectives among chips of one node (ICI on TPU, NVLink on
  GPU); `node_bw` between nodes (TPU slices: ICI again; GPU: the NIC).
  """

  name: str
  peak_flops: float  # FLOP/s in the compute dtype (bfloat16 on accelerators)
  mem_bw: float  # bytes/s
  mem_bytes: float  # bytes
  link_bw: float  # bytes/s per chip within a node
  node_bw: float  # bytes/s per chip across nodes
  chips_per_node: int
  train_mfu: float = 0.4  # achieved / peak FLOP/s of training matmuls
  prefill_mfu: float = 0.5
  decode_mfu: float = 0.3
  bw_eff: float = 0.7  # achieved / peak memory bandwidth when decoding
  step_overhead_s: float = 2e-3  # host time per decode step (dispatch, sampling, read-back)
  collective_latency_s: float = 10e-6  # fixed cost of one all-reduce
  source: str = ''


# Vendor peak figures (dense bfloat16 FLOP/s, HBM bandwidth and size, interconnect).
HARDWARE = {
  'tpu-v5e': Hardware('TPU v5e', 197e12, 819e9, 16 * GiB, 200e9, 200e9, 256, source='spec'),
  'tpu-v5p': Hardware('TPU v5p', 459e12, 2765e9, 95 * GiB, 600e9, 600e9, 8960, source='spec'),
  'tpu-v6e': Hardware('TPU v6e', 918e12, 1640e9, 32 * GiB, 400e9, 400e9, 256, source='spec'),
  'h100': Hardware('NVIDIA H100 SXM', 989e12, 3350e9, 80e9, 450e9, 50e9, 8, source='spec'),
  'h200': Hardware('NVIDIA H200 SXM', 989e12, 4800e9, 141e9, 450e9, 50e9, 8, source='spec'),
}


def measure_this_machine(matmul_n=1024, copy_mib=256):
  """A Hardware for the default JAX device of this process, measured:
  float32 matmul peak, copy bandwidth, physical memory."""
  import time

  import jax
  import jax.numpy as jnp

  a = jnp.ones((matmul_n, matmul_n), jnp.float32)
  f = jax.jit(jnp.dot)
  jax.block_until_ready(f(a, a))
  best = min(_timed(lambda: jax.block_until_ready(f(a, a)), time) for _ in range(5))
  peak = 2 * matmul_n**3 / best
  x = jnp.ones(copy_mib * 2**20 // 4, jnp.float32)
  g = jax.jit(lambda v: v + 1.0)
  jax.block_until_ready(g(x))
  best = min(_timed(lambda: jax.block_until_ready(g(x)), time) for _ in range(5))
  bw = 2 * x.nbytes / best  # read + write
  try:
    import os

    mem = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    mem = 8 * GiB
  kind = jax.devices()[0].device_kind
  return Hardware(
    f'this machine ({kind})', peak, bw, mem, bw, bw, jax.device_count(), source='measured'
  )


def _timed(fn, time):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


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


# Model arithmetic -----------------------------------------------------------------


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


# Workload and layout --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
  """One RL step's work.

  Response lengths: `response_clip_frac` of the completions run to
  `response_max`; the others spread evenly up to twice the mean that makes
  the overall mean `response_mean` (see `response_lengths`).
  """

  prompts_per_step: int  # B
  group_size: int  # G
  prompt_len: int  # tokens (mean; padded rows use max_prompt_len)
  response_mean: float
  response_max: int
  response_clip_frac: float = 0.0
  max_prompt_len: int = 0  # rows are max_prompt_len + response_max long (0: prompt_len)
  epochs: int = 1
  minibatch_rows: int = 0  # rows per optimiser step (0: the whole batch)
  reference: bool = False  # a KL term: reference logprobs every step
  num_slots: int = 64  # sampler slots per rollout replica
  page_size: int = 16
  steps_per_dispatch: int = 8
  reward_s: float = 1e-4  # seconds per completion scored
  param_bytes: int = 4  # master weights
  compute_bytes: int = 2  # activations, KV cache, rollout weights

  @property
  def rows(self):
    return self.prompts_per_step * self.group_size

  @property
  def seq_len(self):
    return (self.max_prompt_len or self.prompt_len) + self.response_max

  def response_lengths(self):
    """[B·G] deterministic response lengths with the stated mean, max and clip fraction."""
    n = self.rows
    n_clip = round(self.response_clip_frac * n)
    lengths = [self.response_max] * n_clip
    rest = n - n_clip
    if rest:
      mean = (self.response_mean * n - self.response_max * n_clip) / rest
      mean = min(max(mean, 1.0), self.response_max)
      hi = min(2 * mean - 1, self.response_max)
      lo = max(1.0, 2 * mean - hi)
      lengths += [round(lo + (hi - lo) * (i + 0.5) / rest) for i in range(rest)]
    # Interleave so that clipped rows are spread over groups, as sampling does.
    order = np.argsort([(i * 7919) % n for i in range(n)], kind='stable')
    return [lengths[i] for i in order]


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the chips are used."""

  topology: str = 'colocated'
  train_chips: int = 1
  rollout_chips: int = 0  # separate rollout chips (0: the training chips)
  tensor: int = 1  # tensor-parallel degree of training (the rest is fsdp x data)
  rollout_tensor: int = 1  # tensor-parallel degree of one rollout replica
  micro_rows: int = 0  # rows per forward/backward micro-batch (0: the minibatch)

  def __post_init__(self):
    if self.topology not in TOPOLOGIES:
      raise ValueError(f'`topology` must be one of {TOPOLOGIES}, got {self.topology!r}.')
    if self.topology == 'disaggregated' and self.rollout_chips < 1:
      raise ValueError('`rollout_chips` must be >= 1 for a disaggregated layout.')
    if self.train_chips < 1 or self.tensor < 1 or self.rollout_tensor < 1:
      raise ValueError('`train_chips`, `tensor` and `rollout_tensor` must be >= 1.')

  @property
  def separate(self):
    return self.rollout_chips > 0

  @property
  def chips(self):
    return self.train_chips + self.rollout_chips

  @property
  def rollout_replicas(self):
    chips = self.rollout_chips or self.train_chips
    return max(1, chips // self.rollout_tensor)


# Memory ---------------------------------------------------------------------------


def memory(model, workload, layout):
  """Bytes per device of each part, for the training and the rollout chips.

  Training state is fully sharded (FSDP x tensor) over the training chips:
  parameters in `param_bytes`, float32 gradients, AdamW's two float32
  moments, a reference copy when `workload.reference`. Activations are those
  of one micro-batch kept for the backward pass, plus one chunk of float32
  logits. The KV pool holds every slot's worst case (shared prompt pages
  once per group, as `jrl.sampler.pages_needed`), split over the rollout
  tensor degree; with separate rollout chips they also hold the weights in
  `compute_bytes`.

  Returns:
    {'train': {part: bytes, 'total': bytes}, 'rollout': {...}}.
  """
  w, lay = workload, layout
  p = model.num_params()
  shards = lay.train_chips
  train = {
    'params': p * w.param_bytes / shards,
    'grads': p * 4 / shards,
    'optimizer': 2 * p * 4 / shards,
  }
  if w.reference:
    train['reference'] = p * w.param_bytes / shards
  micro = lay.micro_rows or w.minibatch_rows or w.rows
  per_device_rows = max(1, micro // max(1, lay.train_chips // lay.tensor))
  q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
  mlp = sum(
    3 * model.experts_per_token * model.moe_mlp_width if model.is_moe(i) else 3 * model.mlp_width
    for i in range(model.num_layers)
  )
  per_token = model.num_layers * (4 * model.width + 2 * q + 2 * kv) + mlp
  train['activations'] = per_device_rows * w.seq_len * per_token * w.compute_bytes / lay.tensor
  train['logits_chunk'] = per_device_rows * min(w.seq_len, 1024) * model.vocab_size * 4 / lay.tensor
  rollout = {'kv_cache': kv_pool_bytes(model, workload) / lay.rollout_tensor}
  if lay.separate:
    rollout['weights'] = p * w.compute_bytes / lay.rollout_tensor
  elif lay.topology == 'one_step_off':
    train['rollout_weights'] = p * w.param_bytes / shards  # the copy generation reads
  if not lay.separate:
    train.update(rollout)
    rollout = dict(train)
  train['total'] = sum(v for k, v in train.items() if k != 'total')
  rollout['total'] = sum(v for k, v in rollout.items() if k != 'total')
  return {'train': train, 'rollout': rollout}


def kv_pages(workload):
  """Pages of the sampler's pool (as `jrl.sampler.pool_pages`): every group in
  flight at its worst case over prompt lengths, plus the scratch page."""
  w = workload

  def per_group(n):
    n_full = n // w.page_size
    return n_full + w.group_size * (math.ceil((n + w.response_max - 1) / w.page_size) - n_full)

  worst = max(per_group(n) for n in range(1, (w.max_prompt_len or w.prompt_len) + 1))
  return 1 + worst * max(1, w.num_slots // w.group_size)


def kv_pool_bytes(model, workload):
  return kv_pages(workload) * workload.page_size * kv_bytes_per_token(model, workload.compute_bytes)


# Stage coefficients -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Coefficients:
  """Seconds per unit of work of each stage, on one rollout replica (generation)
  or on the training chips together (the rest).

  A decode step costs `decode_fixed_s + max(decode_compute_s,
  decode_mem_s + decode_page_s · pages)`, where `pages` is the page bound
  the sampler attends to (every slot is computed every step).
  """

  decode_fixed_s: float
  decode_compute_s: float
  decode_mem_s: float
  decode_page_s: float
  prefill_fixed_s: float
  prefill_token_s: float
  forward_token_s: float  # reference / proximal logprobs, per padded token
  train_token_s: float  # forward + backward, per padded token
  update_fixed_s: float  # per optimiser step: dispatch, and collectives not hidden
  reward_s: float  # per completion
  reshard_s: float  # per policy version with separate rollout chips
  host_frac: float = 0.0  # the part of generation that is host time (overlaps on shared chips)
  source: str = ''

  @classmethod
  def from_hardware(cls, model, hw, workload, layout):
    """Roofline coefficients with `hw`'s assumed utilisation."""
    w, lay = workload, layout
    tp_r = lay.rollout_tensor
    slots = w.num_slots
    page_bytes = w.page_size * kv_bytes_per_token(model, w.compute_bytes)
    weights = model.num_params() * w.compute_bytes
    bw = hw.mem_bw * hw.bw_eff * tp_r
    ctx = (w.max_prompt_len or w.prompt_len) + w.response_mean
    train_peak = hw.peak_flops * hw.train_mfu * lay.train_chips
    coll_bw = hw.link_bw if lay.train_chips <= hw.chips_per_node else hw.node_bw
    # FSDP: all-gather the weights for forward and backward, reduce-scatter gradients.
    n = lay.train_chips
    comm = 3 * model.num_params() * w.param_bytes * (n - 1) / n / coll_bw if n > 1 else 0.0
    cross_bw = hw.node_bw if lay.chips > hw.chips_per_node else hw.link_bw

    # Tensor parallelism: two activation all-reduces per layer (attention, MLP);
    # training moves them three times (forward, and two in the backward pass),
    # in large enough messages that their latency does not count.
    def tp_allreduce(t, rows, latency):
      if t == 1:
        return 0.0
      volume = rows * model.width * w.compute_bytes * 2 * (t - 1) / t
      return 2 * model.num_layers * (volume / hw.link_bw + latency)

    tp_train_token = 3 * tp_allreduce(lay.tensor, 1, 0.0) / max(1, n // lay.tensor)
    return cls(
      decode_fixed_s=hw.step_overhead_s + tp_allreduce(tp_r, slots, hw.collective_latency_s),
      decode_compute_s=slots * flops_per_token(model, ctx) / (hw.peak_flops * hw.decode_mfu * tp_r),
      decode_mem_s=weights / bw,
      decode_page_s=slots * page_bytes / bw,
      prefill_fixed_s=hw.step_overhead_s,
      prefill_token_s=2 * matmul_params(model) / (hw.peak_flops * hw.prefill_mfu * tp_r),
      forward_token_s=flops_per_token(model, w.seq_len / 2) / train_peak + tp_train_token / 3,
      train_token_s=3 * flops_per_token(model, w.seq_len / 2) / train_peak + tp_train_token,
      update_fixed_s=comm,
      reward_s=w.reward_s,
      reshard_s=weights / max(cross_bw * min(lay.train_chips, lay.rollout_chips or 1), 1.0),
      host_frac=0.0,
      source=f'roofline of {hw.name}',
    )

  @classmethod
  def from_trace(cls, trace, workload, model=None, reference_model=None):
    """Coefficients fitted to a measured run (see `calibrate`)."""
    return calibrate(trace, workload, model=model, reference_model=reference_model)

  def scaled(self, factor):
    """For a model with `factor` x the FLOPs per token on the same machine."""
    f = factor
    return dataclasses.replace(
      self,
      decode_compute_s=self.decode_compute_s * f,
      decode_mem_s=self.decode_mem_s * f,
      decode_page_s=self.decode_page_s * f,
      prefill_token_s=self.prefill_token_s * f,
      forward_token_s=self.forward_token_s * f,
      train_token_s=self.train_token_s * f,
      reshard_s=self.reshard_s * f,
    )


# Generation simulated slot by slot --------------------------------------------------


def simulate_generation(workload, lengths=None):
  """The sampler's schedule for one step: (prefills, [(steps, page bound)] per dispatch).

  Mirrors `jrl.sampler.Sampler.generate`: groups admitted in order while G
  slots are free; each dispatch runs up to `steps_per_dispatch` steps for
  all slots (fewer when every slot finishes sooner); slots that finished
  are freed at the dispatch boundary; the page
  bound is the most pages any slot can hold after the dispatch, rounded up
  to a power of two (at most the per-slot maximum), as `attend_pages`.
  """
  w = workload
  lengths = list(workload.response_lengths() if lengths is None else lengths)
  g, s, k, page = w.group_size, w.num_slots, w.steps_per_dispatch, w.page_size
  prompt = w.prompt_len
  max_pages = math.ceil(((w.max_prompt_len or prompt) + w.response_max) / page)
  pending = list(range(w.prompts_per_step))
  free, running = s, []  # running: [remaining tokens, tokens held]
  prefills, dispatches = 0, []
  while pending or running:
    while pending and free >= g:
      b = pending.pop(0)
      for j in range(g):
        # The first token comes from the prefill's logits: L - 1 decode steps.
        running.append([lengths[b * g + j] - 1, prompt])
      free -= g
      prefills += 1
    held = max(math.ceil(t / page) for _, t in running)
    bound = min(1 << max(0, math.ceil(math.log2(held + math.ceil(k / page) + 1))), max_pages)
    # The decode loop stops early once no slot is live.
    dispatches.append((min(k, max((r[0] for r in running), default=0)), bound))
    for r in running:
      step = min(k, r[0])
      r[0] -= step
      r[1] += step
    done = [r for r in running if r[0] <= 0]
    running = [r for r in running if r[0] > 0]
    free += len(done)
  return prefills, dispatches


# Prediction ---------------------------------------------------------------------------


def predict(model, workload, layout, coeffs, lengths=None):
  """Seconds per stage and per step, idle fractions, and the bound.

  Returns:
    dict with 'generate', 'reward', 'reference', 'proximal', 'update',
    'reshard', 'step' (seconds), 'rollout_idle', 'train_idle' (fractions of
    the step) and 'bound' ('rollout', 'train', 'communication' or 'balanced').
  """
  del model
  w, lay, c = workload, layout, coeffs
  # Generation: prompts split evenly over rollout replicas.
  replicas = lay.rollout_replicas
  per_replica = dataclasses.replace(w, prompts_per_step=max(1, -(-w.prompts_per_step // replicas)))
  all_lengths = list(w.response_lengths() if lengths is None else lengths)
  prefills, dispatches = simulate_generation(per_replica, all_lengths[: per_replica.rows])
  decode = sum(
    steps * (c.decode_fixed_s + max(c.decode_compute_s, c.decode_mem_s + c.decode_page_s * pages))
    for steps, pages in dispatches
  )
  generate = prefills * (c.prefill_fixed_s + c.prefill_token_s * w.prompt_len) + decode
  reward = w.rows * c.reward_s
  tokens = w.rows * w.seq_len
  reference = tokens * c.forward_token_s if w.reference else 0.0
  minibatch = w.minibatch_rows or w.rows
  optimiser_steps = w.epochs * max(1, w.rows // minibatch)
  compute = w.epochs * tokens * c.train_token_s
  comm = optimiser_steps * c.update_fixed_s
  update = max(compute, comm) + 0.1 * min(compute, comm)  # mostly overlapped
  stale = lay.topology == 'one_step_off'
  proximal = tokens * c.forward_token_s if stale else 0.0
  reshard = c.reshard_s if lay.separate else 0.0
  rollout_side = generate + reward
  train_side = reference + proximal + update
  if lay.topology == 'one_step_off':
    if lay.separate:
      step = max(rollout_side, train_side) + reshard
    else:
      # Shared chips: device work adds up; host time (dispatch, scoring) overlaps.
      device_gen = generate * (1 - c.host_frac)
      step = max(rollout_side, train_side, device_gen + train_side)
  else:
    step = rollout_side + train_side + reshard
  if lay.separate:
    rollout_idle = 1 - rollout_side / step
    train_idle = 1 - train_side / step
  else:
    rollout_idle = train_idle = 0.0
  if comm > compute:
    bound = 'communication'
  elif rollout_side > 1.5 * train_side:
    bound = 'rollout'
  elif train_side > 1.5 * rollout_side:
    bound = 'train'
  else:
    bound = 'balanced'
  return {
    'generate': generate,
    'reward': reward,
    'reference': reference,
    'proximal': proximal,
    'update': update,
    'reshard': reshard,
    'step': step,
    'rollout_idle': rollout_idle,
    'train_idle': train_idle,
    'bound': bound,
    'dispatches': len(dispatches),
  }


# Calibration from a trace --------------------------------------------------------------


def _events(trace, name):
  return [e for e in trace['traceEvents'] if e.get('ph') == 'X' and e['name'] == name]


def workload_from_config(config):
  """The Workload of a jrl run config (a dict, as in a trace's `otherData`)."""
  rl, sc = config['rl'], config['sampler']
  return Workload(
    prompts_per_step=rl['prompts_per_step'],
    group_size=rl['group_size'],
    prompt_len=rl['max_prompt_len'],
    response_mean=rl['max_new_tokens'],
    response_max=rl['max_new_tokens'],
    epochs=rl['epochs'],
    minibatch_rows=rl['minibatch_size'],
    reference=rl['kl_coef'] > 0,
    num_slots=sc['num_slots'],
    page_size=sc['page_size'],
    steps_per_dispatch=sc['steps_per_dispatch'],
  )


def trace_model(trace):
  """The ModelConfig a trace was recorded with (None if it does not say)."""
  fields = trace.get('otherData', {}).get('model')
  if not fields:
    return None
  # JSON has no tuples: the tuple-valued fields come back as lists.
  return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def calibrate(trace, workload=None, model=None, reference_model=None):
  """Coefficients fitted to the spans of a measured run (`workdir/trace.json`).

  * decode: per-dispatch seconds regressed on the page bound
    (least squares, seconds = a + b · pages), divided by the steps;
  * prefill: per-call seconds regressed on the prompt tokens;
  * reference / update: seconds per padded token (`workload.rows x
    seq_len` per step, `epochs` passes for the update); the update's fixed
    part is the median update minus its token part (dispatch per optimiser step);
  * reward: seconds per completion;
  * decode's fixed part also takes the host time of each 'generate' span
    outside its prefill and decode spans, per decode step;
  * host_frac: the fixed (row-independent) share of decode time.

  `workload` is the run's (default: read from the trace's config). With
  `model`, the coefficients are scaled by the ratio of its FLOPs per token
  to those of `reference_model` (default: the trace's model).
  """
  w = workload or workload_from_config(trace['otherData']['config'])
  reference_model = reference_model or trace_model(trace)
  decode = _events(trace, 'decode')
  if not decode:
    raise ValueError('the trace has no decode spans: record a run with `log.trace` on.')
  decode = [e for e in decode if e['args']['steps'] > 0]
  steps = np.asarray([e['args']['steps'] for e in decode], np.float64)
  pages = np.asarray([e['args']['max_pages'] for e in decode], np.float64)
  secs = np.asarray([e['dur'] for e in decode], np.float64) / 1e6 / steps
  a, b = _fit(pages, secs)
  prefill = _events(trace, 'prefill')
  pa, pb = _fit(
    np.asarray([e['args']['tokens'] for e in prefill], np.float64),
    np.asarray([e['dur'] for e in prefill], np.float64) / 1e6,
  )
  tokens = w.rows * w.seq_len
  median = lambda name: float(np.median([e['dur'] for e in _events(trace, name)]) / 1e6)
  update = median('update')
  reference = median('reference') if _events(trace, 'reference') else None
  reward = median('reward') / w.rows
  train_token = update / (w.epochs * tokens)
  forward_token = reference / tokens if reference is not None else train_token / 3
  decode_total = float(np.sum(secs * steps))
  fixed_total = float(np.sum(np.maximum(a, 0.0) * steps))
  # Host time inside a 'generate' span but outside its prefill and decode
  # spans (admission, reading finished slots back, freeing them), spread over
  # the decode steps of that span.
  extra = []
  for g in _events(trace, 'generate'):
    lo, hi = g['ts'], g['ts'] + g['dur']
    inner = [e for e in prefill + decode if lo <= e['ts'] and e['ts'] + e['dur'] <= hi]
    n_steps = sum(e['args']['steps'] for e in inner if e['name'] == 'decode')
    if n_steps:
      extra.append((g['dur'] - sum(e['dur'] for e in inner)) / 1e6 / n_steps)
  host_step = max(float(np.median(extra)), 0.0) if extra else 0.0
  coeffs = Coefficients(
    decode_fixed_s=max(a, 0.0) + host_step,
    decode_compute_s=0.0,
    decode_mem_s=0.0,
    decode_page_s=max(b, 0.0),
    prefill_fixed_s=max(pa, 0.0),
    prefill_token_s=max(pb, 0.0),
    forward_token_s=forward_token,
    train_token_s=train_token,
    update_fixed_s=0.0,
    reward_s=reward,
    reshard_s=median('reshard') if _events(trace, 'reshard') else 0.0,
    host_frac=fixed_total / decode_total if decode_total else 0.0,
    source='calibrated from a trace',
  )
  if model is not None and reference_model is not None:
    ctx = w.seq_len / 2
    coeffs = coeffs.scaled(flops_per_token(model, ctx) / flops_per_token(reference_model, ctx))
  return coeffs


def _fit(x, y):
  """Least-squares (intercept, slope); a constant when x does not vary."""
  if len(x) == 0:
    return 0.0, 0.0
  if np.ptp(x) == 0:
    return float(np.median(y)), 0.0
  slope, intercept = np.polyfit(x, y, 1)
  if intercept < 0:  # keep both parts physical
    return 0.0, float(np.sum(x * y) / np.sum(x * x))
  if slope < 0:
    return float(np.median(y)), 0.0
  return float(intercept), float(slope)
