"""Prompt files and the grain stream the controller reads from.

`PromptStream` wraps a grain `MapDataset` (shuffled with a seed, repeated
forever) and hands out examples in order; its whole state is one integer,
the number of examples consumed, which goes into every checkpoint so that a
resumed run sees exactly the prompts it would have seen.

JSONL readers check every row and raise `ValueError` naming the file and the
line of the first bad one (invalid UTF-8 or JSON, a missing or mistyped
field, or whatever the caller's `check` refuses, e.g. a character the
tokenizer cannot encode); nothing is silently dropped.
"""

import json
import os

import grain


class PromptStream:
  """An endless, deterministic, checkpointable stream of examples."""

  def __init__(self, source, *, seed, shuffle=True):
    """
    Args:
      source: a sequence of examples (dicts) or an object with `example(i)`
        (a generated task: then the stream is `example(0), example(1), ...`).
      seed: shuffle seed.
      shuffle: shuffle a finite source (reshuffled every epoch).
    """
    if hasattr(source, 'example'):
      self._get = source.example
    else:
      if len(source) == 0:
        raise ValueError('the prompt source is empty.')
      ds = grain.MapDataset.source(list(source))
      if shuffle:
        ds = ds.shuffle(seed=seed)
      ds = ds.repeat()
      self._get = ds.__getitem__
    self.position = 0

  def next(self, n, rows=None):
    """The next `n` examples, or only rows [lo, hi) of them.

    Args:
      n: the global batch size (the stream advances by `n` either way).
      rows: (lo, hi): this process's rows of the batch (data loading
        sharded by process); None reads all `n`.
    """
    lo, hi = (0, n) if rows is None else rows
    if not 0 <= lo <= hi <= n:
      raise ValueError(f'`rows` {rows} must lie within [0, {n}].')
    out = [self._get(self.position + i) for i in range(lo, hi)]
    self.position += n
    return out

  def state(self):
    return {'position': self.position}

  def restore(self, state):
    self.position = int(state['position'])


def _read_rows(path):
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: file not found.')
  rows = []
  # Bytes, decoded line by line, so that invalid UTF-8 is reported with its line.
  with open(path, 'rb') as f:
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError as e:
        raise ValueError(
          f'{path}:{lineno}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}: '
          f'{e.reason}).'
        ) from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}:{lineno}: invalid JSON ({e.msg}).') from None
      if not isinstance(row, dict):
        raise ValueError(f'{path}:{lineno}: expected a JSON object, got {type(row).__name__}.')
      rows.append((lineno, row))
  if not rows:
    raise ValueError(f'{path}: no rows.')
  return rows


def _text_field(path, lineno, row, name, required=True):
  if name not in row:
    if required:
      raise ValueError(f'{path}:{lineno}: missing field `{name}`.')
    return None
  value = row[name]
  if isinstance(value, list):  # chat messages
    for m in value:
      if not (isinstance(m, dict) and isinstance(m.get('role'), str) and 'content' in m):
        raise ValueError(
          f'{path}:{lineno}: field `{name}` must be a string or a list of '
          '{"role", "content"} messages.'
        )
    return value
  if not isinstance(value, str) or not value:
    raise ValueError(f'{path}:{lineno}: field `{name}` must be a non-empty string.')
  return value


def _checked(path, lineno, item, check):
  """`item`, after `check(item)` (None: no check) passed; its ValueError gets the line."""
  if check is not None:
    try:
      check(item)
    except ValueError as e:
      raise ValueError(f'{path}:{lineno}: {e}') from None
  return item


def read_jsonl(path, *, answer_field='answer', require_answer=True, check=None):
  """Prompt rows: {"prompt": str | messages, "answer": str, ...extra metadata}.

  Args:
    path: the JSONL file.
    answer_field: the row's answer field.
    require_answer: refuse rows without one.
    check: called on every row read (the dict returned for it); a ValueError
      it raises is re-raised with the file and line.

  Returns:
    list of dicts with 'prompt', 'answer' and the row's other fields.
  """
  out = []
  for lineno, row in _read_rows(path):
    prompt = _text_field(path, lineno, row, 'prompt')
    answer = row.get(answer_field)
    if answer is None and require_answer:
      raise ValueError(f'{path}:{lineno}: missing field `{answer_field}`.')
    if answer is not None and not isinstance(answer, str | int | float):
      raise ValueError(f'{path}:{lineno}: field `{answer_field}` must be a string or number.')
    extra = {k: v for k, v in row.items() if k not in ('prompt', answer_field)}
    item = {'prompt': prompt, 'answer': None if answer is None else str(answer), **extra}
    out.append(_checked(path, lineno, item, check))
  return out


def read_sft_jsonl(path, *, check=None):
  """SFT rows: {"prompt": str | messages, "response": str} (`check` as in `read_jsonl`)."""
  out = []
  for lineno, row in _read_rows(path):
    item = {
      'prompt': _text_field(path, lineno, row, 'prompt'),
      'response': _text_field(path, lineno, row, 'response'),
    }
    out.append(_checked(path, lineno, item, check))
  return out


def read_preference_jsonl(path, *, check=None):
  """Preference rows: {"prompt": str | messages, "chosen": str, "rejected": str}
  (`check` as in `read_jsonl`)."""
  out = []
  for lineno, row in _read_rows(path):
    item = {
      'prompt': _text_field(path, lineno, row, 'prompt'),
      'chosen': _text_field(path, lineno, row, 'chosen'),
      'rejected': _text_field(path, lineno, row, 'rejected'),
    }
    if item['chosen'] == item['rejected']:
      raise ValueError(f'{path}:{lineno}: `chosen` and `rejected` are identical.')
    out.append(_checked(path, lineno, item, check))
  return out


def read_unlabelled_pairs_jsonl(path):
  """Pairs to be judged: {"prompt": str | messages, "completion_a": str, "completion_b": str}."""
  out = []
  for lineno, row in _read_rows(path):
    item = {'prompt': _text_field(path, lineno, row, 'prompt')}
    for key in ('completion_a', 'completion_b'):
      if not isinstance(row.get(key), str):
        raise ValueError(f'{path}:{lineno}: field `{key}` must be a string.')
      item[key] = row[key]
    out.append(item)
  return out
