"""Supervised fine-tuning: next-token cross-entropy on response tokens.

`train_step` is the pure update; `warmup` turns it into the iteration of an
SFT phase (the warm-up before GRPO, PPO, DPO and the agent, or the whole
run of `algorithm='sft'`, built by `build(config)`): no sampler
for training, no reward workers, no topology. Held-out accuracy is measured
with a greedy sampler of its own, built at the first evaluation.
"""

import time

import jax
import jax.numpy as jnp

from jrl import distributed
from jrl import losses as L
from jrl.trainers import checks, common, controller, setup, signals
from jrl.trainers.evaluation import held_out
from jrl.trainers.rollouts import engines


def sft_loss(params, graphdef, batch, chunk_size=1024):
  """Mean negative log-likelihood of the response tokens of a SequenceBatch,
  or the share of it that the micro-batch `batch.packed.select` holds (its
  tokens' sum over the whole batch's token count)."""
  logp, _ = common.token_logprobs(
    graphdef, params, batch.tokens, batch.mask, batch.packed, chunk_size=chunk_size
  )
  loss_mask = batch.loss_mask
  _, own_mask = common.held_mask(loss_mask, batch.packed)
  # logp is 0 off the sequences held: their terms are 0.
  loss = -L.token_mean(logp, loss_mask)
  share = jnp.sum(own_mask) / jnp.maximum(jnp.sum(loss_mask), 1)
  return loss, {'sft/nll': jax.lax.stop_gradient(loss), TOKEN_SHARE: share}


TOKEN_SHARE = 'token_share'
ADDITIVE_METRICS = ('sft/nll',)


def loss_and_grads(state, batch, *, graphdef, chunk_size=1024):
  """(loss [], metrics, grads) of `sft_loss` at `state.params`."""
  (loss, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(
    state.params, graphdef, batch, chunk_size
  )
  return loss, metrics, grads


def apply_update(state, grads, loss, metrics, *, tx, schedule, accum=1):
  """The optimiser update of a batch's (summed) gradients and loss."""
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule, accum=accum)
  return state, dict(metrics, **{f'sft/{k}': v for k, v in opt_metrics.items()})


def train_step(state, batch, *, graphdef, tx, schedule, chunk_size=1024, accum=1):
  """One optimiser step of SFT; non-finite steps are skipped.

  Returns:
    (state, metrics).
  """
  loss, metrics, grads = loss_and_grads(state, batch, graphdef=graphdef, chunk_size=chunk_size)
  del metrics[TOKEN_SHARE]
  return apply_update(state, grads, loss, metrics, tx=tx, schedule=schedule, accum=accum)


# The SFT phase -------------------------------------------------------------------


def response_batch(resources, examples, iteration):
  """Rows of prompt + response (or answer) + eos; the loss covers the response."""
  del iteration
  eos = list(resources.stop_tokens[:1])
  prompts = [resources.encoder.prompt_ids(ex['prompt']) for ex in examples]
  responses = [
    resources.tokenizer.encode(str(ex['response'] if 'response' in ex else ex['answer'])) + eos
    for ex in examples
  ]
  return common.pack_sequences(prompts, responses, resources.seq_len, resources.tokenizer.pad_id)


class Warmup:
  """The SFT iteration: `sft_config.batch_size` examples of the SFT stream,
  packed by `make_batch(resources, examples, iteration)`, one update with the
  SFT optimiser (`step`, jitted with the state's layout, the state donated).

  Args:
    resources: setup.Resources (the model, the mesh, the streams).
    state: the train state the step takes (its layout is kept).
    optimiser: (tx, schedule) of the warm-up (`setup.sft_optimizer`).
    sft_config, train_config: the config's `sft` and `train` sections.
    grad_accum: `optim.grad_accum`.
  """

  def __init__(
    self,
    resources,
    state,
    optimiser,
    sft_config,
    train_config,
    grad_accum,
    make_batch=response_batch,
  ):
    self.resources, self.make_batch, self.size = resources, make_batch, sft_config.batch_size
    tx, schedule = optimiser
    self.packer = common.make_packer(train_config, resources.seq_len, resources.batch_sharding)
    self.step = common.Update(
      (train_step, loss_and_grads, apply_update),
      model=dict(graphdef=resources.model.graphdef, chunk_size=train_config.chunk_size),
      optim=dict(tx=tx, schedule=schedule, accum=int(grad_accum)),
      shardings=setup.step_shardings(state, resources.mesh),
      mesh=resources.mesh,
      models={},
      additive=ADDITIVE_METRICS,
      token_share=TOKEN_SHARE,
      compiler_options=resources.train_xla,
    ).jit(self.packer is not None and self.packer.budget)  # micro-batches of a token budget
    self.rows = distributed.local_rows(resources.batch_sharding, self.size)
    self.stream = resources.streams['sft_stream']

  @classmethod
  def of(cls, config, resources, state, make_batch=response_batch):
    """The Warmup of a run's `config`: the SFT optimiser and the sections it reads."""
    optimiser = setup.sft_optimizer(config)
    return cls(
      resources, state, optimiser, config.sft, config.train, config.optim.grad_accum, make_batch
    )

  def iterate(self, state, iteration):
    resources, size = self.resources, self.size
    batch = self.make_batch(resources, self.stream.next(size, self.rows), iteration)
    start = time.perf_counter()
    with resources.tracer.span('sft_update', iteration=iteration):
      placed = common.place_rows(batch, resources.batch_sharding, size)
      state, metrics = self.step(state, common.with_packed(placed, self.packer))
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    metrics['time/update'] = time.perf_counter() - start
    metrics['phase'] = 0.0
    return state, signals.Report(metrics, signals.skipped(metrics, ('sft',)))


# The SFT algorithm ---------------------------------------------------------------


def check(config, batch_shards):
  """The `sft` section's checks between fields and against the mesh."""
  checks.batch_divides(config.sft.batch_size, 'sft.batch_size', batch_shards)


# The `sft` section: the whole run of algorithm 'sft', the warm-up of the others.
SECTION = checks.Section(
  'sft',
  {
    'sft.steps': checks.count(0),
    'sft.batch_size': checks.count(1),
    'sft.lr': checks.positive(),
    'sft.warmup_steps': checks.count(0),
    'sft.examples': checks.count(0),
  },
  check,
)
# What algorithm 'sft' reads besides the shared sections (the sampler: held-out generation).
SECTIONS = (SECTION, engines.SAMPLER)


class SFT(controller.Job):
  """The job of `algorithm='sft'`: `sft.steps` iterations, nothing else."""

  def __init__(self, config):
    self.resources, _ = setup.start(config, SECTIONS)
    tx, _ = setup.sft_optimizer(config)
    self.state = setup.new_state(self.resources.params, tx, self.resources.mesh)
    self.warmup = Warmup.of(config, self.resources, self.state)
    self.evaluator = held_out.Evaluator(self.resources)

  def iterate(self, state, iteration):
    return self.warmup.iterate(state, iteration)

  def evaluate(self, state):
    return self.evaluator(state)

  def close(self):
    self.evaluator.close()


ALGORITHM = checks.register(checks.Algorithm('sft', SFT, SECTIONS, standalone_eval=True))
