"""GRPO as each framework computes it: named `Objective`s.

"GRPO" names four different formulas in veRL, TRL, OpenRLHF and NeMo-RL.
A preset is an `Objective` (`jrl.losses.objective`) that pins every choice
that differs: the advantage estimator and its ε, std and singleton rule; the
clip ranges, dual clip and log-ratio clamp of the policy loss; the loss
aggregation; the KL estimator, its clamps and coefficient. It is the same
value that a run's `rl` section becomes, so `grpo_loss` and the trainer
compose the same terms (`objective.token_loss`) with it. The table in
`jrl/losses/README.md` lists the values and where each comes from. Two
presets keep a framework's GRPO-style loop but change its policy loss:
'trl_gmpo' (TRL's GMPOTrainer) and 'prime_rl' (prime-rl's default loss).
`preset._replace(kl_estimator=...)` changes a field, and
`preset.policy.replace(eps_high=...)` an argument of its loss.
"""

import jax
import jax.numpy as jnp

from jrl.losses import advantages as adv_lib
from jrl.losses import objective, reductions
from jrl.losses._checks import check_choice, check_rank, check_same_shape
from jrl.losses.objective import Objective
from jrl.losses.registry import Advantage, PolicyLoss


def _policy(name, **args):
  return PolicyLoss.of(name, args)


def _advantage(name, **args):
  return Advantage.of(name, args)


PRESETS = {
  # verl/trainer/ppo/core_algos.py: compute_grpo_outcome_advantage (torch.std,
  # +1e-6, singleton mean 0 / std 1), compute_policy_loss_vanilla (clip 0.2,
  # clip_ratio_c 3, log-ratio clamp ±20), agg_loss token-mean, kl_penalty
  # low_var_kl (clamps ±20 in, ±10 out), kl_loss_coef 0.001.
  'verl': Objective(
    policy=_policy('ppo', eps_low=0.2, eps_high=0.2, dual_clip_c=3.0, log_ratio_clamp=20.0),
    advantage=_advantage('grpo', scale='group', std='unbiased', eps=1e-6, singleton='raw'),
    loss_agg='token-mean',
    loss_norm=None,
    kl_coef=0.001,
    kl_estimator='k3',
    kl_input_clamp=20.0,
    kl_output_clamp=10.0,
  ),
  # trl GRPOTrainer: (r - mean) / (std + 1e-4), scale_rewards="group", a lone
  # sample gets std 0 hence advantage 0; epsilon 0.2 = epsilon_high; no dual
  # clip, no clamp; loss_type "dapo" (global token mean); beta 0.0; k3
  # without clamps, times the differentiable ratio π/π_old
  # (use_bias_correction_kl=True, GRPOConfig's default in TRL 1.16; earlier
  # releases defaulted to False: _replace(kl_estimator='k3') for those).
  'trl': Objective(
    policy=_policy('ppo', eps_low=0.2, eps_high=0.2),
    advantage=_advantage('grpo', scale='group', std='unbiased', eps=1e-4, singleton='zero'),
    loss_agg='token-mean',
    loss_norm=None,
    kl_coef=0.0,
    kl_estimator='k3_ratio_corrected',
    kl_input_clamp=None,
    kl_output_clamp=None,
  ),
  # OpenRLHF advantage_estimator "group_norm": (r - mean) / (std + 1e-9),
  # n_samples_per_prompt > 1 asserted; PolicyLoss eps_clip 0.2, no dual clip,
  # no clamp, token-level masked mean; compute_approx_kl k3 with the estimate
  # clamped to ±10, used as a loss (--use_kl_loss), init_kl_coef 0.01.
  'openrlhf': Objective(
    policy=_policy('ppo', eps_low=0.2, eps_high=0.2),
    advantage=_advantage('grpo', scale='group', std='unbiased', eps=1e-9, singleton='error'),
    loss_agg='token-mean',
    loss_norm=None,
    kl_coef=0.01,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=10.0,
  ),
  # NeMo-RL GRPO: leave-one-out baseline and leave-one-out std (+1e-6, only
  # where std > 0); ClippedPGLossFn ratio_clip 0.2/0.2, no dual clip, token
  # level; calculate_kl k3 with input clamp ±20 and output clamp ±10,
  # reference_policy_kl_penalty 0.01.
  'nemo_rl': Objective(
    policy=_policy('ppo', eps_low=0.2, eps_high=0.2),
    advantage=_advantage('loo', eps=1e-6),
    loss_agg='token-mean',
    loss_norm=None,
    kl_coef=0.01,
    kl_estimator='k3',
    kl_input_clamp=20.0,
    kl_output_clamp=10.0,
  ),
  # Dr. GRPO (Liu et al. 2025): no std scaling, constant normaliser (the
  # padded response length), no KL.
  'dr_grpo': Objective(
    policy=_policy('ppo', eps_low=0.2, eps_high=0.2),
    advantage=_advantage('grpo', scale='none', std='unbiased', eps=0.0, singleton='zero'),
    loss_agg='seq-mean-token-sum-norm',
    loss_norm=None,
    kl_coef=0.0,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=None,
  ),
  # DAPO (Yu et al. 2025): clip-higher 0.2 / 0.28, token-mean, no KL. Its
  # dynamic sampling and overlong shaping live in the trainer.
  'dapo': Objective(
    policy=_policy('ppo', eps_low=0.2, eps_high=0.28),
    advantage=_advantage('grpo', scale='group', std='unbiased', eps=1e-6, singleton='zero'),
    loss_agg='token-mean',
    loss_norm=None,
    kl_coef=0.0,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=None,
  ),
  # TRL's experimental GMPOTrainer (trl/experimental/gmpo, TRL 1.10.dev):
  # GRPOConfig's advantages as 'trl'; GMPOConfig's epsilon 0.4 (= epsilon_high)
  # in log space, clipped per token before the geometric mean; the mean of the
  # per-sequence losses over the batch (seq-mean-token-mean); beta 0.0, and
  # when set, plain k3 averaged per sequence.
  'trl_gmpo': Objective(
    policy=_policy('gmpo', eps_low=0.4, eps_high=0.4),
    advantage=_advantage('grpo', scale='group', std='unbiased', eps=1e-4, singleton='zero'),
    loss_agg='seq-mean-token-mean',
    loss_norm=None,
    kl_coef=0.0,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=None,
  ),
  # prime-rl v0.8's GRPO: reward minus the group mean (no std), and its default
  # loss (trainer/rl/loss.py default_loss_fn, DefaultLossConfig): DPPO-Binary-TV
  # masking at 0.2 / 0.2 in probability, the unclipped importance ratio on the
  # kept tokens, kl_tau 1e-3 on (log ratio)^2; summed and divided by the global
  # token count; no reference KL. The clip fields are not read by 'dppo'.
  'prime_rl': Objective(
    policy=_policy('dppo', delta_low=0.2, delta_high=0.2, kl_tau=1e-3),
    advantage=_advantage('grpo', scale='none', std='unbiased', eps=0.0, singleton='zero'),
    loss_agg='token-mean',
    loss_norm=None,
    kl_coef=0.0,
    kl_estimator='k3',
    kl_input_clamp=None,
    kl_output_clamp=None,
  ),
}


