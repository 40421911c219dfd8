"""`costmodel`: the cost model calibrated on a short traced run of the default
job's RL phase, then its predictions for other configurations against their
measured steps.

    python launch/bench.py costmodel [--steps 8 --warmup 2]
"""

import statistics

from launch.benches import common

HELP = 'cost model calibration and prediction vs measurement'


def add_arguments(parser):
  parser.add_argument('--steps', type=int, default=8)
  parser.add_argument('--warmup', type=int, default=2, help='steps left out (compilation)')


COSTMODEL_CASES = {
  # name: (config overrides, topology)
  'default G=8': {},
  'G=4, 32 prompts, 12 new': {
    'rl.group_size': 4,
    'rl.prompts_per_step': 32,
    'task.max_response_len': 12,
  },
  'G=16, 8 prompts, 10 new': {
    'rl.group_size': 16,
    'rl.prompts_per_step': 8,
    'task.max_response_len': 10,
  },
  'KL (reference model)': {'rl.kl_coef': 0.001},
  'one-step-off': {'topology.kind': 'one_step_off'},
}


def run(args):
  """Calibrates the cost model on a short traced run of the default job's RL
  phase, then predicts other configurations and measures them."""
  common.import_configs()
  from configs import grpo_arith
  from jrl import costmodel, trainers
  from jrl.trainers import controller

  def measure(overrides):
    overrides = {'reward.mode': 'inline', **overrides}
    config = common.bench_config(grpo_arith.get_config(), args.steps, overrides)
    rl = config.rl
    rl.minibatch_size = min(rl.minibatch_size, rl.prompts_per_step * rl.group_size)
    config.sampler.num_slots = max(config.sampler.num_slots, rl.group_size)
    job = trainers.build(config)
    tracer = job.resources.tracer
    state, records, t_warm = job.state, [], None
    for i in range(args.steps):
      if i == args.warmup:
        t_warm = tracer.now()
      state, report = job.iterate(state, i)
      records.append(report.metrics)
    controller.close(job)
    steady = records[args.warmup :]
    med = lambda k: statistics.median(r.get(k, 0.0) for r in steady)
    trace = tracer.trace()
    trace['traceEvents'] = [e for e in trace['traceEvents'] if e.get('ts', 1e18) >= t_warm * 1e6]
    workload = costmodel.Workload(
      prompts_per_step=rl.prompts_per_step,
      group_size=rl.group_size,
      prompt_len=round(
        statistics.mean(
          len(job.resources.encoder.prompt_ids(ex['prompt']))
          for ex in job.resources.task.held_out[:50]
        )
      ),
      max_prompt_len=config.task.max_prompt_len,
      response_mean=med('response_length/mean'),
      response_max=config.task.max_response_len,
      response_clip_frac=med('response_length/clip_ratio'),
      epochs=rl.epochs,
      minibatch_rows=rl.minibatch_size,
      reference=rl.kl_coef > 0,
      num_slots=config.sampler.num_slots,
      page_size=config.sampler.page_size,
      steps_per_dispatch=config.sampler.steps_per_dispatch,
      param_bytes=4,
      compute_bytes=4,
      packing=bool(config.train.packing),
      pack_row_len=config.train.pack_row_len if config.train.packing else 0,
      micro_batch_tokens=config.train.micro_batch_tokens if config.train.packing else 0,
    )
    layout = costmodel.Layout(topology=config.topology.kind)
    measured = {
      'generate': med('time/generate'),
      'reward': med('time/reward'),
      'reference': med('time/reference'),
      'update': med('time/update'),
      'step': med('time/step'),
    }
    return job.resources.model.config, workload, layout, trace, measured

  model, workload, layout, trace, measured = measure({})
  coeffs = costmodel.calibrate(trace, workload)
  print(
    f'cost model on this machine, calibrated on the default job ({args.steps} RL steps, '
    f'medians after {args.warmup})'
  )
  print(
    f'  coefficients: decode {1e3 * coeffs.decode_fixed_s:.2f} ms/step + '
    f'{1e3 * coeffs.decode_page_s:.3f} ms/page bound; '
    f'prefill {1e3 * coeffs.prefill_fixed_s:.2f} ms + {1e6 * coeffs.prefill_token_s:.1f} us/token; '
    f'update {1e6 * coeffs.train_token_s:.2f} us/token; '
    f'reward {1e6 * coeffs.reward_s:.1f} us/completion'
  )
  header = (
    f'  {"configuration":28s} {"stage":10s} {"predicted":>10s} {"measured":>10s} {"ratio":>7s}'
  )
  print(header)
  errors = []
  for name, overrides in COSTMODEL_CASES.items():
    if name != 'default G=8':
      model, workload, layout, trace, measured = measure(overrides)
    predicted = costmodel.predict(model, workload, layout, coeffs)
    for stage in ('generate', 'reward', 'reference', 'update', 'step'):
      if measured[stage] < 1e-3 and predicted[stage] < 1e-3:
        continue
      ratio = predicted[stage] / max(measured[stage], 1e-9)
      if stage in ('generate', 'update', 'step'):
        errors.append(abs(ratio - 1))
      print(
        f'  {name:28s} {stage:10s} {predicted[stage]:9.3f}s {measured[stage]:9.3f}s {ratio:7.2f}'
      )
  print(
    f'  generate/update/step: median |error| {100 * statistics.median(errors):.0f}%, '
    f'max {100 * max(errors):.0f}%'
  )
