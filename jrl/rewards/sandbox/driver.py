"""The fixed driver that runs every test case of one program inside one
sandbox start. Standard library only: `sandbox.run_driver` runs its `main`,
loaded in the warm zygote (or as the sandbox's main program, `python -I
main.py`, this file's text, where there is no zygote), with the model's
program beside it as `solution.py`; jrl itself never imports it.

Its job arrives on stdin, one JSON document; it holds the cases' INPUTS only
(call arguments, or stdin text), never an expected value:

    {"mode": "call" | "stdin" | "asserts",
     "fn": "twoSum", "cls": "Solution" | null,      # call mode
     "cases": [{"args": <tagged>, "kwargs": <tagged>} | {"stdin": "..."}],
     "check": "<test code>", "entry": "candidate",  # asserts mode
     "fresh_process_per_case": false,               # call mode
     "case_wall_s": 2.0, "case_cpu_s": 2, "deadline_s": 18.0, "share_s": 6.0,
     "max_output_bytes": 65536}

The driver never runs the program's code itself: it forks children from its
own warm interpreter (in a zygote run, the zygote's: see sandbox/README.md).
A stdin case gets a child of its own; call-mode cases run one after another
in one child (each call on a fresh instance, for a class), or one child per
case with "fresh_process_per_case": true, and after a case that timed out,
crashed or passed the output cap the next cases run in a fresh child. A
child puts itself in a process group of its own, points stdin at the case's
input (or /dev/null), stdout and stderr at /dev/null (call mode) or a pipe
to the driver (stdin mode), closes every other descriptor but its result
pipe, sets RLIMIT_CPU and runs the program. A call-mode child then calls the
function and writes the return value, encoded with tags for the types JSON
lacks, as one line per case to its result pipe; the driver kills the
child's group when a case passes `case_wall_s`, when its output passes
`max_output_bytes`, or when it has done.

The asserts case runs in two children: the program in one, a fresh
interpreter (`main.py --serve`: nothing of the job is in its memory), which
answers calls of the names it defines as call-mode cases (`serve`); the
check code in the other, forked from the driver (it never ran a line of the
program), where each name the program defines at its top level is a stub
that calls it over a pipe with plain, encoded values (`_check_client`).
Only the check's process holds the pipe the verdict comes back on, and it
writes {"ok": true} when `check(candidate)` returns; a value report is
never a pass in asserts mode, nor an "ok" in call mode.

A case after the first that would start with less than `case_wall_s` left
before `deadline_s`, or, once one of the program's cases timed out, before
`share_s` (its share of the caller's budget), is not started ('not_run');
the first always starts
(the caller gave the run time for one case beyond the driver's start, which
a loaded machine can slow past the slack). With "stop_at_failure": true
(the caller scores 'all'), the cases after one that failed here (an error,
a timeout, a crash, the output cap, an unencodable return) are not started
('skipped'): the program's score is already fixed. The driver makes itself
non-dumpable, so a child cannot trace another or open its descriptors or
memory through /proc, and writes to its real stdout, which no child holds,
a line {"start": i} as case i starts and one JSON line per case as it
ends, then a last line {"done": <cases>}; so the caller tells a case that
started and never ended (a driver stopped or killed by the program) from
one never started:

    {"case": 0, "status": "ok" | "error" | "timeout" | "crash" |
     "output_limit" | "bad_return" | "not_run" | "skipped",
     "value": "<tagged JSON>" | "stdout": "...", "error": "...", "wall": 0.01}

Nothing the program does can produce a pass by itself: the verdict is the
caller's comparison (jrl/rewards/code/compare.py) with expected values that
never enter the sandbox, or, in asserts mode, the check's own process
returning; the check's expected values reach that process and the driver,
never the program's. A program can make its check fail (end or stop its
processes, the driver included), never pass.
"""

import ast
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
_DICT, _TUPLE, _SET, _FROZENSET, _BYTES, _COMPLEX, _FLOAT = '$d $t $s $fs $b $c $f'.split()
_MAX_DEPTH = 100


class _Unencodable(Exception):
  pass  # deliberate: a marker exception


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
  if value is None or t is bool or t is str or t is int:
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


