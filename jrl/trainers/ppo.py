"""PPO with a critic (value head), GAE, value clipping, and a KL penalty in the
reward (adaptive or fixed) or in the loss.

The critic is the same transformer with a scalar head (`score`, no LM head),
initialised from the policy when RL starts (or from a reward-model checkpoint
via `ppo.critic_path`). Per rollout:

    r_t   = −β · KL_t(π_old ‖ π_ref) + [t last] · R          (KL in the reward)
    V_t   = critic value of the state before token t
    A, G  = GAE(r, V; γ, λ) over response tokens;  A ← whiten(A)
    policy: PPO clip on A;  critic: clipped value loss toward G
    β     ← adaptive controller (Ziegler et al. 2019) from the measured KL

Completions whose reward could not be computed (`reward.unscored='drop'`)
are left out: no reward, no GAE, no whitening statistics, no policy or
value loss (`PPOBatch.valid`).

`train_step(state, batch)` updates policy and critic together; it is pure
and jitted once by `PPO`. Rollouts come from the same rollout worker
and topology as GRPO's (`jrl.trainers.online`).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl import losses as L
from jrl import models, parallel
from jrl.models import hf as hf_lib
from jrl.trainers import checks, common, online, policy_step, setup, sft
from jrl.trainers.optim import make_optimizer
from jrl.trainers.rollouts import rollout


class PPOBatch(NamedTuple):
  tokens: jax.Array  # [B, T] int32
  mask: jax.Array  # [B, T] bool
  loss_mask: jax.Array  # [B, T] bool response tokens
  old_logp: jax.Array  # [B, T] float32
  ref_logp: jax.Array  # [B, T] float32 (zeros when the KL is in the reward)
  advantages: jax.Array  # [B, T] float32 (whitened GAE)
  returns: jax.Array  # [B, T] float32 value targets
  old_values: jax.Array  # [B, T] float32 critic values at rollout time
  # [B, T] float32 importance weights proximal / behaviour for a stale rollout
  # (one-step-off, `correction.proximal`); None: on-policy.
  is_weights: jax.Array | None = None
  packed: Any = None  # jrl.data.packing.PackedInputs (`train.packing`), else None
  valid: jax.Array | None = None  # [B] bool rows trained on (policy_step.PolicyBatch.valid)


def critic_values(graphdef, params, tokens, mask, packed=None):
  """[B, T] float32: V_t is the critic's value of the prefix before token t
  (its scalar head at position t − 1); 0 at t = 0. With `packed` the critic
  runs on the laid-out rows (padded, packed or shared-prompt) and V_t is
  read at the row position of token t − 1 (`common.predecessor_values`)."""
  if packed is None:
    return jnp.pad(models.values(graphdef, params, tokens, mask)[:, :-1], ((0, 0), (1, 0)))
  v = models.values(
    graphdef,
    params,
    packed.tokens,
    positions=packed.positions,
    segment_ids=packed.segment_ids,
    branches=packed.branches,
  )
  return common.predecessor_values(v, packed)


def value_loss_fn(params, graphdef, batch, value_clip):
  """Token-mean value loss of a minibatch, or the share of it that the
  micro-batch `batch.packed.select` holds (as `policy_step.policy_loss`)."""
  v = critic_values(graphdef, params, batch.tokens, batch.mask, batch.packed)
  loss_mask, _ = policy_step.trained_mask(batch)
  held, own_mask = common.held_mask(loss_mask, batch.packed)
  v = common.only_held(v, held, jax.lax.stop_gradient(batch.old_values))
  per_token, metrics = L.value_loss(
    v, batch.old_values, batch.returns, own_mask, clip_eps=value_clip or None
  )
  loss = L.token_mean(common.only_held(per_token, held), loss_mask)
  return loss, {f'critic/{k}': v for k, v in metrics.items()}


ADDITIVE_METRICS = policy_step.ADDITIVE_METRICS + ('critic/vf_loss',)


def loss_and_grads(state, batch, *, graphdef, critic_graphdef, step_config, value_clip):
  """((policy loss, value loss), metrics, (policy grads, critic grads)) of
  one (micro-)batch."""
  pbatch = policy_step.PolicyBatch(
    batch.tokens,
    batch.mask,
    batch.loss_mask,
    batch.old_logp,
    batch.ref_logp,
    batch.advantages,
    is_weights=batch.is_weights,
    packed=batch.packed,
    valid=batch.valid,
  )
  loss, metrics, grads = policy_step.loss_and_grads(
    state, pbatch, graphdef=graphdef, step_config=step_config
  )
  (vloss, vmetrics), vgrads = jax.value_and_grad(value_loss_fn, has_aux=True)(
    state.extra.critic.params, critic_graphdef, batch, value_clip
  )
  metrics.update(vmetrics)
  metrics['critic/vf_loss'] = vloss
  return (loss, vloss), metrics, (grads, vgrads)


def apply_update(state, grads, losses, metrics, *, tx, schedule, critic_tx, critic_schedule):
  """The policy's and the critic's updates; a non-finite loss or gradient
  skips that model's update."""
  (loss, vloss), (grads, vgrads) = losses, grads
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule)
  critic, copt = common.apply_gradients(
    state.extra.critic, vgrads, vloss, critic_tx, critic_schedule
  )
  metrics = dict(metrics)
  metrics.update({f'actor/{k}': v for k, v in opt_metrics.items()})
  metrics.update({f'critic/{k}': v for k, v in copt.items()})
  return state._replace(extra=state.extra.replace(critic=critic)), metrics


