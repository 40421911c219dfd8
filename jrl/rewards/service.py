"""The reward service: runs reward functions concurrently, with timeouts, and
never lets a verifier's failure reach the training loop.

    service = RewardService(['math_answer', 'format_think_answer'], weights=[1.0, 0.1],
                            mode='process', workers=2, timeout_s=10)
    scored = service(prompts, completions, metadata)      # ScoredBatch

A call splits every function's work into chunks of `chunk_size` completions
and runs the chunks concurrently:

* mode='process' (CPU-bound verifiers): a pool of fresh worker processes
  (`python -m jrl.rewards.worker`, never a fork of a process running JAX),
  each in its own session. A chunk that exceeds `timeout_s` gets its worker
  killed with everything it started, and replaced; a worker that dies is
  replaced. Reward functions are found in workers by their registry name,
  after importing the module that registered them (so they must live in an
  importable module).
* mode='thread' (I/O-bound functions, e.g. a remote model): `workers` daemon
  threads. Threads cannot be killed: a chunk that exceeds `timeout_s` is
  counted as a timeout, its thread is abandoned (it exits when the function
  returns, if ever) and a fresh thread takes its place, so one hung function
  never starves the others, and daemon threads never keep the process from
  exiting.
* mode='inline': in the caller's process (for functions that need the
  caller's state, e.g. a jrl reward model on the accelerator), one call at a
  time on a daemon thread with the same timeout and replacement.

Inside a call, `jrl.rewards.base.time_left()` gives the seconds left before
that call's chunk times out, in every mode, so that a function can keep to
the deadline itself and return the scores it has (`math_answer` does).

Whatever happens (an exception, even SystemExit or KeyboardInterrupt raised
by a reward function, a timeout, a crashed worker, a non-finite or missing
score), the affected completions are "unscored" (they count as
`unscored_value` in the total) and the counts appear in the returned
metrics: `failures`, `timeouts` and `unscored` per function, and the first
error messages. Nothing is raised into the caller.
"""

import collections
import math
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from multiprocessing import connection

import numpy as np

from jrl.rewards.base import REGISTRY, ScoredBatch, call_deadline, get_reward_fn

MODES = ('process', 'thread', 'inline')


def clean_scores(scores, n):
  """Floats or None; anything else (NaN, inf, wrong length) is an error."""
  scores = list(scores)
  if len(scores) != n:
    raise ValueError(f'returned {len(scores)} scores for {n} completions')
  out = []
  for s in scores:
    if s is None:
      out.append(None)
      continue
    s = float(s)
    out.append(s if math.isfinite(s) else None)
  return out


# Process workers -----------------------------------------------------------------


def read_message(stream):
  """One length-prefixed pickle from a binary stream, or None at EOF."""
  header = stream.read(8)
  if len(header) < 8:
    return None
  (n,) = struct.unpack('<Q', header)
  return pickle.loads(stream.read(n))  # deliberate: the trainer's own worker pipes only


def write_message(stream, message):
  data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
  stream.write(struct.pack('<Q', len(data)) + data)
  stream.flush()


