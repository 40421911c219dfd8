"""What a run trains and evaluates on: the task's examples (`Task`), the
prompt encoding (`Encoder`: raw text or the chat template), and preference
pairs with a known truth on the arithmetic task (`arith_pairs`).

Both are plain host-side objects, built once at set-up by
`jrl.trainers.setup.examples`; every example is checked there
(`ExampleChecker`), so a bad row fails with its file and line before
anything is compiled.
"""

import numpy as np

from jrl import distributed, plugins
from jrl.data.arith import ArithmeticTask
from jrl.data.sources import ANSWER_EXTRACTORS, PromptFile, prompt_rows, read_prompts

# Examples ------------------------------------------------------------------------


class PromptTooLong(ValueError):
  """A prompt longer than `task.max_prompt_len` (`task.long_prompts='filter'` drops these)."""


class ExampleChecker:
  """Encodes examples as the trainer will, and refuses those it could not train on.

  Each method takes one example (a dict as `jrl.data` returns it) and raises
  ValueError saying which field is wrong; the JSONL readers prefix the file
  and line (`jrl.data.sources`, `check=`), `check_generated` the example's
  index.
  """

  def __init__(self, prompt_ids, encode, max_prompt_len, seq_len):
    """
    Args:
      prompt_ids: prompt (text or chat messages) -> token ids, as the trainer
        builds them (chat template, bos).
      encode: text -> token ids (responses, answers).
      max_prompt_len: `task.max_prompt_len`.
      seq_len: tokens of a packed training row (`task.max_prompt_len +
        task.max_response_len`); a response is followed by one eos token.
    """
    self.prompt_ids = prompt_ids
    self.encode = encode
    self.max_prompt_len = max_prompt_len
    self.seq_len = seq_len

  @classmethod
  def of(cls, task_config, encoder, tokenizer):
    """The checker of a run's `task` section, its `Encoder` and tokenizer."""
    seq_len = task_config.max_prompt_len + task_config.max_response_len
    return cls(encoder.prompt_ids, tokenizer.encode, task_config.max_prompt_len, seq_len)

  def _ids(self, example, key, fn):
    try:
      return fn(example[key])
    except ValueError as e:  # e.g. a character outside the tokenizer's vocabulary
      raise ValueError(f'field `{key}`: {e}') from None

  def prompt(self, example):
    """The prompt encodes and fits in `task.max_prompt_len`; returns its length."""
    n = len(self._ids(example, 'prompt', self.prompt_ids))
    if n > self.max_prompt_len:
      raise PromptTooLong(
        f'field `prompt` is {n} tokens, more than `task.max_prompt_len`={self.max_prompt_len}.'
      )
    return n

  def _completion(self, example, key, prompt_len, eos=True):
    m = len(self._ids(example, key, lambda text: self.encode(str(text))))
    if prompt_len + m + int(eos) > self.seq_len:
      raise ValueError(
        f'prompt ({prompt_len} tokens) + `{key}` ({m} tokens){" + eos" if eos else ""} exceed '
        f'`task.max_prompt_len` + `task.max_response_len` = {self.seq_len} tokens.'
      )

  def sft(self, example):
    """An SFT row: prompt, and prompt + response (or answer) + eos fit a row."""
    n = self.prompt(example)
    self._completion(example, 'response' if 'response' in example else 'answer', n)

  def pair(self, example, eos=True):
    """A preference pair: prompt, and prompt + chosen / rejected (+ eos) fit a row."""
    n = self.prompt(example)
    for key in ('chosen', 'rejected'):
      self._completion(example, key, n, eos)


def check_generated(name, examples, check):
  """Runs `check` on (index, example) pairs of a generated task, naming the index."""
  for i, example in examples:
    try:
      check(example)
    except ValueError as e:
      raise ValueError(f'{name} example {i}: {e}') from None


