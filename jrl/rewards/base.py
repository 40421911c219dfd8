"""The reward-function protocol and the registry.

A reward function is batched:

    fn(prompts: list[str], completions: list[str], metadata: list[dict]) -> list[float | None]

returning one score per completion, or None for "could not score" (e.g. no
answer could be parsed). Functions are registered by name with `@register`
so that configs (and worker processes) can find them, or named in config by
import path (`'my_project.rewards:score'`, importable from the directory the
run starts in or from PYTHONPATH);
`jrl.rewards.service.RewardService` runs several of them with weights and
keeps each one's scores for metrics.
"""

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jrl.plugins import is_import_path, load_object

REGISTRY: dict[str, Callable] = {}


def register(name):
  """Decorator: makes a reward function available to configs by `name`."""

  def wrap(fn):
    REGISTRY[name] = fn
    return fn

  return wrap


def get_reward_fn(name):
  """The reward function registered as `name`, or found at the import path
  `name` ('my_project.rewards:score'; then registered under that name, so
  reward worker processes find it the same way, by importing its module)."""
  if name in REGISTRY:
    return REGISTRY[name]
  if is_import_path(name):
    fn = load_object(name, 'reward function')
    if not callable(fn):
      raise ValueError(f'reward function {name!r} is a {type(fn).__name__}, not a function.')
    REGISTRY[name] = fn
    return fn
  raise ValueError(
    f'unknown reward function {name!r}; registered: {sorted(REGISTRY)} '
    '(or give an import path, "package.module:function").'
  )


class ScoredBatch(NamedTuple):
  """The scores of one batch of completions."""

  total: np.ndarray  # [N] float32 weighted sum (unscored entries count as `unscored_value`)
  per_fn: dict  # name -> [N] float32, NaN where unscored
  unscored: dict  # name -> number of completions it could not score
  failures: dict  # name -> chunks whose call raised or crashed
  timeouts: dict  # name -> chunks that ran out of time
  errors: list  # the first error messages, for the log
