"""The parts of `launch/accel_check.py` that measure (the device, the sampler,
the update, a GRPO step), the workloads and what every part shares; the
numerics checks are in `accel_numerics.py`. Each part is `part(ctx) -> dict`
of figures.

A part returns plain JSON values. Its `checks` entry maps a check's name to
True/False (the runner marks the part 'mismatch' when one is False); its
`headline` entry is the short text of the printed table. Workloads are
`WORKLOADS[ctx.mode]`: 'tiny' (CPU, seconds, the test suite) and 'full'
(an accelerator: a Qwen2.5-0.5B-shaped model with random weights).
"""

import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jrl import costmodel, models
from launch.benches import common as benches

TINY_MODEL = dict(
  benches.MODEL_SIZES['cpu-tiny'], family='qwen2', qkv_bias=True, num_heads=4, num_kv_heads=2
)
QWEN_05B = dict(costmodel.MODEL_PRESETS['qwen2.5-0.5b'], family='qwen2', rope_theta=1e6)
# Qwen2.5-1.5B's config.json shape.
QWEN_15B = dict(
  QWEN_05B, width=1536, mlp_width=8960, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128
)


@dataclasses.dataclass(frozen=True)
class Workload:
  model: dict  # ModelConfig fields
  dtype: str  # compute dtype of the measurements (parameters stay float32)
  prompts: int  # a GRPO step: prompts x group completions
  group: int
  prompt_lens: tuple  # (shortest, longest) prompt tokens
  max_new: int  # the longest completion
  page: int  # KV page tokens
  check_layers: int  # layers of the numerics checks' model (same widths)
  attn_len: int  # row length of the training-attention check (a multiple of 128)
  micro_tokens: tuple  # update micro-batch token budgets to measure
  peak_n: int  # matmul size of the peak measurement


WORKLOADS = {
  # 4 x 2 rows: the test suite's 8 CPU devices split them (mesh.data = -1).
  'tiny': Workload(TINY_MODEL, 'float32', 4, 2, (8, 24), 8, 4, 2, 128, (64, 128), 256),
  'full': Workload(
    QWEN_05B, 'bfloat16', 64, 8, (128, 512), 1024, 16, 4, 1024, (16384, 32768), 8192
  ),
}


@dataclasses.dataclass
class Context:
  mode: str  # a key of WORKLOADS
  earlier: dict  # figures of the parts already run, by part name
  size: str = '0.5b'  # '0.5b' | '1.5b' (the full mode's model)

  @property
  def work(self):
    w = WORKLOADS[self.mode]
    return (
      dataclasses.replace(w, model=QWEN_15B) if self.size == '1.5b' and self.mode == 'full' else w
    )

  def model_config(self, **overrides):
    return models.ModelConfig(**{**self.work.model, **overrides})

  def kernel(self, part, fallback):
    """'auto', or `fallback` when the check `part` ran in this call and failed
    or missed a tolerance: one broken kernel must not take the figures of
    every later part with it."""
    figures = self.earlier.get(part)
    if figures is None:
      return 'auto'
    ok = 'failed' not in figures and all(figures.get('checks', {}).values())
    return 'auto' if ok else fallback

  def bf16_peak(self):
    """The device part's bfloat16 matmul peak, or a quick one measured now."""
    peak = self.earlier.get('device', {}).get('bf16_peak_flops')
    return peak or benches.measure_matmul_peak(n=self.work.peak_n, dtype='bfloat16', repeats=3)


def max_abs(a, b, where=None):
  d = jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))
  return float(jnp.max(jnp.where(where, d, 0.0) if where is not None else d))


def rel_err(a_tree, b_tree):
  """||a - b|| / ||b|| over every leaf of two pytrees."""
  num = sum(
    float(jnp.sum((jnp.float32(x) - jnp.float32(y)) ** 2))
    for x, y in zip(jax.tree.leaves(a_tree), jax.tree.leaves(b_tree), strict=True)
  )
  den = sum(float(jnp.sum(jnp.float32(y) ** 2)) for y in jax.tree.leaves(b_tree))
  return (num / max(den, 1e-30)) ** 0.5


def median_ms(fn, *args, repeats=5):
  return 1e3 * benches.median_seconds(fn, args, repeats)


