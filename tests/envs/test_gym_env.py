"""Gymnasium-style text environments and textarena's single-player games as
chat episodes (`jrl.envs.gym_env`), with the real `gymnasium` and `textarena`
packages (the [gym] and [textarena] extras, in the [test] extra).

Through the agent trainer's real episode worker (a tiny random chat model
sampling several turns per episode): the trajectories of a deterministic
Gymnasium env and of textarena's GuessTheNumber through the adapter equal,
token for token, those of hand-written token-level environments that play
the same games and render the whole conversation each turn. textarena
games (Blackjack draws cards from the global `random` at every step) give
the same transcript per seed when many run at once on the environment
pool, and leave the process's global generators alone. An environment that
raises (at reset or step) or hangs ends only its own episode, counted.
"""

import itertools
import random
import string
import threading
import time

import numpy as np
import pytest

gymnasium = pytest.importorskip('gymnasium', reason='the [gym] extra (pip install -e ".[gym]")')
ta = pytest.importorskip('textarena', reason='the [textarena] extra')

from jrl.envs import EnvPool  # noqa: E402
from jrl.envs.gym_env import GymTextEnv, TextArenaGame, episode_seed  # noqa: E402
from jrl.models import tokenizer as T  # noqa: E402
from jrl.trainers.rollouts import episodes  # noqa: E402
from tests.envs import episode_worker  # noqa: E402
from tests.envs.episode_worker import HandWritten  # noqa: E402
from tests.envs.test_chat import TEMPLATES  # noqa: E402
from tests.helpers import train_byte_bpe  # noqa: E402

EXAMPLES = [{'prompt': '', 'answer': '', 'seed': s} for s in (11, 12)]


# The rules make the game's first observation as long as GuessTheNumber's
# (one prompt bucket: the sampler compiles its prefill once for both).
RULES = (
  'Each turn, write some text. You score a tenth of a point for every digit in it. '
  'The game ends when your text contains the number, or after your third turn. '
) * 3


class WriteTheNumber(gymnasium.Env):
  """A deterministic text game: the seed picks a number; each turn scores 0.1
  per digit written; writing the number ends the game, the third turn
  truncates it."""

  observation_space = gymnasium.spaces.Text(500, charset=string.printable)
  action_space = gymnasium.spaces.Text(500, charset=string.printable)

  def reset(self, *, seed=None, options=None):
    super().reset(seed=seed)
    self.target = int(self.np_random.integers(10, 99))
    self.turn = 0
    return f'{RULES}Write the number {self.target}.', {'target': self.target}

  def step(self, action):
    self.turn += 1
    digits = sum(ch.isdigit() for ch in action)
    observation = f'Turn {self.turn}: {len(action)} characters, {digits} digits.'
    done = str(self.target) in action
    return observation, 0.1 * digits, done, self.turn >= 3 and not done, {}


gymnasium.register('jrl-test/WriteTheNumber-v0', entry_point=WriteTheNumber)


class GymGame:
  """`WriteTheNumber` played through its own API (for `HandWritten`)."""

  def start(self, seed):
    self.env = WriteTheNumber()
    return self.env.reset(seed=seed)[0]

  def play(self, action):
    text, reward, terminated, truncated, _ = self.env.step(action)
    return text, reward, terminated or truncated


class ArenaGame:
  """A textarena single-player game played through textarena's own API (for
  `HandWritten`): the game's messages to the player as the text."""

  def __init__(self, game_id, action_fn=None, **options):
    self.game_id, self.options = game_id, options
    self.action_fn = action_fn or (lambda text: text)

  def _text(self):
    player, messages = self.game.get_observation()
    return '\n'.join(text for sender, text, _ in messages if sender != player)

  def start(self, seed):
    self.game = ta.make(self.game_id, **self.options)
    self.game.reset(num_players=1, seed=seed)
    return self._text()

  def play(self, action):
    done, _ = self.game.step(self.action_fn(action))
    if done:
      rewards, _ = self.game.close()
      return '', rewards[0], True
    return self._text(), 0.0, False


@pytest.fixture(scope='module')
def agent(tmp_path_factory):
  job, worker = episode_worker.build(tmp_path_factory.mktemp('gym_agent'))
  yield job, worker
  worker.close()


@pytest.fixture(scope='module')
def bpe():
  template, specials, _, eos, _ = TEMPLATES['smollm2']
  corpus = ['Guess the number [10] higher lower. Hand: 10♠, K♥ (Score: 20) [Hit] [Stand]']
  return T.HFTokenizer(train_byte_bpe(corpus, specials, 400), chat_template=template, eos=eos)


