"""Agentic RL (`algorithm='agent'`): multi-turn tool-use episodes end to end.

A shrunken `configs/agent_arith.py` (tiny model, a few SFT steps on
demonstrations, 2 RL steps). The tests wrap the environment to record what
it returned and the trainer's batch to see what it trained on.
"""

import itertools
import random
import re
import time

import jax
import numpy as np
import pytest

from configs import agent_arith
from configs import common as config_common
from jrl import trainers
from jrl.envs import EnvPool, Step, TurnSampling
from jrl.envs.arith import make_env as make_arith_env
from jrl.metrics import read_jsonl
from jrl.trainers import controller
from jrl.trainers.rollouts import episodes
from tests.helpers import set_fields
from tests.sampler import margins

SHRINK = {
  'model.width': 32,
  'model.mlp_width': 64,
  'model.num_layers': 1,
  'model.head_dim': 8,
  'task.eval_size': 8,
  'sft.steps': 30,
  'sft.batch_size': 16,
  'rl.steps': 2,
  'rl.prompts_per_step': 4,
  'rl.group_size': 4,
  'rl.minibatch_size': 8,
  'sampler.num_slots': 16,
  'eval.every': 0,
  'checkpoint.every': 100,
  'log.plot': False,
  'log.tensorboard': False,
}


def agent_config(workdir, overrides=None):
  fields = {**SHRINK, 'workdir': str(workdir), **(overrides or {})}
  return set_fields(agent_arith.get_config(), fields)


class Recorder:
  """Wraps the environment and the episode worker to keep the environment's
  answers and the batches the trainer trains on."""

  def __init__(self, monkeypatch):
    self.env_answers = []  # (prompt tokens, model turn, environment tokens)
    self.batches = []
    original_make = episodes.ENVIRONMENTS['arith_tool'][1]
    original_sample = episodes.EpisodeWorker.sample
    recorder = self

    def make_env(tokenizer):
      env = original_make(tokenizer)
      step = env.step

      def recording_step(turn):
        out = step(turn)
        recorder.env_answers.append((list(turn), list(out.tokens)))
        return out

      env.step = recording_step
      return env

    def sample(worker, *args, **kwargs):
      rollout = original_sample(worker, *args, **kwargs)
      recorder.batches.append(rollout)
      return rollout

    task = episodes.ENVIRONMENTS['arith_tool'][0]
    monkeypatch.setitem(episodes.ENVIRONMENTS, 'arith_tool', (task, make_env))
    monkeypatch.setattr(episodes.EpisodeWorker, 'sample', sample)


@pytest.fixture(scope='module')
def agent_run(tmp_path_factory):
  mp = pytest.MonkeyPatch()
  recorder = Recorder(mp)
  workdir = tmp_path_factory.mktemp('agent')
  job = trainers.build(agent_config(workdir, {'agent.sft_tool_frac': 0.9}))
  state = controller.train(job)
  mp.undo()
  return job, recorder, read_jsonl(f'{workdir}/metrics.jsonl'), state


def test_trainer_sees_exactly_the_sampled_and_environment_tokens(agent_run):
  job, recorder, _, _ = agent_run
  assert recorder.env_answers, 'no tool was called: the test would be vacuous'
  answers = {tuple(turn): env for turn, env in recorder.env_answers}
  tok = job.resources.tokenizer
  checked = 0
  for sampled in recorder.batches:
    tokens = np.asarray(sampled.batch.tokens)
    mask, loss_mask = np.asarray(sampled.batch.mask), np.asarray(sampled.batch.loss_mask)
    for row in range(tokens.shape[0]):
      real = tokens[row][mask[row]]
      prompt_len = int(np.argmax(loss_mask[row] | ~mask[row])) if loss_mask[row].any() else 0
      text = tok.decode(real.tolist())
      assert text.startswith(tok.decode(real[:prompt_len].tolist()))
      # Walk the response: every run of non-loss tokens after the prompt is exactly
      # what the environment returned for the model turn before it.
      resp, lm = real[prompt_len:], loss_mask[row][mask[row]][prompt_len:]
      turn_start, k = 0, 0
      while k < len(resp):
        if lm[k]:
          k += 1
          continue
        end = k
        while end < len(resp) and not lm[end]:
          end += 1
        turn = tuple(int(t) for t in resp[turn_start:k])
        assert turn in answers, tok.decode(list(turn))
        assert resp[k:end].tolist() == answers[turn]
        # Environment tokens carry no sampler logprob.
        logp = np.asarray(sampled.old_logp)[row][mask[row]][prompt_len:]
        assert np.all(logp[k:end] == 0.0)
        checked += 1
        turn_start, k = end, end
  assert checked > 0


