"""Supervised fine-tuning: next-token cross-entropy on response tokens."""

import jax

from jrl import losses as L
from jrl import models
from jrl.trainers import common


def sft_loss(params, graphdef, batch, chunk_size=1024):
  """Mean negative log-likelihood of the response tokens of a SequenceBatch."""
  logp, _ = models.next_token_logprobs(
    graphdef, params, batch.tokens, batch.mask, chunk_size=chunk_size
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
