"""Code a user would keep in their own project, named in config by import path:
a data source (`task.kind='tests.user_code:make_rows'`), a tool environment
(`agent.env='tests.user_code:ShopEnv'`, the worked example of
docs/your_own_environment.md), and broken variants of both for the error tests.
"""

import numpy as np

from jrl.envs import Environment, Step, parse_call

# A data source ------------------------------------------------------------------


def make_rows(task):
  """Two-digit sums: (train rows, held-out rows), from the task config's seeds."""

  def rows(seed, n):
    rng = np.random.default_rng(seed)
    pairs = rng.integers(10, 50, size=(n, 2))
    return [{'prompt': f'{a}+{b}=', 'answer': a + b, 'source': 'sums'} for a, b in pairs.tolist()]

  return rows(task.train_seed, 64), rows(task.eval_seed, task.eval_size)


NOT_A_FUNCTION = 3


def make_rows_dict(task):
  del task
  return {'train': [], 'eval': []}


def make_rows_not_dicts(task):
  del task
  return ['1+1=', '2+2='], []


def make_rows_long_prompt(task):
  train, held_out = make_rows(task)
  train[5] = {'prompt': '1+' * 30 + '1=', 'answer': '31'}
  return train, held_out


def make_rows_bad_character(task):
  train, held_out = make_rows(task)
  held_out[2] = {'prompt': '3\u20ac+1=', 'answer': '4'}
  return train, held_out


# A tool environment -------------------------------------------------------------

PRICES = {'apple': 3, 'pear': 7, 'plum': 2, 'fig': 5}


def shop_rows(task):
  """'3 pear=' -> '21': (train rows, held-out rows)."""

  def rows(seed, n):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
      item, count = str(rng.choice(list(PRICES))), int(rng.integers(2, 10))
      out.append({'prompt': f'{count} {item}=', 'answer': str(count * PRICES[item]), 'item': item})
    return out

  return rows(task.train_seed, 256), rows(task.eval_seed, task.eval_size)


class ShopEnv(Environment):
  """One tool, `{price:ITEM}` -> `[PRICE]`; the model answers after it."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    (close,) = tokenizer.encode('}')  # one token: it ends a tool call
    self.turn_stop_tokens = (close,)
    self.example = None

  def reset(self, example):
    self.example = example
    return self.tokenizer.encode(example['prompt'])

  def step(self, turn_tokens):
    turn = self.tokenizer.decode(turn_tokens, skip_special_tokens=True)
    try:
      name, item = parse_call(turn)
    except ValueError:
      return self._say('[no call]', invalid_calls=1)
    if name != 'price':
      return self._say('[no such tool]', invalid_calls=1)
    if item not in PRICES:
      return self._say('[unknown item]', tool_calls=1, tool_failures=1)
    return self._say(f'[{PRICES[item]}]', tool_calls=1)

  def _say(self, text, **info):
    return Step(self.tokenizer.encode(text), info=info)

  def final_reward(self, trajectory_text):
    answer = trajectory_text.rsplit(']', 1)[-1].strip()
    return 1.0 if answer == self.example['answer'] else 0.0

  @staticmethod
  def demonstration(example, use_tool):
    """A correct episode for the SFT warm-up: [(text, written by the model)]."""
    if not use_tool:
      return [(example['answer'], True)]
    item = example['item']
    return [
      ('{price:' + item + '}', True),
      (f'[{PRICES[item]}]', False),
      (example['answer'], True),
    ]


def make_shop_env(tokenizer):
  """A factory function works as well as the class (no demonstrations)."""
  return ShopEnv(tokenizer)


class NoStep:
  """Not an environment: it cannot take a turn."""

  turn_stop_tokens = ()

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  def reset(self, example):
    return self.tokenizer.encode(example['prompt'])


def make_env_without_tokenizer():
  return None


# Rollout engines (`sampler.engine`) ------------------------------------------------

ENGINES = []  # every engine make_engine made, in order


class RecordingEngine:
  """jrl's paged sampler behind the Engine contract, recording each call."""

  def __init__(self, inner):
    self.inner = inner
    self.calls = []  # (requests, group_size)
    self.events = []  # ('load', version), 'release', 'resume', 'generate', in order

  @property
  def version(self):
    return self.inner.version

  def load_weights(self, params, version):
    self.events.append(('load', version))
    return self.inner.load_weights(params, version)

  def release(self):
    self.events.append('release')
    self.inner.release()

  def resume(self):
    self.events.append('resume')
    self.inner.resume()

  @property
  def stats(self):
    return self.inner.stats

  @property
  def tracer(self):
    return self.inner.tracer

  @tracer.setter
  def tracer(self, tracer):
    self.inner.tracer = tracer

  def generate(self, params, requests, *, group_size=1, share_prompt=True, on_turn_end=None):
    self.calls.append((len(requests), group_size))
    self.events.append('generate')
    return self.inner.generate(
      params, requests, group_size=group_size, share_prompt=share_prompt, on_turn_end=on_turn_end
    )


def make_engine(config, model, mesh, stop_tokens, group_sizes=None, **engine_overrides):
  from jrl.trainers.rollouts import engines

  inner = engines.build_sampler(config, model, mesh, stop_tokens, group_sizes, **engine_overrides)
  ENGINES.append(RecordingEngine(inner))
  return ENGINES[-1]


def make_not_an_engine(config, model, mesh, stop_tokens, group_sizes=None, **engine_overrides):
  return {'generate': None}


# Reward functions ------------------------------------------------------------------


def sandboxed_reward(prompts, completions, metadata):
  """A reward of one's own that would run completions in `jrl.rewards.sandbox`:
  the trainer sets the sandbox up for it as for code_tests."""
  del prompts, metadata
  return [0.0] * len(completions)


sandboxed_reward.uses_sandbox = True
