"""The RLHF pipeline in miniature: SFT (exported) -> a Bradley-Terry reward
model from its backbone (exported) -> PPO with that reward model as the
reward and the critic's initialisation, with reward normalisation and
clipping; and the generative judge as a preference labeller (`launch/label.py`,
which runs the same `GenerativeJudge` that `reward.judge_path` uses).

The preference here is trivially learnable (the chosen response is always
"yes", the rejected "no"), so a few steps show the mechanics: the loss
falls and held-out pairwise accuracy reaches 1.
"""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from jrl import trainers
from jrl.metrics import read_jsonl
from jrl.models import hf
from jrl.models.tokenizer import load_tokenizer
from jrl.rewards.model import RewardModel
from jrl.trainers import common, controller, online
from jrl.trainers.rollouts import rollout
from tests.helpers import QUIET, restore, shrunk_config


def write_pairs(path, n, seed):
  rng = np.random.default_rng(seed)
  with open(path, 'w', encoding='utf-8') as f:
    for _ in range(n):
      a, b = rng.integers(10, 99, 2)
      f.write(json.dumps({'prompt': f'{a}+{b}=', 'chosen': 'yes', 'rejected': 'no'}) + '\n')


@pytest.fixture(scope='module')
def pipeline(tmp_path_factory):
  root = tmp_path_factory.mktemp('rlhf')
  out = {'root': root}
  # Stage 1: SFT, exported.
  sft = shrunk_config(str(root / 'sft'), {**QUIET, 'algorithm': 'sft', 'export_hf': True})
  trainers.run(sft)
  out['sft_export'] = str(root / 'sft' / 'hf_export')
  # Stage 2: the reward model.
  write_pairs(root / 'train.jsonl', 64, 0)
  write_pairs(root / 'eval.jsonl', 16, 1)
  rm = shrunk_config(
    str(root / 'rm'),
    {
      'algorithm': 'reward_model',
      'model.path': out['sft_export'],
      'rm.steps': 12,
      'rm.pairs_per_step': 8,
      'rm.train_path': str(root / 'train.jsonl'),
      'rm.eval_path': str(root / 'eval.jsonl'),
      'optim.lr': 3e-3,
      'eval.every': 6,
      'log.plot': False,
      'log.tensorboard': False,
      'export_hf': True,
      'checkpoint.every': 6,
    },
  )
  trainers.run(rm)
  out['rm_export'] = str(root / 'rm' / 'hf_export')
  out['rm_records'] = read_jsonl(str(root / 'rm' / 'metrics.jsonl'))
  return out


def test_reward_model_learns_the_preference(pipeline):
  records = pipeline['rm_records']
  evals = [r for r in records if 'eval/pair_accuracy' in r]
  assert [r['step'] for r in evals] == [0, 6, 12]
  assert evals[-1]['eval/pair_accuracy'] == 1.0
  assert evals[-1]['eval/margin'] > evals[0]['eval/margin']
  losses = [r['rm/loss'] for r in records if 'rm/loss' in r]
  assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3])
  for key in ('rm/accuracy', 'rm/margin', 'rm/chosen', 'rm/rejected', 'rm/grad_norm'):
    assert key in records[-1], key


def test_reward_model_export_scores_like_the_trainer(pipeline):
  export = pipeline['rm_export']
  with open(os.path.join(export, 'config.json'), encoding='utf-8') as f:
    arch = json.load(f)['architectures'][0]
  assert arch.endswith('ForSequenceClassification')
  rm = RewardModel.load(export, load_tokenizer('char'), batch_size=4)
  chosen = rm(['12+34=', '56+78='], ['yes', 'yes'])
  rejected = rm(['12+34=', '56+78='], ['no', 'no'])
  assert all(c > r for c, r in zip(chosen, rejected, strict=True))


def test_ppo_against_the_reward_model_with_normalisation(pipeline):
  root = pipeline['root']
  config = shrunk_config(
    str(root / 'ppo'),
    {
      **QUIET,
      'algorithm': 'ppo',
      'model.path': pipeline['sft_export'],
      'sft.steps': 0,
      'rl.steps': 2,
      'rl.kl_coef': 0.05,
      'rl.kl_in': 'reward',
      'reward.functions': ('reward_model',),
      'reward.model_path': pipeline['rm_export'],
      'reward.mode': 'inline',
      'reward.normalize': True,
      'reward.clip': 1.5,
      'ppo.critic_path': pipeline['rm_export'],
    },
  )
  job = trainers.build(config)
  # The critic starts as the reward model.
  critic = nnx.to_pure_dict(job.state.extra.critic.params)
  rm = hf.to_host(hf.load(pipeline['rm_export'], lm_head=False, scalar_head=True).params)
  np.testing.assert_array_equal(np.asarray(critic['score']['kernel']).T, rm['score.weight'])
  state = controller.train(job)
  records = read_jsonl(str(root / 'ppo' / 'metrics.jsonl'))
  rows = config.rl.prompts_per_step * config.rl.group_size
  last = records[-1]
  assert 'reward/reward_model/mean' in last
  assert last['reward/reward_model/failures'] == 0
  assert last['reward/reward_model/unscored'] == 0
  assert rows == 16
  assert last['reward/running_std'] > 0
  assert abs(last['reward/shaped_mean']) <= 1.5
  assert -1.0 <= last['reward/length_corr'] <= 1.0
  assert jax.tree.leaves(state.params)
  # The running moments live in the train state: both steps' rewards folded
  # in, and checkpointed with it, so a resumed run normalises alike.
  moments = state.extra.reward_moments
  assert float(moments.count) == 2 * rows
  np.testing.assert_allclose(float(moments.mean), last['reward/running_mean'], rtol=1e-6)
  saved, meta = restore(str(root / 'ppo'))
  assert 'reward_moments' not in meta
  held = saved['extra']['reward_moments']  # a dict of the fields, as Orbax reads it back
  assert {k: float(held[k]) for k in moments._fields} == moments._asdict()


