"""OpenEnv environments, in process or served on localhost, as chat episodes.

    from my_env import GuessAction, GuessEnvironment           # an OpenEnv Environment

    def in_process(tokenizer):                                 # agent.env = 'pkg.mod:in_process'
      return OpenEnvEnv(tokenizer, GuessEnvironment(), action=GuessAction,
                        system=action_instructions(GuessAction))

    SERVER = 'my_env.server:app'      # app = create_app(GuessEnvironment, GuessAction, ...)

    def served(tokenizer):
      return OpenEnvEnv(tokenizer, shared(SERVER).url, action=GuessAction)

An OpenEnv environment (`openenv.core.env_server.Environment`) has
`reset(seed=None, episode_id=None, **kw) -> Observation` and `step(action,
timeout_s=None, **kw) -> Observation`, with typed (pydantic) actions and
observations; an observation carries `done` and `reward` (which the
environment computes, by convention with its rubric). `OpenEnvEnv` plays
one episode of it as a conversation in the checkpoint's chat template
(`jrl.envs.gym_env.TextEpisodeEnv`): each observation is a user message,
each model turn is exactly the sampled tokens, and its text becomes the
environment's own Action:

- `action=MyAction` (an Action class): the turn's JSON object holds the
  action's fields (the last {...} in the turn, or a ```json block), checked
  by the class (`json_action`; `action_instructions(MyAction)` is a system
  prompt that tells the model the fields);
- `action=fn`: any fn(turn text) -> Action (or, for a server, the action's
  JSON dict); `text_action(MyAction, 'field')` puts the whole turn in one
  field.
A turn that is not a valid action (ValueError, pydantic's ValidationError)
is answered with a user message saying what is wrong, counted as
`invalid_calls`; the environment does not step. Observations become text
through `observation_fn` (default `observation_text`: the observation's
only text field, else its fields as JSON). Rewards: each step's
`observation.reward` (None counts 0), summed over the episode; or, with
`rubric=` an OpenEnv `Rubric` run here on (action, observation) at each
step (reset with the episode), its score instead.

Where the environment runs:
- in process: an Environment instance (the `agent.env` factory makes one
  per episode); steps run on the environment pool's threads;
- on a server: its URL. The episode opens a WebSocket session to the
  server's `/ws` route (OpenEnv's `GenericEnvClient`, or a typed `EnvClient`
  passed instead of the URL), which gives it an environment instance of
  its own for the episode's life (HTTP `/reset` and `/step` make a fresh
  environment per request, so they cannot hold an episode). All sessions
  of the process share one event loop in a background thread; many
  episodes are in flight at once. The server must allow them:
  `create_app(..., max_concurrent_envs=N)` with N at least
  `rl.prompts_per_step * rl.group_size`, and an Environment class with
  `SUPPORTS_CONCURRENT_SESSIONS = True`.
`OpenEnvServer` / `shared` serve an app (`create_app(...)`, by its import
path) under uvicorn on 127.0.0.1 in a process of its own.

Failures end only their own episode, unscored ('env_error', see
`jrl.trainers.rollouts.episodes`): an environment that raises; a server that does not
answer within `step_timeout_s`; a server that died (the episodes it held
fail at their next step; a reset that cannot connect fails that episode
before its first turn). Episodes on other servers, or in process, go on.

Seeds: `reset(seed=episode_seed(example))` (see `jrl.envs.gym_env`), so
the `rl.group_size` samples of a prompt start from the same observation.

Needs `openenv-core` (`pip install -e ".[openenv]"`; it ships the module
`openenv`, and imports gradio, ~3 s, on first use); jrl's core never
imports it.
"""

import asyncio
import atexit
import collections
import inspect
import json
import re
import subprocess
import sys
import threading

from jrl.envs.base import Step
from jrl.envs.gym_env import TextEpisodeEnv, episode_seed, step_reward

# -- actions and observations -------------------------------------------------------------

_FENCE = re.compile(r'```(?:json)?\s*(\{.*?\})\s*```', re.DOTALL)


def _fields_error(error):
  """A short text of a pydantic ValidationError ('field: problem; ...')."""
  errors = getattr(error, 'errors', None)
  if not callable(errors):
    return str(error)
  parts = []
  for err in errors():
    where = '.'.join(str(x) for x in err.get('loc', ())) or 'action'
    parts.append(f'{where}: {err.get("msg", "invalid")}')
  return '; '.join(parts)


