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

`policy_loss` and `advantage` are names that `jrl.losses.registry` looks up
(`L.POLICY_LOSSES`, `L.ADVANTAGE_ESTIMATORS`); this module only turns the
config's plain values into those functions' keyword arguments.
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


class PolicyLossConfig(NamedTuple):
  """Plain values, read from `config.rl` at the edge."""

  policy_loss: str = 'ppo'  # one of L.POLICY_LOSSES
  # ((argument, value), ...): keyword arguments of that loss under its own
  # names (`config.rl.loss.<policy_loss>`); None or absent: the loss's default
  loss_args: tuple = ()
  loss_agg: str = 'token-mean'  # one of L.AGGREGATION_MODES
  loss_norm: float | None = None  # seq-mean-token-sum-norm constant (None: L)
  kl_coef: float = 0.0  # KL in the loss (0: off)
  kl_estimator: str = 'k3'  # one of L.KL_ESTIMATORS; 'k3_ratio_corrected' uses old_logp
  kl_input_clamp: float | None = None
  kl_output_clamp: float | None = None
  entropy_coef: float = 0.0
  temperature: float = 1.0  # the sampling temperature
  chunk_size: int = 1024
  off_policy_mask_threshold: float | None = None  # δ of L.off_policy_sequence_mask (None: off)
  router_aux_coef: float = 0.0  # MoE router load-balancing loss in the loss (0: off)


def policy_loss(params, graphdef, batch, policy_config):
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
    temperature=policy_config.temperature,
    chunk_size=policy_config.chunk_size,
    with_entropy=True,
    with_router_loss=bool(policy_config.router_aux_coef),
  )
  return objective(logp, entropy, router[0] if router else None, batch, policy_config)


def objective(logp, entropy, router_loss, batch, policy_config):
  """`policy_loss` from the model's outputs: the policy loss named by
  `policy_config`, the off-policy mask and importance weights, the KL and entropy
  terms, aggregated.

  Args:
    logp, entropy: [B, T] float32 at the sampling temperature.
    router_loss: [] the MoE router's load-balancing loss, or None.
    batch: PolicyBatch; policy_config: PolicyLossConfig.

  Returns:
    (loss [], metrics dict of [] float32).
  """
  stop = jax.lax.stop_gradient
  loss_mask, num_seqs = trained_mask(batch)
  held, own_mask = common.held_mask(loss_mask, batch.packed)
  # Sequences of other micro-batches: the behaviour logprobs stand in for
  # theirs (ratio 1, every term finite), and their terms are zeroed.
  logp = common.only_held(logp, held, stop(batch.old_logp))
  entropy = common.only_held(entropy, held)
  pg, metrics = L.policy_loss_by_name(
    policy_config.policy_loss,
    logp,
    batch.old_logp,
    batch.advantages,
    own_mask,
    dict(policy_config.loss_args),
  )
  if policy_config.off_policy_mask_threshold is not None:
    # DeepSeek-V3.2's off-policy sequence mask, against the behaviour logprobs.
    keep, opsm_metrics = L.off_policy_sequence_mask(
      logp,
      batch.old_logp,
      batch.advantages,
      own_mask,
      threshold=policy_config.off_policy_mask_threshold,
    )
    pg = pg * keep
    metrics.update(opsm_metrics)
  is_weights = getattr(batch, 'is_weights', None)
  if is_weights is not None:
    pg = pg * is_weights
  total = pg
  kl = jnp.zeros_like(pg)
  if policy_config.kl_coef:
    kl = L.kl_penalty(
      logp,
      batch.ref_logp,
      estimator=policy_config.kl_estimator,
      input_clamp=policy_config.kl_input_clamp,
      output_clamp=policy_config.kl_output_clamp,
      mask=own_mask,
      old_logp=batch.old_logp,
    )
    total = total + policy_config.kl_coef * kl
  if policy_config.entropy_coef:
    total = total + policy_config.entropy_coef * L.entropy_loss(entropy, own_mask)
  own = lambda x: common.only_held(x, held)
  agg = dict(loss_norm=policy_config.loss_norm, num_seqs=num_seqs)
  loss = L.aggregate_loss(own(total), loss_mask, policy_config.loss_agg, **agg)
  metrics = {f'actor/{k}': v for k, v in metrics.items()}
  if policy_config.router_aux_coef:
    # A micro-batch's router loss is over its own tokens: weighed by its
    # share of the minibatch's real tokens (exact for one micro-batch).
    real_mask = batch.mask if held is None else batch.mask & held
    real_share = jnp.sum(real_mask) / jnp.maximum(jnp.sum(batch.mask), 1)
    loss = loss + policy_config.router_aux_coef * real_share * router_loss
    metrics['actor/router_loss'] = stop(router_loss)
  metrics['actor/pg_loss'] = L.aggregate_loss(
    own(stop(pg)), loss_mask, policy_config.loss_agg, **agg
  )
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


