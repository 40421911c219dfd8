"""What RL adds over SFT at equal compute, over several seeds.

    python launch/rl_vs_sft.py --config configs/grpo_arith.py --seeds 0,1,2 \\
        --out runs/rl_vs_sft.json [--config.<field>=<value> ...]

Three arms per seed, each run by `launch/train.py` in its own process. All
three resume one warm-up run (the config's S = `sft.steps` SFT iterations,
`rl.steps = 0`; a resumed run continues exactly, and RL then starts as in a
run that had its steps from the start), then spend the same compute in
different ways:

- `rl`: the config as it is: `rl.steps` RL iterations;
- `sft`: K more SFT iterations instead, as configured (`sft.lr`);
- `sft_at_rl_lr`: the same K SFT iterations at the RL phase's learning rate
  (`optim.lr`), so that only the loss differs from the RL phase, not the
  step size.

K is chosen so that the extra SFT takes the wall time the RL phase took on
this machine: RL iterations x the median RL iteration time / the median SFT
iteration time, both measured in the first seed's runs, rounded up; or
`--sft_extra_steps K`.

Each run's last checkpoint is scored by `launch/eval.py` (greedy, on the
task's held-out problems). Prints the accuracy of each run, each arm's mean
and standard error over seeds, and RL's gain over each SFT arm with its
standard error and their ratio, unpaired (sqrt(se_rl^2 + se_sft^2)) and
paired by seed (the SE of the per-seed differences, `gain`); writes them
as JSON to `--out`. `--config.*` flags are passed to every run.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

try:  # imported as launch.<module> (tests), or run as a script from launch/
  from launch import machine
except ImportError:
  import machine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, log_path):
  """Runs `python args...` in the repository; its output goes to `log_path`."""
  with open(log_path, 'w', encoding='utf-8') as log:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
  if proc.returncode:
    raise SystemExit(f'{" ".join(args[:3])} ... failed ({proc.returncode}); see {log_path}')


def train_run(config, root, name, overrides):
  """Runs launch/train.py on `config` in `root`/`name` (its log beside it,
  `name`.train.log); returns the run's absolute workdir."""
  workdir = os.path.abspath(os.path.join(root, name))
  train_args = ['launch/train.py', f'--config={config}', f'--config.workdir={workdir}']
  _run([*train_args, *overrides], os.path.join(root, f'{name}.train.log'))
  return workdir


def write_result(path, result):
  """`result` as JSON at `path` ('': nowhere), with the machine's record."""
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
      json.dump({'machine': machine.record(), **result}, f, indent=1)


def _records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def phase_times(workdir):
  """(median seconds per SFT iteration, median seconds per RL iteration, RL
  iterations) from a run's metrics (`time/update` of SFT records, `time/step`
  of RL ones)."""
  records = _records(workdir)
  sft = [r['time/update'] for r in records if r.get('phase') == 0.0 and 'time/update' in r]
  rl = [r['time/step'] for r in records if r.get('phase', 0.0) > 0.0 and 'time/step' in r]
  if not sft or not rl:
    raise SystemExit(f'{workdir}: the run logged no SFT or no RL iteration times.')
  rl_steps = len({r['step'] for r in records if r.get('phase', 0.0) > 0.0})
  return statistics.median(sft), statistics.median(rl), rl_steps


def accuracy(config, workdir, overrides, log_path):
  """Greedy held-out accuracy of the run's last checkpoint (`launch/eval.py`)."""
  out = os.path.join(workdir, 'final_eval.jsonl')
  args = ['launch/eval.py', f'--config={config}', f'--config.workdir={workdir}', *overrides]
  _run([*args, '--samples=0', f'--out={out}'], log_path)
  with open(log_path, encoding='utf-8') as f:
    lines = [line for line in f if line.startswith('{')]
  return json.loads(lines[-1])['eval/accuracy']


def mean_se(values):
  """(mean, standard error of the mean)."""
  mean = statistics.fmean(values)
  se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float('nan')
  return mean, se


