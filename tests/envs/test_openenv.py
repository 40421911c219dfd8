"""OpenEnv environments as chat episodes (`jrl.envs.openenv_env`), with the
real `openenv-core` package (the [openenv] extra, in the [test] extra), in
process and served by uvicorn on 127.0.0.1 (tests/envs/openenv_guess.py).

Through the agent trainer's real episode worker (a tiny random chat model):
a deterministic environment's trajectories, in process, on a server over
its WebSocket route, and through its typed client, equal those of a
hand-written token-level environment that plays it directly, token for
token, its rubric's rewards included. Scripted turns: JSON actions checked
by the Action type, invalid ones answered with an error the model reads;
many episodes stepping at once on one server. A server step that raises,
hangs, or kills its server ends only its own episodes (the dead server's),
counted; a reset against a dead server ends its episode, not the run.
"""

import concurrent.futures
import itertools
import os

import numpy as np
import pytest

pytest.importorskip('openenv.core', reason='the [openenv] extra (pip install -e ".[openenv]")')

from jrl.envs import EnvPool
from jrl.envs.openenv_env import (
  OpenEnvEnv,
  OpenEnvServer,
  action_instructions,
  text_action,
)
from jrl.models import tokenizer as T
from jrl.trainers.rollouts import episodes
from tests.envs import episode_worker
from tests.envs.episode_worker import HandWritten
from tests.envs.openenv_guess import (
  GuessAction,
  GuessClient,
  GuessEnvironment,
  GuessObservation,
)
from tests.envs.test_chat import TEMPLATES
from tests.helpers import train_byte_bpe


@pytest.fixture(scope='module', autouse=True)
def _no_persistent_cache_writes():
  """Serialising an executable for the persistent compilation cache crashed
  an xdist worker once in this module (a segmentation fault in XLA's
  `executable.serialize()` under the fresh-clone CI run, 2026-12-06, not
  reproduced since): its programs are compiled without writing the cache."""
  import jax

  # (The cache itself is latched on at first use: a write is skipped below
  # this compile time.)
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 1e9)
  yield
  jax.config.update('jax_persistent_cache_min_compile_time_secs', before)


APP = 'tests.envs.openenv_guess:app'
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = [{'prompt': '', 'answer': '', 'seed': s} for s in (13, 16)]  # digits 3 and 6


def guess_from_text(text):
  """Any turn is a guess (the random model writes no JSON): its length's last digit."""
  return GuessAction(guess=len(text) % 10)


class OpenGame:
  """`GuessEnvironment` played through its own API (for `HandWritten`)."""

  def start(self, seed):
    self.env = GuessEnvironment()
    return self.env.reset(seed=seed).message

  def play(self, action):
    observation = self.env.step(guess_from_text(action))
    return observation.message, observation.reward, observation.done


@pytest.fixture(scope='module')
def servers():
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    started = list(pool.map(lambda _: OpenEnvServer(APP, cwd=ROOT), range(2)))
  yield started
  for server in started:
    server.close()


@pytest.fixture(scope='module')
def agent(tmp_path_factory):
  job, worker = episode_worker.build(tmp_path_factory.mktemp('openenv_agent'))
  yield job, worker
  worker.close()


@pytest.fixture(scope='module')
def bpe():
  template, specials, _, eos, _ = TEMPLATES['hermes']
  corpus = ['Guess my digit (0 to 9). {"guess": 3} Higher than 2. Lower. Right!']
  return T.HFTokenizer(train_byte_bpe(corpus, specials, 400), chat_template=template, eos=eos)


def _trajectories(results):
  return [
    (c.tokens.tolist(), c.env_mask.tolist(), ep.reason, ep.turns, round(ep.reward, 6))
    for row in results
    for c, ep in row
  ]


ADAPTERS = {
  'in-process': lambda url: lambda tok: OpenEnvEnv(tok, GuessEnvironment(), action=guess_from_text),
  'server': lambda url: (
    lambda tok: OpenEnvEnv(tok, url, action=guess_from_text, observation_cls=GuessObservation)
  ),
  'typed-client': lambda url: (
    lambda tok: OpenEnvEnv(tok, GuessClient(base_url=url), action=guess_from_text)
  ),
}


@pytest.mark.parametrize('where', sorted(ADAPTERS))
def test_trajectories_through_the_adapter_equal_a_hand_written_token_environment(
  agent, servers, where
):
  job, worker = agent
  want = episode_worker.run(job, worker, lambda tok: HandWritten(tok, OpenGame()), EXAMPLES)
  made = []
  adapter = ADAPTERS[where](servers[0].url)
  got = episode_worker.run(job, worker, lambda tok: made.append(adapter(tok)) or made[-1], EXAMPLES)
  assert _trajectories(got) == _trajectories(want)
  eps = [ep for row in got for _, ep in row]
  assert max(ep.turns for ep in eps) >= 2 and 'done' in [ep.reason for ep in eps]
  assert sum(ep.reward for ep in eps) > 0  # the rubric's rewards
  # The environment's own observation type, wherever it ran.
  assert all(isinstance(env.last_observation, GuessObservation) for env in made)


