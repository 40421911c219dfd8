"""verifiers environments trained by jrl: a taskset's tasks as jrl's task rows,
its reward functions as jrl's rewards, its harnesses as black-box agents on
jrl's OpenAI-compatible endpoint.

Written against verifiers 0.4.0, whose only API is v1 (`import verifiers.v1
as vf`): a `Taskset` yields `Task`s (data, plus `@vf.reward` / `@vf.metric`
methods, async functions of the task and the `Trace` of a rollout); a
harness is the program that plays a task, calling a chat-completions
endpoint; a rollout runs the harness in a runtime (here verifiers'
subprocess runtime) behind verifiers' interception server, which records
the trace and forwards each call upstream, here to jrl's `AgentEndpoint`.
verifiers pins `openai<3` and `mcp==2.0.0`, which jrl's test extra does not
meet, so it lives in an environment of its own (`pip install -e
".[verifiers]"`; docs/your_own_environment.md). jrl's core never imports
this module.

    # my_env.py, next to where the run starts
    from jrl.envs import verifiers_env
    from my_tasks import MathConfig, MathTaskset

    TASKSET = MathTaskset(MathConfig())

    def rows(task_config):                    # task.kind = 'my_env:rows'
      return verifiers_env.task_rows(TASKSET, train=1000, held_out=task_config.eval_size)

    # algorithm='agent', agent.env='my_env:make_env'
    make_env = verifiers_env.env_factory(TASKSET)
    # or single-turn GRPO: reward.functions=('my_env:score',)
    score = verifiers_env.reward_fn(TASKSET)

Rows (`task_rows`): one per task, {'prompt': the task's system prompt and
prompt as chat messages, 'answer': the task data's `answer` field if it has
one ('' otherwise: jrl never scores with it), 'verifiers': the task's data
as JSON}; the task is rebuilt from its row (`task_of`) with the taskset's
task class and task config, so rows can travel (reward worker processes).

Episodes (`VerifiersEnv`, an `AgentEnv`): the agent of an episode is a
verifiers rollout of the row's task (`vf.Agent(...).run(task)`) with the
harness of `harness` (default 'null', verifiers' tool-less chat loop, which
still serves the task's MCP tools), run as a subprocess
(`LocalRuntime`: verifiers' subprocess runtime, with the harness's
script run by this interpreter, its declared packages checked installed,
nothing downloaded). Its model calls reach jrl's endpoint, so the tokens
trained are the sampler's own. When the harness exits, the episode's reward
is the taskset's reward functions, awaited, on the transcript jrl recorded
(the messages the harness sent and the turns jrl sampled, `transcript_trace`)
with the rollout's task state, its runtime still alive; verifiers' own
scoring of its trace is skipped unless `check_rewards`, which also runs it
and ends the episode if the two disagree.

Failures end only their episode, unscored (`agent.env`'s step raises, the
episode worker counts 'env_error' / 'env_timeout'): a harness that exits
non-zero or dies, a rollout verifiers marks failed or timed out
(`rollout_timeout_s`), a reward that raises or runs past
`scoring_timeout_s`, a harness that goes silent past `turn_timeout_s`. An
episode that jrl ends first (its token budget, the turn limit) cancels its
rollout, which kills the harness's process group.

Single-turn (`reward_fn`): a jrl reward function, `fn(prompts, completions,
metadata)`, for tasks a model answers in one turn without tools: each
completion goes through its row's task's lifecycle without a harness (the
task's `setup` and `finalize` in a fresh `LocalRuntime`, the completion as
the assistant's one reply to the row's prompt) and is scored by the task's
rewards; a hook or reward that raises or runs past `timeout_s` leaves that
completion unscored (None). Rewards that need a runtime (a `runtime`
argument without a default) would read a harness's work from it, which a
bare completion has not: they are refused by name.
"""

import asyncio
import contextlib
import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

import verifiers.v1 as vf
from packaging.requirements import InvalidRequirement, Requirement
from verifiers.v1.dialects.chat import ChatDialect, message_to_wire
from verifiers.v1.graph import MessageNode
from verifiers.v1.runtimes.subprocess import SubprocessRuntime
from verifiers.v1.state import state_cls
from verifiers.v1.utils.decorators import invoke

from jrl.envs.openai_endpoint import AgentEndpoint, AgentEnv

ROW_KEY = 'verifiers'  # a row's field holding its task's data as JSON

# Tasks -------------------------------------------------------------------------


