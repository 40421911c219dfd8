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
reason instead of reaching the run.
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


class Environment:
  """Base class; subclasses implement `reset` and `step`.

  `turn_stop_tokens`: tokens that end a model turn (besides the sampler's
  stop tokens, which end the episode).
  """

  turn_stop_tokens: tuple = ()

  def reset(self, example):
    """Starts an episode for `example`; returns the prompt's token ids."""
    raise NotImplementedError

  def step(self, turn_tokens):
    """The model's latest turn (token ids, its stop token included) -> Step."""
    raise NotImplementedError

  def final_reward(self, trajectory_text):
    """Reward when the model ends the episode itself (end of sequence)."""
    del trajectory_text
    return 0.0


_POOL = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix='env')
_POOL_LOCK = threading.Lock()


def run_step(env, turn_tokens, *, timeout_s, vocab_size, max_tokens):
  """`env.step(turn_tokens)` with a deadline and checks.

  Returns:
    (Step or None, failure reason or None). A None step ends the trajectory
    with the reason: 'env_error' (it raised; the message is in the step
    info of the caller's record), 'env_timeout', or 'env_invalid'.

  A step that runs past `timeout_s` keeps running in its thread (Python
  cannot stop a thread); the trajectory does not wait for it. Environments
  that can hang on untrusted input should run it in a process, as the code
  tool does (`jrl.rewards.sandbox`).
  """
  with _POOL_LOCK:
    future = _POOL.submit(env.step, list(turn_tokens))
  try:
    step = future.result(timeout=timeout_s)
  except concurrent.futures.TimeoutError:
    return None, 'env_timeout', f'no answer within {timeout_s} s'
  except Exception as e:
    return None, 'env_error', f'{type(e).__name__}: {e}'
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
