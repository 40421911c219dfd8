"""The HTTP server: a WSGI app serving one `RewardService` (POST /score, GET
/health, JSON errors), on waitress with every limit an argument of
`RewardServer`. See README.md beside this file."""

import json
import logging
import threading

from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask

from jrl.rewards.server.validation import BadRequest, parse_score_request, scored_to_json

MAX_BODY_BYTES = 16 * 2**20  # requests of this many bytes or more are answered 413
MAX_COMPLETIONS = 4096  # requests with more completions are answered 413
READ_TIMEOUT_S = 30  # a connection silent this long is closed
THREADS = 8  # worker threads handling complete requests
CONNECTION_LIMIT = 1024  # open connections; more wait in the listen backlog
BACKLOG = 4096  # listen(2) backlog; Linux clamps it to net.core.somaxconn
MAX_HEADER_BYTES = 64 * 2**10

_REASONS = {
  200: 'OK',
  400: 'Bad Request',
  404: 'Not Found',
  405: 'Method Not Allowed',
  413: 'Content Too Large',
  500: 'Internal Server Error',
}


def make_app(service, max_completions=MAX_COMPLETIONS):
  """The WSGI application serving `service`, at most `max_completions` per request."""
  lock = threading.Lock()  # one scoring call at a time per service

  def respond(start_response, code, payload, headers=()):
    body = json.dumps(payload, allow_nan=False).encode()
    start_response(
      f'{code} {_REASONS[code]}',
      [('Content-Type', 'application/json'), ('Content-Length', str(len(body))), *headers],
    )
    return [body]

  def score(environ):
    # waitress has already read the whole body (at most max_body_bytes) into a buffer.
    length = int(environ.get('CONTENT_LENGTH') or 0)
    args = parse_score_request(environ['wsgi.input'].read(length), max_completions)
    with lock:
      return scored_to_json(service(*args))

  def app(environ, start_response):
    path, method = environ.get('PATH_INFO', ''), environ['REQUEST_METHOD']
    routes = {'/health': 'GET', '/score': 'POST'}
    if path not in routes:
      return respond(start_response, 404, {'error': f'not found: {path} (use {sorted(routes)})'})
    if method != routes[path]:
      return respond(
        start_response,
        405,
        {'error': f'method {method} not allowed on {path} (use {routes[path]})'},
        [('Allow', routes[path])],
      )
    try:
      if path == '/health':
        return respond(start_response, 200, {'ok': True, 'functions': list(service.names)})
      return respond(start_response, 200, score(environ))
    except BadRequest as e:
      return respond(start_response, e.status, {'error': f'bad request: {e}', 'field': e.field})
    except ValueError as e:  # the service refused the arguments
      return respond(start_response, 400, {'error': f'bad request: {e}'})
    except Exception as e:  # a bug in a service must still get an answer
      return respond(start_response, 500, {'error': f'{type(e).__name__}: {e}'})

  return app


class _JSONErrorTask(ErrorTask):
  """waitress's answer to a request its parser refused (413, 400, 431, ...), in JSON."""

  def execute(self):
    e = self.request.error
    body = json.dumps({'error': f'{e.reason}: {e.body}'}).encode()
    self.status = f'{e.code} {e.reason}'
    self.response_headers.append(('Content-Type', 'application/json'))
    self.set_close_on_finish()
    self.content_length = len(body)
    self.write(body)


class _JSONErrorChannel(HTTPChannel):
  error_task_class = _JSONErrorTask


class _Listener(TcpWSGIServer):
  channel_class = _JSONErrorChannel


class RewardServer:
  """A waitress server for one `RewardService`, with the socketserver interface.

  `serve_forever()` runs the event loop (in any thread); `shutdown()` stops it
  from another thread and waits for it; `server_close()` (or `close()`)
  closes the socket and every connection. `server_address` is the bound
  (host, port), useful with port=0.
  """

  def __init__(
    self,
    service,
    host='127.0.0.1',
    port=0,
    *,
    max_body_bytes=MAX_BODY_BYTES,
    max_completions=MAX_COMPLETIONS,
    read_timeout_s=READ_TIMEOUT_S,
    threads=THREADS,
    connection_limit=CONNECTION_LIMIT,
    backlog=BACKLOG,
  ):
    read_timeout_s = int(read_timeout_s)
    for name, value in (
      ('max_body_bytes', max_body_bytes),
      ('max_completions', max_completions),
      ('read_timeout_s', read_timeout_s),
      ('threads', threads),
      ('connection_limit', connection_limit),
      ('backlog', backlog),
    ):
      if value < 1:
        raise ValueError(f'`{name}` must be at least 1, got {value}.')
    adj = Adjustments(
      host=host,
      port=port,
      threads=threads,
      connection_limit=connection_limit,
      backlog=backlog,
      channel_timeout=read_timeout_s,
      cleanup_interval=1,
      max_request_body_size=max_body_bytes,
      max_request_header_size=MAX_HEADER_BYTES,
      asyncore_use_poll=True,  # select() fails past 1024 file descriptors
      expose_tracebacks=False,
      ident='jrl-reward-server',
    )
    # A queue of requests waiting for the scoring lock is normal here, not a warning.
    logging.getLogger('waitress.queue').setLevel(logging.ERROR)
    self._map = {}
    # One address only: the first that `host` resolves to.
    app = make_app(service, max_completions)
    self._listener = _Listener(app, map=self._map, adj=adj, sockinfo=adj.listen[0])
    self.server_address = (self._listener.effective_host, self._listener.effective_port)
    self._stop = threading.Event()
    self._running = threading.Event()
    self._stopped = threading.Event()
    self._closed = False

  def serve_forever(self, poll_interval=0.5):
    self._stop.clear()
    self._stopped.clear()
    self._running.set()
    try:
      while not self._stop.is_set():
        wasyncore.loop(timeout=poll_interval, map=self._map, use_poll=True, count=1)
    finally:
      self._running.clear()
      self._stopped.set()

  def shutdown(self):
    """Stops `serve_forever` (called from another thread) and waits for it."""
    self._stop.set()
    if self._running.is_set():
      self._listener.pull_trigger()
      self._stopped.wait()

  def server_close(self):
    """Closes the listening socket and every connection; stops the worker threads."""
    if self._closed:
      return
    self.shutdown()
    self._closed = True
    self._listener.task_dispatcher.shutdown(timeout=1)
    wasyncore.close_all(self._map)

  def close(self):
    self.server_close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def make_server(service, host='127.0.0.1', port=0, **limits):
  """A `RewardServer` serving `service` (call `serve_forever()` on it).

  `limits`: max_body_bytes, max_completions, read_timeout_s, threads,
  connection_limit, backlog (see `RewardServer` and README.md for the defaults).
  """
  return RewardServer(service, host, port, **limits)
