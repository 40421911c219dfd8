"""The environment protocol for multi-turn (agentic) rollouts, on tokens.

A trajectory is one token sequence: the prompt, then model turns and
environment turns alternating. The sampler generates a model turn until one
of the environment's `turn_stop_tokens` (a tool call's closing token, or
end of sequence); the environment reads that turn and answers with tokens
that are appended to the same sequence (the sampler continues on its cached
pages, see `jrl.sampler.Sampler.generate(on_turn_end=...)`). Nothing is
re-tokenised: the trainer sees exactly the tokens the sampler produced and
the environment returned, with a loss mask over the model's tokens only.

    class MyEnv(Environment):
      def reset(self, example):           # -> prompt token ids
      def step(self, turn_tokens):        # -> Step(tokens, done, reward, info)

`run_step` wraps `step` with the limits: an exception, a timeout, or output
that is not a list of valid token ids ends the trajectory with a recorded
reason instead of reaching the run. `EnvPool.submit` does the same without
waiting, so the sampler decodes other samples while a step runs.
"""

import concurrent.futures
import dataclasses
import threading

FINISH_REASONS = (
  'done',  # the environment ended the episode
  'stop',  # the model ended its turn with end-of-sequence
  'length',  # the token budget ran out
  'max_turns',  # the turn limit
  'env_error',  # the environment raised
  'env_timeout',  # the environment did not answer in time
  'env_invalid',  # the environment returned something that is not token ids
)


@dataclasses.dataclass
class Step:
  """The environment's answer to one model turn."""

  tokens: list  # token ids appended after the model's turn ([] when done)
  done: bool = False  # the episode is over
  reward: float = 0.0  # added to the trajectory's reward
  info: dict = dataclasses.field(default_factory=dict)  # counters, summed per trajectory


@dataclasses.dataclass(frozen=True)
class TurnSampling:
  """How the model's next turn is sampled, as an environment asks (a
  black-box agent's request: `jrl.envs.openai_endpoint`). None: the run's.

  `max_tokens`: the turn ends after that many tokens, as if the model had
  stopped it (the environment sees the turn so far; 0: no limit but the
  episode's budget). `temperature`: 0 is greedy. A greedy run (the held-out
  evaluation) stays greedy.
  """

  max_tokens: int | None = None
  temperature: float | None = None

  def check(self):
    """Raises ValueError naming the field that is out of range."""
    if self.max_tokens is not None and (
      not isinstance(self.max_tokens, int)
      or isinstance(self.max_tokens, bool)
      or self.max_tokens < 0
    ):
      raise ValueError(f'`max_tokens` must be an int >= 0, got {self.max_tokens!r}')
    t = self.temperature
    if t is not None and (
      not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t < float('inf')
    ):
      raise ValueError(f'`temperature` must be a number >= 0, got {t!r}')
    return self


class Environment:
  """Base class; subclasses implement `reset` and `step`.

  `turn_stop_tokens`: tokens that end a model turn (besides the sampler's
  stop tokens, which end the episode).
  `sampling`: a `TurnSampling` for the model's next turn, read after
  `reset` and after each `step` (None: the run's sampling).
  """

  turn_stop_tokens: tuple = ()
  sampling = None
  # True: `step` is called as step(turn_tokens, logprobs=...) with the turn's
  # per-token logprobs as the sampler drew them (e.g. to report them to an agent).
  wants_logprobs: bool = False

  def reset(self, example):
    """Starts an episode for `example`; returns the prompt's token ids."""
    raise NotImplementedError  # deliberate: the protocol; subclasses implement it

  def step(self, turn_tokens):
    """The model's latest turn (token ids, its stop token included) -> Step."""
    raise NotImplementedError  # deliberate: the protocol; subclasses implement it

  def final_reward(self, trajectory_text):
    """Reward when the model ends the episode itself (end of sequence)."""
    del trajectory_text
    return 0.0

  def finish(self, reason, last_turn_tokens):
    """Called once the episode is over, whatever ended it (`reason`: a
    FINISH_REASONS entry; the tokens of the turn in progress, [] if none):
    release what waits on the episode (e.g. a black-box agent's request)."""
    del reason, last_turn_tokens


