"""Pieces shared by the on-policy algorithms (GRPO family, PPO, agent): the
devices split by the topology, this process's prompt rows, reward shaping,
placing a rollout on the mesh with its reference logprobs, and minibatched
epochs of an update step.

Offline algorithms (SFT, DPO, reward model) import nothing from here.
"""

import abc
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jrl import distributed, parallel
from jrl import losses as L
from jrl.data import layouts
from jrl.rewards import shaping as reward_norm
from jrl.trainers import checks, common, controller, memory_plan, policy_step, setup, sft, signals
from jrl.trainers.rollouts import contracts, correction, engines, rollout, topology


def check_rl(config, batch_shards):
  """The `rl` section between its fields, against the task and the devices."""
  rl, need = config.rl, checks.need
  need(
    rl.group_size >= 2 or rl.advantage not in L.GROUP_ADVANTAGES,
    'rl.group_size',
    f'must be >= 2 for the group estimator {rl.advantage!r}.',
  )
  estimators, policy_losses = tuple(L.ADVANTAGE_ESTIMATORS), tuple(L.POLICY_LOSSES)
  need(rl.advantage in estimators, 'rl.advantage', f'must be one of {estimators}.')
  need(rl.policy_loss in policy_losses, 'rl.policy_loss', f'one of {policy_losses}.')
  for field, choices in CHOICES.items():
    present, value = checks.lookup(config, field)
    need(not present or value in choices, field, f'must be one of {choices}, got {value!r}.')
  # Every kernel's section, by the kernel's own argument checks; the chosen
  # ones become the run's objective the same way (policy_step.objective_of).
  for section, make, names in (
    ('adv', L.Advantage.make, L.ADVANTAGE_ESTIMATORS),
    ('loss', L.PolicyLoss.make, L.POLICY_LOSSES),
  ):
    for name in rl[section]:
      need(name in names, f'rl.{section}.{name}', f'is not one of {tuple(names)}.')
      make(name, dict(rl[section][name]), f'rl.{section}')
  policy_step.objective_of(rl)
  rows = rl.prompts_per_step * rl.group_size
  need(
    rows % rl.minibatch_size == 0,
    'rl.minibatch_size',
    f'must divide prompts_per_step x group_size = {rows}.',
  )
  checks.batch_divides(rl.minibatch_size, 'rl.minibatch_size', batch_shards)
  need(
    rl.minibatch_by != 'group' or rl.minibatch_size % rl.group_size == 0,
    'rl.minibatch_by',
    f"'group' needs rl.minibatch_size ({rl.minibatch_size}) to be a multiple of "
    f'rl.group_size ({rl.group_size}).',
  )
  need(
    0 <= rl.overlong_buffer < config.task.max_response_len,
    'rl.overlong_buffer',
    'must be in [0, task.max_response_len).',
  )
  check_bounded_when_stale(config)
  need(rl.kl_in in ('loss', 'reward'), 'rl.kl_in', "must be 'loss' or 'reward'.")
  need(
    rl.kl.estimator != 'k3_ratio_corrected' or rl.kl_in == 'loss',
    'rl.kl.estimator',
    "'k3_ratio_corrected' weights the KL by π/π_old, which exists only in the loss: "
    "set rl.kl_in='loss' or another estimator.",
  )
  train = config.train
  if train.shared_prompt:
    row = layouts.shared_row_len(
      config.task.max_prompt_len, rl.group_size, config.task.max_response_len
    )
    need(
      not train.micro_batch_tokens or train.micro_batch_tokens >= row,
      'train.micro_batch_tokens',
      f'must be 0 or hold one shared-prompt row of a group ({row} tokens) with '
      'train.shared_prompt on.',
    )
    need(
      not rl.router_aux_coef,
      'rl.router_aux_coef',
      'counts each token once per sequence; with train.shared_prompt a prompt is '
      'computed once per group: set it to 0 or turn train.shared_prompt off.',
    )
  need(
    rl.prompts_per_step % jax.process_count() == 0,
    'rl.prompts_per_step',
    f'must be divisible by the number of processes ({jax.process_count()}).',
  )