def test_episode_metrics_are_logged(agent_run):
  _, _, records, _ = agent_run
  rl = [r for r in records if r.get('phase') == 1.0]
  assert len(rl) == 2
  for key in ('env/turns', 'env/tool_calls', 'env/tool_failures', 'env/invalid_calls',
              'env/tool_use_rate', 'env/finish/stop', 'reward/mean'):  # fmt: skip
    assert key in rl[-1], key
  assert sum(r['env/turns'] for r in rl) > 0  # environment turns happened
  finish = sum(v for k, v in rl[-1].items() if k.startswith('env/finish/'))
  assert finish == pytest.approx(1.0)


def test_pooled_environments_give_the_trajectories_of_inline_stepping(agent_run, monkeypatch):
  # A deterministic environment whose steps take random times: parked
  # samples resume in another order and other dispatches than inline ones,
  # and every trajectory is the same.
  job, _, _, state = agent_run
  worker = job.topology.worker
  assert worker.parking and worker.pool.workers == job.resources.config.agent.env_workers == 16
  monkeypatch.setattr(worker, 'pool', EnvPool(16))  # the run closed its own
  rng = random.Random(0)

  def slow_env(tokenizer):
    env = make_arith_env(tokenizer)
    step = env.step

    def slow_step(turn):
      time.sleep(rng.choice([0.0, 0.02, 0.1]))
      return step(turn)

    env.step = slow_step
    return env

  monkeypatch.setattr(worker, 'make_env', slow_env)
  examples = worker.held_out[:4]

  def episodes_with(parking):
    monkeypatch.setattr(worker, 'parking', parking)
    requests, results = worker.run_episodes(
      state.params, examples, group_size=4, greedy=False, iteration=9, version=9
    )
    return requests, results, worker.engine.stats

  requests, inline, inline_stats = episodes_with(False)
  _, pooled, pooled_stats = episodes_with(True)
  assert inline_stats.env_turns == pooled_stats.env_turns > 0
  assert inline_stats.env_parked_peak == 0 and pooled_stats.env_parked_peak >= 1
  # Parked samples decode in other batches: the same trajectories up to a
  # draw that rounding could flip (tests/sampler/margins.py).
  groups = [[c for c, _ in row] for row in inline]
  upto = margins.fragile_points(worker.engine.graphdef, state.params, requests, groups)
  assert sum(map(sum, upto)) >= 0.75 * sum(len(c.tokens) for row in groups for c in row)
  for p_row, i_row, n_row in zip(pooled, inline, upto, strict=True):
    for (a, ea), (b, eb), n in zip(p_row, i_row, n_row, strict=True):
      np.testing.assert_array_equal(a.tokens[:n], b.tokens[:n])
      np.testing.assert_array_equal(a.env_mask[:n], b.env_mask[:n])
      np.testing.assert_allclose(a.logprobs[:n], b.logprobs[:n], atol=1e-6)
      if n < len(b.tokens):
        continue
      np.testing.assert_array_equal(a.tokens, b.tokens)
      assert (a.finish_reason, ea.reason, ea.turns) == (b.finish_reason, eb.reason, eb.turns)
      assert (ea.reward, dict(ea.info)) == (eb.reward, dict(eb.info))


