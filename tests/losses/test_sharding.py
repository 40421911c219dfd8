"""Data-parallel reductions on the 8 fake CPU devices of tests/conftest.py.

With `axis_name`, every reduction (and the losses built on them) must return
on each device the value of the *global* batch, equal to the single-device
value on the whole batch, with the same gradient; under `jax.jit` with sharded
inputs and no `axis_name`, GSPMD must give the same.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jrl.losses
from jrl.losses import reductions as R

NUM_DEVICES = 8
GROUP_SIZE = 4
B = NUM_DEVICES * GROUP_SIZE  # 32 rows: one group of 4 per device
T = 6
MODES = R.AGGREGATION_MODES
AXIS = 'data'


def _mesh(axis_type=None):
  # jax 0.10's make_mesh defaults to AxisType.Explicit (sharding in types).
  return jax.make_mesh((NUM_DEVICES,), (AXIS,), None if axis_type is None else (axis_type,))


def _put(*arrays, axis_type=None):
  """Places each array on the mesh, split over rows."""
  sharding = NamedSharding(_mesh(axis_type), P(AXIS))
  return tuple(jax.device_put(a, sharding) for a in arrays)


def _kwargs(mode):
  return {'norm': float(T)} if mode == 'seq-mean-token-sum-norm' else {}


def _ragged_mask():
  """[B, T] right-padded rows whose lengths differ, so per-device counts differ.

  Device d holds rows 4d..4d+3. Lengths cycle through 0..6, so some devices
  hold a fully masked row and the per-device token counts range widely.
  """
  lengths = np.array([(3 * i + i // 4) % (T + 1) for i in range(B)])
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
  counts = mask.reshape(NUM_DEVICES, -1).sum(axis=1)
  assert len(set(counts.tolist())) > 2, counts  # the counts really are uneven
  return mask


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  mask = _ragged_mask()
  # Per-row offsets make the per-device means differ, so a wrong way of
  # combining devices gives a visibly wrong value.
  x = (rng.normal(size=(B, T)) + np.linspace(-2.0, 3.0, B)[:, None]).astype(np.float32)
  old_logp = (-rng.random((B, T)) * 3.0).astype(np.float32)
  # Ratios spread around 1 so that some tokens are clipped.
  logp = (old_logp + 0.4 * rng.normal(size=(B, T))).astype(np.float32)
  ref_logp = (old_logp + 0.3 * rng.normal(size=(B, T))).astype(np.float32)
  rewards = rng.integers(0, 2, size=(B,)).astype(np.float32)
  rewards[: 2 * GROUP_SIZE] += rng.normal(size=2 * GROUP_SIZE).astype(np.float32)
  return {
    'x': x,
    'mask': mask,
    'logp': logp,
    'old_logp': old_logp,
    'ref_logp': ref_logp,
    'rewards': rewards,
  }


def _shard_map(fn, n_in, out_specs=None):
  """shard_map over rows (out_specs default P(): a replicated result).

  The inputs are first placed split over the mesh: on the default (Explicit)
  mesh, shard_map refuses inputs whose sharding differs from `in_specs`, so
  host arrays are `device_put` first, as a trainer does with its batch.
  """
  out_specs = P() if out_specs is None else out_specs
  mapped = jax.shard_map(
    fn, mesh=_mesh(), in_specs=(P(AXIS),) * n_in, out_specs=out_specs, check_vma=True
  )
  return jax.jit(lambda *args: mapped(*_put(*args)))


def _grad(fn):
  # Jitted: on an Explicit mesh, jax.grad of a shard_map outside jit refuses
  # to build the replicated cotangent ("enter your jit into a mesh context").
  return jax.jit(jax.grad(fn))


def _assert_tree_close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol), a, b)


# ----------------------------------------------------------------------------
# Reductions under shard_map.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('mode', MODES)
def test_reduction_shard_map_equals_single_device(mode):
  d = _batch()
  single = functools.partial(R.aggregate, mode=mode, **_kwargs(mode))
  sharded = _shard_map(functools.partial(single, axis_name=AXIS), 2)
  want = single(d['x'], d['mask'])
  np.testing.assert_allclose(sharded(d['x'], d['mask']), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('mode', MODES)
def test_reduction_shard_map_every_device_holds_global_value(mode):
  d = _batch(1)
  single = functools.partial(R.aggregate, mode=mode, **_kwargs(mode))
  # out_specs P(AXIS) stacks each device's own scalar: all 8 must be global.
  per_device = _shard_map(lambda x, m: single(x, m, axis_name=AXIS)[None], 2, P(AXIS))
  out = per_device(d['x'], d['mask'])
  assert out.shape == (NUM_DEVICES,)
  np.testing.assert_allclose(out, np.full(NUM_DEVICES, single(d['x'], d['mask'])), rtol=1e-5)


def test_naive_mean_of_device_means_is_wrong():
  # Sanity check that the batch can tell a global token mean from the mean of
  # per-device token means, so the equality tests above can fail.
  d = _batch()
  local = _shard_map(lambda x, m: R.token_mean(x, m)[None], 2, P(AXIS))
  naive = np.mean(local(d['x'], d['mask']))
  right = R.token_mean(d['x'], d['mask'])
  assert abs(naive - right) > 1e-2, (naive, right)  # 1000x the tolerance used above
  # And that the per-device sums without `axis_name` are not the global sum.
  local_sum = _shard_map(lambda x, m: R.token_sum(x, m)[None], 2, P(AXIS))(d['x'], d['mask'])
  assert not np.allclose(local_sum, R.token_sum(d['x'], d['mask']))


@pytest.mark.parametrize('mode', ['seq-mean-token-mean', 'seq-mean-token-sum'])
def test_reduction_shard_map_num_seqs_override(mode):
  # An explicit num_seqs is the global count, used as given on every device.
  d = _batch(2)
  want = R.aggregate(d['x'], d['mask'], mode, num_seqs=20)
  sharded = _shard_map(lambda x, m: R.aggregate(x, m, mode, num_seqs=20, axis_name=AXIS), 2)
  np.testing.assert_allclose(sharded(d['x'], d['mask']), want, rtol=1e-5)


@pytest.mark.parametrize('mode', MODES)
def test_reduction_shard_map_gradient(mode):
  d = _batch(3)
  single = functools.partial(R.aggregate, mode=mode, **_kwargs(mode))
  sharded = _shard_map(functools.partial(single, axis_name=AXIS), 2)
  want = jax.grad(single)(d['x'], d['mask'])
  # Gradient of the shard_mapped function (through the shard_map transpose).
  np.testing.assert_allclose(_grad(sharded)(d['x'], d['mask']), want, rtol=1e-5, atol=1e-7)
  # Gradient taken inside each device, as a data-parallel train step does: the
  # local slice of the global gradient (psum must transpose to the identity
  # on the varying input, not to another psum, which would scale it by 8).
  inside = _shard_map(lambda x, m: jax.grad(lambda x: single(x, m, axis_name=AXIS))(x), 2, P(AXIS))
  np.testing.assert_allclose(inside(d['x'], d['mask']), want, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------
# PPO clip + aggregate, and GRPO presets, under shard_map.
# ----------------------------------------------------------------------------


def _ppo(logp, old_logp, adv, mask, *, mode, axis_name=None):
  loss_BxT, metrics = jrl.losses.ppo_clip_loss(
    logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, axis_name=axis_name
  )
  loss = jrl.losses.aggregate(loss_BxT, mask, mode, axis_name=axis_name, **_kwargs(mode))
  return loss, metrics


def _ppo_args(d):
  adv = jrl.losses.broadcast_to_tokens(np.linspace(-1.5, 1.5, B, dtype=np.float32), d['mask'])
  return d['logp'], d['old_logp'], np.asarray(adv), d['mask']


def _soft(logp, old_logp, adv, mask, *, name, axis_name=None):
  """SAPO / VESPO under the off-policy sequence mask, token-mean, with metrics."""
  fn = {'sapo': jrl.losses.sapo_loss, 'vespo': jrl.losses.vespo_loss}[name]
  loss_BxT, metrics = fn(logp, old_logp, adv, mask, axis_name=axis_name)
  keep, opsm = jrl.losses.off_policy_sequence_mask(
    logp, old_logp, adv[:, 0], mask, threshold=0.05, axis_name=axis_name
  )
  loss = jrl.losses.token_mean(loss_BxT * keep[:, None], mask, axis_name=axis_name)
  return loss, {**metrics, **opsm}


@pytest.mark.parametrize('name', ['sapo', 'vespo'])
def test_soft_losses_and_off_policy_mask_shard_map_equal_single_device(name):
  d = _batch(9)
  args = _ppo_args(d)
  args = (0.5 * args[1] + 0.5 * args[0], *args[1:])  # milder ratios: VESPO's W spread
  want_loss, want_metrics = _soft(*args, name=name)
  assert 0.0 < want_metrics['opsm_dropped_frac'] < 1.0  # the mask is exercised
  sharded = _shard_map(functools.partial(_soft, name=name, axis_name=AXIS), 4)
  loss, metrics = sharded(*args)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  assert metrics.keys() == want_metrics.keys()
  _assert_tree_close(metrics, want_metrics)
  want_g = jax.grad(lambda lp: _soft(lp, *args[1:], name=name)[0])(args[0])
  g = _grad(lambda lp: sharded(lp, *args[1:])[0])(args[0])
  np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('mode', MODES)
def test_ppo_clip_shard_map_equals_single_device(mode):
  d = _batch(4)
  args = _ppo_args(d)
  want_loss, want_metrics = _ppo(*args, mode=mode)
  assert 0.0 < want_metrics['clipfrac'] < 1.0  # the clip is exercised
  sharded = _shard_map(functools.partial(_ppo, mode=mode, axis_name=AXIS), 4)
  loss, metrics = sharded(*args)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  assert metrics.keys() == want_metrics.keys()
  _assert_tree_close(metrics, want_metrics)

  # Gradient w.r.t. logp, outside and inside the shard_map.
  want_g = jax.grad(lambda lp: _ppo(lp, *args[1:], mode=mode)[0])(args[0])
  g = _grad(lambda lp: sharded(lp, *args[1:])[0])(args[0])
  np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)
  inside = _shard_map(
    lambda lp, *rest: jax.grad(lambda lp: _ppo(lp, *rest, mode=mode, axis_name=AXIS)[0])(lp),
    4,
    P(AXIS),
  )
  np.testing.assert_allclose(inside(*args), want_g, rtol=1e-5, atol=1e-7)


def _grpo(logp, old_logp, ref_logp, rewards, mask, *, preset, axis_name=None):
  return jrl.losses.grpo_loss(
    logp,
    old_logp,
    ref_logp,
    rewards,
    mask,
    group_size=GROUP_SIZE,
    preset=preset,
    kl_coef=0.05,  # nonzero for both presets so that the KL term is exercised
    axis_name=axis_name,
  )


def _grpo_args(d):
  return d['logp'], d['old_logp'], d['ref_logp'], d['rewards'], d['mask']


@pytest.mark.parametrize('preset', ['verl', 'trl'])
def test_grpo_loss_shard_map_equals_single_device(preset):
  d = _batch(5)
  args = _grpo_args(d)
  want_loss, want_metrics = _grpo(*args, preset=preset)
  sharded = _shard_map(functools.partial(_grpo, preset=preset, axis_name=AXIS), 5)
  loss, metrics = sharded(*args)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  assert metrics.keys() == want_metrics.keys()
  _assert_tree_close(metrics, want_metrics)

  want_g = jax.grad(lambda lp: _grpo(lp, *args[1:], preset=preset)[0])(args[0])
  assert np.abs(want_g).max() > 0
  g = _grad(lambda lp: sharded(lp, *args[1:])[0])(args[0])
  np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)
  inside = _shard_map(
    lambda lp, *rest: jax.grad(lambda lp: _grpo(lp, *rest, preset=preset, axis_name=AXIS)[0])(lp),
    5,
    P(AXIS),
  )
  np.testing.assert_allclose(inside(*args), want_g, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------
# jit with NamedSharding inputs, no axis_name: GSPMD makes it global.
# ----------------------------------------------------------------------------


AXIS_TYPES = [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto]


@pytest.mark.parametrize('axis_type', AXIS_TYPES)
@pytest.mark.parametrize('mode', MODES)
def test_reduction_jit_named_sharding_equals_single_device(mode, axis_type):
  d = _batch(6)
  f = functools.partial(R.aggregate, mode=mode, **_kwargs(mode))
  x, m = _put(d['x'], d['mask'], axis_type=axis_type)
  assert len(x.sharding.device_set) == NUM_DEVICES
  np.testing.assert_allclose(jax.jit(f)(x, m), f(d['x'], d['mask']), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    jax.jit(jax.grad(f))(x, m), jax.grad(f)(d['x'], d['mask']), rtol=1e-5, atol=1e-7
  )


@pytest.mark.parametrize('axis_type', AXIS_TYPES)
@pytest.mark.parametrize('preset', ['verl', 'trl'])
def test_grpo_loss_jit_named_sharding_equals_single_device(preset, axis_type):
  d = _batch(7)
  args = _grpo_args(d)
  f = functools.partial(_grpo, preset=preset)
  placed = _put(*args, axis_type=axis_type)
  loss, metrics = jax.jit(f)(*placed)
  want_loss, want_metrics = f(*args)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  _assert_tree_close(metrics, want_metrics)
  g = jax.jit(jax.grad(lambda lp, *rest: f(lp, *rest)[0]))(*placed)
  want_g = jax.grad(lambda lp: f(lp, *args[1:])[0])(args[0])
  np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------
# pmap with axis_name.
# ----------------------------------------------------------------------------


def _per_device(a):
  return a.reshape(NUM_DEVICES, -1, *a.shape[1:])


@pytest.mark.parametrize('mode', MODES)
def test_reduction_pmap_equals_single_device(mode):
  d = _batch(8)
  single = functools.partial(R.aggregate, mode=mode, **_kwargs(mode))
  pmapped = jax.pmap(functools.partial(single, axis_name=AXIS), axis_name=AXIS)
  out = pmapped(_per_device(d['x']), _per_device(d['mask']))
  assert out.shape == (NUM_DEVICES,)
  np.testing.assert_allclose(out, np.full(NUM_DEVICES, single(d['x'], d['mask'])), rtol=1e-5)


def test_token_mean_pmap_gradient_is_summed_over_devices():
  # Unlike shard_map (which tracks which values vary over the axis), pmap
  # transposes psum to psum: jax.grad inside pmap of the global loss returns
  # d(Σ_devices loss)/d(local x) = NUM_DEVICES × the global gradient, since all
  # devices hold the same loss. A pmap trainer must therefore `pmean` (not
  # `psum`) such gradients. This pins that contract.
  d = _batch(9)
  want = jax.grad(R.token_mean)(d['x'], d['mask'])
  grad = jax.pmap(
    jax.grad(functools.partial(R.token_mean, axis_name=AXIS)),
    axis_name=AXIS,
  )(_per_device(d['x']), _per_device(d['mask']))
  np.testing.assert_allclose(grad.reshape(B, T), NUM_DEVICES * want, rtol=1e-5, atol=1e-7)


def test_grpo_loss_pmap_equals_single_device():
  d = _batch(10)
  args = _grpo_args(d)
  f = functools.partial(_grpo, preset='verl')
  loss, _ = jax.pmap(functools.partial(f, axis_name=AXIS), axis_name=AXIS)(
    *(_per_device(jnp.asarray(a)) for a in args)
  )
  np.testing.assert_allclose(loss, np.full(NUM_DEVICES, f(*args)[0]), rtol=1e-5, atol=1e-6)
