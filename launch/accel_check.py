"""jrl on whatever accelerator JAX sees, in one call under a hard time budget.

    python launch/accel_check.py [--budget_s 480 --out runs/accel_check.json]
    python launch/accel_check.py --mode tiny      # the CPU mode the test suite runs
    python launch/accel_check.py --parts device,sampler

Numerics first, then measurements (launch/accel_numerics.py and
launch/accel_parts.py define the parts; docs/tpu_and_gpu_clusters.md says
what each figure means):

  device           backend, device kind, bf16 / f32 matmul peaks (the MFU denominators)
  paged_attention  the sampler's Pallas kernel vs the gather path, NaN where no slot reads
  train_attention  cuDNN (GPU) / splash (TPU) vs XLA: logprobs and gradients, packed and padded
  logprob_match    sampler logprobs vs the trainer's recomputed ones, f32 and bf16
  bf16_update      one update in bf16 compute with f32 master weights vs the f32 step
  sampler          output tokens/s on 64 prompts x G=8 (prompts 128-512, up to 1,024 new)
  update           update tokens/s and MFU, packed rows in micro-batches
  grpo_step        whole GRPO steps through the trainer, seconds per stage
  sampler_gather   the sampler on the gather path (the kernel's baseline)
  sampler_1.5b, update_1.5b   the same on a Qwen2.5-1.5B shape, where time is left

Each part runs in a process of its own (its peak device memory is its own;
a crash or a hang ends only that part), killed at the time left. A part the
budget cannot fit is skipped and says so. The figures go to `--out` as
JSON after every part, and one table is printed at the end. The exit status
is 0 whatever the parts did; read the statuses: ok, mismatch (a numerics
check failed), failed, timeout, skipped.

`--mode auto` (the default) is 'full' on a GPU or TPU (random-weight
Qwen2.5-0.5B-shaped models) and 'tiny' on the CPU (the same code paths on
tiny shapes, the kernels in Pallas interpret mode).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))

# name: (module.function, keyword arguments, model size,
#        seconds to start it at all in full mode, seconds at most in full mode)
PARTS = {
  'device': ('accel_parts.device', {}, '0.5b', 20, 90),
  'paged_attention': ('accel_numerics.paged_attention', {}, '0.5b', 25, 120),
  'train_attention': ('accel_numerics.train_attention', {}, '0.5b', 25, 120),
  'logprob_match': ('accel_numerics.logprob_match', {}, '0.5b', 30, 120),
  'bf16_update': ('accel_numerics.bf16_update', {}, '0.5b', 30, 120),
  'sampler': ('accel_parts.sampler', {}, '0.5b', 60, 180),
  'update': ('accel_parts.update', {}, '0.5b', 60, 180),
  'grpo_step': ('accel_parts.grpo_step', {}, '0.5b', 90, 240),
  'sampler_gather': ('accel_parts.sampler', {'impl': 'gather'}, '0.5b', 60, 150),
  'sampler_1.5b': ('accel_parts.sampler', {}, '1.5b', 80, 150),
  'update_1.5b': ('accel_parts.update', {}, '1.5b', 80, 150),
}
RESERVE_S = 5  # kept back for writing the figures


def run_part(name, mode, earlier):
  """Runs part `name` in this process: {'figures', 'peak_device_bytes', 'peak_rss_bytes'}."""
  import importlib

  sys.path.insert(0, HERE)
  import accel_parts

  target, kwargs, size, _, _ = PARTS[name]
  module, fn_name = target.split('.')
  ctx = accel_parts.Context(mode=mode, earlier=earlier, size=size)
  figures = getattr(importlib.import_module(module), fn_name)(ctx, **kwargs)
  peak, _ = accel_parts.device_memory()
  return {
    'figures': figures,
    'peak_device_bytes': peak,
    'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  }


def _child(args):
  """`--child NAME`: one part; its result (or the error) as JSON at --result."""
  with open(args.earlier, encoding='utf-8') as f:
    earlier = json.load(f)
  try:
    result = run_part(args.child, args.mode, earlier)
  except Exception as e:  # a broken part is a figure too
    result = {'error': f'{type(e).__name__}: {e}', 'traceback': traceback.format_exc()[-4000:]}
  with open(args.result, 'w', encoding='utf-8') as f:
    json.dump(result, f, default=_plain)


def _plain(x):
  """JSON for numpy scalars and the odd object."""
  try:
    return x.item()
  except AttributeError:
    return str(x)


def _status(result):
  if 'error' in result:
    return 'failed'
  failed = [k for k, ok in result['figures'].get('checks', {}).items() if not ok]
  return 'mismatch: ' + ', '.join(failed) if failed else 'ok'


def _in_process(name, mode, earlier, timeout):
  del timeout  # inline parts cannot be killed; tiny mode needs no limit
  try:
    return run_part(name, mode, earlier)
  except Exception as e:
    return {'error': f'{type(e).__name__}: {e}', 'traceback': traceback.format_exc()[-4000:]}


def _subprocess(name, mode, earlier, timeout):
  with tempfile.TemporaryDirectory(prefix='jrl-accel-') as tmp:
    earlier_path, result_path = os.path.join(tmp, 'earlier.json'), os.path.join(tmp, 'result.json')
    with open(earlier_path, 'w', encoding='utf-8') as f:
      json.dump(earlier, f, default=_plain)
    cmd = [
      sys.executable,
      os.path.abspath(__file__),
      '--child',
      name,
      '--mode',
      mode,
      '--earlier',
      earlier_path,
      '--result',
      result_path,
    ]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      return {'timeout': True, 'error': f'killed after {timeout:.0f} s (the time left)'}
    if os.path.exists(result_path):
      with open(result_path, encoding='utf-8') as f:
        return json.load(f)
    return {'error': f'exit {proc.returncode}: {proc.stderr[-2000:].strip()}'}


def probe_backend():
  """JAX's default backend, asked in a child process so that this one never
  holds an accelerator (a GPU's memory would be taken from the parts)."""
  out = subprocess.run(
    [sys.executable, '-c', 'import jax; print(jax.default_backend())'],
    capture_output=True,
    text=True,
    timeout=300,
  )
  return out.stdout.strip().splitlines()[-1] if out.returncode == 0 else 'unknown'


def check(parts, mode, budget_s, out_path, inline=False, backend=None, start=None):
  """Runs `parts` in order within `budget_s` seconds from `start` (a
  `time.perf_counter()` value; default now); returns the report dict (also
  written to `out_path` after each part)."""
  start = time.perf_counter() if start is None else start
  report = {'mode': mode, 'backend': backend, 'budget_s': budget_s, 'parts': {}}
  earlier = {}
  run = _in_process if inline else _subprocess
  for name in parts:
    _, _, _, need_s, cap_s = PARTS[name]
    left = budget_s - (time.perf_counter() - start) - RESERVE_S
    need_s = need_s if mode == 'full' else 1
    if mode == 'tiny' and PARTS[name][2] != '0.5b':
      entry = {
        'status': 'skipped',
        'seconds': 0.0,
        'reason': 'full mode only (tiny mode runs this code in the 0.5b parts)',
      }
    elif left < need_s:
      entry = {
        'status': 'skipped',
        'seconds': 0.0,
        'reason': f'{left:.0f} s left of the budget, the part needs about {need_s} s',
      }
    else:
      t0 = time.perf_counter()
      print(f'[{time.perf_counter() - start:6.1f} s] {name} ...', flush=True)
      result = run(name, mode, earlier, min(left, cap_s if mode == 'full' else left))
      entry = {
        'status': 'timeout' if result.get('timeout') else _status(result),
        'seconds': time.perf_counter() - t0,
        **result,
      }
      # What later parts see: the figures, or that this part did not give any.
      earlier[name] = result.get('figures', {'failed': entry['status']})
    report['parts'][name] = entry
    print(
      f'  {name}: {entry["status"]} ({entry["seconds"]:.1f} s) '
      f'{entry.get("figures", {}).get("headline", entry.get("error", entry.get("reason", "")))}',
      flush=True,
    )
    report['wall_s'] = time.perf_counter() - start
    if out_path:
      os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
      with open(out_path, 'w', encoding='utf-8') as f:
        json.dump(report, f, indent=1, default=_plain)
  return report


def table(report):
  """The printed table: one row per part."""
  rows = [
    f'accel check ({report["mode"]} mode, backend {report["backend"]}): '
    f'{report["wall_s"]:.0f} s of a {report["budget_s"]:.0f} s budget'
  ]
  rows.append(f'{"part":16s} {"status":12s} {"s":>6s}  {"peak mem":>9s}  figures')
  for name, e in report['parts'].items():
    peak = e.get('peak_device_bytes') or e.get('peak_rss_bytes')
    mem = f'{peak / 2**30:7.2f}G' if peak else '        -'
    text = e.get('figures', {}).get('headline') or e.get('error') or e.get('reason', '')
    rows.append(f'{name:16s} {e["status"][:12]:12s} {e["seconds"]:6.1f}  {mem}  {text[:160]}')
  return '\n'.join(rows)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--mode', choices=('auto', 'tiny', 'full'), default='auto')
  p.add_argument('--budget_s', type=float, default=480.0, help='the whole run, seconds')
  p.add_argument('--parts', default=','.join(PARTS), help='comma-separated, in this order')
  p.add_argument('--out', default='runs/accel_check.json', help='the JSON report')
  p.add_argument('--inline', action='store_true', help='every part in this process (no limits)')
  p.add_argument('--child', help=argparse.SUPPRESS)
  p.add_argument('--earlier', help=argparse.SUPPRESS)
  p.add_argument('--result', help=argparse.SUPPRESS)
  start = time.perf_counter()  # the budget counts from here: the backend probe is in it
  args = p.parse_args(argv)
  if args.child:
    return _child(args)
  parts = [x for x in args.parts.split(',') if x]
  unknown = [x for x in parts if x not in PARTS]
  if unknown:
    raise SystemExit(f'--parts: unknown {unknown}; have {list(PARTS)}')
  if args.inline:
    import jax

    backend = jax.default_backend()
  else:
    backend = probe_backend()
  mode = args.mode if args.mode != 'auto' else ('tiny' if backend == 'cpu' else 'full')
  report = check(parts, mode, args.budget_s, args.out, args.inline, backend, start)
  print(table(report))
  if args.out:
    print(f'figures written to {args.out}')
  return report


if __name__ == '__main__':
  main()
