"""Code-execution reward: run the completion's program on a data set's tests.

    @register('code_tests')   # metadata: the row's tests, in any layout of formats.py

`extract_code` takes the last ```python fenced block of a completion (also
```py / ```python3), else the whole text. The row's tests are read by
`formats.parse` (the layout named by `reward.code.format`, or detected from
the row's fields): stdin/stdout pairs, call-based cases, or assert code.
`judge.run_tests` runs the program once in `jrl.rewards.sandbox`, under a fixed
driver that forks children for its cases (one per stdin case; one for a
program's call cases, or one each with `reward.code.fresh_process_per_case`),
each case under its own limit, and judges what each case printed
or returned here, outside the sandbox, against expected values that never
enter it. The score is the fraction of cases passed (`reward.code.score =
'fraction'`) or 1.0 only if all pass ('all').

Call-based rows (and HumanEval / MBPP asserts, converted): a completion that
does not itself define the function under test is appended to the row's
prefix (HumanEval's prompt), as HumanEval's harness runs it.

Time. The reward service gives a chunk of completions one deadline
(`reward.timeout_s`). `code_tests` runs the programs of a call concurrently
(`reward.code.concurrency`; 0: 2 per CPU, 4 to 16) within
`reward.code.budget_s` for the whole call (at most 90% of what the service's
deadline leaves the chunk, `rewards.base.time_left()`); each case runs under its own
limit (`reward.code.case_wall_s`, else the row's `limits` or
`sandbox.Limits`). A case that would start with less than its limit left is
not run, and its program is unscored (None: counted by the service), never
scored 0.0 for the budget's sake; a program whose own cases timed out scores
them as failed.

Isolation. Every run goes through `sandbox.require_isolation`, which refuses
(raises `SandboxUnavailableError`, naming what is missing and the switch)
where the sandbox's isolation level is below 'no_cgroup', unless
`reward.sandbox_unsafe=True` (JRL_SANDBOX_UNSAFE=1 for the reward workers).
The guarantees of each mode are in README.md beside this file.
"""

import dataclasses
import json
import logging
import math
import os
import re
import threading
import time
from concurrent import futures

from jrl.rewards import sandbox
from jrl.rewards.base import register, time_left
from jrl.rewards.code import formats
from jrl.rewards.code.cases import normalize_output
from jrl.rewards.code.judge import SCORES, Verdict, run_tests
from jrl.rewards.sandbox import (
  SAFE_LEVELS,
  UNSAFE_ENV,
  Limits,
  SandboxUnavailableError,
)

__all__ = [
  'SAFE_LEVELS',
  'SETTINGS_ENV',
  'UNSAFE_ENV',
  'SandboxUnavailableError',
  'Settings',
  'Verdict',
  'check_sandbox',
  'code_tests',
  'configure_sandbox',
  'extract_code',
  'normalize_output',
  'program_source',
  'run_tests',
  'score_program',
  'score_programs',
]

SETTINGS_ENV = 'JRL_CODE_TESTS'  # the reward.code settings, as JSON, for the reward workers
_FENCE = re.compile(r'```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```', re.DOTALL | re.IGNORECASE)
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Settings:
  """`reward.code`: how `code_tests` reads rows and spends its time."""

  format: str = 'auto'  # formats.FORMATS; 'auto': detected from each row's fields
  asserts: str = 'refuse'  # assert tests that do not convert: 'refuse' | 'in_program'
  score: str = 'fraction'  # 'fraction' of cases passed | 'all' (1.0 only if all pass)
  budget_s: float = 20.0  # one call's programs; keep it below reward.timeout_s
  concurrency: int = 0  # programs run at once; 0: 2 per CPU, 4 to 16
  case_wall_s: float = 0.0  # per case; 0: the row's limits, else sandbox.Limits
  strict_types: bool = False  # call-based: the same types at every level (bool is not int)
  # call-based: each case in a fresh process (no state shared between cases)
  # instead of one process for a program's cases (as HumanEval's and APPS's harnesses)
  fresh_process_per_case: bool = False
  # distributions programs may import besides the standard library, copied with
  # their dependencies from the trainer's environment into the sandbox's own
  packages: tuple = ()

  def __post_init__(self):
    if self.format not in formats.FORMATS:
      raise ValueError(f'reward.code.format must be one of {formats.FORMATS}, got {self.format!r}')
    if self.asserts not in formats.ASSERTS:
      raise ValueError(
        f'reward.code.asserts must be one of {formats.ASSERTS}, got {self.asserts!r}'
      )
    if self.score not in SCORES:
      raise ValueError(f'reward.code.score must be one of {SCORES}, got {self.score!r}')
    for name in ('budget_s', 'case_wall_s'):
      value = getattr(self, name)
      if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f'reward.code.{name} must be a finite number >= 0, got {value!r}')
    if self.budget_s <= 0:
      raise ValueError(f'reward.code.budget_s must be > 0, got {self.budget_s!r}')
    for name in ('strict_types', 'fresh_process_per_case'):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f'reward.code.{name} must be True or False, got {getattr(self, name)!r}')
    packages = self.packages
    if isinstance(packages, str) or not all(isinstance(p, str) and p.strip() for p in packages):
      raise ValueError(
        f"reward.code.packages must be a tuple of package names, e.g. ('numpy',), got {packages!r}"
      )
    object.__setattr__(self, 'packages', tuple(p.strip() for p in packages))
    if not isinstance(self.concurrency, int) or self.concurrency < 0:
      raise ValueError(f'reward.code.concurrency must be an integer >= 0, got {self.concurrency!r}')

  @classmethod
  def from_config(cls, section):
    """From a `reward.code` ConfigDict (or dict); unknown fields are refused."""
    fields = dict(section.to_dict() if hasattr(section, 'to_dict') else section)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - known
    if unknown:
      raise ValueError(f'reward.code has unknown fields {sorted(unknown)}; known: {sorted(known)}')
    return cls(**fields)

  @classmethod
  def of(cls, reward_config):
    """The Settings of a `reward` section (its `code` field; defaults without one)."""
    code = reward_config.get('code') if hasattr(reward_config, 'get') else None
    return cls() if code is None else cls.from_config(code)

  def workers(self):
    if self.concurrency:
      return self.concurrency
    return min(16, max(4, 2 * (os.cpu_count() or 1)))


