"""`topology`: step time of colocated vs one-step-off GRPO (the RL phase of
configs/grpo_arith.py, or its `larger` setup).

    python launch/bench.py topology [--setup default|larger --steps 10]
"""

import statistics
import time

from launch.benches import common
from launch.benches.grpo import GRPO_SETUPS

HELP = 'colocated vs one-step-off step time'


def add_arguments(parser):
  parser.add_argument('--setup', choices=sorted(GRPO_SETUPS), default='default')
  parser.add_argument('--steps', type=int, default=10)


def run(args):
  common.import_configs()
  from configs import grpo_arith
  from jrl import trainers
  from jrl.trainers import controller

  def job_for(kind):
    overrides = {**GRPO_SETUPS[args.setup], 'topology.kind': kind}
    return trainers.build(common.bench_config(grpo_arith.get_config(), args.steps, overrides))

  print(f'topology ({args.setup} setup, {args.steps} steps each, medians after the first 2)')
  results = {}
  for kind in ('colocated', 'one_step_off'):
    job = job_for(kind)
    start = time.perf_counter()
    records = common.rl_iterations(job, args.steps)
    total = time.perf_counter() - start
    controller.close(job)
    steady = records[2:] or records
    med = lambda k, steady=steady: statistics.median(r.get(k, 0.0) for r in steady)
    results[kind] = med('time/step')
    print(
      f'  {kind:13s} step {med("time/step"):.3f} s  (generate {med("time/generate"):.3f} s, '
      f'update {med("time/update"):.3f} s, waiting for the rollout '
      f'{med("time/rollout_wait"):.3f} s; {total:.1f} s for all steps)'
    )
  ratio = results['one_step_off'] / results['colocated']
  print(f'  step time one-step-off / colocated: x{ratio:.2f}')
