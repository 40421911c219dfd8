"""Running one program on its tests: one sandbox start for all its cases.

    verdict = run_tests(source, tests, limits=Limits(wall_seconds=2), deadline=deadline)
    verdict.passed, verdict.total, verdict.not_run      # 3, 4, 0
    verdict.score('fraction')                           # 0.75; None when unscored

The program runs under the sandbox's fixed driver (`sandbox/driver.py`,
through `sandbox.run_driver`), which forks children for the cases (see its
docstring), each case under its own limits, and reports what
each case returned or printed; the verdict is taken here, against expected
values the sandbox never saw.

Time. Each case runs under `limits.wall_seconds` of wall clock (and as many
CPU seconds, rounded up), so a program's run is bounded by its own cases'
limits. A case is not started when less than that is left before
`deadline`: it is 'not_run', and a program left with such cases is
unscored (None) unless its own cases timed out (then they count as failed:
being slow is the program's doing) or, with `score='all'`, a case that did
run already failed it; with `stop_at_failure` (what `score='all'` uses) the
cases after one that failed in the driver (an error, a timeout, ...) are
'skipped', failed without being run.

Failures are the program's own. The driver reports each case as it starts
and as it ends (sandbox/driver.py); a case that started and never ended,
and every case after it, is 'lost' (a failure): the program stopped, killed
or outlived its driver. A driver silent for longer than a case may take
(`Limits.quiet_seconds`) ends the run at once ('stalled'), so a stopped
driver costs its slot one case's time, not the budget. A program whose
case timed out starts no case past its `share` of the call's budget (what
is left, times the concurrency, over the programs not yet started), so
looping programs never starve the others; its unrun cases count as failed.
Only cases that never started because the call's budget ran out (other
programs used the time) leave a program unscored.
"""

import dataclasses
import json
import math
import time
from typing import NamedTuple

from jrl.rewards import sandbox
from jrl.rewards.code import compare
from jrl.rewards.code.cases import normalize_output
from jrl.rewards.sandbox import Limits

STARTUP_S = 1.0  # a sandbox start and clean-up, beyond the cases' own time
CASE_OVERHEAD_S = 0.05  # the driver's fork and bookkeeping, per case
REPORT_SLACK_S = 1.0  # a case's end (kill, reap, report) beyond its wall limit
FAILED_HERE = ('lost', 'skipped')  # statuses that fail a case the driver did not judge
SCORES = ('fraction', 'all')


class Verdict(NamedTuple):
  passed: int
  total: int
  not_run: int  # cases not started for lack of budget
  timed_out: int  # cases stopped at their time limit
  # per case: 'pass' | 'fail' | 'timeout' | 'not_run' | 'skipped' | 'lost' (sandbox/driver.py)
  statuses: tuple

  def score(self, how='fraction'):
    """'fraction': passed / total; 'all': 1.0 if every case passed, else 0.0;
    None (unscored) when cases were left unrun by the budget (see the module)."""
    failed = self.total - self.passed - self.not_run
    if self.not_run and not self.timed_out and not (how == 'all' and failed):
      return None
    if how == 'all':
      return 1.0 if self.passed == self.total else 0.0
    return self.passed / self.total


def _job(tests, case_wall, deadline_s, limits, fresh_process_per_case=False, stop=False):
  job = {
    'mode': tests.kind,
    'case_wall_s': case_wall,
    'case_cpu_s': max(1, math.ceil(min(float(limits.cpu_seconds), case_wall))),
    'deadline_s': deadline_s,
    'max_output_bytes': int(limits.max_output_bytes),
    'stop_at_failure': bool(stop),
  }
  if tests.kind == 'stdin':
    job['cases'] = [{'stdin': inp} for inp, _ in tests.cases]
  elif tests.kind == 'call':
    job.update(fn=tests.fn_name, cls=tests.class_name)
    job['fresh_process_per_case'] = fresh_process_per_case
    job['cases'] = [
      {'args': compare.encode(list(c.args)), 'kwargs': compare.encode(dict(c.kwargs))}
      for c in tests.cases
    ]
  else:
    job.update(check=tests.check, entry=tests.entry_point, cases=[{}])
  return job


