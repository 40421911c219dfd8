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

`train_step(state, batch)` updates policy and critic together; both are
pure and jitted once by the controller.
"""

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jrl import losses as L
from jrl import models
from jrl.models import hf as hf_lib
from jrl.trainers import common, loop, policy
from jrl.trainers.optim import make_optimizer


class PPOBatch(NamedTuple):
  tokens: jax.Array  # [B, L] int32
  mask: jax.Array  # [B, L] bool
  loss_mask: jax.Array  # [B, L] bool response tokens
  old_logp: jax.Array  # [B, L] float32
  ref_logp: jax.Array  # [B, L] float32 (zeros when the KL is in the reward)
  advantages: jax.Array  # [B, L] float32 (whitened GAE)
  returns: jax.Array  # [B, L] float32 value targets
  old_values: jax.Array  # [B, L] float32 critic values at rollout time


def critic_values(graphdef, params, tokens, mask):
  """[B, L] float32: V_t is the critic's value of the prefix before token t
  (its scalar head at position t − 1); 0 at t = 0."""
  v = models.values(graphdef, params, tokens, mask)
  return jnp.pad(v[:, :-1], ((0, 0), (1, 0)))


def value_loss_fn(params, graphdef, batch, value_clip):
  v = critic_values(graphdef, params, batch.tokens, batch.mask)
  per_token, metrics = L.value_loss(
    v, batch.old_values, batch.returns, batch.loss_mask, clip_eps=value_clip or None
  )
  loss = L.token_mean(per_token, batch.loss_mask)
  return loss, {f'critic/{k}': v for k, v in metrics.items()}


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
  cfg,
  value_clip,
):
  """One minibatch update of the policy (PPO clip) and of the critic.

  Returns:
    (state, metrics); a non-finite loss or gradient skips that model's update.
  """
  pbatch = policy.PolicyBatch(
    batch.tokens, batch.mask, batch.loss_mask, batch.old_logp, batch.ref_logp, batch.advantages
  )
  (loss, metrics), grads = jax.value_and_grad(policy.policy_loss, has_aux=True)(
    state.params, graphdef, pbatch, cfg
  )
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule)
  metrics['actor/loss'] = loss
  metrics.update({f'actor/{k}': v for k, v in opt_metrics.items()})

  critic = state.extra['critic']
  (vloss, vmetrics), vgrads = jax.value_and_grad(value_loss_fn, has_aux=True)(
    critic.params, critic_graphdef, batch, value_clip
  )
  critic, copt = common.apply_gradients(critic, vgrads, vloss, critic_tx, critic_schedule)
  metrics.update(vmetrics)
  metrics['critic/vf_loss'] = vloss
  metrics.update({f'critic/{k}': v for k, v in copt.items()})
  return state._replace(extra={**state.extra, 'critic': critic}), metrics


def critic_from_policy(config, policy_params, key, mesh):
  """(graphdef, params) of a critic: a copy of the policy's backbone plus a
  fresh scalar head, laid out on `mesh`."""
  graphdef, fresh = models.create_sharded(config, key, mesh, lm_head=False, scalar_head=True)
  pure = nnx.to_pure_dict(fresh)
  source = nnx.to_pure_dict(policy_params)
  for name in pure:
    if name != 'score':
      pure[name] = jax.tree.map(jnp.copy, source[name])  # own buffers: states are donated
  nnx.replace_by_pure_dict(fresh, pure)
  return graphdef, fresh


class PPOTrainer(loop.Trainer):
  """The controller for PPO: the GRPO controller's rollouts, plus a critic."""

  def _setup_algorithm(self):
    config = self.config
    ppo = config.ppo
    if not 0.0 <= ppo.gamma <= 1.0 or not 0.0 <= ppo.lam <= 1.0:
      raise ValueError('`ppo.gamma` and `ppo.lam` must be in [0, 1].')
    if config.rl.kl_in not in ('loss', 'reward'):
      raise ValueError(f"`rl.kl_in` must be 'loss' or 'reward', got {config.rl.kl_in!r}.")
    critic_optim = config.optim.copy_and_resolve_references()
    with critic_optim.unlocked():
      critic_optim.lr = ppo.critic_lr
    self.critic_tx, self.critic_schedule = make_optimizer(critic_optim)
    self._critic_key = jax.random.PRNGKey(loop._seed(config.seed, 'critic'))
    # The adaptive controller drives the KL penalty in the reward (as in veRL);
    # a KL term in the loss keeps the fixed `rl.kl_coef` it was compiled with.
    adaptive = ppo.adaptive_kl and config.rl.kl_in == 'reward'
    self.kl_ctl = (
      L.adaptive_kl_controller(config.rl.kl_coef, ppo.kl_target, ppo.kl_horizon)
      if adaptive
      else L.fixed_kl_controller(config.rl.kl_coef)
    )

  def _init_extra(self, params):
    extra = super()._init_extra(params)
    ppo = self.config.ppo
    if ppo.critic_path:
      ck = hf_lib.load(
        ppo.critic_path, mesh=self.mesh, lm_head=False, scalar_head=True, head_key=self._critic_key
      )
      self.critic_graphdef, critic_params = ck.graphdef, ck.params
    else:
      self.critic_graphdef, critic_params = critic_from_policy(
        self.model_config, params, self._critic_key, self.mesh
      )
    extra['critic'] = common.init_state(critic_params, self.critic_tx)
    extra['kl_ctl'] = self.kl_ctl.init()
    return extra

  def __init__(self, config):
    super().__init__(config)
    self._ppo_step = jax.jit(
      functools.partial(
        train_step,
        graphdef=self.graphdef,
        critic_graphdef=self.critic_graphdef,
        tx=self.tx,
        schedule=self.schedule,
        critic_tx=self.critic_tx,
        critic_schedule=self.critic_schedule,
        cfg=self.loss_cfg,
        value_clip=config.ppo.value_clip,
      ),
      donate_argnums=(0,),
      out_shardings=self.step_shardings,
    )
    self._values = jax.jit(functools.partial(critic_values, self.critic_graphdef))
    self._gae = jax.jit(functools.partial(L.gae, gamma=config.ppo.gamma, lam=config.ppo.lam))

  def rl_iteration(self):
    rl = self.config.rl
    t_step = time.perf_counter()
    ro = self.collect_rollout()
    m = dict(ro.metrics)
    mask = ro.batch.loss_mask
    beta = float(self.state.extra['kl_ctl'].coef)  # read before the state is donated
    kl = jnp.zeros_like(ro.old_logp)
    if self.uses_ref:
      kl = L.kl_penalty(ro.old_logp, ro.ref_logp, estimator=rl.kl_estimator, mask=mask)
    in_reward = rl.kl_in == 'reward'
    token_rewards = L.token_level_rewards(
      jnp.asarray(ro.rewards), mask, kl=kl, kl_coef=beta if in_reward else 0.0
    )
    critic = self.state.extra['critic']
    old_values = self._minibatched(self._values, critic.params, ro.batch)
    adv, returns = self._gae(token_rewards, old_values, mask)
    adv = L.whiten(adv, mask)
    full = PPOBatch(
      ro.batch.tokens, ro.batch.mask, mask, ro.old_logp, ro.ref_logp, adv, returns, old_values
    )
    um, t_update = self.run_minibatches(self._ppo_step, full)
    m.update(um)
    m.update(loop._advantage_metrics(adv, mask))
    measured_kl = float(L.token_mean(kl, mask))
    n = rl.prompts_per_step * rl.group_size
    new_ctl = self.kl_ctl.update(self.state.extra['kl_ctl'], measured_kl, n)
    self.state = self.state._replace(extra={**self.state.extra, 'kl_ctl': new_ctl})
    m['actor/kl_coef'] = float(beta)
    m['rollout/kl'] = measured_kl
    m['critic/values_mean'] = float(L.token_mean(old_values, mask))
    m['critic/returns_mean'] = float(L.token_mean(returns, mask))
    m['time/update'] = t_update
    m['time/step'] = time.perf_counter() - t_step
    m['throughput/update_tokens_per_s'] = rl.epochs * ro.num_tokens / max(t_update, 1e-9)
    m['phase'] = 1.0
    return m

  def _minibatched(self, fn, params, batch):
    mb = self.config.rl.minibatch_size
    out = [
      fn(params, batch.tokens[k : k + mb], batch.mask[k : k + mb])
      for k in range(0, batch.tokens.shape[0], mb)
    ]
    return jax.device_put(jnp.concatenate(out), self.batch_sharding)
