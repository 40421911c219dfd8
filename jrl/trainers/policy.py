"""The policy update of the GRPO family (GRPO, Dr.GRPO, DAPO, GSPO, CISPO,
RLOO, REINFORCE++): one pure `train_step(state, batch) -> (state, metrics)`.

Rows are prompt + response sequences [B, T]; the loss covers response
tokens only (`loss_mask`). `old_logp` are the behaviour policy's logprobs of
those tokens (the sampler's, which equal the trainer's for the colocated
sampler), `ref_logp` the reference model's (unused when `kl_coef` is 0), and
`advantages` are per token, computed once per rollout by `advantages`.

    ℓ_t = policy_loss(logp, old_logp, A) + β · KL_t(π ‖ π_ref) − c_H · H_t
    L   = aggregate(ℓ, loss_mask, loss_agg)
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl import losses as L
from jrl import models
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


class PolicyLossConfig(NamedTuple):
  """Plain values, read from `config.rl` at the edge."""

  policy_loss: str = 'ppo'  # one of POLICY_LOSSES
  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip_c: float | None = None
  log_ratio_clamp: float | None = None
  loss_agg: str = 'token-mean'
  loss_norm: float | None = None  # seq-mean-token-sum-norm constant (None: L)
  kl_coef: float = 0.0  # KL in the loss (0: off)
  kl_estimator: str = 'k3'  # one of L.KL_ESTIMATORS; 'k3_ratio_corrected' uses old_logp
  kl_input_clamp: float | None = None
  kl_output_clamp: float | None = None
  entropy_coef: float = 0.0
  temperature: float = 1.0  # the sampling temperature
  chunk_size: int = 1024
  sapo_tau_pos: float = 1.0  # SAPO gate temperature for A > 0 (TRL default)
  sapo_tau_neg: float = 1.05  # SAPO gate temperature for A <= 0 (TRL default)
  vespo_k_pos: float = 2.0  # VESPO kernel exponent for A >= 0 (TRL default)
  vespo_lambda_pos: float = 3.0  # VESPO kernel decay for A >= 0
  vespo_k_neg: float = 3.0  # VESPO kernel exponent for A < 0
  vespo_lambda_neg: float = 2.0  # VESPO kernel decay for A < 0
  off_policy_mask_threshold: float | None = None  # δ of L.off_policy_sequence_mask (None: off)


POLICY_LOSSES = ('ppo', 'gspo', 'cispo', 'sapo', 'vespo')


def policy_loss(params, graphdef, batch, cfg):
  """Scalar loss and metrics for one minibatch.

  Returns:
    (loss [], metrics dict of [] float32).
  """
  logp, entropy = models.next_token_logprobs(
    graphdef,
    params,
    batch.tokens,
    batch.mask,
    temperature=cfg.temperature,
    chunk_size=cfg.chunk_size,
    with_entropy=True,
  )
  m = batch.loss_mask
  if cfg.policy_loss == 'ppo':
    pg, metrics = L.ppo_clip_loss(
      logp,
      batch.old_logp,
      batch.advantages,
      m,
      eps_low=cfg.eps_low,
      eps_high=cfg.eps_high,
      dual_clip_c=cfg.dual_clip_c,
      log_ratio_clamp=cfg.log_ratio_clamp,
    )
  elif cfg.policy_loss == 'gspo':
    pg, metrics = L.gspo_loss(
      logp, batch.old_logp, batch.advantages, m, eps_low=cfg.eps_low, eps_high=cfg.eps_high
    )
  elif cfg.policy_loss == 'cispo':
    pg, metrics = L.cispo_loss(logp, batch.old_logp, batch.advantages, m, eps_high=cfg.eps_high)
  elif cfg.policy_loss == 'sapo':
    clamp = {} if cfg.log_ratio_clamp is None else {'log_ratio_clamp': cfg.log_ratio_clamp}
    pg, metrics = L.sapo_loss(
      logp,
      batch.old_logp,
      batch.advantages,
      m,
      tau_pos=cfg.sapo_tau_pos,
      tau_neg=cfg.sapo_tau_neg,
      **clamp,
    )
  elif cfg.policy_loss == 'vespo':
    pg, metrics = L.vespo_loss(
      logp,
      batch.old_logp,
      batch.advantages,
      m,
      k_pos=cfg.vespo_k_pos,
      lambda_pos=cfg.vespo_lambda_pos,
      k_neg=cfg.vespo_k_neg,
      lambda_neg=cfg.vespo_lambda_neg,
    )
  else:
    raise ValueError(f'`policy_loss` must be one of {POLICY_LOSSES}, got {cfg.policy_loss!r}.')
  if cfg.off_policy_mask_threshold is not None:
    # DeepSeek-V3.2's off-policy sequence mask, against the behaviour logprobs.
    keep, opsm_metrics = L.off_policy_sequence_mask(
      logp, batch.old_logp, batch.advantages, m, threshold=cfg.off_policy_mask_threshold
    )
    pg = pg * keep
    metrics.update(opsm_metrics)
  is_weights = getattr(batch, 'is_weights', None)
  if is_weights is not None:
    pg = pg * is_weights
  total = pg
  kl = jnp.zeros_like(pg)
  if cfg.kl_coef:
    kl = L.kl_penalty(
      logp,
      batch.ref_logp,
      estimator=cfg.kl_estimator,
      input_clamp=cfg.kl_input_clamp,
      output_clamp=cfg.kl_output_clamp,
      mask=m,
      old_logp=batch.old_logp,
    )
    total = total + cfg.kl_coef * kl
  if cfg.entropy_coef:
    total = total + cfg.entropy_coef * L.entropy_loss(entropy, m)
  agg = {}
  if cfg.loss_agg == 'seq-mean-token-sum-norm':
    agg['norm'] = cfg.loss_norm or batch.tokens.shape[1]
  loss = L.aggregate(total, m, cfg.loss_agg, **agg)
  stop = jax.lax.stop_gradient
  metrics = {f'actor/{k}': v for k, v in metrics.items()}
  metrics['actor/pg_loss'] = L.aggregate(stop(pg), m, cfg.loss_agg, **agg)
  metrics['actor/kl_ref'] = L.token_mean(stop(kl), m)
  metrics['actor/entropy'] = L.token_mean(stop(entropy), m)
  # Before any update this is the sampler-vs-trainer logprob difference.
  metrics['actor/logp_diff_abs'] = L.token_mean(stop(jnp.abs(logp - batch.old_logp)), m)
  return loss, metrics


def train_step(state, batch, *, graphdef, tx, schedule, cfg, accum=1):
  """One optimiser step on one minibatch; non-finite steps are skipped.

  Args:
    state: common.TrainState.
    batch: PolicyBatch.
    graphdef: the model graph (static).
    tx, schedule: from `make_optimizer`.
    cfg: PolicyLossConfig.
    accum: gradient-accumulation factor (for the logged learning rate).

  Returns:
    (state, metrics).
  """
  (loss, metrics), grads = jax.value_and_grad(policy_loss, has_aux=True)(
    state.params, graphdef, batch, cfg
  )
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule, accum=accum)
  metrics['actor/loss'] = loss
  metrics.update({f'actor/{k}': v for k, v in opt_metrics.items()})
  return state, metrics


# Advantages ------------------------------------------------------------------


class AdvantageConfig(NamedTuple):
  estimator: str = 'grpo'  # grpo | dr_grpo | rloo | loo | reinforce_pp | reinforce_pp_baseline
  scale: str = 'group'  # grpo: 'group' | 'batch' | 'none'
  std: str = 'unbiased'
  eps: float = 1e-6
  gamma: float = 1.0  # REINFORCE++ discount
  kl_coef_in_reward: float = 0.0  # β of a KL penalty folded into the reward


ESTIMATORS = ('grpo', 'dr_grpo', 'rloo', 'loo', 'reinforce_pp', 'reinforce_pp_baseline')


def advantages(rewards_B, loss_mask_BxT, group_size, cfg, kl_BxT=None):
  """Per-token advantages [B, T] of one rollout batch.

  Outcome estimators (grpo, dr_grpo, rloo, loo) give each response token its
  sequence's advantage; REINFORCE++ variants use per-token returns with the
  KL penalty (β = `kl_coef_in_reward`) in the reward.
  """
  m = loss_mask_BxT
  if cfg.estimator == 'grpo':
    adv = L.grpo_advantages(rewards_B, group_size, scale=cfg.scale, std=cfg.std, eps=cfg.eps)
  elif cfg.estimator == 'dr_grpo':
    adv = L.dr_grpo_advantages(rewards_B, group_size)
  elif cfg.estimator == 'rloo':
    adv = L.rloo_advantages(rewards_B, group_size)
  elif cfg.estimator == 'loo':
    adv = L.loo_advantages(rewards_B, group_size, eps=cfg.eps)
  elif cfg.estimator == 'reinforce_pp':
    tok = L.token_level_rewards(rewards_B, m, kl=kl_BxT, kl_coef=cfg.kl_coef_in_reward)
    return L.reinforce_pp_advantages(tok, m, gamma=cfg.gamma)
  elif cfg.estimator == 'reinforce_pp_baseline':
    return L.reinforce_pp_baseline_advantages(
      rewards_B, m, group_size, kl=kl_BxT, kl_coef=cfg.kl_coef_in_reward, gamma=cfg.gamma
    )
  else:
    raise ValueError(f'`rl.advantage` must be one of {ESTIMATORS}, got {cfg.estimator!r}.')
  return L.broadcast_to_tokens(adv, m)


# From the config ------------------------------------------------------------


def loss_config(rl):
  """The PolicyLossConfig of a config's `rl` section."""
  return PolicyLossConfig(
    policy_loss=rl.policy_loss,
    eps_low=rl.eps_low,
    eps_high=rl.eps_high,
    dual_clip_c=rl.dual_clip_c or None,
    log_ratio_clamp=rl.log_ratio_clamp or None,
    loss_agg=rl.loss_agg,
    loss_norm=rl.loss_norm or None,
    kl_coef=rl.kl_coef if rl.kl_in == 'loss' else 0.0,
    kl_estimator=rl.kl_estimator,
    kl_input_clamp=rl.kl_input_clamp or None,
    kl_output_clamp=rl.kl_output_clamp or None,
    entropy_coef=rl.entropy_coef,
    temperature=rl.temperature,
    chunk_size=rl.chunk_size,
    sapo_tau_pos=rl.sapo_tau_pos,
    sapo_tau_neg=rl.sapo_tau_neg,
    vespo_k_pos=rl.vespo_k_pos,
    vespo_lambda_pos=rl.vespo_lambda_pos,
    vespo_k_neg=rl.vespo_k_neg,
    vespo_lambda_neg=rl.vespo_lambda_neg,
    off_policy_mask_threshold=rl.off_policy_mask_threshold or None,
  )


def advantage_config(rl):
  """The AdvantageConfig of a config's `rl` section."""
  return AdvantageConfig(
    estimator=rl.advantage,
    scale=rl.adv_scale,
    std=rl.adv_std,
    eps=rl.adv_eps,
    gamma=rl.gamma,
    kl_coef_in_reward=rl.kl_coef if rl.kl_in == 'reward' else 0.0,
  )
