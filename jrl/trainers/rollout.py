"""The rollout worker: prompts in, scored completions out.

`RolloutWorker` owns the prompt stream's use, the encoder, the sampler and
the reward service behind one interface,

    worker.sample(params, iteration, version=None) -> Rollout   # host arrays
    worker.evaluate(params, step) -> {'eval/accuracy': ...}      # held-out (held_out.py)
    worker.close()

The agent's episode runner (`jrl.trainers.episodes.EpisodeWorker`) is a
second implementation of the same interface. A topology
(`jrl.trainers.topology`) decides which parameters a worker samples with and
when; the algorithm never calls the sampler itself.

`Rollout` is the one container of a generated batch: the worker fills the
host side (tokens, the sampler's logprobs, raw rewards, metrics); the
online controller places it on the mesh and adds reference logprobs
(`jrl.trainers.online.place_rollout`).
"""

import threading
import time
from typing import NamedTuple

import jax
import numpy as np

from jrl import distributed, plugins, rewards, sampler
from jrl.rewards import shaping as reward_norm
from jrl.rewards.format import overlong_penalty
from jrl.rewards.server import RemoteRewardService
from jrl.trainers import checks, common, contracts, topology
from jrl.trainers.held_out import HeldOut, decode
from jrl.trainers.setup import seed


class Rollout(NamedTuple):
  """One batch of B·G scored samples, rows b·G + g."""

  batch: common.SequenceBatch  # [B·G, T] prompt + completion rows
  old_logp: np.ndarray | jax.Array  # [B·G, T] the sampler's logprobs on completion tokens
  rewards: np.ndarray  # [B·G] float32 total reward (raw; shaped once placed)
  version: int  # the iteration whose parameters generated it
  metrics: dict
  ref_logp: jax.Array | None = None  # [B·G, T] reference logprobs, once placed
  num_tokens: int = 0  # real tokens in the batch, once placed


# The sampler and the reward service ---------------------------------------------


def eval_group_sizes(config):
  """The group sizes of the held-out evaluation: 1 (greedy) and `eval.samples`."""
  return (1, int(config.eval.samples)) if config.eval.samples else (1,)


def build_sampler(config, model, mesh, stop_tokens, group_sizes=None, **engine_overrides):
  """A paged sampler for `model` on `mesh`, sized by `sampler.*` and `task.*`
  (`engine_overrides`: EngineConfig fields, e.g. room for forced tokens).

  With `sampler.num_pages` = 0 the page pool holds every slot's worst case
  for each of `group_sizes` (default: `rl.group_size`): groups share their
  prompt pages, so the greedy held-out evaluation (groups of 1) needs more
  pages per slot than GRPO's groups, and a pool sized for the latter would
  leave slots idle during it.

  With `sampler.replicas` R > 1 the slots are split into R data-parallel
  replicas over the mesh's batch axes, each with a pool of its own (sized
  for its S/R slots); whole groups go to one replica."""
  tk, sc = config.task, config.sampler
  sizes = group_sizes or (config.rl.group_size,)
  per_replica = sc.num_slots // sc.replicas
  num_pages = sc.num_pages or max(
    sampler.pool_pages(tk.max_prompt_len, tk.max_response_len, g, sc.page_size, per_replica)
    for g in sizes
  )
  engine_config = sampler.EngineConfig(
    num_slots=sc.num_slots,
    num_pages=num_pages,
    page_size=sc.page_size,
    max_prompt_len=tk.max_prompt_len,
    max_new_tokens=tk.max_response_len,
    max_stop_tokens=max(1, len(stop_tokens)),
    attention_impl=sc.attention_impl,
  )._replace(**engine_overrides)
  try:
    return sampler.Sampler(
      model.graphdef,
      model.config,
      engine_config,
      steps_per_dispatch=sc.steps_per_dispatch,
      mesh=mesh,
      replicas=sc.replicas,
    )
  except ValueError as e:
    if 'replicas' not in str(e):
      raise
    raise ValueError(f'`sampler.replicas`: {e}') from None