def _trajectories(results):
  return [
    (c.tokens.tolist(), c.env_mask.tolist(), ep.reason, ep.turns, round(ep.reward, 6))
    for row in results
    for c, ep in row
  ]


@pytest.fixture(scope='module')
def reference(agent):
  """The hand-written environment's trajectories of `WriteTheNumber` on EXAMPLES."""
  job, worker = agent
  return episode_worker.run(job, worker, lambda tok: HandWritten(tok, GymGame()), EXAMPLES)


def _worth_comparing(results, ended=True):
  """The episodes exercise the adapter: several turns, environment tokens
  between them, (`ended`) an episode the game ended, no template rewrites
  (a turn the model sampled as other tokens than its text encodes to is
  counted as a token_diff and kept as sampled, by both environments)."""
  eps = [ep for row in results for _, ep in row]
  assert max(ep.turns for ep in eps) >= 2
  assert sum(c.env_mask.sum() for row in results for c, _ in row) > 0
  assert not ended or 'done' in [ep.reason for ep in eps]
  assert all(ep.info['render_rewritten'] == 0 for ep in eps)


def test_a_gymnasium_env_through_the_adapter_equals_a_hand_written_token_environment(
  agent, reference
):
  job, worker = agent
  got = episode_worker.run(job, worker, lambda tok: GymTextEnv(tok, WriteTheNumber()), EXAMPLES)
  assert _trajectories(got) == _trajectories(reference)
  _worth_comparing(got)
  assert sum(ep.reward for row in got for _, ep in row) > 0


def _small_guess(text):
  """A guess from 1 to 5 from any text (the random model writes no numbers)."""
  return f'[{len(text) % 5 + 1}]'


def test_a_textarena_game_through_the_adapter_equals_a_hand_written_token_environment(agent):
  job, worker = agent
  game = lambda: ArenaGame('GuessTheNumber-v0-raw', max_number=5, action_fn=_small_guess)
  want = episode_worker.run(job, worker, lambda tok: HandWritten(tok, game()), EXAMPLES)
  adapter = lambda tok: GymTextEnv(
    tok, TextArenaGame('GuessTheNumber-v0-raw', max_number=5), action_fn=_small_guess
  )
  got = episode_worker.run(job, worker, adapter, EXAMPLES)
  assert _trajectories(got) == _trajectories(want)
  _worth_comparing(got)


def test_a_gymnasium_id_is_made_by_gymnasium(bpe):
  by_id = GymTextEnv(bpe, 'jrl-test/WriteTheNumber-v0')
  assert isinstance(by_id.env.unwrapped, WriteTheNumber)
  by_hand = HandWritten(bpe, GymGame())
  assert by_id.reset({'seed': 3}) == by_hand.reset({'seed': 3})
  for text in ('12 and 3', 'none', str(by_hand.game.env.target)):
    turn = by_id.model_turn(text)
    a, b = by_id.step(turn), by_hand.step(turn)
    assert (a.tokens, a.done, a.reward) == (b.tokens, b.done, b.reward)
  assert a.done and a.reward == pytest.approx(0.2)


def test_a_scripted_textarena_game_equals_the_hand_written_one(bpe):
  # The default id: textarena's observation wrapper is bypassed (the
  # conversation keeps the history), its action wrapper applies.
  env = GymTextEnv(bpe, TextArenaGame('GuessTheNumber-v0'))
  ref = HandWritten(bpe, ArenaGame('GuessTheNumber-v0-raw'))
  assert env.reset({'seed': 5}) == ref.reset({'seed': 5})
  target = env.env.core.game_number
  low, high, rewards = 1, 20, []
  for i in range(10):
    guess = (low + high) // 2 if i != 1 else 99  # one guess out of range
    turn = env.model_turn(f'I guess [{guess}]')
    a, b = env.step(turn), ref.step(turn)
    assert (a.tokens, a.done, a.reward) == (b.tokens, b.done, b.reward)
    rewards.append(a.reward)
    if a.done:
      break
    low, high = (guess + 1, high) if guess < target else (low, min(guess - 1, high))
  assert a.done and rewards[-1] == 1.0 and sum(rewards) == 1.0
  assert env.last_info['game_info'][0]['reason'].startswith('Congratulations')


def _play(env, seed, actions, jitter=None):
  """One episode of `env` on the environment pool: its transcript."""
  pool = EnvPool(1)
  transcript = [env.reset({'seed': seed})]
  for action in actions:
    if jitter is not None:
      time.sleep(jitter.random() * 0.003)
    step, failure, _ = pool.submit(
      env, env.model_turn(action), timeout_s=10, vocab_size=10**6, max_tokens=10**4
    ).result()
    assert failure is None
    transcript.append((step.tokens, step.reward, step.done))
    if step.done:
      break
  pool.close()
  return transcript


