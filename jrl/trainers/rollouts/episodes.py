"""Multi-turn episodes with tools: the agent's rollout worker.

`EpisodeWorker` implements the rollout worker's interface
(`sample(params, iteration) -> Rollout`, `evaluate(params)`, `close()`; see
`jrl.trainers.rollouts.rollout`) by running one environment (`jrl.envs`) per sample.
The sampler generates a model turn until a turn-ending token (a tool call's
closing `}`) or end of sequence; the environment answers with tokens that
the sampler appends on the sequence's cached pages; this repeats until the
model ends its answer, the environment ends the episode, or a limit is hit
(`agent.max_turns`, the token budget `task.max_response_len`, the per-step
timeout `agent.step_timeout_s`, the episode's `agent.episode_timeout_s`).
An environment that raises, hangs or returns garbage ends only its own
trajectory, with the reason counted.

Environment steps run in a pool of `agent.env_workers` threads
(`jrl.envs.EnvPool`): while one sample waits for its tool, its slot is
parked with its pages and the other slots keep decoding; it continues when
the answer arrives. The trajectories are those of inline stepping
(`agent.env_workers = 0`, each step waited for in the sampler's loop): a
sample's tokens depend on its seed and position, never on when its
environment answered. On more than one process the steps are waited for
as they are submitted (every process's sampler must take the same
decisions at the same moment).

The trainer sees exactly the tokens the sampler produced and the
environment returned (no re-tokenisation), with the loss mask over the
model's tokens only. The reward is the environment's: the final answer's
score plus any step rewards. `demonstration_batch` builds the SFT warm-up's
rows with the same masking (environment tokens are context, never targets).

An episode its environment failed ('env_error', 'env_timeout',
'env_invalid': a tool or server that raised, hung or answered garbage) is
unscored: left out of the loss and of its group's statistics
(`reward.unscored='drop'`), never trained as a 0 reward.

Metrics: `env/turns`, `env/tool_calls`, `env/tool_failures`,
`env/invalid_calls` (means per trajectory), `env/tool_use_rate` (share of
trajectories with a successful tool call), `env/finish/<reason>`, and the
usual `reward/*`.
"""

import collections
import inspect
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from jrl import plugins, sampler
from jrl.envs import arith as arith_env
from jrl.envs.base import FINISH_REASONS, EnvPool, TurnSampling
from jrl.trainers import checks, common, signals
from jrl.trainers.evaluation.held_out import decode
from jrl.trainers.rollouts import engines, rollout
from jrl.trainers.setup import seed

# Finish reasons that are the environment's failure, not the model's: unscored.
ENV_FAILURES = ('env_error', 'env_timeout', 'env_invalid')
# name -> (task with a `demonstration(example, use_tool)`, factory(tokenizer) -> Environment)
ENVIRONMENTS = {'arith_tool': (arith_env.ArithToolTask, arith_env.make_env)}


class EnvSpec(NamedTuple):
  """What `agent.env` names: how to make an environment and, for the SFT
  warm-up, demonstrations of good episodes."""

  make_env: Callable  # tokenizer -> a fresh Environment (one per episode)
  demonstration: Callable | None  # (example, use_tool) -> [(text, by_model)]; None: none


def environment(name):
  """The `EnvSpec` of `agent.env`: a name in `ENVIRONMENTS`, or an import path
  'package.module:factory' of a callable `factory(tokenizer) -> Environment`
  (an `Environment` subclass taking the tokenizer works). The factory's
  `demonstration` attribute, if it has one, gives the SFT warm-up's episodes.
  Raises ValueError naming `agent.env`."""
  if name in ENVIRONMENTS:
    task_cls, make_env = ENVIRONMENTS[name]
    return EnvSpec(make_env, task_cls.demonstration)
  if not plugins.is_import_path(name):
    raise ValueError(
      f'`agent.env` must be one of {sorted(ENVIRONMENTS)} or an import path '
      f'("package.module:factory"), got {name!r}.'
    )
  factory = plugins.load_object(name, '`agent.env`')
  if not callable(factory):
    raise ValueError(
      f'`agent.env` {name!r}: a {type(factory).__name__} is not an environment factory.'
    )
  try:
    inspect.signature(factory).bind(None)
  except TypeError:
    raise ValueError(
      f'`agent.env` {name!r} must be callable as factory(tokenizer) -> Environment.'
    ) from None
  except ValueError:
    pass  # no signature to inspect (a builtin): the first call will tell
  demonstration = getattr(factory, 'demonstration', None)
  if demonstration is not None and not callable(demonstration):
    raise ValueError(f'`agent.env` {name!r}: its `demonstration` is not a function.')
  return EnvSpec(factory, demonstration)


