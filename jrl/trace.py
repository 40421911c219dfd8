"""Per-stage traces of a run, in the Chrome / Perfetto trace-event format.

The controller wraps every stage of a step (generate with its prefill and
decode dispatches, reward, reference, update, checkpoint, reshard) in a
`span`; each span becomes one complete ("X") event on the track of the
thread that ran it (`trainer` for the main thread, `rollout` for the
one-step-off generation thread). `Tracer.write` produces a JSON file that
ui.perfetto.dev and chrome://tracing open directly.

`busy` and `bubbles` turn the spans into the idle time of each side of a
step: with a disaggregated or asynchronous topology the rollout devices
wait for the trainer (or the reverse), and that wait is the bubble.

`log.profile_steps` captures a `jax.profiler` trace of chosen iterations
(workdir/profile/, for TensorBoard's profiler or Perfetto), in which every
span appears as an annotation named 'jrl/<stage>'.

Spans time the host: a stage that only dispatches device work and returns
is measured as its dispatch. The stages the controller wraps block on
their results (the sampler reads back every decode dispatch; the update
reads its metrics), so their spans cover the device time.
"""

import contextlib
import json
import os
import threading
import time

import jax

SCHEMA = {
  '$schema': 'https://json-schema.org/draft/2020-12/schema',
  'title': 'Trace Event Format (JSON object form)',
  'type': 'object',
  'required': ['traceEvents'],
  'properties': {
    'traceEvents': {
      'type': 'array',
      'items': {
        'type': 'object',
        'required': ['name', 'ph', 'pid', 'tid'],
        'properties': {
          'name': {'type': 'string'},
          'cat': {'type': 'string'},
          'ph': {'enum': ['X', 'B', 'E', 'i', 'I', 'C', 'M']},
          'ts': {'type': 'number', 'minimum': 0},
          'dur': {'type': 'number', 'minimum': 0},
          'pid': {'type': 'integer'},
          'tid': {'type': 'integer'},
          'args': {'type': 'object'},
        },
        'allOf': [
          {'if': {'properties': {'ph': {'const': 'X'}}}, 'then': {'required': ['ts', 'dur']}},
          {
            'if': {'properties': {'ph': {'const': 'M'}}},
            'then': {
              'required': ['args'],
              'properties': {'args': {'required': ['name']}},
            },
          },
        ],
      },
    },
    'displayTimeUnit': {'enum': ['ms', 'ns']},
    'otherData': {'type': 'object'},
  },
}

# Which device group a stage occupies (for bubbles).
ROLLOUT_STAGES = ('generate', 'reward')
TRAIN_STAGES = ('reference', 'proximal', 'update', 'sft_update')


class Tracer:
  """Collects spans; thread-safe. A disabled tracer records nothing."""

  def __init__(self, enabled=True, pid=0):
    self.enabled = enabled
    self.pid = pid
    self.events = []
    self._tids = {}
    self._lock = threading.Lock()
    self._t0 = time.perf_counter()

  def _tid(self):
    name = threading.current_thread().name
    track = 'trainer' if name == 'MainThread' else name.split('_')[0]
    with self._lock:
      if track not in self._tids:
        self._tids[track] = len(self._tids) + 1
      return self._tids[track]

  def now(self):
    """Seconds since the tracer started."""
    return time.perf_counter() - self._t0

  def add(self, name, start, end, cat='stage', **args):
    """Records a span from `start` to `end` (seconds, as from `now()`)."""
    if not self.enabled:
      return
    event = {
      'name': name,
      'cat': cat,
      'ph': 'X',
      'ts': round(start * 1e6, 3),
      'dur': round(max(0.0, end - start) * 1e6, 3),
      'pid': self.pid,
      'tid': self._tid(),
      'args': args,
    }
    with self._lock:
      self.events.append(event)

  @contextlib.contextmanager
  def span(self, name, cat='stage', **args):
    """Times the body as one span named `name`; while a `jax.profiler` trace
    is being captured (`log.profile_steps`) the span is also a trace
    annotation of that name, so jrl's stages frame XLA's ops there."""
    start = self.now()
    try:
      if self.enabled:
        with jax.profiler.TraceAnnotation(f'jrl/{name}'):
          yield
      else:
        yield
    finally:
      self.add(name, start, self.now(), cat, **args)

  def spans(self, cat=None, names=None, lo=0.0, hi=float('inf')):
    """(name, start s, end s, track) of the spans overlapping [lo, hi]."""
    tracks = {tid: track for track, tid in self._tids.items()}
    out = []
    with self._lock:
      events = list(self.events)
    for e in events:
      start, end = e['ts'] / 1e6, (e['ts'] + e['dur']) / 1e6
      if cat is not None and e['cat'] != cat:
        continue
      if names is not None and e['name'] not in names:
        continue
      if end <= lo or start >= hi:
        continue
      out.append((e['name'], start, end, tracks.get(e['tid'], str(e['tid']))))
    return out

  def busy(self, names, lo, hi):
    """Seconds within [lo, hi] covered by at least one span named in `names`."""
    spans = self.spans(names=names, lo=lo, hi=hi)
    intervals = sorted((max(s, lo), min(e, hi)) for _, s, e, _ in spans)
    total, cur_start, cur_end = 0.0, None, None
    for s, e in intervals:
      if cur_end is None or s > cur_end:
        if cur_end is not None:
          total += cur_end - cur_start
        cur_start, cur_end = s, e
      else:
        cur_end = max(cur_end, e)
    if cur_end is not None:
      total += cur_end - cur_start
    return total

  def bubbles(self, lo, hi):
    """Idle fractions of the rollout and the train side over [lo, hi]."""
    window = max(hi - lo, 1e-9)
    return {
      'time/rollout_idle_frac': 1.0 - self.busy(ROLLOUT_STAGES, lo, hi) / window,
      'time/train_idle_frac': 1.0 - self.busy(TRAIN_STAGES, lo, hi) / window,
    }

  def trace(self, other=None):
    """The trace-event JSON object."""
    with self._lock:
      meta = [
        {'name': 'thread_name', 'ph': 'M', 'pid': self.pid, 'tid': tid, 'args': {'name': track}}
        for track, tid in self._tids.items()
      ]
      name = {'name': f'jrl process {self.pid}'}
      meta.append({'name': 'process_name', 'ph': 'M', 'pid': self.pid, 'tid': 0, 'args': name})
      events = meta + list(self.events)
    return {'traceEvents': events, 'displayTimeUnit': 'ms', 'otherData': other or {}}

  def write(self, path, other=None):
    """Writes the trace atomically (a reader never sees half a file)."""
    if not self.enabled:
      return
    tmp = f'{path}.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump(self.trace(other), f)
    os.replace(tmp, path)


NULL = Tracer(enabled=False)