def test_an_episode_past_its_time_limit_ends_with_env_timeout(agent_run, monkeypatch):
  # Each step takes 0.3 s, under `agent.step_timeout_s` (10 s) but past the
  # episode's limit (0.2 s): an episode that calls its tool ends there,
  # unscored, at the episode's deadline rather than the step's.
  job, _, _, state = agent_run
  worker = job.topology.worker
  monkeypatch.setattr(worker, 'pool', EnvPool(16))  # the run closed its own
  config = worker.config.copy_and_resolve_references()
  with config.unlocked():
    config.agent.episode_timeout_s = 0.2
  monkeypatch.setattr(worker, 'config', config)

  def slow_env(tokenizer):
    env = make_arith_env(tokenizer)
    step = env.step

    def slow_step(turn):
      time.sleep(0.3)
      return step(turn)

    env.step = slow_step
    return env

  monkeypatch.setattr(worker, 'make_env', slow_env)
  _, results = worker.run_episodes(
    state.params, worker.held_out[:4], group_size=4, greedy=False, iteration=9, version=9
  )
  eps = [ep for row in results for _, ep in row]
  timed_out = [ep for ep in eps if ep.reason == 'env_timeout']
  assert timed_out and all(ep.turns >= 1 for ep in timed_out)
  assert all(ep.reason != 'env_timeout' for ep in eps if ep.turns == 0)
  # Each step's deadline was what was left of the episode's 0.2 s, never 10 s.
  for ep in timed_out:
    deadline = re.fullmatch(r'no answer within ([0-9.e-]+) s', ep.error)
    assert 'episode_timeout_s' in ep.error or float(deadline[1]) <= 0.2, ep.error


class _Prompts:
  """An environment whose reset gives the next of `prompts`."""

  def __init__(self, prompts):
    self.prompts = iter(prompts)

  def reset(self, example):
    return next(self.prompts)


def test_a_reset_over_the_prompt_limit_ends_only_its_episode():
  envs = _Prompts([[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3], [4, 4, 4]])
  group = [episodes.Episode(envs) for _ in range(4)]
  assert episodes.reset_group(group, {}, 0, max_prompt_len=4) == [1, 2, 3]
  assert [ep.reason for ep in group] == [None, 'env_invalid', None, 'env_invalid']
  assert 'over task.max_prompt_len=4' in group[1].error and 'another prompt' in group[3].error
  # A group whose prompts are all too long: unscored episodes on the prompt [pad].
  group = [episodes.Episode(_Prompts([[1] * 9])) for _ in range(2)]
  assert episodes.reset_group(group, {}, 0, max_prompt_len=4) == [0]
  assert all(ep.reason == 'env_invalid' for ep in group)


def test_an_environments_turn_sampling_is_checked_and_a_bad_one_ends_its_episode():
  class Asks:
    def __init__(self, sampling):
      self.sampling = sampling

  good = episodes.Episode(Asks(TurnSampling(max_tokens=5, temperature=0)))
  assert episodes.turn_sampling(good) == TurnSampling(5, 0) and good.reason is None
  assert episodes.turn_sampling(episodes.Episode(Asks(None))) is None
  for bad, field in [
    (TurnSampling(max_tokens=-1), 'max_tokens'),
    (TurnSampling(max_tokens=2.5), 'max_tokens'),
    (TurnSampling(temperature=float('inf')), 'temperature'),
    ({'max_tokens': 5}, 'TurnSampling'),
  ]:
    ep = episodes.Episode(Asks(bad))
    assert episodes.turn_sampling(ep) is None
    assert ep.reason == 'env_invalid' and field in ep.error, ep.error


class Flaky:
  """In turn, over every trajectory's tool calls: raises, hangs, returns
  garbage, answers (the order of the calls, not their text, so that every
  failure happens whatever the sampled turns say)."""

  turn_stop_tokens = ()
  calls = None  # itertools.count, set by the test

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.inner = make_arith_env(tokenizer)
    self.turn_stop_tokens = self.inner.turn_stop_tokens

  def reset(self, example):
    return self.inner.reset(example)

  def step(self, turn):
    kind = next(Flaky.calls) % 4
    if kind == 0:
      raise ValueError('flaky tool')
    if kind == 1:
      time.sleep(2)
    if kind == 2:
      return Step([10**6])
    return self.inner.step(turn)

  def final_reward(self, text):
    return self.inner.final_reward(text)


