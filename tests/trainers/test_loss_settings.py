"""Loss settings in the config: `rl.loss.<policy loss>.<argument>` and
`rl.adv.<estimator>.<argument>` under the kernels' own names and defaults,
and the GRPO presets seeding them (`configs.common.seed_preset`).

The presets' reference is `jrl.losses.grpo_loss(preset=...)`, which composes
the kernels directly; the trainer's loss (`policy_step.objective` and
`policy_step.advantages`, from the configs the run reads) must equal it.
"""

import inspect
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from configs import common as config_common
from configs import grpo_qwen
from jrl import losses as L
from jrl import trainers
from jrl.trainers import policy_step
from tests.helpers import REPO, set_fields, shrunk_config

B, G, T = 8, 4, 6


def test_every_setting_is_a_kernel_argument_with_the_kernels_default(tmp_path):
  rl = shrunk_config(tmp_path).rl
  for section, table, args in (
    ('loss', L.POLICY_LOSSES, L.POLICY_LOSS_ARGS),
    ('adv', L.ADVANTAGE_ESTIMATORS, L.ADVANTAGE_ARGS),
  ):
    assert set(rl[section]) == set(table), section
    for name, fn in table.items():
      params = inspect.signature(fn).parameters
      expected = {k: params[k].default for k in args[name] if k not in L.SUPPLIED_ARGS}
      assert dict(rl[section][name]) == expected, (section, name)


def test_a_setting_of_another_loss_does_not_reach_the_chosen_one(tmp_path):
  config = shrunk_config(tmp_path, {'rl.policy_loss': 'ppo', 'rl.loss.gspo.eps_low': 0.1})
  assert policy_step.objective_of(config.rl).policy == L.PolicyLoss('ppo')  # eps_low 0.2
  config = shrunk_config(tmp_path, {'rl.policy_loss': 'gspo', 'rl.loss.gspo.eps_low': 0.1})
  gspo = policy_step.objective_of(config.rl).policy
  assert gspo == L.PolicyLoss('gspo', (('eps_low', 0.1),))  # eps_high: the kernel's 4e-4


@pytest.mark.parametrize(
  'field, value, message',
  [
    ('rl.adv.grpo.scale', 'groups', "must be one of ('group', 'batch', 'none')"),
    ('rl.adv.grpo.singleton', 'drop', "must be one of ('zero', 'raw', 'error')"),
    ('rl.loss.cispo.eps_high', -0.1, 'must be > 0'),
    ('rl.loss.vespo.lambda_neg', float('nan'), 'must be > 0'),
    ('rl.loss.ppo.eps_low', 1.0, 'must be < 1'),
    ('rl.loss.icepop.low', 6.0, '(5.0) must be > `rl.loss.icepop.low` (6.0)'),
    ('rl.adv.reinforce_pp.gamma', 1.01, 'must be in [0, 1]'),
  ],
)
def test_a_bad_setting_is_refused_by_name(tmp_path, field, value, message):
  """Each kernel's own checks, run once when the config is validated: the
  message names the field whichever section it is in, chosen or not."""
  config = shrunk_config(tmp_path)
  config.unlock()  # a str or NaN where a number was: what `ignore_type` overrides carry
  section = config.rl
  *path, key = field.split('.')[1:]
  for part in path:
    section = section[part]
  section[key] = value
  if field.startswith('rl.loss.icepop'):
    field = 'rl.loss.icepop.high'
  with pytest.raises(ValueError, match=rf'^`{re.escape(field)}` {re.escape(message)}'):
    trainers.validate(config, 1)


def test_a_setting_no_kernel_takes_is_refused_by_name(tmp_path):
  config = shrunk_config(tmp_path)
  config.unlock()
  config.rl.loss.sapo.eps_low = 0.2  # an argument of ppo, not of sapo
  with pytest.raises(ValueError, match=r'^`rl\.loss\.sapo\.eps_low` is not an argument of'):
    trainers.validate(config, 1)


