"""The reward HTTP server and its client: limits, error answers, retries.

Everything listens on 127.0.0.1. Waits are bounded by socket timeouts far
above what the server needs, so no assertion depends on timing.
"""

import contextlib
import http.client
import http.server
import json
import socket
import struct
import threading

import numpy as np
import pytest

from jrl.rewards import RewardService
from jrl.rewards.server import MAX_COMPLETIONS, RemoteRewardService, make_server
from jrl.rewards.server import client as client_lib
from tests.rewards import fixtures  # noqa: F401 (registers the test functions)

WAIT_S = 20.0  # upper bound on any wait for the server; it needs ~2 s at most


def _batch(n):
  return ['p'] * n, [f'c{i}' + 'x' * (i % 7) for i in range(n)], [{} for _ in range(n)]


@contextlib.contextmanager
def _serving(service, **limits):
  server = make_server(service, **limits)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield server.server_address[1]
  finally:
    server.shutdown()
    server.server_close()
    thread.join(WAIT_S)


@pytest.fixture(scope='module')
def port():
  """A server with a 1 KiB body limit and a 1 s read timeout."""
  with RewardService(['test_length'], mode='inline') as service:
    with _serving(service, max_body_bytes=1024, read_timeout_s=1) as p:
      yield p


def _raw(port, data):
  """Sends `data` on a fresh connection and reads until the server closes it."""
  with socket.create_connection(('127.0.0.1', port), timeout=WAIT_S) as sock:
    sock.sendall(data)
    return _read_until_closed(sock)


def _read_until_closed(sock):
  chunks = []
  while chunk := sock.recv(65536):
    chunks.append(chunk)
  return b''.join(chunks)


def _status_and_json(response):
  head, _, body = response.partition(b'\r\n\r\n')
  lines = head.decode('latin-1').split('\r\n')
  headers = dict(line.split(': ', 1) for line in lines[1:])
  assert headers['Content-Type'] == 'application/json', response
  return int(lines[0].split()[1]), json.loads(body)


def _request(port, method, path, body=None):
  connection = http.client.HTTPConnection('127.0.0.1', port, timeout=WAIT_S)
  try:
    connection.request(method, path, body=body, headers={'Content-Type': 'application/json'})
    response = connection.getresponse()
    assert response.getheader('Content-Type') == 'application/json'
    return response.status, json.loads(response.read())
  finally:
    connection.close()


# Server ----------------------------------------------------------------------------


def test_256_concurrent_clients_are_all_answered_correctly():
  n_clients = 256
  barrier = threading.Barrier(n_clients)
  results = [None] * n_clients

  def client(i, url):
    prompts, completions, metadata = ['p'], ['y' * (i % 50)], [{}]
    barrier.wait(WAIT_S)
    results[i] = RemoteRewardService(url, timeout_s=60, retries=0)(prompts, completions, metadata)

  with RewardService(['test_length'], mode='thread', workers=2, timeout_s=30) as service:
    with _serving(service) as p:
      url = f'http://127.0.0.1:{p}'
      threads = [threading.Thread(target=client, args=(i, url)) for i in range(n_clients)]
      for t in threads:
        t.start()
      for t in threads:
        t.join(120)
  for i, scored in enumerate(results):
    assert scored is not None, f'client {i} never returned'
    assert scored.failures == {'test_length': 0, 'remote': 0}, (i, scored.errors)
    assert scored.timeouts == {'test_length': 0, 'remote': 0}, (i, scored.errors)
    np.testing.assert_array_equal(scored.total, [float(i % 50)])
    np.testing.assert_array_equal(scored.per_fn['test_length'], [float(i % 50)])


def test_a_body_over_the_limit_is_answered_413_from_the_headers(port):
  # Announce 1 GB, send 13 bytes: an answer at all shows the body was not awaited.
  head = (
    'POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
    'Content-Length: 1000000000\r\n\r\n'
  )
  status, payload = _status_and_json(_raw(port, head.encode() + b'{"prompts": ['))
  assert status == 413 and '1024' in payload['error']
  # Just over the limit, sent whole by the client: 413, counted, never raised.
  n = 200
  scored = RemoteRewardService(f'http://127.0.0.1:{port}', timeout_s=WAIT_S, retries=0)(*_batch(n))
  assert scored.failures == {'remote': 1} and scored.unscored == {'remote': n}
  assert 'HTTP 413' in scored.errors[0], scored.errors
  # The server still serves.
  assert _request(port, 'GET', '/health') == (200, {'ok': True, 'functions': ['test_length']})