def build_engine(config, model, mesh, stop_tokens, group_sizes=None, **engine_overrides):
  """The rollout engine `sampler.engine` names: jrl's paged sampler
  (`build_sampler`) for 'jrl', else the `contracts.Engine` that the factory
  at that import path makes from the same arguments. Raises ValueError
  naming the field when the path does not load or the object is no engine."""
  name = config.sampler.engine
  if name == 'jrl':
    return build_sampler(config, model, mesh, stop_tokens, group_sizes, **engine_overrides)
  factory = plugins.load_object(name, '`sampler.engine`')
  if not callable(factory):
    raise ValueError(f'`sampler.engine` {name!r}: a {type(factory).__name__} is not a factory.')
  engine = factory(config, model, mesh, stop_tokens, group_sizes, **engine_overrides)
  if not isinstance(engine, contracts.Engine):
    raise ValueError(
      f'`sampler.engine` {name!r} made a {type(engine).__name__}, which is no engine: it needs '
      '`generate(params, requests, *, group_size, share_prompt, on_turn_end)`, `stats` and '
      '`tracer` (jrl.trainers.contracts.Engine).'
    )
  return engine


DECODE_WEIGHTS = ('auto', 'gathered', 'sharded')


def check_sampler(config, batch_shards):
  """The `sampler` section against the rollout's groups (a group's samples decode together)."""
  sc, need = config.sampler, checks.need
  need(
    sc.engine == 'jrl' or plugins.is_import_path(sc.engine),
    'sampler.engine',
    "must be 'jrl' (the paged sampler) or an import path 'package.module:make_engine'.",
  )
  need(sc.decode_weights in DECODE_WEIGHTS, 'sampler.decode_weights', f'one of {DECODE_WEIGHTS}.')
  need(sc.num_slots % sc.replicas == 0, 'sampler.replicas', 'must divide sampler.num_slots.')
  need(
    batch_shards % sc.replicas == 0,
    'sampler.replicas',
    f'must be 1, mesh.data or mesh.data x mesh.fsdp (the batch shards: {batch_shards}).',
  )
  if 'rl' in config:
    need(
      sc.num_slots // sc.replicas >= config.rl.group_size,
      'sampler.num_slots',
      'divided by sampler.replicas must be >= rl.group_size (a group decodes on one replica).',
    )


SAMPLING = checks.Section(
  'sampling',
  {
    'sampling.temperature': checks.positive(),
    'sampling.top_k': checks.count(0),
    'sampling.top_p': checks.fraction(lo_open=True),
    'sampling.min_new_tokens': checks.count(0),
  },
  lambda config, batch_shards: checks.need(
    config.sampling.min_new_tokens <= config.task.max_response_len,
    'sampling.min_new_tokens',
    f'must be at most task.max_response_len = {config.task.max_response_len}.',
  ),
)
SAMPLER = checks.Section(
  'sampler',
  {
    'sampler.num_slots': checks.count(1),
    'sampler.page_size': checks.count(1),
    'sampler.num_pages': checks.count(2, also=(0,)),  # page 0 is scratch; 0: sized automatically
    'sampler.steps_per_dispatch': checks.count(1),
    'sampler.replicas': checks.count(1),
  },
  check_sampler,
)
REWARD = checks.Section(
  'reward',
  {
    'reward.unscored_value': checks.Range(False),
    'reward.workers': checks.count(1),
    'reward.timeout_s': checks.positive(),
    'reward.max_unscored_frac': checks.fraction(),
    'reward.max_unscored_steps': checks.count(1),
    'reward.judge_max_new_tokens': checks.count(1),
    'reward.judge_max_prompt_len': checks.count(1),
    'reward.clip': checks.non_negative(),
    'reward.code.budget_s': checks.positive(),
    'reward.code.concurrency': checks.count(0),
    'reward.code.case_wall_s': checks.non_negative(),
  },
  lambda config, batch_shards: check_code_reward(config.reward),
)


def check_code_reward(reward_config):
  """`reward.code`: its names, and a budget the reward service's timeout leaves room for."""
  if 'code' not in reward_config:
    return
  settings = rewards.code.Settings.of(reward_config)
  if 'code_tests' in reward_config.functions and not reward_config.url:
    checks.need(
      settings.budget_s < reward_config.timeout_s,
      'reward.code.budget_s',
      f'must be below reward.timeout_s = {reward_config.timeout_s} (a chunk that misses the '
      "service's deadline is unscored as a whole).",
    )


def check_reward_functions(reward_config):
  """Looks every reward function up now: an unknown name fails at set-up."""
  if not reward_config.url:
    for name in reward_config.functions:
      if name not in ('reward_model', 'judge'):
        rewards.get_reward_fn(name)


