"""Word problems with a calculator, in the checkpoint's own chat format.

The question is the user message; a `calculate` tool is offered (declared to
the template, or in the system prompt for templates without tools, such as
SmolLM2's); a turn without a call is the final answer, 1.0 when its number
equals the problem's answer. Three ways to the same task, for
`agent.env` (configs/agent_smollm2_tools.py):

- `jrl.envs.word_problems:make_chat_env`: the tool is a Python function;
- `jrl.envs.word_problems:make_mcp_env`: the same function served by an MCP
  server over stdio (`jrl/envs/calculator_mcp.py`, one per process; needs
  the `mcp` extra);
- `jrl.envs.word_problems:make_agent_env`: an agent loop written with the
  `openai` client, talking to jrl's OpenAI-compatible endpoint (one per
  process; needs the `openai` package), running the tool itself.

Rows come from `launch/make_word_problems.py` read with
`task.answer_extractor='gsm8k'`: each example's 'answer' is the number.
"""

import json
import os
import re
import threading

from jrl.envs import chat
from jrl.envs.arith import calculate
from jrl.rewards import math as math_reward

SYSTEM = (
  'Solve the math word problem. Use the calculate tool for the arithmetic, then write the '
  'final answer as "The answer is N".'
)
SERVER = os.path.join(os.path.dirname(__file__), 'calculator_mcp.py')


def answer_reward(text, example):
  """1.0 if the number `text` ends on equals example['answer'], else 0.0."""
  got = math_reward.extract_answer(text)
  return float(got is not None and math_reward.is_equivalent(got, example['answer']))


# "6 * 8 = 48" in a worked solution: an arithmetic expression and its value.
_WORKING = re.compile(r'([0-9][0-9.\s+\-*/()]*[0-9)])\s*=\s*([0-9.]+)')


def working(solution):
  """[(expression, value)] of the calculations a GSM8K-style solution writes."""
  return [(e.strip(), v) for e, v in _WORKING.findall(solution) if re.search(r'[-+*/]', e)]


def chat_demonstration(example, use_tool, env):
  """A correct episode of the task, as token segments for the SFT warm-up.

  With the tool, one call per calculation of the row's worked solution
  (`example['solution']`, kept by `task.answer_extractor='gsm8k'`), each
  answered by the environment, then "The answer is N."; without it, the
  calculations written out in one turn, as configs/grpo_smollm2_gsm.py asks.
  """
  steps = working(example.get('solution', ''))
  final = f'The answer is {example["answer"]}.'
  if not use_tool or not steps:
    text = ' '.join(f'{e} = {v}.' for e, v in steps)
    return [(env.model_turn(f'{text} {final}'.strip()), True)]
  segments = []
  for expression, _ in steps:
    turn = env.model_turn(
      chat.call_text(env.conversation.family, 'calculate', {'expression': expression})
    )
    segments += [(turn, True), (env.step(turn).tokens, False)]
  segments.append((env.model_turn(final), True))
  return segments


def make_chat_env(tokenizer):
  """The task with `calculate` as a Python function tool."""
  return chat.ChatToolEnv(tokenizer, [calculate], answer_fn=answer_reward, system=SYSTEM)


def make_mcp_env(tokenizer):
  """The task with `calculate` served by an MCP server over stdio."""
  from jrl.envs import mcp_tools

  server = mcp_tools.shared(mcp_tools.python_server(SERVER))
  return chat.ChatToolEnv(tokenizer, server.tools(), answer_fn=answer_reward, system=SYSTEM)


make_chat_env.demonstration = chat_demonstration
make_mcp_env.demonstration = chat_demonstration


TOOLS = [chat.function_tool(calculate).schema()]
_ENDPOINT = []
_ENDPOINT_LOCK = threading.Lock()


def endpoint():
  """This process's started `AgentEndpoint` (closed at exit)."""
  from jrl.envs.openai_endpoint import AgentEndpoint

  with _ENDPOINT_LOCK:
    if not _ENDPOINT:
      import atexit

      _ENDPOINT.append(AgentEndpoint().start())
      atexit.register(_ENDPOINT[0].close)
    return _ENDPOINT[0]


def agent(base_url, api_key, example, max_turns=4):
  """An agent loop as an `openai`-client user writes it: ask, run the tool
  calls the answer makes, ask again; the last answer is scored."""
  import openai

  client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
  messages = [{'role': 'system', 'content': SYSTEM}, {'role': 'user', 'content': example['prompt']}]
  for _ in range(max_turns):
    reply = client.chat.completions.create(model='policy', messages=messages, tools=TOOLS)
    message = reply.choices[0].message
    if not message.tool_calls:
      return answer_reward(message.content or '', example)
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
      try:
        result = calculate(**json.loads(call.function.arguments))
      except Exception as e:  # the model's bad call: it reads the error
        result = f'error: {e}'
      messages.append({'role': 'tool', 'tool_call_id': call.id, 'content': str(result)})
  return 0.0  # no final answer within its turns


def make_agent_env(tokenizer):
  """The task as an `openai`-client agent through jrl's endpoint."""
  from jrl.envs.openai_endpoint import AgentEnv

  return AgentEnv(tokenizer, endpoint(), agent, turn_timeout_s=120.0)