def device_memory():
  """(peak, limit) bytes of the first device's allocator (None, None on the CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get('peak_bytes_in_use'), stats.get('bytes_limit')


# ------------------------------------------------------------------ the parts


def device(ctx):
  """The device, the software and the matmul peaks (the MFU denominators)."""
  d = jax.devices()[0]
  n = ctx.work.peak_n
  bf16 = benches.measure_matmul_peak(n=n, dtype='bfloat16')
  f32 = benches.measure_matmul_peak(n=n, dtype='float32')
  _, limit = device_memory()
  return {
    'backend': jax.default_backend(),
    'device_kind': d.device_kind,
    'devices': jax.device_count(),
    'jax': jax.__version__,
    'bytes_limit': limit,
    'bf16_peak_flops': bf16,
    'f32_peak_flops': f32,
    'headline': f'{d.device_kind}: bf16 {bf16 / 1e12:.1f} TFLOP/s, f32 {f32 / 1e12:.1f} TFLOP/s '
    f'({n}^3 matmul)',
  }


def grpo_requests(ctx, vocab, rng, prompts=None, max_new=None, lengths='mixed'):
  """GRPO-shaped requests: prompt lengths uniform in the workload's range;
  'mixed' limits (a quarter of the samples the longest, the rest 1/16 to 1/2
  of it) or 'fixed' (every sample the longest)."""
  from jrl import sampler

  w = ctx.work
  prompts, max_new = prompts or w.prompts, max_new or w.max_new
  lo, hi = w.prompt_lens

  def limits():
    if lengths == 'fixed':
      return [max_new] * w.group
    short = lambda: int(rng.integers(max(1, max_new // 16), max(2, max_new // 2) + 1))
    return [max_new if rng.random() < 0.25 else short() for _ in range(w.group)]

  return [
    sampler.Request(
      prompt=rng.integers(3, vocab, int(rng.integers(lo, hi + 1))),
      max_new_tokens=limits(),
      temperature=1.0,
      seed=i,
    )
    for i in range(prompts)
  ]


def make_engine(ctx, config, graphdef, requests, max_new, impl='auto'):
  from jrl import sampler

  w = ctx.work
  slots = len(requests) * w.group
  per_group = max(sampler.pages_needed(len(r.prompt), max_new, w.group, w.page) for r in requests)
  engine_config = sampler.SamplerConfig(
    num_slots=slots,
    num_pages=1 + per_group * len(requests),
    page_size=w.page,
    max_prompt_len=w.prompt_lens[1],
    max_new_tokens=max_new,
    attention_impl=impl,
  )
  return sampler.Sampler(graphdef, config, engine_config, steps_per_dispatch=16)


def sampler(ctx, impl='auto'):
  """Output tokens/s of the paged sampler on the GRPO workload (random
  weights, 'mixed' completion limits), with attention `impl`: the first call
  (compiles included), XLA compile seconds in it, one steady call, the KV
  bytes in use at the peak and allocated, and the device's peak memory."""
  from jrl.sampler import attention

  w = ctx.work
  config = ctx.model_config(compute_dtype=w.dtype)
  if impl == 'auto':
    impl = ctx.kernel('paged_attention', 'gather')
  resolved = attention.resolve_impl(impl, w.page, config.head_dim, kv_dtype=jnp.dtype(w.dtype))
  if impl != 'auto' and ctx.earlier.get('sampler', {}).get('implementation') == resolved:
    return {
      'implementation': resolved,
      'headline': f"'auto' is {resolved} here: see the sampler part",
    }
  graphdef, params = models.create(config, jax.random.PRNGKey(0))
  requests = grpo_requests(ctx, config.vocab_size, np.random.default_rng(0))
  smp = make_engine(ctx, config, graphdef, requests, w.max_new, impl)
  start = time.perf_counter()
  with benches.compile_seconds() as compiled:
    out = smp.generate(params, requests, group_size=w.group)
  first = time.perf_counter() - start
  start = time.perf_counter()
  out = smp.generate(params, requests, group_size=w.group)
  steady = time.perf_counter() - start
  tokens = sum(len(c.tokens) for grp in out for c in grp)
  kv_token = costmodel.kv_bytes_per_token(config, jnp.dtype(w.dtype).itemsize)
  st = smp.stats
  return {
    'implementation': resolved,
    'model_params': config.num_params(),
    'output_tokens': tokens,
    'tokens_per_s': tokens / steady,
    'steady_s': steady,
    'first_call_s': first,
    'compile_s': compiled[0],
    'programs': compiled[1],
    'kv_bytes_peak': st.peak_pages * w.page * kv_token,
    'kv_bytes_pool': smp.cfg.num_pages * w.page * kv_token,
    'decode_rows_per_step': st.decode_rows / max(1, st.decode_steps),
    'headline': f'{resolved}: {tokens / steady:.0f} output tokens/s ({tokens} tokens), first call '
    f'{first:.1f} s (compile {compiled[0]:.1f} s), KV peak '
    f'{st.peak_pages * w.page * kv_token / 2**30:.2f} GiB',
  }


