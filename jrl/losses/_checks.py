"""Argument checks shared by the objectives.

Every public function in `jrl.losses` checks the shapes and modes of its
arguments in its first lines and raises `ValueError` naming the argument, so a
wrong call fails at trace time with a message rather than broadcasting
silently. Checks look at static shapes only, so they cost nothing under jit.
"""

import numbers
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np


def check_rank(x, rank: int, name: str, dims: str) -> None:
  """Raises if `x` does not have `rank` dimensions; `dims` is e.g. '[B, T]'."""
  shape = jnp.shape(x)
  if len(shape) != rank:
    raise ValueError(f'`{name}` must have shape {dims}, got shape {tuple(shape)}.')


def check_same_shape(ref_name: str, ref, **others) -> None:
  """Raises if any array in `others` has a shape different from `ref`."""
  ref_shape = tuple(jnp.shape(ref))
  for name, x in others.items():
    if x is None:
      continue
    if tuple(jnp.shape(x)) != ref_shape:
      raise ValueError(
        f'`{name}` must have the same shape as `{ref_name}` {ref_shape}, '
        f'got shape {tuple(jnp.shape(x))}.'
      )


def check_choice(value: str, name: str, choices: Iterable[str]) -> None:
  """Raises if `value` is not one of `choices`."""
  choices = tuple(choices)
  if value not in choices:
    raise ValueError(f'`{name}` must be one of {choices}, got {value!r}.')


def check_group_size(batch: int, group_size: int, name: str = 'group_size') -> None:
  """Raises unless `group_size` is a positive int that divides `batch`."""
  if not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool) or group_size < 1:
    raise ValueError(f'`{name}` must be a positive int, got {group_size!r}.')
  if batch % group_size:
    raise ValueError(
      f'the batch size {batch} is not divisible by `{name}`={group_size}; '
      'rows must be laid out as consecutive groups of samples of one prompt.'
    )


def check_number(value, name: str) -> None:
  """Raises unless `value` is a number (not a bool, a string or None)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
    raise ValueError(f'`{name}` must be a number, got {value!r} ({type(value).__name__}).')


def check_positive(value, name: str, allow_zero: bool = False) -> None:
  """Raises unless the number `value` is > 0 (or >= 0); NaN is neither."""
  check_number(value, name)
  if not (value >= 0 if allow_zero else value > 0):
    bound = '>= 0' if allow_zero else '> 0'
    raise ValueError(f'`{name}` must be {bound}, got {value!r}.')


def check_below_one(value, name: str) -> None:
  """Raises unless the number `value` is < 1 (a clip range ε whose lower
  clip 1 − ε must stay above 0)."""
  check_number(value, name)
  if not value < 1:
    raise ValueError(f'`{name}` must be < 1 (the lower clip 1 - {name} stays > 0), got {value!r}.')


def as_f32(x):
  """Casts to float32: all loss arithmetic is done in float32."""
  return jnp.asarray(x, jnp.float32)
