"""Every objective of `jrl.losses` by name: the one table from a name to its function.

The trainer (`jrl.trainers.policy_step`, from `config.rl`) and the GRPO presets
(`jrl.losses.presets`) both go from a name to a function through this module;
neither keeps a table of its own. Adding a policy loss is: write the kernel in
`jrl/losses/policy.py`, add one entry to `POLICY_LOSSES` and one to
`POLICY_LOSS_ARGS` (the keyword arguments callers may set), say whether and
by which argument it bounds the update (`UNBOUNDED_POLICY_LOSSES`,
`_UPPER_BOUNDS`: asynchronous runs refuse an unbounded one), and give any
new argument a config field (see `jrl/losses/README.md`).

| table                  | name →                                                  |
|------------------------|---------------------------------------------------------|
| `POLICY_LOSSES`        | f(logp, old_logp, advantages, mask, *, ..., axis_name)  |
|                        | -> (loss [B, T], metrics); all of `jrl.losses.policy`   |
| `ADVANTAGE_ESTIMATORS` | outcome (`OUTCOME_ADVANTAGES`):                         |
|                        | f(rewards [B], group_size, *, valid, ...) -> [B];       |
|                        | returns (`RETURN_ADVANTAGES`):                          |
|                        | f(rewards [B], mask [B, T], group_size, *, kl, valid,   |
|                        | ...) -> [B, T]                                          |
| `KL_ESTIMATORS`        | the `estimator` of `kl_penalty` (dispatched there)      |
| `AGGREGATION_MODES`    | the `mode` of `aggregate` (dispatched there)            |

Hyperparameters travel as one mapping of plain values keyed by the
functions' keyword names (`{'eps_low': 0.2, 'tau_pos': 1.0, ...}`), the same
mapping whichever function the name picks: `policy_loss_by_name` forwards
the keys its entry in `POLICY_LOSS_ARGS` lists and leaves the others, so a
caller need not know which loss takes what. Two rules keep this explicit:

* a value of None is not forwarded, so the function's default applies (the
  trainer's `log_ratio_clamp` of None leaves SAPO's default clamp of 20 and
  PPO's default of no clamp);
* a key that no function of the table takes raises, naming it.

Nothing here sees a config: names and values are plain strings and numbers.
"""

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from jrl.losses import advantages as adv_lib
from jrl.losses import kl as kl_lib
from jrl.losses import policy, reductions
from jrl.losses._checks import check_choice, check_same_shape

# Policy losses -----------------------------------------------------------------

POLICY_LOSSES: dict[str, Callable] = {
  'ppo': policy.ppo_clip_loss,
  'gspo': policy.gspo_loss,
  'gmpo': policy.gmpo_loss,
  'cispo': policy.cispo_loss,
  'sapo': policy.sapo_loss,
  'vespo': policy.vespo_loss,
  'importance_sampling': policy.importance_sampling_loss,
  'icepop': policy.icepop_loss,
  'dppo': policy.dppo_loss,
  'kpop': policy.kpop_loss,
}

# The keyword arguments `policy_loss_by_name` forwards to each loss; the
# others keep the function's defaults. CISPO takes ε_high only: its lower
# bound stays off (MiniMax-M1), whatever `eps_low` the caller sets for PPO.
POLICY_LOSS_ARGS: dict[str, tuple[str, ...]] = {
  'ppo': ('eps_low', 'eps_high', 'dual_clip_c', 'log_ratio_clamp'),
  'gspo': ('eps_low', 'eps_high'),
  'gmpo': ('eps_low', 'eps_high'),
  'cispo': ('eps_high',),
  'sapo': ('tau_pos', 'tau_neg', 'log_ratio_clamp'),
  'vespo': ('k_pos', 'lambda_pos', 'k_neg', 'lambda_neg'),
  'importance_sampling': ('log_ratio_clamp',),
  'icepop': ('low', 'high', 'kl_tau'),
  'dppo': ('delta_low', 'delta_high', 'kl_tau'),
  'kpop': ('threshold', 'kl_tau'),
}


