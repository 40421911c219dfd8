"""Gymnasium-style text environments (and textarena's single-player games) as chat episodes.

    def make_env(tokenizer):                      # agent.env = 'my_pkg.envs:make_env'
      return GymTextEnv(tokenizer, MyTextEnv(), system='You play ...')

    def make_game(tokenizer):
      return GymTextEnv(tokenizer, TextArenaGame('GuessTheNumber-v0'))

A Gymnasium-style text environment has `reset(seed=...) -> (observation,
info)` and `step(action_text) -> (observation, reward, terminated,
truncated, info)`. `GymTextEnv` plays one episode of it as a conversation
in the checkpoint's chat template (`jrl.envs.chat.Conversation`): each
observation is a user message, appended as the tokens the template renders
for it; each model turn is exactly the tokens the model sampled, and its
text (the turn's end token removed) is the action. Step rewards are summed
into the episode's reward; `terminated` or `truncated` ends the episode
(the final observation is not shown: nothing follows it). An environment
that raises ends only its own episode ('env_error', unscored: see
`jrl.trainers.rollouts.episodes`).

Seeds. An episode's seed comes from its example (`episode_seed`): the
example's 'seed' field, else a stable hash of the example. The same
example gives the same game, so an episode is reproducible, and the
`rl.group_size` samples of one prompt play one game (GRPO compares them
on equal terms; the episode worker checks that they share their prompt).

textarena. `TextArenaGame` gives a textarena 0.7.4 single-player game
(`ta.make('GuessTheNumber-v0')`; its word games download word lists at run
time: offline, use the others) the Gymnasium API: `reset(num_players=1,
seed)`, the game's own messages since the player's last turn as the
observation (its observation wrappers, which repeat the whole history as
one prompt, are bypassed: the conversation keeps the history), `step(action)
-> (done, info)`, the reward from `close()` once the game is over.
textarena's games draw from the process-global `random` module (its
`State` even re-seeds it on reset), and episodes step concurrently on the
environment pool's threads. So each game keeps a private copy of the
global `random` state (and, with `isolate_numpy=True`, numpy's legacy
global one): every call into the game holds one process-wide lock, swaps
the episode's state in, and swaps the state the rest of the process had
back out. A game's draws then depend on its seed and its own actions only,
never on which other episodes ran meanwhile, and the rest of the process
never sees a game's draws. Measured here (AMD EPYC, 2 shared cores; see
docs/your_own_environment.md): 8 Blackjack games at once diverged from
their sequential transcripts in 20 of 20 runs without the swap, in 0 of 20
with it; a GuessTheNumber step takes 7 µs without it and 30 µs with it
(~240 µs with numpy's state too). A game that would hold the lock for long
(one that waits on a network) should pass `isolate_random=False` and seed its
own generator.

Needs `gymnasium` for environment ids (`pip install -e ".[gym]"`) and
`textarena` for its games (`".[textarena]"`); jrl's core never imports them.
"""

import contextlib
import hashlib
import json
import math
import os
import random
import threading

import numpy as np

from jrl.envs.base import Environment, Step
from jrl.envs.chat import Conversation, turn_end


def episode_seed(example):
  """The seed of `example`'s episode, in [0, 2**31): its integer 'seed' field,
  else a stable hash of the example (the same in every process and run).
  Raises ValueError for a 'seed' that is not a non-negative integer."""
  if isinstance(example, dict) and 'seed' in example:
    seed = example['seed']
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
      raise ValueError(f"an example's 'seed' must be a non-negative integer, got {seed!r}")
    return int(seed)
  text = json.dumps(example, sort_keys=True, default=str)
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], 'big') >> 1


def as_text(observation):
  """An observation as the text of a user message: a string as it is, a dict
  or list as JSON, anything else by `str`."""
  if isinstance(observation, str):
    return observation
  if isinstance(observation, dict | list | tuple):
    return json.dumps(observation, ensure_ascii=False, default=str)
  return str(observation)


