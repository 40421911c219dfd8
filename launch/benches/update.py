"""`update`: one GRPO update step (forward, backward, Adam) on a batch of
long-tailed lengths (log-normal, mean `--mean_frac` of `--max_len`), on
padded rows and on packed rows (`train.packing`), and with `--micro_tokens`
in micro-batches; MFU counts real tokens only.

    python launch/bench.py update [--size cpu-20m --batch 16 --max_len 1024 --mean_frac 0.25]
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from launch.benches import common

HELP = 'a GRPO update step, padded vs packed rows'


def add_arguments(parser):
  parser.add_argument('--size', choices=sorted(common.MODEL_SIZES), default='cpu-20m')
  parser.add_argument('--compute_dtype', default='float32')
  parser.add_argument('--batch', type=int, default=16, help='sequences in the minibatch')
  parser.add_argument(
    '--max_len', type=int, default=1024, help='longest sequence (padded row length)'
  )
  parser.add_argument('--mean_frac', type=float, default=0.25, help='mean length / max_len')
  parser.add_argument('--min_len', type=int, default=16, help='shortest sequence (e.g. the prompt)')
  parser.add_argument('--row_len', type=int, default=0, help='packed row length (0: max_len)')
  parser.add_argument(
    '--micro_tokens', type=int, default=0, help='also time micro-batches of this many tokens'
  )
  parser.add_argument('--remat', default='full')
  parser.add_argument('--repeats', type=int, default=3)


def run(args):
  """One GRPO update step (policy_step.train_step: forward, backward, Adam) on
  a long-tailed batch, padded rows vs packed rows (`train.packing`)."""
  import optax

  from jrl import models
  from jrl.data import packing
  from jrl.trainers import common as train_common
  from jrl.trainers import policy_step

  config = models.ModelConfig(
    **common.MODEL_SIZES[args.size], compute_dtype=args.compute_dtype, remat=args.remat
  )
  b, t = args.batch, args.max_len
  lengths = common.long_tailed_lengths(b, t, args.mean_frac, seed=0, min_len=args.min_len)
  batch, tokens, mask = common.policy_batch(
    np.random.default_rng(1), b, t, config.vocab_size, lengths
  )
  host = packing.pack_padded(tokens, mask, args.row_len or t)
  packed = batch._replace(packed=jax.tree.map(jnp.asarray, host))
  real = int(mask.sum())
  eff_padded, eff_packed = packing.efficiency(mask, host)
  print(
    f'update ({args.size}, {config.num_params() / 1e6:.1f}M params, remat {args.remat}): '
    f'{b} sequences of at most {t} tokens, mean {lengths.mean():.0f} (median '
    f'{np.median(lengths):.0f}), {real} real tokens; padded {b} rows x {t} '
    f'({100 * eff_padded:.0f}% real), packed {host.tokens.shape[0]} rows x '
    f'{host.tokens.shape[1]} ({100 * eff_packed:.0f}% real); backend {jax.default_backend()}'
  )
  graphdef, params = models.create(config, jax.random.PRNGKey(0))
  tx = optax.adamw(1e-5)
  schedule = optax.constant_schedule(1e-5)
  step = jax.jit(
    functools.partial(
      policy_step.train_step,
      graphdef=graphdef,
      tx=tx,
      schedule=schedule,
      step_config=policy_step.StepConfig(chunk_size=1024),
    )
  )
  state = train_common.init_state(params, tx)
  # Model FLOPs of the real tokens only: forward + both backward matmuls.
  flops = 3 * sum(common.forward_flops_per_token(config, int(n)) * int(n) for n in lengths)
  seconds = {}
  for name, data in (('padded', batch), ('packed', packed)):
    peak = common.measure_matmul_peak(dtype='float32')
    start = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_s = time.perf_counter() - start
    sec = common.median_seconds(compiled, (state, data), args.repeats)
    seconds[name] = sec
    print(
      f'  {name:7s} {1e3 * sec:9.1f} ms/step  {real / sec:8.0f} real tokens/s  MFU (real '
      f'tokens) {100 * flops / sec / peak:5.1f}% of {peak / 1e9:.0f} GFLOP/s  (compile '
      f'{compile_s:.1f} s)',
      flush=True,
    )
  print(f'  packed / padded time: x{seconds["packed"] / seconds["padded"]:.2f}')
  temp = lambda c: c.memory_analysis().temp_size_in_bytes / 2**20
  print(f'  packed: XLA temporaries of the step {temp(compiled):.0f} MiB')
  if args.micro_tokens:
    bench_micro_batches(args, state, batch, tokens, mask, graphdef, tx, schedule, real, flops, peak)


def bench_micro_batches(
  args, state, batch, tokens, mask, graphdef, tx, schedule, real, flops, peak
):
  """The packed update split into micro-batches of `--micro_tokens` tokens
  (`train.micro_batch_tokens`): gradients summed, one update; time and the
  largest micro-batch's XLA temporaries."""
  from jrl.data import packing
  from jrl.trainers import common as train_common
  from jrl.trainers import policy_step

  row_len = args.row_len or args.max_len
  cfg = policy_step.StepConfig(chunk_size=1024)
  grads = jax.jit(functools.partial(policy_step.loss_and_grads, graphdef=graphdef, step_config=cfg))
  apply = jax.jit(functools.partial(policy_step.apply_update, tx=tx, schedule=schedule))
  step = train_common.MicroBatchedStep(
    grads, apply, policy_step.ADDITIVE_METRICS, policy_step.TOKEN_SHARE
  )
  # With the row-length buckets (the trainer's split), then with rows of one length.
  for name, row_lens in (('micro', None), ('micro/1L', (row_len,))):
    hosts = packing.micro_batches(tokens, mask, row_len, args.micro_tokens, row_lens=row_lens)
    parts = [jax.tree.map(jnp.asarray, h) for h in hosts]
    data = batch._replace(packed=parts)
    temps = [
      grads.lower(state, batch._replace(packed=p)).compile().memory_analysis().temp_size_in_bytes
      for p in parts
    ]
    sec = common.median_seconds(lambda s, d: step(s, d)[0], (state, data), args.repeats)
    print(
      f'  {name:8s} {1e3 * sec:8.1f} ms/step  {real / sec:8.0f} real tokens/s  MFU (real '
      f'tokens) {100 * flops / sec / peak:5.1f}%  ({len(parts)} micro-batches of at most '
      f'{args.micro_tokens} tokens: rows x length {[p.tokens.shape for p in parts]}; XLA '
      f'temporaries of the largest {max(temps) / 2**20:.0f} MiB)'
    )
