"""The policy losses GMPO, IcePop, DPPO, KPop and plain importance sampling
in the trainer: an asynchronous run refuses an objective that bounds no
ratio (`rl.allow_unbounded_async`), and the trainer's loss leaves the rows
`valid` drops out of every term, as for the other losses.

The presets that seed these losses ('trl_gmpo', 'prime_rl') are checked
against `grpo_loss` with the others in test_loss_settings.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import losses as L
from jrl import trainers
from jrl.trainers import policy_step
from tests.helpers import shrunk_config, step_config

ASYNC = {'topology.kind': 'async', 'topology.max_staleness': 2}
ONE_STEP_OFF = {'topology.kind': 'one_step_off', 'topology.staleness': 1}
FIELD = re.escape('`rl.allow_unbounded_async`')


@pytest.mark.parametrize('topology', [ASYNC, ONE_STEP_OFF], ids=['async', 'one_step_off'])
def test_a_stale_run_refuses_an_unbounded_loss_naming_the_field(tmp_path, topology):
  config = shrunk_config(tmp_path, {**topology, 'rl.policy_loss': 'importance_sampling'})
  with pytest.raises(
    ValueError, match=rf"^{FIELD}: is False, but .*rl.policy_loss='importance_sampling'"
  ) as info:
    trainers.validate(config, 1)
  assert 'tinker-cookbook PR #822' in str(info.value)
  assert 'rl.allow_unbounded_async=True' in str(info.value)


def test_a_bound_set_past_its_limit_is_refused_too(tmp_path):
  fields = {**ASYNC, 'rl.policy_loss': 'dppo', 'rl.loss.dppo.delta_high': 1.0}
  config = shrunk_config(tmp_path, fields)
  with pytest.raises(ValueError, match=rf'^{FIELD}: .*delta_high=1\.0'):
    trainers.validate(config, 1)


BOUNDED = ('ppo', 'gspo', 'gmpo', 'cispo', 'sapo', 'vespo', 'icepop', 'dppo', 'kpop')


@pytest.mark.parametrize('loss', BOUNDED)
def test_a_stale_run_accepts_a_bounded_loss(tmp_path, loss):
  trainers.validate(shrunk_config(tmp_path, {**ASYNC, 'rl.policy_loss': loss}), 1)


@pytest.mark.parametrize(
  'fields',
  [
    {**ASYNC, 'rl.allow_unbounded_async': True},  # said so
    {'topology.kind': 'async', 'topology.max_staleness': 0},  # synchronous
    {'topology.kind': 'one_step_off', 'topology.staleness': 0},
    {},  # colocated
  ],
  ids=['allowed', 'async_k0', 'one_step_off_k0', 'colocated'],
)
def test_an_unbounded_loss_runs_where_it_is_allowed_or_fresh(tmp_path, fields):
  config = shrunk_config(tmp_path, {**fields, 'rl.policy_loss': 'importance_sampling'})
  trainers.validate(config, 1)


@pytest.mark.parametrize(
  'field, value, message',
  [
    ('rl.loss.gmpo.eps_low', 0.0, 'must be > 0'),
    ('rl.loss.dppo.delta_high', -0.1, 'must be >= 0'),
    ('rl.loss.kpop.threshold', 0.0, 'must be > 0'),
    ('rl.loss.icepop.low', 5.0, '(5.0) must be > `rl.loss.icepop.low` (5.0)'),
  ],
)
def test_a_bad_setting_is_refused_by_name(tmp_path, field, value, message):
  config = shrunk_config(tmp_path, {field: value})
  named = 'rl.loss.icepop.high' if field == 'rl.loss.icepop.low' else field
  with pytest.raises(ValueError, match=rf'^`{re.escape(named)}` {re.escape(message)}'):
    trainers.validate(config, 1)


# Rows left out -------------------------------------------------------------------

B, T = 6, 5


def _batch(seed):
  k = jax.random.split(jax.random.key(seed), 4)
  mask = jnp.arange(T)[None, :] < jax.random.randint(k[0], (B, 1), 2, T + 1)
  old = -jax.random.uniform(k[1], (B, T), minval=0.1, maxval=2.5) * mask
  logp = (old + 0.6 * jax.random.normal(k[2], (B, T))) * mask
  adv = jnp.repeat(jax.random.normal(k[3], (B, 1)), T, axis=1) * mask
  return logp, old, adv, mask


@pytest.mark.parametrize('loss', ['gmpo', 'importance_sampling', 'icepop', 'dppo', 'kpop'])
def test_rows_valid_leaves_out_are_in_no_term(loss):
  """The trainer's loss with row 2 left out by `valid` equals its loss on the
  batch without row 2, and row 2 gets no gradient."""
  logp, old, adv, mask = _batch(0)
  agg = 'seq-mean-token-mean' if loss == 'gmpo' else 'token-mean'
  cfg = step_config(policy_loss=loss, loss_agg=agg, loss_args=None)

  def objective(logp, old, adv, mask, valid=None):
    batch = policy_step.PolicyBatch(
      tokens=jnp.zeros(logp.shape, jnp.int32),
      mask=mask,
      loss_mask=mask,
      old_logp=old,
      ref_logp=jnp.zeros_like(old),
      advantages=adv,
      valid=valid,
    )
    return policy_step.objective(logp, jnp.zeros_like(logp), None, batch, cfg)[0]

  valid = jnp.arange(B) != 2
  loss_value, grad = jax.value_and_grad(objective)(logp, old, adv, mask, valid)
  keep = np.asarray(valid)
  want = objective(*(x[keep] for x in (logp, old, adv, mask)))
  np.testing.assert_allclose(loss_value, want, rtol=1e-6)
  assert np.all(np.asarray(grad)[2] == 0.0)
  assert float(jnp.abs(grad).sum()) > 0
  # The trainer's loss is the kernel's, aggregated.
  kernel = L.aggregate(L.POLICY_LOSSES[loss](logp, old, adv, mask)[0], mask, agg)
  np.testing.assert_allclose(objective(logp, old, adv, mask), kernel, rtol=1e-6)
