"""The update's micro-batch budget and remat policy, chosen from the memory
its compiled program needs (`train.memory_plan = 'auto'`).

What a setting costs in memory is measured, not estimated: each candidate's
update step is lowered and compiled for the largest batch the run can
produce (every sequence at max_prompt_len + max_response_len) and XLA's
memory analysis of it gives the bytes the step allocates beyond the state
that already exists (temporaries and outputs not aliased to donated
inputs; with micro-batches, plus the summed gradients). The limit is
`train.memory_limit_gib`, or 90% of what one device has free when the plan
is made (after the parameters, optimiser state, reference copy and the
sampler's pages are allocated): the accelerator's `bytes_limit` less its
`bytes_in_use`, on the CPU the host's available memory over its local
devices.

Candidates, fastest first (`candidates`), on accelerators:

    remat 'none',  the whole minibatch, then halved micro-batches down to
                   MIN_SHARE of it (smaller ones fill the matmuls too little
                   to beat recomputation);
    remat 'full',  the whole minibatch, halved down to one row.

On the CPU remat 'full' alone: XLA:CPU runs an update that recomputes each
block's activations as fast as one that stores them once these no longer
fit in the caches, and faster when they are large, because every stored
activation is written to and read back from memory, and the host's memory
is also the sampler's and the reward workers' (SmolLM2-135M, 8 prompts x
8 completions of 128 tokens in shared-prompt rows, `launch/bench_layouts.py`
shapes: 40.1 s and 2.6 GiB with 'full' over the whole minibatch, 45.0 s and
10.9 GiB without remat in two micro-batches, the fastest that fits without;
a 20M model: 5.6 s and 1.1 GiB against 5.4 s and 4.0 GiB).

The first that fits is taken; the measurements stop there (one compile when
the whole minibatch fits, none when `upper_bound` of the fastest is at most
half the limit: a small model, where the compile would cost more than any
choice saves, and which runs without remat; on the CPU that also needs the
bound to be at most CPU_SMALL_BYTES, where the activations stay close to
the cores). A field the config sets is kept: an explicit
`model.remat` is the only remat tried, an explicit `train.micro_batch_tokens`
the only budget. When nothing fits, the smallest candidate is taken and the
log says so. The compiled probes are not reused: jit compiles the step again
for the shapes the batches have.
"""

import contextlib
import json
import math
import os
from typing import NamedTuple

import jax
import numpy as np

from jrl import distributed
from jrl.data import layouts
from jrl.trainers import common

# The smallest micro-batch without remat, as a share of the minibatch's tokens.
MIN_SHARE = 1 / 8
# Of a device's free memory, what the plan may use (allocator slack, fragmentation).
FREE_SHARE = 0.9
# On the CPU, the bound under which an update runs without remat uncompiled.
CPU_SMALL_BYTES = 2 * 2**30
GIB = 2**30


class Plan(NamedTuple):
  remat: str  # the update's per-layer remat policy
  budget: int  # micro_batch_tokens per batch shard (0: the whole minibatch)
  need: int  # bytes the chosen step allocates (measured; 0 when not measured)
  limit: int  # bytes it may allocate (0: not planned)
  reason: str  # what was chosen and why, in words
  measured: tuple = ()  # ((remat, budget, bytes), ...) of the candidates compiled

  def describe(self):
    return f'remat={self.remat} micro_batch_tokens={self.budget}: {self.reason}'


def size(n):
  """Bytes in words: '812 KiB', '5.2 GiB'."""
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if n >= scale:
      return f'{n / scale:.3g} {unit}'
  return f'{n} B'


def fixed(remat, budget, reason='train.memory_plan is off'):
  """The config's own settings ('auto' remat without a plan: 'none')."""
  remat = 'none' if remat == 'auto' else remat
  return Plan(remat, int(budget), 0, 0, reason)


def free_bytes(device):
  """Bytes `device` has free now: its allocator's limit less what is in use,
  or on the CPU the host's available memory over its local CPU devices."""
  stats = device.memory_stats() or {}
  if 'bytes_limit' in stats:
    return int(stats['bytes_limit']) - int(stats.get('bytes_in_use', 0))
  with open('/proc/meminfo', encoding='ascii') as f:
    fields = dict(line.split(':', 1) for line in f)
  available = int(fields['MemAvailable'].split()[0]) * 1024
  return available // max(1, len(jax.local_devices(backend=device.platform)))


def remat_order(remat, platform):
  """The remat policies tried for `model.remat`, fastest first on `platform`
  ('auto': 'none' then 'full', on the CPU 'full' alone)."""
  if remat != 'auto':
    return (remat,)
  return ('full',) if platform == 'cpu' else ('none', 'full')


