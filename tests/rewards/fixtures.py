"""Reward functions for the service tests, registered when this module is
imported, so that worker processes find them too."""

import os
import threading
import time

from jrl.rewards import register
from jrl.rewards.base import time_left


@register('test_const')
def const(prompts, completions, metadata):
  return [1.0] * len(completions)


@register('test_length')
def length(prompts, completions, metadata):
  return [float(len(c)) for c in completions]


@register('test_slow')
def slow(prompts, completions, metadata):
  time.sleep(max(m.get('sleep', 0.0) for m in metadata))
  return [1.0] * len(completions)


@register('test_raise')
def raises(prompts, completions, metadata):
  raise ZeroDivisionError('verifier bug')


@register('test_crash')
def crash(prompts, completions, metadata):
  os._exit(3)


@register('test_hang')
def hang(prompts, completions, metadata):
  while True:
    pass


@register('test_nan')
def nan(prompts, completions, metadata):
  return [float('nan')] + [1.0] * (len(completions) - 1)


@register('test_wrong_length')
def wrong_length(prompts, completions, metadata):
  return [1.0]


@register('test_flaky')
def flaky(prompts, completions, metadata):
  """Fails, hangs or sleeps depending on metadata['mode'] of the first item."""
  mode = metadata[0].get('mode', 'ok')
  if mode == 'raise':
    raise RuntimeError('flaky failure')
  if mode == 'hang':
    time.sleep(60)
  if mode == 'slow':
    time.sleep(0.3)
  return [float(m.get('value', 1.0)) for m in metadata]


@register('test_time_left')
def seconds_left(prompts, completions, metadata):
  """What `time_left()` says at the start of the call, for every completion."""
  return [time_left()] * len(completions)


RELEASE = threading.Event()  # set by the tests to let blocked functions return


@register('test_block')
def block(prompts, completions, metadata):
  """Blocks (without using the CPU) while metadata asks for it."""
  if any(m.get('block') for m in metadata):
    RELEASE.wait()
  return [1.0] * len(completions)


@register('test_exit')
def exits(prompts, completions, metadata):
  raise SystemExit(0)


@register('test_interrupt')
def interrupts(prompts, completions, metadata):
  raise KeyboardInterrupt


@register('test_first_even')
def first_even(prompts, completions, metadata):
  """1 for a completion whose first character has an even code point, else 0."""
  return [float(bool(c) and ord(c[0]) % 2 == 0) for c in completions]


def serve_endless_symbolic():
  """A symbolic helper (`jrl.rewards.math.serve_symbolic`) whose comparisons
  of unequal-looking expressions never end and ignore their deadline, like
  one stuck in C code: only a kill stops it."""
  import contextlib

  import math_verify

  from jrl.rewards import symbolic

  def endless(gold, pred, **kwargs):
    if gold == pred:  # the helper's warm-up, cut to '1' and '1' below
      return True
    while True:
      time.sleep(0.01)

  math_verify.verify = endless
  symbolic._WARM_UP = (('1', '1'),)
  symbolic._deadline = lambda seconds: contextlib.nullcontext()
  symbolic.serve_symbolic()
