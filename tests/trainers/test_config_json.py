"""workdir/config.json: the resolved config and the command line of a run;
a resumed run with changed fields keeps the old file and prints the changes."""

import json
import os

from jrl import trainers
from jrl.trainers import setup
from tests.helpers import QUIET, shrunk_config


def _read(path):
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def test_run_writes_its_config_and_a_resumed_run_records_a_change(tmp_path, capsys):
  fields = {**QUIET, 'sft.steps': 0, 'rl.steps': 1, 'log.trace': False}
  config = shrunk_config(tmp_path, fields)
  trainers.run(config)
  written = _read(tmp_path / 'config.json')
  assert written['config'] == json.loads(config.to_json_best_effort())
  assert written['config']['rl']['steps'] == 1 and written['config']['workdir'] == str(tmp_path)
  assert written['argv'] and written['cwd'] == os.getcwd()

  # Resumed at its last iteration with one field changed: nothing left to run.
  resumed = shrunk_config(tmp_path, {**fields, 'checkpoint.keep': 5})
  capsys.readouterr()
  trainers.run(resumed)
  out = capsys.readouterr().out
  assert '(the previous kept as config.1.json): checkpoint.keep 3 -> 5\n' in out
  assert _read(tmp_path / 'config.1.json') == written
  assert _read(tmp_path / 'config.json')['config'] == json.loads(resumed.to_json_best_effort())


def test_write_config_keeps_each_earlier_version(tmp_path, capsys):
  config = shrunk_config(tmp_path)
  assert setup.write_config(config, str(tmp_path), argv=['train.py']) == []
  assert setup.write_config(config, str(tmp_path), argv=['other.py']) == []  # same config
  assert _read(tmp_path / 'config.json')['argv'] == ['train.py']
  assert not (tmp_path / 'config.1.json').exists()
  config.rl.steps, config.optim.lr = 7, 1e-5
  assert setup.write_config(config, str(tmp_path)) == [
    'optim.lr 0.0001 -> 1e-05',
    'rl.steps 3 -> 7',
  ]
  config.rl.steps = 8
  assert setup.write_config(config, str(tmp_path)) == ['rl.steps 7 -> 8']
  assert _read(tmp_path / 'config.1.json')['config']['rl']['steps'] == 3
  assert _read(tmp_path / 'config.2.json')['config']['rl']['steps'] == 7
  assert _read(tmp_path / 'config.json')['config']['rl']['steps'] == 8
  assert '(the previous kept as config.2.json): rl.steps 7 -> 8' in capsys.readouterr().out


def test_a_config_json_of_another_kind_is_left_alone(tmp_path, capsys):
  (tmp_path / 'config.json').write_text('{"architectures": ["LlamaForCausalLM"]}')
  assert setup.write_config(shrunk_config(tmp_path), str(tmp_path)) == []
  assert 'not a jrl run config' in capsys.readouterr().out
  assert _read(tmp_path / 'config.json') == {'architectures': ['LlamaForCausalLM']}
  assert not (tmp_path / 'config.1.json').exists()
