"""The rollout worker: prompts in, scored completions out.

`RolloutWorker` owns the prompt stream's use, the encoder, the sampler and
the reward service behind one interface,

    worker.sample(params, iteration, version=None) -> Rollout   # host arrays
    worker.evaluate(params, step) -> {'eval/accuracy': ...}      # held-out (held_out.py)
    worker.close()

The agent's episode runner (`jrl.trainers.rollouts.episodes.EpisodeWorker`) is a
second implementation of the same interface. A topology
(`jrl.trainers.rollouts.topology`) decides which parameters a worker samples with and
when; the algorithm never calls the sampler itself.

`Rollout` is the one container of a generated batch: the worker fills the
host side (tokens, the sampler's logprobs, raw rewards, the rows that enter
training, metrics); the online controller places it on the mesh and adds
reference logprobs (`jrl.trainers.online.place_rollout`).

Unscored is not wrong: a completion whose total lacks a reward function's
score (it returned None, failed, timed out, the remote total did not
arrive) is left out of training by default (`reward.unscored='drop'`: its
`valid` row is False, so it has advantage 0, is outside its group's
statistics and outside the loss), and counted (`samples/unscored`,
`samples/left_out`). `reward.unscored='value'` trains it with
`reward.unscored_value` in its total instead, as a score.
"""

import threading
import time
from typing import NamedTuple

import jax
import numpy as np

from jrl import distributed, rewards, sampler
from jrl.rewards import shaping as reward_norm
from jrl.rewards.base import scored_rows
from jrl.rewards.format import overlong_penalty
from jrl.rewards.server import RemoteRewardService
from jrl.trainers import checks, common, signals
from jrl.trainers.evaluation.held_out import HeldOut, decode
from jrl.trainers.rollouts import engines
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
  # [B·G] bool: the rows that enter training (False: an unscored completion
  # left out, `reward.unscored='drop'`); None: every row. Laid out by rows once placed.
  valid: np.ndarray | jax.Array | None = None
  # signals.Unscored per reward function: what the first draw left unscored.
  unscored: tuple = ()


def unscored_counts(scored):
  """A ScoredBatch's unscored completions per reward function, as
  `signals.Unscored` (the fraction of the batch, failed and timed-out chunks)."""
  return tuple(
    signals.Unscored(
      name,
      float(np.mean(~np.isfinite(values))),
      int(scored.failures[name]),
      int(scored.timeouts[name]),
    )
    for name, values in scored.per_fn.items()
  )


# The reward service ---------------------------------------------------------------


UNSCORED = ('drop', 'value')  # the choices of `reward.unscored`

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
  lambda config, batch_shards: check_reward(config.reward),
)


def check_reward(reward_config):
  """The `reward` section's choices and its code reward."""
  unscored = reward_config.unscored
  checks.need(
    unscored in UNSCORED,
    'reward.unscored',
    f"must be one of {UNSCORED} ('drop': an unscored completion is left out of the "
    "loss and its group's advantages; 'value': it counts `reward.unscored_value`), "
    f'got {unscored!r}.',
  )
  check_code_reward(reward_config)


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
  fns = {}
  if reward_config.model_path:
    from jrl.rewards.model import RewardModel

    fns['reward_model'] = RewardModel.load(reward_config.model_path, tokenizer, mesh=mesh)
  if reward_config.judge_path:
    from jrl.rewards.judge import GenerativeJudge

    judge = GenerativeJudge.load(
      reward_config.judge_path,
      tokenizer,
      reward_config.judge_rubric,
      mode='score',
      max_new_tokens=reward_config.judge_max_new_tokens,
      max_prompt_len=reward_config.judge_max_prompt_len,
      mesh=mesh,
    )
    fns['judge'] = judge.as_reward_fn()
  return fns