def _json_object(text):
  """The JSON object a turn holds: a ```json block, else from its first '{'
  to its last '}'. Raises ValueError naming what is missing."""
  fenced = _FENCE.findall(text)
  if fenced:
    body = fenced[-1]
  else:
    start, end = text.find('{'), text.rfind('}')
    if start < 0 or end < start:
      raise ValueError('the action is a JSON object ({...}); none was found')
    body = text[start : end + 1]
  try:
    data = json.loads(body)
  except ValueError as e:
    raise ValueError(f'the action is not valid JSON ({e})') from None
  if not isinstance(data, dict):
    raise ValueError('the action is a JSON object of its fields')
  return data


def json_action(action_cls):
  """fn(turn text) -> `action_cls`, from the JSON object of its fields in the
  turn; ValueError (the model reads it) when there is none or it does not
  validate."""

  def parse(text):
    data = _json_object(text)
    try:
      return action_cls.model_validate(data)
    except ValueError as e:  # pydantic's ValidationError
      raise ValueError(f'invalid {action_cls.__name__}: {_fields_error(e)}') from None

  parse.action_cls = action_cls
  return parse


def text_action(action_cls, field):
  """fn(turn text) -> `action_cls(**{field: text})`: the turn's whole text
  (stripped) as one field of the action."""
  if field not in action_cls.model_fields:
    raise ValueError(f'{action_cls.__name__} has no field {field!r}')

  def parse(text):
    try:
      return action_cls.model_validate({field: text.strip()})
    except ValueError as e:
      raise ValueError(f'invalid {action_cls.__name__}: {_fields_error(e)}') from None

  parse.action_cls = action_cls
  return parse


def action_instructions(action_cls):
  """A system prompt that tells the model how to write an `action_cls`: a
  JSON object of its fields (their JSON schema, `metadata` left out)."""
  schema = action_cls.model_json_schema()
  schema.get('properties', {}).pop('metadata', None)
  return (
    'Answer each turn with one JSON object, the action, with these fields '
    f'(JSON schema): {json.dumps(schema, ensure_ascii=False)}'
  )


_BOOKKEEPING = ('done', 'reward', 'metadata')


def observation_text(observation):
  """An observation's text: its only text field when it has one, else its
  fields (done, reward and metadata left out) as JSON. `observation`: an
  OpenEnv Observation, or the dict of its fields a server sends."""
  if hasattr(observation, 'model_dump'):
    fields = observation.model_dump(exclude=set(_BOOKKEEPING))
  elif isinstance(observation, dict):
    fields = {k: v for k, v in observation.items() if k not in _BOOKKEEPING}
  else:
    return str(observation)
  if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
    return next(iter(fields.values()))
  return json.dumps(fields, ensure_ascii=False, default=str)


# -- where the environment runs ------------------------------------------------------------


class _Loop:
  """One event loop in a daemon thread for every server session of the process."""

  _lock = threading.Lock()
  _loop = None

  @classmethod
  def get(cls):
    with cls._lock:
      if cls._loop is None or not cls._loop.is_running():
        loop = asyncio.new_event_loop()
        started = threading.Event()
        loop.call_soon(started.set)
        threading.Thread(target=loop.run_forever, daemon=True, name='openenv').start()
        started.wait(10)
        cls._loop = loop
      return cls._loop


class _InProcess:
  """An Environment instance, stepped in the caller's thread."""

  def __init__(self, env):
    self.env = env
    self.where = type(env).__name__

  def reset(self, **kwargs):
    obs = self.env.reset(**kwargs)
    return obs, obs.reward, bool(obs.done)

  def step(self, action):
    obs = self.env.step(action)
    return obs, obs.reward, bool(obs.done)

  def close(self):
    self.env.close()


