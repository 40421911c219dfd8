"""Held-out accuracy of a run's latest (or given) checkpoint.

    python launch/eval.py --config configs/grpo_arith.py [--step 450]

Uses the run's config (same overrides as for training), restores the
checkpoint from `config.workdir`, decodes the held-out set greedily with the
paged sampler and prints the share scored correct by `config.eval.reward`.
"""

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jrl import config_errors

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config.', lock_config=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint iteration (default: the latest).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  from jrl import checkpoint, trainers
  from jrl.trainers import controller, setup

  config = _CONFIG.value
  job = trainers.build(config)
  ckpt = setup.checkpointer(config, job.res.workdir)
  try:
    step = _STEP.value if _STEP.value is not None else ckpt.latest_step()
    if step is None:
      raise SystemExit(f'no checkpoint in {ckpt.directory}')
    state, _ = ckpt.restore(step, checkpoint.abstract_like(job.state))
    result = {'checkpoint': step, **job.evaluate(state)}
  finally:
    controller.close(job)
    ckpt.close()
  print(json.dumps(result))


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main, flags_parser=config_errors.parse_flags)
