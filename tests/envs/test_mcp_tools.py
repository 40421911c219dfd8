"""Tools served over MCP (`jrl.envs.mcp_tools`), with the real `mcp`
package (the [mcp] extra, in the [test] extra): a server started over stdio
and over streamable HTTP lists its tools with their schemas, a chat
episode offers them to the model and calls them with its arguments, a
tool's error reaches the model, and a server that dies is restarted; one
that cannot come back, or a call that hangs, ends only its episode.
"""

import os
import socket
import subprocess
import sys
import time

import pytest

mcp = pytest.importorskip('mcp', reason='the [mcp] extra (pip install -e ".[mcp]")')

from jrl.envs import chat, mcp_tools  # noqa: E402
from jrl.envs.tools import ToolError  # noqa: E402
from jrl.models import tokenizer as T  # noqa: E402
from tests.envs.test_chat import TEMPLATES, _call_text, _turn  # noqa: E402
from tests.helpers import train_byte_bpe  # noqa: E402

SERVER = '''
import os, sys, time
from mcp.server.mcpserver import MCPServer

server = MCPServer('arith')


@server.tool()
def add(a: int, b: int) -> int:
  """Adds two integers."""
  return a + b


@server.tool()
def divide(a: float, b: float) -> float:
  """Divides a by b."""
  if b == 0:
    raise ValueError('division by zero')
  return a / b


@server.tool()
def die() -> str:
  """Ends the server."""
  os._exit(3)


@server.tool()
def hang() -> str:
  """Never answers."""
  time.sleep(60)
  return 'late'


if __name__ == '__main__':
  if len(sys.argv) > 1:
    server.run(transport='streamable-http', host='127.0.0.1', port=int(sys.argv[1]))
  else:
    server.run()
'''


@pytest.fixture(scope='module')
def script(tmp_path_factory):
  path = tmp_path_factory.mktemp('mcp') / 'server.py'
  path.write_text(SERVER)
  return str(path)


@pytest.fixture(scope='module')
def hermes():
  template, specials, bos, eos, _ = TEMPLATES['hermes']
  tok = train_byte_bpe(['{"name": "add", "arguments": {"a": 2, "b": 3}}'], specials, 300)
  return T.HFTokenizer(tok, chat_template=template, bos=bos, eos=eos)


@pytest.fixture
def server(script):
  tools = mcp_tools.MCPTools(mcp_tools.python_server(script), call_timeout_s=2.0)
  yield tools
  tools.close()


def test_tools_are_listed_with_their_schemas_and_called(server):
  tools = {t.name: t for t in server.tools()}
  assert set(tools) == {'add', 'divide', 'die', 'hang'}
  assert tools['add'].description == 'Adds two integers.'
  assert tools['add'].parameters['properties']['a']['type'] == 'integer'
  assert tools['add'].parameters['required'] == ['a', 'b']
  assert tools['add'].fn(a=2, b=3) == '5'
  with pytest.raises(ToolError, match='Error executing tool divide'):
    tools['divide'].fn(a=1, b=0)


def test_a_chat_episode_offers_and_calls_the_servers_tools(server, hermes):
  env = chat.ChatToolEnv(hermes, server.tools(), answer_fn=lambda text, ex: float(text == '5'))
  prompt = hermes.decode(env.reset({'prompt': 'What is 2 + 3?'}))
  assert '"name": "add"' in prompt and '"name": "hang"' in prompt  # declared to the model
  step = env.step(_turn(hermes, env.conversation, _call_text('hermes', 'add', {'a': 2, 'b': 3})))
  assert step.info['tool_calls'] == 1
  assert '<tool_response>\n5\n</tool_response>' in hermes.decode(step.tokens)
  step = env.step(_turn(hermes, env.conversation, _call_text('hermes', 'divide', {'a': 1, 'b': 0})))
  assert step.info['tool_failures'] == 1 and 'error: ' in hermes.decode(step.tokens)
  step = env.step(_turn(hermes, env.conversation, '5'))
  assert step.done and step.reward == 1.0


def test_a_server_that_dies_is_restarted_and_a_hung_call_ends_its_episode(server, hermes):
  tools = {t.name: t for t in server.tools()}
  with pytest.raises(mcp_tools.ServerError):
    tools['die'].fn()  # it dies again on the restart's retry: the episode ends
  assert tools['add'].fn(a=1, b=1) == '2'  # the next call restarts it
  assert server.restarts >= 1
  env = chat.ChatToolEnv(hermes, server.tools(), tool_timeout_s=10.0)
  env.reset({'prompt': 'x'})
  t0 = time.monotonic()
  with pytest.raises(TimeoutError, match="'hang' did not answer"):
    env.step(_turn(hermes, env.conversation, _call_text('hermes', 'hang', {})))
  assert time.monotonic() - t0 < 8


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_a_streamable_http_server(script):
  port = _free_port()
  proc = subprocess.Popen(
    [sys.executable, script, str(port)],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    env={**os.environ, 'PYTHONUNBUFFERED': '1'},
  )
  try:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
      try:
        socket.create_connection(('127.0.0.1', port), timeout=0.5).close()
        break
      except OSError:
        time.sleep(0.2)
    tools = mcp_tools.MCPTools(f'http://127.0.0.1:{port}/mcp')
    try:
      assert {t.name: t for t in tools.tools()}['add'].fn(a=20, b=22) == '42'
    finally:
      tools.close()
  finally:
    proc.kill()
    proc.wait()