def settings():
  """The Settings the reward workers were started with (`configure_sandbox`)."""
  raw = os.environ.get(SETTINGS_ENV)
  return Settings(**json.loads(raw)) if raw else Settings()


def check_sandbox(unsafe=None):
  """`sandbox.require_isolation` for code_tests: the level, or raises."""
  return sandbox.require_isolation(unsafe, who='code_tests')


def configure_sandbox(unsafe, code_settings=None):
  """At start-up: records `unsafe` and the `reward.code` Settings for the reward
  workers (environment variables, inherited by processes started later),
  checks and logs the isolation level, prepares the sandbox's packages
  (`reward.code.packages`) and checks that a program imports each of them.

  Returns the level (see `check_sandbox`); raises SandboxUnavailableError,
  or ValueError naming `reward.code.packages` and the package that is not
  installed here or does not import in the sandbox.
  """
  if unsafe:
    os.environ[UNSAFE_ENV] = '1'
  else:
    os.environ.pop(UNSAFE_ENV, None)
  if code_settings is not None:
    sandbox.set_packages(code_settings.packages)
    os.environ[SETTINGS_ENV] = json.dumps(dataclasses.asdict(code_settings))
  level = check_sandbox(unsafe)
  _log.info('code_tests: sandbox isolation %r (metric %d)', level, sandbox.isolation_metric())
  if code_settings is not None:
    sandbox.check_packages(who='reward.code.packages')
  return level


def extract_code(completion):
  """The last ```python block of `completion`, else the whole text; None if empty."""
  blocks = _FENCE.findall(completion)
  code = blocks[-1] if blocks else completion
  return code if code.strip() else None


def _defines(code, names):
  import ast

  try:
    tree = ast.parse(code)
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return False
  for node in tree.body:
    if (
      isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name in names
    ):
      return True
    if isinstance(node, ast.Assign) and any(getattr(t, 'id', None) in names for t in node.targets):
      return True
  return False


def program_source(completion, tests):
  """The program to run for `completion`: its code; for call-based and assert
  tests with a prefix, prefix + code, as HumanEval's harness runs a
  completion after the prompt: a completion that continues the prompt's
  function, or one that defines the function again after the prompt (whose
  imports, e.g. `from typing import List`, it may rely on). A completion
  that defines the function and does not compile after the prefix runs
  alone. None: no code."""
  code = extract_code(completion)
  if code is None:
    return None
  if tests.kind == 'stdin' or not tests.prefix:
    return code
  names = {tests.fn_name if tests.kind == 'call' else tests.entry_point}
  if tests.kind == 'call' and tests.class_name:
    names.add(tests.class_name)
  if not _defines(code, names):
    return tests.prefix + code
  joined = tests.prefix + ('\n' if tests.prefix.endswith('\n') else '\n\n') + code
  return joined if _compiles(joined) else code


def _compiles(source):
  try:
    compile(source, 'solution.py', 'exec', dont_inherit=True)
  except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
    return False
  return True


