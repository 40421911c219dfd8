"""Sequence packing: several (prompt + response) sequences per fixed-length row.

RL batches are long-tailed (most responses short, a few at the limit), so
padding every sequence to `max_prompt_len + max_new_tokens` spends most of the
compute on padding. Packing places sequences end to end in rows of a few
static lengths; `segment_ids` tell the model where each one starts (attention
stays inside a segment, positions restart at 0), and `unpack` brings any
per-token result back to the padded [B, T] layout of
`trainers.common.pack_sequences`, so every loss and aggregation computed
there is unchanged.

    bins = first_fit_decreasing(lengths, capacity=512)
    packed = pack(prompts, responses, bins, row_len=512)
    logp_RxL = model(packed.tokens, packed.segment_ids, packed.positions)
    logp_BxT = unpack(logp_RxL, packed.layout, T)

Everything here is host-side NumPy and deterministic: the same lengths give
the same rows on every process and every run.
"""

from typing import NamedTuple

import numpy as np


class Layout(NamedTuple):
  """Where each of the B sequences lies in the packed rows."""

  row: np.ndarray  # [B] int32
  start: np.ndarray  # [B] int32 first column in its row
  length: np.ndarray  # [B] int32 tokens (prompt + response)


class PackedBatch(NamedTuple):
  """R rows of L tokens holding B sequences."""

  tokens: np.ndarray  # [R, L] int32
  segment_ids: np.ndarray  # [R, L] int32, 1, 2, ... per sequence in a row; 0 padding
  positions: np.ndarray  # [R, L] int32, 0 at each sequence's first token
  mask: np.ndarray  # [R, L] bool, real tokens
  loss_mask: np.ndarray  # [R, L] bool, response tokens
  layout: Layout


def first_fit_decreasing(lengths, capacity):
  """Bins of sequence indices whose lengths sum to at most `capacity`.

  Longest first (ties by index), each into the first bin it fits; bins in the
  order they were opened, indices within a bin in the order placed.
  Deterministic for the same lengths.

  Args:
    lengths: [B] non-negative ints.
    capacity: tokens per bin (a row length or a micro-batch token budget).

  Returns:
    list of lists of indices, every index exactly once.

  Raises:
    ValueError naming the first sequence longer than `capacity`.
  """
  lengths = [int(n) for n in lengths]
  if capacity < 1:
    raise ValueError(f'capacity must be >= 1, got {capacity}.')
  for i, n in enumerate(lengths):
    if n < 0 or n > capacity:
      raise ValueError(f'sequence {i} has {n} tokens, more than the capacity {capacity}.')
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  bins, room = [], []
  for i in order:
    for b, free in enumerate(room):
      if lengths[i] <= free:
        bins[b].append(i)
        room[b] -= lengths[i]
        break
    else:
      bins.append([i])
      room.append(capacity - lengths[i])
  return bins


def bucket(length, buckets):
  """The smallest of `buckets` that holds `length` tokens.

  Raises:
    ValueError when none does.
  """
  fits = [b for b in sorted(buckets) if b >= length]
  if not fits:
    raise ValueError(f'{length} tokens exceed the largest row bucket {max(buckets)}.')
  return fits[0]


def pack(prompts, responses, bins, row_len, pad_id=0):
  """Packs sequences (prompt + response token lists) into rows.

  Args:
    prompts, responses: B lists of token ids.
    bins: rows as lists of sequence indices (e.g. `first_fit_decreasing`).
    row_len: L, tokens per row.
    pad_id: token id of padding.

  Returns:
    PackedBatch with R = len(bins) rows.
  """
  b = len(prompts)
  if len(responses) != b:
    raise ValueError(f'{b} prompts but {len(responses)} responses.')
  placed = sorted(i for row in bins for i in row)
  if placed != list(range(b)):
    raise ValueError('bins must hold every sequence index exactly once.')
  r = len(bins)
  tokens = np.full((r, row_len), pad_id, np.int32)
  segment_ids = np.zeros((r, row_len), np.int32)
  positions = np.zeros((r, row_len), np.int32)
  loss_mask = np.zeros((r, row_len), bool)
  row_of = np.zeros(b, np.int32)
  start_of = np.zeros(b, np.int32)
  length_of = np.zeros(b, np.int32)
  for row, members in enumerate(bins):
    col = 0
    for seg, i in enumerate(members, start=1):
      p, q = list(prompts[i]), list(responses[i])
      n = len(p) + len(q)
      if col + n > row_len:
        raise ValueError(
          f'row {row}: sequence {i} ends at column {col + n} > row length {row_len}.'
        )
      tokens[row, col : col + n] = p + q
      segment_ids[row, col : col + n] = seg
      positions[row, col : col + n] = np.arange(n)
      loss_mask[row, col + len(p) : col + n] = True
      row_of[i], start_of[i], length_of[i] = row, col, n
      col += n
  return PackedBatch(
    tokens, segment_ids, positions, segment_ids > 0, loss_mask, Layout(row_of, start_of, length_of)
  )


def unpack(values, layout, length, fill=0):
  """Per-token values of packed rows -> the padded [B, T] layout.

  Args:
    values: [R, L, ...] array (NumPy or JAX).
    layout: Layout of the packed batch.
    length: T of the padded layout.
    fill: value of the padding positions.

  Returns:
    [B, T, ...] array, sequence i at row i, columns [0, length_i).
  """
  values = np.asarray(values)
  b = len(layout.row)
  out = np.full((b, length, *values.shape[2:]), fill, values.dtype)
  for i in range(b):
    r, s, n = int(layout.row[i]), int(layout.start[i]), int(layout.length[i])
    if n > length:
      raise ValueError(f'sequence {i} has {n} tokens, more than the padded length {length}.')
    out[i, :n] = values[r, s : s + n]
  return out


def gather_index(layout, length, row_len):
  """Flat indices that unpack on the device: for a packed [R, L] array `v`,
  `jnp.where(valid, v.reshape(-1)[index], 0)` is `unpack(v, layout, length)`.

  Returns:
    (index [B, T] int32 into R * L, 0 where not valid; valid [B, T] bool).
  """
  cols = np.arange(length)[None, :]
  valid = cols < np.asarray(layout.length)[:, None]
  index = np.asarray(layout.row)[:, None] * row_len + np.asarray(layout.start)[:, None] + cols
  return np.where(valid, index, 0).astype(np.int32), valid