class _Session:
  """One WebSocket session with a server (an `EnvClient`), driven from
  synchronous code through the shared event loop."""

  def __init__(self, client, timeout_s, observation_cls=None):
    self.client = client
    self.timeout_s = float(timeout_s)
    self.observation_cls = observation_cls
    self.where = getattr(client, '_ws_url', type(client).__name__)
    self.broken = None

  def _run(self, coro, what):
    if self.broken:
      coro.close()
      raise ConnectionError(f'OpenEnv session {self.where}: {self.broken}')
    future = asyncio.run_coroutine_threadsafe(coro, _Loop.get())
    try:
      return future.result(self.timeout_s)
    except TimeoutError:
      future.cancel()
      self.broken = f'no answer to {what} within {self.timeout_s} s'
      raise TimeoutError(f'OpenEnv server {self.where}: {self.broken}') from None
    except Exception as e:
      self.broken = f'{what} failed: {type(e).__name__}: {e}'
      raise

  def _result(self, result):
    obs = result.observation
    if self.observation_cls is not None and isinstance(obs, dict):
      fields = {**obs, 'reward': result.reward, 'done': result.done}
      obs = self.observation_cls.model_validate(fields)
    return obs, result.reward, bool(result.done)

  def reset(self, **kwargs):
    self._run(self.client.connect(), 'connect')
    return self._result(self._run(self.client.reset(**kwargs), 'reset'))

  def step(self, action):
    return self._result(self._run(self.client.step(action), 'step'))

  def close(self):
    """Closes the WebSocket (the server drops the session's environment) on
    the loop, without waiting: a hung or dead server cannot hold it up."""
    future = asyncio.run_coroutine_threadsafe(self.client.close(), _Loop.get())
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # deliberate: best effort


def _run_rubric(rubric, action, observation):
  score = rubric(action, observation)
  if inspect.iscoroutine(score):
    score = asyncio.run(score)
  return score


