"""Sequence packing: the bin packer, pack / unpack against the padded layout."""

import numpy as np
import pytest

from jrl.data import packing
from jrl.trainers import common


def _sequences(rng, b, max_prompt=6, max_response=10, empty_every=5):
  prompts = [list(rng.integers(1, 50, rng.integers(1, max_prompt + 1))) for _ in range(b)]
  responses = [
    [] if i % empty_every == 0 else list(rng.integers(1, 50, rng.integers(1, max_response + 1)))
    for i in range(b)
  ]
  return prompts, responses


def test_first_fit_decreasing_by_hand():
  # Longest first: 7 -> bin 0; 5 -> bin 1 (7 + 5 > 10); 3 -> bin 0; 3 -> bin 1;
  # 2 -> bin 1 (bin 0 has 0 left); 1 -> bin 2.
  assert packing.first_fit_decreasing([3, 7, 1, 5, 3, 2], 10) == [[1, 0], [3, 4, 5], [2]]


@pytest.mark.parametrize('seed', range(5))
def test_bins_hold_every_sequence_once_within_capacity_and_are_deterministic(seed):
  rng = np.random.default_rng(seed)
  lengths = list(rng.integers(0, 64, 200))
  bins = packing.first_fit_decreasing(lengths, 64)
  assert sorted(i for b in bins for i in b) == list(range(200))
  assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
  assert bins == packing.first_fit_decreasing(list(lengths), 64)
  # First fit never leaves two bins that could have been one.
  loads = sorted(sum(lengths[i] for i in b) for b in bins)
  assert loads[0] + loads[1] > 64 or len(bins) == 1


def test_too_long_a_sequence_is_named():
  with pytest.raises(ValueError, match='sequence 2 has 11 tokens'):
    packing.first_fit_decreasing([1, 2, 11], 10)


def test_bucket():
  assert packing.bucket(100, (128, 256, 512)) == 128
  assert packing.bucket(128, (512, 128)) == 128
  with pytest.raises(ValueError, match='largest row bucket 512'):
    packing.bucket(600, (128, 512))


@pytest.mark.parametrize('seed', range(4))
def test_pack_then_unpack_is_the_padded_layout(seed):
  rng = np.random.default_rng(seed)
  prompts, responses = _sequences(rng, 23)
  t = 16
  padded = common.pack_sequences(prompts, responses, t)
  lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
  packed = packing.pack(prompts, responses, packing.first_fit_decreasing(lengths, 32), 32)
  assert packed.tokens.shape[0] < 23  # fewer rows than sequences
  for name in ('tokens', 'mask', 'loss_mask'):
    np.testing.assert_array_equal(
      packing.unpack(getattr(packed, name), packed.layout, t), getattr(padded, name)
    )
  # Positions restart in every segment; segment ids number them in their row.
  for i, n in enumerate(lengths):
    r, s = packed.layout.row[i], packed.layout.start[i]
    np.testing.assert_array_equal(packed.positions[r, s : s + n], np.arange(n))
    assert len(set(packed.segment_ids[r, s : s + n])) == 1
  assert packed.mask.sum() == sum(lengths)
  np.testing.assert_array_equal(packed.mask, packed.segment_ids > 0)


def test_device_unpack_index_matches_unpack():
  rng = np.random.default_rng(7)
  prompts, responses = _sequences(rng, 11)
  lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
  packed = packing.pack(prompts, responses, packing.first_fit_decreasing(lengths, 24), 24)
  values = rng.normal(size=packed.tokens.shape).astype(np.float32)
  index, valid = packing.gather_index(packed.layout, 16, 24)
  on_device = np.where(valid, values.reshape(-1)[index], 0.0)
  np.testing.assert_array_equal(on_device, packing.unpack(values, packed.layout, 16))


def test_bad_bins_are_refused():
  with pytest.raises(ValueError, match='exactly once'):
    packing.pack([[1], [2]], [[3], [4]], [[0], [0]], 8)
  with pytest.raises(ValueError, match='row 0: sequence 1 ends at column 10'):
    packing.pack([[1] * 4, [2] * 4], [[3], [4]], [[0, 1]], 8)