def _setup_child(job, result_w, devnull, input_fd, max_fd, cpu_s, keep=None):
  """The forked child's own process group, descriptors (all closed but the
  streams and `keep`, default the result pipe), CPU limit and streams."""
  os.setpgid(0, 0)
  mode = job['mode']
  os.dup2(input_fd if input_fd is not None else devnull, 0)
  os.dup2(result_w if mode == 'stdin' else devnull, 1)
  os.dup2(devnull, 2)
  if keep is None:
    keep = () if mode == 'stdin' else (result_w,)
  for fd in range(3, max_fd):
    if fd not in keep:
      try:
        os.close(fd)
      except OSError:
        pass
  cpu = max(1, int(cpu_s))
  hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
  if hard != resource.RLIM_INFINITY:
    cpu = min(cpu, max(1, hard - 1))
  resource.setrlimit(
    resource.RLIMIT_CPU, (cpu, cpu + 1 if hard == resource.RLIM_INFINITY else min(cpu + 1, hard))
  )
  sys.stdin = io.TextIOWrapper(io.FileIO(0, 'r', closefd=False), encoding='utf-8', errors='replace')
  sys.stdout = io.TextIOWrapper(
    io.FileIO(1, 'w', closefd=False), encoding='utf-8', errors='replace'
  )
  sys.stderr = io.TextIOWrapper(
    io.FileIO(2, 'w', closefd=False), encoding='utf-8', errors='replace'
  )
  sys.argv = ['solution.py']
  signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def _write_all(fd, data):
  try:
    while data:
      data = data[os.write(fd, data) :]
  except OSError:
    os._exit(1)


def _child(code, job, result_w, devnull, input_fd, max_fd):
  """A stdin case, in the forked child; never returns."""
  try:
    _setup_child(job, result_w, devnull, input_fd, max_fd, job['case_cpu_s'])
  except BaseException:
    os._exit(70)
  code_ok = 0
  try:
    main = {'__name__': '__main__', '__builtins__': builtins, '__file__': 'solution.py'}
    exec(code, main)  # deliberate: inside the sandbox
  except SystemExit as e:
    code_ok = 0 if e.code in (None, 0) else 1
  except BaseException:
    code_ok = 1
  try:
    sys.stdout.flush()
  except BaseException:
    code_ok = 1
  os._exit(code_ok)


def _call_payload(call, case):
  """One call's result line: its encoded value, or what went wrong."""
  try:
    value = call(*decode(case.get('args', [])), **decode(case.get('kwargs', {'$d': []})))
    return _dumps({'value': json.dumps(encode(value), allow_nan=False)})
  except SystemExit as e:
    return _dumps({'error': f'SystemExit: {e.code!r:.100}'})
  except _Unencodable as e:
    return _dumps({'bad_return': str(e)})
  except BaseException as e:
    return _dumps({'error': _short(e)})


def _program_server(job, req_r, resp_w, devnull, max_fd):
  """Asserts mode, the program's side (forked child; never returns): a
  fresh interpreter (`python -I main.py --serve`, main.py being this file)
  so that nothing of the job, the check's expected values included, is in
  the program's memory; `serve` runs there."""
  try:
    _setup_child(job, resp_w, devnull, None, max_fd, job['case_cpu_s'], keep=(req_r, resp_w))
    for fd in (req_r, resp_w):
      os.set_inheritable(fd, True)
    main_py = os.path.abspath('main.py')
    os.execv(sys.executable, [sys.executable, '-I', main_py, '--serve', str(req_r), str(resp_w)])
  except BaseException:
    os._exit(70)


def serve(req_r, resp_w):
  """`main.py --serve`: runs solution.py, then answers each request line
  {"name", "args", "kwargs"} from the check's process with one result line,
  as a call-mode case; ends when the requests do."""
  sys.argv = ['solution.py']
  try:
    with open('solution.py', encoding='utf-8', errors='surrogatepass') as f:
      code = compile(f.read(), 'solution.py', 'exec', dont_inherit=True)
    namespace = {'__name__': 'solution', '__builtins__': builtins, '__file__': 'solution.py'}
    exec(code, namespace)  # deliberate: inside the sandbox
  except BaseException:
    os._exit(1)  # the check sees the pipe close: its call fails
  requests = open(req_r, 'rb', closefd=False)
  for line in requests:
    try:
      request = json.loads(line)
      fn = namespace[request['name']]
    except BaseException as e:
      payload = _dumps({'error': _short(e)})
    else:
      payload = _call_payload(fn, request)
    _write_all(resp_w, (payload + '\n').encode('utf-8', errors='replace'))
  os._exit(0)