def new_env(spec, tokenizer, name):
  """`spec.make_env(tokenizer)`, refused (naming `agent.env`) unless it has the
  methods of `jrl.envs.Environment` and `turn_stop_tokens` of token ids (run
  once, when the episode worker is built)."""
  env = spec.make_env(tokenizer)
  missing = [m for m in ('reset', 'step', 'final_reward') if not callable(getattr(env, m, None))]
  if missing:
    raise ValueError(
      f'`agent.env` {name!r} made a {type(env).__name__} without {", ".join(missing)}: '
      'subclass jrl.envs.Environment.'
    )
  stops = getattr(env, 'turn_stop_tokens', None)
  if not (
    isinstance(stops, list | tuple)
    and all(isinstance(t, int | np.integer) and 0 <= t < tokenizer.vocab_size for t in stops)
  ):
    raise ValueError(
      f'`agent.env` {name!r}: `turn_stop_tokens` must be a tuple of token ids, got {stops!r}.'
    )
  return env


def check(config, batch_shards=None):
  """Raises ValueError naming the `agent.*` field that is out of place."""
  del batch_shards
  ac = config.agent
  if ac.trainer not in ('grpo', 'ppo'):
    raise ValueError(f"`agent.trainer` must be 'grpo' or 'ppo', got {ac.trainer!r}.")
  spec = environment(ac.env)
  if config.sft.steps and spec.demonstration is None:
    raise ValueError(
      f'`agent.env` {ac.env!r} has no `demonstration(example, use_tool)` for the SFT '
      'warm-up: give its factory one, or set `sft.steps` = 0.'
    )
  if config.rl.dynamic_sampling:
    raise ValueError('`rl.dynamic_sampling` is not supported with `algorithm` "agent".')


# The `agent` section: the environment and the episodes' limits.
SECTION = checks.Section(
  'agent',
  {
    'agent.max_turns': checks.count(1),
    'agent.step_timeout_s': checks.positive(),
    'agent.episode_timeout_s': checks.non_negative(),
    'agent.max_env_tokens': checks.count(1),
    'agent.env_workers': checks.count(0),
    'agent.sft_tool_frac': checks.fraction(),
  },
  check,
)


class Episode:
  """The host-side record of one trajectory."""

  def __init__(self, env):
    self.env = env
    self.turn_start = 0  # where the model's current turn starts in the completion
    self.turns = 0
    self.reward = 0.0
    self.info = collections.Counter()
    self.reason = None
    self.error = ''
    self.started = time.monotonic()  # `agent.episode_timeout_s` counts from here

  def time_left(self, limit_s):
    """Seconds left of an episode limit of `limit_s` (0: none; inf)."""
    return limit_s - (time.monotonic() - self.started) if limit_s else float('inf')


