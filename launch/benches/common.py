"""What the benchmarks share: model sizes, timing, the matmul peak, the FLOPs
formula (the cost model's), synthetic update batches, and the one helper that
shrinks a job's config to the steps a benchmark measures."""

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl import costmodel
from launch import machine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def median_seconds(fn, args, repeats):
  """Median wall seconds of `fn(*args)` over `repeats` calls after one warm-up."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


@contextlib.contextmanager
def compile_seconds():
  """Sums JAX's tracing, lowering and XLA compile durations inside the block.

  Yields a list that holds the total seconds and the number of programs XLA
  compiled once the block exits.
  """
  total = [0.0, 0]
  active = [True]

  def listener(name, seconds, **_):
    if active[0] and name.startswith('/jax/core/compile/'):
      total[0] += seconds
      total[1] += name == '/jax/core/compile/backend_compile_duration'

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield total
  finally:
    active[0] = False


MODEL_SIZES = {
  # ~0.1M parameters: checks that a bench runs end to end (the tests), not a measurement.
  'cpu-tiny': dict(
    vocab_size=512,
    width=64,
    mlp_width=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_embeddings=True,
  ),
  # ~22M parameters (tied 8k vocabulary): sized for a 2-core CPU.
  'cpu-20m': dict(
    vocab_size=8192,
    width=512,
    mlp_width=1408,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    tie_embeddings=True,
  ),
  # A Qwen3-MoE layout of the same width: 8 experts, top 2 (~61M parameters, ~25M active).
  'cpu-moe-60m': dict(
    family='qwen3_moe',
    vocab_size=8192,
    width=512,
    mlp_width=1408,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    qk_norm=True,
    tie_embeddings=True,
    num_experts=8,
    experts_per_token=2,
    moe_mlp_width=704,
  ),
  # SmolLM2-135M-Instruct (the issue-15 model; launch/prepare_model.py) with random weights.
  'real': dict(
    vocab_size=49152,
    width=576,
    mlp_width=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_embeddings=True,
    rms_eps=1e-5,
    rope_theta=100000.0,
  ),
  # The shape of Qwen2.5-0.5B (~494M parameters).
  'gpu-0.5b': {**costmodel.MODEL_PRESETS['qwen2.5-0.5b'], 'family': 'qwen2'},
  # Qwen3-30B-A3B's layers at a quarter of the depth and experts: 32 experts, top 8.
  'gpu-moe-1b': {
    **costmodel.MODEL_PRESETS['qwen3-30b-a3b'],
    'num_layers': 12,
    'num_experts': 32,
  },
}


def backend():
  """JAX's backend and its first device's kind, e.g. 'cpu (cpu)'."""
  return f'{jax.default_backend()} ({jax.devices()[0].device_kind})'


def measure_matmul_peak(n=2048, dtype='float32', repeats=10):
  """Best FLOP/s of an n×n×n matmul on the default device (fastest of `repeats`:
  a peak, so the least disturbed run counts)."""
  key_a, key_b = jax.random.split(jax.random.PRNGKey(1))
  a = jax.random.normal(key_a, (n, n), dtype)
  b = jax.random.normal(key_b, (n, n), dtype)
  f = jax.jit(jnp.dot)
  jax.block_until_ready(f(a, b))
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(a, b))
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def forward_flops_per_token(config, seq):
  """Forward matmul FLOPs per token of a causal row of `seq` tokens: the cost
  model's formula (`costmodel.flops_per_token`) at the mean context, seq / 2
  keys (LM head included, embedding lookup excluded; of a MoE layer the router
  and the k routed experts only)."""
  return costmodel.flops_per_token(config, seq / 2)


def import_configs():
  """Puts the repository root on sys.path (for `configs`) and quiets absl."""
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  if REPO not in sys.path:
    sys.path.insert(0, REPO)


def bench_config(config, steps, overrides=None):
  """`config` (locked) set up for measuring `steps` RL iterations: a fresh
  temporary workdir, no SFT warm-up, evaluation, checkpoints, export or
  plots; then `overrides`, {'section.field': value} or {section: {field:
  value}}."""
  config.workdir = tempfile.mkdtemp(prefix='jrl-bench-')
  config.sft.steps = 0
  config.rl.steps = steps
  config.eval.every = 0
  config.export_hf = False
  config.log.tensorboard = False
  config.log.plot = False
  config.checkpoint.every = 10**6
  for key, value in (overrides or {}).items():
    fields = value.items() if isinstance(value, dict) else [(key.split('.')[1], value)]
    section = key if isinstance(value, dict) else key.split('.')[0]
    for name, v in fields:
      if name not in config[section]:
        raise KeyError(f'`{section}.{name}`: the config has no such field.')
      config[section][name] = v
  return config


def set_fields(config, assignments):
  """Sets `KEY=VALUE` strings ('rl.group_size=4') on a locked config, each value
  parsed as the type of the field it replaces."""
  for assignment in assignments or ():
    key, sep, text = assignment.partition('=')
    if not sep:
      raise ValueError(f'--set {assignment!r}: expected KEY=VALUE')
    *parents, name = key.split('.')
    node = config
    for parent in parents:
      node = node[parent]
    old = node[name]
    if isinstance(old, bool):
      if text.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(f'--set {assignment!r}: {key} is a bool')
      value = text.lower() in ('true', '1')
    elif isinstance(old, tuple):
      value = tuple(v for v in text.split(',') if v)
    else:
      value = type(old)(text)
    node[name] = value
  return config


def write_json(path, figures):
  """`figures` as JSON at `path` ('' : nowhere), with the machine's record
  (`launch/machine.py`: CPU model, cores, flags, versions) under 'machine'
  and the device JAX ran on under 'backend'."""
  if path:
    record = {'machine': machine.record(), 'backend': backend(), **figures}
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=2, default=str)
    print(f'figures written to {path}')


def rl_iterations(job, steps):
  """The metrics of the first `steps` iterations of a built job (no checkpoints, no writer)."""
  state, records = job.state, []
  for it in range(steps):
    state, report = job.iterate(state, it)
    records.append(report.metrics)
  return records


def long_tailed_lengths(n, max_len, mean_frac, seed, min_len=16):
  """`n` sequence lengths in [min_len, max_len] with a long tail (log-normal
  above min_len), the mean about `mean_frac` of max_len (rescaled, then
  clipped; deterministic)."""
  rng = np.random.default_rng(seed)
  raw = rng.lognormal(0.0, 1.0, n)
  extra = max(mean_frac * max_len - min_len, 0.0)
  lengths = np.clip(np.round(min_len + raw / raw.mean() * extra), min_len, max_len)
  lengths[np.argmax(lengths)] = max_len  # one at the limit, as a clipped response
  return lengths.astype(np.int32)


def policy_batch(rng, rows, t, vocab, lengths=None):
  """A PolicyBatch of right-padded rows: the first quarter of each sequence
  prompt, the rest response; advantages +-1 by row."""
  from jrl.trainers import policy_step

  lengths = np.full(rows, t) if lengths is None else np.asarray(lengths)
  tokens = np.zeros((rows, t), np.int32)
  mask, loss_mask = np.zeros((rows, t), bool), np.zeros((rows, t), bool)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(1, vocab, n)
    mask[i, :n] = True
    loss_mask[i, max(1, n // 4) : n] = True
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  adv = np.where(loss_mask, np.where(np.arange(rows) % 2, 1.0, -1.0)[:, None], 0.0)
  batch = policy_step.PolicyBatch(
    tokens=jnp.asarray(tokens),
    mask=jnp.asarray(mask),
    loss_mask=jnp.asarray(loss_mask),
    old_logp=f32(np.where(loss_mask, -5.0, 0.0)),
    ref_logp=f32(np.zeros((rows, t))),
    advantages=f32(adv),
  )
  return batch, tokens, mask
