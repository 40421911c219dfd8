"""Every objective of `jrl.losses` by name: the one table from a name to its
function, and the typed call of one (`PolicyLoss`, `Advantage`).

The trainer (`jrl.trainers.policy_step`, from `config.rl`) and the GRPO presets
(`jrl.losses.presets`) both go from a name to a function through this module;
neither keeps a table of its own. Adding a policy loss is: write the kernel in
`jrl/losses/policy.py`, add one entry to `POLICY_LOSSES` and one to
`POLICY_LOSS_ARGS` (the keyword arguments callers may set), say whether and
by which argument it bounds the update (`UNBOUNDED_POLICY_LOSSES`,
`_UPPER_BOUNDS`: asynchronous runs refuse an unbounded one), and check its
arguments in its first lines (see `jrl/losses/README.md`).

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

A `PolicyLoss(name, args)` or `Advantage(name, args)` is one function of a
table with the keyword arguments it is called with, under the function's
own names: `make` checks them once (an argument the function does not take,
or a value its own checks refuse, raises naming the config field), and
calling it calls the function with them. None and the function's own
default are left out, so equal values compute the same thing.

Nothing here sees a config: names and values are plain strings and numbers.
"""

import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.losses import advantages as adv_lib
from jrl.losses import kl as kl_lib
from jrl.losses import policy, reductions
from jrl.losses._checks import check_choice, check_positive, check_same_shape

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


def _canonical_args(fn, args):
  """((argument, value), ...) of the mapping `args`, sorted by argument,
  without the values that leave `fn`'s default: None, or the default itself.
  Two calls of the same function that compute the same thing compare equal."""
  params = inspect.signature(fn).parameters
  out = []
  for key, value in dict(args or {}).items():
    default = params[key].default if key in params else inspect.Parameter.empty
    if value is None or (type(value) is type(default) and value == default):
      continue
    out.append((key, value))
  return tuple(sorted(out))


def probe(call, shapes, names, field):
  """Traces `call(*inputs of shapes)` without computing it, so that the
  function it calls runs its own argument checks. Their ValueError comes
  back with each backquoted argument name replaced by its name in `names`
  ({argument: name}, e.g. 'eps_low': 'rl.loss.ppo.eps_low'), or, where the
  message names none, prefixed with `field`.

  Args:
    call: a function of the inputs.
    shapes: ((input name, shape), ...): float32 inputs, bool for 'mask'.
    names: {argument: the name errors give it}.
    field: the name of the whole call, for messages that name no argument.
  """
  inputs = [
    jax.ShapeDtypeStruct(shape, jnp.bool_ if name == 'mask' else jnp.float32)
    for name, shape in shapes
  ]
  try:
    jax.eval_shape(call, *inputs)
  except (ValueError, TypeError) as e:
    message = str(e)
    for key, name in names.items():
      message = message.replace(f'`{key}`', f'`{name}`')
    if message == str(e):
      message = f'`{field}`: {message}'
    raise ValueError(message) from None


def _named(args, field):
  return {key: f'{field}.{key}' for key in args}


def _made(kernel, args, field, table_args, what):
  """`kernel` (a PolicyLoss or an Advantage made from `args`) once its
  arguments are known to the function (`table_args`) and pass its own checks
  (`_PROBES`); errors name `field.<name>.<argument>`."""
  at = f'{field}.{kernel.name}'
  _check_args(kernel.name, dict(args or {}).items(), table_args, at, what)
  once(_PROBES[type(kernel).__name__], kernel, at)
  return kernel


def _check_args(name, args, table_args, field, what):
  """Refuses an argument that the function called `name` does not take."""
  takes = tuple(k for k in table_args[name] if k != 'axis_name')
  for key, _ in args:
    if key not in takes:
      raise ValueError(
        f'`{field}.{key}` is not an argument of the {what} {name!r}: it takes {takes}.'
      )


class PolicyLoss(NamedTuple):
  """A policy loss of `POLICY_LOSSES` with the keyword arguments it is called
  with: the typed value a config's `rl.policy_loss` and `rl.loss.<name>`
  section become, and a preset's. Hashable, so a static argument of a jitted
  step. Build it with `PolicyLoss.make`, which checks the arguments once
  with the function's own checks; calling it is calling the function.
  """

  name: str = 'ppo'
  args: tuple = ()  # ((argument, value), ...), sorted; absent: the function's default

  @classmethod
  def make(cls, name, args=None, field='rl.loss', name_field='rl.policy_loss'):
    """The loss called `name` with `args` ({argument: value}; None: the
    function's default). A ValueError names `name_field` for an unknown
    name, and `field.<name>.<argument>` for an argument the loss does not
    take or a value its checks refuse."""
    check_choice(name, name_field, POLICY_LOSSES)
    return _made(cls.of(name, args), args, field, POLICY_LOSS_ARGS, 'policy loss')

  @classmethod
  def of(cls, name, args=None):
    """The loss called `name` with `args`, unchecked (`make` checks)."""
    return cls(name, _canonical_args(POLICY_LOSSES[name], args))

  @property
  def kwargs(self):
    return dict(self.args)

  def replace(self, **args):
    """The same loss with `args` changed (None: back to the default)."""
    return PolicyLoss.make(self.name, {**self.kwargs, **args}, 'policy', 'policy.name')

  def __call__(self, logp, old_logp, advantages, mask, *, axis_name=None):
    """(loss [B, T] float32 zero where mask is 0, metrics dict of [] float32)
    of `logp`, `old_logp`, `advantages`, `mask`, all [B, T] (see `ppo_clip_loss`)."""
    fn = POLICY_LOSSES[self.name]
    return fn(logp, old_logp, advantages, mask, **self.kwargs, axis_name=axis_name)


