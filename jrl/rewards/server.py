"""The reward service over HTTP, so that verifiers can run on other CPU hosts.

    python -m jrl.rewards.server --port 8123 --functions math_answer,format_think_answer \\
        --mode process --workers 8 --timeout_s 10

POST /score with JSON {"prompts": [...], "completions": [...], "metadata": [...]}
answers {"total": [...], "per_fn": {name: [score or null]}, "unscored": {...},
"failures": {...}, "timeouts": {...}, "errors": [...]}; GET /health answers
{"ok": true, "functions": [...]}. `RemoteRewardService(url)` is the client,
with the interface of `RewardService`: a server that is down, slow or
answering garbage makes every completion of that call unscored and is
counted as a failure or timeout, never raised.
"""

import argparse
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from jrl.rewards.base import ScoredBatch
from jrl.rewards.service import RewardService


def _to_json(scored):
  nan_to_none = lambda a: [None if np.isnan(v) else float(v) for v in a]
  return {
    'total': [float(v) for v in scored.total],
    'per_fn': {k: nan_to_none(v) for k, v in scored.per_fn.items()},
    'unscored': scored.unscored,
    'failures': scored.failures,
    'timeouts': scored.timeouts,
    'errors': scored.errors,
  }


def make_server(service, host='127.0.0.1', port=0):
  """A ThreadingHTTPServer serving `service` (call `serve_forever()` on it)."""
  lock = threading.Lock()  # one scoring call at a time per service

  class Handler(BaseHTTPRequestHandler):
    def _send(self, code, payload):
      body = json.dumps(payload).encode()
      self.send_response(code)
      self.send_header('Content-Type', 'application/json')
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def do_GET(self):
      if self.path == '/health':
        self._send(200, {'ok': True, 'functions': list(service.names)})
      else:
        self._send(404, {'error': 'not found'})

    def do_POST(self):
      if self.path != '/score':
        self._send(404, {'error': 'not found'})
        return
      try:
        request = json.loads(self.rfile.read(int(self.headers.get('Content-Length', 0))))
        args = (request['prompts'], request['completions'], request['metadata'])
      except (ValueError, KeyError, TypeError) as e:
        self._send(400, {'error': f'bad request: {e}'})
        return
      try:
        with lock:
          scored = service(*args)
      except ValueError as e:
        self._send(400, {'error': str(e)})
        return
      self._send(200, _to_json(scored))

    def log_message(self, *args):
      del args

  return ThreadingHTTPServer((host, port), Handler)


class RemoteRewardService:
  """Client of a reward server, with the `RewardService` interface."""

  def __init__(self, url, timeout_s=60.0):
    self.url = url.rstrip('/')
    self.timeout_s = float(timeout_s)
    self.names = ('remote',)

  def __call__(self, prompts, completions, metadata):
    n = len(completions)
    body = json.dumps(
      {
        'prompts': list(prompts),
        'completions': list(completions),
        'metadata': list(metadata),
      }
    ).encode()
    request = urllib.request.Request(
      self.url + '/score', data=body, headers={'Content-Type': 'application/json'}
    )
    try:
      with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
        payload = json.loads(response.read())
      per_fn = {
        k: np.asarray([np.nan if v is None else v for v in vals], np.float32)
        for k, vals in payload['per_fn'].items()
      }
      return ScoredBatch(
        np.asarray(payload['total'], np.float32),
        per_fn,
        dict(payload['unscored']),
        dict(payload['failures']),
        dict(payload['timeouts']),
        list(payload['errors']),
      )
    except TimeoutError:
      kind = 'timeouts'
      message = f'remote: no answer from {self.url} after {self.timeout_s:g} s'
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as e:
      kind = 'failures'
      message = f'remote: {self.url}: {type(e).__name__}: {e}'
    counts = {'failures': {'remote': 0}, 'timeouts': {'remote': 0}}
    counts[kind]['remote'] = 1
    return ScoredBatch(
      np.zeros(n, np.float32),
      {'remote': np.full(n, np.nan, np.float32)},
      {'remote': n},
      counts['failures'],
      counts['timeouts'],
      [message],
    )

  def close(self):
    pass


def main():
  parser = argparse.ArgumentParser(description='Serve jrl reward functions over HTTP.')
  parser.add_argument('--host', default='127.0.0.1')
  parser.add_argument('--port', type=int, default=8123)
  parser.add_argument('--functions', required=True, help='comma-separated registry names')
  parser.add_argument('--weights', default='', help='comma-separated, one per function')
  parser.add_argument('--modules', default='', help='extra modules that register functions')
  parser.add_argument('--mode', default='process')
  parser.add_argument('--workers', type=int, default=4)
  parser.add_argument('--timeout_s', type=float, default=30.0)
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
  server = make_server(service, args.host, args.port)
  print(f'serving {service.names} on http://{args.host}:{server.server_address[1]}', flush=True)
  try:
    server.serve_forever()
  finally:
    service.close()


if __name__ == '__main__':
  main()
