"""A reward worker process: `python -m jrl.rewards.worker MODULE...`.

Imports the modules that register the reward functions it will run, then
serves requests on stdin and answers on stdout, each a pickled message
prefixed with its 8-byte length. Request: (task id, function name, prompts,
completions, metadata, timeout_s, sent at (time.time())); answer: (task id,
'ok', scores) or (task id, 'error', message). The function runs with
`time_left()` counting down to `timeout_s` after the request was sent (the
pool kills the worker then), so a worker still importing when the request
came does not overrun. Anything the reward functions print goes to stderr,
so it cannot corrupt the protocol.
Started by `jrl.rewards.service.ProcessPool` in a session of its own, so
that a timed-out worker can be killed with everything it started.
"""

import importlib
import os
import sys
import time

from jrl.rewards.service import clean_scores, read_message, write_message


def main(modules):
  proto_out = os.fdopen(os.dup(1), 'wb')
  os.dup2(2, 1)  # prints from reward functions go to stderr
  proto_in = sys.stdin.buffer
  for module in modules:
    importlib.import_module(module)
  from jrl.rewards.base import call_deadline, get_reward_fn

  while True:
    msg = read_message(proto_in)
    if msg is None:
      return
    task_id, name, prompts, completions, metadata, timeout_s, sent_at = msg
    left = min(timeout_s, timeout_s - (time.time() - sent_at))  # whatever the wall clock did
    try:
      with call_deadline(max(0.0, left)):
        scores = get_reward_fn(name)(prompts, completions, metadata)
      write_message(proto_out, (task_id, 'ok', clean_scores(scores, len(completions))))
    except BaseException as e:  # report everything; the worker itself never dies of it
      write_message(proto_out, (task_id, 'error', f'{type(e).__name__}: {e}'))


if __name__ == '__main__':
  main(sys.argv[1:])