def inline_reward_fns(reward_config, tokenizer, mesh):
  """Reward functions that need this process's state: a jrl reward model, a judge."""
  rc = reward_config
  fns = {}
  if rc.model_path:
    from jrl.rewards.model import RewardModel

    fns['reward_model'] = RewardModel.load(rc.model_path, tokenizer, mesh=mesh)
  if rc.judge_path:
    from jrl.rewards.judge import GenerativeJudge

    judge = GenerativeJudge.load(
      rc.judge_path,
      tokenizer,
      rc.judge_rubric,
      mode='score',
      max_new_tokens=rc.judge_max_new_tokens,
      max_prompt_len=rc.judge_max_prompt_len,
      mesh=mesh,
    )
    fns['judge'] = judge.as_reward_fn()
  return fns


def make_scorer(reward_config, tokenizer, mesh, is_main):
  """(reward service, sandbox level or None). Starts the worker processes; a
  code reward refuses here, at start-up, unless its sandbox is isolated or
  `reward.sandbox_unsafe` opts in."""
  rc = reward_config
  if rc.url:
    remote = RemoteRewardService(rc.url, timeout_s=rc.timeout_s, unscored_value=rc.unscored_value)
    return remote, None
  level = None
  if 'code_tests' in rc.functions:
    level = rewards.code.configure_sandbox(rc.sandbox_unsafe, rewards.code.Settings.of(rc))
    if is_main:
      print(f'code_tests: sandbox isolation {level!r}', flush=True)
  service = rewards.RewardService(
    rc.functions,
    rc.weights,
    unscored_value=rc.unscored_value,
    mode=rc.mode,
    workers=rc.workers,
    timeout_s=rc.timeout_s,
    inline_fns=inline_reward_fns(rc, tokenizer, mesh),
  )
  return service, level


def pack_completions(prompts, completions, seq_len, pad_id):
  """(SequenceBatch, old_logp [B·G, T]): one row per completion, prompt +
  completion tokens, with the sampler's logprobs on the completion."""
  batch = common.pack_sequences(prompts, [c.tokens for c in completions], seq_len, pad_id)
  old_logp = np.zeros(batch.tokens.shape, np.float32)
  for row, c in enumerate(completions):
    start = len(prompts[row])
    old_logp[row, start : start + len(c.tokens)] = c.logprobs
  return batch, old_logp


def held_out_evaluator(res):
  """`evaluate(state)` for the algorithms without a rollout worker: held-out
  accuracy with a greedy sampler of its own, built at the first evaluation
  (never, with `eval.every` = 0 or no held-out examples); returns (evaluate,
  close). Under fsdp it reads a copy of the parameters in the decode layout,
  made per evaluation, where `sampler.decode_weights` says so (as a colocated
  rollout does, `topology.decode_shardings`)."""
  held_out = []
  layout = []

  def evaluate(state):
    if not res.task.held_out:
      return {}
    if not held_out:
      mode = res.config.sampler.decode_weights
      layout.append(topology.decode_shardings(mode, res.mesh, res.model.config, state.params))
      sampler_ = build_engine(
        res.config, res.model, res.mesh, res.stop_tokens, eval_group_sizes(res.config)
      )
      sampler_.tracer = res.tracer
      held_out.append(
        HeldOut(
          res.config,
          res.encoder,
          res.tokenizer,
          res.stop_tokens,
          res.task.held_out,
          sampler_,
          threading.Lock(),
          res.tracer,
        )
      )
    params = state.params
    if layout[0] is not None:
      with res.tracer.span('reshard'):
        params = jax.block_until_ready(jax.device_put(params, layout[0]))
    return held_out[0].evaluate(params, step=int(state.step))

  def close():
    for h in held_out:
      h.close()

  return evaluate, close


# The worker ---------------------------------------------------------------------