def episode_metrics(episodes, rewards):
  n = max(1, len(episodes))
  metrics = {
    'reward/mean': float(np.mean(rewards)) if len(rewards) else 0.0,
    'env/turns': sum(ep.turns for ep in episodes) / n,
    'env/tool_calls': sum(ep.info['tool_calls'] for ep in episodes) / n,
    'env/tool_failures': sum(ep.info['tool_failures'] for ep in episodes) / n,
    'env/invalid_calls': sum(ep.info['invalid_calls'] for ep in episodes) / n,
    'env/tool_use_rate': float(
      np.mean([ep.info['tool_calls'] > ep.info['tool_failures'] for ep in episodes])
    ),
  }
  reasons = collections.Counter(ep.reason for ep in episodes)
  for reason in FINISH_REASONS:
    metrics[f'env/finish/{reason}'] = reasons.get(reason, 0) / n
  errors = [ep.error for ep in episodes if ep.error]
  if errors:
    print(f'environment failures ({len(errors)}): {errors[0]}')
  return metrics


def environment_unscored(episodes):
  """The episodes their environments failed, as a `signals.Unscored` named
  `signals.ENVIRONMENT`: the fraction of `episodes`, those that raised or
  misbehaved ('env_error', 'env_invalid'), those that hung ('env_timeout'),
  and the first three errors. The controller stops a run that they leave
  mostly unscored, as it does for a reward function (`reward.max_unscored_*`)."""
  reasons = collections.Counter(ep.reason for ep in episodes)
  failed = sum(reasons[r] for r in ENV_FAILURES)
  return signals.Unscored(
    signals.ENVIRONMENT,
    failed / max(1, len(episodes)),
    reasons['env_error'] + reasons['env_invalid'],
    reasons['env_timeout'],
    tuple(ep.error for ep in episodes if ep.reason in ENV_FAILURES and ep.error)[:3],
  )


def turn_sampling(ep):
  """The `TurnSampling` episode `ep`'s environment asks for its next turn,
  checked, or None; an invalid one ends the episode ('env_invalid')."""
  asked = getattr(ep.env, 'sampling', None)
  if asked is None or ep.reason:
    return None
  try:
    if not isinstance(asked, TurnSampling):
      raise ValueError(f'`sampling` must be a TurnSampling, got {type(asked).__name__}')
    return asked.check()
  except ValueError as e:
    ep.reason, ep.error = 'env_invalid', f'sampling: {e}'
    return None


def asked_values(asked, temperature):
  """(turn token limit, temperature) of a `TurnSampling` (or None), its
  None fields read as the run's: no limit, the config's `temperature`."""
  if asked is None:
    return 0, temperature
  return asked.max_tokens or 0, temperature if asked.temperature is None else asked.temperature


def per_sample(values):
  """One value when a group's samples agree, else the list (`sampler.Request`)."""
  return values[0] if len(set(values)) == 1 else list(values)


def reset_group(group, example, pad_id, max_prompt_len=None):
  """The prompt of a group's episodes (`Episode`s), each reset on `example`:
  the first reset's token ids. An environment that fails at its reset ends
  its own episode before its first turn, unscored, never the run: a reset
  that raised ('env_error', e.g. a server that is down), that gave another
  prompt than its group's ('env_invalid': the G samples of a prompt share
  its tokens, so an environment must start the same episode for the same
  example) or a prompt longer than `max_prompt_len` (`task.max_prompt_len`,
  'env_invalid'). A group whose resets all failed gets the prompt [pad_id]."""
  prompt = None
  for ep in group:
    try:
      ids = [int(t) for t in ep.env.reset(example)]
    except Exception as e:
      ep.reason, ep.error = 'env_error', f'reset: {type(e).__name__}: {e}'
      continue
    if max_prompt_len is not None and len(ids) > max_prompt_len:
      ep.reason = 'env_invalid'
      ep.error = f'reset: a prompt of {len(ids)} tokens, over task.max_prompt_len={max_prompt_len}'
    elif prompt is None:
      prompt = ids
    elif ids != prompt:
      ep.reason = 'env_invalid'
      ep.error = "reset: another prompt than its group's first episode's for the same example"
  return prompt if prompt is not None else [pad_id]