def _check_client(job, names, req_w, resp_r, result_w, devnull, max_fd):
  """Asserts mode, the check's side (forked child; never returns): runs the
  check code in a process the program never ran in, every name the program
  defines (`names`) a stub that calls it in the program's process with
  plain values; writes {"ok": true} when `check(candidate)` returns."""
  try:
    keep = (req_w, resp_r, result_w)
    _setup_child(job, result_w, devnull, None, max_fd, job['case_cpu_s'], keep=keep)
  except BaseException:
    os._exit(70)
  replies = open(resp_r, 'rb', closefd=False)

  def stub(name):
    def call(*args, **kwargs):
      request = {'name': name, 'args': encode(list(args)), 'kwargs': encode(dict(kwargs))}
      _write_all(req_w, (_dumps(request) + '\n').encode('utf-8'))
      line = replies.readline()
      if not line:
        raise RuntimeError(f'the program ended during a call of {name}')
      reply = json.loads(line)
      if 'value' in reply:
        return decode(json.loads(reply['value']))
      raise RuntimeError(f'{name}: {reply.get("error") or reply.get("bad_return")}'[:300])

    return call

  try:
    namespace = {'__name__': 'check', '__builtins__': builtins}
    namespace.update({name: stub(name) for name in names})
    exec(job['check_code'], namespace)  # deliberate: inside the sandbox
    namespace['check'](namespace[job['entry']])
    payload = _dumps({'ok': True})
  except SystemExit as e:
    payload = _dumps({'error': f'SystemExit: {e.code!r:.100}'})
  except BaseException as e:
    payload = _dumps({'error': _short(e)})
  _write_all(result_w, payload.encode('utf-8', errors='replace'))
  os._exit(0)


def defined_names(source, entry):
  """The names the program defines at its top level (functions, classes,
  assignments), read without running it; `entry` always."""
  names = {entry}
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return names
  for node in tree.body:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
  return names


def _call_child(code, job, cases, result_w, devnull, max_fd):
  """Call-mode cases, one after another in the forked child, one result line
  each on `result_w`; never returns."""
  try:
    _setup_child(job, result_w, devnull, None, max_fd, len(cases) * job['case_cpu_s'])
  except BaseException:
    os._exit(70)
  try:
    namespace = {'__name__': 'solution', '__builtins__': builtins, '__file__': 'solution.py'}
    exec(code, namespace)  # deliberate: inside the sandbox
    cls = namespace.get(job['cls']) if job.get('cls') else None
    fn = None if isinstance(cls, type) else namespace[job['fn']]
  except BaseException as e:
    error = _dumps({'error': _short(e)}) + '\n'
    _write_all(result_w, error.encode('utf-8', errors='replace') * len(cases))
    os._exit(0)
  for case in cases:
    try:  # LeetCode style: a method of a fresh instance of the class, if defined
      call = getattr(cls(), job['fn']) if fn is None else fn
    except BaseException as e:
      payload = _dumps({'error': _short(e)})
    else:
      payload = _call_payload(call, case)
    _write_all(result_w, (payload + '\n').encode('utf-8', errors='replace'))
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


def _slow(status, cpu, cpu_s):
  """Whether a process that ended with wait `status` after `cpu` seconds hit its CPU limit."""
  sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
  return sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= int(cpu_s) - 0.05)


def _ended(pid, cpu_s):
  """Kills `pid`'s group and reaps it: (wait status, whether it hit its CPU limit)."""
  _kill(pid)
  _, status, usage = os.wait4(pid, 0)
  return status, _slow(status, usage.ru_utime + usage.ru_stime, cpu_s)


def _died(status, slow, wall):
  """The result of a case whose process ended without a result."""
  if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    return {'status': 'timeout' if slow else 'crash', 'signal': sig, 'wall': wall}
  return {'status': 'error', 'error': f'no result (exit {os.WEXITSTATUS(status)})', 'wall': wall}