class OpenEnvEnv(TextEpisodeEnv):
  """One episode of an OpenEnv environment, in process or on a server (see the module).

  Args:
    tokenizer: the checkpoint's tokenizer (with its chat template).
    env: an OpenEnv `Environment` instance (in process; one per episode), a
      server's URL ('http://127.0.0.1:8000' or 'ws://...'), or an `EnvClient`
      (typed, not yet connected; or its `.sync()` wrapper) for that server.
    action: the Action class (the model writes its fields as JSON:
      `json_action`), or fn(turn text) -> the action (raise ValueError for
      text that is not one: the model reads the message).
    observation_fn: fn(observation) -> its text (default `observation_text`).
    observation_cls: the Observation class to rebuild a server's
      observations as (default: the dict of fields it sends; a typed
      `EnvClient` gives its own types).
    rubric: an OpenEnv `Rubric` scoring each (action, observation) here,
      instead of the observation's reward (reset with each episode; it sees
      the observation as `last_observation` holds it).
    system: a system message (e.g. `action_instructions(MyAction)`), or None.
    seed: fn(example) -> the episode's seed (default `episode_seed`).
    reset_kwargs: fn(example) -> more keyword arguments of `reset`.
    step_timeout_s: a server that does not answer a reset or step in time
      ends the episode.
    family, on_rewrite, template_kwargs: as `jrl.envs.chat.Conversation`.

  `last_observation` is the latest observation, typed where it can be.
  """

  def __init__(
    self,
    tokenizer,
    env,
    *,
    action,
    observation_fn=None,
    observation_cls=None,
    rubric=None,
    system=None,
    seed=None,
    reset_kwargs=None,
    step_timeout_s=30.0,
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
    if isinstance(action, type):
      action = json_action(action)
    if not callable(action):
      raise TypeError(f'`action` must be an Action class or a function, got {action!r}')
    self.action_fn = action
    self.observation_fn = observation_fn or observation_text
    self.rubric = rubric
    self.seed_fn = seed or episode_seed
    self.reset_kwargs = reset_kwargs
    if isinstance(env, str):
      from openenv.core.generic_client import GenericEnvClient

      env = GenericEnvClient(base_url=env, message_timeout_s=step_timeout_s)
    env = getattr(env, 'async_client', env)  # a SyncEnvClient: the client it wraps
    if hasattr(env, '_step_payload') and hasattr(env, 'connect'):  # an EnvClient
      self.session = _Session(env, step_timeout_s, observation_cls)
    elif all(callable(getattr(env, m, None)) for m in ('reset', 'step')):
      self.session = _InProcess(env)
    else:
      raise TypeError(
        f'`env` must be an OpenEnv Environment, a server URL or an EnvClient, got {env!r}'
      )
    self.seed = None
    self.last_observation = None
    self.invalid_actions = 0

  def reset(self, example):
    self.seed = int(self.seed_fn(example))
    kwargs = dict(self.reset_kwargs(example)) if self.reset_kwargs else {}
    if self.rubric is not None:
      self.rubric.reset()
    obs, _, done = self.session.reset(seed=self.seed, **kwargs)
    if done:
      raise ValueError(f'{self.session.where}: the episode ended at its reset')
    self.last_observation = obs
    return self._open(self.observation_fn(obs))

  def step(self, turn_tokens):
    text = self._model_turn(turn_tokens)
    try:
      action = self.action_fn(text)
    except ValueError as e:
      self.invalid_actions += 1
      tokens = self._observe(f'error: {e}')
      return Step(tokens, info={'invalid_calls': 1, **self._render_info()})
    obs, reward, done = self.session.step(action)
    self.last_observation = obs
    if self.rubric is not None:
      reward = _run_rubric(self.rubric, action, obs)
    reward = step_reward(reward, f'{self.session.where} step')
    if done:
      return Step([], done=True, reward=reward)
    tokens = self._observe(self.observation_fn(obs))
    return Step(tokens, reward=reward, info=self._render_info())

  def finish(self, reason, last_turn_tokens):
    """Closes the session (or the in-process environment), whatever ended it."""
    del reason, last_turn_tokens
    self.session.close()


# -- servers ---------------------------------------------------------------------------------


class ServerError(RuntimeError):
  """An OpenEnv server did not start."""


class OpenEnvServer:
  """An OpenEnv app served by uvicorn on 127.0.0.1, in a process of its own.

      server = OpenEnvServer('my_env.server:app')     # app = create_app(...)
      env = OpenEnvEnv(tokenizer, server.url, action=MyAction)
      server.close()

  Args:
    app: the app's import path ('package.module:app'), as uvicorn takes it.
    port: the port (default: a free one, chosen by the server).
    cwd, env: the server process's working directory and environment
      variables (e.g. a PYTHONPATH where `app` is found).
    start_timeout_s: a server not listening by then raises ServerError
      with the end of its log.
  """

  def __init__(self, app, *, port=0, cwd=None, env=None, start_timeout_s=60.0):
    self.app = app
    command = [sys.executable, '-m', 'uvicorn', app, '--host', '127.0.0.1']
    # Sessions still open (a hung step) hold a graceful shutdown for 3 s at most.
    command += ['--port', str(int(port)), '--no-access-log', '--timeout-graceful-shutdown', '3']
    self.process = subprocess.Popen(
      command,
      cwd=cwd,
      env=env,
      stdin=subprocess.DEVNULL,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )
    self.log = collections.deque(maxlen=50)
    self.url = None
    ready = threading.Event()
    threading.Thread(target=self._read_log, args=(ready,), daemon=True).start()
    if not ready.wait(start_timeout_s) or self.url is None:
      self.close()
      tail = '\n'.join(self.log)
      raise ServerError(f'OpenEnv server {app!r} did not start in {start_timeout_s} s:\n{tail}')

  def _read_log(self, ready):
    """Reads the server's log: its address, then the rest (kept for errors)."""
    for line in self.process.stderr:
      self.log.append(line.rstrip())
      found = re.search(r'running on (http://127\.0\.0\.1:\d+)', line)
      if found and self.url is None:
        self.url = found.group(1)
        ready.set()
    ready.set()  # the process ended

  def alive(self):
    return self.process.poll() is None

  def close(self):
    """Stops the server (its sessions' episodes fail at their next step)."""
    if self.process.poll() is None:
      self.process.terminate()
      try:
        self.process.wait(10)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait(10)


_SHARED = {}
_SHARED_LOCK = threading.Lock()


def shared(app, **options):
  """One started `OpenEnvServer` per app in this process (closed at exit);
  one that died is started again for the episodes that come after."""
  with _SHARED_LOCK:
    server = _SHARED.get(app)
    if server is None or not server.alive():
      _SHARED[app] = server = OpenEnvServer(app, **options)
    return server


@atexit.register
def _close_shared():
  for server in _SHARED.values():
    try:
      server.close()
    except Exception:
      pass  # deliberate: the process is ending
