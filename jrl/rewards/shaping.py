"""Reward clipping and running normalisation, as pure functions on a small state.

    state = init()
    state = update(state, rewards)                # fold a batch into the moments
    shaped = normalize(state, rewards, clip=5.0)  # (r − mean) / std, then clipped

The state is optax-style: a NamedTuple of plain numbers, updated by a pure
function and checkpointed with the run (so a resumed run normalises exactly
as an uninterrupted one). Moments are merged batch by batch with Chan et
al.'s parallel update, so the result does not depend on how the stream is
cut into batches. OpenRLHF's `normalize_reward` keeps the same running
statistics for its reward model.
"""

from typing import NamedTuple

import numpy as np


class RunningMoments(NamedTuple):
  count: float  # samples seen
  mean: float
  m2: float  # sum of squared deviations from the mean


def init():
  return RunningMoments(0.0, 0.0, 0.0)


def update(state, values):
  """Folds a batch of finite values ([N]) into the moments."""
  x = np.asarray(values, np.float64).reshape(-1)
  x = x[np.isfinite(x)]
  if x.size == 0:
    return state
  n_b, mean_b = float(x.size), float(x.mean())
  m2_b = float(((x - mean_b) ** 2).sum())
  n = state.count + n_b
  delta = mean_b - state.mean
  mean = state.mean + delta * n_b / n
  m2 = state.m2 + m2_b + delta**2 * state.count * n_b / n
  return RunningMoments(n, mean, m2)


def std(state, eps=1e-8):
  """Population standard deviation of everything seen (1 before any data)."""
  if state.count < 2:
    return 1.0
  return float(np.sqrt(state.m2 / state.count) + eps)


def normalize(state, values, *, clip=0.0, center=True):
  """(values − mean) / std (or values / std without `center`), clipped to
  [−clip, clip] when clip > 0. Returns float32 [N]."""
  x = np.asarray(values, np.float64)
  out = (x - (state.mean if center else 0.0)) / std(state)
  if clip:
    out = np.clip(out, -clip, clip)
  return out.astype(np.float32)


def clip_rewards(values, clip):
  """Rewards clipped to [−clip, clip] (clip = 0: unchanged)."""
  x = np.asarray(values, np.float32)
  return np.clip(x, -clip, clip) if clip else x


def length_correlation(rewards, lengths):
  """Pearson correlation of reward with response length (0 when either is constant):
  a reward model that pays for length shows up here first."""
  r, n = np.asarray(rewards, np.float64), np.asarray(lengths, np.float64)
  if r.size < 2 or r.std() == 0 or n.std() == 0:
    return 0.0
  return float(np.corrcoef(r, n)[0, 1])
