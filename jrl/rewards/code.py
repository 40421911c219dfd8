"""Code-execution reward: run the completion's program on test cases.

    @register('code_tests')  metadata['tests'] = [{'input': '1 2\\n', 'output': '3\\n'}, ...]

`extract_code` takes the last ```python fenced block of a completion (also
```py / ```python3), else the whole text. `score_program` runs the program
once per test case in `jrl.rewards.sandbox` (stdin = the test's input) and
returns the fraction of cases whose stdout matches the expected output, both
compared after stripping trailing whitespace on every line and trailing
blank lines (the convention of most judges; veRL's prime_code and TACO
compare the same way). A run that fails in any way (error, timeout, memory,
output limit, signal) fails its case. A failure of the sandbox itself is
raised, since it says nothing about the program: the reward service then
counts the completion as unscored and reports the message.

Per-example limits may be given as metadata['limits'] = {'wall_seconds': 2,
...} (fields of `sandbox.Limits`).

Time. The reward service gives a chunk of completions one deadline
(`reward.timeout_s`, 30 s by default); a chunk that misses it is unscored as
a whole. So `code_tests` runs the programs of a call concurrently, at most
`concurrency` at a time (JRL_CODE_TESTS_CONCURRENCY; default 2 per CPU, 4 to
16), and gives each program a share of a budget for the whole call
(JRL_CODE_TESTS_BUDGET_S, default 20 s; keep it a few seconds below
`reward.timeout_s`): budget / waves - 0.5 s, where waves = ceil(programs /
concurrency). A program's cases run in order, each under
min(limits.wall_seconds, what is left of its share); cases it has no time
left for fail. So the call ends within about the budget whatever the
programs do, and a slow program scores 0 on the cases it did not finish
(a score, not "unscored": being slow is the program's doing), while its
neighbours are scored as if it were not there.

Isolation. `check_sandbox` refuses (raises `SandboxUnavailableError`, naming
what is missing and the switch) when the sandbox's isolation level is below
'no_cgroup', i.e. a namespace or the uid drop is missing and a program could
read its own hidden tests or reach the trainer; `code_tests` calls it first
on every call, and the trainer at start-up. `reward.sandbox_unsafe=True`
(which sets JRL_SANDBOX_UNSAFE=1 for the reward workers) runs programs
anyway; the level is logged and `sandbox.isolation_metric()` reports it.
"""

import dataclasses
import json
import logging
import math
import os
import re
import time
from concurrent import futures

from jrl.rewards import sandbox
from jrl.rewards.base import register
from jrl.rewards.sandbox import Limits, run_program

UNSAFE_ENV = 'JRL_SANDBOX_UNSAFE'  # '1': run programs in a degraded sandbox
BUDGET_ENV = 'JRL_CODE_TESTS_BUDGET_S'  # seconds for one call of code_tests
CONCURRENCY_ENV = 'JRL_CODE_TESTS_CONCURRENCY'  # programs run at once
DEFAULT_BUDGET_S = 20.0  # below the reward service's default timeout_s (30 s)
SAFE_LEVELS = ('full', 'no_cgroup')
_RUN_OVERHEAD_S = 0.5  # per program: sandbox start-up and clean-up beyond the wall clock
_MIN_RUN_S = 0.2  # a case with less time left than this is not started (it fails)

_FENCE = re.compile(r'```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```', re.DOTALL | re.IGNORECASE)
_log = logging.getLogger(__name__)
_warned = set()


class SandboxUnavailableError(RuntimeError):
  """The sandbox may not run model-written programs here (see `check_sandbox`)."""


def _env_flag(name):
  return os.environ.get(name, '').strip().lower() not in ('', '0', 'false', 'no')


def check_sandbox(unsafe=None):
  """The sandbox's isolation level, if `code_tests` may run programs; else raises.

  Args:
    unsafe: run programs even in a 'degraded' sandbox (None: the
      JRL_SANDBOX_UNSAFE environment variable).
  Returns:
    `sandbox.isolation_level()`: 'full' | 'no_cgroup' | 'degraded'.
  Raises:
    SandboxUnavailableError: the sandbox is 'broken', or 'degraded' and not `unsafe`.
  """
  unsafe = _env_flag(UNSAFE_ENV) if unsafe is None else bool(unsafe)
  caps = sandbox.capabilities()
  level = caps['isolation']
  if level == 'broken':
    raise SandboxUnavailableError(f'the code sandbox cannot run programs here: {caps["self_test"]}')
  if level in SAFE_LEVELS:
    return level
  unprivileged = caps['uid_drop'] or caps['user_namespace']
  missing = [
    name
    for name, ok in [
      ('a mount namespace (new root)', caps['mount_namespace']),
      ('a PID namespace with a private /proc', caps['private_proc']),
      ('a network namespace', caps['network_namespace']),
      ('an IPC namespace', caps['ipc_namespace']),
      ('an unprivileged uid (uid drop or user namespace)', unprivileged),
    ]
    if not ok
  ]
  if not unsafe:
    raise SandboxUnavailableError(
      f'code_tests refuses to run model-written programs: the sandbox is {level!r} here, '
      f'missing {", ".join(missing)}, so a program could read its hidden tests, reach the '
      'network or signal the trainer. Run where namespaces are allowed (root, or unprivileged '
      'user namespaces), or set reward.sandbox_unsafe=True (JRL_SANDBOX_UNSAFE=1) to run them '
      f'anyway. Sandbox notes: {"; ".join(caps["notes"])}'
    )
  if level not in _warned:
    _warned.add(level)
    _log.warning('code_tests runs programs in a %r sandbox (UNSAFE), missing %s', level, missing)
  return level