class _Worker:
  """One `python -m jrl.rewards.worker` process in its own session."""

  def __init__(self, modules):
    self.process = subprocess.Popen(
      [sys.executable, '-m', 'jrl.rewards.worker', *modules],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=None,
      start_new_session=True,
    )
    self.task = None  # (task id, started at)

  def send(self, message):
    write_message(self.process.stdin, message)

  def recv(self):
    return read_message(self.process.stdout)

  def kill(self):
    try:
      os.killpg(self.process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    self.process.kill()
    self.process.wait(timeout=5)
    for stream in (self.process.stdin, self.process.stdout):
      try:
        stream.close()
      except OSError:
        pass

  def stop(self):
    try:
      self.process.stdin.close()
      self.process.wait(timeout=2)
    except (OSError, subprocess.TimeoutExpired):
      pass
    self.kill()


class ProcessPool:
  """N worker processes; tasks with a deadline; hung or dead workers are replaced."""

  def __init__(self, workers, modules):
    self._modules = tuple(modules)
    self._workers = [_Worker(self._modules) for _ in range(workers)]
    self._lock = threading.Lock()  # calls from several threads take turns
    self.restarts = 0

  def run(self, tasks, timeout_s):
    """Runs tasks [(name, prompts, completions, metadata)]; returns per task
    ('ok', scores) | ('error', message) | ('timeout', message)."""
    with self._lock:
      return self._run(tasks, timeout_s)

  def _run(self, tasks, timeout_s):
    results = [None] * len(tasks)
    pending = collections.deque(range(len(tasks)))
    while pending or any(w.task is not None for w in self._workers):
      for w in list(self._workers):
        if w.task is None and pending:
          i = pending.popleft()
          try:
            w.send((i, *tasks[i], timeout_s, time.time()))  # the clock runs from now
            w.task = (i, time.monotonic())
          except (BrokenPipeError, OSError) as e:
            results[i] = ('error', f'worker unavailable: {e}')
            self._replace(w)
      busy = [w for w in self._workers if w.task is not None]
      if not busy:
        continue
      now = time.monotonic()
      wait_s = max(0.0, min(w.task[1] + timeout_s - now for w in busy))
      ready = connection.wait([w.process.stdout for w in busy], timeout=wait_s)
      for w in busy:
        i, started = w.task
        if w.process.stdout in ready:
          message = None
          try:
            message = w.recv()
          except (EOFError, OSError, pickle.UnpicklingError):
            pass
          if message is None:
            results[i] = ('error', f'worker died (exit code {w.process.poll()})')
            self._replace(w)
          else:
            task_id, status, payload = message
            results[task_id] = (status, payload)
            w.task = None
        elif time.monotonic() - started >= timeout_s:
          results[i] = ('timeout', f'no result after {timeout_s:g} s')
          self._replace(w)
    return results

  def _replace(self, old):
    old.kill()
    self._workers[self._workers.index(old)] = _Worker(self._modules)
    self.restarts += 1

  def close(self):
    for w in self._workers:
      w.stop()


# Threads -------------------------------------------------------------------------


def contained_call(fn, chunk, timeout_s=None):
  """('ok', scores) | ('error', message) for fn(*chunk), with `time_left()`
  counting down from `timeout_s`; raises nothing, not even SystemExit or
  KeyboardInterrupt raised inside `fn`."""
  try:
    with call_deadline(timeout_s):
      return ('ok', clean_scores(fn(*chunk), len(chunk[1])))
  except BaseException as e:  # contained and reported: a reward must not end the run
    return ('error', f'{type(e).__name__}: {e}')


class _Job:
  __slots__ = ('call', 'done', 'result', 'started', 'thread', 'timeout_s')

  def __init__(self, call, timeout_s):
    self.call = call  # (fn, chunk)
    self.timeout_s = timeout_s
    self.done = False
    self.result = None
    self.started = None  # monotonic time a thread took it
    self.thread = None


class ThreadPool:
  """`workers` daemon threads running calls with a per-call deadline.

  A call that runs past its deadline is reported as a timeout; its thread is
  abandoned (it leaves when the call returns, if ever) and a new thread takes
  its place, so the pool always has `workers` threads taking work. `hung`
  counts the abandoned threads that have not returned yet.
  """

  def __init__(self, workers, name='reward'):
    self._name = name
    self._queue = collections.deque()
    self._cond = threading.Condition()
    self._closed = False
    self._abandoned = set()
    self._serial = 0
    self.replaced = 0
    for _ in range(workers):
      self._spawn()

  def _spawn(self):
    self._serial += 1
    t = threading.Thread(target=self._loop, name=f'{self._name}-{self._serial}', daemon=True)
    t.start()

  def _loop(self):
    me = threading.current_thread()
    while True:
      with self._cond:
        while not self._queue and not self._closed:
          self._cond.wait()
        if self._closed:
          return
        job = self._queue.popleft()
        job.started, job.thread = time.monotonic(), me
        self._cond.notify_all()  # its deadline now runs
      result = contained_call(*job.call, job.timeout_s)
      with self._cond:
        job.result, job.done = result, True
        self._cond.notify_all()
        if me in self._abandoned:  # replaced while it ran: leave
          self._abandoned.discard(me)
          return

  @property
  def hung(self):
    """Abandoned threads still inside a reward function."""
    with self._cond:
      return len(self._abandoned)

  def run(self, calls, timeout_s):
    """[(fn, chunk)] -> [('ok', scores) | ('error', msg) | ('timeout', msg)].

    Each call has `timeout_s` from the moment a thread starts it."""
    jobs = [_Job(c, timeout_s) for c in calls]
    results = [None] * len(jobs)
    with self._cond:
      self._queue.extend(jobs)
      self._cond.notify_all()
      while True:
        now = time.monotonic()
        waits = []
        for i, job in enumerate(jobs):
          if results[i] is not None:
            continue
          if job.done:
            results[i] = job.result
          elif job.started is not None and now - job.started >= timeout_s:
            results[i] = ('timeout', f'no result after {timeout_s:g} s')
            self._abandoned.add(job.thread)
            self.replaced += 1
            self._spawn()
          elif job.started is not None:
            waits.append(job.started + timeout_s - now)
        if all(r is not None for r in results):
          return results
        self._cond.wait(timeout=min(waits) if waits else None)

  def close(self):
    """Stops the idle threads; abandoned ones are daemons and never block exit."""
    with self._cond:
      self._closed = True
      self._queue.clear()
      self._cond.notify_all()


# The service ---------------------------------------------------------------------


class RewardService:
  """Weighted reward functions, scored concurrently, failures contained."""

  def __init__(
    self,
    names,
    weights=None,
    *,
    unscored_value=0.0,
    mode='process',
    workers=2,
    timeout_s=30.0,
    chunk_size=32,
    inline_fns=None,
  ):
    """
    Args:
      names: reward function names (jrl.rewards.REGISTRY), or keys of `inline_fns`.
      weights: one per function (default all 1).
      unscored_value: what an unscored completion contributes to the total.
      mode: 'process' | 'thread' | 'inline'.
      workers: processes or threads.
      timeout_s: per chunk.
      chunk_size: completions per task.
      inline_fns: {name: fn} run in the caller's thread whatever the mode
        (e.g. a reward model holding device arrays).
    """
    names = tuple(names)
    inline_fns = dict(inline_fns or {})
    if not names:
      raise ValueError('`reward.functions` must name at least one reward function.')
    if mode not in MODES:
      raise ValueError(f'`reward.mode` must be one of {MODES}, got {mode!r}.')
    weights = (1.0,) * len(names) if weights is None or len(weights) == 0 else tuple(weights)
    if len(weights) != len(names):
      raise ValueError(
        f'`reward.weights` has {len(weights)} entries for {len(names)} functions {names}.'
      )
    if not timeout_s > 0 or workers < 1 or chunk_size < 1:
      raise ValueError('`reward.timeout_s`, `reward.workers` and chunk size must be positive.')
    for n in names:
      if n not in inline_fns:
        get_reward_fn(n)  # raises for an unknown name, at start-up
    self.names, self.weights = names, [float(w) for w in weights]
    self.unscored_value = float(unscored_value)
    self.mode, self.timeout_s, self.chunk_size = mode, float(timeout_s), int(chunk_size)
    self.inline_fns = inline_fns
    modules = sorted({REGISTRY[n].__module__ for n in names if n not in inline_fns})
    self._pool = ProcessPool(workers, modules) if mode == 'process' else None
    self._threads = ThreadPool(workers) if mode == 'thread' else None
    # Inline functions (and every function in mode 'inline') run one at a time
    # in this process, on a thread of their own so that a hung one can time out.
    self._inline = ThreadPool(1, name='reward-inline')
    self.totals = collections.Counter()  # calls, failures, timeouts over the service's life
    self._lock = threading.Lock()

  def _run_tasks(self, tasks):
    """tasks: [(name, prompts, completions, metadata)] -> [(status, payload)]."""
    inline = [i for i, t in enumerate(tasks) if t[0] in self.inline_fns or self.mode == 'inline']
    pooled = [i for i in range(len(tasks)) if i not in set(inline)]
    results = [None] * len(tasks)
    calls = lambda idx: [
      (self.inline_fns.get(tasks[i][0]) or get_reward_fn(tasks[i][0]), tasks[i][1:]) for i in idx
    ]
    if self.mode == 'process' and pooled:
      pool_results = self._pool.run([tasks[i] for i in pooled], self.timeout_s)
      for i, r in zip(pooled, pool_results, strict=True):
        results[i] = r
    elif self.mode == 'thread' and pooled:
      for i, r in zip(pooled, self._threads.run(calls(pooled), self.timeout_s), strict=True):
        results[i] = r
    if inline:
      for i, r in zip(inline, self._inline.run(calls(inline), self.timeout_s), strict=True):
        results[i] = r
    return results

  @property
  def hung_threads(self):
    """Reward threads abandoned after a timeout that have not returned."""
    pools = (self._threads, self._inline)
    return sum(p.hung for p in pools if p is not None)

  def __call__(self, prompts, completions, metadata):
    n = len(completions)
    if not (len(prompts) == n == len(metadata)):
      raise ValueError(
        f'prompts ({len(prompts)}), completions ({n}) and metadata ({len(metadata)}) differ.'
      )
    spans = [(s, min(s + self.chunk_size, n)) for s in range(0, n, self.chunk_size)]
    tasks, owners = [], []
    for name in self.names:
      for s, e in spans:
        tasks.append((name, list(prompts[s:e]), list(completions[s:e]), list(metadata[s:e])))
        owners.append((name, s, e))
    results = self._run_tasks(tasks)

    per_fn = {name: np.full(n, np.nan, np.float32) for name in self.names}
    failures = dict.fromkeys(self.names, 0)
    timeouts = dict.fromkeys(self.names, 0)
    errors = []
    for (name, s, e), (status, payload) in zip(owners, results, strict=True):
      if status == 'ok':
        per_fn[name][s:e] = [np.nan if v is None else v for v in payload]
      elif status == 'timeout':
        timeouts[name] += 1
        errors.append(f'{name}: {payload}')
      else:
        failures[name] += 1
        errors.append(f'{name}: {payload}')
    total = np.zeros(n, np.float32)
    unscored = {}
    for name, weight in zip(self.names, self.weights, strict=True):
      values = per_fn[name]
      unscored[name] = int(np.isnan(values).sum())
      total += weight * np.where(np.isnan(values), self.unscored_value, values)
    with self._lock:
      self.totals['calls'] += 1
      self.totals['failures'] += sum(failures.values())
      self.totals['timeouts'] += sum(timeouts.values())
    return ScoredBatch(total, per_fn, unscored, failures, timeouts, errors[:5])

  def close(self):
    if self._pool is not None:
      self._pool.close()
    if self._threads is not None:
      self._threads.close()
    self._inline.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