def _prompt_messages(data):
  """A task's system prompt and prompt as chat messages (OpenAI wire dicts)."""
  messages = []
  if data.system_prompt:
    messages.append({'role': 'system', 'content': data.system_prompt})
  if isinstance(data.prompt, str):
    messages.append({'role': 'user', 'content': data.prompt})
  else:
    messages += [message_to_wire(m) for m in data.prompt]
  return messages


def task_row(task):
  """The jrl row of a verifiers task (see the module). Raises ValueError for a
  task without a prompt (one the user opens: jrl's episodes start from a prompt)."""
  data = task.data
  if not data.prompt:
    raise ValueError(
      f'verifiers task {data.name or data.idx!r} has no prompt (its user opens the '
      'conversation); jrl trains tasks whose prompt opens it.'
    )
  answer = getattr(data, 'answer', None)
  if isinstance(answer, bool) or not isinstance(answer, str | int | float):
    answer = ''
  return {
    'prompt': _prompt_messages(data),
    'answer': str(answer),
    ROW_KEY: data.model_dump(mode='json', exclude_none=True),
  }


def task_rows(taskset, *, train=None, held_out=0):
  """(train rows, held-out rows) of `taskset` for `task.kind` (a function
  `fn(task_config)` returning these; see the module): the held-out rows are
  its first `held_out` tasks, the training rows the `train` tasks after them
  (None: all the rest; an infinite taskset needs a number). Raises ValueError
  when a training task is a held-out one again (the same key, or the same
  data at another position)."""
  if not isinstance(held_out, int) or held_out < 0:
    raise ValueError(f'`held_out` must be a count of tasks >= 0, got {held_out!r}.')
  if train is not None and (not isinstance(train, int) or train < 1):
    raise ValueError(f'`train` must be a count of tasks >= 1 or None, got {train!r}.')
  if train is None and not taskset.bounded:
    raise ValueError(
      f'{type(taskset).__name__} yields tasks forever: give `train`, the number of training tasks.'
    )
  view = taskset if train is None else taskset.take(held_out + train)
  tasks = list(view)
  evaluation, training = tasks[:held_out], tasks[held_out:]
  if len(evaluation) < held_out or not training:
    raise ValueError(
      f'{type(taskset).__name__} has {len(tasks)} tasks: too few for {held_out} held-out '
      'and at least one training task.'
    )
  seen = {_identity(t) for t in evaluation} | {t.key for t in evaluation}
  both = [t.data.name or t.data.idx for t in training if seen & {_identity(t), t.key}]
  if both:
    raise ValueError(f'held-out tasks appear in training too: {both[:5]}')
  return [task_row(t) for t in training], [task_row(t) for t in evaluation]


def _identity(task):
  """A task's content, without its position (`idx`), which its default key includes."""
  data = task.data.model_dump(mode='json', exclude_none=True, exclude={'idx'})
  return json.dumps(data, sort_keys=True)


def task_of(taskset, row):
  """The verifiers task of a jrl row (`task_row`), rebuilt with the taskset's
  task class and task config."""
  if ROW_KEY not in row:
    raise ValueError(
      f'this row has no `{ROW_KEY}` field: make the task rows with '
      'jrl.envs.verifiers_env.task_rows.'
    )
  task_cls = type(taskset).task_type()
  data = task_cls.data_type().model_validate(row[ROW_KEY])
  return task_cls(data, taskset.config.task)


def _needs_runtime(fn):
  param = inspect.signature(fn).parameters.get('runtime')
  return param is not None and param.default is inspect.Parameter.empty


def runtime_rewards(task):
  """The names of `task`'s rewards (its judges' included) that need a live runtime."""
  names = [fn.__name__ for fn in task.hooks('reward') if _needs_runtime(fn)]
  names += [j.reward_name for j in task.plugged_judges() if _needs_runtime(j.score)]
  return names


# Transcripts and scores --------------------------------------------------------------


