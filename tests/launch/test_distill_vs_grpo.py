"""launch/distill_vs_grpo.py: on-policy distillation against GRPO, same student."""

import json

import pytest

from launch import distill_vs_grpo


def test_curve_reads_rl_evaluations_against_iterations_and_seconds(tmp_path):
  rows = [
    {'step': 0, 'phase': 0.0, 'eval/accuracy': 0.0},
    {'step': 1, 'phase': 0.0, 'time/update': 0.1},
    {'step': 2, 'phase': 0.0, 'time/update': 0.1, 'eval/accuracy': 0.4},  # the warm-up's end
    {'step': 3, 'phase': 1.0, 'time/step': 2.0},
    {'step': 3, 'phase': 1.0, 'eval/accuracy': 0.5},  # a second record of one step
    {'step': 4, 'phase': 1.0, 'time/step': 3.0, 'eval/accuracy': 0.7},
  ]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  assert distill_vs_grpo.curve(str(tmp_path)) == [(0, 0.0, 0.4), (1, 2.0, 0.5), (2, 5.0, 0.7)]


@pytest.mark.slow
def test_both_arms_resume_one_warm_up_and_the_distilled_one_reads_the_teacher(tmp_path):
  """One seed of the smoke job: the teacher trained and exported, one
  warm-up, GRPO and distillation resuming it, each scored."""
  out, runs = tmp_path / 'cmp.json', tmp_path / 'runs'
  result = distill_vs_grpo.main(
    ['--config=configs/grpo_arith.py:smoke', '--seeds=1', f'--workdir={runs}', f'--out={out}']
  )
  saved = json.loads(out.read_text())
  assert saved['machine']['cores'] >= 1 and saved['seeds'] == [1]
  for arm in ('grpo', 'distill'):
    run = result['runs'][arm][1]
    assert 0.0 <= run['final_accuracy'] <= 1.0 and run['curve']
    config = json.loads((runs / f'{arm}_seed1' / 'config.json').read_text())['config']
    assert config['seed'] == 1
    assert config['distill']['teachers'] == ([result['teacher']] if arm == 'distill' else [])

  def records(arm):
    return [json.loads(line) for line in (runs / f'{arm}_seed1' / 'metrics.jsonl').open()]

  assert any('distill/reverse_kl' in r for r in records('distill'))
  assert not any('distill/reverse_kl' in r for r in records('grpo'))
