"""The policy update of the GRPO family (GRPO, Dr.GRPO, DAPO, GSPO, CISPO,
RLOO, REINFORCE++): one pure `train_step(state, batch) -> (state, metrics)`.

Rows are prompt + response sequences [B, T]; the loss covers response
tokens only (`loss_mask`), of the rows that `valid` keeps (a completion
whose reward could not be computed is left out: `reward.unscored`).
`old_logp` are the behaviour policy's logprobs of those tokens (the
sampler's, which equal the trainer's for the colocated sampler), `ref_logp`
the reference model's (unused when `kl_coef` is 0), and `advantages` are
per token, computed once per rollout by `advantages`.

    ℓ_t = policy_loss(logp, old_logp, A) + β · KL_t(π ‖ π_ref) − c_H · H_t
    L   = aggregate(ℓ, loss_mask, loss_agg)

The terms are `jrl.losses.token_loss` of the run's `jrl.losses.Objective`,
which `objective_of(config.rl)` builds once from the config (its kernels'
arguments checked there); this module adds what the trainer has and the
losses do not: micro-batches, unscored rows, the MoE router's loss.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jrl import losses as L
from jrl.trainers import common


class PolicyBatch(NamedTuple):
  tokens: jax.Array  # [B, T] int32
  mask: jax.Array  # [B, T] bool real tokens
  loss_mask: jax.Array  # [B, T] bool response tokens
  old_logp: jax.Array  # [B, T] float32 behaviour logprobs (0 off the response)
  ref_logp: jax.Array  # [B, T] float32 reference logprobs (0 when unused)
  advantages: jax.Array  # [B, T] float32
  # [B, T] float32 importance weights for a stale behaviour policy (one-step-off);
  # None: on-policy.
  is_weights: jax.Array | None = None
  # jrl.data.packing.PackedInputs of tokens/mask: the model runs on packed
  # rows (`train.packing`); None: on the padded rows.
  packed: Any = None
  # [B] bool: the rows trained on; the others (unscored completions) are in
  # no term of the loss and no count that normalises it. None: every row.
  # Kept apart from `loss_mask`, which also lays the rows out (where prompts end).
  valid: jax.Array | None = None


class StepConfig(NamedTuple):
  """What the update's loss needs besides the batch: the objective (a
  `jrl.losses.Objective`, from `config.rl` by `objective_of`) and how the
  model's logprobs are computed. Hashable: a static argument of the step."""

  objective: L.Objective = L.Objective()
  temperature: float = 1.0  # the sampling temperature
  chunk_size: int = 1024  # train.chunk_size
  router_aux_coef: float = 0.0  # MoE router load-balancing loss in the loss (0: off)


def policy_loss(params, graphdef, batch, step_config):
  """Scalar loss and metrics for one minibatch, or for the micro-batch of it
  that `batch.packed.select` holds.

  A micro-batch's loss is its share of the minibatch's: its per-token terms
  aggregated with the whole minibatch's normaliser (token count, sequence
  count), so the losses and gradients of a minibatch's micro-batches sum to
  the minibatch's. Its metrics are means over its own tokens, with
  `token_share` (its response tokens / the minibatch's) to weigh them.

  Returns:
    (loss [], metrics dict of [] float32).
  """
  logp, entropy, *router = common.token_logprobs(
    graphdef,
    params,
    batch.tokens,
    batch.mask,
    batch.packed,
    temperature=step_config.temperature,
    chunk_size=step_config.chunk_size,
    with_entropy=True,
    with_router_loss=bool(step_config.router_aux_coef),
  )
  return objective(logp, entropy, router[0] if router else None, batch, step_config)


def objective(logp, entropy, router_loss, batch, step_config):
  """`policy_loss` from the model's outputs: the policy loss named by
  `step_config`, the off-policy mask and importance weights, the KL and entropy
  terms, aggregated.

  Args:
    logp, entropy: [B, T] float32 at the sampling temperature.
    router_loss: [] the MoE router's load-balancing loss, or None.
    batch: PolicyBatch; step_config: StepConfig.

  Returns:
    (loss [], metrics dict of [] float32).
  """
  stop = jax.lax.stop_gradient
  obj = step_config.objective
  loss_mask, num_seqs = trained_mask(batch)
  held, own_mask = common.held_mask(loss_mask, batch.packed)
  # Sequences of other micro-batches: the behaviour logprobs stand in for
  # theirs (ratio 1, every term finite), and their terms are zeroed.
  logp = common.only_held(logp, held, stop(batch.old_logp))
  entropy = common.only_held(entropy, held)
  total, pg, kl, metrics = L.token_loss(
    obj,
    logp,
    batch.old_logp,
    batch.advantages,
    own_mask,
    ref_logp=batch.ref_logp,
    entropy=entropy,
    is_weights=getattr(batch, 'is_weights', None),
  )
  own = lambda x: common.only_held(x, held)
  loss = obj.aggregate(own(total), loss_mask, num_seqs=num_seqs)
  metrics = {f'actor/{k}': v for k, v in metrics.items()}
  if step_config.router_aux_coef:
    # A micro-batch's router loss is over its own tokens: weighed by its
    # share of the minibatch's real tokens (exact for one micro-batch).
    real_mask = batch.mask if held is None else batch.mask & held
    real_share = jnp.sum(real_mask) / jnp.maximum(jnp.sum(batch.mask), 1)
    loss = loss + step_config.router_aux_coef * real_share * router_loss
    metrics['actor/router_loss'] = stop(router_loss)
  metrics['actor/pg_loss'] = obj.aggregate(own(stop(pg)), loss_mask, num_seqs=num_seqs)
  metrics['actor/kl_ref'] = L.token_mean(stop(kl), own_mask)
  metrics['actor/entropy'] = L.token_mean(stop(entropy), own_mask)
  # Before any update this is the sampler-vs-trainer logprob difference.
  metrics['actor/logp_diff_abs'] = L.token_mean(stop(jnp.abs(logp - batch.old_logp)), own_mask)
  metrics[TOKEN_SHARE] = jnp.sum(own_mask) / jnp.maximum(jnp.sum(loss_mask), 1)
  return loss, metrics


