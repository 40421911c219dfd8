"""Tests for jrl.losses.preference: DPO, IPO, hinge (SLiC), SimPO, ORPO.

Each loss is tested four ways (STYLE.md point 14): hand-computed values for
one pair, an independent float64 NumPy reference on random batches,
gradients (analytic and `jax.test_util.check_grads`), and jit vs no-jit.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jrl.losses as L

B = 16


def _f32(*xs):
  return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def _assert_metrics(got, want, rtol=1e-5, atol=1e-6):
  assert set(want) <= set(got)
  for k, v in want.items():
    np.testing.assert_allclose(float(got[k]), v, rtol=rtol, atol=atol, err_msg=k)


def _np_reward_metrics(r_c, r_r):
  return {
    'rewards_chosen': r_c.mean(),
    'rewards_rejected': r_r.mean(),
    'reward_margin': (r_c - r_r).mean(),
    'reward_accuracy': (r_c > r_r).mean(),
  }


def _tree_allclose(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, **tol)


# ----------------------------------------------------------------------------
# Hand-computed values.
# ----------------------------------------------------------------------------

# Pair 0: logp_c = -10, logp_r = -12, ref_c = ref_r = -11:
#   logp_c - ref_c = 1, logp_r - ref_r = -1, margin h = 2.
# Pair 1: everything 0, so h = 0 and the rewards tie.
PAIRS = _f32([-10.0, 0.0], [-12.0, 0.0], [-11.0, 0.0], [-11.0, 0.0])
# β = 0.1: rewards β·(logp - ref): chosen [0.1, 0], rejected [-0.1, 0];
# means 0.05 / -0.05, margin 0.1; accuracy 1/2 (a tie is not a win).
PAIR_METRICS = {
  'rewards_chosen': 0.05,
  'rewards_rejected': -0.05,
  'reward_margin': 0.1,
  'reward_accuracy': 0.5,
}


@pytest.mark.parametrize(
  'label_smoothing, want',
  [
    # z = β·h = 0.2: -log σ(0.2) = log(1 + e^-0.2) = 0.598139; pair 1: log 2 = 0.693147.
    (0.0, [0.5981389, 0.6931472]),
    # ε = 0.1: 0.9·log(1 + e^-0.2) + 0.1·log(1 + e^0.2) = 0.9·0.598139 + 0.1·0.798139
    #        = 0.618139; pair 1: log 2 whatever ε.
    (0.1, [0.6181389, 0.6931472]),
    # ε = 0.5: ½(0.598139 + 0.798139) = 0.698139.
    (0.5, [0.6981389, 0.6931472]),
  ],
)
def test_dpo_hand_computed(label_smoothing, want):
  loss, metrics = L.dpo_loss(*PAIRS, beta=0.1, label_smoothing=label_smoothing)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  _assert_metrics(metrics, PAIR_METRICS)


def test_ipo_hand_computed():
  # (h - 1/(2β))² with β = 0.1: (2 - 5)² = 9; pair 1: (0 - 5)² = 25.
  loss, metrics = L.ipo_loss(*PAIRS, beta=0.1)
  np.testing.assert_allclose(loss, [9.0, 25.0], rtol=1e-6)
  _assert_metrics(metrics, PAIR_METRICS)


def test_hinge_hand_computed():
  # max(0, 1 - β·h): β = 0.1: 1 - 0.2 = 0.8; pair 1: 1.
  loss, metrics = L.hinge_loss(*PAIRS, beta=0.1)
  np.testing.assert_allclose(loss, [0.8, 1.0], rtol=1e-6)
  _assert_metrics(metrics, PAIR_METRICS)
  # β = 1: max(0, 1 - 2) = 0, and no gradient past the hinge.
  loss, _ = L.hinge_loss(*PAIRS, beta=1.0)
  np.testing.assert_allclose(loss, [0.0, 1.0], rtol=1e-6)
  grad = jax.grad(lambda c: jnp.sum(L.hinge_loss(c, *PAIRS[1:], beta=1.0)[0]))(PAIRS[0])
  np.testing.assert_allclose(grad, [0.0, -1.0], rtol=1e-6)


@pytest.mark.parametrize(
  'label_smoothing, want',
  [
    # ā_c = -0.5, ā_r = -1, β = 2, γ = 0.5: z = 2·0.5 - 0.5 = 0.5;
    # -log σ(0.5) = log(1 + e^-0.5) = 0.474077. Pair 1 (ā = -1 both): z = -0.5,
    # log(1 + e^0.5) = 0.974077.
    (0.0, [0.4740770, 0.9740770]),
    # ε = 0.2: 0.8·0.474077 + 0.2·0.974077 = 0.574077; pair 1: 0.8·0.974077 + 0.2·0.474077.
    (0.2, [0.5740770, 0.8740770]),
  ],
)
def test_simpo_hand_computed(label_smoothing, want):
  c, r = _f32([-0.5, -1.0], [-1.0, -1.0])
  loss, metrics = L.simpo_loss(c, r, beta=2.0, gamma=0.5, label_smoothing=label_smoothing)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  # Rewards β·ā: chosen [-1, -2] (mean -1.5), rejected [-2, -2] (mean -2).
  _assert_metrics(
    metrics,
    {
      'rewards_chosen': -1.5,
      'rewards_rejected': -2.0,
      'reward_margin': 0.5,
      'reward_accuracy': 0.5,
    },
  )


def test_orpo_hand_computed():
  # ā_c = log ½ (p = 1/2): odds 1, log odds 0. ā_r = log ¼: odds (1/4)/(3/4) = 1/3,
  # log odds -log 3. log odds ratio = log 3 = 1.098612; log σ(log 3) = log(3/4).
  # ℓ = -ā_c - λ·log σ = log 2 - 0.1·log 0.75 = 0.693147 + 0.028768 = 0.721915.
  c, r = _f32([math.log(0.5)], [math.log(0.25)])
  loss, metrics = L.orpo_loss(c, r, lam=0.1)
  np.testing.assert_allclose(loss, [0.7219154], rtol=1e-6)
  _assert_metrics(
    metrics,
    {
      'log_odds_ratio': math.log(3.0),
      'nll_chosen': math.log(2.0),
      # Rewards λ·ā: -0.0693147 and -0.1386294.
      'rewards_chosen': 0.1 * math.log(0.5),
      'rewards_rejected': 0.1 * math.log(0.25),
      'reward_margin': 0.1 * math.log(2.0),
      'reward_accuracy': 1.0,
    },
  )
  # λ = 0 is plain SFT on the chosen response.
  np.testing.assert_allclose(L.orpo_loss(c, r, lam=0.0)[0], [math.log(2.0)], rtol=1e-6)


# ----------------------------------------------------------------------------
# NumPy references and analytic gradients.
# ----------------------------------------------------------------------------


def _random_seq_logps(seed):
  rng = np.random.default_rng(seed)
  c = rng.normal(-50.0, 10.0, B)
  r = rng.normal(-55.0, 10.0, B)
  rc = c + rng.normal(0.0, 5.0, B)
  rr = r + rng.normal(0.0, 5.0, B)
  return _f32(c, r, rc, rr)


def _random_avg_logps(seed):
  rng = np.random.default_rng(seed)
  return _f32(-rng.uniform(0.05, 3.0, B), -rng.uniform(0.05, 3.0, B))


def _np_dpo_family(kind, c, r, rc, rr, beta, label_smoothing=0.0):
  """Float64 (loss, metrics, d loss/d chosen) from the module table."""
  c, r, rc, rr = (np.asarray(x, np.float64) for x in (c, r, rc, rr))
  h = (c - rc) - (r - rr)
  if kind == 'dpo':
    z, eps = beta * h, label_smoothing
    loss = -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
    grad = -(1 - eps) * beta * _sigmoid(-z) + eps * beta * _sigmoid(z)
  elif kind == 'ipo':
    loss = (h - 1.0 / (2.0 * beta)) ** 2
    grad = 2.0 * (h - 1.0 / (2.0 * beta))
  else:
    loss = np.maximum(0.0, 1.0 - beta * h)
    grad = np.where(1.0 - beta * h > 0, -beta, 0.0)
  return loss, _np_reward_metrics(beta * (c - rc), beta * (r - rr)), grad


DPO_FAMILY = [
  pytest.param(L.dpo_loss, 'dpo', dict(beta=0.1), id='dpo'),
  pytest.param(L.dpo_loss, 'dpo', dict(beta=0.5, label_smoothing=0.2), id='cdpo'),
  pytest.param(L.ipo_loss, 'ipo', dict(beta=0.1), id='ipo'),
  pytest.param(L.hinge_loss, 'hinge', dict(beta=0.1), id='hinge'),
]


def _grads(fn, args, **kw):
  """Loss, metrics and the gradient of Σ loss w.r.t. every positional input."""

  def total(*a):
    loss, metrics = fn(*a, **kw)
    return jnp.sum(loss), (loss, metrics)

  grads, (loss, metrics) = jax.grad(total, argnums=tuple(range(len(args))), has_aux=True)(*args)
  return loss, metrics, grads


@pytest.mark.parametrize('fn, kind, kw', DPO_FAMILY)
def test_dpo_family_matches_numpy_reference_and_gradients(fn, kind, kw):
  args = _random_seq_logps(0)
  loss, metrics, (g_c, g_r, g_rc, g_rr) = _grads(fn, args, **kw)
  want, want_metrics, want_grad = _np_dpo_family(kind, *args, **kw)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-5)
  _assert_metrics(metrics, want_metrics)
  np.testing.assert_allclose(g_c, want_grad, rtol=1e-5, atol=1e-6)
  # h depends on logp_c - logp_r: the rejected gradient is the negative.
  np.testing.assert_allclose(g_r, -want_grad, rtol=1e-5, atol=1e-6)
  # Reference logprobs are constants.
  assert np.all(np.asarray(g_rc) == 0.0) and np.all(np.asarray(g_rr) == 0.0)
  assert 0.0 < want_metrics['reward_accuracy'] < 1.0  # wins and losses in the batch


def test_dpo_gradient_is_minus_beta_sigmoid_of_minus_beta_h():
  # ∂/∂logp_c of -log σ(β h) = -β σ(-β h).
  beta = 0.3
  args = _random_seq_logps(1)
  _, _, (g_c, _, _, _) = _grads(L.dpo_loss, args, beta=beta)
  c, r, rc, rr = (np.asarray(x, np.float64) for x in args)
  h = (c - rc) - (r - rr)
  np.testing.assert_allclose(g_c, -beta * _sigmoid(-beta * h), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('label_smoothing', [0.0, 0.25])
def test_simpo_matches_numpy_reference_and_gradient(label_smoothing):
  beta, gamma, eps = 2.5, 0.3, label_smoothing
  c, r = _random_avg_logps(2)
  loss, metrics, (g_c, g_r) = _grads(
    L.simpo_loss, (c, r), beta=beta, gamma=gamma, label_smoothing=eps
  )
  c64, r64 = np.asarray(c, np.float64), np.asarray(r, np.float64)
  z = beta * (c64 - r64) - gamma
  want = -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
  want_grad = -(1 - eps) * beta * _sigmoid(-z) + eps * beta * _sigmoid(z)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  _assert_metrics(metrics, _np_reward_metrics(beta * c64, beta * r64))
  np.testing.assert_allclose(g_c, want_grad, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_r, -want_grad, rtol=1e-5, atol=1e-6)


def _np_orpo(c, r, lam):
  """Float64 (loss, log_odds_ratio, d loss/d c, d loss/d r) with ā ≤ -1e-6."""
  c = np.minimum(np.asarray(c, np.float64), -1e-6)
  r = np.minimum(np.asarray(r, np.float64), -1e-6)
  log_odds = lambda a: a - np.log(-np.expm1(a))  # log(p / (1 - p)), p = e^a
  lor = log_odds(c) - log_odds(r)
  loss = -c - lam * _log_sigmoid(lor)
  # d log_odds(a)/da = 1 + e^a/(1 - e^a) = 1/(1 - e^a); d log σ(x)/dx = σ(-x).
  g_c = -1.0 - lam * _sigmoid(-lor) / (-np.expm1(c))
  g_r = lam * _sigmoid(-lor) / (-np.expm1(r))
  return loss, lor, g_c, g_r


def test_orpo_matches_numpy_reference_and_gradient():
  lam = 0.25
  c, r = _random_avg_logps(3)
  loss, metrics, (g_c, g_r) = _grads(L.orpo_loss, (c, r), lam=lam)
  want, lor, want_g_c, want_g_r = _np_orpo(c, r, lam)
  np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
  c64, r64 = np.asarray(c, np.float64), np.asarray(r, np.float64)
  _assert_metrics(
    metrics,
    {
      'log_odds_ratio': lor.mean(),
      'nll_chosen': -c64.mean(),
      **_np_reward_metrics(lam * c64, lam * r64),
    },
  )
  np.testing.assert_allclose(g_c, want_g_c, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(g_r, want_g_r, rtol=1e-5, atol=1e-6)


def test_orpo_finite_at_extreme_average_logprobs():
  # ā = -1e-7 (p ≈ 1, odds ≈ 1e7) and -50 (p ≈ 2e-22) in every combination.
  c, r = _f32([-1e-7, -1e-7, -50.0, -50.0, -1e-5], [-50.0, -1e-7, -1e-7, -50.0, -2.0])
  loss, metrics, (g_c, g_r) = _grads(L.orpo_loss, (c, r), lam=0.1)
  for x in (loss, g_c, g_r, *metrics.values()):
    assert np.all(np.isfinite(np.asarray(x)))
  want, _, want_g_c, want_g_r = _np_orpo(c, r, 0.1)
  np.testing.assert_allclose(loss, want, rtol=1e-4)
  # Documented clip of ā to ≤ -1e-6: -1e-7 gives the loss of -1e-6, and no
  # gradient flows through the clipped input.
  np.testing.assert_allclose(loss[1], 0.1 * math.log(2.0) + 1e-6, rtol=1e-5)  # equal odds
  assert float(g_c[0]) == 0.0 and float(g_c[1]) == 0.0 and float(g_r[1]) == 0.0
  np.testing.assert_allclose(g_c[2:], want_g_c[2:], rtol=1e-4)
  np.testing.assert_allclose(np.asarray(g_r)[[0, 3, 4]], want_g_r[[0, 3, 4]], rtol=1e-4)


# ----------------------------------------------------------------------------
# check_grads and jit.
# ----------------------------------------------------------------------------

ALL_LOSSES = [
  pytest.param(L.dpo_loss, dict(beta=0.1, label_smoothing=0.1), 4, id='dpo'),
  pytest.param(L.ipo_loss, dict(beta=0.1), 4, id='ipo'),
  pytest.param(L.hinge_loss, dict(beta=0.1), 4, id='hinge'),
  pytest.param(L.simpo_loss, dict(beta=2.0, gamma=0.5, label_smoothing=0.1), 2, id='simpo'),
  pytest.param(L.orpo_loss, dict(lam=0.1), 2, id='orpo'),
]


def _inputs(n_args, seed):
  return _random_seq_logps(seed) if n_args == 4 else _random_avg_logps(seed)


@pytest.mark.parametrize('fn, kw, n_args', ALL_LOSSES)
def test_check_grads(fn, kw, n_args):
  args = _inputs(n_args, 5)
  if fn is L.hinge_loss:  # keep away from the hinge 1 - β h = 0
    c, r, rc, rr = (np.asarray(x, np.float64) for x in args)
    h = (c - rc) - (r - rr)
    shift = np.where(np.abs(1.0 - 0.1 * h) < 0.5, 20.0, 0.0)
    args = _f32(c + shift, r, rc, rr)
  # Only the policy inputs are perturbed (the reference ones are constants).
  f = lambda c, r: fn(c, r, *args[2:], **kw)[0]
  check_grads(f, args[:2], order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


@pytest.mark.parametrize('fn, kw, n_args', ALL_LOSSES)
def test_jit_matches_no_jit(fn, kw, n_args):
  args = _inputs(n_args, 6)
  f = functools.partial(_grads, fn, **kw)
  _tree_allclose(f(args), jax.jit(f)(args), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------

_B = np.zeros((3,), np.float32)
_BAD = np.zeros((4,), np.float32)
_RANK2 = np.zeros((3, 2), np.float32)
REF_LOSSES = [L.dpo_loss, L.ipo_loss, L.hinge_loss]
REF_NAMES = ('chosen_logp', 'rejected_logp', 'ref_chosen_logp', 'ref_rejected_logp')
AVG_LOSSES = [L.simpo_loss, L.orpo_loss]
AVG_NAMES = ('chosen_avg_logp', 'rejected_avg_logp')


@pytest.mark.parametrize('fn', REF_LOSSES)
def test_reference_losses_refuse_rank_2(fn):
  with pytest.raises(ValueError, match=r'`chosen_logp` must have shape \[B\]'):
    fn(_RANK2, _RANK2, _RANK2, _RANK2)


@pytest.mark.parametrize('fn', AVG_LOSSES)
def test_average_logp_losses_refuse_rank_2(fn):
  # The error names the argument the caller passed: `chosen_avg_logp`.
  with pytest.raises(ValueError, match=r'`chosen_avg_logp` must have shape \[B\]'):
    fn(_RANK2, _RANK2)


@pytest.mark.parametrize('fn', REF_LOSSES)
@pytest.mark.parametrize('which', REF_NAMES[1:])
def test_reference_losses_mismatched_shapes(fn, which):
  args = dict.fromkeys(REF_NAMES, _B)
  args[which] = _BAD
  with pytest.raises(ValueError, match=f'`{which}` must have the same shape'):
    fn(**args)


@pytest.mark.parametrize('fn', AVG_LOSSES)
def test_average_logp_losses_mismatched_shapes(fn):
  with pytest.raises(ValueError, match='`rejected_avg_logp` must have the same shape'):
    fn(chosen_avg_logp=_B, rejected_avg_logp=_BAD)


@pytest.mark.parametrize('beta', [0.0, -0.1])
@pytest.mark.parametrize('fn', [*REF_LOSSES, L.simpo_loss])
def test_beta_must_be_positive(fn, beta):
  args = (_B,) * (4 if fn in REF_LOSSES else 2)
  with pytest.raises(ValueError, match='`beta` must be > 0'):
    fn(*args, beta=beta)


@pytest.mark.parametrize('label_smoothing', [-0.1, 0.6, 1.0])
@pytest.mark.parametrize('fn', [L.dpo_loss, L.simpo_loss])
def test_label_smoothing_range(fn, label_smoothing):
  args = (_B,) * (4 if fn is L.dpo_loss else 2)
  with pytest.raises(ValueError, match=r'`label_smoothing` must be in \[0, 0.5\]'):
    fn(*args, label_smoothing=label_smoothing)


def test_simpo_gamma_and_orpo_lam_nonnegative():
  with pytest.raises(ValueError, match='`gamma` must be >= 0'):
    L.simpo_loss(_B, _B, gamma=-0.5)
  with pytest.raises(ValueError, match='`lam` must be >= 0'):
    L.orpo_loss(_B, _B, lam=-0.1)