def demonstration_batch(config, tokenizer, stop_tokens, seq_len, examples, iteration):
  """SFT rows of tool-use demonstrations (`agent.sft_tool_frac` of them call
  the tool) after the environment's own prompt (`env.reset`); the loss mask
  covers the model's segments and the eos only. A demonstration gives
  [(text or token ids, by_model)]; one that takes an `env` argument gets the
  episode's environment, reset on the example (a chat environment builds
  its segments through its conversation)."""
  ac = config.agent
  rng = np.random.default_rng(seed(config.seed, iteration, 'demo'))
  spec = environment(ac.env)
  takes_env = 'env' in inspect.signature(spec.demonstration).parameters
  eos = list(stop_tokens[:1])
  prompts, responses, masks = [], [], []
  for ex in examples:
    env = spec.make_env(tokenizer)
    prompts.append(list(env.reset(ex)))  # the environment's own prompt (a chat template's)
    use_tool = bool(rng.random() < ac.sft_tool_frac)
    extra = {'env': env} if takes_env else {}
    ids, model = [], []
    for piece, by_model in spec.demonstration(ex, use_tool=use_tool, **extra):
      seg = list(piece) if isinstance(piece, list | tuple) else tokenizer.encode(piece)
      ids += seg
      model += [by_model] * len(seg)
    if not ids or ids[-1] not in stop_tokens:  # a chat turn already ends with its end token
      ids, model = ids + eos, model + [True]
    responses.append(ids)
    masks.append(model)
  batch = common.pack_sequences(prompts, responses, seq_len, tokenizer.pad_id)
  loss_mask = np.zeros_like(batch.loss_mask)
  for row, (p, mk) in enumerate(zip(prompts, masks, strict=True)):
    loss_mask[row, len(p) : len(p) + len(mk)] = mk
  return batch._replace(loss_mask=loss_mask)