def transcript_trace(task, messages, *, tools=None, sampled_from=0, like=None):
  """A verifiers `Trace` of `task` whose messages are `messages` (OpenAI wire
  dicts, as jrl's endpoint recorded them), read as verifiers' interception
  reads a request; the assistant messages from `sampled_from` on count as the
  model's turns. `like`: a rollout's trace whose task state, info and tools
  it takes (what `Task.setup` left for the rewards)."""
  request = ChatDialect().parse_request({'messages': list(messages), 'tools': tools or []})
  trace = vf.Trace(
    task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
    agent=vf.AgentInfo(config=vf.AgentConfig(model='policy', runtime=vf.SubprocessConfig())),
    state=like.state if like is not None else state_cls(type(task))(),
    tools=request.tools or [],
  )
  if like is not None:
    trace.info = dict(like.info)
  for i, message in enumerate(request.messages):
    node = MessageNode(
      parent=i - 1 if i else None,
      message=message,
      sampled=i >= sampled_from and message.role == 'assistant',
      tools=(request.tools or []) if i == 0 else [],
    )
    trace.nodes.append(node)
  trace.is_completed = trace.ok = True
  return trace


async def score_trace(task, trace, runtime=None, *, timeout_s=None):
  """`task.score(trace, runtime)` awaited (the rewards' functions, its metrics
  and judges), within `timeout_s` (None: no limit); returns {name: weighted
  value} of the rewards. Raises what scoring raised, or TimeoutError."""
  async with asyncio.timeout(timeout_s):
    await task.score(trace, runtime)
  unscored = [name for name, r in trace.rewards.items() if r is None]
  if unscored:
    raise RuntimeError(f'verifiers left rewards unscored: {unscored}')
  return {name: r.value for name, r in trace.rewards.items()}


def reward_fn(taskset, *, timeout_s=60.0):
  """A jrl reward function (`fn(prompts, completions, metadata) -> [float |
  None]`, named by import path in `reward.functions`): each completion scored
  by its row's task's rewards, awaited, on a trace of the row's prompt and the
  completion (see the module). `timeout_s` bounds each completion's scoring."""

  def score(prompts, completions, metadata):
    del prompts  # the row's own prompt messages are the trace's
    return asyncio.run(_score_completions(taskset, completions, metadata, timeout_s))

  score.__name__ = f'verifiers_{type(taskset).__name__}'
  return score


async def _score_completions(taskset, completions, metadata, timeout_s):
  async def one(text, row):
    task = task_of(taskset, row)
    needs = runtime_rewards(task)
    if needs:
      raise ValueError(
        f'{type(task).__name__}: rewards {needs} need a runtime, which a bare completion '
        'has not; train it through its harness (agent.env, VerifiersEnv).'
      )
    prompt = row['prompt']
    messages = [*prompt, {'role': 'assistant', 'content': text}]
    trace = transcript_trace(task, messages, sampled_from=len(prompt))
    box = LocalRuntime()
    await box.start()
    try:
      async with asyncio.timeout(timeout_s):
        await invoke(task.setup, {'trace': trace, 'runtime': box})
        await invoke(task.finalize, {'trace': trace, 'runtime': box})
        return sum((await score_trace(task, trace)).values())
    except Exception:  # a hook or reward that raised or hung: this completion is unscored
      return None
    finally:
      await box.stop()

  return list(await asyncio.gather(*map(one, completions, metadata)))


# The runtime ---------------------------------------------------------------------------

_SCRIPT_BLOCK = re.compile(r'^# /// script\s*$(.*?)^# ///\s*$', re.M | re.S)
_DEPENDENCIES = re.compile(r'dependencies\s*=\s*\[(.*?)\]', re.S)


def script_requirements(source):
  """The `dependencies` of a PEP 723 script's metadata block ([] if none)."""
  block = _SCRIPT_BLOCK.search(source)
  if not block:
    return []
  lines = [line.removeprefix('#').strip() for line in block.group(1).splitlines()]
  found = _DEPENDENCIES.search('\n'.join(lines))
  return re.findall(r'"([^"]+)"|\'([^\']+)\'', found.group(1)) if found else []


def missing_requirements(source):
  """The requirements of a PEP 723 script this interpreter does not meet."""
  missing = []
  for pair in script_requirements(source):
    text = pair[0] or pair[1]
    try:
      req = Requirement(text)
    except InvalidRequirement:
      missing.append(f'{text} (unreadable)')
      continue
    try:
      version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
      missing.append(text)
      continue
    if req.specifier and not req.specifier.contains(version, prereleases=True):
      missing.append(f'{text} (installed: {version})')
  return missing