def _result(job, data, wall):
  """A case's result from the line its process wrote."""
  try:
    report = json.loads(data.decode('utf-8'))
    ((key, body),) = report.items()
  except Exception:
    return {'status': 'error', 'error': 'an unreadable result', 'wall': wall}
  asserts = job['mode'] == 'asserts'
  if key == 'value' and isinstance(body, str) and not asserts:
    return {'status': 'ok', 'value': body, 'wall': wall}
  if key == 'ok' and body is True and asserts:  # written by the check's own process only
    return {'status': 'ok', 'wall': wall}
  if key in ('value', 'ok'):
    return {'status': 'error', 'error': f'a {key!r} report in {job["mode"]} mode', 'wall': wall}
  if key == 'bad_return':
    return {'status': 'bad_return', 'error': str(body)[:300], 'wall': wall}
  return {'status': 'error', 'error': str(body)[:300], 'wall': wall}


def _fork(target, *args):
  """Forks a child that runs `target(*args)` (which never returns); its pid."""
  pid = os.fork()
  if pid == 0:
    target(*args)
    os._exit(70)  # deliberate: targets end with os._exit; this is never reached
  try:
    os.setpgid(pid, pid)
  except OSError:
    pass
  return pid


def run_asserts(job, devnull, max_fd, names):
  """The asserts case: the program in one child, the check in another that
  calls it over pipes (`_program_server`, `_check_client`); the verdict is
  what the check's process reports, the program's process never holds the
  descriptor it reports on."""
  t0 = time.monotonic()
  req_r, req_w = os.pipe()
  resp_r, resp_w = os.pipe()
  program = _fork(_program_server, job, req_r, resp_w, devnull, max_fd)
  r, w = os.pipe()  # made after the program's fork: it never had it
  check = _fork(_check_client, job, names, req_w, resp_r, w, devnull, max_fd)
  for fd in (req_r, req_w, resp_r, resp_w, w):
    os.close(fd)
  try:
    how, data, status = _read_until(r, check, float(job['case_wall_s']), 1 << 16)
  finally:
    os.close(r)
  _ended(program, job['case_cpu_s'])
  if status is None:
    status, slow = _ended(check, job['case_cpu_s'])
  else:
    _kill(check)
    status, slow = status[0], _slow(*status, job['case_cpu_s'])
  wall = round(time.monotonic() - t0, 4)
  if how != 'done':
    return {'status': how, 'wall': wall}
  if os.WIFSIGNALED(status) or not data:
    return _died(status, slow, wall)
  return _result(job, data, wall)


def run_case(code, job, case, devnull, max_fd, scratch):
  """A stdin case in a fresh child of its own."""
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
    _child(code, job, w, devnull, input_fd, max_fd)
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
  if status is None:
    status, slow = _ended(pid, job['case_cpu_s'])
  else:
    _kill(pid)  # its descendants
    status, slow = status[0], _slow(*status, job['case_cpu_s'])
  wall = round(time.monotonic() - t0, 4)
  if how != 'done':
    return {'status': how, 'wall': wall}
  if os.WIFSIGNALED(status):
    return _died(status, slow, wall)
  if job['mode'] == 'stdin':
    result = {'status': 'ok' if os.WEXITSTATUS(status) == 0 else 'error', 'wall': wall}
    result['stdout'] = data.decode('utf-8', errors='replace')
    return result
  if not data:
    return _died(status, slow, wall)
  return _result(job, data, wall)


def _read_line(fd, buf, wall_s, cap):
  """('line', line, rest) | ('eof' | 'timeout' | 'output_limit', None, buf):
  the next line of `fd` after `buf` (bytes already read) within `wall_s`."""
  stop = time.monotonic() + wall_s
  while True:
    end = buf.find(b'\n')
    if end >= 0:
      if end > cap:
        return 'output_limit', None, buf
      return 'line', buf[:end], buf[end + 1 :]
    if len(buf) > cap:
      return 'output_limit', None, buf
    left = stop - time.monotonic()
    if left <= 0:
      return 'timeout', None, buf
    if select.select([fd], [], [], left)[0]:
      chunk = os.read(fd, 65536)
      if not chunk:
        return 'eof', None, buf
      buf += chunk


FAILURES = ('error', 'timeout', 'crash', 'output_limit', 'bad_return')


