"""`model`: forward and forward+backward tokens/s and MFU of a random model of
one of `common.MODEL_SIZES` (`real`: SmolLM2-135M-Instruct's shape), once
per `--remat` policy and `--lora_rank` (0: full fine-tuning; r: adapters on
every projection, gradients for the adapters only), with XLA's compiled
memory of the step (temporaries; peak = inputs + outputs + temporaries) and
the bytes of parameters + gradients + Adam moments training keeps.

    python launch/bench.py model [--size cpu-20m|cpu-moe-60m|gpu-0.5b|gpu-moe-1b --seq 256]
    python launch/bench.py model --size real --batch 2 --seq 256 --remat none,full --lora_rank 0,16
"""

import time

import jax
import jax.numpy as jnp

from launch.benches import common

HELP = 'transformer forward / forward+backward throughput and MFU'


def add_arguments(parser):
  parser.add_argument('--size', choices=sorted(common.MODEL_SIZES), default='cpu-20m')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--seq', type=int, default=256)
  parser.add_argument('--compute_dtype', default='float32')
  parser.add_argument('--peak_dtype', default='float32', help='dtype of the peak-measuring matmul')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument(
    '--moe_impl', choices=('ragged', 'dense'), default='ragged', help='MoE dispatch'
  )
  parser.add_argument('--remat', default='none', help='policies, comma-separated (none,full,...)')
  parser.add_argument('--lora_rank', default='0', help='LoRA ranks, comma-separated (0: full)')
  parser.add_argument('--scan', action='store_true', help='scan the layers')


def run(args):
  """Forward, then forward+backward per (remat policy, LoRA rank)."""
  import optax

  from jrl import models
  from jrl.models import lora

  base = models.ModelConfig(
    **common.MODEL_SIZES[args.size], compute_dtype=args.compute_dtype, scan_layers=args.scan
  )
  if base.num_experts:
    base = base.replace(moe_impl=args.moe_impl)
  b, t = args.batch, args.seq
  tokens = jax.random.randint(jax.random.PRNGKey(2), (b, t), 0, base.vocab_size)
  mask = jnp.ones((b, t), bool)
  backend = jax.default_backend()
  print(
    f'model {args.size}: {base.num_params() / 1e6:.1f}M params '
    f'({base.num_params(active=True) / 1e6:.1f}M active), batch {b}x{t}, '
    f'compute {base.compute_dtype}, scan_layers {base.scan_layers}, '
    f'backend {backend} ({jax.devices()[0].device_kind})'
  )
  flops_tok = common.forward_flops_per_token(base, t)

  def run(name, fn, fn_args, mult):
    # Peak measured next to each run, so both see the same machine load.
    peak = common.measure_matmul_peak(dtype=args.peak_dtype)
    start = time.perf_counter()
    compiled = fn.lower(*fn_args).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    temp = mem.temp_size_in_bytes
    # What the step holds at its peak: inputs, outputs (not donated) and XLA's temporaries.
    peak_bytes = mem.argument_size_in_bytes + mem.output_size_in_bytes + temp
    sec = common.median_seconds(compiled, fn_args, args.repeats)
    tok_s = b * t / sec
    mfu = tok_s * flops_tok * mult / peak
    print(
      f'  {name:30s} {tok_s:8.0f} tokens/s {1e3 * sec:9.1f} ms/step  MFU {100 * mfu:5.1f}% '
      f'of {peak / 1e9:.0f} GFLOP/s ({args.peak_dtype})  temp {temp / 2**20:6.0f} MiB, '
      f'step peak {peak_bytes / 2**20:6.0f} MiB  (compile {compile_s:.1f} s)',
      flush=True,
    )

  graphdef, params = models.create(base, jax.random.PRNGKey(0))

  def loss_of(graphdef):
    def loss_fn(trainable, frozen):
      p = trainable if frozen is None else lora.join(trainable, frozen)
      logp, _ = models.next_token_logprobs(graphdef, p, tokens, mask)
      return -jnp.mean(logp[:, 1:])

    return loss_fn

  run('forward', jax.jit(loss_of(graphdef)), (params, None), 1)
  del params
  for remat in args.remat.split(','):
    for rank in [int(r) for r in args.lora_rank.split(',')]:
      lora_config = models.LoraConfig(rank=rank, alpha=2.0 * rank) if rank else None
      config = base.replace(remat=remat, lora=lora_config)
      graphdef, params = models.create(config, jax.random.PRNGKey(0))
      trainable, frozen = lora.split(params) if rank else (params, None)
      opt_state = jax.eval_shape(optax.adamw(1e-5).init, trainable)
      state = lora.num_bytes(params) + lora.num_bytes(trainable) + lora.num_bytes(opt_state)
      # Model FLOPs: forward 1x, activation gradients 1x, weight gradients 1x
      # (none for a frozen base); recomputation is not counted.
      mult = 2 if rank else 3
      n_train = sum(x.size for x in jax.tree.leaves(trainable))
      name = f'fwd+bwd remat={remat} lora={rank or "-"}'
      print(
        f'  {name:30s} trainable {n_train / 1e6:6.1f}M params; params + '
        f'grads + Adam {state / 2**30:.2f} GiB'
      )
      run(name, jax.jit(jax.value_and_grad(loss_of(graphdef))), (trainable, frozen), mult)
      del params, trainable, frozen
