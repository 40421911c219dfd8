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

The service stops waiting for a call after `reward.timeout_s`; inside the
call, `time_left()` says how long is left, so that a function can spend its
own budget (`math_answer` does) instead of losing the whole chunk.
"""

import contextlib
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jrl.plugins import is_import_path, load_object

REGISTRY: dict[str, Callable] = {}
_call = threading.local()  # .deadline: monotonic time the service stops waiting


def time_left():
  """Seconds before the reward service stops waiting for the call running in
  this thread (its chunk's `timeout_s`, from the start of the call), never
  below 0; None outside the service."""
  deadline = getattr(_call, 'deadline', None)
  return None if deadline is None else max(0.0, deadline - time.monotonic())


@contextlib.contextmanager
def call_deadline(seconds):
  """Sets `time_left()` to `seconds` from now inside the block (None: no deadline).
  The reward service and its worker processes wrap each call in it."""
  previous = getattr(_call, 'deadline', None)
  _call.deadline = None if seconds is None else time.monotonic() + float(seconds)
  try:
    yield
  finally:
    _call.deadline = previous


def register(name, *, uses_sandbox=False):
  """Decorator: makes a reward function available to configs by `name`.
  `uses_sandbox`: it runs completions in `jrl.rewards.sandbox`, so a run
  that names it sets the sandbox up at start-up (and refuses to start
  without isolation unless `reward.sandbox_unsafe`)."""

  def wrap(fn):
    if uses_sandbox:
      fn.uses_sandbox = True
    REGISTRY[name] = fn
    return fn

  return wrap


def uses_sandbox(name):
  """Whether the reward function `name` (registered or an import path) runs
  completions in the sandbox: registered with `uses_sandbox=True`, or a
  function with a true `uses_sandbox` attribute. False for a name neither
  registered nor an import path (the trainer's own 'reward_model' and
  'judge', made in process; an unknown name is refused where it is run)."""
  fn = REGISTRY.get(name)
  if fn is None and is_import_path(name):
    fn = get_reward_fn(name)
  return bool(getattr(fn, 'uses_sandbox', False))


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


def scored_rows(scored, weights=None):
  """[N] bool: the completions whose total holds every reward function's
  score. A completion that one function left unscored (NaN in `per_fn`:
  None, a failure, a timeout, a remote total that did not arrive) is not;
  a function whose weight in `weights` ({name: weight}, None: all count) is
  0 adds nothing to the total, and its gaps do not count."""
  n = len(scored.total)
  ok = np.ones(n, bool)
  for name, values in scored.per_fn.items():
    if weights is None or weights.get(name, 1.0) != 0:
      ok &= np.isfinite(np.asarray(values, np.float64).reshape(n))
  return ok