class TextEpisodeEnv(Environment):
  """An episode in which the environment speaks as the user and the model's
  turns are its actions, in the checkpoint's chat template. The base of
  `GymTextEnv` and `jrl.envs.openenv_env.OpenEnvEnv`: subclasses call
  `_open(text)` in `reset`, `_model_turn(tokens)` and `_observe(text)` in
  `step`.

  Args:
    tokenizer: the checkpoint's tokenizer (with its chat template).
    system: a system message opening the conversation, or None.
    family, on_rewrite, template_kwargs: as `jrl.envs.chat.Conversation`.
  """

  def __init__(
    self, tokenizer, *, system=None, family=None, on_rewrite='append', template_kwargs=None
  ):
    self.tokenizer = tokenizer
    self.system = system
    self.options = dict(family=family, on_rewrite=on_rewrite, template_kwargs=template_kwargs)
    self.turn_stop_tokens = (turn_end(tokenizer)[1],)
    self.conversation = None

  def _open(self, observation_text):
    """The prompt's token ids: the system message, then the first observation."""
    messages = [{'role': 'system', 'content': self.system}] if self.system else []
    messages.append({'role': 'user', 'content': observation_text})
    self.conversation = Conversation(self.tokenizer, messages, **self.options)
    return self.conversation.prompt_ids()

  def _model_turn(self, turn_tokens):
    """Records the model's turn; returns its text (the action)."""
    message, _ = self.conversation.add_turn(turn_tokens)
    return message['content']

  def _observe(self, observation_text):
    """The tokens that show `observation_text` to the model as a user message."""
    return self.conversation.append([{'role': 'user', 'content': observation_text}])

  def _render_info(self):
    """This step's render checks (`Conversation.render_info`)."""
    return self.conversation.render_info()

  def model_turn(self, text):
    """The tokens a model that follows the template samples to write `text`
    as its turn (for demonstrations and tests): its end token last."""
    conv = self.conversation
    return [*self.tokenizer.encode(conv.turn_prefix + text), conv.end_id]


def step_reward(value, where):
  """A step's reward as a float (None counts 0); ValueError naming `where`
  for one that is not finite."""
  reward = float(value if value is not None else 0.0)
  if not math.isfinite(reward):
    raise ValueError(f'{where} returned the reward {value!r}')
  return reward


class GymTextEnv(TextEpisodeEnv):
  """One episode of a Gymnasium-style text environment (see the module).

  Args:
    tokenizer: the checkpoint's tokenizer (with its chat template).
    env: an object with `reset(seed=...) -> (obs, info)` and `step(action) ->
      (obs, reward, terminated, truncated, info)` (a fresh one per episode:
      the `agent.env` factory is called per episode), or a registered
      Gymnasium id, made with `gymnasium.make`.
    system: a system message (the rules, the action format), or None.
    seed: fn(example) -> the episode's seed (default `episode_seed`).
    action_fn: fn(turn text) -> the action (default: the text itself).
    observation_fn: fn(observation) -> its text (default `as_text`).
    family, on_rewrite, template_kwargs: as `jrl.envs.chat.Conversation`.

  `info` of the latest reset or step is kept as `last_info`; the step's
  counters (`Step.info`) are the render checks and 'truncated'.
  """

  def __init__(
    self,
    tokenizer,
    env,
    *,
    system=None,
    seed=None,
    action_fn=None,
    observation_fn=None,
    family=None,
    on_rewrite='append',
    template_kwargs=None,
  ):
    super().__init__(
      tokenizer,
      system=system,
      family=family,
      on_rewrite=on_rewrite,
      template_kwargs=template_kwargs,
    )
    if isinstance(env, str):
      import gymnasium

      env = gymnasium.make(env)
    missing = [m for m in ('reset', 'step') if not callable(getattr(env, m, None))]
    if missing:
      raise TypeError(f'a {type(env).__name__} is not a Gymnasium-style env: no {missing}')
    self.env = env
    self.seed_fn = seed or episode_seed
    self.action_fn = action_fn
    self.observation_fn = observation_fn or as_text
    self.seed = None
    self.last_info = {}

  def reset(self, example):
    self.seed = int(self.seed_fn(example))
    observation, self.last_info = self.env.reset(seed=self.seed)
    return self._open(self.observation_fn(observation))

  def step(self, turn_tokens):
    text = self._model_turn(turn_tokens)
    action = self.action_fn(text) if self.action_fn is not None else text
    observation, reward, terminated, truncated, self.last_info = self.env.step(action)
    reward = step_reward(reward, f'{type(self.env).__name__}.step')
    info = {'truncated': int(bool(truncated) and not terminated)}
    if terminated or truncated:
      return Step([], done=True, reward=reward, info=info)
    tokens = self._observe(self.observation_fn(observation))
    return Step(tokens, reward=reward, info={**info, **self._render_info()})

  def finish(self, reason, last_turn_tokens):
    """Closes the environment, whatever ended the episode."""
    del reason, last_turn_tokens
    close = getattr(self.env, 'close', None)
    if callable(close):
      close()


