"""The GRPO family (GRPO, Dr.GRPO, DAPO, GSPO, CISPO, SAPO, VESPO, RLOO,
REINFORCE++), with an optional SFT warm-up first.

`GRPO(config)` is the job `jrl.trainers.run` builds for `algorithm='grpo'`
(registered below); one RL iteration (`online.Run.rl_iteration`) reads:

    rollout  = topology.next_rollout(params, it)      # generate + score (worker)
    rollout  = place_rollout(rollout, ...)            # mesh, reference (rewards shaped)
    A        = advantages(rewards, loss_mask, valid)  # group-normalised, per token
    state    = epochs x minibatches of policy_step.train_step(state, batch)

`valid` leaves out the completions whose reward could not be computed
(`reward.unscored='drop'`): advantage 0, outside their group's statistics
and outside the loss.

One-step-off (staleness 1) adds decoupled PPO: the clip is taken against
the current (proximal) policy and the loss weighted by the truncated ratio
proximal / behaviour.

All randomness is a function of (`seed`, iteration), and the data streams'
positions are checkpointed, so a resumed run produces the same parameters
and metrics as one that never stopped.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl import losses as L
from jrl.trainers import checks, common, distill, online, policy_step, setup, sft
from jrl.trainers.rollouts import rollout


class Steps(NamedTuple):
  """The jitted functions of a GRPO-family run."""

  rl: Any  # the update step: (state, policy_step.PolicyBatch) -> (state, metrics)
  logprobs: Any  # (params, tokens, mask) -> logp [B, T]
  advantages: Any  # (rewards [B], loss_mask [B, T], kl_BxT=None, valid_B=None) -> [B, T]


# What a GRPO-family run reads besides the shared sections.
SECTIONS = (*online.SECTIONS, distill.SECTION)


def make_update(config, resources, tx, schedule, shardings):
  """The update of a GRPO-family run (policy_step.train_step), not yet jitted."""
  return common.Update(
    (policy_step.train_step, policy_step.loss_and_grads, policy_step.apply_update),
    model=dict(
      graphdef=resources.model.graphdef,
      step_config=policy_step.step_config(
        config.rl, config.train.chunk_size, config.sampling.temperature
      ),
    ),
    optim=dict(tx=tx, schedule=schedule, accum=int(config.optim.grad_accum)),
    shardings=shardings,
    mesh=resources.mesh,
    models={'graphdef': resources.params},
    additive=policy_step.ADDITIVE_METRICS,
    token_share=policy_step.TOKEN_SHARE,
    compiler_options=resources.train_xla,
  )


def probe_batch(resources, staleness, tokens, mask, loss_mask):
  """The PolicyBatch the memory plan compiles the update for: host
  (tokens, mask, loss_mask) [B, T] on the mesh, the rest zeros."""
  put = lambda x: common.place_global(x, resources.batch_sharding)
  zeros = put(np.zeros(tokens.shape, np.float32))
  is_weights = put(np.ones(tokens.shape, np.float32)) if staleness else None
  valid = online.place_valid(np.ones(tokens.shape[0], bool), resources.batch_sharding)
  return policy_step.PolicyBatch(
    put(tokens), put(mask), put(loss_mask), zeros, zeros, zeros, is_weights, valid=valid
  )


class GRPO(online.Run):
  """The job of a GRPO-family run (`algorithm='grpo'`).

  Args:
    config: the run's config.
    make_worker: (resources, rollout mesh, prompt rows) -> the rollout worker
      (the agent passes its episode runner).
    sft_batch: (resources, examples, iteration) -> the warm-up's packed rows.
    sections: the config sections checked.
  """

  def __init__(
    self, config, make_worker=rollout.RolloutWorker, sft_batch=sft.response_batch, sections=SECTIONS
  ):
    self.config = config
    rl = config.rl
    resources, rollout_mesh, rows = online.start(config, sections)
    self.resources = resources

    # State: the reference model is the policy at the start of RL. One
    # optimiser per phase; the optimiser state and step restart when RL begins.
    self.tx, schedule = setup.optimizer(config)
    self.uses_ref = rl.kl_coef > 0
    sft_tx = setup.sft_optimizer(config)[0]
    self.state = self.new_state(resources.params, sft_tx if config.sft.steps else self.tx)
    self.warmup = sft.Warmup.of(config, resources, self.state, sft_batch)
    self.worker, self.topology = online.finish(config, resources, rollout_mesh, rows, make_worker)

    # The update: its memory plan chosen first, then the step jitted with it.
    shardings = setup.step_shardings(self.state, resources.mesh)
    update_fns = make_update(config, resources, self.tx, schedule, shardings)
    update_step = self.plan_update(update_fns, probe_batch)  # sets memory_plan, packer, logprobs
    self.steps = Steps(
      update_step,
      self.logprobs,
      jax.jit(
        functools.partial(
          policy_step.advantages,
          group_size=rl.group_size,
          estimator=update_fns.model['step_config'].objective.advantage,
        )
      ),
    )
    self.kl_in_reward = update_fns.model['step_config'].objective.advantage.kwargs.get('kl_coef')
    self.teachers = distill.load(config, resources, self.packer)

  def new_state(self, params, tx):
    """A train state of `params` with the optimiser `tx`, the reference (a
    copy of `params`) and the reward shaping's running moments."""
    extra = common.AlgorithmState(
      ref_params=jax.tree.map(jnp.copy, params) if self.uses_ref else None,
      reward_moments=online.reward_state(self.config.reward),
    )
    return setup.new_state(params, tx, self.resources.mesh, extra)

  def start_rl(self, state):
    """A fresh optimiser, and the policy as the reference."""
    return self.new_state(state.params, self.tx)

  def batch(self, state, generated, old_logp, is_weights, metrics):
    """The group-relative advantages of a placed rollout (with teachers, mixed
    with the distillation advantage: `jrl.trainers.distill`), and its PolicyBatch."""
    del state
    mask = generated.batch.loss_mask
    kl_reward = None
    if self.kl_in_reward:
      kl_reward = L.kl_penalty(generated.old_logp, generated.ref_logp, estimator='k1', mask=mask)
    adv = self.steps.advantages(
      jnp.asarray(generated.rewards), mask, kl_BxT=kl_reward, valid_B=generated.valid
    )
    if self.teachers is not None:
      rows, d = self.config.rl.minibatch_size, self.config.distill
      adv = distill.advantages(
        self.teachers, d, rows, generated, old_logp, adv, self.resources, metrics
      )
    full = policy_step.PolicyBatch(
      tokens=generated.batch.tokens,
      mask=generated.batch.mask,
      loss_mask=mask,
      old_logp=old_logp,
      ref_logp=generated.ref_logp,
      advantages=adv,
      is_weights=is_weights,
      valid=generated.valid,
    )
    return full, adv

  def update(self, state, minibatch):
    return self.steps.rl(state, minibatch)


ALGORITHM = checks.register(
  checks.Algorithm('grpo', GRPO, SECTIONS, steps_section='rl', online=True, standalone_eval=True)
)