class EpisodeWorker:
  """The rollout worker of `algorithm='agent'`: B x G episodes per sample."""

  def __init__(self, resources, mesh, prompt_rows=None):
    del prompt_rows  # one process: every episode runs here
    config = resources.config
    self.config = config
    self.tokenizer = resources.tokenizer
    self.stream = resources.streams['rl_stream']
    self.held_out = resources.task.held_out
    self.stop_tokens = resources.stop_tokens
    self.seq_len = resources.seq_len
    self.vocab_size = resources.model.config.vocab_size
    self.tracer = resources.tracer
    self.lock = threading.Lock()
    self.last_errors = []  # environment errors are in the episodes' metrics
    self.last_samples = []  # the latest batch's first group, for the sample log
    spec = environment(config.agent.env)
    self.make_env = spec.make_env
    self.turn_stops = tuple(new_env(spec, resources.tokenizer, config.agent.env).turn_stop_tokens)
    # Room for the environment's answers (fed through the decode loop) and
    # for the turn-ending tokens among the stop tokens.
    self.engine = engines.build_engine(
      config,
      resources.model,
      mesh,
      resources.stop_tokens,
      max_forced_tokens=config.agent.max_env_tokens,
      max_stop_tokens=len(resources.stop_tokens) + 2,
    )
    self.engine.tracer = resources.tracer
    self.pool = EnvPool(max(1, config.agent.env_workers), name='env')
    # Parked samples need every process to see the same answers at the same
    # moment; with several processes each step is waited for, as it is with
    # an engine that cannot park (`contracts.Engine.generate`).
    self.parking = (
      config.agent.env_workers > 0
      and jax.process_count() == 1
      and getattr(self.engine, 'parks_turns', False)
    )

  def close(self):
    self.pool.close()

  def run_episodes(
    self, params, examples, *, group_size, greedy, iteration, version, draw=0, **options
  ):
    """(requests, [len(examples)][G] (Completion, Episode)), generated by
    `params`, the policy's version `version`."""
    ac = self.config.agent
    episodes = [
      [Episode(self.make_env(self.tokenizer)) for _ in range(group_size)] for _ in examples
    ]
    pad = self.tokenizer.pad_id
    limit = self.config.task.max_prompt_len
    prompts = [
      reset_group(group, ex, pad, limit) for group, ex in zip(episodes, examples, strict=True)
    ]
    stops = set(self.stop_tokens)
    temperature = self.config.sampling.temperature
    # What each environment asks for its first turn (a black-box agent's request).
    first = [[asked_values(turn_sampling(ep), temperature) for ep in group] for group in episodes]

    def settle(ep, end, outcome):
      """The sampler's answer for episode `ep`'s step outcome; `end`: the
      completion's length when the turn ended."""
      step, failure, message = outcome
      if failure:
        ep.reason, ep.error = failure, message
        return failure
      ep.info.update(step.info)
      ep.reward += float(step.reward)
      if step.done:
        ep.reason = 'done'
        return 'done'
      ep.turn_start = end + len(step.tokens)
      asked = turn_sampling(ep)
      if ep.reason:
        return ep.reason
      if asked is None:
        return list(step.tokens)
      return sampler.Continuation(list(step.tokens), *asked_values(asked, temperature))

    def on_turn_end(i, g, tokens, logprobs=None):
      ep = episodes[i][g]
      if ep.reason:  # its reset failed (`reset_group`): it ends at its first turn's end
        return ep.reason
      if int(tokens[-1]) in stops and int(tokens[-1]) not in self.turn_stops:
        return 'stop'  # the model ended its answer (a chat turn's end: the environment says)
      ep.turns += 1
      if ep.turns > ac.max_turns:
        ep.reason = 'max_turns'
        return ep.reason
      left = ep.time_left(ac.get('episode_timeout_s', 0.0))
      if left <= 0:
        ep.reason, ep.error = 'env_timeout', 'the episode ran past `agent.episode_timeout_s`'
        return ep.reason
      outcome = self.pool.submit(
        ep.env,
        [int(t) for t in tokens[ep.turn_start :]],
        timeout_s=min(ac.step_timeout_s, left),
        vocab_size=self.vocab_size,
        max_tokens=ac.max_env_tokens,
        logprobs=None if logprobs is None else logprobs[ep.turn_start :],
      )
      if not self.parking:
        return settle(ep, len(tokens), outcome.result())
      return EnvPool.then(outcome, lambda out: settle(ep, len(tokens), out))

    requests = [
      sampler.Request(
        prompt=p,
        max_new_tokens=self.config.task.max_response_len,
        temperature=per_sample([t for _, t in asks]),
        top_k=self.config.sampling.top_k,
        top_p=self.config.sampling.top_p,
        greedy=greedy,
        stop_tokens=tuple(self.stop_tokens) + self.turn_stops,
        seed=seed(self.config.seed, iteration, draw, i),
        turn_max_tokens=per_sample([cap for cap, _ in asks]),
      )
      for i, (p, asks) in enumerate(zip(prompts, first, strict=True))
    ]
    with self.lock:
      weights = self.engine.load_weights(params, version)
      groups = self.engine.generate(
        weights, requests, group_size=group_size, on_turn_end=on_turn_end, **options
      )
    out = []
    for i, group in enumerate(groups):
      row = []
      for g, c in enumerate(group):
        ep = episodes[i][g]
        ep.reason = ep.reason or c.finish_reason
        if c.finish_reason == 'stop' and ep.reason == 'stop':
          text = self.tokenizer.decode(
            [int(t) for t in c.tokens if int(t) not in stops], skip_special_tokens=True
          )
          ep.reward += ep.env.final_reward(text)
        finish = getattr(ep.env, 'finish', None)
        if callable(finish):  # the episode is over: an environment may release what waits
          # The turn in progress; none when the environment's own step ended it.
          turn = [] if ep.reason in ENV_FAILURES else c.tokens[ep.turn_start :]
          try:
            finish(ep.reason, [int(t) for t in turn])
          except Exception as e:  # its own episode's business, never the run's
            ep.error = ep.error or f'finish: {type(e).__name__}: {e}'
        row.append((c, ep))
      out.append(row)
    return requests, out

  def sample(self, params, iteration, version=None, **options):
    rl = self.config.rl
    version = iteration if version is None else version
    g, b = rl.group_size, rl.prompts_per_step
    examples = self.stream.next(b)
    start = time.perf_counter()
    with self.tracer.span('generate', iteration=iteration):
      requests, results = self.run_episodes(
        params,
        examples,
        group_size=g,
        greedy=False,
        iteration=iteration,
        version=version,
        **options,
      )
    t_gen = time.perf_counter() - start
    flat = [pair for row in results for pair in row]
    completions = [c for c, _ in flat]
    episodes = [ep for _, ep in flat]
    rewards_np = np.asarray([ep.reward for ep in episodes], np.float32)
    self.last_samples = [
      {
        'prompt': decode(self.tokenizer, requests[0].prompt, ()),
        'completion': decode(self.tokenizer, c.tokens, self.stop_tokens),
        'reward': float(ep.reward),
        'finish_reason': ep.reason,
      }
      for c, ep in results[0]
    ]
    prompts = [r.prompt for r in requests for _ in range(g)]
    batch, old_logp = rollout.pack_completions(
      prompts, completions, self.seq_len, self.tokenizer.pad_id
    )
    loss_mask = np.asarray(batch.loss_mask).copy()
    for row, c in enumerate(completions):
      s = len(prompts[row])
      loss_mask[row, s : s + len(c.tokens)] &= ~c.env_mask  # the model's tokens only
    batch = batch._replace(loss_mask=loss_mask)
    metrics = episode_metrics(episodes, rewards_np)
    lengths = np.asarray([len(c.tokens) for c in completions])
    zero_var = rewards_np.reshape(b, g).max(1) == rewards_np.reshape(b, g).min(1)
    metrics['reward/std'] = float(rewards_np.std())
    metrics['response_length/mean'] = float(lengths.mean())
    metrics['response_length/max'] = float(lengths.max())
    metrics['response_length/clip_ratio'] = float(
      np.mean([ep.reason == 'length' for ep in episodes])
    )
    metrics['groups/zero_variance_frac'] = float(zero_var.mean())
    metrics['time/generate'] = t_gen
    metrics['time/reward'] = 0.0
    gen_tokens = int(sum(len(c.tokens) - int(c.env_mask.sum()) for c in completions))
    metrics['throughput/generate_tokens_per_s'] = gen_tokens / max(t_gen, 1e-9)
    metrics.update(rollout.version_metrics(completions, iteration))
    # An episode its environment failed (raised, hung, garbage, a dead tool
    # server) is unscored, never a 0 reward: left out of the loss and of its
    # group's statistics (reward.unscored='drop'), or trained at
    # reward.unscored_value ('value').
    failed = np.asarray([ep.reason in ENV_FAILURES for ep in episodes])
    reward_config = self.config.reward
    valid = ~failed
    if reward_config.get('unscored', 'drop') != 'drop':
      rewards_np = np.where(failed, reward_config.unscored_value, rewards_np).astype(np.float32)
      valid = np.ones_like(failed)
    metrics['samples/unscored'] = float(failed.sum())
    metrics['samples/left_out'] = float((~valid).sum())
    return rollout.Rollout(
      batch,
      old_logp,
      rewards_np,
      version,
      metrics,
      valid=valid,
      unscored=(environment_unscored(episodes),),
    )

  def evaluate(self, params, step=None):
    """Greedy held-out episodes of `params` (`step`: their policy version)."""
    if not self.held_out:
      return {}
    with self.tracer.span('eval'):
      _, results = self.run_episodes(
        params, self.held_out, group_size=1, greedy=True, iteration=-1, version=step
      )
    episodes = [ep for row in results for _, ep in row]
    rewards = np.asarray([ep.reward for ep in episodes])
    metrics = episode_metrics(episodes, rewards)
    return {
      'eval/accuracy': float(np.mean(rewards > 0.5)),
      'eval/tool_use_rate': metrics['env/tool_use_rate'],
      'eval/turns': metrics['env/turns'],
    }
