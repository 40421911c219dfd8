"""GRPO as each framework computes it: named presets of plain values.

"GRPO" names four different formulas in veRL, TRL, OpenRLHF and NeMo-RL.
A `GRPOPreset` pins every choice that differs (the advantage estimator and
its ε, std and singleton rule; the clip ranges, dual clip and log-ratio
clamp; the loss aggregation; the KL estimator, its clamps and coefficient),
and `grpo_loss` composes the `jrl.losses` functions with them. The table in
`jrl/losses/README.md` lists the values and where each comes from. Two
presets keep a framework's GRPO-style loop but change its policy loss:
'trl_gmpo' (TRL's GMPOTrainer) and 'prime_rl' (prime-rl's default loss).

A preset is data (a NamedTuple of Python scalars and strings), not a config
object: `grpo_loss` unpacks it into the plain arguments of the underlying
functions, which remain the reference. Its `advantage`, `policy_loss` and
`loss_agg` names go through `jrl.losses.registry`, as the trainer's do;
`kl_estimator` is the `estimator` of `kl_penalty`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.losses import advantages as adv_lib
from jrl.losses import kl as kl_lib
from jrl.losses import reductions, registry
from jrl.losses._checks import check_choice, check_rank, check_same_shape


class GRPOPreset(NamedTuple):
  """Every convention that makes one framework's GRPO differ from another's."""

  name: str
  advantage: str  # a name in registry.OUTCOME_ADVANTAGES ('grpo' or 'loo' below).
  adv_scale: str  # grpo_advantages `scale`: 'group' | 'batch' | 'none'.
  adv_std: str  # grpo_advantages `std`: 'unbiased' | 'biased'.
  adv_eps: float  # ε added to the std.
  singleton: str  # grpo_advantages group_size == 1 rule: 'zero' | 'raw' | 'error'.
  eps_low: float  # PPO clip range below 1.
  eps_high: float  # PPO clip range above 1.
  dual_clip_c: float | None  # dual-clip bound for A < 0, None for none.
  log_ratio_clamp: float | None  # clamp on log ρ before exp, None for none.
  loss_agg: str  # one of reductions.AGGREGATION_MODES.
  loss_norm: float | None  # seq-mean-token-sum-norm constant; None: padded T.
  kl_estimator: str  # one of kl.KL_ESTIMATORS ('k3_ratio_corrected' uses old_logp).
  kl_input_clamp: float | None  # clamp on log(π/π_ref) before the estimator.
  kl_output_clamp: float | None  # clamp on the per-token KL estimate.
  kl_coef: float  # β of the KL term in the loss (0 turns it off).
  # The policy loss, a name in registry.POLICY_LOSSES; it takes the clip fields
  # above that it has arguments of (PPO all four, GSPO and GMPO eps_low/eps_high)
  # and `loss_args`, ((argument, value), ...), for its others.
  policy_loss: str = 'ppo'
  loss_args: tuple = ()


PRESETS = {
  # verl/trainer/ppo/core_algos.py: compute_grpo_outcome_advantage (torch.std,
  # +1e-6, singleton mean 0 / std 1), compute_policy_loss_vanilla (clip 0.2,
  # clip_ratio_c 3, log-ratio clamp ±20), agg_loss token-mean, kl_penalty
  # low_var_kl (clamps ±20 in, ±10 out), kl_loss_coef 0.001.
  'verl': GRPOPreset(
    name='verl',
    advantage='grpo',
    adv_scale='group',
    adv_std='unbiased',
    adv_eps=1e-6,
    singleton='raw',
    eps_low=0.2,
    eps_high=0.2,
    dual_clip_c=3.0,
    log_ratio_clamp=20.0,
    loss_agg='token-mean',
    loss_norm=None,
    kl_estimator='k3',
    kl_input_clamp=20.0,
    kl_output_clamp=10.0,
    kl_coef=0.001,
  ),
  # trl GRPOTrainer: (r - mean) / (std + 1e-4), scale_rewards="group", a lone
  # sample gets std 0 hence advantage 0; epsilon 0.2 = epsilon_high; no dual
  # clip, no clamp; loss_type "dapo" (global token mean); beta 0.0; k3
  # without clamps, times the differentiable ratio π/π_old
  # (use_bias_correction_kl=True, GRPOConfig's default in TRL 1.16; earlier
  # releases defaulted to False: _replace(kl_estimator='k3') for those).
  'trl': GRPOPreset(
    name='trl',
    advantage='grpo',
    adv_scale='group',
    adv_std='unbiased',
    adv_eps=1e-4,
    singleton='zero',
    eps_low=0.2,
    eps_high=0.2,
    dual_clip_c=None,
    log_ratio_clamp=None,
    loss_agg='token-mean',
    loss_norm=None,
    kl_estimator='k3_ratio_corrected',
    kl_input_clamp=None,
    kl_output_clamp=None,
    kl_coef=0.0,
  ),
  # OpenRLHF advantage_estimator "group_norm": (r - mean) / (std + 1e-9),
  # n_samples_per_prompt > 1 asserted; PolicyLoss eps_clip 0.2, no dual clip,
  # no clamp, token-level masked mean; compute_approx_kl k3 with the estimate
  # clamped to ±10, used as a loss (--use_kl_loss), init_kl_coef 0.01.
  'openrlhf': GRPOPreset(
    name='openrlhf',
    advantage='grpo',
    adv_scale='group',
    adv_std='unbiased',
    adv_eps=1e-9,
    singleton='error',
    eps_low=0.2,
    eps_high=0.2,
    dual_clip_c=None,
    log_ratio_clamp=None,
    loss_agg='token-mean',
    loss_norm=None,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=10.0,
    kl_coef=0.01,
  ),
  # NeMo-RL GRPO: leave-one-out baseline and leave-one-out std (+1e-6, only
  # where std > 0); ClippedPGLossFn ratio_clip 0.2/0.2, no dual clip, token
  # level; calculate_kl k3 with input clamp ±20 and output clamp ±10,
  # reference_policy_kl_penalty 0.01.
  'nemo_rl': GRPOPreset(
    name='nemo_rl',
    advantage='loo',
    adv_scale='group',
    adv_std='unbiased',
    adv_eps=1e-6,
    singleton='zero',
    eps_low=0.2,
    eps_high=0.2,
    dual_clip_c=None,
    log_ratio_clamp=None,
    loss_agg='token-mean',
    loss_norm=None,
    kl_estimator='k3',
    kl_input_clamp=20.0,
    kl_output_clamp=10.0,
    kl_coef=0.01,
  ),
  # Dr. GRPO (Liu et al. 2025): no std scaling, constant normaliser (the
  # padded response length), no KL.
  'dr_grpo': GRPOPreset(
    name='dr_grpo',
    advantage='grpo',
    adv_scale='none',
    adv_std='unbiased',
    adv_eps=0.0,
    singleton='zero',
    eps_low=0.2,
    eps_high=0.2,
    dual_clip_c=None,
    log_ratio_clamp=None,
    loss_agg='seq-mean-token-sum-norm',
    loss_norm=None,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=None,
    kl_coef=0.0,
  ),
  # DAPO (Yu et al. 2025): clip-higher 0.2 / 0.28, token-mean, no KL. Its
  # dynamic sampling and overlong shaping live in the trainer.
  'dapo': GRPOPreset(
    name='dapo',
    advantage='grpo',
    adv_scale='group',
    adv_std='unbiased',
    adv_eps=1e-6,
    singleton='zero',
    eps_low=0.2,
    eps_high=0.28,
    dual_clip_c=None,
    log_ratio_clamp=None,
    loss_agg='token-mean',
    loss_norm=None,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=None,
    kl_coef=0.0,
  ),
  # TRL's experimental GMPOTrainer (trl/experimental/gmpo, TRL 1.10.dev):
  # GRPOConfig's advantages as 'trl'; GMPOConfig's epsilon 0.4 (= epsilon_high)
  # in log space, clipped per token before the geometric mean; the mean of the
  # per-sequence losses over the batch (seq-mean-token-mean); beta 0.0, and
  # when set, plain k3 averaged per sequence.
  'trl_gmpo': GRPOPreset(
    name='trl_gmpo',
    advantage='grpo',
    adv_scale='group',
    adv_std='unbiased',
    adv_eps=1e-4,
    singleton='zero',
    eps_low=0.4,
    eps_high=0.4,
    dual_clip_c=None,
    log_ratio_clamp=None,
    loss_agg='seq-mean-token-mean',
    loss_norm=None,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=None,
    kl_coef=0.0,
    policy_loss='gmpo',
  ),
  # prime-rl v0.8's GRPO: reward minus the group mean (no std), and its default
  # loss (trainer/rl/loss.py default_loss_fn, DefaultLossConfig): DPPO-Binary-TV
  # masking at 0.2 / 0.2 in probability, the unclipped importance ratio on the
  # kept tokens, kl_tau 1e-3 on (log ratio)^2; summed and divided by the global
  # token count; no reference KL. The clip fields are not read by 'dppo'.
  'prime_rl': GRPOPreset(
    name='prime_rl',
    advantage='grpo',
    adv_scale='none',
    adv_std='unbiased',
    adv_eps=0.0,
    singleton='zero',
    eps_low=0.2,
    eps_high=0.2,
    dual_clip_c=None,
    log_ratio_clamp=None,
    loss_agg='token-mean',
    loss_norm=None,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=None,
    kl_coef=0.0,
    policy_loss='dppo',
    loss_args=(('delta_low', 0.2), ('delta_high', 0.2), ('kl_tau', 1e-3)),
  ),
}


def get_preset(name):
  """Returns the preset called `name` (one of `PRESETS`)."""
  check_choice(name, 'preset', PRESETS)
  return PRESETS[name]


def preset_loss_args(preset):
  """{argument: value} of `preset`'s policy loss: the clip fields and
  `loss_args` (`registry.policy_loss_by_name` passes on those the loss takes)."""
  return {
    'eps_low': preset.eps_low,
    'eps_high': preset.eps_high,
    'dual_clip_c': preset.dual_clip_c,
    'log_ratio_clamp': preset.log_ratio_clamp,
    **dict(preset.loss_args),
  }


def preset_advantages(rewards, group_size, preset, *, axis_name=None):
  """Outcome advantages as `preset` computes them.

  Args:
    rewards: [B] outcome rewards in consecutive groups of `group_size`.
    group_size: G dividing B.
    preset: a GRPOPreset.
    axis_name: mapped axis for batch statistics.

  Returns:
    [B] float32.
  """
  args = {
    'scale': preset.adv_scale,
    'std': preset.adv_std,
    'eps': preset.adv_eps,
    'singleton': preset.singleton,
  }
  return registry.outcome_advantages_by_name(
    preset.advantage, rewards, group_size, args, axis_name=axis_name, field='preset.advantage'
  )


def grpo_loss(
  logp,
  old_logp,
  ref_logp,
  rewards,
  mask,
  *,
  group_size,
  preset,
  kl_coef=None,
  axis_name=None,
):
  """The full GRPO objective of one framework, as a scalar.

    A = preset advantages of `rewards`, broadcast over each response's tokens
    ℓ_t = policy loss(logp, old_logp, A) + β · KL_t(logp ‖ ref_logp)
          (`preset.policy_loss`: PPO-clip for the GRPO presets, GMPO for
          'trl_gmpo', DPPO for 'prime_rl')
          (KL_t: `preset.kl_estimator`; 'k3_ratio_corrected' multiplies k3 by
          exp(logp − old_logp), see `jrl.losses.kl`)
    loss = aggregate(ℓ, mask, preset.loss_agg)

  Args:
    logp: [B, T] current-policy token logprobs (differentiated).
    old_logp: [B, T] rollout-policy logprobs.
    ref_logp: [B, T] reference logprobs, or None when β = 0.
    rewards: [B] outcome rewards, groups of `group_size` consecutive rows.
    mask: [B, T] 0/1 response mask.
    group_size: G dividing B.
    preset: a GRPOPreset or the name of one.
    kl_coef: β; None takes `preset.kl_coef`.
    axis_name: mapped data axis for global token means and batch statistics.

  Returns:
    (loss [] float32, metrics dict of [] float32): `pg_loss`, `kl`,
    `advantages_mean`, `advantages_std` and the policy-loss metrics.
  """
  if isinstance(preset, str):
    preset = get_preset(preset)
  check_rank(logp, 2, 'logp', '[B, T]')
  check_same_shape('logp', logp, old_logp=old_logp, ref_logp=ref_logp, mask=mask)
  check_rank(rewards, 1, 'rewards', '[B]')
  if rewards.shape[0] != logp.shape[0]:
    raise ValueError(f'`rewards` must have shape [B={logp.shape[0]}], got {rewards.shape}.')
  beta = preset.kl_coef if kl_coef is None else kl_coef
  if beta and ref_logp is None:
    raise ValueError('`ref_logp` is required when the KL coefficient is nonzero.')

  adv_B = jax.lax.stop_gradient(preset_advantages(rewards, group_size, preset, axis_name=axis_name))
  adv_BxT = adv_lib.broadcast_to_tokens(adv_B, mask)
  pg_BxT, metrics = registry.policy_loss_by_name(
    preset.policy_loss, logp, old_logp, adv_BxT, mask, preset_loss_args(preset), axis_name=axis_name
  )
  total_BxT = pg_BxT
  kl_BxT = jnp.zeros_like(pg_BxT)
  if beta:
    kl_BxT = kl_lib.kl_penalty(
      logp,
      ref_logp,
      estimator=preset.kl_estimator,
      input_clamp=preset.kl_input_clamp,
      output_clamp=preset.kl_output_clamp,
      mask=mask,
      old_logp=old_logp,
    )
    total_BxT = pg_BxT + beta * kl_BxT

  agg = {'loss_norm': preset.loss_norm, 'axis_name': axis_name}
  loss = registry.aggregate_loss(total_BxT, mask, preset.loss_agg, **agg)
  stop = jax.lax.stop_gradient
  metrics['pg_loss'] = registry.aggregate_loss(stop(pg_BxT), mask, preset.loss_agg, **agg)
  metrics['kl'] = registry.aggregate_loss(stop(kl_BxT), mask, preset.loss_agg, **agg)
  metrics['advantages_mean'] = reductions.token_mean(adv_BxT, mask, axis_name=axis_name)
  centred_sq = jnp.square(adv_BxT - metrics['advantages_mean'])
  metrics['advantages_std'] = jnp.sqrt(reductions.token_mean(centred_sq, mask, axis_name=axis_name))
  return loss, metrics
