"""Prompt files and the grain stream the controller reads from.

`PromptStream` wraps a grain `MapDataset` (shuffled with a seed, repeated
forever) and hands out examples in order; its whole state is one integer,
the number of examples consumed, which goes into every checkpoint so that a
resumed run sees exactly the prompts it would have seen.

Prompt files are JSONL or Parquet (read with pyarrow), one example a row, in
any schema whose prompt and answer live in named fields: GSM8K's
`{"question": ..., "answer": "... #### 42"}` reads with
`read_prompts(path, prompt_key='question', answer_extractor='gsm8k')`.

Readers check every row and raise `ValueError` naming the file and the line
(Parquet: the 0-based row index) of the first bad one: invalid UTF-8 or
JSON, a missing or mistyped field, an answer without '####' for the gsm8k
extractor, or whatever the caller's `check` refuses (e.g. a character the
tokenizer cannot encode). Nothing is silently dropped: `read_prompts` drops
only rows whose `check` raises one of the exception types in `drop` (e.g.
prompts over the length limit) and returns where and why, so that the caller
can report the count.
"""

import json
import os
from typing import NamedTuple

import grain
import numpy as np


class PromptStream:
  """An endless, deterministic, checkpointable stream of examples.

  A generated source may also see how its examples scored, e.g. to move a
  curriculum (`jrl.data.reasoning_gym`): `observe(examples, per_fn, total)
  -> metrics`, with `state()` / `restore(state)` for what that changes
  (saved beside the position in checkpoints).
  """

  def __init__(self, source, *, seed, shuffle=True):
    """
    Args:
      source: a sequence of examples (dicts) or an object with `example(i)`
        (a generated task: then the stream is `example(0), example(1), ...`).
      seed: shuffle seed.
      shuffle: shuffle a finite source (reshuffled every epoch).
    """
    self._source = source if hasattr(source, 'example') else None
    if self._source is not None:
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

  @property
  def observes(self):
    """Whether the source wants to see its examples' scores (`observe`)."""
    return hasattr(self._source, 'observe')

  def observe(self, draws, group_size):
    """The source's metrics after it has seen the scores of `draws`: a list of
    (stream position of a draw's first example, {reward function: [n·G]
    scores, NaN unscored}, [n·G] trained reward, NaN where left out), every
    process's examples of each draw. {} for a source that does not observe."""
    if not self.observes or not draws:
      return {}
    examples, per_fn, total = [], {}, []
    for start, fn_scores, trained in draws:
      n = len(trained) // group_size
      examples += [self._get(start + i) for i in range(n)]
      for name, values in fn_scores.items():
        per_fn.setdefault(name, []).append(np.asarray(values).reshape(n, group_size))
      total.append(np.asarray(trained).reshape(n, group_size))
    per_fn = {name: np.concatenate(parts) for name, parts in per_fn.items()}
    return self._source.observe(examples, per_fn, np.concatenate(total))

  def state(self):
    state = {'position': self.position}
    if hasattr(self._source, 'state'):
      state['source'] = self._source.state()
    return state

  def restore(self, state):
    self.position = int(state['position'])
    if 'source' in state and hasattr(self._source, 'restore'):
      self._source.restore(state['source'])


# Rows of a file: (where, row) pairs, `where` naming the file and line or row. --------