def function_rows(task_config, check, train_check):
  """(train, held-out) `PromptFile`s of the data source that `task.kind` names
  by import path: a function `fn(task_config)` returning (train rows,
  held-out rows), each a list of {'prompt', 'answer', ...} dicts. Every row
  is checked as a prompt file's are (`check`, `train_check`, and
  `task.long_prompts`); errors name `task.kind`, the split and the row."""
  name = f'`task.kind` {task_config.kind!r}'
  fn = plugins.load_object(task_config.kind, '`task.kind`')
  if not callable(fn):
    raise ValueError(f'{name}: a {type(fn).__name__} is not a function.')
  out = fn(task_config)
  if not (isinstance(out, list | tuple) and len(out) == 2):
    got = f'{len(out)} values' if isinstance(out, list | tuple) else f'a {type(out).__name__}'
    raise ValueError(f'{name} must return (train rows, held-out rows), got {got}.')
  long_prompts = task_config.long_prompts
  if long_prompts not in Task.LONG_PROMPTS:
    raise ValueError(
      f'`task.long_prompts` must be one of {Task.LONG_PROMPTS}, got {long_prompts!r}.'
    )
  drop = (PromptTooLong,) if long_prompts == 'filter' else ()
  read = {}
  for split, rows, check_row in (('train', out[0], train_check), ('held-out', out[1], check)):
    if split == 'held-out' and isinstance(rows, list | tuple) and not rows:
      read[split] = PromptFile([], [])  # no held-out evaluation
      continue
    read[split] = prompt_rows(f'{name} {split}', rows, check=check_row, drop=drop)
    dropped = read[split].dropped
    if dropped and distributed.is_main():
      print(
        f'task: dropped {len(dropped)} of {len(read[split].rows) + len(dropped)} {split} rows '
        f'of {name} (task.long_prompts=filter); the first, {dropped[0][0]}: {dropped[0][1]}'
      )
  return read['train'], read['held-out']


class Task:
  """Training and held-out examples as {'prompt', 'answer'} dicts.

  `filtered` counts the rows of prompt files left out for prompts longer than
  `task.max_prompt_len` (`task.long_prompts='filter'`): {'train': n, 'eval': n}.
  """

  CHECKED_EXAMPLES = 256  # generated training examples run through `check`
  LONG_PROMPTS = ('error', 'filter')

  def __init__(self, task_config, seed, check=None, train_check=None):
    """`check(example)` (e.g. `ExampleChecker.prompt`) runs on every
    held-out example, `train_check` (default: `check`) on every training one:
    each row of a prompt file, the first `CHECKED_EXAMPLES` of a generated task.
    Their ValueError is raised with the file and line (or row), or the index;
    with `task.long_prompts='filter'`, a file's rows whose prompt is too long
    (`PromptTooLong`) are dropped and counted instead."""
    kind = task_config.kind
    train_check = train_check or check
    self.filtered = {'train': 0, 'eval': 0}
    if kind == 'arith':
      self.generator = ArithmeticTask(
        digits=task_config.digits,
        ops=task_config.ops,
        seed=task_config.train_seed,
        carry_slip=task_config.carry_slip,
        rounding_slip=task_config.rounding_slip,
        reverse_answers=task_config.reverse_answers,
      )
      self.train = self.generator
      self.held_out = self.generator.held_out(task_config.eval_size, task_config.eval_seed)
    elif kind == 'arith_tool':
      from jrl.envs.arith import ArithToolTask

      self.generator = ArithToolTask(seed=task_config.train_seed)
      self.train = self.generator
      self.held_out = self.generator.held_out(task_config.eval_size, task_config.eval_seed)
    elif kind == 'reasoning_gym':
      from jrl.data.reasoning_gym import ReasoningGymTask

      self.generator = ReasoningGymTask(
        task_config, check, train_check, self._long_prompt_drops(task_config)
      )
      self.train = self.generator
      self.held_out = self.generator.held_out
      self.filtered['eval'] = self.generator.filtered_held_out
    elif kind in ('file', 'jsonl'):
      train = self._read(task_config, 'train', train_check)
      held_out = self._read(task_config, 'eval', check) if task_config.eval_path else None
      self.train = train.rows
      self.held_out = held_out.rows[: task_config.eval_size] if held_out else []
    elif plugins.is_import_path(kind):
      train, held_out = function_rows(task_config, check, train_check)
      self.filtered = {'train': len(train.dropped), 'eval': len(held_out.dropped)}
      self.train = train.rows
      self.held_out = held_out.rows[: task_config.eval_size]
    else:
      raise ValueError(
        "`task.kind` must be 'arith', 'arith_tool', 'reasoning_gym', 'file', 'jsonl' or an "
        f'import path ("package.module:function"), got {kind!r}.'
      )
    if check is not None and kind in ('arith', 'arith_tool'):
      # Generated problems share one format: the first ones stand for the rest.
      train = ((i, self.train.example(i)) for i in range(self.CHECKED_EXAMPLES))
      check_generated(f'task {kind!r} training', train, train_check)
      check_generated(f'task {kind!r} held-out', enumerate(self.held_out), check)
    self.seed = seed

  def _long_prompt_drops(self, task_config):
    """The errors of a row left out under `task.long_prompts` (checked)."""
    long_prompts = task_config.long_prompts
    if long_prompts not in self.LONG_PROMPTS:
      raise ValueError(
        f'`task.long_prompts` must be one of {self.LONG_PROMPTS}, got {long_prompts!r}.'
      )
    return (PromptTooLong,) if long_prompts == 'filter' else ()

  def _read(self, task_config, split, check) -> PromptFile:
    """The `split` file ('train' | 'eval'), its too-long prompts dropped if asked."""
    drop = self._long_prompt_drops(task_config)
    extractor = task_config.answer_extractor
    if extractor not in ANSWER_EXTRACTORS:
      raise ValueError(
        f'`task.answer_extractor` must be one of {ANSWER_EXTRACTORS}, got {extractor!r}.'
      )
    path = task_config[f'{split}_path']
    read = read_prompts(
      path,
      prompt_key=task_config.prompt_key,
      answer_key=task_config.answer_key,
      answer_extractor=extractor,
      check=check,
      drop=drop,
    )
    self.filtered[split] = len(read.dropped)
    if read.dropped and distributed.is_main():
      where, why = read.dropped[0]
      print(
        f'task: dropped {len(read.dropped)} of {len(read.rows) + len(read.dropped)} {split} '
        f'rows of {path} (task.long_prompts=filter); the first, {where}: {why}'
      )
    return read


