"""The GRPO family (GRPO, Dr.GRPO, DAPO, GSPO, CISPO, SAPO, VESPO, RLOO,
REINFORCE++), with an optional SFT warm-up first.

`build(config)` is what `jrl.trainers.run` builds for `algorithm='grpo'`
(registered below); one RL iteration reads:

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
from jrl import parallel
from jrl.trainers import (
  checks,
  common,
  distill,
  memory_plan,
  online,
  policy_step,
  rollout,
  setup,
  sft,
)


class Steps(NamedTuple):
  """The jitted functions of a GRPO-family run."""

  rl: Any  # policy_step.train_step
  logprobs: Any  # (params, tokens, mask) -> logp [B, T]
  advantages: Any  # (rewards [B], loss_mask [B, T], kl_BxT=None, valid_B=None) -> [B, T]


def make_steps(config, resources, tx, schedule, shardings, packer=None, remat=None):
  """The Steps of a run; the update's forward with the `remat` policy (None:
  the model's own, `memory_plan.with_remat`)."""
  rl = config.rl
  step_config = policy_step.step_config(rl, config.train.chunk_size, config.sampling.temperature)
  accum = int(config.optim.grad_accum)
  graphdef = resources.model.graphdef
  if remat is not None:
    graphdef = memory_plan.with_remat(graphdef, resources.params, remat)
  rl_step = common.jit_update(
    (policy_step.train_step, policy_step.loss_and_grads, policy_step.apply_update),
    dict(graphdef=graphdef, step_config=step_config),
    dict(tx=tx, schedule=schedule, accum=accum),
    shardings,
    packer is not None and packer.budget,  # micro-batches of a token budget
    policy_step.ADDITIVE_METRICS,
    policy_step.TOKEN_SHARE,
  )
  advantages = jax.jit(
    functools.partial(
      policy_step.advantages,
      group_size=rl.group_size,
      estimator=step_config.objective.advantage,
    )
  )
  # Traced under the training mesh (attention kernels per shard, `parallel.on_mesh`).
  return Steps(
    parallel.on_mesh(resources.mesh, rl_step),
    parallel.on_mesh(resources.mesh, online.logprobs_fn(config, resources.model.graphdef, packer)),
    advantages,
  )


# What a GRPO-family run reads besides the shared sections.
SECTIONS = (*online.SECTIONS, distill.SECTION)


def build(
  config, make_worker=rollout.RolloutWorker, sft_batch=sft.response_batch, sections=SECTIONS
):
  """The job of a GRPO-family run. `make_worker(resources, mesh, prompt_rows)` is the
  rollout worker (the agent passes its episode runner), `sft_batch` packs
  the warm-up's examples, `sections` are the config sections checked."""
  rl = config.rl
  resources, rollout_mesh, rows = online.start(config, sections)

  # State: the reference model is the policy at the start of RL. One
  # optimiser per phase; the optimiser state and step restart when RL begins.
  tx, schedule = setup.optimizer(config)
  uses_ref = rl.kl_coef > 0

  def new_state(params, tx):
    extra = {'ref_params': jax.tree.map(jnp.copy, params)} if uses_ref else {}
    extra.update(online.reward_state(config.reward))
    return setup.new_state(params, tx, resources.mesh, extra)

  state = new_state(resources.params, setup.sft_optimizer(config)[0] if config.sft.steps else tx)
  warmup = sft.warmup(resources, state, sft_batch)
  packer = common.make_packer(config.train, resources.seq_len, resources.batch_sharding)
  shardings = setup.step_shardings(state, resources.mesh)
  worker, topo = online.finish(config, resources, rollout_mesh, rows, make_worker)

  def probe_batch(tokens, mask, loss_mask):
    put = lambda x: common.place_global(x, resources.batch_sharding)
    zeros = put(np.zeros(tokens.shape, np.float32))
    is_weights = put(np.ones(tokens.shape, np.float32)) if topo.staleness else None
    valid = online.place_valid(np.ones(tokens.shape[0], bool), resources.batch_sharding)
    return policy_step.PolicyBatch(
      put(tokens), put(mask), put(loss_mask), zeros, zeros, zeros, is_weights, valid=valid
    )

  steps, packer, plan = memory_plan.planned_steps(
    config,
    resources,
    state,
    packer,
    lambda remat, p: make_steps(config, resources, tx, schedule, shardings, p, remat),
    probe_batch,
    worker=worker,
  )
  kl_in_reward = policy_step.objective_of(rl).advantage.kwargs.get('kl_coef')
  teachers = distill.load(config, resources, packer)

  def batch(state, generated, old_logp, is_weights, metrics):
    """The group-relative advantages of a placed rollout (with teachers, mixed
    with the distillation advantage: `jrl.trainers.distill`), and its PolicyBatch."""
    del state
    mask = generated.batch.loss_mask
    kl_reward = None
    if kl_in_reward:
      kl_reward = L.kl_penalty(generated.old_logp, generated.ref_logp, estimator='k1', mask=mask)
    adv = steps.advantages(
      jnp.asarray(generated.rewards), mask, kl_BxT=kl_reward, valid_B=generated.valid
    )
    if teachers is not None:
      adv = distill.advantages(teachers, config, generated, old_logp, adv, resources, metrics)
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

  return online.job(
    config,
    resources,
    state,
    worker=worker,
    topo=topo,
    warmup=warmup,
    algorithm=online.Algorithm(batch, steps.rl),
    steps=steps,
    packer=packer,
    plan=plan,
    uses_ref=uses_ref,
    start_rl=lambda state: new_state(state.params, tx),
  )


ALGORITHM = checks.register(
  checks.Algorithm('grpo', build, SECTIONS, steps_section='rl', online=True, standalone_eval=True)
)