def test_a_short_or_negative_body_does_not_hang_the_server(port):
  status, payload = _status_and_json(
    _raw(port, b'POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}')
  )
  assert status == 400 and 'Content-Length' in payload['error']
  # 100 bytes announced, 10 sent, then silence.
  stalled = socket.create_connection(('127.0.0.1', port), timeout=WAIT_S)
  with stalled:
    stalled.sendall(b'POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompts"')
    # Others are served meanwhile.
    scored = RemoteRewardService(f'http://127.0.0.1:{port}', timeout_s=WAIT_S)(['p'], ['abc'], [{}])
    np.testing.assert_array_equal(scored.total, [3.0])
    # The stalled connection is closed after the read timeout (or answered with an error).
    response = _read_until_closed(stalled)
  assert response == b'' or _status_and_json(response)[0] >= 400


def test_idle_connections_are_closed_after_the_read_timeout(port):
  with socket.create_connection(('127.0.0.1', port), timeout=WAIT_S) as idle:
    assert idle.recv(1) == b''  # never sent a byte
  with socket.create_connection(('127.0.0.1', port), timeout=WAIT_S) as kept:
    kept.sendall(b'GET /health HTTP/1.1\r\nHost: x\r\n\r\n')  # keep-alive
    response = _read_until_closed(kept)  # one answer, then closed when idle
  assert response.count(b'HTTP/1.1 200') == 1 and response.endswith(b'["test_length"]}')


@pytest.mark.parametrize(
  'body, field',
  [
    ({'prompts': ['p'], 'completions': 3, 'metadata': [{}]}, 'completions'),
    ({'prompts': ['p', 'q'], 'completions': [1, 2], 'metadata': [{}, {}]}, 'completions'),
    ({'prompts': ['p'], 'completions': ['c'], 'metadata': [1]}, 'metadata'),
    ({'prompts': ['p'], 'completions': ['c'], 'metadata': 'x'}, 'metadata'),
    ({'prompts': [None], 'completions': ['c'], 'metadata': [{}]}, 'prompts'),
    ({'completions': ['c'], 'metadata': [{}]}, 'prompts'),
    ({'prompts': ['p', 'q'], 'completions': ['c'], 'metadata': [{}]}, 'prompts'),
    ({'prompts': ['p'], 'completions': ['c'], 'metadata': [{}, {}]}, 'metadata'),
    ([['p'], ['c'], [{}]], 'body'),
    (b'{"prompts": [', 'body'),
    (b'\xff\xfe', 'body'),
  ],
)
def test_wrong_json_is_answered_400_naming_the_field(port, body, field):
  data = body if isinstance(body, bytes) else json.dumps(body).encode()
  status, payload = _request(port, 'POST', '/score', data)
  assert status == 400 and payload['field'] == field, payload
  assert repr(field) in payload['error']


def test_more_completions_than_the_limit_are_answered_413_naming_it():
  def body(n):
    prompts, completions, metadata = _batch(n)
    return json.dumps({'prompts': prompts, 'completions': completions, 'metadata': metadata})

  with RewardService(['test_length'], mode='inline') as service:
    with _serving(service, max_completions=3) as p:
      status, payload = _request(p, 'POST', '/score', body(4).encode())
      assert status == 413 and payload['field'] == 'completions', payload
      assert 'at most 3 completions' in payload['error'] and 'max_completions' in payload['error']
      status, payload = _request(p, 'POST', '/score', body(3).encode())
      assert status == 200 and len(payload['total']) == 3
      # The client counts the refused batch as a failure, never raised.
      scored = RemoteRewardService(f'http://127.0.0.1:{p}', retries=0)(*_batch(4))
      assert scored.failures == {'remote': 1} and 'HTTP 413' in scored.errors[0]
    # The default limit: MAX_COMPLETIONS.
    with _serving(service) as p:
      status, payload = _request(p, 'POST', '/score', body(MAX_COMPLETIONS + 1).encode())
      assert status == 413 and f'at most {MAX_COMPLETIONS} completions' in payload['error']
    with pytest.raises(ValueError, match='max_completions'):
      make_server(service, max_completions=0)


