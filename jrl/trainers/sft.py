"""Supervised fine-tuning: next-token cross-entropy on response tokens.

`train_step` is the pure update; `warmup` turns it into the iteration of an
SFT phase (the warm-up before GRPO, PPO, DPO and the agent, or the whole
run of `algorithm='sft'`); `run(config)` is the SFT algorithm: no sampler
for training, no reward workers, no topology. Held-out accuracy is measured
with a greedy sampler of its own, built at the first evaluation.
"""

import functools
import time
from typing import Any, NamedTuple

import jax

from jrl import distributed
from jrl import losses as L
from jrl.trainers import common, controller, rollout, setup


def sft_loss(params, graphdef, batch, chunk_size=1024):
  """Mean negative log-likelihood of the response tokens of a SequenceBatch."""
  logp, _ = common.token_logprobs(
    graphdef, params, batch.tokens, batch.mask, batch.packed, chunk_size=chunk_size
  )
  loss = -L.token_mean(logp, batch.loss_mask)
  return loss, {'sft/nll': jax.lax.stop_gradient(loss)}


def train_step(state, batch, *, graphdef, tx, schedule, chunk_size=1024, accum=1):
  """One optimiser step of SFT; non-finite steps are skipped.

  Returns:
    (state, metrics).
  """
  (loss, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(
    state.params, graphdef, batch, chunk_size
  )
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule, accum=accum)
  metrics.update({f'sft/{k}': v for k, v in opt_metrics.items()})
  return state, metrics


# The SFT phase -------------------------------------------------------------------


def response_batch(res, examples, iteration):
  """Rows of prompt + response (or answer) + eos; the loss covers the response."""
  del iteration
  eos = list(res.stop_tokens[:1])
  prompts = [res.encoder.prompt_ids(ex['prompt']) for ex in examples]
  responses = [
    res.tokenizer.encode(str(ex['response'] if 'response' in ex else ex['answer'])) + eos
    for ex in examples
  ]
  return common.pack_sequences(prompts, responses, res.seq_len, res.tokenizer.pad_id)


class Warmup(NamedTuple):
  step: Any  # the jitted train_step
  iterate: Any  # (state, iteration) -> (state, metrics)


def warmup(res, state, make_batch=response_batch):
  """The SFT iteration: `sft.batch_size` examples of the SFT stream, packed by
  `make_batch(res, examples, iteration)`, one update with the SFT optimiser."""
  config = res.config
  tx, schedule = setup.sft_optimizer(config)
  step = jax.jit(
    functools.partial(
      train_step,
      graphdef=res.model.graphdef,
      tx=tx,
      schedule=schedule,
      chunk_size=config.rl.chunk_size,
      accum=int(config.optim.grad_accum),
    ),
    donate_argnums=(0,),
    out_shardings=setup.step_shardings(state, res.mesh),
  )
  size = config.sft.batch_size
  rows = distributed.local_rows(res.batch_sharding, size)
  stream = res.streams['sft_stream']
  packer = common.make_packer(config.rl, res.seq_len, res.batch_sharding)

  def iterate(state, iteration):
    batch = make_batch(res, stream.next(size, rows), iteration)
    start = time.perf_counter()
    with res.tracer.span('sft_update', iteration=iteration):
      placed = common.place_rows(batch, res.batch_sharding, size)
      state, m = step(state, common.with_packed(placed, packer))
      m = {k: float(v) for k, v in jax.device_get(m).items()}
    m['time/update'] = time.perf_counter() - start
    m['phase'] = 0.0
    return state, m

  return Warmup(step, iterate)


# The SFT algorithm ---------------------------------------------------------------


def build(config):
  """The job of `algorithm='sft'`: `sft.steps` iterations, nothing else."""
  if config.rl.steps:
    raise ValueError(
      f'`rl.steps` must be 0 for algorithm "sft" (got {config.rl.steps}); '
      'an SFT warm-up before RL is `sft.steps` with algorithm "grpo".'
    )
  res, _ = setup.start(config)
  tx, _ = setup.sft_optimizer(config)
  state = setup.new_state(res.params, tx, res.mesh)
  phase = warmup(res, state)
  evaluate, close = rollout.held_out_evaluator(res)
  return controller.Job(res, state, phase.iterate, evaluate, close=close, steps=phase)


def run(config):
  return controller.train(build(config))