def test_json_actions_are_checked_by_the_action_type_in_process_and_served(bpe, servers):
  system = action_instructions(GuessAction)
  assert '"guess"' in system and 'metadata' not in system
  local = OpenEnvEnv(bpe, GuessEnvironment(), action=GuessAction, system=system)
  served = OpenEnvEnv(bpe, servers[0].url, action=GuessAction, system=system)
  typed = OpenEnvEnv(bpe, GuessClient(base_url=servers[0].url).sync(), action=GuessAction)
  assert local.reset(EXAMPLES[0]) == served.reset(EXAMPLES[0])  # digit 3
  typed.reset(EXAMPLES[0])
  turns = [
    ('I think 5', 'error: the action is a JSON object'),
    ('{"guess": "five"}', 'error: invalid GuessAction: guess: Input should be a valid integer'),
    ('{"guess": 2}', 'Higher than 2.'),
    ('Then:\n```json\n{"guess": 3}\n```', None),
  ]
  rewards = []
  for text, reply in turns:
    turn = local.model_turn(text)
    a, b, c = local.step(turn), served.step(turn), typed.step(turn)
    assert (a.tokens, a.done, a.reward, a.info) == (b.tokens, b.done, b.reward, b.info), text
    assert (a.done, a.reward) == (c.done, c.reward)
    rewards.append(a.reward)
    if reply is not None:
      assert reply in bpe.decode(a.tokens)
      assert a.info.get('invalid_calls', 0) == reply.startswith('error')
  assert a.done and rewards == [0.0, 0.0, pytest.approx(8 / 9), 1.0]
  assert served.invalid_actions == 2 and served.last_observation['message'] == 'Right!'
  assert isinstance(typed.last_observation, GuessObservation)  # the client's own type
  for env in (local, served, typed):
    env.finish('done', [])


def test_a_rubric_given_here_scores_instead_of_the_observations_reward(bpe, servers):
  from openenv.core.rubrics import Rubric

  class Length(Rubric):
    def forward(self, action, observation):
      return len(observation['message']) / 100

  env = OpenEnvEnv(bpe, servers[0].url, action=text_action(GuessAction, 'guess'), rubric=Length())
  env.reset(EXAMPLES[1])  # digit 6
  step = env.step(env.model_turn(' 2 '))
  assert step.reward == len('Higher than 2.') / 100
  env.finish('done', [])


def _episode(env, example, guesses, pool):
  transcript = [env.reset(example)]
  for guess in guesses:
    step, failure, message = pool.submit(
      env, env.model_turn(f'{{"guess": {guess}}}'), timeout_s=30, vocab_size=10**6, max_tokens=10**4
    ).result()
    assert failure is None, message
    transcript.append((step.tokens, step.reward, step.done))
    if step.done:
      break
  env.finish('done', [])
  return transcript


def test_many_episodes_at_once_on_one_server(bpe, servers):
  examples = [{'seed': s} for s in range(24)]
  guesses = lambda s: [(s + 3) % 10, (s + 7) % 10, s % 10]
  local = [
    _episode(OpenEnvEnv(bpe, GuessEnvironment(), action=GuessAction), ex, guesses(i), EnvPool(1))
    for i, ex in enumerate(examples)
  ]
  pool = EnvPool(12)
  with concurrent.futures.ThreadPoolExecutor(24) as threads:
    served = list(
      threads.map(
        lambda i: _episode(
          OpenEnvEnv(bpe, servers[0].url, action=GuessAction), examples[i], guesses(i), pool
        ),
        range(24),
      )
    )
  pool.close()
  assert served == local
  assert all(t[-1][2] and t[-1][1] == 1.0 for t in served)  # each ended on its right guess


def test_a_failing_server_ends_only_its_own_episodes(agent, servers):
  job, worker = agent
  healthy, doomed = servers[0], OpenEnvServer(APP, cwd=ROOT)
  # In order of the episodes ([example][sample]): where each runs, and its fault.
  plan = iter(
    [(healthy.url, None), (healthy.url, 'raise'), (healthy.url, 'hang'), (doomed.url, 'die')]
  )

  def make(tok):
    url, fault = next(plan)
    env = OpenEnvEnv(
      tok, url, action=guess_from_text, step_timeout_s=3.0, reset_kwargs=lambda ex: {'fault': fault}
    )
    env.fault = fault
    return env

  try:
    results = episode_worker.run(job, worker, make, EXAMPLES)
  finally:
    doomed.close()
  eps = [ep for row in results for _, ep in row]
  assert [(ep.env.fault, ep.reason) for ep in eps] == [
    (None, 'done'),
    ('raise', 'env_error'),
    ('hang', 'env_timeout'),
    ('die', 'env_error'),
  ]
  assert 'the environment crashed' in eps[1].error
  assert doomed.process.returncode == 3 and healthy.alive()  # it died by itself
  metrics = episodes.episode_metrics(eps, np.asarray([ep.reward for ep in eps]))
  assert metrics['env/finish/env_error'] == 0.5 and metrics['env/finish/env_timeout'] == 0.25
  # The healthy episode is the hand-written environment's.
  want = episode_worker.run(job, worker, lambda tok: HandWritten(tok, OpenGame()), EXAMPLES)
  assert _trajectories(results)[0] == _trajectories(want)[0]
  # The next episodes: those whose server is gone end at their reset, the others run.
  urls = itertools.cycle([doomed.url, healthy.url, 'http://127.0.0.1:9', healthy.url])
  make = lambda tok: OpenEnvEnv(tok, next(urls), action=guess_from_text)
  results = episode_worker.run(job, worker, make, EXAMPLES)
  eps = [ep for row in results for _, ep in row]
  assert [ep.reason for ep in eps][0::2] == ['env_error', 'env_error']
  assert all(ep.error.startswith('reset: ConnectionError') for ep in eps[0::2])
  assert _trajectories(results)[1::2] == _trajectories(want)[1::2]
