"""Trains (or resumes) the job a config file describes.

    python launch/train.py --config configs/grpo_arith.py [--config.rl.steps=200 ...]

Parses flags and calls `jrl.trainers.loop.run`; nothing else lives here.
Restarting the same command resumes from the latest checkpoint in
`config.workdir`.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

# Config files import `configs.common`: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config.', lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
  from jrl.trainers import loop

  loop.run(_CONFIG.value)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
