"""The GRPO-family objective as one typed value, composed in one place.

    A   = advantage(rewards, mask, G, kl)         `Objective.advantage` (an `Advantage`)
    ℓ_t = policy(logp, old_logp, A)_t · M · w_t   `Objective.policy` (a `PolicyLoss`); M the
                                                  off-policy sequence mask, w importance weights
          + β · KL_t(π ‖ π_ref) − c_H · H_t
    L   = aggregate(ℓ, mask, loss_agg)

An `Objective` is what a run's `rl` section becomes at the trainer's edge
(`jrl.trainers.policy_step.objective_of`) and what a GRPO preset is
(`jrl.losses.PRESETS`): the same value either way, checked when it is made
(`PolicyLoss.make`, `Advantage.make`) and handed as it is to the functions
here, which call the kernels with its values. `token_loss` is the one
composition of the terms: the trainer's update and `grpo_loss` both call it.
Nothing here reads a config.
"""

import functools
from typing import NamedTuple

import jax.numpy as jnp

from jrl.losses import kl as kl_lib
from jrl.losses import off_policy, registry
from jrl.losses.registry import Advantage, PolicyLoss
from jrl.losses.value import entropy_loss


class Objective(NamedTuple):
  """Every choice of the GRPO family's loss, as plain values. Hashable: a
  static argument of a jitted step."""

  policy: PolicyLoss = PolicyLoss()
  advantage: Advantage = Advantage()
  loss_agg: str = 'token-mean'  # one of AGGREGATION_MODES
  loss_norm: float | None = None  # the 'seq-mean-token-sum-norm' constant; None: padded T
  kl_coef: float = 0.0  # β of the KL term in the loss (0: no term, no reference needed)
  kl_estimator: str = 'k3'  # the `estimator` of `kl_penalty`
  kl_input_clamp: float | None = None
  kl_output_clamp: float | None = None
  entropy_coef: float = 0.0  # c_H
  off_policy_mask_threshold: float | None = None  # δ of `off_policy_sequence_mask`; None: off

  def aggregate(self, x, mask, *, num_seqs=None, axis_name=None):
    """`x` [B, T] reduced over `mask` [B, T] by `loss_agg` and `loss_norm`
    (`num_seqs` replaces B in the 'seq-mean-*' modes). Returns [] float32."""
    agg = dict(loss_norm=self.loss_norm, num_seqs=num_seqs, axis_name=axis_name)
    return registry.aggregate_loss(x, mask, self.loss_agg, **agg)

  def check(self, field='objective'):
    """Runs the kernels' own argument checks on the values of this
    objective that are kernel arguments (the KL estimator and clamps, the
    aggregation and its constant, the off-policy threshold), traced on a
    tiny abstract batch; a ValueError names the kernel's argument under its
    section of `field` (`rl.kl.input_clamp`, `rl.reduction.mode`: a run's
    `rl` section holds them so). The policy loss and the estimator are
    checked when made. Returns self."""
    registry.once(_check, self, field)
    return self


def token_loss(
  objective,
  logp,
  old_logp,
  advantages,
  mask,
  *,
  ref_logp=None,
  entropy=None,
  is_weights=None,
  axis_name=None,
):
  """The per-token loss ℓ_t of `objective` and its parts.

  Args:
    objective: an Objective.
    logp: [B, T] current-policy logprobs (differentiated).
    old_logp: [B, T] behaviour-policy logprobs.
    advantages: [B, T] float32.
    mask: [B, T] 0/1, the tokens with a term.
    ref_logp: [B, T] reference logprobs; needed when `objective.kl_coef` is not 0.
    entropy: [B, T] token entropies; needed when `objective.entropy_coef` is not 0.
    is_weights: optional [B, T] importance weights multiplying the policy term.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (total [B, T], policy term [B, T], KL estimate [B, T] (zeros when β is 0),
    the policy loss's metrics dict of [] float32), each zero where mask is 0.
  """
  pg, metrics = objective.policy(logp, old_logp, advantages, mask, axis_name=axis_name)
  if objective.off_policy_mask_threshold is not None:
    # DeepSeek-V3.2's off-policy sequence mask, against the behaviour logprobs.
    keep, mask_metrics = off_policy.off_policy_sequence_mask(
      logp,
      old_logp,
      advantages,
      mask,
      threshold=objective.off_policy_mask_threshold,
      axis_name=axis_name,
    )
    pg = pg * keep
    metrics.update(mask_metrics)
  if is_weights is not None:
    pg = pg * is_weights
  total, kl = pg, jnp.zeros_like(pg)
  if objective.kl_coef:
    if ref_logp is None:
      raise ValueError('`ref_logp` is required when the KL coefficient is nonzero.')
    kl = kl_estimate(objective, logp, ref_logp, mask, old_logp)
    total = total + objective.kl_coef * kl
  if objective.entropy_coef:
    if entropy is None:
      raise ValueError('`entropy` is required when the entropy coefficient is nonzero.')
    total = total + objective.entropy_coef * entropy_loss(entropy, mask)
  return total, pg, kl, metrics


def kl_estimate(objective, logp, ref_logp, mask, old_logp):
  """The per-token KL [B, T] of `objective`'s estimator and clamps (`kl_penalty`)."""
  return kl_lib.kl_penalty(
    logp,
    ref_logp,
    estimator=objective.kl_estimator,
    input_clamp=objective.kl_input_clamp,
    output_clamp=objective.kl_output_clamp,
    mask=mask,
    old_logp=old_logp,
  )


@functools.lru_cache(maxsize=4096)
def _check(objective, field):
  """`Objective.check`, remembered for the values that pass."""
  # Each kernel's arguments under its section: `<field>.kl.estimator`, ...
  named = lambda section, *args: {arg: f'{field}.{section}{arg}' for arg in args}
  kl = lambda logp, ref, mask: kl_estimate(objective, logp, ref, mask, logp)
  kl_shapes = (('logp', (1, 2)), ('ref_logp', (1, 2)), ('mask', (1, 2)))
  kl_args = named('kl.', 'estimator', 'input_clamp', 'output_clamp')
  registry.probe(kl, kl_shapes, kl_args, f'{field}.kl.estimator')
  agg = lambda x, mask: objective.aggregate(x, mask)
  shapes = (('x', (1, 2)), ('mask', (1, 2)))
  registry.probe(agg, shapes, named('reduction.', 'mode', 'loss_norm'), f'{field}.reduction')
  if objective.off_policy_mask_threshold is not None:
    mask_fn = lambda logp, mask: off_policy.off_policy_sequence_mask(
      logp, logp, logp, mask, threshold=objective.off_policy_mask_threshold
    )
    thr = {'threshold': f'{field}.off_policy_mask_threshold'}
    registry.probe(mask_fn, shapes, thr, f'{field}.off_policy_mask_threshold')