class LocalRuntime(SubprocessRuntime):
  """verifiers' subprocess runtime, offline: a working directory of its own
  (a temporary one, removed at `stop`), and a harness's PEP 723 script run by
  this interpreter instead of an environment uv would download. The
  script's declared packages must be installed here; a missing one raises
  naming it (the rollout fails: 'env_error')."""

  def __init__(self, name=None):
    super().__init__(vf.SubprocessConfig(), name)

  async def run(self, argv, env):
    """`argv` in the working directory, in a process group of its own, to its
    exit; cancelled, the group is killed and reaped before this returns.
    Variables whose names hold 'API_KEY' are not inherited (verifiers'
    policy: the harness's key is the interception's, handed to it)."""
    inherited = {k: v for k, v in os.environ.items() if 'API_KEY' not in k.upper()}
    proc = await asyncio.create_subprocess_exec(
      *argv,
      env={**inherited, **self.process_env(env)},
      cwd=self.workdir,
      stdout=asyncio.subprocess.PIPE,
      stderr=asyncio.subprocess.PIPE,
      start_new_session=True,
    )
    try:
      stdout, stderr = await proc.communicate()
    except BaseException:
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
      await asyncio.shield(proc.wait())
      raise
    return vf.ProgramResult(
      exit_code=proc.returncode or 0,
      stdout=stdout.decode(errors='replace'),
      stderr=stderr.decode(errors='replace'),
    )

  async def start(self):
    self.workdir = Path(tempfile.mkdtemp(prefix='jrl-verifiers-'))
    self.info.id = str(self.workdir)

  async def prepare_uv_script(self, script, env=None, *, activate=True):
    del env, activate  # this interpreter's environment, as it is
    source = script.decode() if isinstance(script, bytes) else script
    missing = missing_requirements(source)
    if missing:
      raise RuntimeError(
        f'the harness script needs {missing}, not installed for {sys.executable}; '
        'install them there (nothing is downloaded at run time).'
      )
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = self.workdir / f'.vf-script-{digest}.py'
    if not path.exists():
      path.write_text(source)
    return [sys.executable, str(path)]

  def cleanup(self):
    super().cleanup()
    if self.workdir is not None:
      shutil.rmtree(self.workdir, ignore_errors=True)


# Episodes ------------------------------------------------------------------------------


class RolloutFailed(RuntimeError):
  """The verifiers rollout of an episode failed or timed out (its own record says how)."""


def harness_class(harness_id):
  """The verifiers `Harness` class of an id."""
  from verifiers.v1.utils.loaders import harness_class as find

  return find(harness_id)


def harness_config(spec):
  """A verifiers harness config from an id ('null', 'bash', ...), a dict of its
  fields with its `id` ({'id': 'bash', 'edit': False}), or a `vf.HarnessConfig`."""
  if isinstance(spec, vf.HarnessConfig):
    return spec
  from verifiers.v1.utils.loaders import harness_config_type

  fields = {'id': spec} if isinstance(spec, str) else dict(spec)
  if not isinstance(fields.get('id'), str):
    raise ValueError(f'a verifiers harness needs an `id` (e.g. "null"), got {spec!r}.')
  return harness_config_type(fields['id']).model_validate(fields)


