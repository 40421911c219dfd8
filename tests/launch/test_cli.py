"""The `jrl` console command (installed by `pip install -e .`), through a
subprocess as a user runs it."""

import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _jrl():
  """The installed console script next to this interpreter."""
  found = shutil.which('jrl', path=os.path.dirname(sys.executable))
  assert found, 'the jrl console script is not installed (pip install -e .)'
  return found


def _run(*argv, cwd=REPO):
  return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=300)


def test_help_lists_every_command():
  from jrl import cli

  out = _run(_jrl(), '--help')
  assert out.returncode == 0
  for name, (script, _) in cli.COMMANDS.items():
    assert name in out.stdout
    assert os.path.exists(os.path.join(REPO, 'launch', script)), script


def test_a_command_runs_its_launch_script_with_the_same_output():
  argv = ['--model', 'qwen2.5-0.5b', '--hardware', 'h100', '--chips', '8']
  via_cli = _run(_jrl(), 'plan', *argv)
  via_script = _run(sys.executable, 'launch/plan.py', *argv)
  assert via_cli.returncode == via_script.returncode == 0, via_cli.stderr
  assert via_cli.stdout == via_script.stdout and 'recommended: ' in via_cli.stdout


def test_train_reports_a_bad_field_with_a_non_zero_exit(tmp_path):
  out = _run(
    _jrl(), 'train', '--config', os.path.join(REPO, 'configs/grpo_arith.py'),
    '--config.sft.batch_size=0', f'--config.workdir={tmp_path}', cwd=tmp_path,
  )  # fmt: skip
  assert out.returncode != 0
  assert '`sft.batch_size` must be >= 1, got 0.' in out.stderr


@pytest.mark.parametrize('argv, code', [(['nonsense'], 2), (['plan', '--chips', 'x'], 2)])
def test_errors_keep_their_exit_codes(argv, code):
  out = _run(_jrl(), *argv)
  assert out.returncode == code
  assert out.stderr


def test_export_writes_any_saved_step_as_a_hugging_face_directory(tmp_path):
  """`jrl export --step N` after a run: the directory loads with jrl's HF
  loader and holds exactly the parameters of checkpoint N."""
  import jax
  import numpy as np

  from jrl import trainers
  from jrl.models import hf
  from tests.helpers import QUIET, SHRINK, restore, shrunk_config

  fields = {**SHRINK, **QUIET, 'sft.steps': 2, 'rl.steps': 2, 'checkpoint.every': 2}
  config = shrunk_config(tmp_path / 'run', fields)
  trainers.run(config)
  flags = [f'--config.{k}={v}' for k, v in fields.items()]
  out = tmp_path / 'export_2'
  result = _run(
    _jrl(), 'export', '--config', os.path.join(REPO, 'configs/grpo_arith.py'),
    f'--config.workdir={config.workdir}', *flags, '--step', '2', '--out', str(out),
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-2000:]
  assert '"checkpoint": 2' in result.stdout
  loaded = hf.load(str(out))
  saved, _ = restore(config.workdir, step=2)

  # The checkpoint's pytree and the loader's differ in container types, not in
  # leaves: pair the leaves by their key paths.
  def by_path(tree):
    flat = jax.tree_util.tree_leaves_with_path(tree)

    # keystr gives "['embed']['embedding'].value" for nnx and "...['value']" for
    # dicts, and [0] for a list index where Orbax's dict has ['0'].
    def norm(path):
      key = jax.tree_util.keystr(path).replace('.value', "['value']")
      return re.sub(r'\[(\d+)\]', r"['\1']", key)

    return {norm(p): np.asarray(x) for p, x in flat}

  want, got = by_path(saved['params']), by_path(loaded.params)
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
