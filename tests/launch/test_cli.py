"""The `jrl` console command (installed by `pip install -e .`), through a
subprocess as a user runs it."""

import os
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
  assert via_cli.stdout == via_script.stdout and 'best colocated' in via_cli.stdout


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
