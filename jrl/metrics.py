"""Metric writers: console with a progress bar, JSONL, TensorBoard, Weights &
Biases (optional), and a PNG of the learning curves at the end of a run.

`MetricsWriter(workdir, total_steps, resume_step)` appends to
`workdir/metrics.jsonl`; on resume it first drops the records of steps after
the checkpoint being resumed from (they will be recomputed), and tells
TensorBoard to purge them too, so the history of a resumed run is the
history of an uninterrupted one.

Weights & Biases (`wandb={'project': ..., 'mode': 'offline' | 'online'}`,
`pip install -e ".[wandb]"`): the same metric names, logged against a
`step` metric of their own, so the records a resumed run writes again for
the steps after its checkpoint are new points at those steps (W&B cannot
delete points; metrics.jsonl stays the exact history). The run id is kept in
`workdir/wandb_id`, so a resumed run continues the same W&B run; 'offline'
writes under `workdir/wandb/` without any network (`wandb sync` uploads it
later).

`write_samples(step, samples)` logs example completions with their rewards:
to the console (the first few, cut), `workdir/samples.jsonl`, TensorBoard
text and a W&B table.
"""

import json
import math
import os
import secrets
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

  def __init__(
    self, workdir, total_steps, *, resume_step=0, tensorboard=True, log_every=1, wandb=None
  ):
    """`wandb`: None (off) or a mapping with 'project' and optionally 'mode'
    ('offline' default, 'online'), 'entity', 'name', 'config' (a dict)."""
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
    self._wandb = _start_wandb(workdir, wandb) if wandb else None

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
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in record.items() if v is not None})
    if step % self.log_every == 0 or step == self.total_steps:
      self._console(step, record)

  def write_samples(self, step, samples, *, show=2, width=300):
    """Logs example completions: `samples` is a list of dicts with at least
    'prompt', 'completion' and 'reward' (more keys are kept in the JSONL)."""
    path = os.path.join(self.workdir, 'samples.jsonl')
    with open(path, 'a', encoding='utf-8') as f:
      for sample in samples:
        f.write(json.dumps({'step': int(step), **sample}, sort_keys=True, default=str) + '\n')
    for sample in samples[:show]:
      text = ' '.join(str(sample['completion']).split())
      print(f'  sample @ {step} (reward {sample["reward"]:.3g}): {text[:width]}', flush=True)
    if self._tb is not None:
      rows = [
        f'| {float(x["reward"]):.3g} | {_md(x["prompt"])} | {_md(x["completion"])} |'
        for x in samples
      ]
      table = '| reward | prompt | completion |\n|---|---|---|\n' + '\n'.join(rows)
      self._tb.add_text('samples', table, step)
    if self._wandb is not None:
      import wandb

      columns = ['step', 'reward', 'prompt', 'completion']
      data = [
        [int(step), float(x['reward']), str(x['prompt']), str(x['completion'])] for x in samples
      ]
      self._wandb.log({'step': int(step), 'samples': wandb.Table(columns=columns, data=data)})

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
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


def _md(text):
  """One table cell of Markdown: pipes escaped, line breaks kept."""
  return str(text).replace('|', '\\|').replace('\n', '<br>')


def _start_wandb(workdir, settings):
  """A W&B run for `workdir` (resumed when `workdir/wandb_id` exists)."""
  settings = dict(settings)
  try:
    import wandb
  except ImportError as e:
    raise ValueError(
      '`log.wandb_project` is set but wandb is not installed: pip install -e ".[wandb]".'
    ) from e
  mode = settings.get('mode', 'offline')
  if mode not in ('offline', 'online', 'disabled'):
    raise ValueError(f"`log.wandb_mode` must be 'offline', 'online' or 'disabled', got {mode!r}.")
  id_path = os.path.join(workdir, 'wandb_id')
  if os.path.exists(id_path):
    with open(id_path, encoding='utf-8') as f:
      run_id = f.read().strip()
  else:
    run_id = secrets.token_hex(4)  # W&B ids: lower-case letters and digits
    with open(id_path, 'w', encoding='utf-8') as f:
      f.write(run_id)
  run = wandb.init(
    project=settings['project'],
    entity=settings.get('entity') or None,
    name=settings.get('name') or os.path.basename(os.path.abspath(workdir)),
    config=settings.get('config'),
    dir=workdir,
    mode=mode,
    id=run_id,
    resume='allow',
  )
  run.define_metric('step')
  run.define_metric('*', step_metric='step')
  return run


class NullWriter:
  """The writer of processes other than 0: writes nothing."""

  path = None

  def write(self, step, metrics):
    del step, metrics

  def write_samples(self, step, samples):
    del step, samples

  def close(self):
    """Nothing to close: nothing was opened."""


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
