"""Tests for jrl.losses.reductions: the masked reductions and `aggregate`.

Each mode is checked against hand-computed values, an independent NumPy
reference, the sliced (unpadded) computation, numerical gradients, and jit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jrl.losses import reductions as R

MODES = R.AGGREGATION_MODES
NORM = 4.0

# A 3x4 batch: row 0 has 3 valid tokens, row 1 has 1, row 2 none. The masked
# entries hold 100s so that any leak of a padded value shows up.
X_HAND = np.array(
  [
    [1.0, 2.0, 3.0, 100.0],
    [5.0, 100.0, 100.0, 100.0],
    [100.0, 100.0, 100.0, 100.0],
  ],
  np.float32,
)
MASK_HAND = np.array(
  [
    [1, 1, 1, 0],
    [1, 0, 0, 0],
    [0, 0, 0, 0],
  ],
  np.float32,
)


def _kwargs(mode, norm=NORM):
  return {'norm': norm} if mode == 'seq-mean-token-sum-norm' else {}


def _np_reduce(x, mask, mode, *, norm=None, num_seqs=None):
  """An obvious float64 loop implementation of the module table."""
  x = np.asarray(x, np.float64)
  mask = np.asarray(mask, np.float64)
  b, t = x.shape
  n = b if num_seqs is None else num_seqs
  total, count = 0.0, 0.0
  seq_means, seq_sums = [], []
  for i in range(b):
    s, c = 0.0, 0.0
    for j in range(t):
      if mask[i, j]:
        s += x[i, j]
        c += 1.0
    total += s
    count += c
    seq_sums.append(s)
    seq_means.append(s / c if c else 0.0)
  if mode == 'token-sum':
    return total
  if mode == 'token-mean':
    return total / count if count else 0.0
  if mode == 'seq-mean-token-mean':
    return sum(seq_means) / n
  if mode == 'seq-mean-token-sum':
    return sum(seq_sums) / n
  if mode == 'seq-mean-token-sum-norm':
    return total / (n * norm)
  raise AssertionError(mode)


def _right_padded_mask(lengths, t):
  return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _random_masks(rng, b, t):
  return {
    'right_padded': _right_padded_mask(rng.integers(0, t + 1, size=b), t),
    'random': (rng.random((b, t)) < 0.5).astype(np.float32),
    'all_valid': np.ones((b, t), np.float32),
    'one_token': np.eye(b, t, dtype=np.float32),
  }


# ----------------------------------------------------------------------------
# Hand-computed values.
# ----------------------------------------------------------------------------


def test_hand_computed_values():
  # Valid tokens: row 0 -> 1, 2, 3 (sum 6, 3 tokens); row 1 -> 5 (sum 5, 1 token);
  # row 2 -> none (sum 0, 0 tokens). B = 3.
  x, m = X_HAND, MASK_HAND
  # token_sum  = 1 + 2 + 3 + 5 = 11
  np.testing.assert_allclose(R.token_sum(x, m), 11.0, rtol=1e-6)
  # token_mean = 11 / 4 tokens = 2.75
  np.testing.assert_allclose(R.token_mean(x, m), 2.75, rtol=1e-6)
  # seq_mean_token_mean = (6/3 + 5/1 + 0) / 3 = (2 + 5 + 0) / 3 = 7/3
  np.testing.assert_allclose(R.seq_mean_token_mean(x, m), 7.0 / 3.0, rtol=1e-6)
  # seq_mean_token_sum = (6 + 5 + 0) / 3 = 11/3
  np.testing.assert_allclose(R.seq_mean_token_sum(x, m), 11.0 / 3.0, rtol=1e-6)
  # seq_mean_token_sum_norm(norm=4) = 11 / (3 * 4) = 11/12
  np.testing.assert_allclose(R.seq_mean_token_sum_norm(x, m, norm=4.0), 11.0 / 12.0, rtol=1e-6)


@pytest.mark.parametrize(
  'mode, expected',
  [
    ('token-sum', 11.0),  # 1 + 2 + 3 + 5
    ('token-mean', 2.75),  # 11 / 4
    ('seq-mean-token-mean', 7.0 / 3.0),  # (2 + 5 + 0) / 3
    ('seq-mean-token-sum', 11.0 / 3.0),  # (6 + 5 + 0) / 3
    ('seq-mean-token-sum-norm', 11.0 / 12.0),  # 11 / (3 * 4)
  ],
)
def test_aggregate_hand_computed(mode, expected):
  out = R.aggregate(X_HAND, MASK_HAND, mode, **_kwargs(mode))
  assert out.shape == ()
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_hand_computed_num_seqs_override():
  x, m = X_HAND, MASK_HAND
  # num_seqs=2 leaves the all-masked row out of the sequence mean:
  # seq_mean_token_mean = (2 + 5) / 2 = 3.5
  np.testing.assert_allclose(R.seq_mean_token_mean(x, m, num_seqs=2), 3.5, rtol=1e-6)
  # seq_mean_token_sum = (6 + 5) / 2 = 5.5
  np.testing.assert_allclose(R.seq_mean_token_sum(x, m, num_seqs=2), 5.5, rtol=1e-6)
  # seq_mean_token_sum_norm = 11 / (2 * 4) = 1.375
  np.testing.assert_allclose(
    R.seq_mean_token_sum_norm(x, m, norm=4.0, num_seqs=2), 1.375, rtol=1e-6
  )
  # Early veRL Dr. GRPO (divide by norm alone): num_seqs=1 -> 11 / 4 = 2.75.
  np.testing.assert_allclose(R.seq_mean_token_sum_norm(x, m, norm=4.0, num_seqs=1), 2.75, rtol=1e-6)
  # Through aggregate, and with a jnp scalar num_seqs.
  np.testing.assert_allclose(
    R.aggregate(x, m, 'seq-mean-token-sum', num_seqs=jnp.float32(2.0)), 5.5, rtol=1e-6
  )
  np.testing.assert_allclose(
    R.aggregate(x, m, 'seq-mean-token-sum-norm', norm=4.0, num_seqs=2), 1.375, rtol=1e-6
  )


@pytest.mark.parametrize('norm, expected', [(1.0, 11.0 / 3.0), (2.0, 11.0 / 6.0), (11, 1.0 / 3.0)])
def test_norm_values(norm, expected):
  # 11 / (3 * norm)
  out = R.aggregate(X_HAND, MASK_HAND, 'seq-mean-token-sum-norm', norm=norm)
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_bool_mask_equals_float_mask():
  for mode in MODES:
    a = R.aggregate(X_HAND, MASK_HAND.astype(bool), mode, **_kwargs(mode))
    b = R.aggregate(X_HAND, MASK_HAND, mode, **_kwargs(mode))
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_low_precision_x_reduced_in_float32():
  x = np.full((2, 500), 1.0 + 2.0**-7, np.float32)  # exactly representable in bfloat16
  m = np.ones_like(x)
  out = R.token_sum(jnp.asarray(x, jnp.bfloat16), m)
  assert out.dtype == jnp.float32
  # 1000 · 1.0078125 = 1007.8125; a bfloat16 result would be 1008 (spacing 4 there).
  np.testing.assert_allclose(out, 1007.8125, rtol=1e-6)


# ----------------------------------------------------------------------------
# Independent NumPy reference on random inputs.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('mode', MODES)
def test_matches_numpy_reference(mode):
  rng = np.random.default_rng(0)
  b, t = 5, 7
  x = rng.normal(size=(b, t)).astype(np.float32)
  for name, m in _random_masks(rng, b, t).items():
    for num_seqs in (None, 3) if mode.startswith('seq-mean') else (None,):
      kw = dict(_kwargs(mode, norm=6.0))
      if num_seqs is not None:
        kw['num_seqs'] = num_seqs
      out = R.aggregate(x, m, mode, **kw)
      ref = _np_reduce(x, m, mode, **kw)
      np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6, err_msg=f'{name} {num_seqs}')


def test_named_functions_equal_aggregate():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(4, 6)).astype(np.float32)
  m = _random_masks(rng, 4, 6)['random']
  pairs = [
    (R.token_sum(x, m), 'token-sum'),
    (R.token_mean(x, m), 'token-mean'),
    (R.seq_mean_token_mean(x, m), 'seq-mean-token-mean'),
    (R.seq_mean_token_sum(x, m), 'seq-mean-token-sum'),
    (R.seq_mean_token_sum_norm(x, m, norm=NORM), 'seq-mean-token-sum-norm'),
  ]
  for value, mode in pairs:
    np.testing.assert_array_equal(value, R.aggregate(x, m, mode, **_kwargs(mode)))


# ----------------------------------------------------------------------------
# Masked vs sliced: right-padded rows reduce like their valid parts.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('lengths', [(3, 1, 4, 2), (0, 2, 4, 1), (4, 4, 4, 4)])
def test_masked_equals_sliced(lengths):
  rng = np.random.default_rng(2)
  b, t = len(lengths), 4
  x = rng.normal(size=(b, t)).astype(np.float32)
  m = _right_padded_mask(lengths, t)
  parts = [x[i, :n].astype(np.float64) for i, n in enumerate(lengths)]
  flat = np.concatenate(parts)

  np.testing.assert_allclose(R.token_sum(x, m), flat.sum(), rtol=1e-5)
  np.testing.assert_allclose(R.token_mean(x, m), flat.mean(), rtol=1e-5)
  seq_means = [p.mean() if p.size else 0.0 for p in parts]
  np.testing.assert_allclose(R.seq_mean_token_mean(x, m), np.mean(seq_means), rtol=1e-5)
  np.testing.assert_allclose(
    R.seq_mean_token_sum(x, m), np.mean([p.sum() for p in parts]), rtol=1e-5
  )
  np.testing.assert_allclose(
    R.seq_mean_token_sum_norm(x, m, norm=NORM), flat.sum() / (b * NORM), rtol=1e-5
  )


@pytest.mark.parametrize('mode', MODES)
def test_extra_padding_columns_change_nothing(mode):
  rng = np.random.default_rng(3)
  x = rng.normal(size=(3, 5)).astype(np.float32)
  m = _right_padded_mask([5, 2, 0], 5)
  x_pad = np.concatenate([x, rng.normal(size=(3, 4)).astype(np.float32)], axis=1)
  m_pad = np.concatenate([m, np.zeros((3, 4), np.float32)], axis=1)
  a = R.aggregate(x, m, mode, **_kwargs(mode))
  b = R.aggregate(x_pad, m_pad, mode, **_kwargs(mode))
  np.testing.assert_allclose(a, b, rtol=1e-6)


# ----------------------------------------------------------------------------
# Gradients.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('mode', MODES)
def test_check_grads(mode):
  rng = np.random.default_rng(4)
  x = rng.normal(size=(3, 4)).astype(np.float32)
  m = MASK_HAND
  f = lambda x: R.aggregate(x, m, mode, **_kwargs(mode))
  check_grads(f, (x,), order=1, modes=['rev'], atol=1e-2, rtol=1e-2, eps=1e-3)


@pytest.mark.parametrize(
  'mode, expected_grad',
  [
    # d/dx of Σ m x is m.
    ('token-sum', MASK_HAND),
    # d/dx of Σ m x / 4 is m / 4.
    ('token-mean', MASK_HAND / 4.0),
    # Row 0: m / (3 tokens · 3 rows); row 1: m / (1 · 3); row 2: 0.
    ('seq-mean-token-mean', MASK_HAND / np.array([[9.0], [3.0], [1.0]], np.float32)),
    # m / 3 rows.
    ('seq-mean-token-sum', MASK_HAND / 3.0),
    # m / (3 rows · norm 4).
    ('seq-mean-token-sum-norm', MASK_HAND / 12.0),
  ],
)
def test_hand_computed_gradients(mode, expected_grad):
  g = jax.grad(lambda x: R.aggregate(x, MASK_HAND, mode, **_kwargs(mode)))(X_HAND)
  np.testing.assert_allclose(g, expected_grad, rtol=1e-6)


# ----------------------------------------------------------------------------
# jit / no-jit.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('mode', MODES)
def test_jit_equals_no_jit(mode):
  rng = np.random.default_rng(5)
  x = rng.normal(size=(4, 6)).astype(np.float32)
  m = _random_masks(rng, 4, 6)['right_padded']
  f = functools.partial(R.aggregate, mode=mode, **_kwargs(mode))
  np.testing.assert_allclose(jax.jit(f)(x, m), f(x, m), rtol=1e-6)
  g = jax.grad(f)
  np.testing.assert_allclose(jax.jit(g)(x, m), g(x, m), rtol=1e-6)


def test_jit_with_traced_num_seqs():
  f = jax.jit(lambda x, m, n: R.seq_mean_token_sum(x, m, num_seqs=n))
  np.testing.assert_allclose(f(X_HAND, MASK_HAND, 2.0), 5.5, rtol=1e-6)  # (6 + 5) / 2


# ----------------------------------------------------------------------------
# Fully masked batch.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('mode', MODES)
def test_fully_masked_batch_is_zero_with_zero_gradient(mode):
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  m = np.zeros((3, 4), np.float32)
  f = lambda x: R.aggregate(x, m, mode, **_kwargs(mode))
  value, grad = jax.value_and_grad(f)(x)
  assert np.isfinite(value)
  assert value == 0.0
  assert np.all(np.isfinite(grad))
  np.testing.assert_array_equal(grad, np.zeros_like(x))
  value_jit, grad_jit = jax.jit(jax.value_and_grad(f))(x)
  assert value_jit == 0.0
  np.testing.assert_array_equal(grad_jit, np.zeros_like(x))


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------

ALL_FUNCTIONS = [
  R.token_sum,
  R.token_mean,
  R.seq_mean_token_mean,
  R.seq_mean_token_sum,
  functools.partial(R.seq_mean_token_sum_norm, norm=NORM),
  functools.partial(R.aggregate, mode='token-mean'),
]


@pytest.mark.parametrize('fn', ALL_FUNCTIONS)
def test_mismatched_mask_shape_raises(fn):
  x = np.zeros((3, 4), np.float32)
  with pytest.raises(ValueError, match='`mask`'):
    fn(x, np.ones((3, 5), np.float32))
  # Broadcastable shapes are refused too.
  with pytest.raises(ValueError, match='`mask`'):
    fn(x, np.ones((3, 1), np.float32))
  with pytest.raises(ValueError, match='`mask`'):
    fn(x, np.ones((4,), np.float32))


@pytest.mark.parametrize('fn', ALL_FUNCTIONS)
def test_wrong_rank_x_raises(fn):
  with pytest.raises(ValueError, match='`x`'):
    fn(np.zeros((4,), np.float32), np.ones((4,), np.float32))
  with pytest.raises(ValueError, match='`x`'):
    fn(np.zeros((2, 3, 4), np.float32), np.ones((2, 3, 4), np.float32))


def test_unknown_mode_raises():
  with pytest.raises(ValueError, match='`mode`'):
    R.aggregate(X_HAND, MASK_HAND, 'seq-mean')
  with pytest.raises(ValueError, match='`mode`'):
    R.aggregate(X_HAND, MASK_HAND, 'token_mean')


def test_missing_norm_raises():
  with pytest.raises(ValueError, match='`norm`'):
    R.aggregate(X_HAND, MASK_HAND, 'seq-mean-token-sum-norm')


@pytest.mark.parametrize('mode', [m for m in MODES if m != 'seq-mean-token-sum-norm'])
def test_norm_refused_by_other_modes(mode):
  with pytest.raises(ValueError, match='`norm`'):
    R.aggregate(X_HAND, MASK_HAND, mode, norm=NORM)


@pytest.mark.parametrize('norm', [0, 0.0, -1.0])
def test_nonpositive_norm_raises(norm):
  with pytest.raises(ValueError, match='`norm`'):
    R.aggregate(X_HAND, MASK_HAND, 'seq-mean-token-sum-norm', norm=norm)
  with pytest.raises(ValueError, match='`norm`'):
    R.seq_mean_token_sum_norm(X_HAND, MASK_HAND, norm=norm)


@pytest.mark.parametrize('mode', ['token-mean', 'token-sum'])
def test_num_seqs_refused_by_token_modes(mode):
  with pytest.raises(ValueError, match='`num_seqs`'):
    R.aggregate(X_HAND, MASK_HAND, mode, num_seqs=2)


@pytest.mark.parametrize('num_seqs', [0, -2, 0.0])
def test_nonpositive_num_seqs_raises(num_seqs):
  for mode in ('seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm'):
    with pytest.raises(ValueError, match='`num_seqs`'):
      R.aggregate(X_HAND, MASK_HAND, mode, num_seqs=num_seqs, **_kwargs(mode))


def test_conftest_gives_eight_fake_devices():
  assert jax.device_count() == 8
