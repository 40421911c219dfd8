"""Writes generated grade-school word problems in GSM8K's schema.

    python launch/make_word_problems.py --out data/word_problems --train 5000 --eval 500 --seed 0

writes OUT/train.jsonl and OUT/eval.jsonl (with --parquet also .parquet copies)
of rows {"question", "answer": "<worked solution>\\n#### N", "difficulty",
"template"}; train with `--config.task.kind=file --config.task.prompt_key=question
--config.task.answer_extractor=gsm8k`. The same flags always write the same
files; no problem is in both splits. Parses flags and calls
`jrl.data.word_problems.write_splits`; nothing else lives here.
"""

import os
import sys

from absl import app, flags

# Make the repository root importable when run as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_OUT = flags.DEFINE_string('out', None, 'Output directory.')
_TRAIN = flags.DEFINE_integer('train', 5000, 'Training problems.', lower_bound=0)
_EVAL = flags.DEFINE_integer('eval', 500, 'Held-out problems.', lower_bound=0)
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of both splits.', lower_bound=0)
_MIX = flags.DEFINE_list('mix', ['1', '1', '1'], 'Relative weights of difficulties 1, 2, 3.')
_PARQUET = flags.DEFINE_bool('parquet', False, 'Also write train.parquet and eval.parquet.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  from jrl.data import word_problems

  try:
    weights = tuple(float(w) for w in _MIX.value)
  except ValueError:
    raise app.UsageError(f'--mix must be 3 numbers, got {_MIX.value}.') from None
  summary = word_problems.write_splits(
    _OUT.value, _TRAIN.value, _EVAL.value, _SEED.value, weights, parquet=_PARQUET.value
  )
  for name, counts in summary.items():
    per = ', '.join(f'{n} with {k} step{"s" if k > 1 else ""}' for k, n in counts.items())
    print(f'{os.path.join(_OUT.value, name)}: {sum(counts.values())} rows ({per})')


if __name__ == '__main__':
  flags.mark_flags_as_required(['out'])
  app.run(main)
