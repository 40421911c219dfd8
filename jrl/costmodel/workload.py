"""One RL step's work (`Workload`), how the chips are used (`Layout`), and the
tokens a pass over the step's batch runs on, padded or packed (`tokens_run`)."""

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

TOPOLOGIES = ('colocated', 'disaggregated', 'one_step_off', 'async')
DECODE_WEIGHTS = ('gathered', 'sharded')


@dataclasses.dataclass(frozen=True)
class Workload:
  """One RL step's work.

  Response lengths: `response_clip_frac` of the completions run to
  `response_max`; the others spread evenly up to twice the mean that makes
  the overall mean `response_mean` (see `response_lengths`).

  With `packing` (`train.packing`), the update, reference and proximal passes
  run each minibatch's sequences end to end in rows of `row_len` tokens
  (`jrl.data.packing`), as the trainer does; `micro_batch_tokens`
  (`train.micro_batch_tokens`) caps the tokens of one forward/backward
  micro-batch per batch shard, which sizes the activations (see `memory`).
  """

  prompts_per_step: int  # B
  group_size: int  # G
  prompt_len: int  # tokens (mean; padded rows use max_prompt_len)
  response_mean: float
  response_max: int
  response_clip_frac: float = 0.0
  max_prompt_len: int = 0  # rows are max_prompt_len + response_max long (0: prompt_len)
  epochs: int = 1
  minibatch_rows: int = 0  # rows per optimiser step (0: the whole batch)
  reference: bool = False  # a KL term: reference logprobs every step
  num_slots: int = 64  # sampler slots per rollout replica
  page_size: int = 16
  steps_per_dispatch: int = 8
  reward_s: float = 1e-4  # seconds per completion scored
  param_bytes: int = 4  # master weights
  compute_bytes: int = 2  # activations, KV cache, rollout weights
  packing: bool = False  # sequences packed into rows (train.packing)
  pack_row_len: int = 0  # tokens per packed row (0: seq_len)
  micro_batch_tokens: int = 0  # tokens per micro-batch and batch shard (0: off; packing only)
  # The spread of one step's generation time from step to step (standard
  # deviation / mean; `coefficients.generation_cv` measures it in a trace):
  # what an async buffer of k > 1 rollouts absorbs.
  generation_cv: float = 0.0

  def __post_init__(self):
    if self.pack_row_len and self.pack_row_len < self.seq_len:
      raise ValueError(
        f'`pack_row_len` ({self.pack_row_len}) must be 0 or at least the longest '
        f'sequence, {self.seq_len} tokens.'
      )
    if self.micro_batch_tokens and not self.packing:
      raise ValueError('`micro_batch_tokens` needs `packing`.')
    if self.micro_batch_tokens and self.micro_batch_tokens < self.row_len:
      raise ValueError(
        f'`micro_batch_tokens` ({self.micro_batch_tokens}) must hold one row of '
        f'{self.row_len} tokens.'
      )

  @property
  def rows(self):
    return self.prompts_per_step * self.group_size

  @property
  def seq_len(self):
    return (self.max_prompt_len or self.prompt_len) + self.response_max

  @property
  def row_len(self):
    """Tokens per row the model runs on: packed rows, or padded sequences."""
    return (self.pack_row_len or self.seq_len) if self.packing else self.seq_len

  def response_lengths(self):
    """[B·G] deterministic response lengths with the stated mean, max and clip fraction."""
    n = self.rows
    n_clip = round(self.response_clip_frac * n)
    lengths = [self.response_max] * n_clip
    rest = n - n_clip
    if rest:
      mean = (self.response_mean * n - self.response_max * n_clip) / rest
      mean = min(max(mean, 1.0), self.response_max)
      hi = min(2 * mean - 1, self.response_max)
      lo = max(1.0, 2 * mean - hi)
      lengths += [round(lo + (hi - lo) * (i + 0.5) / rest) for i in range(rest)]
    # Interleave so that clipped rows are spread over groups, as sampling does.
    order = np.argsort([(i * 7919) % n for i in range(n)], kind='stable')
    return [lengths[i] for i in order]


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the chips are used."""

  topology: str = 'colocated'
  train_chips: int = 1
  rollout_chips: int = 0  # separate rollout chips (0: the training chips)
  tensor: int = 1  # tensor-parallel degree of training (the rest is fsdp x data)
  rollout_tensor: int = 1  # tensor-parallel degree of one rollout replica
  micro_rows: int = 0  # rows per forward/backward micro-batch (0: the minibatch)
  # On shared chips with batch shards > 1 (sampler.decode_weights): 'gathered', a
  # copy of the weights whole on each batch shard, made once per policy version;
  # 'sharded', the trainer's fsdp-sharded arrays, with collectives every decode step.
  decode_weights: str = 'gathered'
  staleness: int = 1  # async: rollouts generated up to this many steps ahead (k)

  def __post_init__(self):
    if not isinstance(self.staleness, int) or self.staleness < 0:
      raise ValueError(f'`staleness` must be an int >= 0, got {self.staleness!r}.')
    if self.topology not in TOPOLOGIES:
      raise ValueError(f'`topology` must be one of {TOPOLOGIES}, got {self.topology!r}.')
    if self.decode_weights not in DECODE_WEIGHTS:
      raise ValueError(
        f'`decode_weights` must be one of {DECODE_WEIGHTS}, got {self.decode_weights!r}.'
      )
    if self.topology == 'disaggregated' and self.rollout_chips < 1:
      raise ValueError('`rollout_chips` must be >= 1 for a disaggregated layout.')
    if self.train_chips < 1 or self.tensor < 1 or self.rollout_tensor < 1:
      raise ValueError('`train_chips`, `tensor` and `rollout_tensor` must be >= 1.')

  @property
  def separate(self):
    return self.rollout_chips > 0

  @property
  def chips(self):
    return self.train_chips + self.rollout_chips

  @property
  def batch_shards(self):
    """Ways the batch splits over the training chips (fsdp x data)."""
    return max(1, self.train_chips // self.tensor)

  @property
  def decode_copy(self):
    """Whether generation on the shared chips reads a gathered copy of the weights."""
    return not self.separate and self.batch_shards > 1 and self.decode_weights == 'gathered'

  @property
  def decode_fsdp(self):
    """Whether every decode step runs collectives over the batch shards
    (generation on the shared chips reading the trainer's sharded weights)."""
    return not self.separate and self.batch_shards > 1 and self.decode_weights == 'sharded'

  @property
  def rollout_replicas(self):
    chips = self.rollout_chips or self.train_chips
    return max(1, chips // self.rollout_tensor)


# Tokens run ------------------------------------------------------------------------


class Tokens(NamedTuple):
  """Tokens of one pass over a step's B·G sequences (the reference pass, the
  proximal pass, or one epoch of the update)."""

  real: int  # prompt + response tokens of every sequence
  run: int  # tokens the model runs on: rows x their row length
  rows: int  # rows run, over all minibatches
  row_len: int  # tokens per row (the longest, with micro-batches)
  most_rows: int  # rows of the largest minibatch
  micro_batches: int  # forward (and backward) calls, over all minibatches

  @property
  def efficiency(self):
    """Real / run: the packing efficiency (the padding efficiency unpacked)."""
    return self.real / self.run if self.run else 1.0


def tokens_run(workload, lengths=None, shards=1):
  """Real tokens and tokens run by one pass over a step's batch.

  Padded, every row is `seq_len` long. Packed (`workload.packing`), each
  minibatch of `minibatch_rows` consecutive sequences goes into rows of
  `row_len` tokens by first-fit-decreasing, and the row count is
  `row_count(bins, shards, most=minibatch rows)`, as the trainer's packer
  (`jrl.trainers.common.Packer`, `jrl.data.packing.pack_padded`) does it.
  With `micro_batch_tokens`, micro-batches of at most that many tokens per
  shard, the shorter sequences' in shorter rows, each row count rounded by
  `row_count` (`jrl.data.packing.micro_batch_plan`). The trainer shuffles the
  rows into minibatches each epoch; consecutive slices stand in for that.

  Args:
    workload: a Workload.
    lengths: [B·G] response lengths (default: `workload.response_lengths()`);
      each sequence is `prompt_len` + its response.
    shards: batch shards of the training mesh (rows are a multiple of it).

  Returns:
    Tokens.
  """
  w = workload
  lengths = list(w.response_lengths() if lengths is None else lengths)
  if len(lengths) != w.rows:
    raise ValueError(f'{len(lengths)} response lengths for {w.rows} rows (B·G).')
  seqs = tuple(int(w.prompt_len + n) for n in lengths)
  minibatch = w.minibatch_rows or w.rows
  if not w.packing:
    n_mb = -(-w.rows // minibatch)
    return Tokens(sum(seqs), w.rows * w.seq_len, w.rows, w.seq_len, minibatch, n_mb)
  parts = _packed_rows(seqs, w.row_len, minibatch, max(1, int(shards)), w.micro_batch_tokens)
  rows = [sum(r for r, _ in p) for p in parts]
  run = sum(r * length for p in parts for r, length in p)
  n_micro = sum(len(p) for p in parts)
  return Tokens(sum(seqs), run, sum(rows), w.row_len, max(rows), n_micro)


@functools.lru_cache(maxsize=64)
def _packed_rows(seqs, row_len, minibatch, shards, budget):
  """(((rows, row length) of each micro-batch) of each minibatch) for
  sequence lengths `seqs`, micro-batches of `budget` tokens per shard (0: the
  minibatch in one; `jrl.data.packing.micro_batch_plan`); cached, as the
  planner asks the same question for every layout."""
  # Imported here: jrl.data's package init loads the data pipeline (grain).
  from jrl.data import packing

  out = []
  for k in range(0, len(seqs), minibatch):
    mini = seqs[k : k + minibatch]
    if not budget:
      n_bins = len(packing.first_fit_decreasing(mini, row_len))
      out.append(((packing.row_count(n_bins, shards, most=len(mini)), row_len),))
    else:
      plan = packing.micro_batch_plan(mini, row_len, budget, shards)
      out.append(tuple((rows, length) for _, length, rows in plan))
  return tuple(out)
