"""A deterministic OpenEnv environment for tests/envs/test_openenv.py, and its
app (`app`, what `OpenEnvServer('tests.envs.openenv_guess:app')` serves)
and typed client.

Guess a digit: the seed picks it; each guess is answered 'higher' or
'lower', a right guess or the third one ends the episode. The reward is the
environment's rubric (1 - distance / 9, per guess), set on each observation
as OpenEnv environments do. `reset(fault=...)` makes the episode's steps
raise, hang or end the server's process, for the failure tests.
"""

import os
import time

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server import Environment, create_app
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics import Rubric


class GuessAction(Action):
  guess: int


class GuessObservation(Observation):
  message: str


class Closeness(Rubric):
  """1 - |guess - digit| / 9."""

  def __init__(self, env):
    super().__init__()
    self.env = env

  def forward(self, action, observation):
    return 1.0 - abs(action.guess - self.env.digit) / 9


class GuessEnvironment(Environment):
  SUPPORTS_CONCURRENT_SESSIONS = True

  def __init__(self):
    super().__init__()
    self.rubric = Closeness(self)
    self._state = State()

  def reset(self, seed=None, episode_id=None, fault=None, **kwargs):
    self._reset_rubric()
    self.digit, self.fault = (seed or 0) % 10, fault
    self._state = State(episode_id=episode_id, step_count=0)
    return GuessObservation(message='Guess my digit (0 to 9). You have 3 guesses.')

  def step(self, action, timeout_s=None, **kwargs):
    if self.fault == 'raise':
      raise RuntimeError('the environment crashed')
    if self.fault == 'hang':
      time.sleep(30)
    if self.fault == 'die':
      os._exit(3)
    self._state.step_count += 1
    right = action.guess == self.digit
    done = right or self._state.step_count >= 3
    if right:
      message = 'Right!'
    else:
      message = f'{"Higher" if action.guess < self.digit else "Lower"} than {action.guess}.'
    observation = GuessObservation(message=message, done=done)
    observation.reward = self._apply_rubric(action, observation)
    return observation

  @property
  def state(self):
    return self._state


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
  """The environment's typed client: GuessObservations come back."""

  def _step_payload(self, action):
    return action.model_dump()

  def _parse_result(self, payload):
    reward, done = payload.get('reward'), payload.get('done', False)
    observation = GuessObservation(**payload['observation'], reward=reward, done=done)
    return StepResult(observation=observation, reward=reward, done=done)

  def _parse_state(self, payload):
    return State(**payload)


app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=64)