def make_scorer(reward_config, tokenizer, mesh, is_main):
  """(reward service, sandbox level or None). Starts the worker processes; a
  code reward refuses here, at start-up, unless its sandbox is isolated or
  `reward.sandbox_unsafe` opts in."""
  if reward_config.url:
    remote = RemoteRewardService(
      reward_config.url,
      timeout_s=reward_config.timeout_s,
      unscored_value=reward_config.unscored_value,
    )
    return remote, None
  level = None
  sandboxed = [name for name in reward_config.functions if rewards.uses_sandbox(name)]
  if sandboxed:
    level = rewards.code.configure_sandbox(
      reward_config.sandbox_unsafe, rewards.code.Settings.of(reward_config)
    )
    if is_main:
      print(f'{", ".join(sandboxed)}: sandbox isolation {level!r}', flush=True)
  service = rewards.RewardService(
    reward_config.functions,
    reward_config.weights,
    unscored_value=reward_config.unscored_value,
    mode=reward_config.mode,
    workers=reward_config.workers,
    timeout_s=reward_config.timeout_s,
    inline_fns=inline_reward_fns(reward_config, tokenizer, mesh),
  )
  return service, level


def function_weights(reward_config):
  """{name: weight} of the local reward functions (`scored_rows`); None for
  a reward server, whose functions and weights are its own."""
  if reward_config.url:
    return None
  names = tuple(reward_config.functions)
  weights = tuple(reward_config.weights) or (1.0,) * len(names)
  return dict(zip(names, weights, strict=False))


def tied_groups(total_BxG, valid_BxG):
  """[B] bool: the groups whose valid rewards are all equal, or that have
  at most one valid reward: no signal for a group baseline."""
  most = np.where(valid_BxG, total_BxG, -np.inf).max(axis=1)
  least = np.where(valid_BxG, total_BxG, np.inf).min(axis=1)
  return (most == least) | (valid_BxG.sum(axis=1) <= 1)


def pack_completions(prompts, completions, seq_len, pad_id):
  """(SequenceBatch, old_logp [B·G, T]): one row per completion, prompt +
  completion tokens, with the sampler's logprobs on the completion."""
  batch = common.pack_sequences(prompts, [c.tokens for c in completions], seq_len, pad_id)
  old_logp = np.zeros(batch.tokens.shape, np.float32)
  for row, c in enumerate(completions):
    start = len(prompts[row])
    old_logp[row, start : start + len(c.tokens)] = c.logprobs
  return batch, old_logp


# The worker ---------------------------------------------------------------------