def train_step(
  state,
  batch,
  *,
  graphdef,
  critic_graphdef,
  tx,
  schedule,
  critic_tx,
  critic_schedule,
  step_config,
  value_clip,
):
  """One minibatch update of the policy (PPO clip) and of the critic.

  Returns:
    (state, metrics); a non-finite loss or gradient skips that model's update.
  """
  losses, metrics, grads = loss_and_grads(
    state,
    batch,
    graphdef=graphdef,
    critic_graphdef=critic_graphdef,
    step_config=step_config,
    value_clip=value_clip,
  )
  del metrics[policy_step.TOKEN_SHARE]
  return apply_update(
    state,
    grads,
    losses,
    metrics,
    tx=tx,
    schedule=schedule,
    critic_tx=critic_tx,
    critic_schedule=critic_schedule,
  )


# The `ppo` section: GAE, the critic and the adaptive KL controller.
SECTION = checks.Section(
  'ppo',
  {
    'ppo.gamma': checks.fraction(),
    'ppo.lam': checks.fraction(),
    'ppo.value_clip': checks.non_negative(),
    'ppo.critic_lr': checks.positive(),
    'ppo.kl_target': checks.positive(),
    'ppo.kl_horizon': checks.count(1),
  },
)
SECTIONS = (*online.SECTIONS, SECTION)


def make_critic(config, resources, policy_params, key):
  """(graphdef, params) of the critic: `ppo.critic_path` (a reward model's
  export) if set, else the policy's backbone with a fresh scalar head. The
  critic takes the policy's `model.remat` and `model.scan_layers`, never its
  LoRA adapters: all of it trains."""
  if config.ppo.critic_path:
    model_section = config.model
    ck = hf_lib.load(
      config.ppo.critic_path,
      mesh=resources.mesh,
      lm_head=False,
      scalar_head=True,
      head_key=key,
      remat='none'
      if model_section.remat == 'auto'
      else model_section.remat,  # 'auto': the update's plan
      scan_layers=model_section.scan_layers,
    )
    return ck.graphdef, ck.params
  return setup.critic_from_policy(resources.model.config, policy_params, key, resources.mesh)