def candidates(remat, budget, whole, row, platform='gpu'):
  """(remat, budget) pairs in the order tried: see the module docstring.

  Args:
    remat: `model.remat` ('auto': by `remat_order`).
    budget: `train.micro_batch_tokens` (0: chosen here).
    whole: tokens of the whole minibatch per batch shard, in rows of `row`.
    row: tokens of one row of the layout (the smallest micro-batch).
    platform: the devices' platform ('cpu', 'gpu', 'tpu').
  """
  remats = remat_order(remat, platform)
  if budget:
    return [(r, int(budget)) for r in remats]
  out = []
  for r in remats:
    floor = row if r != 'none' or len(remats) == 1 else max(row, int(whole * MIN_SHARE))
    b = whole
    while True:
      out.append((r, 0 if b == whole else b))
      if b <= floor:
        break
      b = max(floor, row * math.ceil(b // 2 / row))
  return out


def upper_bound(model_config, num_params, tokens, row, chunk):
  """A generous bound on the bytes an update without remat allocates for
  `tokens` tokens per batch shard in rows of `row` (float32 throughout):
  every layer's activations at 32 x width + 8 x MLP width + the [T, T]
  scores and probabilities of each head per token, 4 chunks of `chunk`
  positions of logits over the vocabulary, and 4 parameter-sized trees
  (gradients and the optimiser's temporaries). Only a screen: a run whose
  bound is far under the limit needs no measurement."""
  c = model_config
  mlp = max(c.mlp_width, c.experts_per_token * c.moe_mlp_width)
  qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
  per_token = c.num_layers * (32 * c.width + 8 * mlp + 4 * qkv + 2 * c.num_heads * row)
  logits = 4 * min(tokens, chunk) * c.vocab_size
  return 4 * (tokens * per_token + logits + 4 * num_params)


def step_bytes(step, state, batch):
  """Bytes one call of an update step allocates beyond its arguments, from
  the compiled program's memory analysis. `step` is a jitted (state, batch)
  -> (state, metrics) or a `common.MicroBatchedStep` (its per-micro-batch
  program, whose gradients are also summed into an accumulator)."""
  mesh = getattr(step, 'mesh', None)  # parallel.on_mesh: lowered under its mesh
  step = getattr(step, 'fn', step)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    if isinstance(step, common.MicroBatchedStep):
      lowered = step.loss_and_grads.lower(state, batch._replace(packed=batch.packed[0]))
      mem = lowered.compile().memory_analysis()
      return mem.temp_size_in_bytes + 2 * mem.output_size_in_bytes
    mem = step.lower(state, batch).compile().memory_analysis()
  return mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes


def choose(options, measure, limit):
  """The first of `options` ((remat, budget) pairs) whose `measure(remat,
  budget)` bytes are at most `limit`, else the last; as a Plan."""
  measured, words = [], []
  for remat, budget in options:
    need = int(measure(remat, budget))
    measured.append((remat, budget, need))
    words.append(f'{remat}/{budget or "whole"} {size(need)}')
    if need <= limit:
      why = 'the fastest candidate' if len(measured) == 1 else 'the fastest that fits'
      reason = f'{why} ({size(need)} of {size(limit)}; measured: {", ".join(words)})'
      return Plan(remat, budget, need, limit, reason, tuple(measured))
  reason = (
    f'nothing fits in {size(limit)} (measured: {", ".join(words)}); taking the '
    'smallest: lower rl.minibatch_size or the task lengths, train LoRA adapters, or '
    'set train.memory_limit_gib'
  )
  return Plan(remat, budget, need, limit, reason, tuple(measured))


def abstract(tree):
  """ShapeDtypeStructs (with shardings) of a tree of arrays: what lowering needs."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def limit_bytes(train, device):
  """What the update may allocate: `train.memory_limit_gib`, or FREE_SHARE of
  `device`'s free memory, the smallest over the processes (so that every
  process makes the same plan)."""
  if train.memory_limit_gib:
    return int(train.memory_limit_gib * GIB)
  kib = int(FREE_SHARE * free_bytes(device)) // 1024
  if jax.process_count() > 1:
    kib = int(distributed.gather_rows(np.asarray([kib], np.int32)).min())
  return kib * 1024


def plan(train, remat, device, whole, row, measure, bound, path=''):
  """The Plan of a run (`train`: the config's train section; `remat`:
  `model.remat`): `train.memory_plan` 'auto' measures the
  candidates with `measure(remat, budget) -> bytes` unless `bound` (bytes,
  `upper_bound` of the first candidate) is at most half the limit; 'off'
  keeps the config's settings.

  With a `path` (the run's memory_plan.json) a single-process run that
  restarts with the same candidates for the same step (its minibatch's
  `whole` tokens in rows of `row`, and `bound`, which also counts the model
  and `train.chunk_size`) keeps the choice its start made, so that a
  resumed run computes what the uninterrupted one would have; the choice is
  written there otherwise. A restart whose step changed (a longer
  `task.max_prompt_len`, another minibatch) plans again. A file written
  before the step was recorded is matched on its candidates alone."""
  options = candidates(remat, train.micro_batch_tokens, whole, row, device.platform)
  if train.memory_plan != 'auto':
    return fixed(remat, train.micro_batch_tokens)
  key = [list(o) for o in options]
  step = {'whole': int(whole), 'row': int(row), 'bound': int(bound)}
  if path and jax.process_count() == 1 and os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      saved = json.load(f)
    if saved.get('options') == key and saved.get('step', step) == step:
      kept = Plan(**{**saved['plan'], 'measured': tuple(map(tuple, saved['plan']['measured']))})
      return kept._replace(reason=f'as the run chose at its start ({path}): {kept.reason}')
  limit = limit_bytes(train, device)
  small = 2 * bound <= limit and (device.platform != 'cpu' or bound <= CPU_SMALL_BYTES)
  if small:
    first, budget = options[0]
    first = 'none' if remat == 'auto' else first
    reason = f'fits by an upper bound ({size(bound)}, at most half of {size(limit)}): not compiled'
    chosen = Plan(first, budget, 0, limit, reason)
  else:
    chosen = choose(options, measure, limit)
  if path and distributed.is_main():
    with open(path, 'w', encoding='utf-8') as f:
      json.dump({'options': key, 'step': step, 'plan': chosen._asdict()}, f, indent=1)
  return chosen


def worst_case_rows(rl, task, seq_len, vocab_size):
  """Host (tokens, mask, loss_mask) [minibatch, seq_len] of the largest
  minibatch a run can produce (`rl`, `task`: the config's sections): every
  sequence max_prompt_len prompt tokens then max_response_len response
  tokens, each group of `rl.group_size` rows sharing its prompt (the memory
  plan's probe)."""
  mb, p = rl.minibatch_size, task.max_prompt_len
  tokens = np.zeros((mb, seq_len), np.int32)
  tokens[:, :p] = 1 + (np.arange(mb) // rl.group_size)[:, None] % (vocab_size - 1)
  mask = np.zeros((mb, seq_len), bool)
  mask[:, : p + task.max_response_len] = True
  loss_mask = mask.copy()
  loss_mask[:, :p] = False
  return tokens, mask, loss_mask


def plan_update(
  resources, state, packer, update, probe_batch, *, train, remat, rl, task, models=1, worker=None
):
  """(Plan, packer): the remat policy and micro-batch budget of an update,
  chosen by `plan` (`train.memory_plan`) before the run's step is made with
  them (`update.jit(plan.budget, plan.remat)`).

  Args:
    resources: setup.Resources (the mesh, the model, the workdir).
    state: the train state the update step takes (only its shapes are read).
    packer: the config's Packer; the returned one has the plan's budget.
    update: the algorithm's common.Update; each candidate is compiled from it.
    probe_batch: (tokens, mask, loss_mask) host [B, T] -> the update's batch
      on the mesh (without `packed`).
    models: how many models of the policy's size the update trains (PPO: 2).
    train, remat, rl, task: the config's `train` section, `model.remat`, and
      the `rl` and `task` sections (the minibatch and the longest sequences).
    worker: the rollout worker, closed (its reward processes stopped) when
      the plan fails.
  """
  sections = dict(train=train, remat=remat, rl=rl, task=task)
  try:
    return _plan_update(resources, state, packer, update, probe_batch, models, **sections)
  except BaseException:
    if worker is not None:
      worker.close()
    raise


def _plan_update(resources, state, packer, update, probe_batch, models, *, train, remat, rl, task):
  shards = common.batch_shards(resources.batch_sharding)
  per_row = rl.group_size if packer.kind == 'shared_prompt' else 1
  if packer.kind == 'shared_prompt':
    row = layouts.shared_row_len(task.max_prompt_len, rl.group_size, task.max_response_len)
  else:
    row = packer.row_len
  whole = math.ceil(rl.minibatch_size / per_row / shards) * row

  def with_budget(budget):
    return common.Packer(packer.row_len, packer.sharding, budget, packer.kind)

  def measure(remat, budget):
    rows = worst_case_rows(rl, task, resources.seq_len, resources.model.config.vocab_size)
    batch = probe_batch(*rows)._replace(packed=with_budget(budget).for_step(*rows))
    return step_bytes(update.jit(budget, remat), abstract(state), batch)

  num_params = sum(x.size for x in jax.tree.leaves(resources.params))
  bound = models * upper_bound(resources.model.config, num_params, whole, row, train.chunk_size)
  path = os.path.join(resources.workdir, 'memory_plan.json')
  device = next(d for d in resources.mesh.devices.flat if d.process_index == jax.process_index())
  chosen = plan(train, remat, device, whole, row, measure, bound, path)
  return chosen, with_budget(chosen.budget)