def test_reward_moments_fold_batch_by_batch_in_the_train_state():
  """Two batches shaped one after the other: the moments in the state are
  those of both batches at once, and each batch is normalised by the moments
  that include it."""
  reward_config = ml_collections.ConfigDict({'normalize': True, 'clip': 0.0})
  extra = common.AlgorithmState(reward_moments=online.reward_state(reward_config))
  state = common.TrainState(jnp.int32(0), {}, (), extra)
  rng = np.random.default_rng(0)
  first, second = rng.normal(3.0, 2.0, 16), rng.normal(-1.0, 0.5, 8)
  m = {}
  state, _ = online.shape_rewards(state, first, reward_config, m)
  state, shaped = online.shape_rewards(state, second, reward_config, m)
  both = np.concatenate([first, second])
  count, mean, m2 = (float(x) for x in state.extra.reward_moments)
  assert count == both.size
  np.testing.assert_allclose([mean, m2 / count], [both.mean(), both.var()], rtol=1e-6)
  np.testing.assert_allclose(shaped, (second - both.mean()) / both.std(), rtol=1e-5, atol=1e-6)
  assert m['reward/running_std'] == pytest.approx(both.std(), rel=1e-6)
  # Without normalisation only the clip applies, and the state holds nothing.
  plain = ml_collections.ConfigDict({'normalize': False, 'clip': 1.0})
  assert online.reward_state(plain) is None
  _, clipped = online.shape_rewards(state, first, plain, {})
  np.testing.assert_array_equal(clipped, np.clip(first, -1, 1).astype(np.float32))


def test_reward_model_config_errors_name_the_field(tmp_path, pipeline):
  config = shrunk_config(
    str(tmp_path), {'algorithm': 'reward_model', 'model.path': pipeline['sft_export']}
  )
  # A config without the section the algorithm reads (here: a GRPO config's sections).
  config.unlock()
  del config['rm']
  config.lock()
  with pytest.raises(ValueError, match=r"^`rm`: algorithm 'reward_model' reads this section"):
    trainers.build(config)
  config = shrunk_config(
    str(tmp_path),
    {'algorithm': 'reward_model', 'model.path': pipeline['sft_export'], 'rm.center_coef': -1.0},
  )
  with pytest.raises(ValueError, match=r'`rm\.center_coef`'):
    trainers.build(config)


def _label_module():
  import importlib.util

  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  spec = importlib.util.spec_from_file_location('label', f'{repo}/launch/label.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_label_cli_counts_and_never_guesses(pipeline, tmp_path, capsys):
  label = _label_module()
  pairs = tmp_path / 'pairs.jsonl'
  pairs.write_text(
    '\n'.join(
      json.dumps({'prompt': f'{a}+1=', 'completion_a': str(a + 1), 'completion_b': str(a)})
      for a in (10, 20, 30)
    )
  )
  out = tmp_path / 'prefs.jsonl'
  args = ['--judge', pipeline['sft_export'], '--tokenizer', 'char', '--rubric', 'Is it correct?']
  args += ['--input', str(pairs), '--output', str(out), '--max_new_tokens', '8']
  args += ['--max_prompt_len', '1024', '--num_slots', '8']
  stats = label.main(args)
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  # The tiny judge writes no verdicts: all three pairs are dropped, none guessed.
  assert printed['input'] == 3 and stats['kept'] == 0 and stats['dropped'] == 3
  assert stats['unparseable'] == 3
  assert out.exists() and out.read_text().strip() == ''
  pairs.write_text(json.dumps({'prompt': 'x', 'completion_a': 1, 'completion_b': 'y'}) + '\n')
  with pytest.raises(ValueError, match=r'pairs\.jsonl:1: field `completion_a`'):
    label.main(args)


def test_judge_path_adds_a_judge_reward_function(pipeline, tmp_path):
  config = shrunk_config(
    str(tmp_path),
    {
      **QUIET,
      'reward.functions': ('exact_match', 'judge'),
      'reward.weights': (1.0, 0.5),
      'reward.judge_path': pipeline['sft_export'],
      'reward.judge_rubric': 'Is the sum right?',
      'reward.mode': 'inline',
    },
  )
  job = trainers.build(config)
  fns = rollout.inline_reward_fns(config.reward, job.resources.tokenizer, job.resources.mesh)
  assert set(fns) == {'judge'} and callable(fns['judge'])
  controller.close(job)