def _strict(tests, strict_types):
  if not strict_types or tests.kind != 'call':
    return tests
  cases = tuple(
    dataclasses.replace(c, expect=dataclasses.replace(c.expect, strict=True)) for c in tests.cases
  )
  return dataclasses.replace(tests, cases=cases)


def _row_limits(meta, case_wall_s):
  fields = dict(meta.get('limits') or {})
  known = {f.name for f in dataclasses.fields(Limits)}
  unknown = set(fields) - known
  if unknown:
    raise ValueError(
      f"metadata['limits'] has unknown fields {sorted(unknown)}; known: {sorted(known)}"
    )
  limits = Limits(**fields)
  if case_wall_s:
    limits = dataclasses.replace(limits, wall_seconds=float(case_wall_s))
  return limits


def score_program(
  source, tests, *, limits=None, budget_s=None, score='fraction', fresh_process_per_case=False
):
  """The score of `source` on `tests` (any layout `formats.parse` reads, as the
  row's `tests` field, or a parsed StdinTests / CallTests / AssertTests),
  within `budget_s` seconds (None: no bound but the limits); None: unscored."""
  if not hasattr(tests, 'kind'):
    tests = formats.parse({'tests': tests})
  deadline = None if budget_s is None else time.monotonic() + float(budget_s)
  verdict = run_tests(
    source,
    tests,
    limits=limits,
    deadline=deadline,
    fresh_process_per_case=fresh_process_per_case,
    stop_at_failure=score == 'all',
  )
  return verdict.score(score)


def score_programs(
  sources, tests, limits, *, budget_s, concurrency, fresh_process_per_case=False, score='fraction'
):
  """The Verdict of each (source, tests, limits), at most `concurrency` at a
  time, none started after `budget_s` seconds from now; with `score='all'`
  a program stops at its first failing case. Each program, as it starts,
  gets a share of the time left (times the concurrency, over the programs
  not yet started): once one of its cases timed out it starts no case past
  it, so slow programs never starve the others (`judge.run_tests`)."""
  if not sources:
    return []
  deadline = time.monotonic() + float(budget_s)
  concurrency = max(1, min(int(concurrency), len(sources)))
  waiting, lock = [len(sources)], threading.Lock()

  def one(source, tests_, limits_):
    with lock:
      now = time.monotonic()
      share = now + max(0.0, deadline - now) * concurrency / waiting[0]
      waiting[0] -= 1
    return run_tests(
      source,
      tests_,
      limits=limits_,
      deadline=deadline,
      fresh_process_per_case=fresh_process_per_case,
      stop_at_failure=score == 'all',
      share=min(share, deadline),
    )

  with futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
    jobs = [pool.submit(one, *row) for row in zip(sources, tests, limits, strict=True)]
    return [job.result() for job in jobs]


@register('code_tests', uses_sandbox=True)
def code_tests(prompts, completions, metadata):
  """The score of each completion's program on its row's tests (see the module);
  0.0 when the completion holds no code; None when its cases were left unrun
  by the budget. Raises SandboxUnavailableError where the sandbox is not isolated,
  ValueError for a row whose tests cannot be read (naming the field)."""
  del prompts
  check_sandbox()
  cfg = settings()
  index, sources, tests, limits = [], [], [], []
  for i, (completion, meta) in enumerate(zip(completions, metadata, strict=True)):
    try:
      row_tests = _strict(formats.parse(meta, cfg.format, cfg.asserts), cfg.strict_types)
    except ValueError as e:
      raise ValueError(f'code_tests, completion {i}: {e}') from None
    source = program_source(completion, row_tests)
    if source is not None:
      index.append(i)
      sources.append(source)
      tests.append(row_tests)
      limits.append(_row_limits(meta, cfg.case_wall_s))
  # A completion without code fails (its doing); None only for the budget's cut.
  have = set(index)
  scores = [None if i in have else 0.0 for i in range(len(completions))]
  left = time_left()  # the reward service's deadline for this chunk, if any
  budget_s = cfg.budget_s if left is None else min(cfg.budget_s, 0.9 * left)
  verdicts = score_programs(
    sources,
    tests,
    limits,
    budget_s=budget_s,
    concurrency=cfg.workers(),
    fresh_process_per_case=cfg.fresh_process_per_case,
    score=cfg.score,
  )
  unrun = 0
  for i, verdict in zip(index, verdicts, strict=True):
    scores[i] = verdict.score(cfg.score)
    unrun += scores[i] is None
  if unrun:
    _log.warning(
      'code_tests: %d of %d programs unscored: the budget of %.1f s (reward.code.budget_s=%s, '
      'or 90%% of what the chunk had left of reward.timeout_s) ran out before their cases',
      unrun,
      len(index),
      budget_s,
      cfg.budget_s,
    )
  return scores
