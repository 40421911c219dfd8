"""Packed runs (`train.packing`, `train.micro_batch_tokens`): one iteration of each
kind of trainer logs the padded run's figures, and a run with the TPU splash
kernel (Pallas interpret mode here) on a mesh trains as the XLA path. The
loss-level checks are in `test_packed_training.py`.
"""

import numpy as np
import pytest

from configs import agent_arith, dpo_arith, grpo_arith, ppo_arith, sft_arith
from jrl import trainers
from jrl.models import attention_kernels
from jrl.trainers.rollouts import episodes
from tests.helpers import QUIET, records, set_fields

# A run: packing changes nothing but the rows ------------------------------------


def digit_share(prompts, completions, metadata):
  """A reward with spread on an untrained model: the share of digits."""
  del prompts, metadata
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


# GRPO, PPO, the agent and SFT run packed with token-budget micro-batches of
# one row per batch shard (4 data shards x 2 tensor): several micro-batches
# per minibatch.
ONLINE = {'mesh.data': 4, 'mesh.tensor': 2}
RUNS = {
  'grpo': (
    grpo_arith,
    ONLINE,
    ['actor/pg_loss', 'actor/entropy', 'actor/grad_norm', 'actor/kl_ref'],
  ),
  'ppo': (
    ppo_arith,
    ONLINE,
    ['actor/pg_loss', 'actor/entropy', 'actor/grad_norm', 'critic/vf_loss'],
  ),
  # The agent's episode runner (environment tokens in the loss: the test below).
  'agent': (
    agent_arith,
    {**ONLINE, 'agent.sft_tool_frac': 0.9, 'sft.steps': 2},
    ['actor/pg_loss', 'actor/entropy', 'actor/grad_norm', 'actor/kl_ref'],
  ),
  'sft': (sft_arith, ONLINE, ['sft/nll', 'sft/grad_norm']),
  'dpo': (dpo_arith, {}, ['dpo/loss', 'dpo/grad_norm', 'logps/chosen', 'logps/rejected']),
}


def with_spread(make_env):
  """The arithmetic environment, its final reward the share of digits (a
  reward with spread on a model that has barely trained)."""

  def make(tokenizer):
    env = make_env(tokenizer)
    env.final_reward = lambda text: digit_share(None, [text], None)[0]
    return env

  return make


@pytest.mark.parametrize('name', sorted(RUNS))
def test_a_packed_step_logs_the_padded_steps_figures(tmp_path, monkeypatch, name):
  """One iteration of each kind of trainer, padded and packed (for GRPO and
  PPO the same rollout: the sampler runs before any update; with a
  reference model, whose logprobs are packed too): the same losses and
  gradient norms."""
  module, fields, keys = RUNS[name]
  if name == 'agent':
    task_cls, make_env = episodes.ENVIRONMENTS['arith_tool']
    monkeypatch.setitem(episodes.ENVIRONMENTS, 'arith_tool', (task_cls, with_spread(make_env)))
  logged = {}
  for packed in (False, True):
    workdir = tmp_path / f'packed_{packed}'
    config = module.get_config('smoke')
    seq_len = config.task.max_prompt_len + config.task.max_response_len
    own_steps = {'dpo': 'dpo.steps', 'sft': 'sft.steps'}.get(name, 'rl.steps')
    overrides = {**QUIET, 'workdir': str(workdir), 'sft.steps': 0, own_steps: 1}
    overrides.update({'train.packing': packed, 'train.pack_row_len': 4 * seq_len, **fields})
    if name in ('grpo', 'ppo', 'agent', 'sft'):
      if packed:
        overrides.update({'train.pack_row_len': seq_len, 'train.micro_batch_tokens': seq_len})
      if name != 'sft':
        overrides['rl.kl_coef'] = 0.01
    if name in ('grpo', 'ppo'):
      overrides['reward.functions'] = (f'{__name__}:digit_share',)
      overrides['reward.mode'] = 'inline'
    trainers.run(set_fields(config, overrides))
    logged[packed] = records(str(workdir))[-1]
  padded, packed = logged[False], logged[True]
  for key in keys:
    # A figure that depends on the model. The KL to the reference at the first
    # step is exactly 0 now that both passes run the same program.
    assert padded[key] != 0 or key == 'actor/kl_ref', key
    np.testing.assert_allclose(packed[key], padded[key], rtol=1e-4, atol=1e-6, err_msg=key)
  if name not in ('grpo', 'ppo', 'agent'):
    return
  assert padded['advantages/std'] > 0  # a loss with gradients to compare
  # Padded rows run in one pass, cut to the batch's longest sequence.
  assert 'throughput/micro_batches' not in padded
  assert padded['throughput/real_token_frac_padded'] <= padded['throughput/real_token_frac_packed']
  assert packed['throughput/micro_batches'] >= 2
  assert 0 < packed['throughput/real_token_frac_packed'] <= 1
  assert 0 < packed['throughput/real_token_frac_padded'] <= 1


def test_splash_attention_trains_as_the_xla_path(tmp_path, monkeypatch):
  """`model.attention='splash'` on a 4 data x 2 tensor mesh: the trainer
  traces its steps under the mesh (`parallel.on_mesh`), so the kernel runs
  once per shard (Pallas interpret mode on the CPU); packed rows of 128
  tokens. One SFT step logs the XLA path's loss and gradient norm."""
  meshes = []
  sharded = attention_kernels.sharded_splash_attention

  def counted(*args, mesh, **kwargs):
    meshes.append(dict(mesh.shape))
    return sharded(*args, mesh=mesh, **kwargs)

  monkeypatch.setattr(attention_kernels, 'sharded_splash_attention', counted)
  logged = {}
  for attention in ('xla', 'splash'):
    workdir = tmp_path / attention
    overrides = {**QUIET, **ONLINE, 'workdir': str(workdir), 'sft.steps': 1}
    overrides.update({'model.attention': attention, 'train.packing': True})
    overrides.update({'train.pack_row_len': 128, 'model.head_dim': 16})
    trainers.run(set_fields(sft_arith.get_config('smoke'), overrides))
    logged[attention] = records(str(workdir))[-1]
  for key in ('sft/nll', 'sft/grad_norm'):
    assert logged['xla'][key] > 0, key
    np.testing.assert_allclose(logged['splash'][key], logged['xla'][key], rtol=1e-5, err_msg=key)
  # Traced per shard on the run's mesh (in interpret mode jit could split the bare kernel).
  assert meshes and all(m['data'] == 4 and m['tensor'] == 2 for m in meshes)
