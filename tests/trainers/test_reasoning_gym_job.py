"""configs/grpo_smollm2_reasoning_gym.py:mixture, shrunk, on a tiny random
Llama of SmolLM2's layout: reasoning-gym problems through the chat template,
scored by their datasets' own scorers in the reward workers, per-dataset
reward and held-out accuracy, and a curriculum that moves during the run and
is saved in the checkpoint with the prompt stream."""

import pytest

pytest.importorskip(
  'reasoning_gym', reason='the [reasoning-gym] extra (pip install -e ".[reasoning-gym]")'
)

from configs import grpo_smollm2_reasoning_gym
from jrl import trainers
from tests.helpers import records, restore, set_fields, write_tiny_chat_model

NAMES = ('basic_arithmetic', 'chain_sum')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp('reasoning_gym_job')
  model_dir = str(root / 'model')
  write_tiny_chat_model(model_dir, family='llama')
  config = set_fields(
    grpo_smollm2_reasoning_gym.get_config('mixture,smoke'),
    {
      'workdir': str(root / 'run'),
      'model.path': model_dir,
      'export_hf': False,
      'task.system_prompt': 'Answer in <answer></answer>.',
      'task.max_prompt_len': 200,  # characters here: the longest questions are filtered
      'task.max_response_len': 12,
      # Every full window raises its dataset a level: the wiring, not the policy, is tested.
      'task.reasoning_gym.curriculum.raise_at': 0.0,
      'task.reasoning_gym.curriculum.window': 4,
      'rl.overlong_buffer': 4,
      'rl.steps': 2,
      'rl.prompts_per_step': 4,
      'rl.group_size': 4,
      'rl.minibatch_size': 8,
      'eval.every': 2,
      'eval.samples': 0,
      'sampler.num_slots': 16,
      'checkpoint.every': 2,
      'log.plot': False,
      'log.tensorboard': False,
    },
  )
  trainers.run(config)
  return config, root


def test_per_dataset_rewards_and_held_out_accuracy(run):
  _, root = run
  recs = records(root / 'run')
  evals = [r for r in recs if 'eval/accuracy' in r]
  assert [r['step'] for r in evals] == [0, 2]
  for r in evals:
    for name in NAMES:
      assert 0.0 <= r[f'eval/accuracy/dataset_{name}'] <= 1.0
  steps = [r for r in recs if 'reward/reasoning_gym/mean' in r]
  assert len(steps) == 2
  for r in steps:
    assert 0.0 <= r['reward/reasoning_gym/mean'] <= 1.0
    seen = [n for n in NAMES if f'task/{n}/prompts' in r]
    assert seen and sum(r[f'task/{n}/prompts'] for n in seen) == 4
    for n in seen:
      assert 0.0 <= r[f'task/{n}/reward'] <= 1.0


def test_the_curriculum_moves_and_is_checkpointed(run):
  _, root = run
  recs = [r for r in records(root / 'run') if 'task/chain_sum/level' in r]
  last = {n: recs[-1][f'task/{n}/level'] for n in NAMES}
  assert max(last.values()) >= 1  # 4 completions fill a window: a dataset drawn rises
  _, meta = restore(root / 'run')
  saved = meta['streams']['rl_stream']
  assert saved['position'] == 2 * 4
  assert {n: float(v) for n, v in saved['source']['levels'].items()} == last
