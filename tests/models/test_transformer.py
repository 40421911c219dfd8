"""Tests for jrl.models.transformer, jrl.models.config and jrl.parallel.

The transformer is checked against obvious references (STYLE.md point 14):
sharded vs single-device forwards on the 8 fake CPU devices of conftest.py,
padded vs unpadded sequences, chunked logprobs vs a log-softmax of the full
logits, grouped attention vs an explicit repeat-kv NumPy loop, Llama 3 rope
scaling vs a float64 NumPy transcription of Meta's formula, and gradient
checks (every parameter gets a gradient; the causal mask lets none leak
backwards in time). Configs are tiny and batch shapes few, so that each
jitted function compiles a handful of times only.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jrl.models as M
from jrl import parallel
from jrl.models.config import RopeScaling, rope_inv_freq

# V vocab, D width, F MLP width, H query heads, K kv heads, d head width.
CFG = M.ModelConfig(
  vocab_size=64,
  width=32,
  mlp_width=64,
  num_layers=2,
  num_heads=8,
  num_kv_heads=4,
  head_dim=8,
  qkv_bias=True,
  qk_norm=True,
)
# K * d = 12, F = 36, V = 60: none divisible by a tensor axis of 8 (replicated);
# H * d = 48 still is.
CFG_ODD = CFG.replace(vocab_size=60, mlp_width=36, num_kv_heads=2, head_dim=6)
KEY = jax.random.key(0)
B, T = 8, 8  # the one batch shape of most tests: B divides every mesh's data * fsdp

_logits = jax.jit(M.logits, static_argnums=0)
_hidden = jax.jit(M.hidden_states, static_argnums=0)
_values = jax.jit(M.values, static_argnums=0)
_scores = jax.jit(M.sequence_scores, static_argnums=0)
_logprobs = jax.jit(
  M.next_token_logprobs, static_argnums=0, static_argnames=('chunk_size', 'with_entropy')
)


@functools.cache
def _model(cfg=CFG):
  """(graphdef, params) with both an LM head and a scalar head."""
  return M.create(cfg, KEY, scalar_head=True)


def _tokens(shape=(B, T), seed=0, vocab=CFG.vocab_size):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def _right_mask(lengths, t=T):
  return jnp.asarray(np.arange(t)[None, :] < np.asarray(lengths)[:, None], jnp.int32)


def _leaves(tree):
  """{path tuple: numpy array} of a params-like pytree."""
  return {
    parallel.path_keys(path): np.asarray(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }


def _np_log_softmax(z):
  z = np.asarray(z, np.float64)
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ----------------------------------------------------------------------------
# 1. Sharding on the 8 fake devices.
# ----------------------------------------------------------------------------

# name: (mesh shape, config, params from create_sharded (else device_put by
# param_shardings)).
MESHES = {
  'fsdp': ((1, 8, 1), CFG, False),
  'tensor': ((1, 1, 8), CFG, False),
  'tensor_fallback': ((1, 1, 8), CFG_ODD, True),
  'mixed': ((2, 2, 2), CFG, True),
}

# Specs written out by hand from parallel.RULES, independent of spec_for.
EXPECTED_SPECS = {
  'fsdp': {
    ('embed', 'embedding'): P(None, 'fsdp'),
    ('layers', 0, 'attn', 'q', 'kernel'): P('fsdp', None),
    ('layers', 1, 'attn', 'o', 'kernel'): P(None, 'fsdp'),
    ('layers', 0, 'mlp', 'gate', 'kernel'): P('fsdp', None),
    ('layers', 0, 'attn_norm', 'scale'): P(None),
    ('lm_head', 'kernel'): P('fsdp', None),
  },
  'tensor': {
    ('embed', 'embedding'): P('tensor', None),
    ('layers', 0, 'attn', 'q', 'kernel'): P(None, 'tensor'),
    ('layers', 0, 'attn', 'k', 'kernel'): P(None, 'tensor'),
    ('layers', 0, 'attn', 'v', 'bias'): P('tensor'),
    ('layers', 1, 'attn', 'o', 'kernel'): P('tensor', None),
    ('layers', 0, 'mlp', 'down', 'kernel'): P('tensor', None),
    ('layers', 0, 'attn', 'q_norm', 'scale'): P(None),
    ('lm_head', 'kernel'): P(None, 'tensor'),
    ('score', 'kernel'): P(None, None),
  },
  'tensor_fallback': {
    ('embed', 'embedding'): P(None, None),
    ('layers', 0, 'attn', 'q', 'kernel'): P(None, 'tensor'),
    ('layers', 0, 'attn', 'k', 'kernel'): P(None, None),
    ('layers', 0, 'attn', 'v', 'kernel'): P(None, None),
    ('layers', 0, 'attn', 'k', 'bias'): P(None),
    ('layers', 0, 'mlp', 'gate', 'kernel'): P(None, None),
    ('lm_head', 'kernel'): P(None, None),
  },
  'mixed': {
    ('embed', 'embedding'): P('tensor', 'fsdp'),
    ('layers', 0, 'mlp', 'gate', 'kernel'): P('fsdp', 'tensor'),
    ('layers', 1, 'mlp', 'down', 'kernel'): P('tensor', 'fsdp'),
    ('layers', 0, 'attn', 'k', 'kernel'): P('fsdp', 'tensor'),
    ('final_norm', 'scale'): P(None),
    ('score', 'kernel'): P('fsdp', None),
  },
}


@pytest.mark.parametrize('name', sorted(MESHES))
def test_sharded_forward_matches_single_device(name):
  shape, cfg, use_create_sharded = MESHES[name]
  mesh = parallel.make_mesh(*shape)
  graphdef, params = _model(cfg)
  tokens = _tokens(vocab=cfg.vocab_size)
  mask = _right_mask([8, 7, 5, 8, 1, 3, 8, 6])
  expected = np.asarray(_logits(graphdef, params, tokens, mask))

  if use_create_sharded:
    sgraphdef, sparams = M.create_sharded(cfg, KEY, mesh, scalar_head=True)
    # The values of `create` with the same key (jit and eager init differ in
    # the last bit of the normal sampler at most).
    single, sharded = _leaves(params), _leaves(sparams)
    assert sharded.keys() == single.keys()
    for path in single:
      np.testing.assert_allclose(sharded[path], single[path], rtol=1e-6, atol=0, err_msg=str(path))
  else:
    sgraphdef = graphdef
    sparams = jax.device_put(params, parallel.param_shardings(mesh, params, M.param_logical_axes))
  batch = parallel.batch_sharding(mesh)
  got = _logits(sgraphdef, sparams, jax.device_put(tokens, batch), jax.device_put(mask, batch))
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)

  # Layout: as the rules say, and physically split.
  for path, leaf in jax.tree_util.tree_leaves_with_path(sparams):
    keys = parallel.path_keys(path)
    spec = parallel.spec_for(leaf.shape, M.param_logical_axes(keys), mesh)
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), keys
    local = tuple(
      n // (1 if a is None else mesh.shape[a])
      for n, a in zip(leaf.shape, tuple(spec) + (None,) * leaf.ndim, strict=False)
    )
    assert leaf.addressable_shards[0].data.shape == local, keys
  by_path = {
    parallel.path_keys(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(sparams)
  }
  for keys, spec in EXPECTED_SPECS[name].items():
    leaf = by_path[keys]
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), (
      keys,
      leaf.sharding.spec,
      spec,
    )


def test_param_shardings_on_1x2x4_mesh():
  mesh = parallel.make_mesh(1, 2, 4)
  _, abstract_params = M.abstract(CFG, scalar_head=True)
  shardings = _leaves_struct(parallel.param_shardings(mesh, abstract_params, M.param_logical_axes))
  assert shardings[('layers', 0, 'mlp', 'gate', 'kernel')].spec == P('fsdp', 'tensor')
  assert shardings[('layers', 1, 'mlp', 'down', 'kernel')].spec == P('tensor', 'fsdp')
  assert shardings[('embed', 'embedding')].spec == P('tensor', 'fsdp')
  assert shardings[('layers', 0, 'attn', 'k', 'bias')].spec == P('tensor')
  assert shardings[('final_norm', 'scale')].spec == P(None)
  assert shardings[('score', 'kernel')].spec == P('fsdp', None)


def _leaves_struct(tree):
  return {
    parallel.path_keys(path): leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: isinstance(x, NamedSharding)
    )
  }


def test_spec_for_rules():
  mesh = parallel.make_mesh(1, 2, 4)
  assert parallel.spec_for((32, 64), ('embed', 'mlp'), mesh) == P('fsdp', 'tensor')
  # Not divisible by the mesh axis: replicated.
  assert parallel.spec_for((33, 62), ('embed', 'mlp'), mesh) == P(None, None)
  # A mesh axis is used by one dimension only.
  assert parallel.spec_for((64, 64), ('vocab', 'mlp'), mesh) == P('tensor', None)
  # Size-1 axes are never named.
  assert parallel.spec_for((8, 8), ('embed', 'mlp'), parallel.make_mesh(8, 1, 1)) == P(None, None)
  assert parallel.spec_for((8,), (None,), mesh) == P(None)
  with pytest.raises(ValueError, match='`bogus`'):
    parallel.spec_for((8,), ('bogus',), mesh)
  with pytest.raises(ValueError, match='do not match shape'):
    parallel.spec_for((8, 8), ('embed',), mesh)


VARIANTS = {
  'plain': (CFG.replace(qkv_bias=False, qk_norm=False), {}),
  'qkv_bias': (CFG.replace(qk_norm=False), {}),
  'qk_norm': (CFG.replace(qkv_bias=False), {}),
  'tied': (CFG.replace(tie_embeddings=True), {}),
  'untied_scalar_head': (CFG, {'scalar_head': True}),
  'critic_only': (CFG, {'lm_head': False, 'scalar_head': True}),
}


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_every_parameter_has_logical_axes(variant):
  cfg, kwargs = VARIANTS[variant]
  _, params = M.abstract(cfg, **kwargs)
  leaves = _leaves_struct(params)
  for keys, leaf in leaves.items():
    axes = M.param_logical_axes(keys)
    assert len(axes) == len(leaf.shape), (keys, axes, leaf.shape)
  names = {k for keys in leaves for k in keys if isinstance(k, str)}
  has_lm_head = kwargs.get('lm_head', True) and not cfg.tie_embeddings
  assert (('lm_head', 'kernel') in leaves) == has_lm_head
  assert (('score', 'kernel') in leaves) == kwargs.get('scalar_head', False)
  assert ('q_norm' in names) == cfg.qk_norm
  assert (('layers', 0, 'attn', 'q', 'bias') in leaves) == cfg.qkv_bias
  assert len(leaves) == len(jax.tree.leaves(params))
  # Every leaf also gets a NamedSharding on a real mesh.
  mesh = parallel.make_mesh(2, 2, 2)
  shardings = jax.tree.leaves(parallel.param_shardings(mesh, params, M.param_logical_axes))
  assert len(shardings) == len(leaves)


@pytest.mark.parametrize(
  'path',
  [
    ('bogus',),
    ('layers', 0, 'attn', 'w', 'kernel'),
    ('layers', 0, 'mlp', 'gate', 'bias'),
    ('lm_head', 'bias'),
    (),
  ],
)
def test_param_logical_axes_unknown_path_raises(path):
  with pytest.raises(ValueError, match='no logical axes'):
    M.param_logical_axes(path)


def test_make_mesh_shapes():
  assert dict(parallel.make_mesh().shape) == {'data': 8, 'fsdp': 1, 'expert': 1, 'tensor': 1}
  assert dict(parallel.make_mesh(data=1, fsdp=-1, tensor=2).shape) == {
    'data': 1,
    'fsdp': 4,
    'expert': 1,
    'tensor': 2,
  }
  assert dict(parallel.make_mesh(data=1, tensor=2, expert=4).shape) == {
    'data': 1,
    'fsdp': 1,
    'expert': 4,
    'tensor': 2,
  }
  assert parallel.make_mesh(2, 2, 2).axis_names == parallel.MESH_AXES


@pytest.mark.parametrize(
  'kwargs, pattern',
  [
    ({'data': 2, 'fsdp': 2, 'tensor': 3}, 'multiply to 12.*8 devices'),
    ({'data': 1, 'fsdp': 1, 'tensor': 1}, 'multiply to 1'),
    ({'data': -1, 'fsdp': -1}, "at most one.*'data', 'fsdp'"),
    ({'data': -1, 'tensor': 3}, 'cannot be split'),
    ({'data': 8, 'fsdp': 0}, '`fsdp`'),
    ({'data': 0, 'fsdp': 8}, '`data`'),
    ({'data': 8, 'tensor': -2}, '`tensor`'),
    ({'data': 4, 'tensor': 2.0}, '`tensor`'),
  ],
)
def test_make_mesh_errors(kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    parallel.make_mesh(**kwargs)


# ----------------------------------------------------------------------------
# 2. Gradients.
# ----------------------------------------------------------------------------


def _lm_loss(params, graphdef, tokens, mask):
  logp, _ = M.next_token_logprobs(graphdef, params, tokens, mask, chunk_size=13)
  real = mask.at[:, 0].set(0).astype(jnp.float32)
  return -jnp.sum(logp * real) / jnp.sum(real)


def _value_loss(params, graphdef, tokens, mask):
  v = M.values(graphdef, params, tokens, mask)
  target = jnp.linspace(-1.0, 1.0, tokens.shape[1])[None]
  m = mask.astype(jnp.float32)
  return jnp.sum(jnp.square(v - target) * m) / jnp.sum(m)


def _assert_all_nonzero_finite(grads, zero=()):
  leaves = _leaves(grads)
  assert leaves
  for keys, g in leaves.items():
    assert np.all(np.isfinite(g)), keys
    if keys[0] in zero:
      np.testing.assert_array_equal(g, 0, err_msg=str(keys))
    else:
      assert np.any(g != 0), f'zero gradient for {keys}'


def test_lm_loss_gradient_reaches_every_parameter():
  graphdef, params = _model()
  mask = _right_mask([8, 7, 5, 8, 2, 3, 8, 6])
  loss, grads = jax.jit(jax.value_and_grad(_lm_loss), static_argnums=1)(
    params, graphdef, _tokens(), mask
  )
  assert np.isfinite(loss) and loss > 0
  # The scalar head does not enter the LM loss.
  _assert_all_nonzero_finite(grads, zero=('score',))


def test_value_loss_gradient_reaches_every_parameter():
  graphdef, params = _model()
  mask = _right_mask([8, 7, 5, 8, 2, 3, 8, 6])
  grads = jax.jit(jax.grad(_value_loss), static_argnums=1)(params, graphdef, _tokens(), mask)
  # The LM head does not enter the value loss.
  _assert_all_nonzero_finite(grads, zero=('lm_head',))


def test_tied_lm_loss_gradient_reaches_every_parameter():
  graphdef, params = M.create(CFG.replace(tie_embeddings=True), KEY)
  grads = jax.jit(jax.grad(_lm_loss), static_argnums=1)(
    params, graphdef, _tokens(), _right_mask([8] * B)
  )
  leaves = _leaves(grads)
  assert ('lm_head', 'kernel') not in leaves
  _assert_all_nonzero_finite(grads)


def _causal_tokens():
  """Row 0 holds 8 distinct tokens; no token of row 0 repeats within it."""
  tokens = np.asarray(_tokens(), np.int32).copy()
  tokens[0] = [5, 17, 42, 3, 60, 29, 11, 50]
  return jnp.asarray(tokens)


@functools.partial(jax.jit, static_argnums=1)
@jax.grad
def _causal_grad(params, graphdef, tokens, i):
  # logp[0, i + 1] = log p(tokens[0, i + 1] | tokens[0, :i + 1]).
  logp, _ = M.next_token_logprobs(graphdef, params, tokens, chunk_size=13)
  return -logp[0, i + 1]


@pytest.mark.parametrize('i', [0, 3, 6])
def test_causal_mask_no_gradient_from_later_tokens(i):
  graphdef, params = _model()
  tokens = _causal_tokens()
  grads = _leaves(_causal_grad(params, graphdef, tokens, i))
  g_emb = grads[('embed', 'embedding')]
  row = np.asarray(tokens[0])
  for tok in row[i + 1 :]:
    np.testing.assert_array_equal(g_emb[tok], 0, err_msg=f'token {tok} after position {i}')
  for tok in row[: i + 1]:
    assert np.any(g_emb[tok] != 0), f'token {tok} at or before position {i}'
  # Tokens not in row 0 at all get nothing either (other rows do not enter).
  others = np.setdiff1d(np.arange(CFG.vocab_size), row[: i + 1])
  np.testing.assert_array_equal(g_emb[others], 0)


def test_changing_later_tokens_leaves_earlier_logits_bitwise_unchanged():
  graphdef, params = _model()
  tokens = _causal_tokens()
  base = np.asarray(_logits(graphdef, params, tokens))
  for i in (0, 4, 6):
    changed = tokens.at[:, i + 1 :].set((tokens[:, i + 1 :] + 7) % CFG.vocab_size)
    got = np.asarray(_logits(graphdef, params, changed))
    np.testing.assert_array_equal(got[:, : i + 1], base[:, : i + 1])
    assert np.all(np.abs(got[:, i + 1 :] - base[:, i + 1 :]).max(-1) > 0)


# ----------------------------------------------------------------------------
# 3. Padding.
# ----------------------------------------------------------------------------

SEQ = np.asarray([7, 33, 2, 61, 19], np.int32)  # n = 5 real tokens
PAD_ID = 0


def _padded_batch(fill=None):
  """Row 0: left padded; row 1: right padded; row 2: all padding; rows 3+: full.

  `fill` ([B, T] int) gives the ids under the pad mask (default PAD_ID).
  """
  n = len(SEQ)
  tokens = np.asarray(_tokens(seed=1), np.int32).copy()
  mask = np.ones((B, T), np.int32)
  mask[0, : T - n] = 0
  mask[1, n:] = 0
  mask[2] = 0
  pad = np.full((B, T), PAD_ID, np.int32) if fill is None else np.asarray(fill, np.int32)
  tokens = np.where(mask == 1, tokens, pad)
  tokens[0, T - n :] = SEQ
  tokens[1, :n] = SEQ
  return jnp.asarray(tokens), jnp.asarray(mask)


def test_left_and_right_padding_match_unpadded():
  graphdef, params = _model()
  n = len(SEQ)
  tokens, mask = _padded_batch()
  positions = M.positions_from_mask(mask)
  np.testing.assert_array_equal(positions[0], [0, 0, 0, 0, 1, 2, 3, 4])
  np.testing.assert_array_equal(positions[1, :n], np.arange(n))
  alone = np.asarray(_logits(graphdef, params, jnp.asarray(SEQ)[None]))[0]
  got = np.asarray(_logits(graphdef, params, tokens, mask, positions))
  np.testing.assert_allclose(got[0, T - n :], alone, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1, :n], alone, rtol=1e-5, atol=1e-5)
  # Default positions are positions_from_mask(mask).
  np.testing.assert_array_equal(np.asarray(_logits(graphdef, params, tokens, mask)), got)
  # Without the mask and positions the left-padded row is different.
  unmasked = np.asarray(_logits(graphdef, params, tokens))
  assert np.abs(unmasked[0, T - n :] - alone).max() > 1e-3


def test_garbage_under_pad_mask_does_not_change_real_positions():
  graphdef, params = _model()
  tokens, mask = _padded_batch()
  garbage, _ = _padded_batch(fill=_tokens(seed=2))
  assert np.any(np.asarray(garbage) != np.asarray(tokens))
  real = np.asarray(mask, bool)
  out = {}
  for name, toks in (('pad', tokens), ('garbage', garbage)):
    logp, ent = _logprobs(graphdef, params, toks, mask, chunk_size=13, with_entropy=True)
    out[name] = (
      np.asarray(_logits(graphdef, params, toks, mask)),
      np.asarray(_values(graphdef, params, toks, mask)),
      np.asarray(logp),
      np.asarray(ent),
    )
  (lg_a, v_a, lp_a, e_a), (lg_b, v_b, lp_b, e_b) = out['pad'], out['garbage']
  np.testing.assert_array_equal(lg_a[real], lg_b[real])
  np.testing.assert_array_equal(v_a[real], v_b[real])
  # logp[t] scores token t from position t - 1: both must be real.
  scored = real.copy()
  scored[:, 1:] &= real[:, :-1]
  scored[:, 0] = False
  np.testing.assert_array_equal(lp_a[scored], lp_b[scored])
  np.testing.assert_array_equal(e_a[scored], e_b[scored])


def test_fully_padded_row_is_finite():
  graphdef, params = _model()
  tokens, mask = _padded_batch()
  assert not np.any(np.asarray(mask[2]))
  logp, ent = _logprobs(graphdef, params, tokens, mask, chunk_size=13, with_entropy=True)
  for x in (
    _logits(graphdef, params, tokens, mask),
    _values(graphdef, params, tokens, mask),
    _scores(graphdef, params, tokens, mask),
    logp,
    ent,
  ):
    assert np.all(np.isfinite(np.asarray(x)))


# ----------------------------------------------------------------------------
# 4. next_token_logprobs, values, sequence_scores.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('chunk_size', [1, 5, 13, None])
def test_next_token_logprobs_matches_log_softmax(chunk_size):
  # B * (T - 1) = 56 scored rows: 5 and 13 do not divide it; None is one chunk.
  graphdef, params = _model()
  tokens, mask = _padded_batch()
  lg = np.asarray(_logits(graphdef, params, tokens, mask), np.float64)
  for temperature in (1.0, 0.7, 2.5):
    logp, ent = _logprobs(
      graphdef,
      params,
      tokens,
      mask,
      temperature=temperature,
      chunk_size=chunk_size,
      with_entropy=True,
    )
    assert logp.shape == ent.shape == (B, T)
    assert logp.dtype == ent.dtype == jnp.float32
    ls = _np_log_softmax(lg[:, :-1] / temperature)
    want = np.take_along_axis(ls, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    want = np.pad(want, ((0, 0), (1, 0)))
    np.testing.assert_allclose(np.asarray(logp), want, rtol=1e-5, atol=1e-5)
    want_ent = -np.sum(np.exp(ls) * ls, -1)
    want_ent = np.pad(want_ent, ((0, 0), (1, 0)))
    np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(logp)[:, 0] == 0)


def test_next_token_logprobs_without_entropy_returns_zeros():
  graphdef, params = _model()
  tokens, mask = _padded_batch()
  logp, ent = _logprobs(graphdef, params, tokens, mask, chunk_size=13, with_entropy=False)
  logp_e, _ = _logprobs(graphdef, params, tokens, mask, chunk_size=13, with_entropy=True)
  np.testing.assert_array_equal(np.asarray(ent), 0)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(logp_e), rtol=1e-6, atol=1e-6)


def test_values_and_sequence_scores():
  graphdef, params = _model()
  tokens = _tokens()
  lengths = np.asarray([8, 7, 5, 1, 3, 8, 6, 2])
  mask = _right_mask(lengths)
  v = np.asarray(_values(graphdef, params, tokens, mask))
  s = np.asarray(_scores(graphdef, params, tokens, mask))
  assert v.shape == (B, T) and v.dtype == np.float32
  assert s.shape == (B,) and s.dtype == np.float32
  np.testing.assert_array_equal(s, v[np.arange(B), lengths - 1])
  # Right padding: the score is the row's value at its last real token when
  # the same rows run unpadded (the padding after it changes nothing).
  full = np.asarray(_values(graphdef, params, tokens, _right_mask([T] * B)))
  np.testing.assert_allclose(s, full[np.arange(B), lengths - 1], rtol=1e-5, atol=1e-5)
  # Left padding: the last column.
  left = jnp.asarray(np.arange(T)[None, :] >= (T - lengths)[:, None], jnp.int32)
  s_left = np.asarray(_scores(graphdef, params, tokens, left))
  v_left = np.asarray(_values(graphdef, params, tokens, left))
  np.testing.assert_array_equal(s_left, v_left[:, -1])
  # The value matches the scalar head applied to the hidden states by hand.
  hidden = np.asarray(_hidden(graphdef, params, tokens, mask), np.float64)
  kernel = _leaves(params)[('score', 'kernel')].astype(np.float64)
  np.testing.assert_allclose(v, (hidden @ kernel)[..., 0], rtol=1e-5, atol=1e-6)


def test_heads_missing_raise():
  # Traced only (eval_shape): the error comes before any computation.
  graphdef, params = M.abstract(CFG)
  with pytest.raises(ValueError, match='scalar head'):
    jax.eval_shape(functools.partial(M.values, graphdef), params, _tokens((1, 4)))
  graphdef, params = M.abstract(CFG, lm_head=False, scalar_head=True)
  with pytest.raises(ValueError, match='LM head'):
    jax.eval_shape(functools.partial(M.logits, graphdef), params, _tokens((1, 4)))


def test_bad_batch_shapes_raise():
  graphdef, params = _model()
  tokens = _tokens((2, 4))
  with pytest.raises(ValueError, match='`tokens`'):
    M.logits(graphdef, params, tokens.astype(jnp.float32))
  with pytest.raises(ValueError, match='`tokens`'):
    M.logits(graphdef, params, tokens[0])
  with pytest.raises(ValueError, match='`mask`'):
    M.logits(graphdef, params, tokens, jnp.ones((2, 3), jnp.int32))
  with pytest.raises(ValueError, match='`positions`'):
    M.logits(graphdef, params, tokens, None, jnp.zeros((4, 2), jnp.int32))


# ----------------------------------------------------------------------------
# 5. Dtype policy, GQA, rope scaling.
# ----------------------------------------------------------------------------


def test_bf16_compute_with_f32_params():
  graphdef32, params32 = _model()
  graphdef, params = M.create(CFG.replace(compute_dtype='bfloat16'), KEY, scalar_head=True)
  # Same key, same float32 parameters; only the graph's compute dtype differs.
  for path, leaf in _leaves(params).items():
    assert leaf.dtype == np.float32, path
    np.testing.assert_array_equal(leaf, _leaves(params32)[path])
  tokens, mask = _padded_batch()
  hidden = _hidden(graphdef, params, tokens, mask)
  assert hidden.dtype == jnp.bfloat16
  lg = _logits(graphdef, params, tokens, mask)
  logp, ent = _logprobs(graphdef, params, tokens, mask, chunk_size=13, with_entropy=True)
  v = _values(graphdef, params, tokens, mask)
  for x in (lg, logp, ent, v):
    assert x.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(x)))
  lg32 = np.asarray(_logits(graphdef32, params32, tokens, mask))
  logp32, _ = _logprobs(graphdef32, params32, tokens, mask, chunk_size=13, with_entropy=True)
  real = np.asarray(mask, bool)
  scale = np.abs(lg32[real]).max()
  np.testing.assert_allclose(np.asarray(lg)[real], lg32[real], rtol=0, atol=0.05 * scale)
  np.testing.assert_allclose(np.asarray(logp), np.asarray(logp32), rtol=0, atol=2e-2)
  # bf16 really ran: not bitwise the float32 model.
  assert np.any(np.asarray(lg)[real] != lg32[real])


def test_bf16_params_are_stored_in_bf16():
  cfg = CFG.replace(param_dtype='bfloat16')
  graphdef, params = M.create(cfg, KEY, scalar_head=True)
  leaves = _leaves(params)
  for path, leaf in leaves.items():
    assert leaf.dtype == jnp.bfloat16, path
  _, abstract_params = M.abstract(cfg, scalar_head=True)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(abstract_params))
  lg = _logits(graphdef, params, _tokens())
  assert lg.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(lg)))


@pytest.mark.parametrize('num_kv_heads', [8, 1])
def test_mha_and_mqa_run(num_kv_heads):
  cfg = CFG.replace(num_kv_heads=num_kv_heads)
  graphdef, params = M.create(cfg, KEY)
  leaves = _leaves(params)
  assert leaves[('layers', 0, 'attn', 'k', 'kernel')].shape == (32, num_kv_heads * 8)
  assert leaves[('layers', 0, 'attn', 'v', 'bias')].shape == (num_kv_heads * 8,)
  tokens, mask = _padded_batch()
  lg = np.asarray(_logits(graphdef, params, tokens, mask))
  assert lg.shape == (B, T, CFG.vocab_size) and np.all(np.isfinite(lg))
  # Causality holds for every grouping (at real positions: a query that sees
  # no key at all, under the pad mask, averages over every key).
  changed = np.asarray(_logits(graphdef, params, tokens.at[:, 5:].set(9), mask))
  real = np.asarray(mask, bool)[:, :5]
  np.testing.assert_array_equal(changed[:, :5][real], lg[:, :5][real])


def _np_attention(q, k, v, allowed):
  """Repeat-kv reference: query head h reads kv head h // (H // K), in float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, h, d = q.shape
  kh = k.shape[2]
  k_rep = np.repeat(k, h // kh, axis=2)  # [B, S, H, d], kv head j repeated G times
  v_rep = np.repeat(v, h // kh, axis=2)
  out = np.zeros((b, t, h, d))
  for bi in range(b):
    for hi in range(h):
      for ti in range(t):
        vis = np.asarray(allowed[bi, ti], bool)
        if not vis.any():  # no visible key: a uniform average over all keys
          out[bi, ti, hi] = v_rep[bi, :, hi].mean(0)
          continue
        scores = k_rep[bi, :, hi] @ q[bi, ti, hi] / math.sqrt(d)
        scores = np.where(vis, scores, -np.inf)
        p = np.exp(scores - scores.max())
        out[bi, ti, hi] = (p / p.sum()) @ v_rep[bi, :, hi]
  return out


@pytest.mark.parametrize('kv_heads', [1, 2, 4, 8])
def test_dot_attention_grouping_matches_repeat_kv(kv_heads):
  rng = np.random.default_rng(kv_heads)
  b, t, s, h, d = 2, 5, 6, 8, 4
  q = rng.normal(size=(b, t, h, d)).astype(np.float32)
  k = rng.normal(size=(b, s, kv_heads, d)).astype(np.float32)
  v = rng.normal(size=(b, s, kv_heads, d)).astype(np.float32)
  allowed = rng.random((b, t, s)) < 0.6
  allowed[0, 1] = False  # one query sees nothing
  allowed[1, 2] = True
  got = np.asarray(M.dot_attention(q, k, v, jnp.asarray(allowed)))
  assert got.shape == (b, t, h, d) and got.dtype == np.float32
  np.testing.assert_allclose(got, _np_attention(q, k, v, allowed), rtol=1e-5, atol=1e-5)


def _np_llama3_inv_freq(head_dim, theta, factor, low, high, original):
  """Meta's `apply_scaling` (llama3 `model.py`), float64, one frequency at a time."""
  freqs = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
  low_wavelen, high_wavelen = original / low, original / high
  out = []
  for f in freqs:
    wavelen = 2 * math.pi / f
    if wavelen < high_wavelen:
      out.append(f)
    elif wavelen > low_wavelen:
      out.append(f / factor)
    else:
      smooth = (original / wavelen - low) / (high - low)
      out.append((1 - smooth) * f / factor + smooth * f)
  return np.asarray(freqs), np.asarray(out)


@pytest.mark.parametrize(
  'head_dim, theta, factor, low, high, original',
  [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2
    (32, 10000.0, 4.0, 2.0, 8.0, 64),
  ],
)
def test_llama3_rope_scaling_matches_reference(head_dim, theta, factor, low, high, original):
  scaling = RopeScaling(
    factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_positions=original
  )
  cfg = CFG.replace(head_dim=head_dim, rope_theta=theta, rope_scaling=scaling)
  got = rope_inv_freq(cfg)
  plain = rope_inv_freq(cfg.replace(rope_scaling=None))
  freqs, want = _np_llama3_inv_freq(head_dim, theta, factor, low, high, original)
  assert got.dtype == plain.dtype == np.float32
  assert got.shape == (head_dim // 2,)
  np.testing.assert_allclose(plain, freqs, rtol=1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  wavelen = 2 * math.pi / freqs
  hi_band, lo_band = wavelen < original / high, wavelen > original / low
  medium = ~hi_band & ~lo_band
  # The parameters reach all three regimes, so each branch is checked.
  assert hi_band.any() and lo_band.any() and medium.any()
  np.testing.assert_array_equal(got[hi_band], plain[hi_band])
  np.testing.assert_allclose(got[lo_band], plain[lo_band] / factor, rtol=1e-6)
  np.testing.assert_allclose(got[-1], plain[-1] / factor, rtol=1e-6)
  assert np.all(got[medium] < plain[medium]) and np.all(got[medium] > plain[medium] / factor)


def test_rope_scaling_changes_the_forward():
  scaling = RopeScaling(
    factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=8
  )
  graphdef, params = _model()
  sgraphdef, _ = M.create(CFG.replace(rope_scaling=scaling), KEY, scalar_head=True)
  tokens = _tokens()
  plain = np.asarray(_logits(graphdef, params, tokens))
  scaled = np.asarray(_logits(sgraphdef, params, tokens))
  # Position 0 has angle 0 whatever the frequencies; later positions differ.
  np.testing.assert_allclose(scaled[:, 0], plain[:, 0], rtol=1e-6, atol=1e-6)
  assert np.abs(scaled[:, 1:] - plain[:, 1:]).max() > 1e-5


# ----------------------------------------------------------------------------
# 6. ModelConfig validation and from_hf.
# ----------------------------------------------------------------------------

_SIZES = dict(
  vocab_size=64, width=32, mlp_width=64, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8
)


@pytest.mark.parametrize(
  'changes, field',
  [
    ({'num_heads': 6, 'num_kv_heads': 4}, 'num_heads'),
    ({'num_heads': 8, 'num_kv_heads': 3}, 'num_kv_heads'),
    ({'head_dim': 7}, 'head_dim'),
    ({'param_dtype': 'fp32'}, 'param_dtype'),
    ({'compute_dtype': 'float64'}, 'compute_dtype'),
    ({'compute_dtype': jnp.bfloat16}, 'compute_dtype'),
    ({'vocab_size': 0}, 'vocab_size'),
    ({'width': -32}, 'width'),
    ({'mlp_width': 0}, 'mlp_width'),
    ({'num_layers': 0}, 'num_layers'),
    ({'num_heads': 0}, 'num_heads'),
    ({'num_kv_heads': 0}, 'num_kv_heads'),
    ({'head_dim': 0}, 'head_dim'),
    ({'head_dim': -2}, 'head_dim'),
    ({'width': 32.0}, 'width'),
    ({'num_layers': True}, 'num_layers'),
    ({'rms_eps': 0.0}, 'rms_eps'),
    ({'rope_theta': -1.0}, 'rope_theta'),
  ],
)
def test_model_config_validation_names_field(changes, field):
  with pytest.raises(ValueError, match=f'`{field}`'):
    M.ModelConfig(**{**_SIZES, **changes})


def test_model_config_accepts_valid_and_is_hashable():
  cfg = M.ModelConfig(**_SIZES, compute_dtype='bfloat16')
  assert cfg.compute_jnp_dtype == jnp.bfloat16 and cfg.param_jnp_dtype == jnp.float32
  assert hash(cfg) == hash(M.ModelConfig(**_SIZES, compute_dtype='bfloat16'))
  _, params = M.abstract(CFG, scalar_head=True)
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params)) - CFG.width  # minus score
  assert CFG.num_params() == n


def _hf(**changes):
  hf = {
    'architectures': ['LlamaForCausalLM'],
    'model_type': 'llama',
    'vocab_size': 64,
    'hidden_size': 32,
    'intermediate_size': 64,
    'num_hidden_layers': 2,
    'num_attention_heads': 8,
    'num_key_value_heads': 4,
    'rms_norm_eps': 1e-5,
    'rope_theta': 500000.0,
    'hidden_act': 'silu',
    'tie_word_embeddings': False,
  }
  hf.update(changes)
  return {k: v for k, v in hf.items() if v is not None}


def test_from_hf_reads_fields():
  cfg = M.ModelConfig.from_hf(_hf())
  assert (cfg.vocab_size, cfg.width, cfg.mlp_width, cfg.num_layers) == (64, 32, 64, 2)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 4, 4)
  assert cfg.family == 'llama' and not cfg.qkv_bias and not cfg.qk_norm
  assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None and cfg.rms_eps == 1e-5
  qwen2 = M.ModelConfig.from_hf(_hf(architectures=['Qwen2ForCausalLM'], model_type='qwen2'))
  assert qwen2.family == 'qwen2' and qwen2.qkv_bias and not qwen2.qk_norm
  qwen3 = M.ModelConfig.from_hf(_hf(architectures=None, model_type='qwen3', head_dim=16))
  assert qwen3.family == 'qwen3' and qwen3.qk_norm and qwen3.head_dim == 16
  rope = {
    'rope_type': 'llama3',
    'rope_theta': 10000.0,
    'factor': 8.0,
    'low_freq_factor': 1.0,
    'high_freq_factor': 4.0,
    'original_max_position_embeddings': 8192,
  }
  for hf in (_hf(rope_parameters=rope, rope_theta=None), _hf(rope_scaling=rope)):
    cfg = M.ModelConfig.from_hf(hf)
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
  assert M.ModelConfig.from_hf(_hf(rope_parameters=rope, rope_theta=None)).rope_theta == 10000.0
  assert M.ModelConfig.from_hf(_hf(), compute_dtype='bfloat16').compute_dtype == 'bfloat16'


@pytest.mark.parametrize(
  'field',
  ['vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads'],
)
def test_from_hf_missing_field_is_named(field):
  hf = _hf()
  del hf[field]
  with pytest.raises(ValueError, match=rf'my\.json: missing field `{field}`'):
    M.ModelConfig.from_hf(hf, source='my.json')


@pytest.mark.parametrize(
  'changes, pattern',
  [
    ({'rope_scaling': {'rope_type': 'yarn', 'factor': 4.0}}, 'rope_scaling'),
    ({'rope_scaling': {'type': 'longrope', 'factor': 2.0}}, 'rope_scaling'),
    ({'rope_scaling': {'type': 'linear'}}, '`factor`'),
    ({'rope_parameters': {'rope_type': 'dynamic', 'rope_theta': 1e4}}, 'rope_parameters'),
    ({'hidden_act': 'gelu'}, '`hidden_act`'),
    ({'architectures': ['MixtralForCausalLM']}, '`architectures`'),
    ({'architectures': ['MistralForCausalLM']}, '`model_type`'),
    ({'architectures': None, 'model_type': 'gemma'}, '`architectures`'),
    ({'use_sliding_window': True}, '`use_sliding_window`'),
    ({'mlp_bias': True}, '`mlp_bias`'),
    (
      {'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0, 'high_freq_factor': 4.0}},
      '`low_freq_factor`',
    ),
    ({'num_key_value_heads': 3}, '`num_kv_heads`'),
    ({'hidden_size': 30, 'num_attention_heads': 6, 'num_key_value_heads': 2}, '`head_dim`'),
  ],
)
def test_from_hf_rejects_unsupported(changes, pattern):
  with pytest.raises(ValueError, match=r'^cfg\.json: ') as info:
    M.ModelConfig.from_hf(_hf(**changes), source='cfg.json')
  assert info.match(pattern)


def test_head_dimensions_shard_only_in_whole_heads():
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=8)
  # K·d = 2·8 = 16 divides by 8, but that would put a quarter head on each device.
  assert parallel.spec_for((32, 16), ('embed', 'kv_heads'), mesh) == P(None, 'tensor')
  units = {'kv_heads': 8}
  assert parallel.spec_for((32, 16), ('embed', 'kv_heads'), mesh, units=units) == P(None, None)
  # 8 whole heads of 8 split over 8 devices.
  assert parallel.spec_for((32, 64), ('embed', 'kv_heads'), mesh, units=units) == P(None, 'tensor')
  config = M.ModelConfig(
    vocab_size=64, width=32, mlp_width=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8
  )
  _, params = M.create_sharded(config, jax.random.PRNGKey(0), mesh)
  attn = params['layers'][0]['attn']
  assert attn['k']['kernel'][...].sharding.spec == P(None, None)  # 2 heads cannot split 8 ways
  assert attn['q']['kernel'][...].sharding.spec == P(None, None)  # nor can 4
  assert params['layers'][0]['mlp']['gate']['kernel'][...].sharding.spec == P(None, 'tensor')


def test_padding_queries_are_causal_too():
  # A left-padded prefix has no real key; its queries must still not see later tokens.
  config = M.ModelConfig(
    vocab_size=64, width=32, mlp_width=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
  )
  graphdef, params = M.create(config, jax.random.PRNGKey(1))
  fwd = jax.jit(functools.partial(M.hidden_states, graphdef))
  mask = jnp.array([[0, 0, 0, 1, 1, 1]], bool)
  tokens = jnp.array([[5, 6, 7, 8, 9, 10]], jnp.int32)
  changed = tokens.at[0, 4:].set(jnp.array([30, 31]))
  a, b = fwd(params, tokens, mask), fwd(params, changed, mask)
  np.testing.assert_array_equal(np.asarray(a[0, :4]), np.asarray(b[0, :4]))
  assert np.all(np.isfinite(np.asarray(a)))