def get_preset(name):
  """The preset called `name` (one of `PRESETS`), an Objective."""
  check_choice(name, 'preset', PRESETS)
  return PRESETS[name]


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

    A = the preset's advantages of `rewards`, broadcast over each response's tokens
    ℓ_t = policy loss(logp, old_logp, A) + β · KL_t(logp ‖ ref_logp)
          (`preset.policy`: PPO-clip for the GRPO presets, GMPO for
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
    preset: an Objective (one of `PRESETS`) or the name of one.
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
  if kl_coef is not None:
    preset = preset._replace(kl_coef=kl_coef)

  stop = jax.lax.stop_gradient
  adv_B = stop(preset.advantage.outcome(rewards, group_size, axis_name=axis_name))
  adv_BxT = adv_lib.broadcast_to_tokens(adv_B, mask)
  total_BxT, pg_BxT, kl_BxT, metrics = objective.token_loss(
    preset, logp, old_logp, adv_BxT, mask, ref_logp=ref_logp, axis_name=axis_name
  )
  reduce = lambda x: preset.aggregate(x, mask, axis_name=axis_name)
  loss = reduce(total_BxT)
  metrics['pg_loss'] = reduce(stop(pg_BxT))
  metrics['kl'] = reduce(stop(kl_BxT))
  metrics['advantages_mean'] = reductions.token_mean(adv_BxT, mask, axis_name=axis_name)
  centred_sq = jnp.square(adv_BxT - metrics['advantages_mean'])
  metrics['advantages_std'] = jnp.sqrt(reductions.token_mean(centred_sq, mask, axis_name=axis_name))
  return loss, metrics
