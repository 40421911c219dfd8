"""Run options of the controller: `log.profile_steps` (a jax.profiler trace of
the chosen iterations, jrl's stages as annotations in it; bad values name the
field), `eval.at_start`, and `launch/train.py`'s compilation cache in the
run directory."""

import glob
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jrl import trainers
from jrl.trainers import setup
from tests.helpers import QUIET, REPO, SHRINK, records, shrunk_config


def test_profiles_the_chosen_iteration_with_stage_annotations(tmp_path):
  config = shrunk_config(
    tmp_path / 'run', {**QUIET, 'sft.steps': 0, 'rl.steps': 2, 'log.profile_steps': (2,)}
  )
  trainers.run(config)
  traces = glob.glob(str(tmp_path / 'run' / 'profile' / '**' / '*.xplane.pb'), recursive=True)
  assert len(traces) == 1, traces  # one capture: iteration 2 only
  with open(traces[0], 'rb') as f:
    data = f.read()
  for stage in (b'jrl/step', b'jrl/generate', b'jrl/update'):
    assert stage in data, stage


def test_no_profile_unless_asked(tmp_path):
  config = shrunk_config(tmp_path / 'run', {**QUIET, 'sft.steps': 0, 'rl.steps': 1})
  trainers.run(config)
  assert not os.path.exists(tmp_path / 'run' / 'profile')


@pytest.mark.parametrize('steps', [(0,), (5,), ('1',), (True,)])
def test_bad_profile_steps_name_the_field(tmp_path, steps):
  config = shrunk_config(
    tmp_path / 'run', {**QUIET, 'sft.steps': 0, 'rl.steps': 2, 'log.profile_steps': steps}
  )
  with pytest.raises(ValueError, match=r'log\.profile_steps'):
    trainers.run(config)


def test_eval_at_start_off_skips_only_the_first_evaluation(tmp_path):
  from tests.helpers import records

  fields = {'log.plot': False, 'log.tensorboard': False, 'sft.steps': 0, 'rl.steps': 2}
  fields.update({'eval.every': 2, 'eval.at_start': False})
  trainers.run(shrunk_config(tmp_path / 'run', fields))
  assert [r['step'] for r in records(tmp_path / 'run') if 'eval/accuracy' in r] == [2]


def test_a_restarted_run_loads_its_compiled_programs_from_the_workdir(tmp_path):
  """`launch/train.py` keeps compiled programs in WORKDIR/xla_cache: the
  first run fills it, and the restart (one more iteration) adds only what
  resuming needs (the finiteness check of the restored state): every
  program of the first run is found there."""
  fields = {**SHRINK, **QUIET, 'sft.steps': 0, 'workdir': str(tmp_path / 'run')}
  flags = [f'--config.{key}={value}' for key, value in fields.items()]
  cache = tmp_path / 'run' / 'xla_cache'

  def train(steps):
    subprocess.run(
      [sys.executable, 'launch/train.py', '--config', 'configs/grpo_arith.py', *flags]
      + [f'--config.rl.steps={steps}'],
      cwd=REPO,
      check=True,
      capture_output=True,
    )
    return set(os.listdir(cache))

  first = train(1)
  assert len(first) > 10  # the programs of the first run
  new = train(2) - first
  assert len(new) <= 1 and all('finite' in name for name in new), new


def test_sft_examples_repeat_the_first_n_demonstrations(tmp_path):
  """`sft.examples`: the warm-up sees only the first N examples, each epoch in
  a new order; the RL prompts stay the whole endless task."""
  config = shrunk_config(tmp_path, {'sft.examples': 4})
  tok = setup.tokenizer(config)
  _, task, streams = setup.examples(config, setup.encoder(config, tok), tok)
  first = sorted(task.train.example(i)['prompt'] for i in range(4))
  epochs = [[ex['prompt'] for ex in streams['sft_stream'].next(4)] for _ in range(4)]
  assert all(sorted(epoch) == first for epoch in epochs)
  assert len({tuple(epoch) for epoch in epochs}) > 1
  assert len({ex['prompt'] for ex in streams['rl_stream'].next(64)}) > 4


def test_sft_examples_beyond_the_file_name_the_field(tmp_path):
  path = tmp_path / 'sft.jsonl'
  path.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": "2+2=", "response": "4"}\n')
  config = shrunk_config(tmp_path, {'sft.examples': 3, 'sft.train_path': str(path)})
  tok = setup.tokenizer(config)
  with pytest.raises(ValueError, match=r'^`sft\.examples`: 3 demonstrations asked for, .* 2 rows'):
    setup.examples(config, setup.encoder(config, tok), tok)


def test_an_sft_only_run_extended_with_rl_steps_trains_as_a_straight_run(tmp_path):
  """A run of the warm-up alone (`rl.steps = 0`), rerun with `rl.steps = 2`,
  starts RL with a fresh optimiser as a run that had the steps from the start
  does: the same metrics record by record and the same final state."""
  fields = {**QUIET, 'checkpoint.every': 100, 'log.every': 1}
  straight = shrunk_config(tmp_path / 'straight', {**fields, 'rl.steps': 2})
  straight_state = trainers.run(straight)
  trainers.run(shrunk_config(tmp_path / 'extended', {**fields, 'rl.steps': 0}))
  extended = shrunk_config(tmp_path / 'extended', {**fields, 'rl.steps': 2})
  extended_state = trainers.run(extended)

  def history(workdir):
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(('time/', 'throughput/'))}
    return {r['step']: strip(r) for r in records(workdir)}

  a, b = history(straight.workdir), history(extended.workdir)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4]
  assert a == b
  assert a[3]['actor/lr'] < a[2]['sft/lr']  # RL's own optimiser (its warm-up), not the SFT one's
  assert int(extended_state.step) == int(straight_state.step)
  jax.tree.map(np.testing.assert_array_equal, straight_state.params, extended_state.params)