class Advantage(NamedTuple):
  """An advantage estimator of `ADVANTAGE_ESTIMATORS` with its keyword
  arguments (`rl.advantage` and `rl.adv.<name>`; REINFORCE++'s `kl_coef`
  is the run's β when the KL is in the reward). Built and called as
  `PolicyLoss` is."""

  name: str = 'grpo'
  args: tuple = ()

  @classmethod
  def make(cls, name, args=None, field='rl.adv', name_field='rl.advantage'):
    """As `PolicyLoss.make`, for the estimator called `name`."""
    check_choice(name, name_field, ADVANTAGE_ESTIMATORS)
    return _made(cls.of(name, args), args, field, ADVANTAGE_ARGS, 'advantage estimator')

  @classmethod
  def of(cls, name, args=None):
    """The estimator called `name` with `args`, unchecked (`make` checks)."""
    return cls(name, _canonical_args(ADVANTAGE_ESTIMATORS[name], args))

  @property
  def kwargs(self):
    return dict(self.args)

  def replace(self, **args):
    """The same estimator with `args` changed (None: back to the default)."""
    return Advantage.make(self.name, {**self.kwargs, **args}, 'advantage', 'advantage.name')

  @property
  def per_token(self):
    """True for the estimators of per-token returns (`RETURN_ADVANTAGES`)."""
    return self.name in RETURN_ADVANTAGES

  def _kwargs(self, valid, axis_name):
    kwargs = self.kwargs
    if 'axis_name' in ADVANTAGE_ARGS[self.name]:
      kwargs['axis_name'] = axis_name
    if valid is not None:
      kwargs['valid'] = valid
    return kwargs

  def outcome(self, rewards, group_size, *, valid=None, axis_name=None):
    """One advantage per sequence, [B] float32, from `rewards` [B] in
    consecutive groups of `group_size`; rows that `valid` ([B] bool) leaves
    out get 0 and count in no statistic. A per-token estimator raises."""
    if self.per_token:
      raise ValueError(
        f'{self.name!r} gives one advantage per token: call the Advantage itself '
        f'(one of {tuple(OUTCOME_ADVANTAGES)} gives one per sequence).'
      )
    return OUTCOME_ADVANTAGES[self.name](rewards, group_size, **self._kwargs(valid, axis_name))

  def __call__(self, rewards, mask, group_size, *, kl=None, valid=None, axis_name=None):
    """Per-token advantages [B, T] float32, zero where `mask` [B, T] is 0 and
    on the rows `valid` leaves out: an outcome estimator's sequence
    advantage on each response token (`broadcast_to_tokens`), or the return
    estimators' per-token values with the KL `kl` [B, T] (times `kl_coef`)
    in the reward. Outcome estimators do not read `kl`."""
    if not self.per_token:
      return adv_lib.broadcast_to_tokens(
        self.outcome(rewards, group_size, valid=valid, axis_name=axis_name), mask
      )
    fn = RETURN_ADVANTAGES[self.name]
    return fn(rewards, mask, group_size, kl=kl, **self._kwargs(valid, axis_name))


def once(check, *key):
  """`check(*key)`, remembered when it passes: a run validates its config
  more than once (start-up, each memory-plan candidate), and a test suite
  thousands of times. A key that cannot be hashed is checked every time."""
  try:
    hash(key)
  except TypeError:
    return check.__wrapped__(*key)
  return check(*key)


@functools.lru_cache(maxsize=4096)
def _probe_policy_loss(loss, at):
  """Traces the policy loss `loss` on a [1, 2] batch: its own checks run."""
  shapes = (('logp', (1, 2)), ('old_logp', (1, 2)), ('advantages', (1, 2)), ('mask', (1, 2)))
  call = lambda *xs: POLICY_LOSSES[loss.name](*xs, **loss.kwargs)
  probe(call, shapes, _named(POLICY_LOSS_ARGS[loss.name], at), at)


@functools.lru_cache(maxsize=4096)
def _probe_advantage(adv, at):
  """Traces the estimator `adv` on a batch of one group of 2: its own checks run."""
  names = _named(ADVANTAGE_ARGS[adv.name], at)
  if adv.name in OUTCOME_ADVANTAGES:
    fn = lambda rewards: OUTCOME_ADVANTAGES[adv.name](rewards, 2, **adv.kwargs)
    probe(fn, (('rewards', (2,)),), names, at)
  else:
    fn = lambda rewards, mask: RETURN_ADVANTAGES[adv.name](rewards, mask, 2, **adv.kwargs)
    probe(fn, (('rewards', (2,)), ('mask', (2, 2))), names, at)


_PROBES = {'PolicyLoss': _probe_policy_loss, 'Advantage': _probe_advantage}


def unbounded_reason(loss: PolicyLoss):
  """Why the policy loss `loss` does not bound the update, or None when it does.

  Bounded are the clipped surrogates (PPO, GSPO, GMPO, CISPO's clipped
  weight), the soft gates (SAPO, VESPO) and the masked importance-sampling
  losses (IcePop, DPPO, KPop), each with a finite bound;
  `importance_sampling` never is. An absent `eps_high` of PPO is its `eps_low`.
  """
  name, args = loss.name, loss.kwargs
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
  if loss_norm is not None:
    check_positive(loss_norm, 'loss_norm')
  norm = None
  if mode == 'seq-mean-token-sum-norm':
    norm = loss_norm or jnp.shape(x)[1]
  if not mode.startswith('seq-mean'):
    num_seqs = None
  return reductions.aggregate(x, mask, mode, norm=norm, num_seqs=num_seqs, axis_name=axis_name)
