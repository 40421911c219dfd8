"""The fixed driver that runs every test case of one program inside one
sandbox start. Standard library only: it is the sandbox's main program
(`python -I main.py`, this file's text), with the model's program beside it
as `solution.py`, and is never imported by jrl.

Its job arrives on stdin, one JSON document; it holds the cases' INPUTS only
(call arguments, or stdin text), never an expected value:

    {"mode": "call" | "stdin" | "asserts",
     "fn": "twoSum", "cls": "Solution" | null,      # call mode
     "cases": [{"args": <tagged>, "kwargs": <tagged>} | {"stdin": "..."}],
     "check": "<test code>", "entry": "candidate",  # asserts mode
     "case_wall_s": 2.0, "case_cpu_s": 2, "deadline_s": 18.0,
     "max_output_bytes": 65536}

For each case the driver forks a child from its own warm interpreter (the
driver never runs the program's code itself); the child puts itself in a
process group of its own, points stdin at the case's input (or /dev/null),
stdout and stderr at /dev/null (call mode) or a pipe to the driver (stdin
mode), closes every other descriptor but its result pipe, sets RLIMIT_CPU
and runs the program. A call-mode child then calls the function and writes
the return value, encoded with tags for the types JSON lacks, to its result
pipe; the driver kills the child's group after `case_wall_s`, when the
output passes `max_output_bytes`, or when it has exited. A case that would
start with less than `case_wall_s` left before `deadline_s` is not started
('not_run'). The driver makes itself non-dumpable, so a child cannot open
its descriptors or memory through /proc, and writes one JSON line per case,
as each ends, to its real stdout, which no child holds, then a last line
{"done": <cases>}:

    {"case": 0, "status": "ok" | "error" | "timeout" | "crash" |
     "output_limit" | "bad_return" | "not_run",
     "value": "<tagged JSON>" | "stdout": "...", "error": "...", "wall": 0.01}

Nothing the program does can produce a pass by itself: the verdict is the
caller's comparison of these values with expected values that never enter
the sandbox (see jrl/rewards/code/README.md). Asserts mode is the exception,
and forgeable: the check runs inside the program's process.
"""

import base64
import builtins
import io
import json
import math
import os
import resource
import select
import signal
import sys
import time

_STATUS_OK = 'ok'
_DICT, _TUPLE, _SET, _FROZENSET, _BYTES, _COMPLEX, _FLOAT = (
  '$d',
  '$t',
  '$s',
  '$fs',
  '$b',
  '$c',
  '$f',
)
_MAX_DEPTH = 100


class _Unencodable(Exception):
  pass


_BASES = (
  (int, int.__int__),
  (float, float.__float__),
  (str, str.__str__),
  (list, lambda v: list(list.__iter__(v))),
  (tuple, lambda v: tuple(tuple.__iter__(v))),
  (dict, lambda v: dict(dict.items(v))),
  (set, lambda v: set(set.__iter__(v))),
  (frozenset, lambda v: frozenset(frozenset.__iter__(v))),
  (bytes, lambda v: bytes(bytes.__iter__(v))),
)
_dumps = json.dumps


