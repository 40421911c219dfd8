"""Offline preference optimisation: DPO, IPO, hinge (SLiC), SimPO and ORPO.

Pairs (prompt, chosen, rejected) come from a JSONL file (`dpo.train_path`)
or, on the arithmetic task, are made on the fly with a known true preference:
the correct answer is chosen, a corrupted one rejected. Chosen and rejected
rows go through the policy in one [2P, T] forward; the reference model (the
policy after the SFT warm-up) is scored once per step, outside the gradient.

An offline algorithm: `DPO` makes no sampler for training, no reward
workers and no topology. Held-out accuracy is measured with a greedy
sampler of its own, built at the first evaluation.
"""

import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jrl import losses as L
from jrl import parallel
from jrl.data import PromptStream, read_preference_jsonl, tasks
from jrl.trainers import checks, common, controller, setup, sft, signals
from jrl.trainers.evaluation import held_out
from jrl.trainers.rollouts import engines

DPO_LOSSES = ('dpo', 'ipo', 'hinge', 'simpo', 'orpo')
_REFERENCE_FREE = ('simpo', 'orpo')
_AVERAGED = ('ipo', 'simpo', 'orpo')  # these take length-averaged logprobs


class DPOBatch(NamedTuple):
  tokens: jax.Array  # [2P, T]: rows 0..P-1 chosen, P..2P-1 rejected
  mask: jax.Array  # [2P, T] bool
  loss_mask: jax.Array  # [2P, T] bool response tokens
  ref_logp: jax.Array  # [2P] float32 reference sequence logprobs (sum or mean)
  packed: Any = None  # jrl.data.packing.PackedInputs of the rows (`train.packing`), else None


class DPOLossConfig(NamedTuple):
  loss: str = 'dpo'
  beta: float = 0.1
  label_smoothing: float = 0.0
  simpo_gamma: float = 0.5
  chunk_size: int = 1024


def sequence_logprobs(
  graphdef, params, tokens, mask, loss_mask, average, chunk_size=1024, packed=None
):
  """[B] sum (or mean) of the response tokens' logprobs (the model on packed
  rows when `packed` is given; the sums are taken in the padded layout)."""
  logp, _ = common.token_logprobs(graphdef, params, tokens, mask, packed, chunk_size=chunk_size)
  counted = loss_mask.astype(jnp.float32)
  total = jnp.sum(logp * counted, axis=-1)
  return total / jnp.maximum(jnp.sum(counted, axis=-1), 1.0) if average else total


def preference_loss(params, graphdef, batch, dpo_config):
  average = dpo_config.loss in _AVERAGED
  seq = sequence_logprobs(
    graphdef,
    params,
    batch.tokens,
    batch.mask,
    batch.loss_mask,
    average,
    dpo_config.chunk_size,
    batch.packed,
  )
  p = seq.shape[0] // 2
  chosen, rejected = seq[:p], seq[p:]
  ref_c, ref_r = batch.ref_logp[:p], batch.ref_logp[p:]
  if dpo_config.loss == 'dpo':
    loss, metrics = L.dpo_loss(
      chosen,
      rejected,
      ref_c,
      ref_r,
      beta=dpo_config.beta,
      label_smoothing=dpo_config.label_smoothing,
    )
  elif dpo_config.loss == 'ipo':
    loss, metrics = L.ipo_loss(chosen, rejected, ref_c, ref_r, beta=dpo_config.beta)
  elif dpo_config.loss == 'hinge':
    loss, metrics = L.hinge_loss(chosen, rejected, ref_c, ref_r, beta=dpo_config.beta)
  elif dpo_config.loss == 'simpo':
    loss, metrics = L.simpo_loss(
      chosen, rejected, beta=dpo_config.beta, gamma=dpo_config.simpo_gamma
    )
  else:
    loss, metrics = L.orpo_loss(chosen, rejected, lam=dpo_config.beta)
  loss = jnp.mean(loss)
  names = {
    'rewards_chosen': 'rewards/chosen',
    'rewards_rejected': 'rewards/rejected',
    'reward_margin': 'rewards/margins',
    'reward_accuracy': 'rewards/accuracies',
  }
  out = {names.get(k, f'dpo/{k}'): v for k, v in metrics.items()}
  out['logps/chosen'] = jax.lax.stop_gradient(jnp.mean(chosen))
  out['logps/rejected'] = jax.lax.stop_gradient(jnp.mean(rejected))
  return loss, out


def train_step(state, batch, *, graphdef, tx, schedule, dpo_config):
  """One optimiser step on a batch of pairs; non-finite steps are skipped."""
  (loss, metrics), grads = jax.value_and_grad(preference_loss, has_aux=True)(
    state.params, graphdef, batch, dpo_config
  )
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule)
  metrics['dpo/loss'] = loss
  metrics.update({f'dpo/{k}': v for k, v in opt_metrics.items()})
  return state, metrics


def check(config, batch_shards):
  """The `dpo` section between its fields and against the task."""
  d = config.dpo
  if d.loss not in DPO_LOSSES:
    raise ValueError(f'`dpo.loss` must be one of {DPO_LOSSES}, got {d.loss!r}.')
  if not d.train_path and config.task.kind != 'arith':
    raise ValueError('`dpo.train_path` is required unless `task.kind` is "arith".')
  checks.no_micro_batches(config, batch_shards)


# The `dpo` section: the preference loss and its pairs.
SECTION = checks.Section(
  'dpo',
  {
    'dpo.steps': checks.count(0),
    'dpo.beta': checks.positive(),
    'dpo.label_smoothing': checks.Range(False, 0, 0.5, hi_open=True),
    'dpo.simpo_gamma': checks.non_negative(),
    'dpo.pairs_per_step': checks.count(1),
  },
  check,
)
# What a DPO run reads besides the shared sections (the sampler: held-out generation).
SECTIONS = (sft.SECTION, engines.SAMPLER, SECTION)