class Steps(NamedTuple):
  """The jitted functions of a PPO run."""

  ppo: Any  # the update step: (state, PPOBatch) -> (state, metrics)
  logprobs: Any  # (params, tokens, mask) -> logp [B, T]
  values: Any  # (critic params, tokens, mask) -> [B, T]
  gae: Any  # (token rewards, values, mask) -> (advantages, returns), each [B, T]


def make_update(config, resources, critic, optimizers, shardings):
  """The update of a PPO run (train_step), not yet jitted; `critic` is
  (graphdef, params), `optimizers` ((tx, schedule), (critic_tx, critic_schedule))."""
  (tx, schedule), (critic_tx, critic_schedule) = optimizers
  return common.Update(
    (train_step, loss_and_grads, apply_update),
    model=dict(
      graphdef=resources.model.graphdef,
      critic_graphdef=critic[0],
      step_config=policy_step.step_config(
        config.rl, config.train.chunk_size, config.sampling.temperature
      ),
      value_clip=config.ppo.value_clip,
    ),
    optim=dict(tx=tx, schedule=schedule, critic_tx=critic_tx, critic_schedule=critic_schedule),
    shardings=shardings,
    mesh=resources.mesh,
    models={'graphdef': resources.params, 'critic_graphdef': critic[1]},
    additive=ADDITIVE_METRICS,
    token_share=policy_step.TOKEN_SHARE,
    compiler_options=resources.train_xla,
  )


def probe_batch(resources, staleness, tokens, mask, loss_mask):
  """The PPOBatch the memory plan compiles the update for (as `grpo.probe_batch`)."""
  put = lambda x: common.place_global(x, resources.batch_sharding)
  z = put(np.zeros(tokens.shape, np.float32))
  is_weights = put(np.ones(tokens.shape, np.float32)) if staleness else None
  valid = online.place_valid(np.ones(tokens.shape[0], bool), resources.batch_sharding)
  return PPOBatch(put(tokens), put(mask), put(loss_mask), z, z, z, z, z, is_weights, valid=valid)


