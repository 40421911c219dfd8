"""Evaluation without a trainer (`jrl.trainers.evaluation.standalone`, `launch/eval.py`)
on configs/grpo_smollm2_gsm.py shrunk, with a tiny random Llama of SmolLM2's
layout: the printed mean@n / pass@k and greedy accuracy agree with the rows
written; a run's checkpoint decodes as its Hugging Face export does; a
missing model directory or checkpoint is named in the error."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from configs import grpo_smollm2_gsm
from jrl import trainers
from jrl.data import word_problems
from jrl.trainers.evaluation import held_out
from jrl.trainers.evaluation import scores as evaluation
from jrl.trainers.evaluation import standalone as standalone_eval
from tests.helpers import REPO, set_fields, write_tiny_chat_model

SHRINK = {
  'task.system_prompt': 'Answer with a number.',
  'task.max_prompt_len': 200,  # characters here: the longest questions are filtered
  'task.max_response_len': 8,
  'rl.overlong_buffer': 0,
  'task.eval_size': 4,
  'sampler.num_slots': 4,
  'sampler.steps_per_dispatch': 8,
}


@pytest.fixture(scope='module', autouse=True)
def compilation_cache_dir(tmp_path_factory):
  """A persistent compilation cache for this module (and its subprocesses): the
  evaluations compile the same sampler programs as each other and as the run."""
  path = str(tmp_path_factory.mktemp('jax_cache'))
  names = {'jax_compilation_cache_dir': path, 'jax_persistent_cache_min_compile_time_secs': 0.0}
  saved = {name: getattr(jax.config, name) for name in names}
  compilation_cache.reset_cache()
  for name, value in names.items():
    jax.config.update(name, value)
  yield path
  for name, value in saved.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  """(root, {field: value}): a tiny chat model and word problems in GSM8K's schema."""
  root = tmp_path_factory.mktemp('standalone_eval')
  write_tiny_chat_model(str(root / 'model'), family='llama')
  word_problems.write_splits(str(root / 'data'), 16, 6, seed=0, weights=(3, 1, 1))
  fields = {
    **SHRINK,
    'model.path': str(root / 'model'),
    'task.train_path': str(root / 'data' / 'train.jsonl'),
    'task.eval_path': str(root / 'data' / 'eval.jsonl'),
  }
  return root, fields


def _config(fields, **more):
  return set_fields(grpo_smollm2_gsm.get_config(), {**fields, **more})


def _overrides(fields):
  return [f'--config.{k}={v}' for k, v in fields.items()]


def _rows(path):
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f]


def _eval_command(*args, cli=False):
  """`python launch/eval.py ARGS` (`jrl eval ARGS` with `cli`) with its output."""
  env = dict(
    os.environ,
    JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
  )
  command = ['-m', 'jrl.cli', 'eval'] if cli else [os.path.join(REPO, 'launch', 'eval.py')]
  return subprocess.run(
    [sys.executable, *command, *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_hf_directory_metrics_agree_with_the_rows_written(files):
  root, fields = files
  out = root / 'before.jsonl'
  out.write_text('stale\n')  # --out is overwritten
  fields = {**fields, 'workdir': str(root / 'nowhere')}  # no run needed
  cmd = ['--config', 'configs/grpo_smollm2_gsm.py', *_overrides(fields)]
  cmd += ['--model_path', str(root / 'model'), '--samples', '3', '--temperature', '1.0']
  done = _eval_command(*cmd, '--out', str(out))
  assert done.returncode == 0, done.stderr[-3000:]
  metrics = json.loads(done.stdout.strip().splitlines()[-1])
  rows = _rows(out)
  assert metrics['examples'] == len(rows) > 0
  assert metrics['model_path'] == str(root / 'model')
  assert not os.path.exists(root / 'nowhere' / 'checkpoints')
  # Sampled: mean@3 and pass@k recomputed from the scores per completion.
  scores = np.array([r['scores'] for r in rows], np.float64)
  assert scores.shape == (len(rows), 3)
  assert all(len(r['completions']) == 3 for r in rows)
  expected = evaluation.summarize(scores, held_out.pass_ks(3), prefix='eval/sampled')
  assert set(expected) <= set(metrics)
  for name, value in expected.items():
    assert metrics[name] == pytest.approx(value), name
  # Greedy: the accuracy, overall and per difficulty, is the rows' share scored > 0.5.
  correct = np.array([r['greedy_score'] > 0.5 for r in rows])
  assert metrics['eval/accuracy'] == pytest.approx(correct.mean())
  for d in {r['difficulty'] for r in rows}:
    share = np.mean([ok for ok, r in zip(correct, rows, strict=True) if r['difficulty'] == d])
    assert metrics[f'eval/accuracy/difficulty_{d}'] == pytest.approx(share)


def test_checkpoint_decodes_as_its_hf_export(files):
  root, fields = files
  workdir = root / 'run'
  config = _config(
    fields,
    **{
      'workdir': str(workdir),
      'rl.steps': 1,
      'rl.prompts_per_step': 4,
      'rl.group_size': 4,
      'rl.minibatch_size': 8,
      'optim.lr': 1e-2,
      'eval.every': 0,
      'log.plot': False,
      'log.tensorboard': False,
    },
  )
  trainers.run(config)
  assert not os.path.exists(workdir / held_out.EXAMPLES_FILE)  # eval.every = 0
  ck = standalone_eval.evaluate(config, samples=2)  # the latest checkpoint
  hf = standalone_eval.evaluate(
    config, model_path=str(workdir / 'hf_export'), samples=2, out=str(root / 'hf.jsonl')
  )
  assert (ck['checkpoint'], ck['updates']) == (1, 2)  # two minibatches: two updates
  assert hf['model_path'] == str(workdir / 'hf_export') and hf['updates'] is None
  # By default the rows are appended to the workdir's eval_samples.jsonl.
  assert ck['out'] == str(workdir / held_out.EXAMPLES_FILE)
  ck_rows, hf_rows = _rows(ck['out']), _rows(root / 'hf.jsonl')
  assert [r['updates'] for r in ck_rows] == [2] * len(ck_rows)
  for a, b in zip(ck_rows, hf_rows, strict=True):
    assert a['prompt'] == b['prompt']
    assert (a['greedy'], a['completions']) == (b['greedy'], b['completions'])
  assert {k: v for k, v in ck.items() if k.startswith('eval/')} == {
    k: v for k, v in hf.items() if k.startswith('eval/')
  }
  with pytest.raises(
    FileNotFoundError, match=re.escape(f'{workdir}/checkpoints/7: no such checkpoint')
  ):
    standalone_eval.evaluate(config, step=7)


def test_missing_model_directory_is_named(files):
  root, fields = files
  missing = str(root / 'no_such_model')
  cmd = ['--config', 'configs/grpo_smollm2_gsm.py', *_overrides(fields), '--model_path', missing]
  done = _eval_command(*cmd, cli=True)  # `jrl eval` passes the flags on
  assert done.returncode == 1
  assert f'model directory {missing}: no such directory' in done.stderr
  with pytest.raises(FileNotFoundError, match=re.escape('no config.json')):
    standalone_eval.evaluate(_config(fields), model_path=str(root / 'data'))


def test_missing_checkpoint_is_named(files, tmp_path):
  _, fields = files
  config = _config(fields, workdir=str(tmp_path / 'empty'))
  with pytest.raises(
    FileNotFoundError, match=re.escape(f'no checkpoint in {tmp_path}/empty/checkpoints')
  ):
    standalone_eval.evaluate(config)
  assert not os.path.exists(tmp_path / 'empty' / 'checkpoints')
