"""The reward service over HTTP, so that verifiers can run on other CPU hosts.

    python -m jrl.rewards.server --port 8123 --functions math_answer,format_think_answer \\
        --mode process --workers 8 --timeout_s 10 \\
        --max_body_bytes 16777216 --read_timeout_s 30 --threads 8 --connection_limit 1024

POST /score with JSON {"prompts": [str], "completions": [str], "metadata": [object]}
(three lists of one length n) answers {"total": [n], "per_fn": {name: [score or null]},
"unscored": {...}, "failures": {...}, "timeouts": {...}, "errors": [...]}; GET /health
answers {"ok": true, "functions": [...]}. Every other request gets a JSON error
answer {"error": message} (plus {"field": name} when one field of the request
is wrong): 400 for bad JSON, wrong types or lengths that differ, 404 for an
unknown path, 405 for a wrong method, 413 for a body of `max_body_bytes` or
more, 500 if the service raised. Totals and scores that are not finite are
sent as null.

Server stack: waitress (a maintained pure-Python WSGI server), not the
stdlib `ThreadingHTTPServer`, which has a listen backlog of 5, one unbounded
thread per connection and no limits at all. Waitress gives what the stdlib
server would need a rewrite for, and every limit is an argument of
`make_server` and a flag of the command line:

* request size: a Content-Length of `max_body_bytes` or more (default
  16 MiB; a step of 32 prompts x 8 samples x 512 tokens is about 2 MB of
  JSON) is answered 413 from the headers alone, before the body is read;
  chunked bodies are cut off at the same size; headers are capped at 64 KiB.
* read timeout: a connection that sends nothing for `read_timeout_s`
  (whole seconds, checked once a second) is closed, whether it is idle
  between requests or stalled in the middle of one (a body shorter than its
  Content-Length). A request that is being scored is never cut off.
* bounded resources: connections are read and written by one event loop
  (so a slow client holds no thread); complete requests are handled by
  `threads` worker threads; at most `connection_limit` connections are
  open, further ones wait in a listen backlog of `backlog` (4096, which
  Linux clamps to net.core.somaxconn).
* malformed HTTP (e.g. a negative or non-numeric Content-Length) is
  answered 400 by waitress's parser; we only swap its plain-text error body
  for JSON (`_JSONErrorTask`, a subclass of a waitress class: hence the pin
  waitress>=3.0,<4 in pyproject.toml).

Scoring calls are serialised (one at a time per service), as `RewardService`
is not meant to be called from several threads at once.

`RemoteRewardService(url)` is the client, with the interface of
`RewardService`; see its docstring. Nothing it meets (a server that is down,
slow, answering garbage, wrong lengths or NaN) is raised into the caller:
the completions it could not score are unscored and counted.
"""

import argparse
import http.client
import json
import logging
import math
import threading
import time
import urllib.parse

import numpy as np
from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask

from jrl.rewards.base import ScoredBatch
from jrl.rewards.service import RewardService

MAX_BODY_BYTES = 16 * 2**20  # requests of this many bytes or more are answered 413
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


# Server --------------------------------------------------------------------------


class BadRequest(ValueError):
  """A request the server answers with 400, naming the wrong field."""

  def __init__(self, field, message):
    super().__init__(f'{field!r} {message}')
    self.field = field


def _finite_or_none(values):
  return [float(v) if math.isfinite(v) else None for v in np.asarray(values, np.float64)]


def _to_json(scored):
  return {
    'total': _finite_or_none(scored.total),
    'per_fn': {k: _finite_or_none(v) for k, v in scored.per_fn.items()},
    'unscored': {k: int(v) for k, v in scored.unscored.items()},
    'failures': {k: int(v) for k, v in scored.failures.items()},
    'timeouts': {k: int(v) for k, v in scored.timeouts.items()},
    'errors': [str(e) for e in scored.errors],
  }


def _type_name(value):
  return 'null' if value is None else type(value).__name__


