"""jrl.losses: RL objectives for language models as pure functions of arrays.

Nothing here sees a model, a tokenizer or a config: callers pass logprobs,
rewards, values and masks, and get per-token (or per-sequence) losses and
scalar metrics back. All arithmetic is float32. Shapes are checked on entry;
a wrong shape, a batch that does not split into groups, or an unknown mode
name raises `ValueError` naming the argument.

    import jrl.losses as L
    adv = L.grpo_advantages(rewards, group_size=8)               # [B]
    loss_BxT, metrics = L.ppo_clip_loss(logp, old_logp,
                                        L.broadcast_to_tokens(adv, mask), mask,
                                        eps_low=0.2, eps_high=0.28)
    loss = L.aggregate(loss_BxT, mask, 'token-mean')

Every policy loss and advantage estimator is also listed by name in
`jrl.losses.registry` (`POLICY_LOSSES`, `ADVANTAGE_ESTIMATORS`), the one table
that the trainer and the presets look names up in. `PolicyLoss` and
`Advantage` are one of them with its arguments, checked when made; an
`Objective` (`jrl.losses.objective`) holds every choice of the GRPO family's
loss, and `token_loss` composes its terms:

    obj = L.Objective(policy=L.PolicyLoss.make('ppo', {'eps_high': 0.28}))
    adv = obj.advantage(rewards, mask, group_size=8)             # [B, T]
    total, pg, kl, metrics = L.token_loss(obj, logp, old_logp, adv, mask)
    loss = obj.aggregate(total, mask)

A GRPO preset (`L.PRESETS['verl']`, ...) is such an Objective.

See `jrl/losses/README.md` for the conventions of veRL, TRL, OpenRLHF and
NeMo-RL and the presets that reproduce each one's GRPO.
"""

from jrl.losses.advantages import (
  batch_std,
  broadcast_to_tokens,
  discounted_returns,
  dr_grpo_advantages,
  gae,
  grpo_advantages,
  loo_advantages,
  reinforce_pp_advantages,
  reinforce_pp_baseline_advantages,
  rloo_advantages,
  token_level_rewards,
  valid_token_mask,
  whiten,
)
from jrl.losses.distill import (
  distillation_advantages,
  distillation_metrics,
  reverse_kl_rewards,
  teacher_mixture,
)
from jrl.losses.kl import (
  KL_ESTIMATORS,
  KLController,
  KLControllerState,
  adaptive_kl_controller,
  fixed_kl_controller,
  kl_penalty,
)
from jrl.losses.logprobs import (
  token_entropy,
  token_logprobs,
  token_logprobs_and_entropy,
  token_logprobs_from_hidden,
)
from jrl.losses.objective import Objective, token_loss
from jrl.losses.policy import (
  binary_kl,
  binary_kl_mask,
  cispo_loss,
  dppo_loss,
  gmpo_loss,
  gspo_loss,
  icepop_loss,
  importance_sampling_loss,
  importance_weights,
  kpop_loss,
  off_policy_sequence_mask,
  ppo_clip_loss,
  prob_diff_mask,
  ratio_band_mask,
  sapo_loss,
  vespo_loss,
  vespo_weights,
)
from jrl.losses.preference import (
  bradley_terry_loss,
  dpo_loss,
  hinge_loss,
  ipo_loss,
  orpo_loss,
  simpo_loss,
)
from jrl.losses.presets import PRESETS, get_preset, grpo_loss
from jrl.losses.reductions import (
  AGGREGATION_MODES,
  aggregate,
  seq_mean_token_mean,
  seq_mean_token_sum,
  seq_mean_token_sum_norm,
  token_mean,
  token_sum,
)
from jrl.losses.registry import (
  ADVANTAGE_ARGS,
  ADVANTAGE_ESTIMATORS,
  GROUP_ADVANTAGES,
  OUTCOME_ADVANTAGES,
  POLICY_LOSS_ARGS,
  POLICY_LOSSES,
  RETURN_ADVANTAGES,
  SUPPLIED_ARGS,
  UNBOUNDED_POLICY_LOSSES,
  Advantage,
  PolicyLoss,
  aggregate_loss,
  default_args,
  get_advantage_estimator,
  get_policy_loss,
  unbounded_reason,
)
from jrl.losses.value import entropy_loss, value_loss