def update(ctx):
  """A GRPO update (forward, backward, AdamW) on the step's 64 x 8
  sequences (prompt + completion lengths as the sampler part's), packed
  rows, in micro-batches of each of `micro_tokens` tokens: real tokens/s and
  MFU against the bfloat16 matmul peak (model FLOPs of the real tokens:
  3 x forward; attention over each sequence's own length)."""
  import optax

  from jrl.data import packing
  from jrl.trainers import common, policy_step

  w = ctx.work
  config = ctx.model_config(
    compute_dtype=w.dtype, attention_impl=ctx.kernel('train_attention', 'xla')
  )
  rng = np.random.default_rng(0)
  requests = grpo_requests(ctx, config.vocab_size, rng)
  lengths = [len(r.prompt) + m for r in requests for m in r.max_new_tokens]
  t = max(lengths)
  batch, tokens, mask = benches.policy_batch(rng, len(lengths), t, config.vocab_size, lengths)
  graphdef, params = models.create(config, jax.random.PRNGKey(0))
  tx = optax.adamw(1e-5)
  cfg = policy_step.StepConfig(chunk_size=4096 if ctx.mode == 'full' else 256)
  grads = jax.jit(functools.partial(policy_step.loss_and_grads, graphdef=graphdef, step_config=cfg))
  apply = jax.jit(
    functools.partial(policy_step.apply_update, tx=tx, schedule=optax.constant_schedule(1e-5)),
    donate_argnums=(0,),
  )
  step = common.MicroBatchedStep(
    grads, apply, policy_step.ADDITIVE_METRICS, policy_step.TOKEN_SHARE
  )
  state = common.init_state(params, tx)
  del params
  flops = 3 * sum(benches.forward_flops_per_token(config, n) * n for n in lengths)
  peak = ctx.bf16_peak()
  real = int(mask.sum())
  out = {
    'attention_impl': config.attention_impl,
    'sequences': len(lengths),
    'real_tokens': real,
    'model_params': config.num_params(),
    'bf16_peak_flops': peak,
  }
  for budget in w.micro_tokens:
    hosts = packing.micro_batches(tokens, mask, min(t, budget), budget)
    data = batch._replace(packed=[jax.tree.map(jnp.asarray, h) for h in hosts])
    start = time.perf_counter()
    with benches.compile_seconds() as compiled:
      state, metrics = step(state, data)
      jax.block_until_ready(state)
    first = time.perf_counter() - start
    times = []
    for _ in range(2):
      start = time.perf_counter()
      state, metrics = step(state, data)
      jax.block_until_ready(state)
      times.append(time.perf_counter() - start)
    sec = statistics.median(times)
    out[f'micro_{budget}'] = {
      'micro_batches': len(hosts),
      'seconds': sec,
      'tokens_per_s': real / sec,
      'mfu': flops / sec / peak,
      'first_call_s': first,
      'compile_s': compiled[0],
      'loss_finite': bool(np.isfinite(float(metrics['actor/loss']))),
    }
  best = max((v for k, v in out.items() if k.startswith('micro_')), key=lambda v: v['tokens_per_s'])
  return {
    **out,
    'checks': {'finite': all(v['loss_finite'] for k, v in out.items() if k.startswith('micro_'))},
    'headline': f'{real} real tokens: best {best["tokens_per_s"]:.0f} tokens/s, MFU '
    f'{100 * best["mfu"]:.1f}% of bf16 peak ({best["micro_batches"]} micro-batches)',
  }