# Which policy losses bound how far one update moves a token's probability
# from the behaviour policy's. With a stale rollout (one-step-off, async) the
# ratio π/π_old of an unbounded loss grows without limit (tinker-cookbook
# PR #822: the unclipped importance-sampling loss at staleness 3 grew the
# sampler-trainer KL ~30x and collapsed the entropy; `ppo` stayed stable).
# `unbounded_reason` reads this; the trainer's config check refuses such a
# loss at staleness > 0 unless `rl.allow_unbounded_async` is set.
UNBOUNDED_POLICY_LOSSES = {
  'importance_sampling': 'weights the gradient by the ratio π/π_old, neither clipped nor masked',
}
# For the others, the argument that bounds the ratio of a token with A > 0
# (the side on which an importance-sampled gradient grows), and the values at
# which it stops bounding it: an infinite clip or band, or for DPPO a
# probability step of 1 or more, which no token can take.
_UPPER_BOUNDS = {
  'ppo': ('eps_high', math.inf),
  'gspo': ('eps_high', math.inf),
  'gmpo': ('eps_high', math.inf),
  'cispo': ('eps_high', math.inf),
  'icepop': ('high', math.inf),
  'kpop': ('threshold', math.inf),
  'dppo': ('delta_high', 1.0),
}


# Advantage estimators ------------------------------------------------------------


def _reinforce_pp(
  rewards, mask, group_size, *, kl=None, kl_coef=0.0, gamma=1.0, valid=None, axis_name=None
):
  """REINFORCE++ from outcome rewards: `token_level_rewards`, then
  `reinforce_pp_advantages`. No baseline, so `group_size` is unused.

  Args:
    rewards: [B]; mask: [B, T] 0/1; group_size: unused.
    kl: optional [B, T] per-token KL; kl_coef: β.  gamma: γ.
    valid: optional [B] bool rows that count: the whitening is over their
      tokens, the others get 0.
    axis_name: for the global whitening statistics.

  Returns:
    [B, T] float32.
  """
  del group_size
  if valid is not None:
    check_same_shape('rewards', rewards, valid=valid)
    mask = adv_lib.valid_token_mask(mask, valid)
    rewards = jnp.where(jnp.asarray(valid, bool), jnp.asarray(rewards, jnp.float32), 0.0)
  token_rewards = adv_lib.token_level_rewards(rewards, mask, kl=kl, kl_coef=kl_coef)
  return adv_lib.reinforce_pp_advantages(token_rewards, mask, gamma=gamma, axis_name=axis_name)


# One advantage per sequence, broadcast over its response tokens by the caller.
OUTCOME_ADVANTAGES: dict[str, Callable] = {
  'grpo': adv_lib.grpo_advantages,
  'dr_grpo': adv_lib.dr_grpo_advantages,
  'rloo': adv_lib.rloo_advantages,
  'loo': adv_lib.loo_advantages,
}

# One advantage per token, from discounted returns of (outcome − β·KL).
RETURN_ADVANTAGES: dict[str, Callable] = {
  'reinforce_pp': _reinforce_pp,
  'reinforce_pp_baseline': adv_lib.reinforce_pp_baseline_advantages,
}

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {**OUTCOME_ADVANTAGES, **RETURN_ADVANTAGES}

# The keyword arguments forwarded to each estimator. `axis_name` is listed
# where the estimator has batch-wide statistics; the others are group-local.
ADVANTAGE_ARGS: dict[str, tuple[str, ...]] = {
  'grpo': ('scale', 'std', 'eps', 'singleton', 'axis_name'),
  'dr_grpo': (),
  'rloo': (),
  'loo': ('normalize', 'eps'),
  'reinforce_pp': ('kl_coef', 'gamma', 'axis_name'),
  'reinforce_pp_baseline': ('kl_coef', 'gamma', 'axis_name'),
}

# The estimators with a group baseline: they need group_size >= 2.
GROUP_ADVANTAGES = ('grpo', 'dr_grpo', 'rloo', 'loo', 'reinforce_pp_baseline')


# KL estimators and aggregation modes ---------------------------------------------