class Encoder:
  """Turns example prompts into token ids (raw text or the chat template).

  With the chat template, `system_prompt` (if set) opens every conversation
  that has no system message of its own, and `template_kwargs` (e.g.
  {'enable_thinking': False}) are passed to the template's render.
  """

  def __init__(self, tokenizer, use_chat_template, add_bos, system_prompt='', template_kwargs=None):
    if system_prompt and not use_chat_template:
      raise ValueError('`task.system_prompt` needs `task.chat_template` = True.')
    self.tokenizer = tokenizer
    self.use_chat_template = use_chat_template
    self.add_bos = add_bos
    self.system_prompt = system_prompt
    self.template_kwargs = dict(template_kwargs or {})

  def prompt_text(self, prompt):
    if not (isinstance(prompt, list) or self.use_chat_template):
      return prompt
    messages = prompt if isinstance(prompt, list) else [{'role': 'user', 'content': prompt}]
    if self.system_prompt and not (messages and messages[0]['role'] == 'system'):
      messages = [{'role': 'system', 'content': self.system_prompt}, *messages]
    return self.tokenizer.apply_chat_template(
      messages, add_generation_prompt=True, **self.template_kwargs
    )

  def prompt_ids(self, prompt):
    """Token ids of the prompt; with `add_bos` one BOS first, unless the chat
    template already wrote it (Gemma's does), so no family gets two."""
    ids = self.tokenizer.encode(self.prompt_text(prompt))
    bos = self.tokenizer.bos_id
    if self.add_bos and bos is not None and ids[:1] != [bos]:
      ids = [bos, *ids]
    return ids


# Preference pairs with a known truth ---------------------------------------------


def corrupt_answer(answer, rng):
  """A plausible wrong answer: the right one off by a small nonzero amount."""
  value = int(answer)
  delta = int(rng.choice([-1, 1])) * int(rng.integers(1, 11))
  wrong = value + delta
  return str(wrong if wrong >= 0 else value + abs(delta))


def arith_pairs(examples, seed):
  """Correct answer chosen over a near miss, for each {'prompt', 'answer'}
  example (DPO and reward-model training on the arithmetic task)."""
  rng = np.random.default_rng(seed)
  return [
    {'prompt': ex['prompt'], 'chosen': ex['answer'], 'rejected': corrupt_answer(ex['answer'], rng)}
    for ex in examples
  ]
