"""On-policy distillation against GRPO from the same student, over several seeds.

    python launch/distill_vs_grpo.py --config configs/grpo_arith.py --seeds 1,2,3 \\
        --out runs/distill_vs_grpo.json [--teacher DIR] [--config.<field>=<value> ...]

The teacher is the config's own run to its end (seed `--teacher_seed`,
exported in Hugging Face format), unless `--teacher` names a checkpoint
directory. Per seed, one warm-up run (the config's `sft.steps` SFT
iterations, `rl.steps = 0`) is resumed by two arms that spend the same
`rl.steps` iterations on the same prompts (the seed's data order):

- `grpo`: the config as it is, its advantage from the reward;
- `distill`: the per-token reverse KL to the teacher as the advantage
  (`distill.teachers`, `distill.reward_coef = 0`): the reward is computed
  and logged but not trained on.

Each arm's held-out accuracy (greedy, the config's `eval.every`) is read
from its metrics against RL iterations and against the seconds its RL
iterations took (`time/step`, the teacher's forward included in
distillation's), and its last checkpoint is scored by `launch/eval.py`.
Prints per seed and the mean ± standard error over seeds, and the gain of
distillation over GRPO, paired by seed; writes them as JSON to `--out`
with the machine's record. Run it on a quiet machine: the seconds are
compared.
"""

import argparse
import os
import shutil
import time

try:  # imported as launch.<module> (tests), or run as a script from launch/
  from launch import rl_vs_sft
except ImportError:
  import rl_vs_sft

ARMS = ('grpo', 'distill')


def curve(workdir):
  """[(RL iteration, seconds of RL iterations so far, held-out accuracy)]
  from a run's metrics: its evaluations in the RL phase (the one at its
  start included)."""
  records = rl_vs_sft._records(workdir)
  rl = [r for r in records if r.get('phase', 0.0) > 0.0]
  start = min((r['step'] for r in rl), default=0)
  out, seconds, timed = [], 0.0, set()
  for r in records:
    if r.get('phase', 0.0) > 0.0 and 'time/step' in r and r['step'] not in timed:
      timed.add(r['step'])
      seconds += r['time/step']
    if 'eval/accuracy' in r and r['step'] >= start - 1:
      out.append((r['step'] - start + 1, seconds, r['eval/accuracy']))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default='configs/grpo_arith.py')
  parser.add_argument('--seeds', default='1,2,3', help='comma-separated student seeds')
  parser.add_argument('--teacher', default='', help='teacher checkpoint ("": train one)')
  parser.add_argument('--teacher_seed', type=int, default=0)
  parser.add_argument('--workdir', default='runs/distill_vs_grpo', help='one folder per run')
  parser.add_argument('--out', default='', help='JSON of the figures')
  args, overrides = parser.parse_known_args(argv)
  bad = [o for o in overrides if not o.startswith('--config.')]
  if bad:
    parser.error(f'unknown arguments {bad}: only --config.<field>=<value> are passed on')
  seeds = [int(s) for s in args.seeds.split(',')]
  os.makedirs(args.workdir, exist_ok=True)
  start = time.time()

  def train(name, run_overrides):
    return rl_vs_sft.train_run(args.config, args.workdir, name, run_overrides)

  teacher = args.teacher
  if not teacher:
    seeded = [*overrides, f'--config.seed={args.teacher_seed}', '--config.export_hf=True']
    teacher = os.path.join(train('teacher', seeded), 'hf_export')
  teacher = os.path.abspath(teacher)
  arm_fields = {
    'grpo': [],
    'distill': [f"--config.distill.teachers=('{teacher}',)", '--config.distill.reward_coef=0.0'],
  }
  runs = {arm: {} for arm in ARMS}
  for seed in seeds:
    seeded = [*overrides, f'--config.seed={seed}']
    warmup = train(f'warmup_seed{seed}', [*seeded, '--config.rl.steps=0'])
    for arm in ARMS:
      name = f'{arm}_seed{seed}'
      arm_overrides = [*seeded, *arm_fields[arm]]
      shutil.copytree(warmup, os.path.join(args.workdir, name), dirs_exist_ok=True)
      workdir = train(name, arm_overrides)  # resumes the warm-up
      log = os.path.join(args.workdir, f'{name}.eval.log')
      final = rl_vs_sft.accuracy(args.config, workdir, arm_overrides, log)
      runs[arm][seed] = {'final_accuracy': final, 'curve': curve(workdir)}
      points = ', '.join(f'{s}: {a:.3f} ({t:.0f} s)' for s, t, a in runs[arm][seed]['curve'])
      print(f'seed {seed} {arm}: final {final:.3f}; by RL iteration: {points}', flush=True)

  stats = {}
  for arm in ARMS:
    finals = [runs[arm][s]['final_accuracy'] for s in seeds]
    seconds = [runs[arm][s]['curve'][-1][1] for s in seeds if runs[arm][s]['curve']]
    mean, se = rl_vs_sft.mean_se(finals)
    stats[arm] = {'mean': mean, 'se': se, 'rl_seconds': rl_vs_sft.mean_se(seconds)[0]}
  finals = {arm: {s: runs[arm][s]['final_accuracy'] for s in seeds} for arm in ARMS}
  result = {
    'config': args.config,
    'overrides': overrides,
    'teacher': teacher,
    'seeds': seeds,
    'runs': runs,
    **stats,
    'gain_of_distill_over_grpo': rl_vs_sft.gain(finals['distill'], finals['grpo']),
    'wall_s': time.time() - start,
  }
  print(f'held-out accuracy over seeds {seeds} (teacher {teacher}):')
  for arm in ARMS:
    s = stats[arm]
    print(f'  {arm:8s} {s["mean"]:.3f} ± {s["se"]:.3f}   RL seconds {s["rl_seconds"]:.0f}')
  g = result['gain_of_distill_over_grpo']
  print(f'  distill over grpo, paired by seed: {g["paired_gain"]:+.3f} ± {g["paired_se"]:.3f}')
  rl_vs_sft.write_result(args.out, result)
  return result


if __name__ == '__main__':
  main()