def check_bounded_when_stale(config):
  """Stale rollouts need a policy loss that bounds the ratio π/π_old
  (`L.unbounded_reason`), unless `rl.allow_unbounded_async` says otherwise."""
  rl, k = config.rl, topology.staleness(config)
  if not k or rl.allow_unbounded_async:
    return
  reason = L.unbounded_reason(L.PolicyLoss(rl.policy_loss, tuple(rl.loss[rl.policy_loss].items())))
  bounded = tuple(name for name in L.POLICY_LOSSES if not L.unbounded_reason(L.PolicyLoss(name)))
  checks.need(
    reason is None,
    'rl.allow_unbounded_async',
    f'is False, but topology.kind={config.topology.kind!r} trains on rollouts up to {k} '
    f'policy versions stale with an unbounded policy loss: rl.policy_loss={reason}. '
    'A stale rollout then moves the policy without limit (tinker-cookbook PR #822: '
    'sampler-trainer KL x30 and entropy collapse at staleness 3). Use a clipped or masked '
    f'loss {bounded} or set rl.allow_unbounded_async=True.',
  )


# The fields of `rl` that take one of a few values.
CHOICES = {
  'rl.allow_unbounded_async': (True, False),
  'rl.minibatch_by': ('auto', 'row', 'group'),
}
# The `rl` section: the online algorithms' iterations, rollout batch and policy loss.
RL = checks.Section(
  'rl',
  {
    'rl.steps': checks.count(0),
    'rl.prompts_per_step': checks.count(1),
    'rl.group_size': checks.count(1),
    'rl.epochs': checks.count(1),
    'rl.minibatch_size': checks.count(1),
    # rl.adv.<name>.<argument>, rl.loss.<name>.<argument>, rl.reduction.<argument>,
    # rl.kl.<argument> and rl.off_policy_mask_threshold are kernel arguments: the
    # kernels' own checks run on them in check_rl (policy_step.objective_of).
    'rl.kl_coef': checks.non_negative(),
    'rl.entropy_coef': checks.Range(False),
    'rl.overlong_buffer': checks.count(0),
    'rl.overlong_penalty': checks.non_negative(),
    'rl.dynamic_sampling_max_draws': checks.count(0),
    'rl.router_aux_coef': checks.non_negative(),
  },
  check_rl,
)
# What every online algorithm reads besides the shared sections.
SECTIONS = (sft.SECTION, RL, engines.SAMPLING, engines.SAMPLER, rollout.REWARD, topology.SECTION)


def start(config, sections=SECTIONS):
  """(Resources, rollout mesh, prompt rows): the set-up of an online run up
  to the model, with every config check (of the shared sections and the
  algorithm's `sections`) that needs no model."""
  topology_config = config.topology
  rollout_devices = topology_config.rollout_devices if topology_config.kind != 'colocated' else 0
  resources, rollout_mesh = setup.start(config, sections, rollout_devices)
  rollout.check_reward_functions(config.reward)
  return resources, rollout_mesh, prompt_rows(config, resources.batch_sharding)


def prompt_rows(config, batch_sharding):
  """(lo, hi): the prompts whose groups this process's devices hold. Data
  loading is sharded by process: each reads only those rows."""
  rl = config.rl
  g = rl.group_size
  lo, hi = distributed.local_rows(batch_sharding, rl.prompts_per_step * g)
  if lo % g or hi % g:
    raise ValueError(
      f'`rl.group_size`: process {jax.process_index()} holds rollout rows [{lo}, {hi}), '
      f'which split groups of {g}; make prompts_per_step x group_size / processes a '
      'multiple of group_size.'
    )
  return lo // g, hi // g


def finish(config, resources, rollout_mesh, rows, make_worker):
  """(worker, topology). Called last: the worker starts reward processes once
  nothing else in the set-up can fail."""
  worker = make_worker(resources, rollout_mesh, rows)
  if not isinstance(worker, contracts.RolloutWorker):
    raise TypeError(f'{type(worker).__name__} is no contracts.RolloutWorker')
  topo = topology.make(
    config.topology,
    config.sampler.decode_weights,
    worker,
    resources,
    rollout_mesh,
    checks.iterations(config),
  )
  return worker, topo


def reward_state(reward_config):
  """What reward shaping keeps in the train state (`AlgorithmState.reward_moments`):
  with `reward.normalize` the running moments (`jrl.rewards.shaping`, as
  float32 scalars, checkpointed with the state), else None."""
  if not reward_config.normalize:
    return None
  return jax.tree.map(jnp.float32, reward_norm.init())


