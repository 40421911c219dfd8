"""Preference rows from judged pairs: the pair rows `label_pairs` reads, the
{'prompt', 'chosen', 'rejected'} rows it makes, and writing them as JSON lines
for `jrl.data.sources.read_preference_jsonl`.
"""

import json
import os
import tempfile

from jrl.rewards.judge.prompts import format_prompt

PAIR_KEYS = ('prompt', 'completion_a', 'completion_b')


def check_pair_rows(rows):
  """ValueError naming the first of `rows` that is not a pair row.

  A pair row is a dict {'prompt': str | messages (non-empty), 'completion_a':
  str, 'completion_b': str, ...}.
  """
  if not isinstance(rows, list | tuple):
    raise ValueError(f'`rows` must be a list of dicts, got {type(rows).__name__}.')
  for i, row in enumerate(rows):
    if not isinstance(row, dict):
      raise ValueError(f'`rows[{i}]` must be a dict, got {type(row).__name__}.')
    for key in PAIR_KEYS:
      if key not in row:
        raise ValueError(f"`rows[{i}]` has no '{key}'.")
    if not row['prompt']:
      raise ValueError(f"`rows[{i}]['prompt']` is empty.")
    try:
      format_prompt(row['prompt'])
    except ValueError as e:
      raise ValueError(f"`rows[{i}]['prompt']`: {e}") from None
    for key in ('completion_a', 'completion_b'):
      if not isinstance(row[key], str):
        raise ValueError(f"`rows[{i}]['{key}']` must be a string.")


def judgeable_pairs(rows):
  """The indices of the pair rows that can make a preference row: both
  completions non-empty and different."""
  return [
    i
    for i, r in enumerate(rows)
    if r['completion_a'] and r['completion_b'] and r['completion_a'] != r['completion_b']
  ]


def preference_row(row, verdict):
  """{'prompt', 'chosen', 'rejected', ...} from a pair row and its verdict
  ('A' or 'B'); the row's other keys are carried over."""
  extra = {k: v for k, v in row.items() if k not in PAIR_KEYS}
  chosen, rejected = (
    (row['completion_a'], row['completion_b'])
    if verdict == 'A'
    else (row['completion_b'], row['completion_a'])
  )
  return {'prompt': row['prompt'], 'chosen': chosen, 'rejected': rejected, **extra}


def write_preference_jsonl(path, rows):
  """Writes {'prompt', 'chosen', 'rejected', ...} rows as JSON lines, atomically.

  The file reads back with `jrl.data.sources.read_preference_jsonl`; rows it
  would refuse raise ValueError naming the row here, before anything is
  written.

  Returns:
    the number of rows written.
  """
  if not isinstance(rows, list | tuple):
    raise ValueError(f'`rows` must be a list of dicts, got {type(rows).__name__}.')
  for i, row in enumerate(rows):
    if not isinstance(row, dict):
      raise ValueError(f'`rows[{i}]` must be a dict, got {type(row).__name__}.')
    prompt = row.get('prompt')
    if not prompt:
      raise ValueError(f"`rows[{i}]['prompt']` is missing or empty.")
    try:
      format_prompt(prompt)
    except ValueError as e:
      raise ValueError(f"`rows[{i}]['prompt']`: {e}") from None
    for key in ('chosen', 'rejected'):
      if not isinstance(row.get(key), str) or not row[key]:
        raise ValueError(f"`rows[{i}]['{key}']` must be a non-empty string.")
    if row['chosen'] == row['rejected']:
      raise ValueError(f"`rows[{i}]`: 'chosen' and 'rejected' are identical.")
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-', suffix='.jsonl')
  try:
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      for row in rows:
        f.write(json.dumps(row, ensure_ascii=False) + '\n')
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  return len(rows)
