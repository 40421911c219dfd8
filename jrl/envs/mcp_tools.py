"""Tools served over MCP (the Model Context Protocol), for chat episodes.

    server = MCPTools(['python', 'my_server.py'])        # stdio; or 'http://127.0.0.1:8000/mcp'
    env = ChatToolEnv(tokenizer, server.tools(), answer_fn=...)

`MCPTools` starts one MCP server (a command over stdio, or a streamable
HTTP URL) and keeps a session to it open on an event loop of its own, in a
background thread, so that environment steps, which are synchronous and run
on the environment pool's threads, can call it. `tools()` lists the
server's tools with their JSON schemas as `jrl.envs.chat.Tool`s: the chat
template declares them, the model calls them in its own format, and each
result comes back as the text of the call's content. A result the server
flags as an error reaches the model as an error message (`ToolError`); a
call that does not answer within `call_timeout_s`, or a server that died
and does not come back after one restart, raises, which ends only that
episode (the trainer records the reason). `shared(spec)` gives one started
server per spec and process, closed at exit: what an `agent.env` factory,
called once per episode, uses.

Needs the `mcp` package (`pip install -e ".[mcp]"`); jrl's core never
imports it.
"""

import asyncio
import atexit
import sys
import threading

from jrl.envs.chat import Tool
from jrl.envs.tools import ToolError


class ServerError(RuntimeError):
  """The MCP server cannot be reached (it did not start, or died for good)."""


def _transport(spec):
  """What `mcp.Client` connects to for `spec`: a URL, or a command's stdio."""
  import mcp

  if isinstance(spec, str) and spec.startswith(('http://', 'https://')):
    return spec
  if isinstance(spec, mcp.StdioServerParameters):
    return spec
  command = [spec] if isinstance(spec, str) else list(spec)
  if not command:
    raise ValueError('an MCP server command must name a program')
  return mcp.StdioServerParameters(command=command[0], args=command[1:])


class MCPTools:
  """One MCP server's tools (see the module).

  Args:
    spec: a command (list of strings, e.g. [sys.executable, 'server.py']), a
      streamable HTTP URL, or an `mcp.StdioServerParameters`.
    call_timeout_s: a call that takes longer raises TimeoutError.
    start_timeout_s: a server that is not ready by then raises ServerError.
  """

  def __init__(self, spec, *, call_timeout_s=10.0, start_timeout_s=30.0):
    self.spec = spec
    self.call_timeout_s = float(call_timeout_s)
    self.start_timeout_s = float(start_timeout_s)
    self.restarts = 0
    self._lock = threading.Lock()
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name='mcp')
    self._thread.start()
    self._client = self._stop = self._session = None
    self._listed = None
    self._connect()

  # The session: one coroutine holds the client open until told to stop.
  async def _hold(self, ready):
    import mcp

    self._stop = asyncio.Event()
    try:
      async with mcp.Client(_transport(self.spec)) as client:
        self._client = client
        ready.set_result(None)
        await self._stop.wait()
    except BaseException as e:
      if not ready.done():
        ready.set_exception(e)
    finally:
      self._client = None

  def _connect(self):
    async def start():
      ready = self._loop.create_future()
      self._session = asyncio.ensure_future(self._hold(ready))
      await ready

    try:
      asyncio.run_coroutine_threadsafe(start(), self._loop).result(self.start_timeout_s)
    except Exception as e:
      raise ServerError(f'MCP server {self.spec!r} did not start: {type(e).__name__}: {e}') from e
    self._listed = None

  def _run(self, coro, timeout):
    return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

  def _disconnect(self):
    if self._stop is not None:
      self._loop.call_soon_threadsafe(self._stop.set)
    if self._session is not None:
      try:
        waiting = asyncio.wait([self._session], timeout=5)
        asyncio.run_coroutine_threadsafe(waiting, self._loop).result(10)
      except Exception:
        pass  # deliberate: a server that will not stop is left to the process's exit

  def alive(self):
    return self._client is not None and self._session is not None and not self._session.done()

  def tools(self):
    """The server's tools as `chat.Tool`s (listed once per connection)."""
    with self._lock:
      if self._listed is None:
        self._ensure()
        result = self._run(self._client.list_tools(), self.start_timeout_s)
        self._listed = [
          Tool(t.name, t.description or '', dict(t.input_schema or {}), self._caller(t.name))
          for t in result.tools
        ]
      return list(self._listed)

  def _caller(self, name):
    def call(**arguments):
      return self.call(name, arguments)

    call.__name__ = name
    return call

  def _ensure(self):
    """Reconnects once to a server that died."""
    if not self.alive():
      self._disconnect()
      self.restarts += 1
      self._connect()

  def call(self, name, arguments):
    """The text of the tool's result; raises ToolError when the server says
    the call failed, TimeoutError past `call_timeout_s`, ServerError when the
    server is gone and does not restart."""
    for attempt in (0, 1):
      with self._lock:
        self._ensure()
        client = self._client
      try:
        result = self._run(client.call_tool(name, dict(arguments)), self.call_timeout_s)
        break
      except TimeoutError:
        raise TimeoutError(f'MCP tool {name!r} did not answer in {self.call_timeout_s} s') from None
      except Exception as e:  # the connection broke: restart once, then give up
        if attempt:
          raise ServerError(f'MCP server {self.spec!r} failed: {type(e).__name__}: {e}') from e
        with self._lock:
          self._disconnect()
    text = '\n'.join(getattr(c, 'text', '') or '' for c in result.content)
    if result.is_error:
      raise ToolError(text or 'the tool failed')
    return text

  def close(self):
    """Stops the session (and a stdio server) and the event loop."""
    self._disconnect()
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(timeout=10)


_SHARED = {}
_SHARED_LOCK = threading.Lock()


def shared(spec, **options):
  """One started `MCPTools` per spec in this process (closed at exit)."""
  key = repr(spec)
  with _SHARED_LOCK:
    if key not in _SHARED:
      _SHARED[key] = MCPTools(spec, **options)
    return _SHARED[key]


@atexit.register
def _close_shared():
  for server in _SHARED.values():
    try:
      server.close()
    except Exception:
      pass  # deliberate: the process is ending


def python_server(path):
  """The command that serves the MCP server script at `path` with this Python."""
  return [sys.executable, path]