def test_wrong_path_and_method_are_answered_in_json(port):
  assert _request(port, 'GET', '/nope')[0] == 404
  assert _request(port, 'POST', '/nope', b'{}')[0] == 404
  assert _request(port, 'GET', '/score')[0] == 405
  assert _request(port, 'POST', '/health', b'{}')[0] == 405
  assert _request(port, 'DELETE', '/score')[0] == 405


# Client against a fake server ------------------------------------------------------


class _FakeServer:
  """A stdlib server on 127.0.0.1 answering POSTs from a list of (status, body)."""

  def __init__(self, answers, activate=True):
    self.answers, self.requests = list(answers), 0
    self.release = threading.Event()  # for answers that wait
    fake = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_POST(self):
        self.rfile.read(int(self.headers['Content-Length']))
        fake.requests += 1
        status, body = fake.answers.pop(0) if len(fake.answers) > 1 else fake.answers[0]
        if status == 'reset':  # drop the connection without an answer
          self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))
          self.close_connection = True
          return
        if status == 'hang':
          fake.release.wait(WAIT_S)
          return
        self.send_response(status)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)

      def log_message(self, *args):
        del args

    self.server = http.server.ThreadingHTTPServer(
      ('127.0.0.1', 0), Handler, bind_and_activate=False
    )
    self.server.daemon_threads = True
    self.server.server_bind()  # bound but not listening: connections are refused
    self.url = f'http://127.0.0.1:{self.server.server_address[1]}'
    self.activated = False
    if activate:
      self.activate()

  def activate(self):
    self.activated = True
    self.server.server_activate()
    threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

  def close(self):
    self.release.set()
    if self.activated:  # shutdown() waits for a serve_forever() that must have started
      self.server.shutdown()
    self.server.server_close()


@contextlib.contextmanager
def _fake(answers, activate=True):
  fake = _FakeServer(answers, activate)
  try:
    yield fake
  finally:
    fake.close()


def _answer(total, **fields):
  n = len(total)
  payload = {
    'total': total,
    'per_fn': {'f': [1.0] * n},
    'unscored': {'f': 0},
    'failures': {'f': 0},
    'timeouts': {'f': 0},
    'errors': [],
    **fields,
  }
  return json.dumps(payload).encode()  # NaN and Infinity as Python writes them


def test_non_finite_totals_become_unscored_completions():
  body = _answer([1.0, float('nan'), None, float('inf'), 2.0])
  with _fake([(200, body)]) as fake:
    scored = RemoteRewardService(fake.url, unscored_value=-1.0)(*_batch(5))
  np.testing.assert_array_equal(scored.total, [1.0, -1.0, -1.0, -1.0, 2.0])
  assert np.isnan(scored.per_fn['remote'][1:4]).all() and scored.per_fn['remote'][0] == 1.0
  np.testing.assert_array_equal(scored.per_fn['f'], np.ones(5))
  assert scored.unscored == {'f': 0, 'remote': 3}
  assert scored.failures == {'f': 0, 'remote': 0}
  assert fake.url in scored.errors[0] and '3 of 5' in scored.errors[0]
  with _fake([(200, _answer([float('nan')] * 3))]) as fake:
    scored = RemoteRewardService(fake.url)(*_batch(3))  # default unscored value 0.0
  np.testing.assert_array_equal(scored.total, np.zeros(3))
  assert scored.unscored['remote'] == 3


