"""Writes a Hugging Face directory from any saved checkpoint of a run.

    python launch/export.py --config configs/grpo_arith.py --step 900 --out runs/export_900
    jrl export --config configs/grpo_qwen.py --config.model.path=models/qwen   # the latest step

Uses the run's config (same overrides as for training), restores checkpoint
`--step` (default: the latest intact one) from `config.workdir` and writes the
policy as config.json + model.safetensors (+ the tokenizer files when the run
has a tokenizer directory), as `export_hf` does at the end of a run.
"""

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jrl import config_errors

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config.', lock_config=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint iteration (default: the latest intact).')
_OUT = flags.DEFINE_string('out', None, 'Output directory (default: WORKDIR/hf_export_STEP).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  from jrl import checkpoint, trainers
  from jrl.trainers import controller, setup

  config = _CONFIG.value
  job = trainers.build(config)
  ckpt = setup.checkpointer(config, job.resources.workdir)
  try:
    abstract = checkpoint.abstract_like(job.state)
    if _STEP.value is None:
      step, state, _ = ckpt.restore_latest_intact(abstract)
      if step is None:
        raise SystemExit(f'no checkpoint in {ckpt.directory}')
    else:
      step = _STEP.value
      state, _ = ckpt.restore(step, abstract)
    out = _OUT.value or os.path.join(job.resources.workdir, f'hf_export_{step}')
    setup.export(job.resources, state.params, out)
  finally:
    controller.close(job)
    ckpt.close()
  print(json.dumps({'checkpoint': step, 'out': out}))


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main, flags_parser=config_errors.parse_flags)
