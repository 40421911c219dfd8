"""Plans a cluster for an RL job: which topology, rollout:train split, mesh and
micro-batch, ranked by estimated step time, and why the others lose.

    python launch/plan.py --model qwen2.5-7b --hardware h100 --chips 64 \
        --prompts 512 --group 8 --prompt_len 512 --response_mean 1024 --response_max 4096

    python launch/plan.py --model /path/to/hf_dir --hardware tpu-v5e --chips 64 ...
    python launch/plan.py --model qwen2.5-0.5b --hardware this --calibration runs/x/trace.json ...
    python launch/plan.py ... --packing --pack_row_len 8192   # as train.packing, train.pack_row_len

Every layout (colocated, and disaggregated, one-step-off and async with
k = 2 and 4 on separate chips with each power-of-two rollout share, each
tensor degree up to a node, the largest micro-batch that fits) is checked
against the chip's memory and timed with `jrl.costmodel` (roofline of the hardware preset with its
assumed utilisation, or coefficients calibrated from a trace of a run on
this machine). Cost is chip-seconds per step: chips x step time. The
training passes cost the tokens they run: padded rows, or with `--packing`
rows packed as the trainer packs them; the report gives the real tokens, the
tokens run and the packing efficiency of one pass over a step's batch.
"""

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jrl import costmodel
from jrl.data import packing
from jrl.models.config import ModelConfig

MEMORY_HEADROOM = 0.9  # plan to use at most this share of a chip's memory
# Topologies on separate chips, with the steps generation may run ahead (async
# with k = 1 is one_step_off).
ASYNC_CHOICES = (('disaggregated', 1), ('one_step_off', 1), ('async', 2), ('async', 4))


def load_model(spec):
  if spec in costmodel.MODEL_PRESETS:
    return costmodel.model_preset(spec)
  path = os.path.join(spec, 'config.json') if os.path.isdir(spec) else spec
  if not os.path.exists(path):
    raise ValueError(
      f'--model: {spec!r} is neither a preset {sorted(costmodel.MODEL_PRESETS)} nor a '
      'directory or file with a Hugging Face config.json.'
    )
  with open(path, encoding='utf-8') as f:
    return ModelConfig.from_hf(json.load(f), source=path)


def load_hardware(name):
  if name == 'this':
    return costmodel.measure_this_machine()
  if name not in costmodel.HARDWARE:
    raise ValueError(f"--hardware must be one of {sorted(costmodel.HARDWARE)} or 'this'.")
  return costmodel.HARDWARE[name]