def parse_score_request(body):
  """(prompts, completions, metadata) from a POST /score body, or BadRequest."""
  try:
    request = json.loads(body)
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise BadRequest('body', f'is not JSON: {e}') from None
  if not isinstance(request, dict):
    raise BadRequest('body', f'must be a JSON object, not {_type_name(request)}')
  fields = {}
  for field, kind, kind_name in (
    ('prompts', str, 'string'),
    ('completions', str, 'string'),
    ('metadata', dict, 'object'),
  ):
    if field not in request:
      raise BadRequest(field, 'is missing')
    values = request[field]
    if not isinstance(values, list):
      raise BadRequest(field, f'must be a list of {kind_name}s, not {_type_name(values)}')
    for i, v in enumerate(values):
      if not isinstance(v, kind):
        raise BadRequest(field, f'must be a list of {kind_name}s; item {i} is {_type_name(v)}')
    fields[field] = values
  n = len(fields['completions'])
  for field in ('prompts', 'metadata'):
    if len(fields[field]) != n:
      raise BadRequest(
        field, f'has {len(fields[field])} entries for {n} completions (lengths must match)'
      )
  return fields['prompts'], fields['completions'], fields['metadata']


def make_app(service):
  """The WSGI application serving `service`."""
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
    args = parse_score_request(environ['wsgi.input'].read(length))
    with lock:
      return _to_json(service(*args))

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
      return respond(start_response, 400, {'error': f'bad request: {e}', 'field': e.field})
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
    read_timeout_s=READ_TIMEOUT_S,
    threads=THREADS,
    connection_limit=CONNECTION_LIMIT,
    backlog=BACKLOG,
  ):
    read_timeout_s = int(read_timeout_s)
    for name, value in (
      ('max_body_bytes', max_body_bytes),
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
    self._listener = _Listener(make_app(service), map=self._map, adj=adj, sockinfo=adj.listen[0])
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

  `limits`: max_body_bytes, read_timeout_s, threads, connection_limit,
  backlog (see `RewardServer` and the module docstring for the defaults).
  """
  return RewardServer(service, host, port, **limits)


# Client --------------------------------------------------------------------------

# Errors that say the request was not answered because there was no server to
# take it (refused) or the connection broke (reset, aborted, closed without an
# answer): retried.
_RETRIED = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class _Unscorable(Exception):
  """The call gave no usable answer; `kind` is 'failures' or 'timeouts'."""

  def __init__(self, kind, message):
    super().__init__(message)
    self.kind = kind


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _backoff_sleep(seconds):
  time.sleep(seconds)


def _is_count(v):
  return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _scores(values, n, field):
  """A [n] float32 array from a JSON list of numbers or nulls (null, NaN, inf -> NaN)."""
  if not isinstance(values, list) or len(values) != n:
    length = len(values) if isinstance(values, list) else _type_name(values)
    raise ValueError(f'{field!r} must be a list of {n} numbers or nulls, got {length}')
  out = np.full(n, np.nan, np.float32)
  for i, v in enumerate(values):
    if v is None:
      continue
    if isinstance(v, bool) or not isinstance(v, int | float):
      raise ValueError(f'{field!r} item {i} is {_type_name(v)}, not a number or null')
    try:
      v = float(v)
    except OverflowError:  # an integer beyond float range
      continue
    if math.isfinite(v) and abs(v) <= _FLOAT32_MAX:
      out[i] = v
  return out


def _counts(values, field):
  if not isinstance(values, dict) or not all(_is_count(v) for v in values.values()):
    raise ValueError(f'{field!r} must be an object of counts (integers >= 0)')
  return dict(values)


class RemoteRewardService:
  """Client of a reward server, with the `RewardService` interface.

  A call POSTs the batch to `url`/score and checks the answer: `total` and
  every `per_fn` entry are lists of n numbers or nulls, the counts are
  objects of non-negative integers, `errors` a list of strings. The
  ScoredBatch it returns has a 'remote' entry besides the server's
  functions: per_fn['remote'] is the total as received (NaN where it was not
  usable) and unscored/failures/timeouts['remote'] count what this client
  could not score.

  * A total that is null, NaN or inf leaves that completion unscored: it
    counts `unscored_value` in the total and one in unscored['remote'].
  * No usable answer (connection failure, HTTP error status, not JSON, a
    field of the wrong type or length) leaves the whole batch unscored, with
    failures['remote'] = 1; no answer within `timeout_s` (connecting,
    sending or waiting for the answer) gives timeouts['remote'] = 1. The
    errors name the URL and the cause.
  * Retries: a refused, reset or aborted connection is retried up to
    `retries` times, after backoff_s, 2 backoff_s, 4 backoff_s, ... (each
    capped at `max_backoff_s`). A reset may come after the server scored the
    batch; scoring again is harmless since reward functions are pure. A
    timeout is never retried (the server may still be scoring it), nor is
    an answer that came back wrong.

  The server is reached directly: proxy environment variables are not used.
  Nothing is raised into the caller.
  """

  def __init__(
    self,
    url,
    timeout_s=60.0,
    *,
    retries=3,
    backoff_s=0.5,
    max_backoff_s=8.0,
    unscored_value=0.0,
    max_response_bytes=256 * 2**20,
  ):
    self.url = url.rstrip('/')
    parts = urllib.parse.urlsplit(self.url)
    if parts.scheme not in ('http', 'https') or not parts.hostname:
      raise ValueError(f'reward server url {url!r} must look like http://host:port.')
    self._parts = parts
    self.timeout_s = float(timeout_s)
    self.retries = int(retries)
    self.backoff_s = float(backoff_s)
    self.max_backoff_s = float(max_backoff_s)
    self.unscored_value = float(unscored_value)
    self.max_response_bytes = int(max_response_bytes)
    self.names = ('remote',)
    self.totals = {'calls': 0, 'failures': 0, 'timeouts': 0, 'retries': 0}

  # One HTTP exchange. ---------------------------------------------------------------

  def _post(self, body):
    """(status, answer bytes) of one POST; raises OSError subclasses on failure."""
    parts = self._parts
    connection_class = (
      http.client.HTTPSConnection if parts.scheme == 'https' else http.client.HTTPConnection
    )
    connection = connection_class(parts.hostname, parts.port, timeout=self.timeout_s)
    deadline = time.monotonic() + self.timeout_s
    try:
      try:
        connection.request(
          'POST',
          parts.path + '/score',
          body=body,
          headers={'Content-Type': 'application/json', 'Connection': 'close'},
        )
        send_error = None
      except (BrokenPipeError, ConnectionResetError) as e:
        send_error = e  # the server may have answered early (e.g. 413) and closed
      try:
        response = connection.getresponse()
      except (OSError, http.client.HTTPException):
        if send_error is not None:
          raise send_error from None
        raise
      chunks, size = [], 0
      while chunk := response.read1(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > self.max_response_bytes:
          raise ValueError(f'answer larger than {self.max_response_bytes} bytes')
        if time.monotonic() > deadline:
          raise TimeoutError('answer still arriving')
      return response.status, b''.join(chunks)
    finally:
      connection.close()

  def _exchange(self, body):
    """The answer bytes of a 200, after retries; raises _Unscorable."""
    where = f'remote {self.url}/score'
    for attempt in range(self.retries + 1):
      try:
        status, answer = self._post(body)
        break
      except TimeoutError:
        raise _Unscorable(
          'timeouts', f'{where}: no answer after {self.timeout_s:g} s (not retried)'
        ) from None
      except _RETRIED as e:
        if attempt == self.retries:
          raise _Unscorable(
            'failures', f'{where}: {type(e).__name__}: {e} (gave up after {attempt + 1} tries)'
          ) from None
        self.totals['retries'] += 1
        _backoff_sleep(min(self.backoff_s * 2**attempt, self.max_backoff_s))
      except (OSError, http.client.HTTPException, ValueError) as e:
        raise _Unscorable('failures', f'{where}: {type(e).__name__}: {e}') from None
    if status != 200:
      try:
        detail = json.loads(answer)['error']
      except Exception:  # any body: show its start
        detail = answer[:200].decode('utf-8', 'replace')
      raise _Unscorable('failures', f'{where}: HTTP {status}: {detail}')
    return answer

  def _parse(self, answer, n):
    """The ScoredBatch in a 200 answer; raises ValueError when it is not one."""
    payload = json.loads(answer)
    if not isinstance(payload, dict):
      raise ValueError(f'answer must be a JSON object, not {_type_name(payload)}')
    for field in ('total', 'per_fn', 'unscored', 'failures', 'timeouts', 'errors'):
      if field not in payload:
        raise ValueError(f'answer has no {field!r}')
    total = _scores(payload['total'], n, 'total')
    if not isinstance(payload['per_fn'], dict) or 'remote' in payload['per_fn']:
      raise ValueError("'per_fn' must be an object of score lists (without 'remote')")
    per_fn = {k: _scores(v, n, f'per_fn.{k}') for k, v in payload['per_fn'].items()}
    counts = [_counts(payload[f], f) for f in ('unscored', 'failures', 'timeouts')]
    errors = payload['errors']
    if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
      raise ValueError("'errors' must be a list of strings")
    return total, per_fn, counts, list(errors)

  # The RewardService interface. -----------------------------------------------------

  def __call__(self, prompts, completions, metadata):
    n = len(completions)
    self.totals['calls'] += 1
    try:
      if not len(prompts) == n == len(metadata):
        raise _Unscorable(
          'failures',
          f'remote {self.url}/score: prompts ({len(prompts)}), completions ({n}) and '
          f'metadata ({len(metadata)}) differ',
        )
      try:
        body = json.dumps(
          {'prompts': list(prompts), 'completions': list(completions), 'metadata': list(metadata)},
          default=_jsonable,
        ).encode()
      except (TypeError, ValueError) as e:
        raise _Unscorable('failures', f'remote {self.url}/score: cannot send batch: {e}') from None
      answer = self._exchange(body)
      try:
        total, per_fn, counts, errors = self._parse(answer, n)
      except (ValueError, RecursionError) as e:
        raise _Unscorable('failures', f'remote {self.url}/score: bad answer: {e}') from None
    except _Unscorable as e:
      self.totals[e.kind] += 1
      return self._unscored(n, e.kind, str(e))
    except Exception as e:  # a bug here must not stop training
      self.totals['failures'] += 1
      return self._unscored(n, 'failures', f'remote {self.url}/score: {type(e).__name__}: {e}')

    bad = np.isnan(total)
    unscored, failures, timeouts = counts
    for name in per_fn:  # every function has its counts, as the trainer gathers them by name
      for c in counts:
        c.setdefault(name, 0)
    per_fn['remote'] = total
    unscored['remote'], failures['remote'], timeouts['remote'] = int(bad.sum()), 0, 0
    if bad.any():
      errors = [
        f'remote {self.url}/score: {int(bad.sum())} of {n} totals null or not finite',
        *errors,
      ]
    total = np.where(bad, self.unscored_value, total).astype(np.float32)
    return ScoredBatch(total, per_fn, unscored, failures, timeouts, errors[:5])

  def _unscored(self, n, kind, message):
    counts = {'failures': {'remote': 0}, 'timeouts': {'remote': 0}}
    counts[kind]['remote'] = 1
    return ScoredBatch(
      np.full(n, self.unscored_value, np.float32),
      {'remote': np.full(n, np.nan, np.float32)},
      {'remote': n},
      counts['failures'],
      counts['timeouts'],
      [message],
    )

  def close(self):
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _jsonable(value):
  """json.dumps fallback for numpy values in metadata."""
  if isinstance(value, np.generic | np.ndarray):
    return value.tolist()
  raise TypeError(f'{type(value).__name__} is not JSON serialisable')


# Command line --------------------------------------------------------------------


def main():
  parser = argparse.ArgumentParser(description='Serve jrl reward functions over HTTP.')
  parser.add_argument('--host', default='127.0.0.1')
  parser.add_argument('--port', type=int, default=8123)
  parser.add_argument('--functions', required=True, help='comma-separated registry names')
  parser.add_argument('--weights', default='', help='comma-separated, one per function')
  parser.add_argument('--modules', default='', help='extra modules that register functions')
  parser.add_argument('--mode', default='process')
  parser.add_argument('--workers', type=int, default=4)
  parser.add_argument('--timeout_s', type=float, default=30.0, help='per chunk of completions')
  parser.add_argument(
    '--max_body_bytes',
    type=int,
    default=MAX_BODY_BYTES,
    help='requests of this many bytes or more are answered 413',
  )
  parser.add_argument(
    '--read_timeout_s',
    type=int,
    default=READ_TIMEOUT_S,
    help='close a connection that sends nothing for this many seconds',
  )
  parser.add_argument('--threads', type=int, default=THREADS, help='request handler threads')
  parser.add_argument(
    '--connection_limit', type=int, default=CONNECTION_LIMIT, help='open connections at most'
  )
  parser.add_argument('--backlog', type=int, default=BACKLOG, help='listen(2) backlog')
  args = parser.parse_args()
  import importlib

  for module in filter(None, args.modules.split(',')):
    importlib.import_module(module)
  weights = [float(w) for w in args.weights.split(',')] if args.weights else None
  service = RewardService(
    args.functions.split(','),
    weights,
    mode=args.mode,
    workers=args.workers,
    timeout_s=args.timeout_s,
  )
  server = make_server(
    service,
    args.host,
    args.port,
    max_body_bytes=args.max_body_bytes,
    read_timeout_s=args.read_timeout_s,
    threads=args.threads,
    connection_limit=args.connection_limit,
    backlog=args.backlog,
  )
  print(f'serving {service.names} on http://{args.host}:{server.server_address[1]}', flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
    service.close()


if __name__ == '__main__':
  main()
