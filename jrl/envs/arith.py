"""The default agentic task: multi-step arithmetic that a calculator solves.

Problems are `a*b+c=` with a in [10, 99], b in [2, 9], c in [10, 99]. A
small model rarely computes these right in its head, but can learn to copy
the expression into a tool call and the result into its answer:

    47*8+13={calc:47*8+13}[389]389<eos>        (model: {calc:47*8+13} and 389<eos>;
                                                 environment: [389])

`demonstration(example, use_tool)` gives SFT segments for a warm-up with a
mix of tool use and direct answers, so that RL starts from a policy that
sometimes calls the calculator and can learn that calling it pays.
"""

import numpy as np

from jrl.envs import chat
from jrl.envs.tools import ToolEnv, calculator


class ArithToolTask:
  """Problems generated from a seed, indexable forever (`example(i)`)."""

  def __init__(self, seed=0):
    self.seed = seed

  def example(self, i):
    rng = np.random.default_rng([self.seed, i])
    a, b, c = int(rng.integers(10, 100)), int(rng.integers(2, 10)), int(rng.integers(10, 100))
    expr = f'{a}*{b}+{c}'
    return {'prompt': f'{expr}=', 'answer': str(a * b + c), 'expression': expr}

  def held_out(self, n, seed):
    return [ArithToolTask(seed).example(i) for i in range(n)]

  @staticmethod
  def demonstration(example, use_tool):
    """[(text, by_model)] segments of a correct episode."""
    if not use_tool:
      return [(example['answer'], True)]
    expr = example['expression']
    return [
      ('{calc:' + expr + '}', True),
      (f'[{calculator(expr)}]', False),
      (example['answer'], True),
    ]


def exact_answer(answer, example):
  return 1.0 if answer == str(example['answer']) else 0.0


def make_env(tokenizer):
  """A fresh environment for one episode of the arithmetic tool task."""
  return ToolEnv(tokenizer, tools={'calc': calculator}, answer_fn=exact_answer)


def calculate(expression: str) -> str:
  """Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses.

  Args:
    expression: the expression, e.g. 47*8+13.
  """
  return calculator(expression)


def make_chat_env(tokenizer):
  """The arithmetic task in the checkpoint's own chat format: the question as
  a user message, the calculator declared as a tool (`calculate`), calls in
  the template's format (`jrl.envs.chat`), the final answer scored by exact
  match (`agent.env = 'jrl.envs.arith:make_chat_env'`)."""
  return chat.ChatToolEnv(
    tokenizer,
    [calculate],
    answer_fn=lambda text, example: exact_answer(text.strip(), example),
    system='Answer with the number only. Use the calculate tool for arithmetic.',
  )


def chat_demonstration(example, use_tool, env):
  """A correct episode in the chat format, as token segments: the call and
  the answer by the model, the tool's message by the environment."""
  segments = []
  if use_tool:
    args = {'expression': example['expression']}
    turn = env.model_turn(chat.call_text(env.conversation.family, 'calculate', args))
    segments += [(turn, True), (env.step(turn).tokens, False)]
  segments.append((env.model_turn(example['answer']), True))
  return segments


make_chat_env.demonstration = chat_demonstration
