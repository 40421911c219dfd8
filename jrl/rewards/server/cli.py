"""The command line of the reward server: `python -m jrl.rewards.server --help`."""

import argparse

from jrl.rewards.server.app import (
  BACKLOG,
  CONNECTION_LIMIT,
  MAX_BODY_BYTES,
  MAX_COMPLETIONS,
  READ_TIMEOUT_S,
  THREADS,
  make_server,
)
from jrl.rewards.service import RewardService


def main():
  """Serves the reward functions named on the command line until interrupted."""
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
    '--max_completions',
    type=int,
    default=MAX_COMPLETIONS,
    help='requests with more completions are answered 413',
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
    max_completions=args.max_completions,
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