class EnvPool:
  """Environment steps on worker threads, so that decoding never waits for one.

  `submit` returns at once with a `concurrent.futures.Future` that resolves
  to `run_step`'s (Step or None, failure reason or None, message): the
  step's answer, checked, or 'env_timeout' once `timeout_s` has passed since
  the submission, whichever comes first. The sampler parks the sample whose
  turn it answers (`Sampler.generate(on_turn_end=...)` returning a Future)
  and decodes the other slots meanwhile.

  A step that runs past its deadline keeps its thread (Python cannot stop a
  thread) but ends only its own episode; the deadline counts from the
  submission, so steps queued behind hung ones time out too rather than
  waiting forever. Environments that can hang on untrusted input should run
  it in a process, as the code tool does (`jrl.rewards.sandbox`).
  """

  def __init__(self, workers, name='env'):
    if not isinstance(workers, int) or workers < 1:
      raise ValueError(f'an EnvPool needs at least 1 worker, got {workers!r}.')
    self.workers = workers
    self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
    self._lock = threading.Lock()

  def submit(self, env, turn_tokens, *, timeout_s, vocab_size, max_tokens, logprobs=None):
    """`env.step(turn_tokens)` in a worker; a Future of (Step | None, reason | None, message).
    `logprobs` (the turn's, [len(turn_tokens)]) go to an env with `wants_logprobs`."""
    out = concurrent.futures.Future()
    out.set_running_or_notify_cancel()

    def settle(outcome):
      try:
        out.set_result(outcome)
      except concurrent.futures.InvalidStateError:
        pass  # the deadline (or the answer) came first

    timer = threading.Timer(
      timeout_s, settle, args=((None, 'env_timeout', f'no answer within {timeout_s} s'),)
    )
    timer.daemon = True
    tokens = list(turn_tokens)

    def work():
      try:
        if getattr(env, 'wants_logprobs', False):
          step = env.step(tokens, logprobs=None if logprobs is None else list(map(float, logprobs)))
        else:
          step = env.step(tokens)
        outcome = check_step(step, vocab_size=vocab_size, max_tokens=max_tokens)
      except Exception as e:
        outcome = (None, 'env_error', f'{type(e).__name__}: {e}')
      timer.cancel()
      settle(outcome)

    with self._lock:
      timer.start()
      self._executor.submit(work)
    return out

  @staticmethod
  def then(future, fn):
    """A Future of `fn(future.result())`, computed in the thread that settles
    `future`; an exception in `fn` settles it too (a waiter never hangs)."""
    out = concurrent.futures.Future()
    out.set_running_or_notify_cancel()

    def done(f):
      try:
        out.set_result(fn(f.result()))
      except Exception as e:
        out.set_exception(e)

    future.add_done_callback(done)
    return out

  def close(self):
    """Stops taking steps; running ones finish in their threads."""
    self._executor.shutdown(wait=False, cancel_futures=True)


_POOL = EnvPool(8)


def run_step(env, turn_tokens, *, timeout_s, vocab_size, max_tokens, logprobs=None):
  """`env.step(turn_tokens)` with a deadline and checks, waited for.

  Returns:
    (Step or None, failure reason or None, message). A None step ends the
    trajectory with the reason: 'env_error' (it raised; the message says
    what), 'env_timeout', or 'env_invalid'.

  The step runs on a worker thread of a shared `EnvPool`; see there for
  what happens to a step past its deadline.
  """
  return _POOL.submit(
    env,
    turn_tokens,
    timeout_s=timeout_s,
    vocab_size=vocab_size,
    max_tokens=max_tokens,
    logprobs=logprobs,
  ).result()


def check_step(step, *, vocab_size, max_tokens):
  """`run_step`'s outcome for what `env.step` returned: (step, None, '') when
  it is a Step of at most `max_tokens` valid token ids, else (None,
  'env_invalid', what is wrong)."""
  if not isinstance(step, Step):
    return None, 'env_invalid', f'step returned {type(step).__name__}, not Step'
  tokens = step.tokens
  if not isinstance(tokens, list | tuple) or not all(
    isinstance(t, int) and 0 <= t < vocab_size for t in tokens
  ):
    return None, 'env_invalid', f'step tokens must be ints in [0, {vocab_size})'
  if len(tokens) > max_tokens:
    return None, 'env_invalid', f'step returned {len(tokens)} tokens, more than {max_tokens}'
  if not step.done and not tokens:
    return None, 'env_invalid', 'a step that does not end the episode must return tokens'
  return step, None, ''
