"""`jrl.rewards.shaping`: running reward statistics, clipping, length bias."""

import numpy as np
import pytest

from jrl.rewards import shaping as N


def test_running_moments_do_not_depend_on_how_the_stream_is_cut():
  x = np.random.default_rng(0).normal(3.0, 2.0, 1000)
  whole = N.update(N.init(), x)
  pieces = N.init()
  for chunk in np.split(x, [7, 100, 101, 640]):
    pieces = N.update(pieces, chunk)
  assert pieces.count == whole.count == 1000
  assert pieces.mean == pytest.approx(x.mean())
  assert N.std(pieces) == pytest.approx(x.std(), abs=1e-7)
  assert N.std(whole) == pytest.approx(x.std(), abs=1e-7)


def test_normalize_centres_scales_and_clips():
  state = N.update(N.init(), [0.0, 2.0, 4.0])  # mean 2, std sqrt(8/3)
  out = N.normalize(state, [2.0, 2.0 + np.sqrt(8 / 3), 100.0], clip=5.0)
  np.testing.assert_allclose(out, [0.0, 1.0, 5.0], rtol=1e-6)
  assert out.dtype == np.float32
  scaled = N.normalize(state, [4.0], center=False)
  np.testing.assert_allclose(scaled, [4.0 / np.sqrt(8 / 3)], rtol=1e-6)
  # Before any data the scale is 1; non-finite values are not folded in.
  assert N.std(N.init()) == 1.0
  assert N.update(N.init(), [np.nan, np.inf]) == N.init()


def test_clip_and_length_correlation():
  np.testing.assert_array_equal(N.clip_rewards([-3.0, 0.5, 9.0], 2.0), [-2.0, 0.5, 2.0])
  np.testing.assert_array_equal(N.clip_rewards([-3.0, 9.0], 0.0), [-3.0, 9.0])
  assert N.length_correlation([1.0, 2.0, 3.0], [10, 20, 30]) == pytest.approx(1.0)
  assert N.length_correlation([3.0, 2.0, 1.0], [10, 20, 30]) == pytest.approx(-1.0)
  assert N.length_correlation([1.0, 1.0, 1.0], [10, 20, 30]) == 0.0