# Dispatched inside `kl_penalty(estimator=...)` and `aggregate(mode=...)`, the
# one place each is computed; listed here so that every name is in this module.
KL_ESTIMATORS = kl_lib.KL_ESTIMATORS
AGGREGATION_MODES = reductions.AGGREGATION_MODES


# Lookups -------------------------------------------------------------------------


# The arguments a caller does not choose: the trainer passes the mapped axis,
# and REINFORCE++'s β is the run's KL coefficient.
SUPPLIED_ARGS = ('axis_name', 'kl_coef')


def default_args(table, args):
  """{name: {argument: the function's default}} for each function of
  `table` (`POLICY_LOSSES`, `ADVANTAGE_ESTIMATORS`) and the arguments its
  entry in `args` (`POLICY_LOSS_ARGS`, `ADVANTAGE_ARGS`) lists, except
  `SUPPLIED_ARGS`. The values are the functions' own (None where the
  function's default is None); a config seeded from them holds no second copy.
  """
  out = {}
  for name, fn in table.items():
    params = inspect.signature(fn).parameters
    out[name] = {k: params[k].default for k in args[name] if k not in SUPPLIED_ARGS}
  return out


def get_policy_loss(name, field='policy_loss'):
  """The policy loss called `name`; a ValueError naming `field` and the valid names if none is."""
  check_choice(name, field, POLICY_LOSSES)
  return POLICY_LOSSES[name]


def get_advantage_estimator(name, field='advantage'):
  """The advantage estimator called `name`; a ValueError naming `field` and the valid names."""
  check_choice(name, field, ADVANTAGE_ESTIMATORS)
  return ADVANTAGE_ESTIMATORS[name]


def _forwarded(name, args, table, what):
  """The items of `args` that `table[name]` lists, without the None values."""
  known = {key for keys in table.values() for key in keys}
  unknown = sorted(set(args) - known)
  if unknown:
    raise ValueError(
      f'{unknown} are not arguments of any {what}; the {what}s take {tuple(sorted(known))}.'
    )
  return {key: args[key] for key in table[name] if args.get(key) is not None}


def unbounded_reason(name, args: Mapping[str, Any]):
  """Why the policy loss called `name` with the arguments `args` (plain
  values by keyword name; None or absent: the function's default) does not
  bound the update, or None when it does.

  Bounded are the clipped surrogates (PPO, GSPO, GMPO, CISPO's clipped
  weight), the soft gates (SAPO, VESPO) and the masked importance-sampling
  losses (IcePop, DPPO, KPop), each with a finite bound;
  `importance_sampling` never is. A None `eps_high` of PPO is its `eps_low`.
  """
  check_choice(name, 'policy_loss', POLICY_LOSSES)
  if name in UNBOUNDED_POLICY_LOSSES:
    return f'{name!r} {UNBOUNDED_POLICY_LOSSES[name]}'
  if name not in _UPPER_BOUNDS:
    return None
  key, limit = _UPPER_BOUNDS[name]
  value = args.get(key)
  if value is None and name == 'ppo':
    value = args.get('eps_low')
  if value is None:
    value = inspect.signature(POLICY_LOSSES[name]).parameters[key].default
  if value is None or value < limit:
    return None
  return (
    f'{name!r} with {key}={value!r} leaves the ratio π/π_old of a token with A > 0 '
    f'unbounded (a bound needs {key} < {limit!r})'
  )


def policy_loss_by_name(
  name, logp, old_logp, advantages, mask, args: Mapping[str, Any], *, axis_name=None
):
  """The per-token policy loss called `name` (one of `POLICY_LOSSES`).

  Args:
    name: one of `POLICY_LOSSES`.
    logp, old_logp, advantages, mask: [B, T] (see `ppo_clip_loss`).
    args: plain values by keyword name, for any of the losses; the keys in
      `POLICY_LOSS_ARGS[name]` whose value is not None are passed on.
    axis_name: optional mapped axis for the metrics.

  Returns:
    (loss [B, T] float32 zero where mask is 0, metrics dict of [] float32).
  """
  fn = get_policy_loss(name)
  kwargs = _forwarded(name, args, POLICY_LOSS_ARGS, 'policy loss')
  return fn(logp, old_logp, advantages, mask, **kwargs, axis_name=axis_name)