def test_environments_that_raise_hang_or_return_garbage_end_only_their_trajectory(
  tmp_path, monkeypatch
):
  task = episodes.ENVIRONMENTS['arith_tool'][0]
  monkeypatch.setitem(episodes.ENVIRONMENTS, 'arith_tool', (task, Flaky))
  monkeypatch.setattr(Flaky, 'calls', itertools.count())
  config = agent_config(
    tmp_path, {'agent.sft_tool_frac': 1.0, 'agent.step_timeout_s': 0.2, 'rl.steps': 2}
  )
  trainers.run(config)
  rl = [r for r in read_jsonl(f'{tmp_path}/metrics.jsonl') if r.get('phase') == 1.0]
  assert len(rl) == 2  # the run finished
  total = {k: sum(r[k] for r in rl) for k in rl[0] if k.startswith('env/finish/')}
  assert total['env/finish/env_error'] > 0
  assert total['env/finish/env_timeout'] > 0
  assert total['env/finish/env_invalid'] > 0
  # The failed episodes are unscored: left out of the loss, never a 0 reward.
  per_step = config.rl.prompts_per_step * config.rl.group_size
  failed = sum(r[k] for r in rl for k in total if k.split('/')[-1] in episodes.ENV_FAILURES)
  assert sum(r['samples/left_out'] for r in rl) == pytest.approx(failed * per_step)


class Down(Flaky):
  """An environment whose server is gone: every reset raises."""

  def reset(self, example):
    raise ConnectionError('tool server down')


def test_environments_that_fail_most_episodes_stop_the_run(tmp_path, monkeypatch):
  """The episodes the environments fail are the rollout's unscored share
  (`Rollout.unscored`, `signals.ENVIRONMENT`): after
  `reward.max_unscored_steps` iterations above `reward.max_unscored_frac`,
  the run stops naming the environments and their first error, and keeps
  its checkpoint, as it does for a reward function."""
  task = episodes.ENVIRONMENTS['arith_tool'][0]
  monkeypatch.setitem(episodes.ENVIRONMENTS, 'arith_tool', (task, Down))
  config = agent_config(tmp_path, {'rl.steps': 4, 'reward.max_unscored_steps': 2, 'sft.steps': 0})
  with pytest.raises(RuntimeError) as info:
    trainers.run(config)
  message = str(info.value)
  assert 'the environments failed 100% of the episodes' in message, message
  assert 'ConnectionError: tool server down' in message, message
  rl = [r for r in read_jsonl(f'{tmp_path}/metrics.jsonl') if r.get('phase') == 1.0]
  assert len(rl) == 2 and all(r['env/finish/env_error'] == 1.0 for r in rl)


def test_agent_ppo_gae_bridges_environment_tokens(tmp_path, monkeypatch):
  config = agent_config(tmp_path, {'agent.sft_tool_frac': 0.9, 'rl.steps': 1, 'sft.steps': 6})
  config.unlock()
  config.ppo = config_common.ppo_section()
  config.agent.trainer = 'ppo'
  config.lock()
  seen = []
  job = trainers.build(config)
  gae = job.steps.gae

  def recording_gae(rewards, values, mask):
    adv, ret = gae(rewards, values, mask)
    seen.append((np.asarray(mask), np.asarray(adv)))
    return adv, ret

  job.steps = job.steps._replace(gae=recording_gae)
  state = controller.train(job)
  ((mask, adv),) = seen
  # Rows with an environment turn have masked positions between model tokens;
  # advantages are zero there and flow to the model tokens before them.
  inner = 0
  for m, a in zip(mask, adv, strict=True):
    idx = np.flatnonzero(m)
    if idx.size and (idx[-1] - idx[0] + 1) > idx.size:
      inner += 1
      gaps = np.setdiff1d(np.arange(idx[0], idx[-1] + 1), idx)
      assert np.all(a[gaps] == 0.0)
  assert inner > 0, 'no trajectory had an environment turn'
  assert jax.tree.leaves(state.params)


def test_bad_agent_config_names_the_field(tmp_path):
  for overrides, field in [
    ({'agent.env': 'chess'}, 'agent.env'),
    ({'agent.max_turns': 0}, 'agent.max_turns'),
    ({'agent.sft_tool_frac': 1.5}, 'agent.sft_tool_frac'),
    ({'agent.trainer': 'dqn'}, 'agent.trainer'),
  ]:
    with pytest.raises(ValueError, match=field.replace('.', r'\.')):
      trainers.build(agent_config(tmp_path, overrides))
