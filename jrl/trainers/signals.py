"""What an iteration tells the controller beside its metrics, as fields.

An algorithm's `iterate(state, iteration)` returns `(state, Report)`. The
controller logs `Report.metrics` as they are and acts on the other fields
only: it stops a run after `max_nonfinite_steps` iterations in a row with a
`skipped` update, and after `reward.max_unscored_steps` in a row where a
reward function left more than `reward.max_unscored_frac` of the completions
`unscored`. No metric name is read to decide anything.

The update says whether it skipped and why: `common.apply_gradients` leaves
the parameters unchanged when the loss or the gradient is not finite and
reports it as `NONFINITE` (1.0) in its metrics, and `NONFINITE_LOSS` (1.0)
when the loss itself was not; `skipped` turns one iteration's update
metrics into a `Skipped` per model whose update did not apply. The
rollout says what it could not score: `rollout.Rollout.unscored`, one
`Unscored` per reward function, and in an agent run one for the episodes
its environments failed (`ENVIRONMENT`).
"""

from typing import NamedTuple

NONFINITE = 'nonfinite'  # the update metric that is 1.0 when it skipped
NONFINITE_LOSS = 'nonfinite_loss'  # 1.0 when the loss was not finite (else the gradient was not)


class Skipped(NamedTuple):
  """A model whose update was skipped in an iteration, and why."""

  model: str  # the metrics' prefix: 'actor', 'critic', 'sft', ...
  why: str  # 'loss' (the loss was not finite) or 'gradient' (the loss was, its gradient not)

  def __str__(self):
    return f'{self.model} (non-finite {self.why})'


class Unscored(NamedTuple):
  """One reward function's completions left without a score in a batch (or,
  named `ENVIRONMENT`, the episodes an agent run's environments failed)."""

  name: str  # the reward function
  frac: float  # of the batch's completions, in [0, 1]
  failures: int  # chunks whose call raised (episodes: whose environment raised or misbehaved)
  timeouts: int  # chunks that ran past the deadline (episodes: whose environment hung)
  errors: tuple = ()  # its first error messages, when it keeps them (environments do)


# The name of the `Unscored` of an agent run's environments.
ENVIRONMENT = 'environment'


class Report(NamedTuple):
  """One iteration's outcome.

  metrics: name -> float, logged as they are.
  skipped: a `Skipped` per model whose update was skipped this iteration
    (a non-finite loss or gradient), in the order the iteration updates
    them; () when every update applied.
  unscored: per reward function, what the iteration's rollout left
    unscored; () when nothing was scored (SFT, DPO, reward models).
  """

  metrics: dict
  skipped: tuple = ()
  unscored: tuple = ()


def skipped(update_metrics, models):
  """A `Skipped` for each of `models` whose update skipped, from the update's
  host metrics: `<model>/NONFINITE` above 0, why by `<model>/NONFINITE_LOSS`
  (over several minibatches the metrics must hold each model's largest value)."""
  get = lambda m, key: update_metrics.get(f'{m}/{key}', 0.0) > 0
  return tuple(
    Skipped(m, 'loss' if get(m, NONFINITE_LOSS) else 'gradient')
    for m in models
    if get(m, NONFINITE)
  )


def mostly_unscored(unscored, limit, errors):
  """A description of the reward functions in `unscored` (Unscored) that
  left more than `limit` of the completions unscored, with their failure
  and timeout counts and first errors; '' if none did."""
  over = [u for u in unscored if u.frac > limit]
  if not over:
    return ''
  bad = [
    f'the environments failed {u.frac:.0%} of the episodes ({u.failures:g} raised or '
    f'misbehaved, {u.timeouts:g} hung)'
    if u.name == ENVIRONMENT
    else f'reward function {u.name!r} left {u.frac:.0%} of completions unscored '
    f'({u.failures:g} failed and {u.timeouts:g} timed-out chunks)'
    for u in over
  ]
  errors = [e for u in over for e in u.errors] + list(errors)
  errors = '; '.join(errors[:3]) or 'no error recorded: it returned None or NaN'
  return ', '.join(bad) + f' (first errors: {errors})'