def outcome_advantages_by_name(
  name,
  rewards,
  group_size,
  args: Mapping[str, Any],
  *,
  valid=None,
  axis_name=None,
  field='advantage',
):
  """One advantage per sequence from the estimator called `name`.

  Args:
    name: one of `OUTCOME_ADVANTAGES` (a per-token estimator raises).
    rewards: [B] outcome rewards, groups of `group_size` consecutive rows.
    group_size: G dividing B.
    args: plain values by keyword name (see `ADVANTAGE_ARGS`).
    valid: optional [B] bool, the rows that count (`jrl.losses.advantages`):
      the others get 0 and leave the statistics alone.
    axis_name: mapped axis, for the estimators that take one.
    field: the name that errors give to `name`.

  Returns:
    [B] float32.
  """
  check_choice(name, field, OUTCOME_ADVANTAGES)
  kwargs = _forwarded(name, {**args, 'axis_name': axis_name}, ADVANTAGE_ARGS, 'advantage estimator')
  if valid is not None:
    kwargs['valid'] = valid
  return OUTCOME_ADVANTAGES[name](rewards, group_size, **kwargs)


def token_advantages_by_name(
  name,
  rewards,
  mask,
  group_size,
  args: Mapping[str, Any],
  *,
  kl=None,
  valid=None,
  axis_name=None,
  field='advantage',
):
  """Per-token advantages [B, T] from the estimator called `name`.

  Outcome estimators give each response token its sequence's advantage
  (`broadcast_to_tokens`); the return estimators (REINFORCE++) compute one
  per token, with the KL penalty `kl` (times `args['kl_coef']`) in the
  reward. Outcome estimators do not use `kl`. Rows that `valid` leaves out
  get 0 on every token and count in no statistic.

  Args:
    name: one of `ADVANTAGE_ESTIMATORS`.
    rewards: [B] outcome rewards, groups of `group_size` consecutive rows.
    mask: [B, T] 0/1 response mask.
    group_size: G dividing B.
    args: plain values by keyword name (see `ADVANTAGE_ARGS`).
    kl: optional [B, T] per-token KL for the return estimators.
    valid: optional [B] bool, the rows that count (default: all).
    axis_name: mapped axis, for the estimators that take one.
    field: the name that errors give to `name`.

  Returns:
    [B, T] float32, zero where mask is 0 and on invalid rows.
  """
  fn = get_advantage_estimator(name, field)
  kwargs = _forwarded(name, {**args, 'axis_name': axis_name}, ADVANTAGE_ARGS, 'advantage estimator')
  if valid is not None:
    kwargs['valid'] = valid
  if name in OUTCOME_ADVANTAGES:
    return adv_lib.broadcast_to_tokens(fn(rewards, group_size, **kwargs), mask)
  return fn(rewards, mask, group_size, kl=kl, **kwargs)


def aggregate_loss(x, mask, mode, *, loss_norm=None, num_seqs=None, axis_name=None):
  """`aggregate(x, mask, mode)` with the callers' rule for the norm.

  'seq-mean-token-sum-norm' divides by B · `loss_norm`, or by B · T (the
  padded length, Dr. GRPO's constant) when `loss_norm` is None or 0; the
  other modes ignore `loss_norm`. `num_seqs` replaces B in the 'seq-mean-*'
  modes (the trainer passes the rows it trains on); the token modes ignore it.

  Args:
    x: [B, T] per-token values.  mask: [B, T] 0/1.
    mode: one of `AGGREGATION_MODES`.
    loss_norm: the constant of 'seq-mean-token-sum-norm', or None.
    num_seqs: None (B) or a count > 0 of the sequences a 'seq-mean-*' mode divides by.
    axis_name: optional mapped axis for cross-device sums.

  Returns:
    [] float32.
  """
  norm = None
  if mode == 'seq-mean-token-sum-norm':
    norm = loss_norm or jnp.shape(x)[1]
  if not mode.startswith('seq-mean'):
    num_seqs = None
  return reductions.aggregate(x, mask, mode, norm=norm, num_seqs=num_seqs, axis_name=axis_name)