# -- textarena ---------------------------------------------------------------------------

# Held by every call into a textarena game while its state of the global
# generators is swapped in (see the module).
_GLOBAL_RANDOM = threading.Lock()


class EpisodeRandom:
  """One episode's private state of the process-global generators: `random`'s,
  and with `numpy=True` also numpy's legacy global `np.random`; seeded by `seed`.

      rng = EpisodeRandom(seed)
      with rng.active():      # the global generators hold the episode's state
        game.step(action)     # draws with random.* (re-seeding it too)
  """

  def __init__(self, seed, numpy=False):
    self.python = random.Random(seed).getstate()
    self.numpy = np.random.RandomState(seed % 2**32).get_state() if numpy else None

  @contextlib.contextmanager
  def active(self):
    """Swaps the episode's state in under the process-wide lock, and the
    state the process had back when the block ends (raising or not)."""
    # deliberate: the legacy global numpy generator is what such games draw from
    with _GLOBAL_RANDOM:
      outer = random.getstate(), self.numpy and np.random.get_state()  # noqa: NPY002
      random.setstate(self.python)
      if self.numpy:
        np.random.set_state(self.numpy)  # noqa: NPY002
      try:
        yield
      finally:
        self.python = random.getstate()
        random.setstate(outer[0])
        if self.numpy:
          self.numpy = np.random.get_state()  # noqa: NPY002
          np.random.set_state(outer[1])  # noqa: NPY002


def _innermost(game):
  while hasattr(game, 'env') and hasattr(game, 'get_observation') and game is not game.env:
    game = game.env
  return game


def game_messages(messages, player_id):
  """The default text of textarena messages [(from_id, text, type)]: the
  texts of those the player did not write, one per line."""
  return '\n'.join(text for sender, text, _ in messages if sender != player_id)


class TextArenaGame:
  """A textarena single-player game with the Gymnasium text-env API (see the module).

  Args:
    game: a textarena id ('GuessTheNumber-v0'), made with `ta.make(game,
      **make_kwargs)`, or a made single-player game.
    isolate_random: keep the game's draws from the global `random`
      private to the episode (default; see the module).
    isolate_numpy: numpy's legacy global generator too, for games that draw
      from `np.random` (Sokoban's layouts); ~70 µs more per call here.
    format_messages: fn(messages, player_id) -> the observation's text
      (default `game_messages`).

  `step` returns the game's reward once it is over (textarena's `close()`),
  0.0 before; `terminated` when textarena says done; never `truncated`
  (the game's own turn limit ends it with its reward). `info` holds
  textarena's step info and, at the end, its game info.
  """

  def __init__(
    self, game, *, isolate_random=True, isolate_numpy=False, format_messages=None, **make_kwargs
  ):
    if isinstance(game, str):
      import textarena

      game = textarena.make(game, **make_kwargs)
    elif make_kwargs:
      raise TypeError(f'options {sorted(make_kwargs)} are for ta.make: pass an id, not a game')
    self.game = game
    self.core = _innermost(game)
    self.isolate_random = bool(isolate_random)
    self.isolate_numpy = bool(isolate_numpy)
    self.format_messages = format_messages or game_messages
    self.random = None

  def _calling(self):
    return self.random.active() if self.random is not None else contextlib.nullcontext()

  def _observation(self):
    player_id, messages = self.core.get_observation()
    if isinstance(messages, str):  # a game that formats its own observation
      return messages
    return self.format_messages(messages, player_id)

  def reset(self, *, seed=None, options=None):
    del options
    if self.isolate_random:
      seed_ = seed if seed is not None else int.from_bytes(os.urandom(4))
      self.random = EpisodeRandom(seed_, numpy=self.isolate_numpy)
    with self._calling():
      self.game.reset(num_players=1, seed=seed)
      return self._observation(), {}

  def step(self, action):
    with self._calling():
      done, step_info = self.game.step(action)
      observation = self._observation()
      info = {'step_info': step_info}
      reward = 0.0
      if done:
        rewards, info['game_info'] = self.game.close()
        reward = float((rewards or {}).get(0, 0.0))
    return observation, reward, bool(done), False, info

  def close(self):
    """Nothing to release (textarena's own `close` scores the game)."""