def configure_sandbox(unsafe):
  """At start-up: records `unsafe` for the reward workers (JRL_SANDBOX_UNSAFE,
  inherited by processes started later), checks and logs the isolation level.

  Returns the level (see `check_sandbox`); raises SandboxUnavailableError.
  """
  if unsafe:
    os.environ[UNSAFE_ENV] = '1'
  else:
    os.environ.pop(UNSAFE_ENV, None)
  level = check_sandbox(unsafe)
  _log.info('code_tests: sandbox isolation %r (metric %d)', level, sandbox.isolation_metric())
  return level


def extract_code(completion):
  """The last ```python block of `completion`, else the whole text; None if empty."""
  blocks = _FENCE.findall(completion)
  code = blocks[-1] if blocks else completion
  return code if code.strip() else None


def normalize_output(text):
  """Trailing whitespace stripped from every line, trailing blank lines dropped."""
  lines = [line.rstrip() for line in text.replace('\r\n', '\n').split('\n')]
  while lines and not lines[-1]:
    lines.pop()
  return '\n'.join(lines)


def score_program(source, tests, *, limits=None, budget_s=None):
  """The fraction of `tests` ([{'input': str, 'output': str}]) that `source`
  passes, each run under `limits` (default `sandbox.Limits()`), all of them
  within `budget_s` seconds (None: no bound but the limits); cases left
  without time fail."""
  limits = Limits() if limits is None else limits
  tests = _parse_tests(tests)
  stop = None if budget_s is None else time.monotonic() + float(budget_s)
  passed = 0
  for i, case in enumerate(tests):
    run_limits = limits
    if stop is not None:
      left = stop - time.monotonic()
      if left < _MIN_RUN_S:
        break
      run_limits = dataclasses.replace(
        limits,
        wall_seconds=min(float(limits.wall_seconds), left),
        cpu_seconds=max(1, min(int(limits.cpu_seconds), math.ceil(left))),
      )
    result = run_program(source, str(case['input']), limits=run_limits)
    if result.status == 'sandbox_error':
      raise RuntimeError(f'sandbox failed on test {i}: {result.stderr[:2000]}')
    if result.status == 'ok' and normalize_output(result.stdout) == normalize_output(
      str(case['output'])
    ):
      passed += 1
  return passed / len(tests)


def _parse_tests(tests):
  if isinstance(tests, str):
    tests = json.loads(tests)
  if isinstance(tests, dict) and 'inputs' in tests:  # APPS / TACO layout
    pairs = zip(tests['inputs'], tests['outputs'], strict=True)
    tests = [{'input': i, 'output': o} for i, o in pairs]
  tests = list(tests)
  if not tests:
    raise ValueError("metadata['tests'] is empty: nothing to score the program against.")
  for i, case in enumerate(tests):
    if not isinstance(case, dict) or 'input' not in case or 'output' not in case:
      raise ValueError(
        f"metadata['tests'][{i}] must be {{'input': str, 'output': str}}, got {case!r}"
      )
  return tests


def _budget_s():
  return float(os.environ.get(BUDGET_ENV, DEFAULT_BUDGET_S))


def _concurrency():
  if os.environ.get(CONCURRENCY_ENV):
    return max(1, int(os.environ[CONCURRENCY_ENV]))
  return min(16, max(4, 2 * (os.cpu_count() or 1)))


def score_programs(sources, tests, limits, *, budget_s, concurrency):
  """`score_program` for each (source, tests, limits), at most `concurrency`
  at a time, all within about `budget_s` seconds (see the module docstring)."""
  n = len(sources)
  if n == 0:
    return []
  concurrency = max(1, min(int(concurrency), n))
  waves = math.ceil(n / concurrency)
  share = max(_MIN_RUN_S, float(budget_s) / waves - _RUN_OVERHEAD_S)
  with futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
    jobs = [
      pool.submit(score_program, s, t, limits=lim, budget_s=share)
      for s, t, lim in zip(sources, tests, limits, strict=True)
    ]
    return [job.result() for job in jobs]


@register('code_tests')
def code_tests(prompts, completions, metadata):
  """Fraction of metadata['tests'] passed by the completion's program; None
  when the completion holds no code. Raises SandboxUnavailableError where the
  sandbox is not isolated (see `check_sandbox`)."""
  del prompts
  check_sandbox()
  index, sources, tests, limits = [], [], [], []
  for i, (completion, meta) in enumerate(zip(completions, metadata, strict=True)):
    code = extract_code(completion)
    if code is not None:
      index.append(i)
      sources.append(code)
      tests.append(_parse_tests(meta['tests']))
      limits.append(Limits(**meta.get('limits', {})))
  scores = [None] * len(completions)
  found = score_programs(sources, tests, limits, budget_s=_budget_s(), concurrency=_concurrency())
  for i, score in zip(index, found, strict=True):
    scores[i] = score
  return scores