def _word_tokenizer(path, vocab_size):
  """A word-level tokenizer of `vocab_size` tokens ('<pad>', '<eos>', 'w2' ...)
  in `path`, so that every id a random model draws decodes."""
  import tokenizers
  from tokenizers import models as tokenizer_models
  from tokenizers import pre_tokenizers

  vocab = {'<pad>': 0, '<eos>': 1, **{f'w{i}': i for i in range(2, vocab_size)}}
  tok = tokenizers.Tokenizer(tokenizer_models.WordLevel(vocab, unk_token='<pad>'))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(os.path.join(path, 'tokenizer.json'))
  with open(os.path.join(path, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump({'eos_token': '<eos>', 'pad_token': '<pad>'}, f)


def grpo_step(ctx, steps=None):
  """Whole GRPO steps through the trainer (`trainers.build`, `job.iterate`)
  on a random checkpoint of the workload's shape with a word-level tokenizer
  of its vocabulary: prompts of the workload's lengths, every completion up
  to `max_new` tokens, KL 0.001 (so the reference pass runs); `steps` of
  them (2 in full mode, 1 in tiny). Seconds per stage of the last step; the
  first includes compiles. Full mode sets remat and micro-batches (the memory
  plan's candidate compiles would take minutes); tiny mode leaves them 'auto'."""
  benches.import_configs()
  from configs import grpo_arith
  from jrl import trainers
  from jrl.models import hf
  from jrl.trainers import controller

  w = ctx.work
  steps = steps or (2 if ctx.mode == 'full' else 1)  # tiny: the code path, one step
  config_m = ctx.model_config(param_dtype='bfloat16')
  root = tempfile.mkdtemp(prefix='jrl-accel-')
  model_dir = os.path.join(root, 'model')
  _, params = models.create(config_m, jax.random.PRNGKey(0))
  hf.save(model_dir, config_m, params)
  del params
  _word_tokenizer(model_dir, config_m.vocab_size)
  rng = np.random.default_rng(0)
  rows = [
    {'prompt': ' '.join(f'w{i}' for i in rng.integers(2, config_m.vocab_size, n)), 'answer': 'w2'}
    for n in rng.integers(w.prompt_lens[0], w.prompt_lens[1] + 1, 2 * w.prompts)
  ]
  data = os.path.join(root, 'prompts.jsonl')
  with open(data, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  c = benches.bench_config(grpo_arith.get_config(), steps)
  fields = {
    'model.path': model_dir,
    'model.compute_dtype': w.dtype,
    'tokenizer': '',
    'task.kind': 'file',
    'task.train_path': data,
    'task.eval_path': data,
    'task.max_prompt_len': w.prompt_lens[1],
    'task.max_response_len': w.max_new,
    'rl.prompts_per_step': w.prompts,
    'rl.group_size': w.group,
    'rl.minibatch_size': w.prompts * w.group,
    'rl.kl_coef': 0.001,
    'sampler.num_slots': w.prompts * w.group,
    'sampler.page_size': w.page,
    'sampler.steps_per_dispatch': 16,
    'sampler.attention_impl': ctx.kernel('paged_attention', 'gather'),
    'model.attention': ctx.kernel('train_attention', 'xla'),
  }
  if ctx.mode == 'full':
    # Set, so that the memory plan does not compile its candidates (minutes at this size).
    fields.update({'model.remat': 'none', 'train.micro_batch_tokens': 16384})
  for key, value in fields.items():
    *parents, name = key.split('.')
    node = c
    for p in parents:
      node = node[p]
    node[name] = value
  job = trainers.build(c)
  state, records = job.state, []
  for it in range(steps):
    with benches.compile_seconds() as compiled:
      state, report = job.iterate(state, it)
    m = report.metrics
    records.append((m, compiled[0]))
  plan = job.memory_plan.describe()
  controller.close(job)
  last, compile_last = records[-1]
  stages = {
    k: float(last.get(f'time/{k}', 0.0))
    for k in ('generate', 'reward', 'reference', 'update', 'step')
  }
  gen_tokens = last['response_length/mean'] * w.prompts * w.group
  return {
    'stages_s': stages,
    'first_step_s': float(records[0][0]['time/step']),
    'compile_first_s': records[0][1],
    'compile_last_s': compile_last,
    'response_length_mean': float(last['response_length/mean']),
    'generate_tokens_per_s': gen_tokens / max(stages['generate'], 1e-9),
    'memory_plan': plan,
    'attention': {k: fields[k] for k in ('sampler.attention_impl', 'model.attention')},
    'headline': f'step {stages["step"]:.2f} s (generate {stages["generate"]:.2f}, reference '
    f'{stages["reference"]:.2f}, update {stages["update"]:.2f}); first step '
    f'{records[0][0]["time/step"]:.1f} s',
  }