def pair_source(config, resources):
  """`next_pairs(n, iteration)`: pairs of `dpo.train_path` (a checkpointed
  stream), or arithmetic pairs made from the task stream (the correct answer
  chosen, a near miss rejected)."""
  if config.dpo.train_path:
    pairs = PromptStream(
      read_preference_jsonl(config.dpo.train_path, check=resources.checker.pair),
      seed=setup.seed(config.seed, 'dpo'),
    )
    resources.streams['dpo_stream'] = pairs
    return lambda n, iteration: pairs.next(n)

  def task_pairs(n, iteration):
    examples = resources.streams['rl_stream'].next(n)
    return tasks.arith_pairs(examples, setup.seed(config.seed, iteration, 'corrupt'))

  return task_pairs


class Steps(NamedTuple):
  dpo: Any  # train_step
  reference: Any  # (params, tokens, mask, loss_mask, packed) -> [2P] reference sequence logprobs


def make_steps(config, resources, tx, schedule, shardings):
  d = config.dpo
  dpo_config = DPOLossConfig(
    loss=d.loss,
    beta=d.beta,
    label_smoothing=d.label_smoothing,
    simpo_gamma=d.simpo_gamma,
    chunk_size=config.train.chunk_size,
  )
  graphdef = resources.model.graphdef
  dpo_step = jax.jit(
    functools.partial(
      train_step, graphdef=graphdef, tx=tx, schedule=schedule, dpo_config=dpo_config
    ),
    donate_argnums=(0,),
    out_shardings=shardings,
    compiler_options=resources.train_xla,
  )
  reference = jax.jit(
    functools.partial(
      sequence_logprobs, graphdef, average=d.loss in _AVERAGED, chunk_size=config.train.chunk_size
    ),
    compiler_options=resources.train_xla,
  )
  # Traced under the training mesh (attention kernels per shard, `parallel.on_mesh`).
  return Steps(
    parallel.on_mesh(resources.mesh, dpo_step), parallel.on_mesh(resources.mesh, reference)
  )


class DPO(controller.Job):
  """The job of a DPO-family run: an optional SFT warm-up, then `dpo.steps`
  updates on `dpo.pairs_per_step` pairs each."""

  def __init__(self, config):
    self.config = config
    resources, _ = setup.start(config, SECTIONS)  # first: the checks name a missing section
    self.resources = resources
    self.next_pairs = pair_source(config, resources)
    self.tx, schedule = setup.optimizer(config)
    self.uses_ref = config.dpo.loss not in _REFERENCE_FREE
    sft_tx = setup.sft_optimizer(config)[0]
    self.state = self.new_state(resources.params, sft_tx if config.sft.steps else self.tx)
    self.warmup = sft.Warmup.of(config, resources, self.state)
    shardings = setup.step_shardings(self.state, resources.mesh)
    self.steps = make_steps(config, resources, self.tx, schedule, shardings)
    self.evaluator = held_out.Evaluator(resources)
    self.packer = common.make_packer(config.train, resources.seq_len, resources.batch_sharding)

  def new_state(self, params, tx):
    """The reference is the policy when DPO begins (after the warm-up)."""
    ref = jax.tree.map(jnp.copy, params) if self.uses_ref else None
    extra = common.AlgorithmState(ref_params=ref)
    return setup.new_state(params, tx, self.resources.mesh, extra)

  def start_rl(self, state):
    return self.new_state(state.params, self.tx)

  def iterate(self, state, it):
    if it < self.config.sft.steps:
      return self.warmup.iterate(state, it)
    return self.dpo_iteration(state, it)

  def dpo_iteration(self, state, it):
    """Pairs -> [2P, T] rows -> the reference's sequence logprobs -> one update."""
    resources, d = self.resources, self.config.dpo
    t_step = time.perf_counter()
    pairs = self.next_pairs(d.pairs_per_step, it)
    eos = list(resources.stop_tokens[:1])
    prompts = [resources.encoder.prompt_ids(p['prompt']) for p in pairs]
    chosen = [resources.tokenizer.encode(p['chosen']) + eos for p in pairs]
    rejected = [resources.tokenizer.encode(p['rejected']) + eos for p in pairs]
    batch = common.pack_sequences(
      prompts + prompts, chosen + rejected, resources.seq_len, resources.tokenizer.pad_id
    )
    placed = common.with_packed(common.place(batch, resources.batch_sharding), self.packer)
    start = time.perf_counter()
    if self.uses_ref:
      ref = self.steps.reference(
        state.extra.ref_params,
        placed.tokens,
        placed.mask,
        placed.loss_mask,
        packed=placed.packed,
      )
    else:
      ref = jnp.zeros(placed.tokens.shape[0], jnp.float32)
    jax.block_until_ready(ref)
    t_ref = time.perf_counter() - start
    full = DPOBatch(placed.tokens, placed.mask, placed.loss_mask, ref, placed.packed)
    start = time.perf_counter()
    state, metrics = self.steps.dpo(state, full)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    metrics['time/update'] = time.perf_counter() - start
    metrics['time/reference'] = t_ref
    metrics['time/step'] = time.perf_counter() - t_step
    metrics['phase'] = 1.0
    return state, signals.Report(metrics, signals.skipped(metrics, ('dpo',)))

  def evaluate(self, state):
    return self.evaluator(state)

  def close(self):
    self.evaluator.close()


ALGORITHM = checks.register(
  checks.Algorithm('dpo', DPO, SECTIONS, steps_section='dpo', standalone_eval=True)
)
