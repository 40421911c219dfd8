"""Format and length rewards.

* `format_think_answer`: 1.0 when the completion is `<think>...</think>`
  followed by `<answer>...</answer>` (whitespace around allowed), else 0.0 —
  the R1-style format check.
* `boxed_format`: 1.0 when the completion contains a `\\boxed{...}`.
* `make_regex_reward(name, pattern)`: registers a reward that is 1.0 when
  the completion matches `pattern` (re.fullmatch, DOTALL).
* `overlong_penalty(lengths, max_new_tokens, buffer, penalty)`: DAPO's soft
  overlong punishment, counted in tokens: 0 up to `max_new_tokens − buffer`
  tokens, then a linear ramp to `−penalty` at `max_new_tokens`. The trainer
  adds it to the reward (`rl.overlong_buffer`, `rl.overlong_penalty`).
"""

import re

import numpy as np

from jrl.rewards.base import register

_JOIN = re.compile(r'</think>\s*<answer>')
_EDGE_SPACE = re.compile(r'\s*')


def _think_answer(text):
  """Whether `text` is `\\s* <think> ... </think> \\s* <answer> ... </answer> \\s*`.

  The same language as that regular expression with lazy `.*?` groups, decided
  in linear time: the regex itself backtracks quadratically on a completion
  holding many `</think>` and no `</answer>` (a policy finds such inputs).
  """
  start = _EDGE_SPACE.match(text).end()
  end = len(text)
  while end > start and _EDGE_SPACE.fullmatch(text[end - 1]):
    end -= 1
  if not (text.startswith('<think>', start) and text.endswith('</answer>', start, end)):
    return False
  # The first `</think>\s*<answer>` after `<think>` ends earliest; any split works
  # only if that one leaves room for `</answer>`.
  join = _JOIN.search(text, start + len('<think>'), end)
  return join is not None and join.end() <= end - len('</answer>')


@register('format_think_answer')
def format_think_answer(prompts, completions, metadata):
  del prompts, metadata
  return [float(_think_answer(c)) for c in completions]


@register('boxed_format')
def boxed_format(prompts, completions, metadata):
  del prompts, metadata
  return [float('\\boxed{' in c) for c in completions]


def make_regex_reward(name, pattern):
  """Registers (and returns) a reward: 1.0 if the completion fully matches `pattern`."""
  compiled = re.compile(pattern, re.DOTALL)

  def fn(prompts, completions, metadata):
    del prompts, metadata
    return [float(compiled.fullmatch(c) is not None) for c in completions]

  fn.__name__ = name
  return register(name)(fn)


def overlong_penalty(lengths, max_new_tokens, buffer, penalty=1.0):
  """[N] float32 penalties (≥ 0, subtract from the reward) for token lengths."""
  lengths = np.asarray(lengths, np.float32)
  if buffer <= 0:
    return np.zeros_like(lengths)
  if buffer >= max_new_tokens:
    raise ValueError(f'`buffer` ({buffer}) must be smaller than max_new_tokens ({max_new_tokens}).')
  start = max_new_tokens - buffer
  return (penalty * np.clip((lengths - start) / buffer, 0.0, 1.0)).astype(np.float32)
