"""Tool use: the call format, a calculator, the code sandbox, and an environment
that runs them.

The call format
---------------
A model turn that calls a tool ends with

    {NAME:ARGUMENTS}

(`{calc:47*8+13}`, `{python:print(2**10)}`); the closing `}` ends the
model's turn (it is the environment's turn stop token). The environment
answers with one bracketed message appended to the sequence:

    [RESULT]                   the tool's output, e.g. [389]
    [error: MESSAGE]           the tool ran and failed (a tool failure)
    [invalid: MESSAGE]         no well-formed call, or an unknown tool (an invalid call)

Messages are cut to `max_result_chars` (the closing bracket kept).

after which the model continues: it may call again or answer and end with
end-of-sequence. Failures and invalid calls go back to the model as
messages, are counted, and never end the episode by themselves.
"""

import ast
import math
import operator
import re

from jrl.envs.base import Environment, Step


class ToolError(Exception):
  """A tool ran and failed; the message goes back to the model."""


_BINARY = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.Div: operator.truediv,
  ast.FloorDiv: operator.floordiv,
  ast.Mod: operator.mod,
  ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_MAGNITUDE = 10**12


def calculator(expression):
  """Evaluates + - * / // % ** and parentheses on numbers; nothing else.

  Raises:
    ToolError for syntax errors, anything but arithmetic, division by zero,
    exponents above 64, numbers or results above 1e12 in magnitude, and
    results that are not finite real numbers.
  """
  if len(expression) > 200:
    raise ToolError('expression longer than 200 characters')
  try:
    tree = ast.parse(expression.strip(), mode='eval')
  except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: NUL bytes
    raise ToolError('not an arithmetic expression') from None

  def checked(value):
    # Real and finite: `(-8) ** 0.5` is complex, `1e999` is inf.
    if not isinstance(value, int | float) or not math.isfinite(value):
      raise ToolError('result is not a finite real number')
    if abs(value) > MAX_MAGNITUDE:
      raise ToolError('result too large')
    return value

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      left, right = ev(node.left), ev(node.right)
      if isinstance(node.op, ast.Pow) and abs(right) > 64:
        raise ToolError('exponent too large')
      try:
        value = _BINARY[type(node.op)](left, right)
      except ZeroDivisionError:
        raise ToolError('division by zero') from None
      except OverflowError:
        raise ToolError('result too large') from None
      return checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return checked(_UNARY[type(node.op)](ev(node.operand)))
    raise ToolError('only numbers and + - * / // % ** ( ) are allowed')

  value = ev(tree)
  if isinstance(value, float):
    if value == int(value):
      value = int(value)
    else:
      return f'{value:.6g}'
  return str(value)


def python_tool(code, limits=None):
  """Runs `code` in the sandbox of `jrl.rewards.sandbox`; its stdout (or a failure)."""
  from jrl.rewards import code as code_reward
  from jrl.rewards import sandbox

  code_reward.check_sandbox()  # refuses a degraded sandbox unless JRL_SANDBOX_UNSAFE opts in
  limits = limits or sandbox.Limits(wall_seconds=5, cpu_seconds=5)
  result = sandbox.run_program(code, limits=limits)
  if result.status != 'ok':
    raise ToolError(f'{result.status}: {(result.stderr or "")[-200:].strip()}')
  return result.stdout[-200:].rstrip('\n')


TOOLS = {'calc': calculator, 'python': python_tool}


def parse_call(text, open_char='{', close_char='}'):
  """(name, arguments) of the call that ends `text`: the last `{NAME:` opening
  (NAME an identifier) up to the final `}`; braces inside the arguments are
  kept. Raises ValueError saying what is missing."""
  if not text.endswith(close_char):
    raise ValueError('no call')
  opening = None
  for match in re.finditer(re.escape(open_char) + r'\s*([A-Za-z_]\w*)\s*:', text[:-1]):
    opening = match
  if opening is None:
    raise ValueError('no ' + open_char + 'name:')
  return opening.group(1), text[opening.end() : -1]


class ToolEnv(Environment):
  """Calls tools for the model; the episode ends when the model ends its answer.

  Args:
    tokenizer: encodes the environment's messages; `close_char` must be
      one token (it is the turn stop token).
    tools: name -> fn(arguments str) -> result str (raise ToolError).
    answer_fn: fn(final answer text, example) -> reward, used when the
      model ends the episode.
    max_result_chars: longer tool output is cut.
  """

  def __init__(self, tokenizer, tools=None, answer_fn=None, *, close_char='}', max_result_chars=16):
    self.tokenizer = tokenizer
    self.tools = dict(TOOLS if tools is None else tools)
    self.answer_fn = answer_fn
    self.close_char = close_char
    ids = tokenizer.encode(close_char)
    if len(ids) != 1:
      raise ValueError(f'`close_char` {close_char!r} must be one token, got {len(ids)}.')
    self.turn_stop_tokens = (ids[0],)
    self.max_result_chars = max_result_chars
    self.example = None
    self.transcript = ''

  def reset(self, example):
    self.example = example
    self.transcript = ''
    return self.tokenizer.encode(example['prompt'])

  def _message(self, text, **info):
    if len(text) > self.max_result_chars:
      text = text[: self.max_result_chars - 1] + ']'
    self.transcript += text
    return Step(self.tokenizer.encode(text), info=info)

  def step(self, turn_tokens):
    turn = self.tokenizer.decode(list(turn_tokens), skip_special_tokens=True)
    self.transcript += turn
    try:
      name, args = parse_call(turn, close_char=self.close_char)
    except ValueError as e:
      return self._message(f'[invalid: {e}]', invalid_calls=1)
    if name not in self.tools:
      return self._message('[invalid: no tool]', invalid_calls=1)
    try:
      result = self.tools[name](args)
    except ToolError as e:
      return self._message(f'[error: {e}]', tool_calls=1, tool_failures=1)
    return self._message(f'[{result}]', tool_calls=1)

  def final_reward(self, trajectory_text):
    """The answer is the text after the last tool message."""
    if self.answer_fn is None:
      return 0.0
    answer = trajectory_text.rsplit(']', 1)[-1].strip()
    return float(self.answer_fn(answer, self.example))