def _inputs(seed):
  k = jax.random.split(jax.random.key(seed), 5)
  mask = jnp.arange(T)[None, :] < jax.random.randint(k[0], (B, 1), 2, T + 1)
  logp = -jax.random.uniform(k[1], (B, T), minval=0.1, maxval=3.0) * mask
  old_logp = (logp + 0.3 * jax.random.normal(k[2], (B, T))) * mask
  ref_logp = (logp + 0.5 * jax.random.normal(k[3], (B, T))) * mask
  rewards = jax.random.bernoulli(k[4], 0.5, (B,)).astype(jnp.float32)
  rewards = rewards.at[:G].set(1.0)  # one group with no variance
  return logp, old_logp, ref_logp, rewards, mask


@pytest.mark.parametrize('name', sorted(L.PRESETS))
def test_a_seeded_config_trains_the_presets_grpo(tmp_path, name):
  """`seed_preset(config, name)`, read as the trainer reads it, gives the
  same advantages, loss, gradient and policy-loss value as `grpo_loss` with
  that preset, on a batch with large ratios, negative advantages and a
  zero-variance group."""
  config = config_common.seed_preset(shrunk_config(tmp_path), name)
  set_fields(config, {'rl.group_size': G})
  trainers.validate(config, 1)
  cfg = policy_step.step_config(config.rl)
  assert cfg.objective == L.PRESETS[name]  # the same value, from the config
  logp, old_logp, ref_logp, rewards, mask = _inputs(sorted(L.PRESETS).index(name))
  adv = policy_step.advantages(rewards, mask, G, cfg.objective.advantage)

  def trainer(logp):
    batch = policy_step.PolicyBatch(
      tokens=jnp.zeros((B, T), jnp.int32),
      mask=mask,
      loss_mask=mask,
      old_logp=old_logp,
      ref_logp=ref_logp,
      advantages=adv,
    )
    return policy_step.objective(logp, jnp.zeros_like(logp), None, batch, cfg)

  def reference(logp):
    return L.grpo_loss(logp, old_logp, ref_logp, rewards, mask, group_size=G, preset=name)

  (loss, metrics), grad = jax.value_and_grad(trainer, has_aux=True)(logp)
  (want, want_metrics), want_grad = jax.value_and_grad(reference, has_aux=True)(logp)
  np.testing.assert_allclose(loss, want, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics['actor/pg_loss'], want_metrics['pg_loss'], rtol=1e-6)
  assert float(jnp.abs(want_grad).sum()) > 0


def test_a_bound_is_set_and_turned_off_on_the_command_line(monkeypatch):
  """The optional numbers parse as Python literals, so `=None` turns off a
  bound that the config file (here the veRL preset's dual clip) sets."""
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config', flag_values=flag_values)
  path = os.path.join(REPO, 'configs', 'grpo_qwen.py')
  argv = [
    'train.py',
    f'--config={path}',
    '--config.rl.loss.ppo.dual_clip_c=None',
    '--config.rl.kl.output_clamp=5',
    '--config.rl.loss.sapo.tau_neg=1.2',
    '--config.rl.adv.grpo.scale=batch',
  ]
  monkeypatch.setattr(sys, 'argv', argv)  # where config_flags reads the overrides
  flag_values(argv)
  rl = flag_values.config.rl
  assert grpo_qwen.get_config().rl.loss.ppo.dual_clip_c == 3.0
  objective = policy_step.objective_of(rl)
  assert 'dual_clip_c' not in objective.policy.kwargs  # None: the kernel's default, off
  assert objective.policy.kwargs['log_ratio_clamp'] == 20.0  # the rest of the preset stays
  assert objective.kl_output_clamp == 5 and rl.loss.sapo.tau_neg == 1.2
  assert objective.advantage.kwargs['scale'] == 'batch'