def gain(rl, sft):
  """RL's gain over an SFT arm from {seed: accuracy} of each: unpaired (the
  difference of the means, SE sqrt(se_rl^2 + se_sft^2)) and paired (the mean
  of the per-seed differences and its SE: the arms of a seed resume the same
  warm-up, so a seed whose warm-up learned less lowers both)."""
  mean_rl, se_rl = mean_se(list(rl.values()))
  mean_sft, se_sft = mean_se(list(sft.values()))
  se = math.sqrt(se_rl**2 + se_sft**2)
  paired, paired_se = mean_se([rl[seed] - sft[seed] for seed in rl])
  ratio = lambda g, e: g / e if e > 0 else None  # None: one seed (se NaN) or no spread
  return {
    'gain': mean_rl - mean_sft,
    'se': se,
    'ratio': ratio(mean_rl - mean_sft, se),
    'paired_gain': paired,
    'paired_se': paired_se,
    'paired_ratio': ratio(paired, paired_se),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default='configs/grpo_arith.py')
  parser.add_argument('--seeds', default='0,1,2', help='comma-separated run seeds')
  parser.add_argument('--workdir', default='runs/rl_vs_sft', help='one subdirectory per run')
  parser.add_argument(
    '--sft_extra_steps', type=int, default=0, help='K (0: from the measured phase times)'
  )
  parser.add_argument('--out', default='', help='JSON of the figures')
  args, overrides = parser.parse_known_args(argv)
  bad = [o for o in overrides if not o.startswith('--config.')]
  if bad:
    parser.error(f'unknown arguments {bad}: only --config.<field>=<value> are passed on')
  seeds = [int(s) for s in args.seeds.split(',')]
  config_path = args.config
  os.makedirs(args.workdir, exist_ok=True)

  arms = ('rl', 'sft', 'sft_at_rl_lr')
  runs, extra, timing, resolved = {arm: {} for arm in arms}, args.sft_extra_steps, None, None
  start = time.time()

  def train(name, run_overrides):
    return train_run(config_path, args.workdir, name, run_overrides)

  for seed in seeds:
    seeded = [*overrides, f'--config.seed={seed}']
    warmup = train(f'warmup_seed{seed}', [*seeded, '--config.rl.steps=0'])
    for arm in arms:
      name = f'{arm}_seed{seed}'
      if arm != 'rl' and timing is None:
        timing = phase_times(os.path.join(args.workdir, f'rl_seed{seed}'))
        with open(os.path.join(warmup, 'config.json'), encoding='utf-8') as f:
          resolved = json.load(f)['config']  # the config after the overrides
        extra = extra or math.ceil(timing[2] * timing[1] / timing[0])
      arm_overrides = seeded
      if arm != 'rl':
        sft_steps = resolved['sft']['steps']
        arm_overrides = [*seeded, '--config.rl.steps=0', f'--config.sft.steps={sft_steps + extra}']
      if arm == 'sft_at_rl_lr':
        arm_overrides = [*arm_overrides, f'--config.sft.lr={resolved["optim"]["lr"]}']
      shutil.copytree(warmup, os.path.join(args.workdir, name), dirs_exist_ok=True)
      workdir = train(name, arm_overrides)  # resumes the warm-up
      log = os.path.join(args.workdir, f'{name}.eval.log')
      runs[arm][seed] = accuracy(config_path, workdir, arm_overrides, log)
      print(f'seed {seed} {arm}: held-out accuracy {runs[arm][seed]:.3f}', flush=True)

  stats = {}
  for arm in arms:
    mean, se = mean_se(list(runs[arm].values()))
    stats[arm] = {'mean': mean, 'se': se}
  result = {
    'config': config_path,
    'overrides': overrides,
    'seeds': seeds,
    'sft_steps': sft_steps,
    'rl_steps_of_rl_arm': timing[2],
    'sft_extra_steps': extra,
    'median_s_per_sft_iteration': timing[0],
    'median_s_per_rl_iteration': timing[1],
    'accuracy': runs,
    **stats,
    'wall_s': time.time() - start,
  }
  for arm in arms[1:]:
    result[f'gain_over_{arm}'] = gain(runs['rl'], runs[arm])
  line = ', '.join(f'{arm} {stats[arm]["mean"]:.3f} ± {stats[arm]["se"]:.3f}' for arm in arms)
  print(
    f'held-out accuracy over seeds {seeds} (SFT {sft_steps}, then RL {timing[2]} or SFT {extra}):'
  )
  print(f'  {line}')
  for arm in arms[1:]:
    g = result[f'gain_over_{arm}']
    ratio, paired = ('n/a' if r is None else f'{r:.1f}' for r in (g['ratio'], g['paired_ratio']))
    print(
      f'  RL over {arm}: {g["gain"]:+.3f} ± {g["se"]:.3f} ({ratio} SE); paired by seed: '
      f'{g["paired_gain"]:+.3f} ± {g["paired_se"]:.3f} ({paired} SE)'
    )
  write_result(args.out, result)
  return result


if __name__ == '__main__':
  main()