def trained_mask(batch):
  """(loss mask [B, T] of the rows trained on, their count or None): the
  batch's `loss_mask` without the rows `batch.valid` leaves out, and the
  number of rows kept (at least 1), which the 'seq-mean-*' aggregations
  divide by instead of B. Without `valid`: (loss_mask, None)."""
  valid = getattr(batch, 'valid', None)
  if valid is None:
    return batch.loss_mask, None
  mask = L.valid_token_mask(batch.loss_mask, valid)
  return mask, jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)


# Keys of the metrics that micro-batches add up (shares of the minibatch's
# value); `token_share` weighs the others, and maxima take the largest.
TOKEN_SHARE = 'token_share'
ADDITIVE_METRICS = ('actor/loss', 'actor/pg_loss')


def train_step(state, batch, *, graphdef, tx, schedule, step_config, accum=1):
  """One optimiser step on one minibatch; non-finite steps are skipped.

  Args:
    state: common.TrainState.
    batch: PolicyBatch.
    graphdef: the model graph (static).
    tx, schedule: from `make_optimizer`.
    step_config: StepConfig.
    accum: gradient-accumulation factor (for the logged learning rate).

  Returns:
    (state, metrics).
  """
  loss, metrics, grads = loss_and_grads(state, batch, graphdef=graphdef, step_config=step_config)
  del metrics[TOKEN_SHARE]
  return apply_update(state, grads, loss, metrics, tx=tx, schedule=schedule, accum=accum)


def loss_and_grads(state, batch, *, graphdef, step_config):
  """(loss [], metrics, grads) of `policy_loss` at `state.params` on one
  (micro-)batch."""
  (loss, metrics), grads = jax.value_and_grad(policy_loss, has_aux=True)(
    state.params, graphdef, batch, step_config
  )
  metrics['actor/loss'] = loss
  return loss, metrics, grads


def apply_update(state, grads, loss, metrics, *, tx, schedule, accum=1):
  """The optimiser update of a minibatch's (summed) gradients and loss."""
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule, accum=accum)
  metrics = dict(metrics, **{f'actor/{k}': v for k, v in opt_metrics.items()})
  return state, metrics


# Advantages ------------------------------------------------------------------


def advantages(rewards_B, loss_mask_BxT, group_size, estimator, kl_BxT=None, valid_B=None):
  """Per-token advantages [B, T] of one rollout batch from `estimator` (a
  `jrl.losses.Advantage`, `StepConfig.objective.advantage`).

  Outcome estimators (grpo, dr_grpo, rloo, loo) give each response token its
  sequence's advantage; REINFORCE++ variants use per-token returns with the
  KL penalty `kl_BxT` (β: the estimator's `kl_coef`, the run's when
  `rl.kl_in` is 'reward') in the reward. Rows that `valid_B` ([B] bool,
  None: all) leaves out get 0 and count in no group or batch statistic.
  """
  return estimator(rewards_B, loss_mask_BxT, group_size, kl=kl_BxT, valid=valid_B)


# From the config ------------------------------------------------------------


def objective_of(rl):
  """The `jrl.losses.Objective` of a config's `rl` section: the policy loss
  `rl.policy_loss` with the arguments of its section `rl.loss.<name>`, the
  estimator `rl.advantage` with `rl.adv.<name>`, and the rest of the loss.
  Every value that is a kernel's argument is checked here by the kernel's
  own checks (`PolicyLoss.make`, `Advantage.make`, `Objective.check`); a
  ValueError names the field (`rl.loss.ppo.eps_high`, `rl.kl.input_clamp`)."""
  kl_in_loss = rl.kl_in == 'loss'
  adv_args = dict(rl.adv.get(rl.advantage) or {})  # an unknown name: `make` names the field
  if not kl_in_loss and 'kl_coef' in L.ADVANTAGE_ARGS.get(rl.advantage, ()):
    adv_args['kl_coef'] = rl.kl_coef  # REINFORCE++: β · KL in the reward
  return L.Objective(
    policy=L.PolicyLoss.make(rl.policy_loss, dict(rl.loss.get(rl.policy_loss) or {})),
    advantage=L.Advantage.make(rl.advantage, adv_args),
    loss_agg=rl.reduction.mode,
    loss_norm=rl.reduction.loss_norm,
    kl_coef=rl.kl_coef if kl_in_loss else 0.0,
    kl_estimator=rl.kl.estimator,
    kl_input_clamp=rl.kl.input_clamp,
    kl_output_clamp=rl.kl.output_clamp,
    entropy_coef=rl.entropy_coef,
    off_policy_mask_threshold=rl.off_policy_mask_threshold,
  ).check('rl')


def step_config(rl, chunk_size=1024, temperature=1.0):
  """The StepConfig of a config's `rl` section (`chunk_size`:
  `train.chunk_size`; `temperature`: `sampling.temperature`, the logprobs')."""
  return StepConfig(
    objective=objective_of(rl),
    temperature=temperature,
    chunk_size=chunk_size,
    router_aux_coef=rl.router_aux_coef,
  )