def _passes(tests, i, result):
  if result.get('status') != 'ok':
    return False
  if tests.kind == 'stdin':
    got = result.get('stdout')
    return isinstance(got, str) and normalize_output(got) == normalize_output(tests.cases[i][1])
  if tests.kind == 'call':
    try:
      value = compare.decode(result['value'])
    except (compare.BadValue, KeyError, TypeError):
      return False
    return compare.matches(value, tests.cases[i].expect)
  return True  # asserts: only the check's own process reports 'ok' (sandbox/driver.py)


def _lines(stdout, n):
  """(first result line of each case, cases reported started, whether the
  driver wrote its last line)."""
  found, started, done = {}, set(), False
  for line in stdout.splitlines():
    line = line.strip()
    if not line.startswith('{'):
      continue
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if not isinstance(row, dict):
      continue
    if type(row.get('case')) is int and 0 <= row['case'] < n:
      found.setdefault(row['case'], row)
    elif type(row.get('start')) is int and 0 <= row['start'] < n:
      started.add(row['start'])
    elif row.get('done') == n:
      done = True
  return found, started, done


def run_tests(
  source,
  tests,
  *,
  limits=None,
  deadline=None,
  fresh_process_per_case=False,
  stop_at_failure=False,
  share=None,
):
  """The Verdict of `source` on `tests` (formats.StdinTests | CallTests |
  AssertTests), every case under `limits` (default `Limits()`), none started
  after `deadline` (time.monotonic(); None: no bound). Call-based cases run
  one after another in one process (a fresh one after a case that timed out
  or crashed), or each in a fresh process with `fresh_process_per_case`.
  `stop_at_failure`: no case runs after one that failed in the driver.
  `share` (time.monotonic(), before `deadline`): once a case timed out, no
  case starts after it (the program's share of a call's budget).
  Raises RuntimeError when the sandbox itself fails (the program is then
  unscored)."""
  limits = Limits() if limits is None else limits
  n = len(tests)
  case_wall = float(limits.wall_seconds)
  slack = STARTUP_S + REPORT_SLACK_S
  need = n * (case_wall + CASE_OVERHEAD_S) + slack
  left = need if deadline is None else deadline - time.monotonic()
  if left < case_wall + slack:
    return Verdict(0, n, n, 0, ('not_run',) * n)
  run_wall = min(need, left)
  # The driver starts no case it could not end (and report) before the run's
  # wall: a started case without an end is then never the budget's doing.
  job = _job(tests, case_wall, run_wall - slack, limits, fresh_process_per_case, stop_at_failure)
  if share is not None:
    job['share_s'] = max(0.0, min(run_wall, share - time.monotonic()) - slack)
  run_limits = dataclasses.replace(
    limits,
    wall_seconds=run_wall,
    cpu_seconds=job['case_cpu_s'] + 1 + math.ceil(0.01 * n),
    max_output_bytes=n * (int(limits.max_output_bytes) + 512) + 4096,
    quiet_seconds=case_wall + slack,
  )
  result = sandbox.run_driver(json.dumps(job), limits=run_limits, files={'solution.py': source})
  if result.status == 'sandbox_error':
    raise RuntimeError(f'sandbox failed: {result.stderr[:2000]}')
  found, started, done = _lines(result.stdout, n)
  unended = started - set(found)
  # The run's wall reached with every started case ended: the budget, not the program.
  cut_short = result.status == 'timeout' and run_wall < need and not unended
  statuses, passed, not_run, timed_out = [], 0, 0, 0
  for i in range(n):
    row = found.get(i)
    if row is None:
      if cut_short or (done and i not in started):
        status = 'not_run'
      else:  # lost after the program ran; an error of the run where it never did
        status = 'lost' if started or found else 'error'
    elif _passes(tests, i, row):
      status = 'pass'
    elif row.get('status') in ('not_run', 'timeout', *FAILED_HERE):
      status = row['status']
    else:
      status = 'fail'
    statuses.append(status)
    passed += status == 'pass'
    not_run += status == 'not_run'
    timed_out += status in ('timeout', 'lost')
  return Verdict(passed, n, not_run, timed_out, tuple(statuses))