class RolloutWorker:
  """Generates and scores groups of G completions for B prompts.

  Touches only the sampler, the RL prompt stream and the reward service, so
  `sample` may run in a background thread while the trainer updates
  (one-step-off); `evaluate` takes the same lock around the sampler.
  """

  def __init__(self, res, mesh, prompt_rows):
    """`res`: setup.Resources; `mesh`: where the sampler runs; `prompt_rows`:
    (lo, hi), this process's prompts of each batch."""
    config = res.config
    self.config = config
    self.tokenizer = res.tokenizer
    self.encoder = res.encoder
    self.stream = res.streams['rl_stream']
    self.stop_tokens = res.stop_tokens
    self.seq_len = res.seq_len
    self.tracer = res.tracer
    self.prompt_rows = prompt_rows
    self.lock = threading.Lock()
    sizes = (config.rl.group_size,)
    if res.task.held_out:
      sizes += eval_group_sizes(config)
    self.sampler = build_engine(config, res.model, mesh, res.stop_tokens, sizes)
    self.sampler.tracer = res.tracer
    self.held_out = HeldOut(
      config,
      res.encoder,
      res.tokenizer,
      res.stop_tokens,
      res.task.held_out,
      self.sampler,
      self.lock,
      res.tracer,
    )
    self.scorer, self.sandbox_level = make_scorer(config.reward, res.tokenizer, mesh, res.is_main)
    self.last_errors = []  # the reward service's first errors of the latest batch
    self.last_samples = []  # the latest batch's first group, for the sample log

  def evaluate(self, params, step=None):
    return self.held_out.evaluate(params, step)

  def close(self):
    self.scorer.close()
    self.held_out.close()

  # Pieces of a sample ---------------------------------------------------------

  def _gather_prompts(self, ids_local):
    """Every process's prompt token lists, in global order."""
    if jax.process_count() == 1:
      return ids_local
    width = self.config.task.max_prompt_len
    padded = np.zeros((len(ids_local), width + 1), np.int32)
    for row, ids in enumerate(ids_local):
      if len(ids) > width:
        raise ValueError(f'a prompt of {len(ids)} tokens exceeds `task.max_prompt_len`={width}.')
      padded[row, 0] = len(ids)
      padded[row, 1 : 1 + len(ids)] = ids
    return [list(r[1 : 1 + r[0]]) for r in distributed.gather_rows(padded)]

  def _generate(self, prompt_ids, draw, params, iteration):
    sp = self.config.sampling
    requests = [
      sampler.Request(
        prompt=ids,
        max_new_tokens=self.config.task.max_response_len,
        min_new_tokens=sp.min_new_tokens,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        stop_tokens=self.stop_tokens,
        seed=seed(self.config.seed, iteration, draw, i),
      )
      for i, ids in enumerate(prompt_ids)
    ]
    with self.lock:
      groups = self.sampler.generate(params, requests, group_size=self.config.rl.group_size)
    return requests, groups

  def _score(self, examples, groups):
    """Scores this process's groups; returns the batch's ScoredBatch (all processes)."""
    g = self.config.rl.group_size
    texts = [decode(self.tokenizer, c.tokens, self.stop_tokens) for grp in groups for c in grp]
    prompts = [self.encoder.prompt_text(ex['prompt']) for ex in examples for _ in range(g)]
    meta = [ex for ex in examples for _ in range(g)]
    scored = self.scorer(prompts, texts, meta)
    if jax.process_count() == 1:
      return scored
    names = sorted(scored.per_fn)
    counts = np.asarray(
      [[scored.unscored[n], scored.failures[n], scored.timeouts[n]] for n in names], np.int64
    )
    counts = distributed.gather_rows(counts[None]).sum(axis=0)
    return rewards.ScoredBatch(
      total=distributed.gather_rows(scored.total),
      per_fn={n: distributed.gather_rows(scored.per_fn[n]) for n in names},
      unscored={n: int(c[0]) for n, c in zip(names, counts, strict=True)},
      failures={n: int(c[1]) for n, c in zip(names, counts, strict=True)},
      timeouts={n: int(c[2]) for n, c in zip(names, counts, strict=True)},
      errors=scored.errors,
    )

  def _reward_metrics(self, scored):
    """Per reward function: mean and std of the scored values, unscored,
    failed and timed-out counts, and the unscored fraction."""
    m = {}
    for name, values in scored.per_fn.items():
      scored_values = values[np.isfinite(values)]
      m[f'reward/{name}/mean'] = float(scored_values.mean()) if scored_values.size else 0.0
      m[f'reward/{name}/std'] = float(scored_values.std()) if scored_values.size else 0.0
      m[f'reward/{name}/unscored'] = float(scored.unscored[name])
      m[f'reward/{name}/failures'] = float(scored.failures[name])
      m[f'reward/{name}/timeouts'] = float(scored.timeouts[name])
      m[f'reward/{name}/unscored_frac'] = float(np.mean(~np.isfinite(values)))
    if self.sandbox_level is not None:  # 3 full, 2 no cgroup, 1 degraded (unsafe opt-in)
      m['reward/sandbox_isolation'] = float(rewards.sandbox.isolation_metric())
    if scored.errors:
      self.last_errors = list(scored.errors)
      print('reward errors (scored as unscored):\n  ' + '\n  '.join(scored.errors))
    return m

  # The interface ----------------------------------------------------------------

  def sample(self, params, iteration, version=None):
    """Generates and scores one batch of groups; returns a Rollout of host arrays.

    `iteration` seeds the sampling (the iteration that will train on it);
    `version` is the iteration whose parameters `params` are (default: the same).

    DAPO's dynamic sampling drops groups whose rewards are all equal (no
    signal) and draws more prompts until `prompts_per_step` groups are kept;
    if `dynamic_sampling_max_draws` runs out, dropped groups fill up.
    """
    rl = self.config.rl
    g, b = rl.group_size, rl.prompts_per_step
    plo, phi = self.prompt_rows
    m = {}
    kept, dropped = [], []
    t_gen = t_reward = 0.0
    zero_var_groups = drawn_groups = gen_tokens = 0
    first_scored = None
    for draw in range(1 + (rl.dynamic_sampling_max_draws if rl.dynamic_sampling else 0)):
      examples = self.stream.next(b, self.prompt_rows)
      prompt_ids = self._gather_prompts([self.encoder.prompt_ids(ex['prompt']) for ex in examples])
      start = time.perf_counter()
      with self.tracer.span('generate', iteration=iteration, draw=draw):
        requests, groups = self._generate(prompt_ids, draw, params, iteration)
      t_gen += time.perf_counter() - start
      gen_tokens += sum(len(c.tokens) for grp in groups for c in grp)
      start = time.perf_counter()
      with self.tracer.span('reward', iteration=iteration):
        scored = self._score(examples, groups[plo:phi])
      first_scored = first_scored or scored
      lengths = [len(c.tokens) for grp in groups for c in grp]
      penalty = overlong_penalty(
        lengths, self.config.task.max_response_len, rl.overlong_buffer, rl.overlong_penalty
      )
      total = (scored.total - penalty).reshape(b, g)
      t_reward += time.perf_counter() - start
      zero_var = total.max(axis=1) == total.min(axis=1)
      zero_var_groups += int(zero_var.sum())
      drawn_groups += b
      for j in range(b):
        item = (requests[j], groups[j], total[j])
        (dropped if rl.dynamic_sampling and zero_var[j] else kept).append(item)
      if len(kept) >= b:
        break
    if rl.dynamic_sampling:
      m['groups/dynamic_sampling_short'] = float(len(kept) < b)
    kept = (kept + dropped)[:b]
    requests = [k[0] for k in kept]
    groups = [k[1] for k in kept]
    rewards_np = np.concatenate([k[2] for k in kept]).astype(np.float32)
    self.last_samples = [
      {
        'prompt': decode(self.tokenizer, requests[0].prompt, ()),
        'completion': decode(self.tokenizer, c.tokens, self.stop_tokens),
        'reward': float(kept[0][2][k]),
        'finish_reason': c.finish_reason,
      }
      for k, c in enumerate(groups[0])
    ]

    # Rows: prompt + completion, with the sampler's logprobs on the completion.
    prompts = [r.prompt for r in requests for _ in range(g)]
    completions = [c for grp in groups for c in grp]
    batch, old_logp = pack_completions(prompts, completions, self.seq_len, self.tokenizer.pad_id)
    lengths = np.asarray([len(c.tokens) for c in completions])

    m['reward/mean'] = float(rewards_np.mean())
    m['reward/std'] = float(rewards_np.std())
    m.update(self._reward_metrics(first_scored))
    m['reward/length_corr'] = reward_norm.length_correlation(rewards_np, lengths)
    m['response_length/mean'] = float(lengths.mean())
    m['response_length/max'] = float(lengths.max())
    m['response_length/clip_ratio'] = float(
      np.mean([c.finish_reason == 'length' for c in completions])
    )
    m['groups/zero_variance_frac'] = zero_var_groups / drawn_groups
    m['groups/drawn'] = float(drawn_groups)
    m['time/generate'] = t_gen
    m['time/reward'] = t_reward
    m['throughput/generate_tokens_per_s'] = gen_tokens / max(t_gen, 1e-9)
    version = iteration if version is None else version
    return Rollout(batch, old_logp, rewards_np, version, m)