def candidate_layouts(chips, chips_per_node):
  """Every layout worth timing for `chips` chips."""
  tensors = [t for t in (1, 2, 4, 8) if t <= min(chips, chips_per_node) and chips % t == 0]
  out = []
  for t in tensors:
    for decode in ('gathered', 'sharded') if chips // t > 1 else ('gathered',):
      out.append(
        costmodel.Layout(
          'colocated', train_chips=chips, tensor=t, rollout_tensor=t, decode_weights=decode
        )
      )
  splits = [chips * k // 8 for k in range(1, 8) if chips * k % 8 == 0] or []
  for rollout in sorted(set(splits)):
    train = chips - rollout
    if rollout < 1 or train < 1:
      continue
    for t in tensors:
      for tr in tensors:
        if train % t or rollout % tr:
          continue
        for topology, ahead in ASYNC_CHOICES:
          out.append(
            costmodel.Layout(
              topology,
              train_chips=train,
              rollout_chips=rollout,
              tensor=t,
              rollout_tensor=tr,
              staleness=ahead,
            )
          )
  return out


def evaluate(model, hw, workload, layout, coeffs=None):
  """(plan dict) for one layout: the most sampler slots and then the largest
  micro-batch that fit in memory, the stage times, or why nothing fits."""
  minibatch = workload.minibatch_rows or workload.rows
  data_ways = max(1, layout.train_chips // layout.tensor)
  slot_options = [workload.num_slots // 2**k for k in range(4)]
  slot_options = [n for n in slot_options if n >= workload.group_size] or [workload.group_size]
  micro_options = sorted(
    {minibatch // 2**k for k in range(12) if minibatch // 2**k >= data_ways}, reverse=True
  ) or [data_ways]
  for slots in slot_options:
    w = dataclasses.replace(workload, num_slots=slots)
    for rows in micro_options:
      trial = dataclasses.replace(layout, micro_rows=rows)
      m = costmodel.memory(model, w, trial)
      if max(m['train']['total'], m['rollout']['total']) <= MEMORY_HEADROOM * hw.mem_bytes:
        c = coeffs or costmodel.Coefficients.from_hardware(model, hw, w, trial)
        times = costmodel.predict(model, w, trial, c)
        return {
          'layout': trial,
          'feasible': True,
          'micro_rows': rows,
          'slots': slots,
          'memory': m,
          'times': times,
          'cost': trial.chips * times['step'],
          'cv': w.generation_cv,
        }
  w = dataclasses.replace(workload, num_slots=slot_options[-1])
  m = costmodel.memory(model, w, dataclasses.replace(layout, micro_rows=micro_options[-1]))
  worst = max(m['train']['total'], m['rollout']['total'])
  side = 'train' if m['train']['total'] >= m['rollout']['total'] else 'rollout'
  big = max((k for k in m[side] if k != 'total'), key=lambda k: m[side][k])
  return {
    'layout': layout,
    'feasible': False,
    'why': f'out of memory: {worst / 2**30:.1f} GiB per {side} chip > '
    f'{MEMORY_HEADROOM:.0%} of {hw.mem_bytes / 2**30:.0f} GiB (largest: {big})',
  }


def why_worse(plan, best):
  """One line: how much slower than `best`, and what bounds it."""
  t, b = plan['times'], best['times']
  lay = plan['layout']
  train = t['reference'] + t['proximal'] + t['update']
  rollout = t['generate'] + t['reward']
  parts = [f'x{t["step"] / b["step"]:.2f} step time']
  if t['bound'] == 'communication':
    parts.append('communication-bound: FSDP collectives outlast the update compute')
  elif max(t['rollout_idle'], t['train_idle']) > 0.3:
    side = 'rollout' if t['rollout_idle'] > t['train_idle'] else 'training'
    idle = max(t['rollout_idle'], t['train_idle'])
    parts.append(f'bubble-bound: {side} chips idle {idle:.0%} of the step')
  elif lay.separate and t['step'] > 1.005 * (max(rollout, train) + t['reshard']):
    parts.append(
      f'waits for slow rollouts: generation varies {plan["cv"]:.0%} from step to step and '
      f'{topology_name(lay)} buffers {lay.staleness} step(s) of it'
    )
  elif lay.separate:
    parts.append(
      f'generation takes {t["generate"]:.1f} s on {lay.rollout_chips} chips and training '
      f"{train:.1f} s on {lay.train_chips}; neither side can use the other's chips"
    )
  else:
    parts.append(f'generation {t["generate"]:.1f} s + training {train:.1f} s in turn')
  return '; '.join(parts)


def topology_name(layout):
  """The topology, with k for async."""
  if layout.topology == 'async':
    return f'async k={layout.staleness}'
  return layout.topology


def describe(layout):
  lay = layout
  if not lay.separate:
    split = f'{lay.train_chips} shared'
  else:
    split = f'{lay.rollout_chips} rollout : {lay.train_chips} train'
  mesh = f'fsdp {lay.train_chips // lay.tensor} x tensor {lay.tensor}'
  decode = f'decode {lay.decode_weights}' if lay.decode_copy or lay.decode_fsdp else ''
  name = topology_name(lay)
  return f'{name:13s} {split:22s} {mesh:22s} rollout tp {lay.rollout_tensor:<2d} {decode}'


def plan(model, hw, workload, chips, coeffs=None, top=8):
  """(ranked feasible plans, infeasible plans)."""
  plans = [
    evaluate(model, hw, workload, lay, coeffs)
    for lay in candidate_layouts(chips, hw.chips_per_node)
  ]
  ok = sorted((p for p in plans if p['feasible']), key=lambda p: p['times']['step'])
  bad = [p for p in plans if not p['feasible']]
  return ok[:top] if top else ok, bad


def report(model, hw, workload, chips, coeffs=None, top=8, out=None):
  out = out or sys.stdout
  ok, bad = plan(model, hw, workload, chips, coeffs, top=0)
  p = model.num_params()
  if coeffs:
    basis = coeffs.source
  else:
    basis = (
      f'roofline at {hw.train_mfu:.0%} train MFU, {hw.decode_mfu:.0%} decode MFU, '
      f'{hw.bw_eff:.0%} of memory bandwidth'
    )
  print(
    f'plan: {p / 1e9:.2f}B-parameter model on {chips} x {hw.name} '
    f'({hw.peak_flops / 1e12:.0f} TFLOP/s, {hw.mem_bw / 1e9:.0f} GB/s, '
    f'{hw.mem_bytes / 2**30:.0f} GiB each; {basis})',
    file=out,
  )
  minibatch = workload.minibatch_rows or workload.rows
  print(
    f'workload: {workload.prompts_per_step} prompts x G={workload.group_size}, prompt '
    f'{workload.prompt_len} tokens, responses mean {workload.response_mean:.0f} / max '
    f'{workload.response_max}, {workload.epochs} epoch(s), minibatch {minibatch} rows',
    file=out,
  )
  print(
    f'assumed: generation time varies {workload.generation_cv:.0%} from step to step '
    '(--generation_cv; what async k > 1 absorbs on separate chips; async k = 1 is '
    'one_step_off), partial rollouts not modelled',
    file=out,
  )
  print(tokens_line(ok[0]['times'] if ok else None, workload), file=out)
  if not ok:
    print('no layout fits:', file=out)
    for b in bad[:top]:
      print(f'  {describe(b["layout"])}  {b["why"]}', file=out)
    return ok, bad
  best = ok[0]
  print(
    f'  {"rank":4s} {"layout":100s} {"slots":>5s} {"micro":>5s} {"GiB/chip":>8s} {"gen s":>7s} '
    f'{"train s":>7s} '
    f'{"step s":>7s} {"chip-h/1k steps":>15s}',
    file=out,
  )
  for i, pl in enumerate(ok[:top]):
    t, m = pl['times'], pl['memory']
    gib = max(m['train']['total'], m['rollout']['total']) / 2**30
    train = t['reference'] + t['proximal'] + t['update']
    print(
      f'  {i + 1:<4d} {describe(pl["layout"]):100s} {pl["slots"]:5d} {pl["micro_rows"]:5d} '
      f'{gib:8.1f} '
      f'{t["generate"]:7.1f} {train:7.1f} {t["step"]:7.1f} {pl["cost"] * 1000 / 3600:15.1f}',
      file=out,
    )
  lay = best['layout']
  print(
    f'recommended: {topology_name(lay)}, '
    + (
      f'{lay.rollout_chips}:{lay.train_chips} rollout:train' if lay.separate else 'all chips shared'
    )
    + f', training mesh fsdp {lay.train_chips // lay.tensor} x tensor {lay.tensor}, '
    + (
      f'sampler.decode_weights={lay.decode_weights}, ' if lay.decode_copy or lay.decode_fsdp else ''
    )
    + f'micro-batch {best["micro_rows"]} rows, {best["slots"]} sampler slots per replica; '
    f'step {best["times"]["step"]:.1f} s '
    f'({best["times"]["bound"]}-bound)',
    file=out,
  )
  shown = {topology_name(lay)}
  print('why not the others:', file=out)
  for pl in ok[1:]:
    key = topology_name(pl['layout'])
    if key in shown:
      continue
    shown.add(key)
    print(f'  best {describe(pl["layout"])}: {why_worse(pl, best)}', file=out)
  if bad:
    print(
      f'  {len(bad)} layouts do not fit, e.g. {describe(bad[0]["layout"])}: {bad[0]["why"]}',
      file=out,
    )
  return ok, bad


def tokens_line(times, workload):
  """Real tokens, tokens run and packing efficiency of one pass over a step's
  batch (the reference pass, the proximal pass, each update epoch), from the
  best plan's `times` (or the workload on one batch shard)."""
  if times is None:
    tok = costmodel.tokens_run(workload)
    real, run, eff = tok.real, tok.run, tok.efficiency
  else:
    real, run, eff = times['tokens_real'], times['tokens_run'], times['packing_efficiency']
  w = workload
  rows = f'packed rows of {w.row_len}' if w.packing else f'padded rows of {w.seq_len}'
  if w.micro_batch_tokens:
    shorter = ', '.join(str(n) for n in packing.row_len_buckets(w.row_len)[1:])
    rows += f' (or {shorter})' if shorter else ''
    rows += f', micro-batches of {w.micro_batch_tokens} tokens per shard'
  return (
    f'tokens per pass over a step: {real:,} real, {run:,} run ({rows}); '
    f'packing efficiency {eff:.1%}'
  )


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', required=True, help='preset name or HF checkpoint directory')
  parser.add_argument('--hardware', required=True, help="preset name or 'this'")
  parser.add_argument('--chips', type=int, required=True)
  parser.add_argument('--prompts', type=int, default=256)
  parser.add_argument('--group', type=int, default=8)
  parser.add_argument('--prompt_len', type=int, default=512)
  parser.add_argument('--response_mean', type=float, default=1024)
  parser.add_argument('--response_max', type=int, default=4096)
  parser.add_argument('--clip_frac', type=float, default=0.05, help='responses reaching max')
  parser.add_argument('--epochs', type=int, default=1)
  parser.add_argument('--minibatch', type=int, default=0, help='rows per optimiser step')
  parser.add_argument('--kl', action='store_true', help='a reference model runs every step')
  parser.add_argument('--slots', type=int, default=256, help='sampler slots per replica')
  parser.add_argument('--reward_s', type=float, default=1e-3, help='seconds per completion')
  parser.add_argument('--packing', action='store_true', help='pack sequences (train.packing)')
  parser.add_argument('--pack_row_len', type=int, default=0, help='train.pack_row_len (0: seq)')
  parser.add_argument(
    '--micro_batch_tokens', type=int, default=0, help='train.micro_batch_tokens (0: off)'
  )
  parser.add_argument('--calibration', default='', help='trace.json of a run on this machine')
  parser.add_argument(
    '--generation_cv',
    type=float,
    default=None,
    help="step-to-step spread of generation time, std / mean (default: the trace's with "
    '--calibration, else 0.1)',
  )
  parser.add_argument('--top', type=int, default=8)
  opts = parser.parse_args(argv)
  if opts.chips < 1:
    parser.error('--chips must be >= 1')
  return opts


def main(argv=None):
  opts = parse_args(sys.argv[1:] if argv is None else argv)
  model = load_model(opts.model)
  hw = load_hardware(opts.hardware)
  workload = costmodel.Workload(
    prompts_per_step=opts.prompts,
    group_size=opts.group,
    prompt_len=opts.prompt_len,
    response_mean=opts.response_mean,
    response_max=opts.response_max,
    response_clip_frac=opts.clip_frac,
    epochs=opts.epochs,
    minibatch_rows=opts.minibatch,
    reference=opts.kl,
    num_slots=opts.slots,
    reward_s=opts.reward_s,
    param_bytes=4,
    compute_bytes=2,
    packing=opts.packing,
    pack_row_len=opts.pack_row_len,
    micro_batch_tokens=opts.micro_batch_tokens,
  )
  coeffs, cv = None, opts.generation_cv
  if opts.calibration:
    # The trace's own workload and model; scaled to `model` by FLOPs per token.
    with open(opts.calibration, encoding='utf-8') as f:
      trace = json.load(f)
    coeffs = costmodel.calibrate(trace, model=model)
    cv = costmodel.generation_cv(trace) if cv is None else cv
  workload = dataclasses.replace(workload, generation_cv=0.1 if cv is None else cv)
  report(model, hw, workload, opts.chips, coeffs, top=opts.top)


if __name__ == '__main__':
  main()