def test_textarena_episodes_are_reproducible_per_seed_while_many_run_at_once(bpe):
  actions = ['[Hit]', '[Stand]', '[Hit]', '[Hit]', '[Stand]', '[Stand]'] * 3
  make = lambda: GymTextEnv(bpe, TextArenaGame('Blackjack-v0'))
  seeds = list(range(6))
  alone = {s: _play(make(), s, actions) for s in seeds}
  assert len({repr(t) for t in alone.values()}) == len(seeds)  # the seed picks the game
  outside = random.getstate(), np.random.get_state()  # noqa: NPY002
  together, threads = {}, []
  for copy, s in itertools.product(range(2), seeds):
    jitter = random.Random(100 * copy + s)
    run = lambda s=s, copy=copy, jitter=jitter: together.__setitem__(
      (s, copy), _play(make(), s, actions, jitter)
    )
    threads.append(threading.Thread(target=run))
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(together) == 2 * len(seeds)
  for (s, _), transcript in together.items():
    assert transcript == alone[s], s
  # The games drew from their own state, never the process's.
  assert random.getstate() == outside[0]
  assert repr(np.random.get_state()) == repr(outside[1])  # noqa: NPY002


def test_a_reward_that_is_not_finite_ends_the_episode(bpe):
  class Broken(WriteTheNumber):
    def step(self, action):
      return 'x', float('nan'), False, False, {}

  env = GymTextEnv(bpe, Broken())
  env.reset({'seed': 1})
  step, failure, message = (
    EnvPool(1)
    .submit(env, env.model_turn('1'), timeout_s=10, vocab_size=10**6, max_tokens=100)
    .result()
  )
  assert step is None and failure == 'env_error' and 'reward nan' in message


def test_episode_seeds():
  assert episode_seed({'prompt': 'x', 'seed': 7}) == 7
  a = episode_seed({'prompt': 'x', 'answer': '1'})
  assert a == episode_seed({'answer': '1', 'prompt': 'x'}) == 263903199  # stable, order-free
  assert a != episode_seed({'prompt': 'y', 'answer': '1'})
  with pytest.raises(ValueError, match='non-negative integer'):
    episode_seed({'seed': -1})


class Faulty(GymTextEnv):
  """`WriteTheNumber`, with a fault chosen by its number among the episodes."""

  made = None  # itertools.count, set by the test

  def __init__(self, tokenizer):
    super().__init__(tokenizer, WriteTheNumber())
    self.fault = ('reset', 'step', 'hang', None)[next(Faulty.made) % 4]

  def reset(self, example):
    if self.fault == 'reset':
      raise ConnectionError('the game server is down')
    return super().reset(example)

  def step(self, turn_tokens):
    if self.fault == 'step':
      raise RuntimeError('the game crashed')
    if self.fault == 'hang':
      time.sleep(3)
    return super().step(turn_tokens)


def test_a_raising_or_hanging_environment_ends_only_its_own_episode(agent, reference, monkeypatch):
  job, worker = agent
  monkeypatch.setattr(Faulty, 'made', itertools.count())
  results = episode_worker.run(job, worker, Faulty, EXAMPLES)
  eps = [ep for row in results for _, ep in row]
  assert [(ep.env.fault, ep.reason) for ep in eps] == [
    ('reset', 'env_error'),
    ('step', 'env_error'),
    ('hang', 'env_timeout'),
    (None, 'length'),
  ]
  assert eps[0].error.startswith('reset: ConnectionError') and 'crashed' in eps[1].error
  # The healthy episode is the hand-written environment's.
  assert _trajectories(results)[3] == _trajectories(reference)[3]
  metrics = episodes.episode_metrics(eps, np.asarray([ep.reward for ep in eps]))
  assert metrics['env/finish/env_error'] == 0.5 and metrics['env/finish/env_timeout'] == 0.25


def test_a_group_whose_episodes_start_differently_is_refused(agent):
  job, worker = agent
  seeds = itertools.count(100)
  make = lambda tok: GymTextEnv(tok, WriteTheNumber(), seed=lambda ex: next(seeds))
  results = episode_worker.run(job, worker, make, EXAMPLES)
  for (_, first), (_, second) in results:
    assert first.reason in ('done', 'length', 'max_turns')
    assert second.reason == 'env_invalid' and 'another prompt' in second.error