def shape_rewards(state, raw, reward_config, metrics, valid=None):
  """(state, shaped rewards [N]): `raw` [N] clipped (`reward.clip`), or with
  `reward.normalize` normalised by the running moments in the state
  after this batch's rows that `valid` ([N] bool, None: all) keeps are
  folded in; the new moments go back into the state. Runs in the main
  thread in step order, so a resumed run shapes alike."""
  clip = reward_config.clip
  if not reward_config.normalize:
    return state, reward_norm.clip_rewards(raw, clip)
  raw = np.asarray(raw)
  kept = np.ones(len(raw), bool) if valid is None else np.asarray(valid, bool)
  held = state.extra.reward_moments
  moments = reward_norm.update(reward_norm.RunningMoments(*map(float, held)), raw[kept])
  shaped = reward_norm.normalize(moments, raw, clip=clip)
  metrics['reward/running_mean'] = float(moments.mean)
  metrics['reward/running_std'] = reward_norm.std(moments)
  metrics['reward/shaped_mean'] = float(shaped[kept].mean()) if kept.any() else 0.0
  new = jax.tree.map(lambda x, old: jax.device_put(jnp.float32(x), old.sharding), moments, held)
  return state._replace(extra=state.extra.replace(reward_moments=new)), shaped


def valid_rows(generated):
  """[B·G] bool host array: the rows of a worker's Rollout that enter
  training (`Rollout.valid`; every row when the worker sets none)."""
  if generated.valid is None:
    return np.ones(len(generated.rewards), bool)
  return np.asarray(generated.valid, bool)


def rows_sharding(sharding, rank):
  """`sharding`, the layout of [B, T] batch arrays, for an array of rank
  `rank`: its rows split the same way, its other axes whole."""
  if not isinstance(sharding, NamedSharding):
    return sharding  # one device: any rank
  spec = tuple(sharding.spec)
  rows = spec[0] if spec else None
  return NamedSharding(sharding.mesh, PartitionSpec(*([rows] + [None] * (rank - 1))[:rank]))


def place_valid(valid, batch_sharding):
  """A [B] host array that every process holds whole, laid out by rows as
  `batch_sharding` lays out [B, T] arrays."""
  return common.place_global(valid, rows_sharding(batch_sharding, 1))


def trained_mask(generated):
  """[B, T] bool: the response tokens of a placed rollout's valid rows."""
  return L.valid_token_mask(generated.batch.loss_mask, generated.valid)


def place_rollout(generated, resources, logprobs, ref_params, rows):
  """A worker's Rollout (its rewards shaped) placed on the mesh, with
  reference logprobs (`logprobs(params, tokens, mask)` over minibatches of
  `rows`; zeros when `ref_params` is None) and `valid` a [B·G] bool array
  laid out by rows (every row when the worker set none)."""
  metrics = dict(generated.metrics)
  start = time.perf_counter()
  placed = common.place(generated.batch, resources.batch_sharding)
  ref_logp = jnp.zeros(generated.batch.tokens.shape, jnp.float32)
  if ref_params is not None:
    with resources.tracer.span('reference'):
      ref_logp = common.minibatched(logprobs, ref_params, placed, rows, resources.batch_sharding)
      jax.block_until_ready(ref_logp)
  t_ref = time.perf_counter() - start
  metrics['time/reference'] = t_ref
  num_tokens = int(np.asarray(generated.batch.mask).sum())
  if ref_params is not None:
    metrics['throughput/reference_tokens_per_s'] = num_tokens / max(t_ref, 1e-9)
  return generated._replace(
    batch=placed,
    old_logp=common.place(generated.old_logp, resources.batch_sharding),
    ref_logp=ref_logp,
    metrics=metrics,
    num_tokens=num_tokens,
    valid=place_valid(valid_rows(generated), resources.batch_sharding),
  )


def _take_rows(full, idx, sharding):
  """The rows `idx` [b] of a pytree of [B, ...] arrays, each laid out by
  rows as `sharding` lays out [B, T] arrays: one program for every leaf."""
  leaves, treedef = jax.tree.flatten(full)
  return _row_taker(sharding, treedef, tuple(x.ndim for x in leaves))(full, idx)


@functools.cache
def _row_taker(sharding, treedef, ranks):
  out = jax.tree.unflatten(treedef, [rows_sharding(sharding, r) for r in ranks])
  return jax.jit(lambda full, idx: jax.tree.map(lambda x: x[idx], full), out_shardings=out)


def whole_groups(rl, shared_prompt):
  """Whether minibatches are drawn as whole groups (`rl.minibatch_by`):
  'group', or 'auto' with `shared_prompt` (`train.shared_prompt`: a group in
  one minibatch has its prompt computed once) and `rl.minibatch_size` a
  multiple of `rl.group_size`; else ('row', 'auto' otherwise) as single rows."""
  by = rl.get('minibatch_by', 'auto')
  if by == 'auto':
    return bool(shared_prompt) and rl.minibatch_size % rl.group_size == 0
  return by == 'group'