def train_step(state, batch, *, graphdef, tx, schedule, policy_config, accum=1):
  """One optimiser step on one minibatch; non-finite steps are skipped.

  Args:
    state: common.TrainState.
    batch: PolicyBatch.
    graphdef: the model graph (static).
    tx, schedule: from `make_optimizer`.
    policy_config: PolicyLossConfig.
    accum: gradient-accumulation factor (for the logged learning rate).

  Returns:
    (state, metrics).
  """
  loss, metrics, grads = loss_and_grads(
    state, batch, graphdef=graphdef, policy_config=policy_config
  )
  del metrics[TOKEN_SHARE]
  return apply_update(state, grads, loss, metrics, tx=tx, schedule=schedule, accum=accum)


def loss_and_grads(state, batch, *, graphdef, policy_config):
  """(loss [], metrics, grads) of `policy_loss` at `state.params` on one
  (micro-)batch."""
  (loss, metrics), grads = jax.value_and_grad(policy_loss, has_aux=True)(
    state.params, graphdef, batch, policy_config
  )
  metrics['actor/loss'] = loss
  return loss, metrics, grads


def apply_update(state, grads, loss, metrics, *, tx, schedule, accum=1):
  """The optimiser update of a minibatch's (summed) gradients and loss."""
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule, accum=accum)
  metrics = dict(metrics, **{f'actor/{k}': v for k, v in opt_metrics.items()})
  return state, metrics


# Advantages ------------------------------------------------------------------


class AdvantageConfig(NamedTuple):
  estimator: str = 'grpo'  # one of L.ADVANTAGE_ESTIMATORS
  # ((argument, value), ...): keyword arguments of that estimator under its
  # own names (`config.rl.adv.<estimator>`); absent: the estimator's default
  args: tuple = ()
  kl_coef_in_reward: float = 0.0  # β of a KL penalty folded into the reward


def advantages(rewards_B, loss_mask_BxT, group_size, adv_config, kl_BxT=None, valid_B=None):
  """Per-token advantages [B, T] of one rollout batch (`L.token_advantages_by_name`).

  Outcome estimators (grpo, dr_grpo, rloo, loo) give each response token its
  sequence's advantage; REINFORCE++ variants use per-token returns with the
  KL penalty (β = `kl_coef_in_reward`) in the reward. Rows that `valid_B`
  ([B] bool, None: all) leaves out get 0 and count in no group or batch
  statistic.
  """
  args = {**dict(adv_config.args), 'kl_coef': adv_config.kl_coef_in_reward}
  return L.token_advantages_by_name(
    adv_config.estimator,
    rewards_B,
    loss_mask_BxT,
    group_size,
    args,
    kl=kl_BxT,
    valid=valid_B,
    field='rl.advantage',
  )


# From the config ------------------------------------------------------------


def settings(section):
  """((argument, value), ...) of a `config.rl.loss.<name>` / `rl.adv.<name>`
  section, sorted: hashable, for the static step arguments."""
  return tuple(sorted(section.items()))


def loss_config(rl, chunk_size=1024, temperature=1.0):
  """The PolicyLossConfig of a config's `rl` section (`chunk_size`:
  `train.chunk_size`; `temperature`: `sampling.temperature`, the logprobs'."""
  return PolicyLossConfig(
    policy_loss=rl.policy_loss,
    loss_args=settings(rl.loss[rl.policy_loss]),
    loss_agg=rl.loss_agg,
    loss_norm=rl.loss_norm,
    kl_coef=rl.kl_coef if rl.kl_in == 'loss' else 0.0,
    kl_estimator=rl.kl_estimator,
    kl_input_clamp=rl.kl_input_clamp,
    kl_output_clamp=rl.kl_output_clamp,
    entropy_coef=rl.entropy_coef,
    temperature=temperature,
    chunk_size=chunk_size,
    off_policy_mask_threshold=rl.off_policy_mask_threshold,
    router_aux_coef=rl.router_aux_coef,
  )


def advantage_config(rl):
  """The AdvantageConfig of a config's `rl` section."""
  return AdvantageConfig(
    estimator=rl.advantage,
    args=settings(rl.adv[rl.advantage]),
    kl_coef_in_reward=rl.kl_coef if rl.kl_in == 'reward' else 0.0,
  )
