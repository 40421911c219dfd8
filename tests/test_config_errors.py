"""Misspelt and mistyped `--config.x=y` overrides: one line naming the field
and what was meant, exit status 2, no traceback (jrl/config_errors.py)."""

import os
import subprocess
import sys

import pytest

from configs import dpo_arith, grpo_arith
from jrl import config_errors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = 'configs/grpo_arith.py'


def _check(*overrides):
  return config_errors.check(grpo_arith.get_config(), list(overrides), SOURCE)


def test_misspelt_field_names_the_nearest_in_its_section():
  assert _check(('rl.setps', '5')) == (
    "unknown config field 'rl.setps' in configs/grpo_arith.py; did you mean 'rl.steps'?"
  )


def test_field_of_another_section_is_suggested_there():
  message = _check(('rl.lr', '1e-5'))
  assert message.startswith("unknown config field 'rl.lr' in configs/grpo_arith.py; did you mean")
  assert "'optim.lr'" in message and "'rl." not in message.partition('did you mean')[2]
  assert "did you mean 'optim.lr'" in _check(('optm.lr', '1e-5'))


def test_a_moved_field_names_its_new_place():
  assert _check(('rl.max_new_tokens', '5')) == (
    "unknown config field 'rl.max_new_tokens' in configs/grpo_arith.py (moved); "
    "did you mean 'task.max_response_len'?"
  )
  assert "did you mean 'train.packing'?" in _check(('rl.packing', 'true'))


def test_a_section_the_algorithm_does_not_read_is_named():
  message = config_errors.check(dpo_arith.get_config(), [('rl.steps', '5')], 'configs/dpo_arith.py')
  assert message.startswith(
    "unknown config field 'rl.steps' in configs/dpo_arith.py (algorithm 'dpo' has no `rl` "
    'section: configs/README.md lists what each reads); did you mean '
  )
  assert "'dpo.steps'" in message


def test_wrong_type_names_the_field_and_the_expected_type():
  assert _check(('rl.steps', 'abc')) == (
    "config field 'rl.steps' in configs/grpo_arith.py expects int, got 'abc'"
  )
  assert 'expects float' in _check(('optim.lr', 'fast'))
  assert 'expects bool' in _check(('log.plot', 'maybe'))


def test_valid_overrides_pass():
  assert _check(
    ('rl.steps', '7'), ('optim.lr', '1e-5'), ('optim.lr', '3'), ('log.plot', 'false'),
    ('log.plot', None), ('workdir', 'runs/x'), ('reward.functions', "('exact_match',)"),
  ) is None  # fmt: skip


def test_command_line_forms():
  argv = [
    'train.py', '--config', 'configs/grpo_arith.py', '--config.rl.steps', '5',
    '--noconfig.log.plot', '--config.optim.lr=1e-5', '--step=3',
  ]  # fmt: skip
  config_arg, found = config_errors.overrides_in(argv)
  assert config_arg == 'configs/grpo_arith.py'
  assert found == [('rl.steps', '5', False), ('log.plot', None, True), ('optim.lr', '1e-5', True)]
  assert config_errors.check_argv(argv) is None
  # a bool's next argument is not its value (absl reports it as an unexpected argument)
  assert config_errors.check_argv([*argv, '--config.log.tensorboard', 'no']) is None
  bad = ['train.py', '--config=configs/grpo_arith.py', '--config.rl.steps', 'x']
  assert config_errors.check_argv(bad) == (
    "config field 'rl.steps' in configs/grpo_arith.py expects int, got 'x'"
  )


@pytest.mark.parametrize(
  'script, override, expected',
  [
    ('train.py', '--config.rl.setps=5', "did you mean 'rl.steps'?"),
    ('eval.py', '--config.eval.sample=3', "did you mean 'eval.samples'?"),
    ('export.py', '--config.rl.steps=abc', "config field 'rl.steps' in"),
  ],
)
def test_launch_scripts_exit_2_with_one_line(script, override, expected):
  out = subprocess.run(
    [sys.executable, f'launch/{script}', '--config', SOURCE, override],
    capture_output=True, text=True, cwd=REPO, timeout=60,
  )  # fmt: skip
  assert out.returncode == 2, out.stderr
  assert expected in out.stderr and 'Traceback' not in out.stderr
  assert len(out.stderr.strip().splitlines()) == 1