def run_calls(code, job, devnull, max_fd, cutoff, report, started):
  """Call-mode cases: one child runs them one after another (each call on a
  fresh instance, for a class), each under its own wall limit; a case that
  times out, crashes or exceeds the output cap ends that child, and a fresh
  one runs the cases after it. `job['fresh_process_per_case']`: a child per
  case. Cases after the first that would start with less than their limit
  left before `cutoff()` are 'not_run'; with `job['stop_at_failure']`, the
  cases after one that failed here (an error, a timeout, ...) are
  'skipped'."""
  cases = job['cases']
  wall_s, cap = float(job['case_wall_s']), int(job['max_output_bytes'])
  failed = False

  def ended(i, result):
    nonlocal failed
    report(i, result)
    failed = bool(job.get('stop_at_failure')) and result['status'] in FAILURES

  i = 0
  while i < len(cases):
    if failed:
      report(i, {'status': 'skipped'})
      i += 1
      continue
    if i and time.monotonic() + wall_s > cutoff():
      report(i, {'status': 'not_run'})
      i += 1
      continue
    batch = 1 if job.get('fresh_process_per_case') else len(cases) - i
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
      _call_child(code, job, cases[i : i + batch], w, devnull, max_fd)
    try:
      os.setpgid(pid, pid)
    except OSError:
      pass
    os.close(w)
    buf, end = b'', i + batch
    try:
      while i < end:
        started(i)
        t0 = time.monotonic()
        how, line, buf = _read_line(r, buf, wall_s, cap)
        wall = round(time.monotonic() - t0, 4)
        if how != 'line':
          status, slow = _ended(pid, job['case_cpu_s'])
          pid = None
          ended(i, {'status': how, 'wall': wall} if how != 'eof' else _died(status, slow, wall))
          i += 1
          break
        ended(i, _result(job, line, wall))
        i += 1
        if failed or (i < end and time.monotonic() + wall_s > cutoff()):
          break  # the rest are skipped, or not run
    finally:
      os.close(r)
      if pid is not None:
        _ended(pid, job['case_cpu_s'])


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
  _nondumpable()
  max_fd = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 4096)
  t0 = time.monotonic()
  deadline = t0 + float(job['deadline_s'])
  # Once one of its cases timed out, the program starts no case past its
  # share of the caller's budget (`share_s`): a slow program is cut there.
  share = t0 + float(job.get('share_s', job['deadline_s']))
  slow = []

  def cutoff():
    return min(deadline, share) if slow else deadline

  def report(i, result):
    result['case'] = i
    if result.get('status') == 'timeout':
      slow.append(i)
    os.write(out, json.dumps(result).encode('utf-8') + b'\n')

  def started(i):  # the caller tells a case that never ended from one never started
    os.write(out, json.dumps({'start': i}).encode('utf-8') + b'\n')

  try:
    with open('solution.py', encoding='utf-8', errors='surrogatepass') as f:
      source = f.read()
    code = compile(source, 'solution.py', 'exec', dont_inherit=True)
    if job['mode'] == 'asserts':
      job['check_code'] = compile(job['check'], 'check.py', 'exec', dont_inherit=True)
      names = defined_names(source, job['entry'])
  except Exception as e:
    for i in range(len(job['cases'])):
      report(i, {'status': 'error', 'error': _short(e), 'wall': 0.0})
  else:
    scratch = os.path.join(os.getcwd(), '.case_input')
    if job['mode'] == 'call':
      run_calls(code, job, devnull, max_fd, cutoff, report, started)
    else:
      failed = False
      for i, case in enumerate(job['cases']):
        if failed:
          report(i, {'status': 'skipped'})
        elif i and time.monotonic() + float(job['case_wall_s']) > cutoff():
          report(i, {'status': 'not_run'})
        else:
          started(i)
          if job['mode'] == 'asserts':
            result = run_asserts(job, devnull, max_fd, names)
          else:
            result = run_case(code, job, case, devnull, max_fd, scratch)
          report(i, result)
          failed = bool(job.get('stop_at_failure')) and result['status'] in FAILURES
  os.write(out, json.dumps({'done': len(job['cases'])}).encode('utf-8') + b'\n')


if __name__ == '__main__':
  if sys.argv[1:2] == ['--serve']:
    serve(int(sys.argv[2]), int(sys.argv[3]))
  else:
    main()
