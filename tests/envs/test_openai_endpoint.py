"""Black-box agents through the OpenAI-compatible endpoint
(`jrl.envs.openai_endpoint`), with the real `openai` client (the [openai]
extra, in the [test] extra).

A deterministic agent written with the `openai` client gives, turn for
turn, the same episode tokens and reward as the native chat environment
(`ChatToolEnv`) on the same model turns; an agent that edits its history
is refused (HTTP 409) and ends its episode; one that raises or goes silent
ends its episode; unsupported requests get HTTP 400.
"""

import json
import time

import pytest

openai = pytest.importorskip('openai', reason='the [openai] extra (pip install -e ".[openai]")')

from jrl.envs import chat  # noqa: E402
from jrl.envs.openai_endpoint import AgentEndpoint, AgentEnv  # noqa: E402
from tests.envs.test_chat import _call_text, _turn, calculator, tokenizers  # noqa: E402, F401

SYSTEM = 'You answer with a number only.'
EXAMPLE = {'prompt': 'What is 47*8+13?', 'answer': '389'}
TOOLS = [chat.function_tool(calculator).schema()]


def honest_agent(base_url, api_key, example):
  """An agent loop as people write it with the openai client."""
  client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
  messages = [
    {'role': 'system', 'content': SYSTEM},
    {'role': 'user', 'content': example['prompt']},
  ]
  while True:
    answer = client.chat.completions.create(model='policy', messages=messages, tools=TOOLS)
    message = answer.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
      return float((message.content or '').strip() == example['answer'])
    for call in message.tool_calls:
      result = calculator(**json.loads(call.function.arguments))
      messages.append({'role': 'tool', 'tool_call_id': call.id, 'content': result})


@pytest.fixture(scope='module')
def endpoint():
  server = AgentEndpoint().start()
  yield server
  server.close()


def _native(tok):
  return chat.ChatToolEnv(
    tok, [calculator], system=SYSTEM, answer_fn=lambda text, ex: float(text.strip() == ex['answer'])
  )


@pytest.mark.parametrize('name', ['hermes', 'smollm2', 'llama3.1'])
def test_an_openai_client_agent_gives_the_native_episode(tokenizers, endpoint, name):  # noqa: F811
  tok = tokenizers[name]
  native, through = _native(tok), AgentEnv(tok, endpoint, honest_agent)
  assert through.turn_stop_tokens == native.turn_stop_tokens
  assert through.reset(EXAMPLE) == native.reset(EXAMPLE)
  fmt = native.conversation.family
  turns = [_call_text(fmt, 'calculator', {'expression': '47*8+13'}), '389']
  for text in turns:
    turn = _turn(tok, native.conversation, text)
    a, b = native.step(turn), through.step(turn)
    assert (a.tokens, a.done, a.reward) == (b.tokens, b.done, b.reward), (name, text)
  assert b.done and b.reward == 1.0
  assert through.conversation.ids == native.conversation.ids


def test_an_agent_that_edits_its_history_is_refused(tokenizers, endpoint):  # noqa: F811
  seen = {}

  def editor(base_url, api_key, example):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{'role': 'user', 'content': example['prompt']}]
    client.chat.completions.create(model='policy', messages=messages)
    messages.append({'role': 'assistant', 'content': 'something it never said'})
    messages.append({'role': 'user', 'content': 'go on'})
    try:
      client.chat.completions.create(model='policy', messages=messages)
    except openai.APIStatusError as e:
      seen['status'] = e.status_code
      raise

  tok = tokenizers['hermes']
  env = AgentEnv(tok, endpoint, editor)
  env.reset(EXAMPLE)
  with pytest.raises(RuntimeError, match='edited its history'):
    env.step(_turn(tok, env.conversation, '12'))
  for _ in range(100):  # the agent's thread reads the answer
    if 'status' in seen:
      break
    time.sleep(0.05)
  assert seen['status'] == 409


def test_an_agent_that_raises_or_goes_silent_ends_its_episode(tokenizers, endpoint):  # noqa: F811
  tok = tokenizers['hermes']

  def broken(base_url, api_key, example):
    raise ValueError('agent bug')

  env = AgentEnv(tok, endpoint, broken, turn_timeout_s=5)
  env.reset(EXAMPLE)
  with pytest.raises(RuntimeError, match='agent bug'):
    env.step(_turn(tok, env.conversation, '1'))

  def silent(base_url, api_key, example):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'x'}])
    time.sleep(30)

  env = AgentEnv(tok, endpoint, silent, turn_timeout_s=0.5)
  env.reset(EXAMPLE)
  with pytest.raises(RuntimeError, match='sent no request'):
    env.step(_turn(tok, env.conversation, '1'))


def test_unsupported_requests_and_unknown_keys_are_refused(endpoint):
  client = openai.OpenAI(base_url=endpoint.base_url, api_key='not-a-key', max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'x'}])
  episode = endpoint.open_episode()
  client = openai.OpenAI(base_url=endpoint.base_url, api_key=episode.key, max_retries=0)
  with pytest.raises(openai.BadRequestError, match='not supported'):
    client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'x'}], n=2)
  endpoint.close_episode(episode)
