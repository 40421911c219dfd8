"""Unscored is not wrong (`reward.unscored`).

A completion whose reward could not be computed is, by default ('drop'),
left out of training: advantage 0, outside its group's statistics, in no
term of the policy or value loss and no count that normalises them, and
counted in the metrics (`samples/unscored`, `samples/left_out`). Each is
checked against the batch without that row. 'value' trains it with
`reward.unscored_value` in its total, as before the field existed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jrl import losses as L
from jrl import models, parallel, rewards, trainers
from jrl.rewards.base import ScoredBatch, scored_rows
from jrl.trainers import common, online, policy_step, ppo
from jrl.trainers.rollouts import rollout
from tests.helpers import QUIET, jit_token_logprobs, records, shrunk_config, step_config
from tests.trainers.test_layouts import TINY, group_batch, parts_of

LEFT_OUT = (1, 6, 11)  # one completion of each of the three groups of four


def _without(x):
  """`x` [B, ...] without the rows of LEFT_OUT."""
  return np.delete(np.asarray(x), LEFT_OUT, axis=0)


def _valid(b):
  valid = np.ones(b, bool)
  valid[list(LEFT_OUT)] = False
  return valid


def _assert_same(got, want, rtol=1e-5, atol=1e-6):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.fixture(scope='module')
def model():
  return models.create(TINY, jax.random.PRNGKey(0))


def _policy_batch(graphdef, params, seed):
  """A PolicyBatch of three groups of four, with behaviour and reference
  logprobs near the model's and random advantages (nonzero on LEFT_OUT:
  the loss must ignore whatever a left-out row holds)."""
  tokens, mask, loss_mask = group_batch(seed=seed)
  b, t = tokens.shape
  rng = np.random.default_rng(seed)
  logp, _ = jit_token_logprobs(graphdef, params, tokens, mask)
  near = lambda: jnp.asarray(np.where(loss_mask, logp + rng.normal(0, 0.1, (b, t)), 0), jnp.float32)
  adv = np.where(loss_mask, rng.normal(size=(b, 1)), 0)
  weights = np.where(loss_mask, rng.uniform(0.5, 1.5, (b, t)), 0)
  return policy_step.PolicyBatch(
    jnp.asarray(tokens),
    jnp.asarray(mask),
    jnp.asarray(loss_mask),
    near(),
    near(),
    jnp.asarray(adv, jnp.float32),
    jnp.asarray(weights, jnp.float32),
  )


def _rows_dropped(batch):
  """The batch without the rows of LEFT_OUT (and no `valid`)."""
  dropped = {f: jnp.asarray(_without(getattr(batch, f))) for f in FIELDS}
  return batch._replace(valid=None, **dropped)


FIELDS = ('tokens', 'mask', 'loss_mask', 'old_logp', 'ref_logp', 'advantages', 'is_weights')

LOSSES = {
  'token_mean': dict(loss_agg='token-mean'),
  'seq_mean_token_mean': dict(loss_agg='seq-mean-token-mean'),
  'seq_mean_token_sum': dict(loss_agg='seq-mean-token-sum'),
  'dr_grpo_norm': dict(loss_agg='seq-mean-token-sum-norm', loss_norm=16.0),
  'gspo': dict(policy_loss='gspo', loss_agg='seq-mean-token-mean'),
  'kl_entropy_opsm': dict(
    kl_coef=0.1, kl_estimator='k3', entropy_coef=0.01, off_policy_mask_threshold=0.05
  ),
}

_loss_and_grad = jax.jit(
  jax.value_and_grad(policy_step.policy_loss, has_aux=True), static_argnums=(1, 3)
)


@pytest.mark.parametrize('name', sorted(LOSSES))
def test_a_left_out_row_is_in_no_term_of_the_policy_loss(model, name):
  """Loss, gradients and metrics with rows left out by `valid` equal those of
  the batch without the rows, whatever the aggregation (the 'seq-mean-*'
  modes divide by the rows kept) and the terms (KL, entropy, masks)."""
  graphdef, params = model
  batch = _policy_batch(graphdef, params, seed=2)
  cfg = step_config(**LOSSES[name])
  valid = jnp.asarray(_valid(batch.tokens.shape[0]))
  (loss, metrics), grads = _loss_and_grad(params, graphdef, batch._replace(valid=valid), cfg)
  (want, want_metrics), want_grads = _loss_and_grad(params, graphdef, _rows_dropped(batch), cfg)
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-7)
  _assert_same(grads, want_grads, rtol=1e-4, atol=1e-6)
  for key in ('actor/pg_loss', 'actor/kl_ref', 'actor/entropy', 'actor/logp_diff_abs'):
    np.testing.assert_allclose(float(metrics[key]), float(want_metrics[key]), rtol=1e-5, atol=1e-7)
  # Control: kept in, the rows change the loss.
  (kept, _), _ = _loss_and_grad(params, graphdef, batch, cfg)
  assert abs(float(kept) - float(want)) > 1e-4


@pytest.mark.parametrize(('kind', 'budget'), [('shared_prompt', 100), ('padded', 64)])
def test_a_left_out_row_in_micro_batches_of_a_layout(model, kind, budget):
  """The layout keeps reading `loss_mask` (where prompts end) while `valid`
  leaves the rows out: the micro-batches' losses and gradients add up to
  the batch without the rows."""
  graphdef, params = model
  batch = _policy_batch(graphdef, params, seed=3)
  cfg = step_config(loss_agg='seq-mean-token-mean', kl_coef=0.1)
  batch = batch._replace(valid=jnp.asarray(_valid(batch.tokens.shape[0])))
  parts = parts_of(kind, budget, *(np.asarray(x) for x in batch[:3]))
  assert len(parts) > 1
  outs = [_loss_and_grad(params, graphdef, batch._replace(packed=p), cfg) for p in parts]
  (want, _), want_grads = _loss_and_grad(params, graphdef, _rows_dropped(batch), cfg)
  np.testing.assert_allclose(sum(float(o[0][0]) for o in outs), float(want), rtol=1e-5, atol=1e-7)
  _assert_same(jax.tree.map(lambda *g: sum(g), *[o[1] for o in outs]), want_grads, 1e-4, 1e-6)


def test_ppo_leaves_a_left_out_row_out_of_the_policy_and_the_value_loss(model):
  graphdef, params = model
  critic_graphdef, critic_params = models.create(
    TINY, jax.random.PRNGKey(1), lm_head=False, scalar_head=True
  )
  pb = _policy_batch(graphdef, params, seed=4)
  rng = np.random.default_rng(5)
  loss_mask = np.asarray(pb.loss_mask)
  f32 = lambda x: jnp.asarray(np.where(loss_mask, x, 0.0), jnp.float32)
  batch = ppo.PPOBatch(
    *pb[:6],
    returns=f32(rng.normal(size=loss_mask.shape)),
    old_values=f32(rng.normal(0, 0.5, loss_mask.shape)),
    is_weights=pb.is_weights,
  )
  tx = optax.sgd(1.0)
  critic = common.init_state(critic_params, tx)
  state = common.init_state(params, tx, common.AlgorithmState(critic=critic))
  step = jax.jit(
    lambda state, batch: ppo.loss_and_grads(
      state,
      batch,
      graphdef=graphdef,
      critic_graphdef=critic_graphdef,
      step_config=step_config(loss_agg='seq-mean-token-mean'),
      value_clip=0.2,
    )
  )
  valid = jnp.asarray(_valid(loss_mask.shape[0]))
  losses, _, grads = step(state, batch._replace(valid=valid))
  dropped = batch._replace(
    **{f: jnp.asarray(_without(getattr(batch, f))) for f in (*FIELDS, 'returns', 'old_values')}
  )
  want_losses, _, want_grads = step(state, dropped)
  _assert_same(losses, want_losses, 1e-5, 1e-7)
  _assert_same(grads, want_grads, 1e-4, 1e-6)
  kept, _, _ = step(state, batch)
  assert abs(float(kept[1]) - float(want_losses[1])) > 1e-4


def test_the_trainers_advantages_of_the_other_rows_are_those_without_the_left_out(tmp_path):
  """`policy_step.advantages` as a run calls it (its config's estimator):
  the left-out rows get 0, the others what they get with those rows absent."""
  tokens, _, loss_mask = group_batch(seed=6)
  rewards_b = np.random.default_rng(7).uniform(size=tokens.shape[0]).round(1).astype(np.float32)
  for estimator in L.ADVANTAGE_ESTIMATORS:
    config = shrunk_config(tmp_path, {'rl.advantage': estimator})
    cfg = policy_step.objective_of(config.rl).advantage
    valid = _valid(tokens.shape[0])
    got = policy_step.advantages(rewards_b, loss_mask, 4, cfg, valid_B=valid)
    want = policy_step.advantages(_without(rewards_b), _without(loss_mask), 3, cfg)
    np.testing.assert_array_equal(np.asarray(got)[~valid], 0.0, err_msg=estimator)
    np.testing.assert_allclose(
      np.asarray(got)[valid], want, rtol=1e-5, atol=1e-6, err_msg=estimator
    )


# The rollout's side ------------------------------------------------------------------


def _scored(per_fn):
  per_fn = {k: np.asarray(v, np.float32) for k, v in per_fn.items()}
  n = len(next(iter(per_fn.values())))
  zeros = dict.fromkeys(per_fn, 0)
  return ScoredBatch(np.zeros(n, np.float32), per_fn, zeros, zeros, zeros, [])


def test_a_completion_is_scored_when_every_weighted_function_scored_it():
  scored = _scored({'a': [1.0, np.nan, 0.0, 1.0], 'b': [0.5, 0.5, np.nan, np.nan]})
  np.testing.assert_array_equal(scored_rows(scored), [True, False, False, False])
  # A function of weight 0 adds nothing to the total: its gaps do not count.
  np.testing.assert_array_equal(
    scored_rows(scored, {'a': 1.0, 'b': 0.0}), [True, False, True, True]
  )
  # A remote total (a name the local weights do not know) counts.
  remote = _scored({'f': [1.0, 1.0], 'remote': [1.0, np.nan]})
  np.testing.assert_array_equal(scored_rows(remote, {'f': 1.0}), [True, False])


def test_a_group_with_at_most_one_scored_reward_or_tied_scored_rewards_has_no_signal():
  total = np.array([[1.0, 0.0, 1.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.5], [0.3, 0.3, 0.3]])
  valid = np.array([[True, False, True], [True, True, True], [False, True, False], [True] * 3])
  np.testing.assert_array_equal(rollout.tied_groups(total, valid), [True, False, True, True])


def test_running_reward_moments_fold_in_only_the_rows_kept(tmp_path):
  config = shrunk_config(tmp_path, {'reward.normalize': True})
  extra = common.AlgorithmState(reward_moments=online.reward_state(config.reward))
  state = common.TrainState(jnp.int32(0), {}, (), extra)
  raw = np.array([1.0, 0.0, -5.0, 3.0], np.float32)
  valid = np.array([True, True, False, True])
  got_state, shaped = online.shape_rewards(state, raw, config.reward, {}, valid)
  want_state, want = online.shape_rewards(state, raw[valid], config.reward, {})
  _assert_same(got_state.extra, want_state.extra)
  np.testing.assert_allclose(shaped[valid], want, rtol=1e-6)


def test_minibatches_carry_the_valid_rows_laid_out_like_the_others():
  sharding = parallel.batch_sharding(parallel.make_mesh())
  full = (
    jax.device_put(np.arange(32).reshape(16, 2), sharding),
    online.place_valid(np.arange(16) % 3 != 0, sharding),
  )
  order = jnp.asarray([0, 3, 4, 5, 8, 9, 12, 15])
  tokens, valid = online._take_rows(full, order, sharding)
  np.testing.assert_array_equal(tokens[:, 0], np.asarray(order) * 2)
  np.testing.assert_array_equal(valid, np.asarray(order) % 3 != 0)
  assert valid.sharding == parallel.batch_sharding(sharding.mesh, 1)


# The config -----------------------------------------------------------------------


def test_the_default_is_drop_and_a_bad_choice_is_refused_by_name(tmp_path):
  assert shrunk_config(tmp_path).reward.unscored == 'drop'
  trainers.validate(shrunk_config(tmp_path, {'reward.unscored': 'value'}), 1)
  config = shrunk_config(tmp_path, {'reward.unscored': 'zero'})
  with pytest.raises(ValueError, match=r"^`reward\.unscored`: must be one of \('drop', 'value'\)"):
    trainers.validate(config, 1)


# Runs -------------------------------------------------------------------------------

UNSCORED_VALUE = -2.0


@pytest.fixture
def first_of_each_group_unscored(monkeypatch):
  """A reward function that cannot score the first completion of each group
  (rows 0, 4, 8, 12 of a call: groups of 4, one chunk) and gives the others
  their length's parity."""
  name = 'test_unscored_first_of_group'
  monkeypatch.setitem(rewards.REGISTRY, name, None)  # removed again after the test

  @rewards.register(name)
  def score(prompts, completions, metadata):
    return [None if i % 4 == 0 else float(len(c) % 2) for i, c in enumerate(completions)]

  return name


@pytest.mark.parametrize('algorithm', ['grpo', 'ppo'])
def test_a_run_leaves_unscored_completions_out_and_counts_them(
  tmp_path, first_of_each_group_unscored, algorithm
):
  name = first_of_each_group_unscored
  fields = {
    **QUIET,
    'algorithm': algorithm,
    'reward.functions': (name,),
    'reward.mode': 'thread',  # registered in this process only
    'reward.unscored_value': UNSCORED_VALUE,
    'sft.steps': 0,
    'rl.steps': 2,
  }
  config = shrunk_config(tmp_path, fields)
  trainers.run(config)
  rl = [r for r in records(config.workdir) if r.get('phase') == 1.0]
  assert len(rl) == 2
  for r in rl:
    assert r[f'reward/{name}/unscored'] == r['samples/unscored'] == 4
    assert r['samples/left_out'] == 4
    # The mean of what is trained on: the scored completions only.
    assert r['reward/mean'] == pytest.approx(r[f'reward/{name}/mean'], abs=1e-6)
    assert np.isfinite(r['actor/loss']) and r.get('actor/nonfinite', 0) == 0


def test_value_trains_unscored_completions_with_the_unscored_value(
  tmp_path, first_of_each_group_unscored
):
  """'value': the old behaviour, nothing left out and `unscored_value` in
  the unscored completions' totals."""
  name = first_of_each_group_unscored
  fields = {
    **QUIET,
    'reward.functions': (name,),
    'reward.mode': 'thread',
    'reward.unscored': 'value',
    'reward.unscored_value': UNSCORED_VALUE,
    'sft.steps': 0,
    'rl.steps': 1,
  }
  config = shrunk_config(tmp_path, fields)
  trainers.run(config)
  (r,) = [r for r in records(config.workdir) if r.get('phase') == 1.0]
  assert r['samples/unscored'] == 4 and r['samples/left_out'] == 0
  substituted = (12 * r[f'reward/{name}/mean'] + 4 * UNSCORED_VALUE) / 16
  assert r['reward/mean'] == pytest.approx(substituted, abs=1e-6)
