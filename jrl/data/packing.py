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

Everything here but `unpack_on_device` is host-side NumPy and deterministic: the same lengths give
the same rows on every process and every run.
"""

from typing import NamedTuple

import jax.numpy as jnp
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


# A padded minibatch, packed for the model ---------------------------------------


class PackedInputs(NamedTuple):
  """A right-padded [B, T] batch packed into R rows of L tokens for the model,
  with the map back: `unpack_on_device(v_RxL, index, valid)` is the [B, T]
  layout (0 off each sequence), so a loss computed there is unchanged.

  A micro-batch (`micro_batches`) holds some of the B sequences: `select`
  says which, and the others have no valid column (they unpack to 0)."""

  tokens: np.ndarray  # [R, L] int32
  segment_ids: np.ndarray  # [R, L] int32, 1, 2, ... per sequence in a row; 0 padding
  positions: np.ndarray  # [R, L] int32, 0 at each sequence's first token
  index: np.ndarray  # [B, T] int32 into the flattened R·L
  valid: np.ndarray  # [B, T] bool, the columns of each sequence held here
  select: np.ndarray  # [B] bool, the sequences these rows hold
  # Shared-prompt rows (`jrl.data.layouts.shared_prompt`): [R, G, U] bool real
  # tokens of each row's G branches after its prompt; None: plain segments.
  branches: np.ndarray | None = None
  # Where logprobs are read (`jrl.data.layouts.with_window`); None: everywhere.
  window_index: np.ndarray | None = None  # [B, W] int32 into R·L: the predicting state
  window_start: np.ndarray | None = None  # [B] int32 column of sequence b's first window token
  window_valid: np.ndarray | None = None  # [B, W] bool


def sequence_lengths(mask_BxT):
  """Real tokens per row of a right-padded mask (True on [0, n_b)).

  Raises:
    ValueError naming the first row whose real tokens are not a prefix (a
    left-padded or holed row cannot be packed by length).
  """
  mask = np.asarray(mask_BxT, bool)
  n_B = mask.sum(axis=1)
  prefix = np.arange(mask.shape[1])[None, :] < n_B[:, None]
  bad = np.nonzero((mask != prefix).any(axis=1))[0]
  if len(bad):
    raise ValueError(
      f'row {int(bad[0])} is not right-padded (real tokens must be columns [0, n)); '
      'packing needs the layout of trainers.common.pack_sequences.'
    )
  return n_B.astype(np.int32)


def row_count(needed, multiple=1, most=None):
  """Static row count for `needed` rows: `multiple` times 1, 2, 3, 4, 6, 8,
  12, 16, ... (powers of two and 1.5 times them: a run compiles a few shapes,
  at most a third of the rows are empty, and the rows split over the batch
  shards), at most `most` rounded up to `multiple`."""
  k = 1
  while k * multiple < needed:
    # The next of 1, 2, 3, 4, 6, 8, 12, ...: 2^p -> 3·2^(p-1) -> 2^(p+1).
    k = k + 1 if k < 2 else k // 2 * 3 if k & (k - 1) == 0 else k // 3 * 4
  r = k * multiple
  if most is not None:
    r = min(r, -(-max(most, needed) // multiple) * multiple)
  return max(r, multiple)


def _inputs(tokens_BxT, n_B, bins, row_len, rows):
  """PackedInputs of the sequences in `bins` (one list of indices per row),
  padded to `rows` rows; the other sequences are not selected."""
  tokens = np.asarray(tokens_BxT)
  b, t = tokens.shape
  bins = list(bins) + [[] for _ in range(rows - len(bins))]
  held = sorted(i for row in bins for i in row)
  select = np.zeros(b, bool)
  select[held] = True
  # A sequence not held here is placed with no tokens: it unpacks to nothing.
  seqs = [tokens[i, : n_B[i]].tolist() if select[i] else [] for i in range(b)]
  bins = [row + ([] if r else [i for i in range(b) if not select[i]]) for r, row in enumerate(bins)]
  packed = pack(seqs, [[] for _ in range(b)], bins, row_len)
  index, valid = gather_index(packed.layout, t, row_len)
  return PackedInputs(
    packed.tokens, packed.segment_ids, packed.positions, index, valid & select[:, None], select
  )


def pack_padded(tokens_BxT, mask_BxT, row_len, multiple=1):
  """Packs the sequences of a right-padded batch (sequence b is
  tokens[b, :n_b], n_b = mask[b].sum()) into rows of `row_len` tokens by
  first-fit-decreasing; rows are then padded to `row_count(...)` (empty
  rows are all padding).

  Args:
    tokens_BxT, mask_BxT: the padded batch (host arrays).
    row_len: L ≥ the longest sequence.
    multiple: the row count is a multiple of this (the batch shards).

  Returns:
    PackedInputs (NumPy), every sequence selected.
  """
  n_B = sequence_lengths(mask_BxT)
  bins = first_fit_decreasing(n_B, row_len)
  r = row_count(len(bins), multiple, most=len(n_B))
  return _inputs(tokens_BxT, n_B, bins, row_len, r)


def row_len_buckets(row_len, smallest=16):
  """The row lengths a micro-batch may use: `row_len` and those of its half,
  quarter and eighth that are multiples of 8 tokens and at least `smallest`
  (1024 -> 1024, 512, 256, 128, every one a whole number of TPU splash
  tiles; 24 -> 24 alone). A few static lengths: compiles stay bounded."""
  row_len = int(row_len)
  out = [row_len]
  for part in (2, 4, 8):
    if row_len % (8 * part) == 0 and row_len // part >= smallest:
      out.append(row_len // part)
  return tuple(out)


def micro_batch_plan(lengths, row_len, budget, multiple=1, row_lens=None):
  """How `micro_batches` splits sequences of `lengths` tokens: a list of
  (bins, L, rows), one per micro-batch in order, where bins are its packed
  rows (lists of sequence indices), L its row length and rows the static row
  count it runs (`row_count`, a multiple of `multiple`).

  The sequences are packed first-fit-decreasing into rows of L tokens, the
  smallest of `row_lens` that holds the longest, and each micro-batch takes
  the next `multiple · (budget // L)` rows, at most `budget` tokens per batch
  shard. Once the sequences left would fit shorter rows, they are packed
  again at the shorter length if that runs no more tokens (rows x L, with
  the row counts' rounding) than going on with the rows of L: so a batch's
  short tail gets short rows (less padding, and attention costs rows · L²),
  and the buckets never add tokens. Depends only on the lengths.

  Args:
    lengths: [B] tokens per sequence.
    row_len: the longest row, ≥ every length.
    budget: tokens per micro-batch and batch shard, ≥ `row_len`.
    multiple: the batch shards.
    row_lens: the row lengths to choose from (default `row_len_buckets`).
  """
  if budget < row_len:
    raise ValueError(f'the micro-batch token budget {budget} is less than a row ({row_len}).')
  lens = sorted({int(x) for x in (row_len_buckets(row_len) if row_lens is None else row_lens)})
  if lens[-1] != row_len:
    raise ValueError(f'the longest row bucket {lens[-1]} is not the row length {row_len}.')
  n = [int(x) for x in lengths]
  return _plan(n, list(range(len(n))), lens, budget, multiple)


def _plan(n, left, lens, budget, multiple):
  """`micro_batch_plan` of the sequences `left` (indices into lengths n)."""
  if not left:
    return []
  length = bucket(max(n[i] for i in left), lens)
  per = multiple * (budget // length)
  bins = [[left[j] for j in row] for row in first_fit_decreasing([n[i] for i in left], length)]
  chunks = [
    (bins[k : k + per], length, row_count(len(bins[k : k + per]), multiple, most=per))
    for k in range(0, len(bins), per)
  ]
  for c in range(1, len(chunks)):
    rest = sorted(i for chunk, _, _ in chunks[c:] for row in chunk for i in row)
    if bucket(max(n[i] for i in rest), lens) < length:
      again = _plan(n, rest, lens, budget, multiple)
      if _tokens(again) <= _tokens(chunks[c:]):
        return chunks[:c] + again
      break
  return chunks


def _tokens(plan):
  """Tokens a plan runs: rows x row length, summed."""
  return sum(rows * length for _, length, rows in plan)


def micro_batches(tokens_BxT, mask_BxT, row_len, budget, multiple=1, row_lens=None):
  """The sequences of a right-padded batch (as `pack_padded` takes it) in
  micro-batches of at most `budget` tokens per batch shard, packed by
  `micro_batch_plan`: rows of `row_len` for the longest sequences, shorter
  rows (`row_len_buckets`) once the sequences left fit them.

  Every sequence is in exactly one micro-batch; the split depends only on
  the lengths (deterministic), and a loss summed over the micro-batches
  with the whole batch's normaliser is the whole batch's loss.

  Args:
    budget: tokens per micro-batch and batch shard, ≥ `row_len`.
    row_lens: as `micro_batch_plan`.

  Returns:
    list of PackedInputs (NumPy), each with its `select`.
  """
  n_B = sequence_lengths(mask_BxT)
  return [
    _inputs(tokens_BxT, n_B, bins, length, rows)
    for bins, length, rows in micro_batch_plan(n_B, row_len, budget, multiple, row_lens)
  ]


def unpack_on_device(values_RxL, index_BxT, valid_BxT, fill=0):
  """[R, L, ...] per-token values of packed rows -> the padded [B, T, ...]
  layout (`fill` off each sequence); differentiable (a gather)."""
  rows, row_len = values_RxL.shape[:2]
  flat = values_RxL.reshape(rows * row_len, *values_RxL.shape[2:])
  out = flat[index_BxT]
  valid = valid_BxT.reshape(*valid_BxT.shape, *([1] * (out.ndim - 2)))
  return jnp.where(valid, out, jnp.asarray(fill, out.dtype))


def efficiency(mask_BxT, packed):
  """Real tokens / tokens the model runs on, padded and packed: (padded, packed).

  `packed`: the PackedInputs of the batch, or a list of its micro-batches."""
  parts = packed if isinstance(packed, list) else [packed]
  real = float(np.asarray(mask_BxT).sum())
  run = sum(np.asarray(p.tokens).size for p in parts)
  return real / np.asarray(mask_BxT).size, real / run