def encode(value, depth=0):
  """A JSON-able form of `value` with tags for tuples, sets, dicts, bytes,
  complex and non-finite floats; exact builtin types only, other objects
  through `tolist()` / `item()` (numpy), else _Unencodable."""
  if depth > _MAX_DEPTH:
    raise _Unencodable('nested too deeply')
  t = type(value)
  if value is None or t is bool or t is str:
    return value
  if t is int:
    return value
  if t is float:
    return value if math.isfinite(value) else {_FLOAT: repr(value)}
  if t is list:
    return [encode(v, depth + 1) for v in value]
  if t is tuple:
    return {_TUPLE: [encode(v, depth + 1) for v in value]}
  if t is dict:
    return {_DICT: [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
  if t is set or t is frozenset:
    return {_SET if t is set else _FROZENSET: [encode(v, depth + 1) for v in value]}
  if t is bytes or t is bytearray:
    return {_BYTES: base64.b64encode(bytes(value)).decode('ascii')}
  if t is complex:
    return {_COMPLEX: [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
  for base, plain in _BASES:  # subclasses (type() cannot lie): their builtin contents
    if issubclass(t, base):
      return encode(plain(value), depth + 1)
  for method in ('tolist', 'item'):
    convert = getattr(t, method, None)
    if callable(convert):
      return encode(convert(value), depth + 1)
  raise _Unencodable(f'a {t.__name__!s:.60} is not a plain value')


def decode(value):
  """The inverse of `encode`, for the case arguments."""
  if isinstance(value, list):
    return [decode(v) for v in value]
  if isinstance(value, dict):
    ((tag, body),) = value.items()
    if tag == _TUPLE:
      return tuple(decode(v) for v in body)
    if tag == _DICT:
      return {decode(k): decode(v) for k, v in body}
    if tag == _SET:
      return {decode(v) for v in body}
    if tag == _FROZENSET:
      return frozenset(decode(v) for v in body)
    if tag == _BYTES:
      return base64.b64decode(body)
    if tag == _COMPLEX:
      return complex(decode(body[0]), decode(body[1]))
    if tag == _FLOAT:
      return float(body)
    raise ValueError(f'unknown tag {tag!r}')
  return value


def _nondumpable():
  try:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
  except Exception:
    pass


def _short(exc):
  try:
    text = f'{type(exc).__name__}: {exc}'
  except Exception:
    text = 'an exception whose message could not be read'
  return text[:300]


def _child(code, job, case, result_w, devnull, input_fd, max_fd):
  """Runs in the forked child; never returns."""
  try:
    os.setpgid(0, 0)
    mode = job['mode']
    os.dup2(input_fd if input_fd is not None else devnull, 0)
    os.dup2(result_w if mode == 'stdin' else devnull, 1)
    os.dup2(devnull, 2)
    keep = 1 if mode == 'stdin' else result_w
    for fd in range(3, max_fd):
      if fd != keep:
        try:
          os.close(fd)
        except OSError:
          pass
    cpu = max(1, int(job['case_cpu_s']))
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
      cpu = min(cpu, max(1, hard - 1))
    resource.setrlimit(
      resource.RLIMIT_CPU, (cpu, cpu + 1 if hard == resource.RLIM_INFINITY else min(cpu + 1, hard))
    )
    sys.stdin = io.TextIOWrapper(
      io.FileIO(0, 'r', closefd=False), encoding='utf-8', errors='replace'
    )
    sys.stdout = io.TextIOWrapper(
      io.FileIO(1, 'w', closefd=False), encoding='utf-8', errors='replace'
    )
    sys.stderr = io.TextIOWrapper(
      io.FileIO(2, 'w', closefd=False), encoding='utf-8', errors='replace'
    )
    sys.argv = ['solution.py']
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
  except BaseException:
    os._exit(70)
  write = os.write
  if mode == 'stdin':
    code_ok = 0
    try:
      exec(code, {'__name__': '__main__', '__builtins__': builtins, '__file__': 'solution.py'})
    except SystemExit as e:
      code_ok = 0 if e.code in (None, 0) else 1
    except BaseException:
      code_ok = 1
    try:
      sys.stdout.flush()
    except BaseException:
      code_ok = 1
    os._exit(code_ok)
  try:
    namespace = {'__name__': 'solution', '__builtins__': builtins, '__file__': 'solution.py'}
    exec(code, namespace)
    if mode == 'asserts':
      exec(job['check_code'], namespace)
      namespace['check'](namespace[job['entry']])
      payload = _dumps({'ok': job['token']})
    else:
      cls = namespace.get(job['cls']) if job.get('cls') else None
      if isinstance(cls, type):  # LeetCode style: a method of the class, if defined
        fn = getattr(cls(), job['fn'])
      else:
        fn = namespace[job['fn']]
      value = fn(*decode(case.get('args', [])), **decode(case.get('kwargs', {'$d': []})))
      payload = _dumps({'value': json.dumps(encode(value), allow_nan=False)})
  except SystemExit as e:
    payload = _dumps({'error': f'SystemExit: {e.code!r:.100}'})
  except _Unencodable as e:
    payload = _dumps({'bad_return': str(e)})
  except BaseException as e:
    payload = _dumps({'error': _short(e)})
  data = payload.encode('utf-8', errors='replace')
  try:
    while data:
      data = data[write(result_w, data) :]
  except OSError:
    os._exit(1)
  os._exit(0)


def _read_until(fd, pid, wall_s, cap):
  """Reads `fd` until EOF, `wall_s`, or `cap` bytes; ('done' | 'timeout' |
  'output_limit', bytes, (wait status, CPU seconds) or None)."""
  buf = bytearray()
  stop = time.monotonic() + wall_s
  status = None
  while True:
    left = stop - time.monotonic()
    if left <= 0:
      return 'timeout', bytes(buf), status
    ready, _, _ = select.select([fd], [], [], min(left, 0.05))
    if ready:
      chunk = os.read(fd, 65536)
      if not chunk:
        return 'done', bytes(buf), status
      buf += chunk
      if len(buf) > cap:
        return 'output_limit', bytes(buf[:cap]), status
    elif status is None:
      done, code, usage = os.wait4(pid, os.WNOHANG)
      if done != 0:
        # exited, but a descendant may hold the pipe: drain what is there
        status = (code, usage.ru_utime + usage.ru_stime)
        while len(buf) <= cap and select.select([fd], [], [], 0)[0]:
          chunk = os.read(fd, 65536)
          if not chunk:
            break
          buf += chunk
        return 'done', bytes(buf[:cap]), status


def _kill(pid):
  for target in (-pid, pid):
    try:
      os.kill(target, signal.SIGKILL)
    except OSError:
      pass


def run_case(code, job, case, devnull, max_fd, scratch):
  t0 = time.monotonic()
  input_fd = None
  if job['mode'] == 'stdin':
    input_fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.unlink(scratch)
    data = case['stdin'].encode('utf-8', errors='surrogatepass')
    while data:
      data = data[os.write(input_fd, data) :]
    os.lseek(input_fd, 0, os.SEEK_SET)
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:
    _child(code, job, case, w, devnull, input_fd, max_fd)
  try:
    os.setpgid(pid, pid)
  except OSError:
    pass
  os.close(w)
  if input_fd is not None:
    os.close(input_fd)
  try:
    how, data, status = _read_until(r, pid, float(job['case_wall_s']), int(job['max_output_bytes']))
  finally:
    os.close(r)
    _kill(pid)
  if status is None:
    _, code, usage = os.wait4(pid, 0)
    status = (code, usage.ru_utime + usage.ru_stime)
  status, cpu = status
  wall = round(time.monotonic() - t0, 4)
  if how != 'done':
    return {'status': how, 'wall': wall}
  if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    slow = sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= int(job['case_cpu_s']) - 0.05)
    return {'status': 'timeout' if slow else 'crash', 'signal': sig, 'wall': wall}
  exit_code = os.WEXITSTATUS(status)
  if job['mode'] == 'stdin':
    result = {'status': 'ok' if exit_code == 0 else 'error', 'wall': wall}
    result['stdout'] = data.decode('utf-8', errors='replace')
    return result
  try:
    report = json.loads(data.decode('utf-8'))
    ((key, body),) = report.items()
  except Exception:
    return {'status': 'error', 'error': f'no result (exit {exit_code})', 'wall': wall}
  if key == 'value' and isinstance(body, str):
    return {'status': 'ok', 'value': body, 'wall': wall}
  if key == 'ok':
    return {'status': 'ok' if body == job['token'] else 'error', 'wall': wall}
  if key == 'bad_return':
    return {'status': 'bad_return', 'error': str(body)[:300], 'wall': wall}
  return {'status': 'error', 'error': str(body)[:300], 'wall': wall}


def main():
  out = os.dup(1)
  devnull = os.open(os.devnull, os.O_RDWR)
  raw = b''
  while True:
    chunk = os.read(0, 1 << 20)
    if not chunk:
      break
    raw += chunk
  os.dup2(devnull, 0)
  os.dup2(devnull, 1)
  job = json.loads(raw.decode('utf-8'))
  if job['mode'] == 'asserts':
    job['token'] = base64.b32encode(os.urandom(20)).decode('ascii')
  _nondumpable()
  max_fd = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 4096)
  deadline = time.monotonic() + float(job['deadline_s'])

  def report(i, result):
    result['case'] = i
    os.write(out, json.dumps(result).encode('utf-8') + b'\n')

  try:
    with open('solution.py', encoding='utf-8', errors='surrogatepass') as f:
      code = compile(f.read(), 'solution.py', 'exec', dont_inherit=True)
    if job['mode'] == 'asserts':
      job['check_code'] = compile(job['check'], 'check.py', 'exec', dont_inherit=True)
  except Exception as e:
    for i in range(len(job['cases'])):
      report(i, {'status': 'error', 'error': _short(e), 'wall': 0.0})
  else:
    scratch = os.path.join(os.getcwd(), '.case_input')
    for i, case in enumerate(job['cases']):
      if time.monotonic() + float(job['case_wall_s']) > deadline:
        report(i, {'status': 'not_run'})
      else:
        report(i, run_case(code, job, case, devnull, max_fd, scratch))
  os.write(out, json.dumps({'done': len(job['cases'])}).encode('utf-8') + b'\n')


if __name__ == '__main__':
  main()
