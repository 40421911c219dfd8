"""How a right-padded [B, T] batch of sequences goes through the model in
training, paying only for what a loss reads.

Three layouts, each a list of `packing.PackedInputs` (one per micro-batch,
`select` saying which sequences it holds), all with the same map back to
the [B, T] layout, so losses, aggregations and metrics are unchanged:

* `padded`: one sequence per row, rows cut to the longest sequence of the
  micro-batch (a length from `length_bucket`), not to T;
* `packing.micro_batches` / `packing.pack_padded`: sequences end to end;
* `shared_prompt`: the sequences that share a prompt (a GRPO group: the
  tokens before the first loss token) in one row, the prompt once, then one
  branch per completion; attention lets each branch see the prompt and
  itself only (`jrl.models.shared_prompt_attention`).

`with_window` adds to any of them the W positions per sequence where
next-token logprobs are read (from the token before its first loss token to
its end): the output projection and the softmax over the vocabulary run
there only (`jrl.models.logprobs_at`), not at the prompt's positions.

Host-side NumPy, deterministic: the same batch gives the same rows on every
process and every run.
"""

import numpy as np

from jrl.data import packing

# Row and window lengths are multiples of this many tokens.
LENGTH_MULTIPLE = 8


def length_bucket(n, most=None):
  """The smallest of 8·{4, 5, 6, 7}·2^k / 4 (8, 16, 24, 32, 40, 48, 56, 64,
  80, 96, 112, 128, 160, ...) that holds `n` tokens, at most `most` (the
  padded length: a layout never runs longer rows than padding does). At
  most four lengths per octave, so a run compiles few shapes, and at most
  a fifth of a row is padding beyond 32 tokens."""
  n = max(int(n), 1)
  step = LENGTH_MULTIPLE
  out = step
  while out < n:
    # Within an octave [2^k, 2^(k+1)) of multiples, quarters of 2^k.
    octave = 1 << (out // step).bit_length() - 1
    out += step * max(octave // 4, 1)
  if most is not None:
    out = min(out, max(int(most), n))
  return out


def loss_starts(loss_mask_BxT, n_B):
  """[B] the first loss column of each sequence (at least 1: the first token
  has no prediction); n_b when it has no loss token."""
  loss = np.asarray(loss_mask_BxT, bool)
  has = loss.any(axis=1)
  first = np.where(has, np.argmax(loss, axis=1), n_B)
  return np.maximum(first, 1).astype(np.int32)


def with_window(inputs, tokens_BxT, loss_mask_BxT):
  """`inputs` (PackedInputs of some of the sequences of a [B, T] batch) with
  the positions where logprobs are read: sequence b's W positions from its
  first loss column s_b on, each predicted by the hidden state of the token
  before it (`window_index`, flat into the rows), valid up to its end.

  W is `length_bucket` of the longest span [s_b, n_b) among the sequences
  held; the others have no valid position (they read 0).
  """
  index = np.asarray(inputs.index)
  valid = np.asarray(inputs.valid)
  n_B = valid.sum(axis=1).astype(np.int32)
  select = np.asarray(inputs.select, bool)
  start = np.where(select, loss_starts(loss_mask_BxT, n_B), 0).astype(np.int32)
  span = np.where(select, np.maximum(n_B - start, 0), 0)
  t = index.shape[1]
  w = length_bucket(int(span.max(initial=1)), most=t)
  cols = start[:, None] + np.arange(w)[None, :]
  window_valid = select[:, None] & (cols < n_B[:, None])
  source = np.clip(cols - 1, 0, t - 1)
  window_index = np.where(window_valid, np.take_along_axis(index, source, axis=1), 0)
  return inputs._replace(
    window_index=window_index.astype(np.int32),
    window_start=start,
    window_valid=window_valid,
  )


def _micro_groups(items, per, multiple):
  """`items` in consecutive groups of `multiple · per` (at least one each)."""
  size = max(int(per), 1) * multiple
  return [items[k : k + size] for k in range(0, len(items), size)]


def padded(tokens_BxT, mask_BxT, budget=0, multiple=1):
  """One sequence per row, in micro-batches of at most `budget` tokens per
  batch shard (0: one micro-batch of every sequence); each micro-batch's rows
  are cut to the `length_bucket` of its longest sequence, and its row count
  is a multiple of `multiple` (`packing.row_count`).

  Returns:
    list of PackedInputs (NumPy), each with its `select`.
  """
  tokens = np.asarray(tokens_BxT)
  b, t = tokens.shape
  n_B = packing.sequence_lengths(mask_BxT)
  # Longest first, so each micro-batch's rows are as short as its sequences.
  order = sorted(range(b), key=lambda i: (-int(n_B[i]), i))
  longest = int(n_B.max(initial=1))
  per = max(budget // length_bucket(longest, most=t), 1) if budget else b
  if budget and budget < longest:
    raise ValueError(
      f'`train.micro_batch_tokens` ({budget}) is less than the longest sequence ({longest} tokens).'
    )
  out = []
  for held in _micro_groups(order, per, 1 if not budget else multiple):
    length = length_bucket(int(n_B[held].max(initial=1)), most=t)
    rows = packing.row_count(len(held), multiple, most=len(held))
    out.append(_padded_inputs(tokens, n_B, sorted(held), length, rows))
  return out


def _padded_inputs(tokens, n_B, held, length, rows):
  b, t = tokens.shape
  select = np.zeros(b, bool)
  select[held] = True
  row_tokens = np.zeros((rows, length), np.int32)
  segment_ids = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  index = np.zeros((b, t), np.int32)
  valid = np.zeros((b, t), bool)
  for r, i in enumerate(held):
    n = int(n_B[i])
    row_tokens[r, :n] = tokens[i, :n]
    segment_ids[r, :n] = 1
    positions[r, :n] = np.arange(n)
    index[i, :n] = r * length + np.arange(n)
    valid[i, :n] = True
  return packing.PackedInputs(row_tokens, segment_ids, positions, index, valid, select)


def prompt_groups(tokens_BxT, mask_BxT, loss_mask_BxT):
  """The sequences that share a prompt (the tokens before the first loss
  token), in order of first appearance: a list of (prompt length, [b, ...])."""
  tokens = np.asarray(tokens_BxT)
  n_B = packing.sequence_lengths(mask_BxT)
  start = loss_starts(loss_mask_BxT, n_B)
  groups = {}
  for i in range(tokens.shape[0]):
    p = int(min(start[i], n_B[i]))
    key = tokens[i, :p].tobytes()
    groups.setdefault(key, (p, []))[1].append(i)
  return list(groups.values())


def shared_row_len(prompt_len, group_size, response_len):
  """The longest shared-prompt row of groups of `group_size` sequences of at
  most `prompt_len` + `response_len` tokens."""
  return length_bucket(prompt_len) + packing.row_count(group_size) * length_bucket(response_len)


def shared_prompt(tokens_BxT, mask_BxT, loss_mask_BxT, budget=0, multiple=1):
  """Rows of one prompt and its completions (`prompt_groups`): the prompt in
  the first P columns, then G branches of U columns, branch k holding the
  k-th sequence's tokens after the prompt, positions continuing the
  prompt's. P, U are `length_bucket`s of the longest prompt and branch of
  the micro-batch and G the largest group (`packing.row_count` sizes);
  micro-batches hold whole groups, at most `budget` tokens per batch shard
  (0: every group in one).

  Returns:
    list of PackedInputs (NumPy) with `branches` [R, G, U] set, each with
    its `select`.
  """
  tokens = np.asarray(tokens_BxT)
  t = tokens.shape[1]
  n_B = packing.sequence_lengths(mask_BxT)
  groups = prompt_groups(tokens, mask_BxT, loss_mask_BxT)

  def shape(part):
    p = length_bucket(max(g[0] for g in part), most=t)
    u = length_bucket(max(int(n_B[i]) - g[0] for g in part for i in g[1]), most=t)
    width = packing.row_count(max(len(g[1]) for g in part))
    return p, width, u

  p, width, u = shape(groups)
  row = p + width * u
  per = budget // row if budget else len(groups)
  if budget and per < 1:
    raise ValueError(
      f'`train.micro_batch_tokens` ({budget}) is less than one shared-prompt row '
      f'({row} tokens: a prompt of {p} and {width} branches of {u}).'
    )
  out = []
  for part in _micro_groups(groups, per, 1 if not budget else multiple):
    rows = packing.row_count(len(part), multiple, most=len(part))
    out.append(_shared_inputs(tokens, n_B, part, shape(part), rows))
  return out


def _shared_inputs(tokens, n_B, part, shape, rows):
  b, t = tokens.shape
  p_cols, width, u = shape
  length = p_cols + width * u
  row_tokens = np.zeros((rows, length), np.int32)
  segment_ids = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  branches = np.zeros((rows, width, u), bool)
  index = np.zeros((b, t), np.int32)
  valid = np.zeros((b, t), bool)
  select = np.zeros(b, bool)
  for r, (p, members) in enumerate(part):
    first = members[0]
    row_tokens[r, :p] = tokens[first, :p]
    segment_ids[r, :p] = 1
    positions[r, :p] = np.arange(p)
    for k, i in enumerate(members):
      n = int(n_B[i])
      col = p_cols + k * u
      row_tokens[r, col : col + n - p] = tokens[i, p:n]
      segment_ids[r, col : col + n - p] = 1
      positions[r, col : col + n - p] = np.arange(p, n)
      branches[r, k, : n - p] = True
      index[i, :p] = r * length + np.arange(p)
      index[i, p:n] = r * length + col + np.arange(n - p)
      valid[i, :n] = True
      select[i] = True
  return packing.PackedInputs(
    row_tokens, segment_ids, positions, index, valid, select, branches=branches
  )
