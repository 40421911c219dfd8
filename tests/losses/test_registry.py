"""Tests for the name -> function tables of jrl.losses.registry.

The tables are consistent (every name has its argument list, every listed
argument is a keyword of its function); calling a `PolicyLoss` or an
`Advantage` is bit-identical to calling the function with its arguments,
jitted or not; None leaves a function's default; and an unknown name or
argument, or a value the kernel's own checks refuse, raises a ValueError
naming the field when the kernel is made. The numerics themselves are the
kernels' and are tested in test_policy.py, test_soft_policy.py and
test_advantages.py.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrl.losses as L
from jrl.losses import registry

B, T, G = 8, 6, 4

# Values of every loss's arguments; each loss takes those it lists.
LOSS_ARGS = {
  'eps_low': 0.2,
  'eps_high': 0.28,
  'dual_clip_c': 3.0,
  'log_ratio_clamp': None,
  'tau_pos': 1.0,
  'tau_neg': 2.0,
  'k_pos': 1.0,
  'lambda_pos': 3.0,
  'k_neg': 3.0,
  'lambda_neg': 2.0,
  'low': 0.6,
  'high': 4.0,
  'kl_tau': 0.01,
  'delta_low': 0.1,
  'delta_high': 0.3,
  'threshold': 0.05,
}
ADV_ARGS = {'scale': 'group', 'std': 'unbiased', 'eps': 1e-6, 'gamma': 0.9, 'kl_coef': 0.05}


def _batch(seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  mask = (jnp.arange(T)[None, :] < jnp.asarray([6, 5, 3, 1, 6, 2, 4, 6])[:, None]).astype(
    jnp.float32
  )
  old = -1.5 + 0.5 * jax.random.normal(k[0], (B, T))
  logp = old + 0.3 * jax.random.normal(k[1], (B, T))
  rewards = jax.random.uniform(k[2], (B,)).round(1)
  adv = L.broadcast_to_tokens(L.grpo_advantages(rewards, G), mask)
  kl = 0.1 * jax.random.normal(k[3], (B, T)) * mask
  return logp, old, adv, mask, rewards, kl


def _same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


# The tables ---------------------------------------------------------------------


@pytest.mark.parametrize(
  'fns, args', [(L.POLICY_LOSSES, L.POLICY_LOSS_ARGS), (L.ADVANTAGE_ESTIMATORS, L.ADVANTAGE_ARGS)]
)
def test_every_name_lists_keywords_of_its_function(fns, args):
  assert list(fns) == list(args)
  for name, fn in fns.items():
    params = inspect.signature(fn).parameters
    for key in args[name]:
      assert params[key].kind is inspect.Parameter.KEYWORD_ONLY, (name, key)


def test_advantage_kinds_partition_the_estimators():
  assert not set(L.OUTCOME_ADVANTAGES) & set(L.RETURN_ADVANTAGES)
  assert {**L.OUTCOME_ADVANTAGES, **L.RETURN_ADVANTAGES} == L.ADVANTAGE_ESTIMATORS
  assert set(L.GROUP_ADVANTAGES) <= set(L.ADVANTAGE_ESTIMATORS)


def test_the_tables_hold_the_public_functions():
  assert L.POLICY_LOSSES['ppo'] is L.ppo_clip_loss
  assert L.POLICY_LOSSES['vespo'] is L.vespo_loss
  assert L.POLICY_LOSSES['gmpo'] is L.gmpo_loss
  assert L.POLICY_LOSSES['dppo'] is L.dppo_loss
  assert L.ADVANTAGE_ESTIMATORS['loo'] is L.loo_advantages
  assert registry.KL_ESTIMATORS == L.KL_ESTIMATORS
  assert registry.AGGREGATION_MODES == L.AGGREGATION_MODES


# Lookups ------------------------------------------------------------------------


@pytest.mark.parametrize(
  'lookup, names',
  [(L.get_policy_loss, L.POLICY_LOSSES), (L.get_advantage_estimator, L.ADVANTAGE_ESTIMATORS)],
)
def test_unknown_name_lists_the_valid_names(lookup, names):
  with pytest.raises(ValueError, match='must be one of') as info:
    lookup('vtrace')
  assert str(tuple(names)) in str(info.value) and "'vtrace'" in str(info.value)


def test_unknown_name_error_names_the_field():
  with pytest.raises(ValueError, match=r'^`rl\.advantage` must be one of'):
    L.Advantage.make('vtrace', {})
  with pytest.raises(ValueError, match=r'^`rl\.policy_loss` must be one of'):
    L.PolicyLoss.make('reinforce', {})


def test_unknown_argument_is_named():
  with pytest.raises(
    ValueError, match=r'^`rl\.loss\.ppo\.eps_hgh` is not an argument of the policy'
  ):
    L.PolicyLoss.make('ppo', {'eps_hgh': 0.3})
  with pytest.raises(ValueError, match=r'^`rl\.adv\.grpo\.tau_pos` is not an argument of the adv'):
    L.Advantage.make('grpo', {'tau_pos': 1.0})
  # CISPO takes ε_high only: its lower bound stays off (MiniMax-M1).
  with pytest.raises(ValueError, match=r'`rl\.loss\.cispo\.eps_low` is not an argument'):
    L.PolicyLoss.make('cispo', {'eps_low': 0.01, 'eps_high': 0.3})


@pytest.mark.parametrize(
  'name, args, message',
  [
    ('ppo', {'eps_low': -0.1}, '`rl.loss.ppo.eps_low` must be > 0, got -0.1.'),
    ('ppo', {'eps_low': 1.0}, '`rl.loss.ppo.eps_low` must be < 1'),
    ('ppo', {'dual_clip_c': 0.5}, '`rl.loss.ppo.dual_clip_c` must be > 1, got 0.5.'),
    ('sapo', {'tau_pos': float('nan')}, '`rl.loss.sapo.tau_pos` must be > 0, got nan.'),
    ('icepop', {'low': 3.0, 'high': 2.0}, '`rl.loss.icepop.high` (2.0) must be > `rl.loss.icepop'),
    ('gspo', {'eps_high': '0.2'}, "`rl.loss.gspo.eps_high` must be a number, got '0.2' (str)."),
  ],
)
def test_a_value_the_kernel_refuses_is_refused_when_made(name, args, message):
  """`make` runs the kernel's own checks (traced, nothing computed), so a
  value fails when the config is read, with the field, not at the first step."""
  with pytest.raises(ValueError) as info:
    L.PolicyLoss.make(name, args)
  assert str(info.value).startswith(message)


@pytest.mark.parametrize(
  'name, args, message',
  [
    ('grpo', {'scale': 'groups'}, "`rl.adv.grpo.scale` must be one of ('group', 'batch', 'none')"),
    ('loo', {'normalize': 'no'}, "`rl.adv.loo.normalize` must be True or False, got 'no'."),
    ('reinforce_pp', {'gamma': 1.5}, '`rl.adv.reinforce_pp.gamma` must be in [0, 1], got 1.5.'),
  ],
)
def test_an_estimator_value_the_kernel_refuses_is_refused_when_made(name, args, message):
  with pytest.raises(ValueError) as info:
    L.Advantage.make(name, args)
  assert str(info.value).startswith(message)


def test_a_kernel_is_the_same_value_whether_defaults_are_spelled_or_not():
  """None and a function's own default leave it: equal kernels compute the
  same, so a config that spells every default equals a preset that does not."""
  assert L.PolicyLoss.make('ppo', {'eps_low': 0.2, 'eps_high': None}) == L.PolicyLoss('ppo')
  assert L.Advantage.make('loo', {'normalize': True, 'eps': 1e-6}) == L.Advantage('loo')
  assert L.PolicyLoss.make('ppo', {'eps_high': 0.28}).args == (('eps_high', 0.28),)
  assert hash(L.PolicyLoss.make('sapo', {'tau_neg': 1.5})) == hash(
    L.PolicyLoss.of('sapo', {'tau_neg': 1.5})
  )


def test_outcome_refuses_a_return_estimator():
  with pytest.raises(ValueError, match="'reinforce_pp' gives one advantage per token"):
    L.Advantage('reinforce_pp').outcome(jnp.zeros(4), 2)


# A kernel's call is the direct call ---------------------------------------------


def _loss_args(name):
  return {k: LOSS_ARGS[k] for k in L.POLICY_LOSS_ARGS[name] if LOSS_ARGS[k] is not None}


def _adv_args(name):
  return {k: ADV_ARGS[k] for k in L.ADVANTAGE_ARGS[name] if k in ADV_ARGS}


@pytest.mark.parametrize('name', list(L.POLICY_LOSSES))
@pytest.mark.parametrize('jit', [False, True])
def test_a_policy_loss_call_is_the_direct_call(name, jit):
  logp, old, adv, mask, *_ = _batch()
  loss = L.PolicyLoss.make(name, _loss_args(name))
  typed = lambda lp: loss(lp, old, adv, mask)
  direct = lambda lp: L.POLICY_LOSSES[name](lp, old, adv, mask, **_loss_args(name))
  if jit:
    typed, direct = jax.jit(typed), jax.jit(direct)
  _same(typed(logp), direct(logp))


def test_none_leaves_the_default():
  logp, old, adv, mask, *_ = _batch(1)
  logp = logp.at[0, 0].add(40.0)  # beyond SAPO's default clamp of 20
  sapo = L.PolicyLoss.make('sapo', {'log_ratio_clamp': None})(logp, old, adv, mask)
  _same(sapo, L.sapo_loss(logp, old, adv, mask, log_ratio_clamp=20.0))


def _direct_advantages(name, rewards, mask, kl):
  """What the trainer computed before the registry, estimator by estimator."""
  if name == 'grpo':
    return L.broadcast_to_tokens(L.grpo_advantages(rewards, G, eps=1e-6), mask)
  if name == 'loo':
    return L.broadcast_to_tokens(L.loo_advantages(rewards, G, eps=1e-6), mask)
  if name == 'dr_grpo':
    return L.broadcast_to_tokens(L.dr_grpo_advantages(rewards, G), mask)
  if name == 'rloo':
    return L.broadcast_to_tokens(L.rloo_advantages(rewards, G), mask)
  if name == 'reinforce_pp':
    token_rewards = L.token_level_rewards(rewards, mask, kl=kl, kl_coef=0.05)
    return L.reinforce_pp_advantages(token_rewards, mask, gamma=0.9)
  return L.reinforce_pp_baseline_advantages(rewards, mask, G, kl=kl, kl_coef=0.05, gamma=0.9)


@pytest.mark.parametrize('name', list(L.ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize('jit', [False, True])
def test_an_advantage_call_is_the_direct_call(name, jit):
  *_, mask, rewards, kl = _batch(2)
  estimator = L.Advantage.make(name, _adv_args(name))
  typed = lambda r, m, k: estimator(r, m, G, kl=k)
  direct = lambda r, m, k: _direct_advantages(name, r, m, k)
  if jit:
    typed, direct = jax.jit(typed), jax.jit(direct)
  adv = typed(rewards, mask, kl)
  _same(adv, direct(rewards, mask, kl))
  assert adv.shape == (B, T) and np.all(np.asarray(adv)[np.asarray(mask) == 0] == 0.0)


def test_outcome_takes_every_argument():
  rewards = jnp.asarray([1.0, 0.0, 0.0, 0.0], jnp.float32)
  args = {'scale': 'none', 'std': 'biased', 'eps': 0.0, 'singleton': 'raw'}
  got = L.Advantage.make('grpo', args).outcome(rewards, 1)
  _same(got, L.grpo_advantages(rewards, 1, scale='none', std='biased', eps=0.0, singleton='raw'))
  np.testing.assert_array_equal(got, rewards)


@pytest.mark.parametrize('mode', L.AGGREGATION_MODES)
def test_aggregate_loss_norm_rule(mode):
  logp, _, _, mask, *_ = _batch(3)
  norm = {'norm': T} if mode == 'seq-mean-token-sum-norm' else {}
  _same(L.aggregate_loss(logp, mask, mode), L.aggregate(logp, mask, mode, **norm))
  if mode == 'seq-mean-token-sum-norm':
    _same(
      L.aggregate_loss(logp, mask, mode, loss_norm=3.0), L.aggregate(logp, mask, mode, norm=3.0)
    )
  else:  # the other modes ignore loss_norm
    _same(L.aggregate_loss(logp, mask, mode, loss_norm=3.0), L.aggregate(logp, mask, mode))


@pytest.mark.parametrize('name', list(L.ADVANTAGE_ESTIMATORS))
def test_an_advantage_leaves_invalid_rows_out(name):
  """Rows 1 and 6 (one of each group) left out: 0 on their tokens, and on the
  others what the batch without those rows gives (groups of G − 1)."""
  *_, mask, rewards, kl = _batch(4)
  valid = np.ones(B, bool)
  valid[[1, 6]] = False
  nan = jnp.where(jnp.asarray(valid), rewards, jnp.nan)  # a left-out reward is never read
  estimator = L.Advantage.make(name, _adv_args(name))
  got = jax.jit(lambda r, m, k, v: estimator(r, m, G, kl=k, valid=v))(nan, mask, kl, valid)
  without = estimator(rewards[valid], mask[valid], G - 1, kl=kl[valid])
  np.testing.assert_array_equal(np.asarray(got)[~valid], 0.0)
  np.testing.assert_allclose(np.asarray(got)[valid], without, rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(without)).sum() > 0


@pytest.mark.parametrize('mode', L.AGGREGATION_MODES)
def test_aggregate_loss_num_seqs_replaces_b_in_the_seq_mean_modes(mode):
  logp, _, _, mask, *_ = _batch(5)
  got = L.aggregate_loss(logp, mask, mode, num_seqs=3.0)
  if mode.startswith('seq-mean'):
    norm = {'norm': T} if mode == 'seq-mean-token-sum-norm' else {}
    _same(got, L.aggregate(logp, mask, mode, num_seqs=3.0, **norm))
  else:  # the token modes ignore it
    _same(got, L.aggregate_loss(logp, mask, mode))
