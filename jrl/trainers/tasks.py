"""What a run trains and evaluates on: the task's examples (`Task`), the
prompt encoding (`Encoder`: raw text or the chat template), and preference
pairs with a known truth on the arithmetic task (`arith_pairs`).

Both are plain host-side objects, built once at set-up by
`jrl.trainers.setup.examples`; every example is checked there, so a bad row
fails with its file and line before anything is compiled.
"""

import numpy as np

from jrl import distributed
from jrl.data import ANSWER_EXTRACTORS, ArithmeticTask, PromptFile, read_prompts
from jrl.trainers import checks


class Task:
  """Training and held-out examples as {'prompt', 'answer'} dicts.

  `filtered` counts the rows of prompt files left out for prompts longer than
  `rl.max_prompt_len` (`task.long_prompts='filter'`): {'train': n, 'eval': n}.
  """

  CHECKED_EXAMPLES = 256  # generated training examples run through `check`
  LONG_PROMPTS = ('error', 'filter')

  def __init__(self, task_config, seed, check=None, train_check=None):
    """`check(example)` (e.g. `checks.ExampleChecker.prompt`) runs on every
    held-out example, `train_check` (default: `check`) on every training one:
    each row of a prompt file, the first `CHECKED_EXAMPLES` of a generated task.
    Their ValueError is raised with the file and line (or row), or the index;
    with `task.long_prompts='filter'`, a file's rows whose prompt is too long
    (`checks.PromptTooLong`) are dropped and counted instead."""
    kind = task_config.kind
    train_check = train_check or check
    self.filtered = {'train': 0, 'eval': 0}
    if kind == 'arith':
      self.generator = ArithmeticTask(
        digits=task_config.digits, ops=task_config.ops, seed=task_config.train_seed
      )
      self.train = self.generator
      self.held_out = self.generator.held_out(task_config.eval_size, task_config.eval_seed)
    elif kind == 'arith_tool':
      from jrl.envs.arith import ArithToolTask

      self.generator = ArithToolTask(seed=task_config.train_seed)
      self.train = self.generator
      self.held_out = self.generator.held_out(task_config.eval_size, task_config.eval_seed)
    elif kind in ('file', 'jsonl'):
      train = self._read(task_config, 'train', train_check)
      held_out = self._read(task_config, 'eval', check) if task_config.eval_path else None
      self.train = train.rows
      self.held_out = held_out.rows[: task_config.eval_size] if held_out else []
    else:
      raise ValueError(
        f"`task.kind` must be 'arith', 'arith_tool', 'file' or 'jsonl', got {kind!r}."
      )
    if check is not None and kind not in ('file', 'jsonl'):
      # Generated problems share one format: the first ones stand for the rest.
      train = ((i, self.train.example(i)) for i in range(self.CHECKED_EXAMPLES))
      checks.check_generated(f'task {kind!r} training', train, train_check)
      checks.check_generated(f'task {kind!r} held-out', enumerate(self.held_out), check)
    self.seed = seed

  def _read(self, task_config, split, check) -> PromptFile:
    """The `split` file ('train' | 'eval'), its too-long prompts dropped if asked."""
    long_prompts = task_config.long_prompts
    if long_prompts not in self.LONG_PROMPTS:
      raise ValueError(
        f'`task.long_prompts` must be one of {self.LONG_PROMPTS}, got {long_prompts!r}.'
      )
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
      drop=(checks.PromptTooLong,) if long_prompts == 'filter' else (),
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
    ids = self.tokenizer.encode(self.prompt_text(prompt))
    if self.add_bos and self.tokenizer.bos_id is not None:
      ids = [self.tokenizer.bos_id, *ids]
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