class RolloutWorker:
  """Generates and scores groups of G completions for B prompts.

  Touches only the sampler, the RL prompt stream and the reward service, so
  `sample` may run in a background thread while the trainer updates
  (one-step-off); `evaluate` takes the same lock around the sampler.
  """

  def __init__(self, resources, mesh, prompt_rows):
    """`resources`: setup.Resources; `mesh`: where the sampler runs; `prompt_rows`:
    (lo, hi), this process's prompts of each batch."""
    config = resources.config
    self.config = config
    self.tokenizer = resources.tokenizer
    self.encoder = resources.encoder
    self.stream = resources.streams['rl_stream']
    self.stop_tokens = resources.stop_tokens
    self.seq_len = resources.seq_len
    self.tracer = resources.tracer
    self.prompt_rows = prompt_rows
    self.lock = threading.Lock()
    sizes = (config.rl.group_size,)
    if resources.task.held_out:
      sizes += engines.eval_group_sizes(config)
    self.engine = engines.build_engine(config, resources.model, mesh, resources.stop_tokens, sizes)
    self.engine.tracer = resources.tracer
    self.held_out = HeldOut.of_run(resources, self.engine, self.lock)
    self.scorer, self.sandbox_level = make_scorer(
      config.reward, resources.tokenizer, mesh, resources.is_main
    )
    self.weights = function_weights(config.reward)
    self.drop_unscored = config.reward.unscored == 'drop'
    self.last_errors = []  # the reward service's first errors of the latest batch
    self.last_samples = []  # the latest batch's first group, for the sample log

  def evaluate(self, params, step=None):
    return self.held_out.evaluate(params, step)

  def close(self):
    self.scorer.close()
    self.held_out.close()
    if hasattr(self.engine, 'close'):  # an outside engine's processes (optional in the contract)
      self.engine.close()

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

  def _generate(self, prompt_ids, draw, params, iteration, version, options):
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
      weights = self.engine.load_weights(params, version)
      groups = self.engine.generate(
        weights, requests, group_size=self.config.rl.group_size, **options
      )
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
    metrics = {}
    for name, values in scored.per_fn.items():
      scored_values = values[np.isfinite(values)]
      metrics[f'reward/{name}/mean'] = float(scored_values.mean()) if scored_values.size else 0.0
      metrics[f'reward/{name}/std'] = float(scored_values.std()) if scored_values.size else 0.0
      metrics[f'reward/{name}/unscored'] = float(scored.unscored[name])
      metrics[f'reward/{name}/failures'] = float(scored.failures[name])
      metrics[f'reward/{name}/timeouts'] = float(scored.timeouts[name])
      metrics[f'reward/{name}/unscored_frac'] = float(np.mean(~np.isfinite(values)))
    if self.sandbox_level is not None:  # 3 full, 2 no cgroup, 1 degraded (unsafe opt-in)
      metrics['reward/sandbox_isolation'] = float(rewards.sandbox.isolation_metric())
    if scored.errors:
      self.last_errors = list(scored.errors)
      print('reward errors (scored as unscored):\n  ' + '\n  '.join(scored.errors))
    return metrics

  # The interface ----------------------------------------------------------------

  def sample(self, params, iteration, version=None, **options):
    """Generates and scores one batch of groups; returns a Rollout of host arrays.

    `iteration` seeds the sampling (the iteration that will train on it);
    `version` is the iteration whose parameters `params` are (default: the
    same); `options` go to the engine's `generate` (partial rollouts:
    `weights_at`, `kv_on_swap`).

    DAPO's dynamic sampling drops groups whose rewards are all equal (no
    signal) and draws more prompts until `prompts_per_step` groups are kept;
    if `dynamic_sampling_max_draws` runs out, dropped groups fill up. With
    `reward.unscored='drop'` only a group's scored completions count there.
    A generated task that observes its scores (a curriculum,
    `jrl.data.reasoning_gym`) sees every draw's, dropped groups' too
    (`PromptStream.observe`), and adds its metrics.
    """
    rl = self.config.rl
    version = iteration if version is None else version
    g, b = rl.group_size, rl.prompts_per_step
    plo, phi = self.prompt_rows
    metrics = {}
    kept, dropped = [], []
    t_gen = t_reward = 0.0
    zero_var_groups = drawn_groups = gen_tokens = 0
    first_scored = None
    observed = []  # each draw's scores, for a task that sees them (a curriculum)
    # Prompt accounting: the stream index of this rollout's first prompt, and its
    # policy version (consecutive rollouts: first prompts `groups/drawn` apart).
    metrics['rollout/first_prompt'] = float(self.stream.position)
    metrics['rollout/version'] = float(version)
    for draw in range(1 + (rl.dynamic_sampling_max_draws if rl.dynamic_sampling else 0)):
      start_position = self.stream.position
      examples = self.stream.next(b, self.prompt_rows)
      prompt_ids = self._gather_prompts([self.encoder.prompt_ids(ex['prompt']) for ex in examples])
      start = time.perf_counter()
      with self.tracer.span('generate', iteration=iteration, draw=draw):
        requests, groups = self._generate(prompt_ids, draw, params, iteration, version, options)
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
      complete = scored_rows(scored, self.weights).reshape(b, g)
      valid = complete if self.drop_unscored else np.ones_like(complete)
      t_reward += time.perf_counter() - start
      if self.stream.observes:
        observed.append((start_position, scored.per_fn, np.where(valid, total, np.nan).ravel()))
      zero_var = tied_groups(total, valid)
      zero_var_groups += int(zero_var.sum())
      drawn_groups += b
      for j in range(b):
        item = (requests[j], groups[j], total[j], complete[j], valid[j])
        (dropped if rl.dynamic_sampling and zero_var[j] else kept).append(item)
      if len(kept) >= b:
        break
    if rl.dynamic_sampling:
      metrics['groups/dynamic_sampling_short'] = float(len(kept) < b)
    kept = (kept + dropped)[:b]
    requests = [k[0] for k in kept]
    groups = [k[1] for k in kept]
    rewards_np = np.concatenate([k[2] for k in kept]).astype(np.float32)
    complete_np = np.concatenate([k[3] for k in kept])
    valid_np = np.concatenate([k[4] for k in kept])
    self.last_samples = [
      {
        'prompt': decode(self.tokenizer, requests[0].prompt, ()),
        'completion': decode(self.tokenizer, c.tokens, self.stop_tokens),
        'reward': float(kept[0][2][k]),
        'scored': bool(kept[0][3][k]),  # False: `reward` is a stand-in (`reward.unscored`)
        'finish_reason': c.finish_reason,
      }
      for k, c in enumerate(groups[0])
    ]

    # Rows: prompt + completion, with the sampler's logprobs on the completion.
    prompts = [r.prompt for r in requests for _ in range(g)]
    completions = [c for grp in groups for c in grp]
    batch, old_logp = pack_completions(prompts, completions, self.seq_len, self.tokenizer.pad_id)
    lengths = np.asarray([len(c.tokens) for c in completions])

    # Over the rewards trained on (with 'drop', the unscored are none of them).
    trained = rewards_np[valid_np]
    metrics['reward/mean'] = float(trained.mean()) if trained.size else 0.0
    metrics['reward/std'] = float(trained.std()) if trained.size else 0.0
    metrics.update(self._reward_metrics(first_scored))
    metrics.update(self.stream.observe(observed, g))
    metrics['reward/length_corr'] = reward_norm.length_correlation(trained, lengths[valid_np])
    metrics['response_length/mean'] = float(lengths.mean())
    metrics['response_length/max'] = float(lengths.max())
    metrics['response_length/clip_ratio'] = float(
      np.mean([c.finish_reason == 'length' for c in completions])
    )
    metrics['groups/zero_variance_frac'] = zero_var_groups / drawn_groups
    metrics['groups/drawn'] = float(drawn_groups)
    # What happened to every sample generated: trained on, or dropped by
    # dynamic sampling (never for being late: a rollout is trained on whatever
    # its version).
    metrics['samples/generated'] = float(drawn_groups * g)
    metrics['samples/trained'] = float(b * g)
    metrics['samples/dropped'] = float((drawn_groups - b) * g)
    # Of the rows trained on: completions whose total lacks a score, and those
    # left out of the loss for it (all of them with `reward.unscored='drop'`,
    # else none).
    metrics['samples/unscored'] = float((~complete_np).sum())
    metrics['samples/left_out'] = float((~valid_np).sum())
    metrics['time/generate'] = t_gen
    metrics['time/reward'] = t_reward
    metrics['throughput/generate_tokens_per_s'] = gen_tokens / max(t_gen, 1e-9)
    metrics.update(version_metrics(completions, iteration))
    return Rollout(
      batch,
      old_logp,
      rewards_np,
      version,
      metrics,
      valid=valid_np,
      unscored=unscored_counts(first_scored),
    )


def version_metrics(completions, iteration):
  """Partial rollouts (`Completion.versions`): the share of the model's
  tokens at each staleness s = iteration - version (`rollout/token_staleness/s`,
  the tokens per version), their mean, and the most versions one sample
  holds. {} when every token comes from the rollout's one version."""
  if not completions or completions[0].versions is None:
    return {}
  stale = np.concatenate(
    [
      iteration - c.versions[~c.env_mask] if c.env_mask is not None else iteration - c.versions
      for c in completions
    ]
  )
  metrics = {'rollout/token_staleness_mean': float(stale.mean()) if stale.size else 0.0}
  for s in range(int(stale.max()) + 1 if stale.size else 0):
    metrics[f'rollout/token_staleness/{s}'] = float(np.mean(stale == s))
  metrics['rollout/versions_per_sample_max'] = float(
    max(len(np.unique(c.versions)) for c in completions)
  )
  return metrics
