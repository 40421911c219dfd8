"""The reward-function protocol and the scorer that runs several of them.

A reward function is batched:

    fn(prompts: list[str], completions: list[str], metadata: list[dict]) -> list[float | None]

returning one score per completion, or None for "could not score" (e.g. no
answer could be parsed). `RewardScorer` calls each configured function,
keeps every function's scores for metrics, and combines them with weights;
unscored entries count as `unscored_value` in the total and are counted in
the metrics. A function that raises is reported with its name and the run
stops: a wrong verifier must not silently teach the wrong thing.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

REGISTRY: dict[str, Callable] = {}


def register(name):
  """Decorator: makes a reward function available to configs by `name`."""

  def wrap(fn):
    REGISTRY[name] = fn
    return fn

  return wrap


def get_reward_fn(name):
  if name not in REGISTRY:
    raise ValueError(f'unknown reward function {name!r}; registered: {sorted(REGISTRY)}.')
  return REGISTRY[name]


class ScoredBatch(NamedTuple):
  total: np.ndarray  # [N] float32 weighted sum
  per_fn: dict  # name -> [N] float32 (NaN where unscored)
  unscored: dict  # name -> int count of None scores


class RewardScorer:
  """Runs named reward functions and combines them with weights."""

  def __init__(self, names, weights=None, unscored_value=0.0):
    names = tuple(names)
    if not names:
      raise ValueError('`reward.functions` must name at least one reward function.')
    weights = (1.0,) * len(names) if weights is None or len(weights) == 0 else tuple(weights)
    if len(weights) != len(names):
      raise ValueError(
        f'`reward.weights` has {len(weights)} entries for {len(names)} functions {names}.'
      )
    self.fns = [(n, get_reward_fn(n), float(w)) for n, w in zip(names, weights, strict=True)]
    self.unscored_value = float(unscored_value)

  def __call__(self, prompts, completions, metadata):
    n = len(completions)
    total = np.zeros(n, np.float32)
    per_fn, unscored = {}, {}
    for name, fn, weight in self.fns:
      try:
        scores = list(fn(prompts, completions, metadata))
      except Exception as e:
        raise RuntimeError(f'reward function {name!r} raised {type(e).__name__}: {e}') from e
      if len(scores) != n:
        raise RuntimeError(f'reward function {name!r} returned {len(scores)} scores for {n}.')
      values = np.full(n, np.nan, np.float32)
      for i, s in enumerate(scores):
        if s is not None:
          s = float(s)
          if not math.isfinite(s):
            raise RuntimeError(f'reward function {name!r} returned {s} for completion {i}.')
          values[i] = s
      per_fn[name] = values
      unscored[name] = int(np.isnan(values).sum())
      total += weight * np.where(np.isnan(values), self.unscored_value, values)
    return ScoredBatch(total, per_fn, unscored)