def _jsonl_rows(path):
  """(where, row) for each non-blank line of a JSONL file; `where` is 'path:line'."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: file not found.')
  rows = []
  # Bytes, decoded line by line, so that invalid UTF-8 is reported with its line.
  with open(path, 'rb') as f:
    for lineno, raw in enumerate(f, 1):
      where = f'{path}:{lineno}'
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError as e:
        raise ValueError(
          f'{where}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}: {e.reason}).'
        ) from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{where}: invalid JSON ({e.msg}).') from None
      if not isinstance(row, dict):
        raise ValueError(f'{where}: expected a JSON object, got {type(row).__name__}.')
      rows.append((where, row))
  if not rows:
    raise ValueError(f'{path}: no rows.')
  return rows


def _parquet_rows(path, batch_size=1024):
  """(where, row) for each row of a Parquet file; `where` is 'path: row i' (0-based)."""
  # Imported here: only Parquet readers pay for loading Arrow.
  import pyarrow as pa
  import pyarrow.parquet as pq

  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: file not found.')
  try:
    parquet = pq.ParquetFile(path)
  except (pa.ArrowException, OSError) as e:
    raise ValueError(f'{path}: cannot read as Parquet ({e}).') from None
  rows, start = [], 0
  for batch in parquet.iter_batches(batch_size=batch_size):
    try:
      records = batch.to_pylist()
    except UnicodeDecodeError:
      # Arrow does not validate string columns when reading: find the cell.
      _raise_invalid_utf8(path, batch, start)
    rows.extend((f'{path}: row {start + i}', row) for i, row in enumerate(records))
    start += batch.num_rows
  if not rows:
    raise ValueError(f'{path}: no rows.')
  return rows


def _raise_invalid_utf8(path, batch, start):
  for name, column in zip(batch.schema.names, batch.columns, strict=True):
    for i in range(len(column)):
      try:
        column[i].as_py()
      except UnicodeDecodeError as e:
        raise ValueError(
          f'{path}: row {start + i}: column `{name}`: invalid UTF-8 (byte '
          f'0x{e.object[e.start]:02x} at offset {e.start}: {e.reason}).'
        ) from None
  raise AssertionError('unreachable: the batch converted cell by cell')


def is_parquet(path):
  return path.lower().endswith('.parquet')


def _file_rows(path):
  """Rows of a JSONL or (by its extension) Parquet file."""
  return _parquet_rows(path) if is_parquet(path) else _jsonl_rows(path)


# Fields -------------------------------------------------------------------------


def _text_field(where, row, name, required=True):
  if row.get(name) is None:  # Parquet writes a missing field as null
    if required:
      raise ValueError(f'{where}: missing field `{name}`.')
    return None
  value = row[name]
  if isinstance(value, list):  # chat messages
    for m in value:
      if not (isinstance(m, dict) and isinstance(m.get('role'), str) and 'content' in m):
        raise ValueError(
          f'{where}: field `{name}` must be a string or a list of {{"role", "content"}} messages.'
        )
    return value
  if not isinstance(value, str):
    raise ValueError(
      f'{where}: field `{name}` must be a string or a list of {{"role", "content"}} messages, '
      f'got {type(value).__name__}.'
    )
  if not value:
    raise ValueError(f'{where}: field `{name}` must be a non-empty string.')
  return value


def _checked(where, item, check):
  """`item`, after `check(item)` (None: no check) passed; its ValueError gets `where`."""
  if check is not None:
    try:
      check(item)
    except ValueError as e:
      raise ValueError(f'{where}: {e}') from None
  return item


ANSWER_EXTRACTORS = ('none', 'gsm8k')


def extract_gsm8k_answer(text):
  """The final answer of a GSM8K solution: the text after its last '####',
  stripped, with thousands separators removed ('... #### 1,234' -> '1234')."""
  _, sep, tail = text.rpartition('####')
  if not sep:
    raise ValueError("has no '####' before the final answer.")
  value = tail.strip().replace(',', '')
  if not value:
    raise ValueError("has nothing after its last '####'.")
  return value


def _answer(where, row, key, extractor, required):
  answer = row.get(key)
  if answer is None:
    if required:
      raise ValueError(f'{where}: missing field `{key}`.')
    return None
  if isinstance(answer, bool) or not isinstance(answer, str | int | float):
    raise ValueError(f'{where}: field `{key}` must be a string or number.')
  if extractor == 'none':
    return str(answer)
  if not isinstance(answer, str):
    raise ValueError(f"{where}: field `{key}` must be a string ending in '#### <answer>'.")
  try:
    return extract_gsm8k_answer(answer)
  except ValueError as e:
    raise ValueError(f'{where}: field `{key}` {e}') from None


class PromptFile(NamedTuple):
  """The examples of a prompt file and the rows left out of them."""

  rows: list  # {'prompt', 'answer', ...the row's other fields}
  dropped: list  # (where, why) of each row dropped by `drop`, in file order


def read_prompts(
  path,
  *,
  prompt_key='prompt',
  answer_key='answer',
  answer_extractor='none',
  require_answer=True,
  check=None,
  drop=(),
):
  """Prompt rows of a JSONL or Parquet file (chosen by the '.parquet' extension).

  Args:
    path: the file.
    prompt_key: the row's prompt field (a string or chat messages); GSM8K:
      'question'.
    answer_key: the row's answer field (a string or number).
    answer_extractor: 'none' (the answer as it is) or 'gsm8k' (the text after
      the last '####'; the whole field is kept as 'solution').
    require_answer: refuse rows without an answer.
    check: called on every example read (the dict returned for it); a
      ValueError it raises is re-raised with the file and line (or row).
    drop: exception types: a row whose `check` raises one of them is left
      out and listed in `PromptFile.dropped` instead of failing the read.

  Returns:
    `PromptFile`: rows as {'prompt', 'answer', ...the row's other fields}.
  """
  if answer_extractor not in ANSWER_EXTRACTORS:
    raise ValueError(
      f'answer_extractor must be one of {ANSWER_EXTRACTORS}, got {answer_extractor!r}.'
    )
  return _prompt_items(
    path, _file_rows(path), prompt_key, answer_key, answer_extractor, require_answer, check, drop
  )


def prompt_rows(source, rows, *, check=None, drop=()):
  """Prompt rows made in Python (a data source named in config), checked as a
  file's rows are.

  Args:
    source: names the rows in errors ("`task.kind` 'my_data:rows' train").
    rows: a list (or tuple) of {'prompt': str | messages, 'answer': str |
      number, ...other fields} dicts; answers become strings.
    check, drop: as in `read_prompts`.

  Returns:
    `PromptFile`; a ValueError names `source` and the 0-based row.
  """
  if not isinstance(rows, list | tuple):
    raise ValueError(f'{source}: rows must be a list of dicts, got {type(rows).__name__}.')
  if not rows:
    raise ValueError(f'{source}: no rows.')
  numbered = []
  for i, row in enumerate(rows):
    where = f'{source} row {i}'
    if not isinstance(row, dict):
      raise ValueError(
        f'{where}: must be a dict with `prompt` and `answer`, got {type(row).__name__}.'
      )
    numbered.append((where, row))
  return _prompt_items(source, numbered, 'prompt', 'answer', 'none', True, check, drop)


def _prompt_items(
  source, numbered, prompt_key, answer_key, answer_extractor, require_answer, check, drop
):
  """`PromptFile` of (where, raw row) pairs: fields renamed and typed, `check` run."""
  out, dropped = [], []
  renamed = {prompt_key, answer_key, 'prompt', 'answer'}
  for where, row in numbered:
    prompt = _text_field(where, row, prompt_key)
    answer = _answer(where, row, answer_key, answer_extractor, require_answer)
    item = {'prompt': prompt, 'answer': answer}
    item.update((k, v) for k, v in row.items() if k not in renamed)
    if answer_extractor != 'none' and answer is not None:
      item.setdefault('solution', row[answer_key])
    if check is not None:
      try:
        check(item)
      except drop as e:
        dropped.append((where, str(e)))
        continue
      except ValueError as e:
        raise ValueError(f'{where}: {e}') from None
    out.append(item)
  if not out:
    first = f'{dropped[0][0]}: {dropped[0][1]}' if dropped else ''
    raise ValueError(f'{source}: all {len(dropped)} rows were dropped (the first: {first}).')
  return PromptFile(out, dropped)


def read_jsonl(path, *, answer_field='answer', require_answer=True, check=None):
  """Prompt rows of a JSONL file: {"prompt": str | messages, "answer": str, ...extra metadata}.

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
  for where, row in _jsonl_rows(path):
    prompt = _text_field(where, row, 'prompt')
    answer = _answer(where, row, answer_field, 'none', require_answer)
    extra = {k: v for k, v in row.items() if k not in ('prompt', answer_field)}
    item = {'prompt': prompt, 'answer': answer, **extra}
    out.append(_checked(where, item, check))
  return out


def read_sft_jsonl(path, *, check=None):
  """SFT rows: {"prompt": str | messages, "response": str} (`check` as in `read_jsonl`)."""
  out = []
  for where, row in _jsonl_rows(path):
    item = {
      'prompt': _text_field(where, row, 'prompt'),
      'response': _text_field(where, row, 'response'),
    }
    out.append(_checked(where, item, check))
  return out


def read_preference_jsonl(path, *, check=None):
  """Preference rows: {"prompt": str | messages, "chosen": str, "rejected": str}
  (`check` as in `read_jsonl`)."""
  out = []
  for where, row in _jsonl_rows(path):
    item = {
      'prompt': _text_field(where, row, 'prompt'),
      'chosen': _text_field(where, row, 'chosen'),
      'rejected': _text_field(where, row, 'rejected'),
    }
    if item['chosen'] == item['rejected']:
      raise ValueError(f'{where}: `chosen` and `rejected` are identical.')
    out.append(_checked(where, item, check))
  return out


def read_unlabelled_pairs_jsonl(path):
  """Pairs to be judged: {"prompt": str | messages, "completion_a": str, "completion_b": str}."""
  out = []
  for where, row in _jsonl_rows(path):
    item = {'prompt': _text_field(where, row, 'prompt')}
    for key in ('completion_a', 'completion_b'):
      if not isinstance(row.get(key), str):
        raise ValueError(f'{where}: field `{key}` must be a string.')
      item[key] = row[key]
    out.append(item)
  return out


# Writing ------------------------------------------------------------------------


def write_jsonl(path, rows):
  """Writes dicts one per line (UTF-8, non-ASCII kept as is); returns `path`."""
  with open(path, 'w', encoding='utf-8') as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + '\n')
  return path


def write_parquet(path, rows):
  """Writes dicts (one schema) as a Parquet table with pyarrow; returns `path`."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.Table.from_pylist(list(rows)), path)
  return path
