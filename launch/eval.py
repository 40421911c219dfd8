"""Held-out evaluation of a run's checkpoint or of any Hugging Face directory.

    python launch/eval.py --config configs/grpo_arith.py [--step 900]
    python launch/eval.py --config configs/grpo_smollm2_gsm.py --model_path models/smollm2 \\
        --samples 4 --temperature 0.7 --out /tmp/before.jsonl

Uses the run's config (same overrides as for training) for the task, the
prompt format, the lengths, the sampler and `eval.reward`. By default it
restores checkpoint `--step` (default: the latest) of `config.workdir`, its
parameters only; `--model_path DIR` evaluates a Hugging Face directory
instead (no run or checkpoint needed). Every held-out problem is decoded
greedily, and `--samples` n times at `--temperature` (default: `eval.samples`,
`eval.temperature`) for mean@n and pass@k. Prints one JSON line of metrics;
one row per problem goes to `--out` (overwritten), by default appended to
workdir/eval_samples.jsonl. See `jrl.trainers.evaluation.standalone`.

The reward model and the agent are evaluated by their trainers: for them
the checkpoint is restored into the whole job (`--samples`, `--temperature`
and `--step` apply, `--model_path` and `--out` do not).
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
_MODEL_PATH = flags.DEFINE_string(
  'model_path', None, 'Evaluate this Hugging Face directory instead of a checkpoint.'
)
_SAMPLES = flags.DEFINE_integer(
  'samples',
  None,
  'Samples per problem for mean@n / pass@k (default: eval.samples; 0: none).',
  lower_bound=0,
)
_TEMPERATURE = flags.DEFINE_float(
  'temperature', None, 'Sampling temperature (default: eval.temperature).', lower_bound=0.0
)
_OUT = flags.DEFINE_string(
  'out', None, 'Per-problem rows, JSONL, overwritten (default: WORKDIR/eval_samples.jsonl).'
)


def _trainer_evaluate(config):
  """The checkpoint restored into the whole job of `config` (reward model, agent)."""
  from jrl import checkpoint, trainers
  from jrl.trainers import controller, setup

  if _MODEL_PATH.value is not None or _OUT.value is not None:
    raise ValueError(
      f'--model_path and --out evaluate a policy on held-out prompts; `algorithm` '
      f'{config.algorithm!r} is evaluated by its trainer, from a checkpoint of config.workdir.'
    )
  job = trainers.build(config)
  ckpt = setup.checkpointer(config, job.resources.workdir)
  try:
    step = _STEP.value if _STEP.value is not None else ckpt.latest_step()
    if step is None:
      raise FileNotFoundError(f'no checkpoint in {ckpt.directory}.')
    state, _ = ckpt.restore(step, checkpoint.abstract_like(job.state))
    return {'checkpoint': step, **job.evaluate(state)}
  finally:
    controller.close(job)
    ckpt.close()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.WARNING)
  from jrl.trainers.evaluation import standalone as standalone_eval

  config = _CONFIG.value
  try:
    if standalone_eval.supports(config):
      result = standalone_eval.evaluate(
        config,
        model_path=_MODEL_PATH.value,
        step=_STEP.value,
        samples=_SAMPLES.value,
        temperature=_TEMPERATURE.value,
        out=_OUT.value,
      )
    else:
      config = standalone_eval.configured(
        config, samples=_SAMPLES.value, temperature=_TEMPERATURE.value
      )
      result = _trainer_evaluate(config)
  except (FileNotFoundError, ValueError) as e:  # a missing model or checkpoint, a bad field
    raise SystemExit(f'eval: {e}') from None
  print(json.dumps(result))


if __name__ == '__main__':
  from jrl import hostmem

  hostmem.ensure_huge_pages()  # re-executes once with XLA's buffers on huge pages
  flags.mark_flags_as_required(['config'])
  app.run(main, flags_parser=config_errors.parse_flags)
