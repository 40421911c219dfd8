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
...} (fields of `sandbox.Limits`). Completions of a batch run concurrently,
one sandbox per CPU; the cases of one program run in order.
"""

import json
import os
import re
from concurrent import futures

from jrl.rewards.base import register
from jrl.rewards.sandbox import Limits, run_program

_FENCE = re.compile(r'```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)```', re.DOTALL | re.IGNORECASE)


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


def score_program(source, tests, *, limits=None):
  """The fraction of `tests` ([{'input': str, 'output': str}]) that `source`
  passes, each run under `limits` (default `sandbox.Limits()`)."""
  limits = Limits() if limits is None else limits
  tests = _parse_tests(tests)
  passed = 0
  for i, case in enumerate(tests):
    result = run_program(source, str(case['input']), limits=limits)
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


@register('code_tests')
def code_tests(prompts, completions, metadata):
  """Fraction of metadata['tests'] passed by the completion's program; None
  when the completion holds no code."""
  del prompts
  jobs = {}
  with futures.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
    for i, (completion, meta) in enumerate(zip(completions, metadata, strict=True)):
      code = extract_code(completion)
      if code is not None:
        limits = Limits(**meta.get('limits', {}))
        jobs[i] = pool.submit(score_program, code, meta['tests'], limits=limits)
    return [jobs[i].result() if i in jobs else None for i in range(len(completions))]
