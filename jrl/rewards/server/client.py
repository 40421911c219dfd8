"""The client of a reward server: `RemoteRewardService`, with the interface
of `RewardService`. Nothing it meets (a server that is down, slow, answering
garbage, wrong lengths or NaN) is raised into the caller: what it could not
score is unscored and counted. See README.md beside this file."""

import http.client
import json
import math
import time
import urllib.parse

import numpy as np

from jrl.rewards.base import ScoredBatch
from jrl.rewards.server.validation import type_name

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
    length = len(values) if isinstance(values, list) else type_name(values)
    raise ValueError(f'{field!r} must be a list of {n} numbers or nulls, got {length}')
  out = np.full(n, np.nan, np.float32)
  for i, v in enumerate(values):
    if v is None:
      continue
    if isinstance(v, bool) or not isinstance(v, int | float):
      raise ValueError(f'{field!r} item {i} is {type_name(v)}, not a number or null')
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
      raise ValueError(f'answer must be a JSON object, not {type_name(payload)}')
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
    pass  # deliberate: a remote service holds nothing to release

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _jsonable(value):
  """json.dumps fallback for numpy values in metadata."""
  if isinstance(value, np.generic | np.ndarray):
    return value.tolist()
  raise TypeError(f'{type(value).__name__} is not JSON serialisable')