def run_minibatches(
  step, state, full, rl, iteration, sharding, packer=None, *, seed, shared_prompt=False
):
  """`rl.epochs` passes of `step` over minibatches of `full` (a pytree of
  [B·G, ...] arrays), in permutations fixed by (`seed`, iteration): of rows,
  or of whole groups (`whole_groups(rl, shared_prompt)`).

  With a `packer` (common.make_packer) each minibatch's sequences are packed
  into rows (`full.packed` set per minibatch): the same minibatches in the
  same order, so the optimiser sees the same updates.

  Returns:
    (state, metrics averaged over minibatches, seconds).
  """
  start = time.perf_counter()
  rows = rl.prompts_per_step * rl.group_size
  mb = rl.minibatch_size
  by_group = whole_groups(rl, shared_prompt)
  results = []
  efficiency = []
  if packer is not None:
    host = [distributed.fetch(x) for x in (full.tokens, full.mask, full.loss_mask)]
  for epoch in range(rl.epochs):
    rng = np.random.default_rng(setup.seed(seed, iteration, 'perm', epoch))
    g = rl.group_size
    if by_group:
      perm = (rng.permutation(rows // g)[:, None] * g + np.arange(g)).reshape(-1)
    else:
      perm = rng.permutation(rows)
    for k in range(rows // mb):
      order = np.sort(perm[k * mb : (k + 1) * mb])
      mini = _take_rows(full, jnp.asarray(order), sharding)
      distributed.settle(mini)
      if packer is not None:
        mini = mini._replace(packed=packer.for_step(*(x[order] for x in host)))
        efficiency.append((*packer.last, len(mini.packed) if packer.budget else 1))
      state, update_metrics = distributed.settle(step(state, mini))
      results.append(update_metrics)
  results = jax.device_get(results)
  metrics = {k: float(np.mean([u[k] for u in results])) for k in results[0]}
  if efficiency:
    metrics['throughput/real_token_frac_padded'] = float(np.mean([e[0] for e in efficiency]))
    metrics['throughput/real_token_frac_packed'] = float(np.mean([e[1] for e in efficiency]))
    if packer.budget:
      metrics['throughput/micro_batches'] = float(np.mean([e[2] for e in efficiency]))
  # The first minibatch is scored before any update: the sampler/trainer gap.
  if 'actor/logp_diff_abs' in results[0]:
    metrics['actor/logp_diff_abs'] = float(results[0]['actor/logp_diff_abs'])
  for k in results[0]:  # a skip in any minibatch is the iteration's
    if k.rpartition('/')[2] in (signals.NONFINITE, signals.NONFINITE_LOSS):
      metrics[k] = float(np.max([u[k] for u in results]))
  return state, metrics, time.perf_counter() - start


def logprobs_fn(graphdef, temperature, chunk_size, packer=None, compiler_options=None):
  """(params, tokens, mask) -> [B, T] logprobs at the sampling `temperature`
  (the reference and proximal passes), the logits in chunks of `chunk_size`
  positions; with a `packer` (common.make_packer) the model runs on packed
  rows; `compiler_options`: XLA's for the program (`train.xla_flags`)."""
  logprobs = jax.jit(
    functools.partial(
      common.token_logprobs, graphdef, temperature=temperature, chunk_size=chunk_size
    ),
    compiler_options=compiler_options,
  )
  return common.with_packer(lambda *args: logprobs(*args)[0], packer)


class Run(controller.Job):
  """An online algorithm's job: `sft.steps` SFT warm-up iterations, then RL
  iterations (`rl_iteration`) that call the algorithm's parts, its methods:

    batch(state, placed rollout, behaviour or proximal logprobs, importance
      weights or None, metrics) -> (the update's batch, advantages [B, T]):
      GRPO's group advantages, PPO's critic values and GAE; it may add metrics.
    update(state, minibatch) -> (state, metrics): the jitted update step.
    after(state, placed rollout, metrics) -> state, once the update is done
      (PPO's KL controller).

  A subclass's constructor sets the run up (`start`, `finish`,
  `memory_plan.plan_update`) and sets `config`, `resources`, `state`,
  `warmup` (sft.Warmup), `worker`, `topology`, `logprobs` (the reference
  and proximal passes), `packer` and `memory_plan`.
  """

  def iterate(self, state, it):
    if it < self.config.sft.steps:
      return self.warmup.iterate(state, it)
    return self.rl_iteration(state, it)

  def plan_update(self, update, probe_batch, models=1):
    """The jitted update step of `update` (a common.Update), with the remat
    policy and micro-batch budget `memory_plan.plan_update` chooses for it
    first (`probe_batch(resources, staleness, tokens, mask, loss_mask)`: the
    update's batch; `models`: how many models of the policy's size it
    trains). Sets `memory_plan`, `packer` (the plan's budget) and
    `logprobs` (the reference and proximal passes, laid out by `packer`)."""
    config, resources = self.config, self.resources
    self.memory_plan, self.packer = memory_plan.plan_update(
      resources,
      self.state,
      common.make_packer(config.train, resources.seq_len, resources.batch_sharding),
      update,
      functools.partial(probe_batch, resources, self.topology.staleness),
      train=config.train,
      remat=config.model.remat,
      rl=config.rl,
      task=config.task,
      models=models,
      worker=self.worker,
    )
    # Traced under the training mesh (attention kernels per shard, `parallel.on_mesh`).
    self.logprobs = parallel.on_mesh(
      resources.mesh,
      logprobs_fn(
        resources.model.graphdef,
        config.sampling.temperature,
        config.train.chunk_size,
        self.packer,
        resources.train_xla,
      ),
    )
    return update.jit(self.memory_plan.budget, self.memory_plan.remat)

  def rl_iteration(self, state, it):
    """One RL iteration, top to bottom: the rollout (its worker, through the
    topology) -> rewards shaped -> placed on the mesh, the reference pass ->
    for a rollout of an older policy, the proximal pass and its importance
    weights -> `batch` and its advantages -> `rl.epochs` passes of `update`
    over minibatches -> `after` -> (state, signals.Report): metrics, the
    models whose update skipped, what the rollout left unscored."""
    config, resources, topo = self.config, self.resources, self.topology
    rl = config.rl
    t_step = time.perf_counter()
    generated = topo.next_rollout(state.params, it)
    state, shaped = shape_rewards(
      state, generated.rewards, config.reward, generated.metrics, valid_rows(generated)
    )
    ref_params = state.extra.ref_params
    generated = place_rollout(
      generated._replace(rewards=shaped), resources, self.logprobs, ref_params, rl.minibatch_size
    )
    metrics = dict(generated.metrics)
    old_logp, is_weights = generated.old_logp, None
    recompute = correction.recomputes_logprobs(config.sampler)
    if topo.staleness or recompute:
      old_logp, is_weights, corrected = correction.proximal(
        self.logprobs,
        state.params,
        generated,
        it,
        resources,
        rows=rl.minibatch_size,
        topology_config=config.topology,
        recompute=recompute,
      )
      metrics.update(corrected)
    full, adv = self.batch(state, generated, old_logp, is_weights, metrics)
    with topo.update_window(), resources.tracer.span('update', iteration=it):
      state, update_metrics, t_update = run_minibatches(
        self.update,
        state,
        full,
        rl,
        it,
        resources.batch_sharding,
        self.packer,
        seed=config.seed,
        shared_prompt=config.train.get('shared_prompt', False),
      )
    metrics.update(update_metrics)
    metrics.update(advantage_metrics(adv, trained_mask(generated)))
    state = self.after(state, generated, metrics)
    topo.publish(state.params, it + 1)  # partial rollouts in flight may move to it
    metrics['time/update'] = t_update
    metrics['time/step'] = time.perf_counter() - t_step
    metrics['throughput/update_tokens_per_s'] = (
      rl.epochs * generated.num_tokens / max(t_update, 1e-9)
    )
    metrics['phase'] = 1.0
    report = signals.Report(
      metrics, signals.skipped(update_metrics, ('actor', 'critic')), generated.unscored
    )
    return state, report

  @abc.abstractmethod
  def batch(self, state, generated, old_logp, is_weights, metrics):
    """(the update's batch, advantages [B, T]) of a placed rollout."""

  @abc.abstractmethod
  def update(self, state, minibatch):
    """(state, metrics): the jitted update step on one minibatch."""

  def after(self, state, generated, metrics):
    del generated, metrics
    return state

  def evaluate(self, state):
    return self.worker.evaluate(self.topology.rollout_params(state.params), int(state.step))

  def reward_errors(self):
    return self.worker.last_errors

  def samples(self):
    return self.worker.last_samples

  def close(self):
    self.worker.close()


def advantage_metrics(adv, loss_mask):
  """Mean, std and range of the advantages on the tokens trained on."""
  values = distributed.fetch(adv)[distributed.fetch(loss_mask)]
  if not values.size:  # every completion left out
    return {f'advantages/{k}': 0.0 for k in ('mean', 'std', 'max', 'min')}
  return {
    'advantages/mean': float(values.mean()),
    'advantages/std': float(values.std()),
    'advantages/max': float(values.max()),
    'advantages/min': float(values.min()),
  }
