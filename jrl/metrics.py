"""Metric writers: console with a progress bar, JSONL, TensorBoard, and a PNG
of the learning curves at the end of a run.

`MetricsWriter(workdir, total_steps, resume_step)` appends to
`workdir/metrics.jsonl`; on resume it first drops the records of steps after
the checkpoint being resumed from (they will be recomputed), and tells
TensorBoard to purge them too, so the history of a resumed run is the
history of an uninterrupted one.
"""

import json
import math
import os
import sys
import time

import numpy as np

PLOT_KEYS = (
  ('reward/mean', 'reward'),
  ('eval/accuracy', 'held-out accuracy'),
  ('eval/pair_accuracy', 'held-out pairwise accuracy'),
  ('rm/loss', 'reward-model loss'),
  ('actor/kl_ref', 'KL to reference'),
  ('actor/approx_kl', 'KL old -> new (per update)'),
  ('actor/entropy', 'entropy'),
  ('response_length/mean', 'response length'),
)


def _to_float(v):
  v = float(np.asarray(v))
  return v if math.isfinite(v) else None


class MetricsWriter:
  """Writes one record per step to console, JSONL and TensorBoard."""

  def __init__(self, workdir, total_steps, *, resume_step=0, tensorboard=True, log_every=1):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.workdir = workdir
    self.total_steps = total_steps
    self.log_every = max(1, log_every)
    self._truncate(resume_step)
    self._file = open(self.path, 'a', encoding='utf-8')  # closed in close()
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter

      purge = resume_step + 1 if resume_step > 0 else 0
      self._tb = SummaryWriter(os.path.join(workdir, 'tb'), purge_step=purge)
    self._start = time.time()
    self._first_step = resume_step

  def _truncate(self, resume_step):
    """Keeps the records up to the checkpoint resumed from (none on a fresh start)."""
    if not os.path.exists(self.path):
      return
    kept = [r for r in read_jsonl(self.path) if 0 < resume_step and r['step'] <= resume_step]
    with open(self.path, 'w', encoding='utf-8') as f:
      for r in kept:
        f.write(json.dumps(r, sort_keys=True) + '\n')

  def write(self, step, metrics):
    record = {'step': int(step), **{k: _to_float(v) for k, v in metrics.items()}}
    self._file.write(json.dumps(record, sort_keys=True) + '\n')
    self._file.flush()
    if self._tb is not None:
      for k, v in record.items():
        if k != 'step' and v is not None:
          self._tb.add_scalar(k, v, step)
    if step % self.log_every == 0 or step == self.total_steps:
      self._console(step, record)

  def _console(self, step, record):
    frac = min(1.0, step / max(1, self.total_steps))
    width = 20
    bar = '#' * int(frac * width) + '.' * (width - int(frac * width))
    done = step - self._first_step
    elapsed = time.time() - self._start
    eta = elapsed / done * (self.total_steps - step) if done > 0 else float('nan')
    labels = (
      ('phase', 'phase'),
      ('eval/accuracy', 'eval_acc'),
      ('sft/nll', 'nll'),
      ('dpo/loss', 'dpo_loss'),
      ('rewards/accuracies', 'pref_acc'),
      ('rm/loss', 'rm_loss'),
      ('rm/accuracy', 'rm_acc'),
      ('eval/pair_accuracy', 'eval_pair_acc'),
      ('reward/mean', 'reward'),
      ('actor/pg_loss', 'pg_loss'),
      ('actor/kl_ref', 'kl'),
      ('actor/entropy', 'entropy'),
      ('response_length/mean', 'len'),
      ('time/step', 's/step'),
    )
    parts = [f'{label}={record[k]:.4g}' for k, label in labels if record.get(k) is not None]
    line = f'[{bar}] {step}/{self.total_steps} ' + ' '.join(parts) + f' eta {eta:.0f}s'
    print(line, file=sys.stdout, flush=True)

  def close(self):
    self._file.close()
    if self._tb is not None:
      self._tb.close()


class NullWriter:
  """The writer of processes other than 0: writes nothing."""

  path = None

  def write(self, step, metrics):
    del step, metrics

  def close(self):
    pass


def read_jsonl(path):
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_curves(metrics_path, out_path, keys=PLOT_KEYS):
  """PNG of the given metrics against the step; missing metrics are skipped."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  records = read_jsonl(metrics_path)
  # A metric that is missing or identically zero (e.g. the KL to a reference
  # that is not used) gets no panel.
  present = [(k, title) for k, title in keys if any(r.get(k) for r in records)]
  if not present:
    return None
  fig, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2), squeeze=False)
  for ax, (k, title) in zip(axes[0], present, strict=True):
    pts = [(r['step'], r[k]) for r in records if r.get(k) is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.5)
    ax.set_title(title)
    ax.set_xlabel('step')
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)
  return out_path
