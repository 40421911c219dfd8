"""launch/rl_vs_sft.py: the RL-over-SFT comparison at equal compute."""

import json
import math
import os

import pytest

from launch import rl_vs_sft


def test_mean_and_standard_error():
  mean, se = rl_vs_sft.mean_se([0.8, 0.9, 1.0])
  assert mean == pytest.approx(0.9)
  assert se == pytest.approx(0.1 / math.sqrt(3))


def test_gain_unpaired_and_paired_by_seed():
  rl, sft = {0: 0.9, 1: 0.3, 2: 0.8}, {0: 0.4, 1: 0.1, 2: 0.4}
  g = rl_vs_sft.gain(rl, sft)
  assert g['gain'] == pytest.approx(2 / 3 - 0.3)
  se_rl, se_sft = rl_vs_sft.mean_se(list(rl.values()))[1], rl_vs_sft.mean_se([0.4, 0.1, 0.4])[1]
  assert g['se'] == pytest.approx(math.sqrt(se_rl**2 + se_sft**2))
  # Per-seed differences 0.5, 0.2, 0.4: the seed-to-seed spread of both arms cancels.
  assert g['paired_gain'] == pytest.approx(1.1 / 3)
  assert g['paired_se'] == pytest.approx(rl_vs_sft.mean_se([0.5, 0.2, 0.4])[1])
  assert g['paired_ratio'] > g['ratio']
  assert rl_vs_sft.gain({0: 0.5}, {0: 0.2})['ratio'] is None  # one seed: no SE


def test_phase_times_are_medians_of_each_phase(tmp_path):
  rows = [
    {'step': 0, 'phase': 0.0, 'eval/accuracy': 0.0},
    *({'step': i, 'phase': 0.0, 'time/update': t} for i, t in enumerate((0.1, 0.3, 0.2), 1)),
    *({'step': i, 'phase': 1.0, 'time/step': t} for i, t in enumerate((0.5, 0.9), 4)),
  ]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  assert rl_vs_sft.phase_times(str(tmp_path)) == (0.2, 0.7, 2)


@pytest.mark.slow
def test_the_comparison_runs_the_three_arms_with_the_extra_sft_steps(tmp_path):
  """Two seeds of the smoke job: each arm trained and scored; the SFT arms
  resume one warm-up with `rl.steps = 0` and the SFT steps the measured RL
  time buys, one of them at the RL phase's learning rate."""
  out, runs = tmp_path / 'cmp.json', tmp_path / 'runs'
  result = rl_vs_sft.main(
    [
      '--config=configs/grpo_arith.py:smoke',
      '--seeds=0,1',
      f'--workdir={runs}',
      f'--out={out}',
      '--config.eval.every=100',
    ]
  )
  saved = json.loads(out.read_text())
  assert saved['gain_over_sft']['gain'] == pytest.approx(result['gain_over_sft']['gain'])
  extra = result['sft_extra_steps']
  assert extra >= 1 and result['rl_steps_of_rl_arm'] == 3
  for arm in ('rl', 'sft', 'sft_at_rl_lr'):
    for seed in (0, 1):
      assert 0.0 <= result['accuracy'][arm][seed] <= 1.0
      config = json.loads((runs / f'{arm}_seed{seed}' / 'config.json').read_text())['config']
      assert config['seed'] == seed
      assert os.path.exists(runs / f'{arm}_seed{seed}' / 'final_eval.jsonl')
  for arm, lr in (('sft', 1e-3), ('sft_at_rl_lr', 1e-4)):
    config = json.loads((runs / f'{arm}_seed0' / 'config.json').read_text())['config']
    assert config['rl']['steps'] == 0 and config['sft']['steps'] == 2 + extra
    assert config['sft']['lr'] == lr
    steps = [r['step'] for r in rl_vs_sft._records(str(runs / f'{arm}_seed0'))]
    assert steps == sorted(set(steps)) and steps[-1] == 2 + extra  # resumed, not restarted
