"""Bytes per device: training state, activations, the sampler's KV pool."""

import math

from jrl.costmodel.model import kv_bytes_per_token
from jrl.costmodel.workload import tokens_run


def memory(model, workload, layout, lengths=None):
  """Bytes per device of each part, for the training and the rollout chips.

  Training state is fully sharded (FSDP x tensor) over the training chips:
  parameters in `param_bytes`, float32 gradients, AdamW's two float32
  moments, a reference copy when `workload.reference`. Activations are those
  of one micro-batch kept for the backward pass, plus one chunk of float32
  logits, for one micro-batch per batch shard (`micro_batch`: padded rows
  of `seq_len`, or packed rows of at most `row_len` within `micro_batch_tokens`).
  The KV pool holds every slot's worst case
  (shared prompt pages once per group, as `jrl.sampler.pages_needed`), split
  over the rollout tensor degree; with separate rollout chips they also
  hold the weights in `compute_bytes`. On shared chips the sampler reads a
  copy of the weights with one-step-off (sharded as the trainer's) or with
  `decode_weights='gathered'` (whole on each batch shard, split over tensor).

  Returns:
    {'train': {part: bytes, 'total': bytes}, 'rollout': {...}}.
  """
  w, lay = workload, layout
  p = model.num_params()
  shards = lay.train_chips
  train = {
    'params': p * w.param_bytes / shards,
    'grads': p * 4 / shards,
    'optimizer': 2 * p * 4 / shards,
  }
  if w.reference:
    train['reference'] = p * w.param_bytes / shards
  rows, row_len = micro_batch(workload, layout, lengths)
  q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
  mlp = sum(
    3 * model.experts_per_token * model.moe_mlp_width if model.is_moe(i) else 3 * model.mlp_width
    for i in range(model.num_layers)
  )
  per_token = model.num_layers * (4 * model.width + 2 * q + 2 * kv) + mlp
  train['activations'] = rows * row_len * per_token * w.compute_bytes / lay.tensor
  train['logits_chunk'] = rows * min(row_len, 1024) * model.vocab_size * 4 / lay.tensor
  rollout = {'kv_cache': kv_pool_bytes(model, workload) / lay.rollout_tensor}
  # Rollouts generated ahead hold the parameters of every version in flight.
  copies = max(1, lay.staleness) if lay.topology == 'async' else 1
  if lay.separate:
    rollout['weights'] = copies * p * w.compute_bytes / lay.rollout_tensor
  elif lay.decode_copy:
    train['rollout_weights'] = copies * p * w.param_bytes / lay.tensor  # gathered decode copies
  elif lay.topology in ('one_step_off', 'async'):
    train['rollout_weights'] = copies * p * w.param_bytes / shards  # the copies generation reads
  if not lay.separate:
    train.update(rollout)
    rollout = dict(train)
  train['total'] = sum(v for k, v in train.items() if k != 'total')
  rollout['total'] = sum(v for k, v in rollout.items() if k != 'total')
  return {'train': train, 'rollout': rollout}


def micro_batch(workload, layout, lengths=None):
  """(rows, row_len) of one forward/backward micro-batch on one batch shard.

  Padded: `micro_rows` (default the minibatch) over the batch shards. Packed:
  the micro-batch's share of the largest minibatch's packed rows (`tokens_run`),
  over the batch shards, and at most `micro_batch_tokens` when set.
  """
  w, lay = workload, layout
  minibatch = w.minibatch_rows or w.rows
  micro = lay.micro_rows or minibatch
  if not w.packing:
    return max(1, micro // lay.batch_shards), w.seq_len
  tok = tokens_run(w, lengths, lay.batch_shards)
  packed = math.ceil(tok.most_rows * min(micro, minibatch) / minibatch)
  rows = math.ceil(packed / lay.batch_shards)
  if w.micro_batch_tokens:
    rows = min(rows, w.micro_batch_tokens // w.row_len)
  return max(1, rows), w.row_len


def kv_pages(workload):
  """Pages of the sampler's pool (as `jrl.sampler.pool_pages`): every group in
  flight at its worst case over prompt lengths, plus the scratch page."""
  w = workload

  def per_group(n):
    n_full = n // w.page_size
    return n_full + w.group_size * (math.ceil((n + w.response_max - 1) / w.page_size) - n_full)

  worst = max(per_group(n) for n in range(1, (w.max_prompt_len or w.prompt_len) + 1))
  return 1 + worst * max(1, w.num_slots // w.group_size)


def kv_pool_bytes(model, workload):
  return kv_pages(workload) * workload.page_size * kv_bytes_per_token(model, workload.compute_bytes)