class PPO(online.Run):
  """The job of a PPO run (arguments: as `grpo.GRPO`)."""

  def __init__(
    self, config, make_worker=rollout.RolloutWorker, sft_batch=sft.response_batch, sections=SECTIONS
  ):
    self.config = config
    rl, ppo = config.rl, config.ppo
    resources, rollout_mesh, rows = online.start(config, sections)
    self.resources = resources

    # The optimisers: the policy's, and the critic's (the whole critic trains).
    self.tx, schedule = setup.optimizer(config)
    critic_optim = config.optim.copy_and_resolve_references()
    with critic_optim.unlocked():
      critic_optim.lr = ppo.critic_lr
    self.critic_tx, critic_schedule = make_optimizer(critic_optim)
    self.critic_key = jax.random.PRNGKey(setup.seed(config.seed, 'critic'))
    # The adaptive controller drives the KL penalty in the reward (as in veRL);
    # a KL term in the loss keeps the fixed `rl.kl_coef` it was compiled with.
    self.kl_in_reward = rl.kl_in == 'reward'
    if ppo.adaptive_kl and self.kl_in_reward:
      self.kl_ctl = L.adaptive_kl_controller(rl.kl_coef, ppo.kl_target, ppo.kl_horizon)
    else:
      self.kl_ctl = L.fixed_kl_controller(rl.kl_coef)
    self.uses_ref = rl.kl_coef > 0

    # State: the policy, its reference, the critic and the KL controller.
    sft_tx = setup.sft_optimizer(config)[0]
    self.state = self.new_state(resources.params, sft_tx if config.sft.steps else self.tx)
    self.warmup = sft.Warmup.of(config, resources, self.state, sft_batch)
    self.worker, self.topology = online.finish(config, resources, rollout_mesh, rows, make_worker)

    # The update: its memory plan chosen first, then the step jitted with it.
    shardings = setup.step_shardings(self.state, resources.mesh)
    critic = (self.critic_graphdef, self.state.extra.critic.params)
    optimizers = ((self.tx, schedule), (self.critic_tx, critic_schedule))
    update_fns = make_update(config, resources, critic, optimizers, shardings)
    update_step = self.plan_update(update_fns, probe_batch, models=2)  # policy and critic
    values = jax.jit(functools.partial(critic_values, self.critic_graphdef))
    self.steps = Steps(
      update_step,
      self.logprobs,
      parallel.on_mesh(resources.mesh, common.with_packer(values, self.packer)),
      jax.jit(functools.partial(L.gae, gamma=ppo.gamma, lam=ppo.lam)),
    )

  def new_state(self, params, tx):
    """Policy state with the reference, a critic built from `params` and the
    KL controller (at the start, and again when RL begins)."""
    self.critic_graphdef, critic_params = make_critic(
      self.config, self.resources, params, self.critic_key
    )
    extra = common.AlgorithmState(
      ref_params=jax.tree.map(jnp.copy, params) if self.uses_ref else None,
      critic=common.init_state(critic_params, self.critic_tx),
      kl_ctl=self.kl_ctl.init(),
      reward_moments=online.reward_state(self.config.reward),
    )
    return setup.new_state(params, tx, self.resources.mesh, extra)

  def start_rl(self, state):
    """A fresh optimiser, the policy as the reference, a new critic."""
    return self.new_state(state.params, self.tx)

  def batch(self, state, generated, old_logp, is_weights, metrics):
    """The critic's values, the KL-shaped token rewards, GAE (whitened) and
    the PPOBatch of a placed rollout; the rows left out (`generated.valid`)
    get no reward, advantage or return and count in no statistic."""
    rl = self.config.rl
    mask = online.trained_mask(generated)
    beta = float(state.extra.kl_ctl.coef)  # read before the state is donated
    kl = jnp.zeros_like(generated.old_logp)
    response = generated.batch.loss_mask  # the KL is measured on every response
    if self.uses_ref:
      kl = L.kl_penalty(
        generated.old_logp, generated.ref_logp, estimator=rl.kl.estimator, mask=response
      )
    token_rewards = L.token_level_rewards(
      jnp.asarray(generated.rewards), mask, kl=kl, kl_coef=beta if self.kl_in_reward else 0.0
    )
    critic = state.extra.critic
    old_values = common.minibatched(
      self.steps.values,
      critic.params,
      generated.batch,
      rl.minibatch_size,
      self.resources.batch_sharding,
    )
    adv, returns = self.steps.gae(token_rewards, old_values, mask)
    adv = L.whiten(adv, mask)
    metrics['actor/kl_coef'] = beta
    metrics['rollout/kl'] = float(L.token_mean(kl, response))
    metrics['critic/values_mean'] = float(L.token_mean(old_values, mask))
    metrics['critic/returns_mean'] = float(L.token_mean(returns, mask))
    full = PPOBatch(
      generated.batch.tokens,
      generated.batch.mask,
      generated.batch.loss_mask,  # the layout's: where each prompt ends
      old_logp,
      generated.ref_logp,
      adv,
      returns,
      old_values,
      is_weights,
      valid=generated.valid,
    )
    return full, adv

  def update(self, state, minibatch):
    return self.steps.ppo(state, minibatch)

  def after(self, state, generated, metrics):
    """The KL controller, updated by the KL the rollout measured."""
    del generated
    rl = self.config.rl
    n = rl.prompts_per_step * rl.group_size
    new_ctl = self.kl_ctl.update(state.extra.kl_ctl, metrics['rollout/kl'], n)
    return state._replace(extra=state.extra.replace(kl_ctl=new_ctl))


ALGORITHM = checks.register(
  checks.Algorithm('ppo', PPO, SECTIONS, steps_section='rl', online=True, standalone_eval=True)
)
