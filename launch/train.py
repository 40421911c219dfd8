"""Trains (or resumes) the job a config file describes.

    python launch/train.py --config configs/grpo_arith.py [--config.rl.steps=200 ...]

Parses flags and calls `jrl.trainers.run`; nothing else lives here.
Restarting the same command resumes from the latest checkpoint in
`config.workdir`; SIGTERM (preemption) saves a checkpoint and exits 0.
Compiled programs are kept in `config.workdir/xla_cache` (JAX's persistent
compilation cache), so a restarted run loads them instead of compiling
again (`--nocompilation_cache`: off).

On several hosts every host runs the same command. Processes join through
`jax.distributed`: automatically on Cloud TPU VMs and SLURM, or from
`--coordinator_address/--num_processes/--process_id` (or the
`JRL_COORDINATOR_ADDRESS`, `JRL_NUM_PROCESSES`, `JRL_PROCESS_ID` variables;
`launch/local.py` sets them for N processes on one machine).
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

# Config files import `configs.common`: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jrl import config_errors

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config.', lock_config=True)
_COORDINATOR = flags.DEFINE_string('coordinator_address', '', 'host:port of process 0.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 0, 'Number of processes (0: from env).')
_PROCESS_ID = flags.DEFINE_integer('process_id', -1, 'This process (-1: from env).')
_CACHE = flags.DEFINE_bool(
  'compilation_cache', True, 'Keep compiled programs in WORKDIR/xla_cache for restarts.'
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO
  from jrl import distributed

  distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  from jrl import sampler, trainers

  if _CACHE.value:
    sampler.enable_compilation_cache(
      os.path.join(os.path.abspath(_CONFIG.value.workdir), 'xla_cache')
    )

  trainers.run(_CONFIG.value)


if __name__ == '__main__':
  from jrl import hostmem

  hostmem.ensure_huge_pages()  # re-executes once with XLA's buffers on huge pages
  flags.mark_flags_as_required(['config'])
  app.run(main, flags_parser=config_errors.parse_flags)
