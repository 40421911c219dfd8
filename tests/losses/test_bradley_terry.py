"""`jrl.losses.bradley_terry_loss`: the reward-model objective."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jrl.losses as L


def numpy_bt(c, r, margin, center):
  z = c - r - margin
  return np.log1p(np.exp(-z)) + center * (c + r) ** 2


def test_hand_computed():
  loss, m = L.bradley_terry_loss(jnp.array([1.0, 0.0]), jnp.array([0.0, 0.0]))
  np.testing.assert_allclose(loss, [math.log1p(math.exp(-1.0)), math.log(2.0)], rtol=1e-6)
  assert float(m['reward_accuracy']) == 0.5  # a tie is not a win
  assert float(m['reward_margin']) == pytest.approx(0.5)


@pytest.mark.parametrize('margin, center', [(None, 0.0), (0.5, 0.0), ('rows', 0.01), (0.0, 0.1)])
def test_matches_numpy_reference(margin, center):
  rng = np.random.default_rng(0)
  c, r = rng.normal(size=16).astype(np.float32), rng.normal(size=16).astype(np.float32)
  m = rng.uniform(0, 1, 16).astype(np.float32) if margin == 'rows' else margin
  loss, metrics = L.bradley_terry_loss(c, r, margin=m, center_coef=center)
  want = numpy_bt(c.astype(np.float64), r, 0.0 if m is None else m, center)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  assert float(metrics['reward_accuracy']) == pytest.approx(np.mean(c > r))


def test_gradients_and_jit():
  c, r = jnp.array([0.3, -1.2, 2.0]), jnp.array([0.1, 0.5, -3.0])

  def f(c, r):
    return jnp.sum(L.bradley_terry_loss(c, r, margin=0.2, center_coef=0.05)[0])

  check_grads(f, (c, r), order=2, modes=['rev'])
  # d/dc of −log σ(c − r − m) is −σ(−(c − r − m)); the centring term adds 2k(c + r).
  g = jax.grad(f)(c, r)
  want = -jax.nn.sigmoid(-(c - r - 0.2)) + 2 * 0.05 * (c + r)
  np.testing.assert_allclose(g, want, rtol=1e-5)
  jitted = jax.jit(lambda c, r: L.bradley_terry_loss(c, r, center_coef=0.05)[0])
  np.testing.assert_allclose(jitted(c, r), L.bradley_terry_loss(c, r, center_coef=0.05)[0])


def test_finite_at_extreme_margins():
  loss, _ = L.bradley_terry_loss(jnp.array([1e4, -1e4]), jnp.array([-1e4, 1e4]))
  assert np.all(np.isfinite(loss))
  assert float(loss[0]) == 0.0 and float(loss[1]) == pytest.approx(2e4)


def test_bad_input_names_the_argument():
  with pytest.raises(ValueError, match='rejected_reward'):
    L.bradley_terry_loss(jnp.zeros(3), jnp.zeros(4))
  with pytest.raises(ValueError, match='center_coef'):
    L.bradley_terry_loss(jnp.zeros(3), jnp.zeros(3), center_coef=-1.0)
  with pytest.raises(ValueError, match='margin'):
    L.bradley_terry_loss(jnp.zeros(3), jnp.zeros(3), margin=jnp.zeros(4))
  with pytest.raises(ValueError, match='chosen_reward'):
    L.bradley_terry_loss(jnp.zeros((3, 2)), jnp.zeros((3, 2)))