@pytest.mark.parametrize(
  'status, body, cause',
  [
    (200, _answer([1.0, 2.0]), "'total' must be a list of 3"),
    (200, _answer([1.0, 2.0, 3.0, 4.0]), "'total' must be a list of 3"),
    (200, _answer([1.0, 'a', 3.0]), "'total' item 1 is str"),
    (200, _answer([1.0, 2.0, 3.0], per_fn={'f': [1.0]}), "'per_fn.f'"),
    (200, _answer([1.0, 2.0, 3.0], unscored={'f': -1}), "'unscored'"),
    (200, _answer([1.0, 2.0, 3.0], errors='oops'), "'errors'"),
    (200, json.dumps({'total': [1.0, 2.0, 3.0]}).encode(), "no 'per_fn'"),
    (200, b'<html>not json</html>', 'bad answer'),
    (200, b'[1, 2, 3]', 'JSON object'),
    (500, json.dumps({'error': 'verifier exploded'}).encode(), 'HTTP 500: verifier exploded'),
    (503, b'busy', 'HTTP 503: busy'),
  ],
)
def test_a_wrong_answer_leaves_the_batch_unscored(status, body, cause):
  with _fake([(status, body)]) as fake:
    scored = RemoteRewardService(fake.url, retries=3, backoff_s=0.01)(*_batch(3))
  assert fake.requests == 1  # a wrong answer is not retried
  np.testing.assert_array_equal(scored.total, np.zeros(3))
  assert np.isnan(scored.per_fn['remote']).all()
  assert scored.unscored == {'remote': 3}
  assert scored.failures == {'remote': 1} and scored.timeouts == {'remote': 0}
  assert fake.url in scored.errors[0] and cause in scored.errors[0], scored.errors


def _recording_sleep(monkeypatch, on_sleep=None):
  slept = []

  def sleep(seconds):
    slept.append(seconds)
    if on_sleep is not None:
      on_sleep(len(slept))

  monkeypatch.setattr(client_lib, '_backoff_sleep', sleep)
  return slept


def test_a_server_that_comes_up_is_reached_after_backoff(monkeypatch):
  with _fake([(200, _answer([1.0, 2.0, 3.0]))], activate=False) as fake:
    # The server starts listening during the second wait.
    slept = _recording_sleep(monkeypatch, lambda k: k == 2 and fake.activate())
    client = RemoteRewardService(fake.url, retries=5, backoff_s=0.1)
    scored = client(*_batch(3))
  assert slept == [0.1, 0.2]
  np.testing.assert_array_equal(scored.total, [1.0, 2.0, 3.0])
  assert scored.failures == {'f': 0, 'remote': 0} and scored.unscored['remote'] == 0
  assert client.totals['retries'] == 2 and fake.requests == 1


def test_a_refused_connection_after_retries_is_counted_as_a_failure(monkeypatch):
  slept = _recording_sleep(monkeypatch)
  with _fake([(200, b'')], activate=False) as fake:
    scored = RemoteRewardService(fake.url, retries=3, backoff_s=0.5, max_backoff_s=1.0)(*_batch(4))
  assert slept == [0.5, 1.0, 1.0]  # doubling, capped
  np.testing.assert_array_equal(scored.total, np.zeros(4))
  assert scored.unscored == {'remote': 4} and scored.failures == {'remote': 1}
  assert fake.url in scored.errors[0] and 'ConnectionRefusedError' in scored.errors[0]
  assert '4 tries' in scored.errors[0]


def test_a_reset_is_retried_but_a_timeout_is_not(monkeypatch):
  slept = _recording_sleep(monkeypatch)
  with _fake([('reset', b''), (200, _answer([5.0]))]) as fake:
    scored = RemoteRewardService(fake.url, retries=1, backoff_s=0.01)(*_batch(1))
  assert fake.requests == 2 and slept == [0.01]
  np.testing.assert_array_equal(scored.total, [5.0])
  # The server may be scoring a batch that timed out: it is not sent again.
  with _fake([('hang', b'')]) as fake:
    scored = RemoteRewardService(fake.url, timeout_s=0.5, retries=3)(*_batch(2))
    assert fake.requests == 1
  assert slept == [0.01]
  assert scored.timeouts == {'remote': 1} and scored.failures == {'remote': 0}
  assert scored.unscored == {'remote': 2} and fake.url in scored.errors[0]


def test_a_batch_that_cannot_be_sent_is_unscored_not_raised():
  client = RemoteRewardService('http://127.0.0.1:9', retries=0)
  mismatched = client(['p'], ['a', 'b'], [{}, {}])
  assert mismatched.failures == {'remote': 1} and mismatched.unscored == {'remote': 2}
  unserialisable = client(['p'], ['a'], [{'x': object()}])
  assert unserialisable.failures == {'remote': 1} and 'cannot send' in unserialisable.errors[0]