class VerifiersEnv(AgentEnv):
  """One episode of a verifiers task, its harness playing it through jrl's
  endpoint (see the module).

  Args:
    tokenizer: the checkpoint's tokenizer (with its chat template).
    endpoint: a started `AgentEndpoint`.
    taskset: the `vf.Taskset` the rows were made from (`task_rows`).
    harness: a verifiers harness (`harness_config`: an id such as 'null' or
      'bash', a dict of its config, a `vf.HarnessConfig`); one that needs a
      container is refused by verifiers.
    host_code: allow a harness that runs the model's commands (verifiers'
      `EXECUTES_CODE`: 'bash' and the other agent programs). They run on
      this machine, outside jrl's sandbox, with access to what the trainer
      process can read; refused unless set.
    rollout_timeout_s: verifiers' limit on the harness's run (None: none).
    scoring_timeout_s: the limit on scoring an episode.
    check_rewards: also let verifiers score its own record of the rollout,
      and end the episode (unscored) if its rewards differ from jrl's.
    turn_timeout_s, family, template_kwargs: as `AgentEnv`.

  After an episode: `verifiers_trace` (verifiers' record of the rollout),
  `transcript` (the trace jrl scored) and `rewards` ({'jrl': {name: value},
  'verifiers': {...} with `check_rewards`}).
  """

  def __init__(
    self,
    tokenizer,
    endpoint,
    taskset,
    *,
    harness='null',
    host_code=False,
    rollout_timeout_s=None,
    scoring_timeout_s=60.0,
    check_rewards=False,
    turn_timeout_s=60.0,
    family=None,
    template_kwargs=None,
  ):
    super().__init__(
      tokenizer,
      endpoint,
      self._play,
      family=family,
      template_kwargs=template_kwargs,
      turn_timeout_s=turn_timeout_s,
    )
    self.taskset = taskset
    self.harness = harness_config(harness)
    if not host_code and harness_class(self.harness.id).EXECUTES_CODE:
      raise ValueError(
        f"verifiers harness {self.harness.id!r} runs the model's commands, here on this "
        'machine outside jrl\'s sandbox: set host_code=True to allow it, or use "null".'
      )
    self.rollout_timeout_s = rollout_timeout_s
    self.scoring_timeout_s = scoring_timeout_s
    self.check_rewards = bool(check_rewards)
    self.verifiers_trace = self.transcript = self.rewards = None
    self._lock = threading.Lock()
    self._ended = False
    self._running = None  # (event loop, its rollout task) while the rollout runs
    self._prompt_len = 0
    self._tools = None

  def reset(self, example):
    ids = super().reset(example)
    self._prompt_len = len(self.sent)
    self._tools = self.pending.body.get('tools')
    return ids

  def _play(self, base_url, api_key, example):
    """The episode's agent (in its own thread): the rollout on a loop of its own."""
    loop = asyncio.new_event_loop()
    try:
      main = loop.create_task(self._rollout(base_url, api_key, task_of(self.taskset, example)))
      with self._lock:
        if self._ended:
          main.cancel()
        self._running = (loop, main)
      return loop.run_until_complete(main)
    except asyncio.CancelledError:
      raise RolloutFailed('the episode ended before its rollout did: cancelled') from None
    finally:
      with self._lock:
        self._running = None
      loop.close()

  async def _rollout(self, base_url, api_key, task):
    # verifiers reads an endpoint's key from an environment variable when its
    # client is made: one variable per episode, dropped when it ends (its
    # subprocesses never see it: the runtime drops names with API_KEY).
    key_var = f'JRL_VERIFIERS_API_KEY_{secrets.token_hex(8)}'
    os.environ[key_var] = api_key
    box = LocalRuntime()
    await box.start()
    try:
      config = vf.AgentConfig(
        harness=self.harness,
        runtime=vf.SubprocessConfig(),
        model='policy',
        client=vf.EvalClientConfig(base_url=base_url, api_key_var=key_var),
        timeout={'rollout': self.rollout_timeout_s, 'scoring': self.scoring_timeout_s},
      )
      async with vf.Agent(config) as agent:
        played = task if self.check_rewards else task.defer_scoring()
        trace = await agent.run(played, runtime=box)
      self.verifiers_trace = trace
      if not trace.ok:
        error = trace.last_error
        raise RolloutFailed(f'verifiers rollout failed: {error.type}: {error.message}')
      if trace.is_timeout:
        raise RolloutFailed(f'verifiers rollout stopped: {trace.stop_condition}')
      self.transcript = transcript_trace(
        task, list(self.sent), tools=self._tools, sampled_from=self._prompt_len, like=trace
      )
      ours = await score_trace(task, self.transcript, box, timeout_s=self.scoring_timeout_s)
      self.rewards = {'jrl': ours}
      if self.check_rewards:
        theirs = {name: r.value for name, r in trace.rewards.items() if r is not None}
        self.rewards['verifiers'] = theirs
        if theirs != ours:
          raise RolloutFailed(f'rewards differ: jrl {ours}, verifiers {theirs}')
      return sum(ours.values())
    finally:
      os.environ.pop(key_var, None)
      await box.stop()

  def finish(self, reason, last_turn_tokens):
    """The episode is over: its rollout, if still running, is cancelled (the
    harness's processes killed)."""
    super().finish(reason, last_turn_tokens)
    with self._lock:
      self._ended = True
      running = self._running
    if running is not None:
      loop, main = running
      try:
        loop.call_soon_threadsafe(main.cancel)
      except RuntimeError:
        pass  # the loop closed meanwhile: the rollout is over


def env_factory(taskset, **options):
  """An `agent.env` factory (`factory(tokenizer) -> VerifiersEnv`) for
  `taskset`'s rows; `options` as `VerifiersEnv`. Its episodes share one
  `AgentEndpoint`, started by the first."""
  started = []
  lock = threading.Lock()

  def make_env(tokenizer):
    with lock:
      if not started:
        started.append(AgentEndpoint().start())
    return VerifiersEnv(tokenizer, started[0], taskset, **options)

  return make_env
