"""bfloat16 compute with float32 master weights (`param_dtype='float32'`,
`compute_dtype='bfloat16'`).

What the issue asks of it, each checked on the jaxpr of one training step
(forward and backward, with activation checkpointing on so its recomputed
forward is covered too): the parameters, their gradients and the optimiser
state stay float32; every matmul reads bfloat16 operands; every softmax and
log-softmax (exp, log, max) runs in float32; and an update far below
bfloat16's resolution still changes the float32 weights. The loss and
gradients then agree with the float32 model to bfloat16 accuracy.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

import jrl.models as M
from jrl.models import lora

CFG = M.ModelConfig(
  vocab_size=96,
  width=32,
  mlp_width=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  qkv_bias=True,
  param_dtype='float32',
  compute_dtype='bfloat16',
)
KEY = jax.random.key(0)
TOKENS = jax.random.randint(jax.random.key(1), (3, 10), 0, CFG.vocab_size)


def _loss_fn(graphdef):
  def loss(params):
    logp, _ = M.next_token_logprobs(graphdef, params, TOKENS, chunk_size=32)
    return -jnp.mean(logp[:, 1:])

  return loss


def _eqns(jaxpr):
  """Every equation of a jaxpr, sub-jaxprs (jit, remat, custom_vjp, scan) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, list | tuple) else [value]:
        if isinstance(sub, jcore.ClosedJaxpr):
          yield from _eqns(sub.jaxpr)
        elif isinstance(sub, jcore.Jaxpr):
          yield from _eqns(sub)


def _ops(cfg, params):
  jaxpr = jax.make_jaxpr(jax.value_and_grad(_loss_fn(M.abstract(cfg)[0])))(params)
  found = collections.defaultdict(list)
  for eqn in _eqns(jaxpr.jaxpr):
    found[eqn.primitive.name].append(eqn)
  return found


@pytest.mark.parametrize('remat, lora_rank', [('full', 0), ('none', 4)])
def test_matmuls_read_bf16_and_softmax_runs_in_f32(remat, lora_rank):
  cfg = CFG.replace(remat=remat)
  if lora_rank:
    cfg = cfg.replace(lora=M.LoraConfig(rank=lora_rank, alpha=8.0))
  _, params = M.create(cfg, KEY)
  ops = _ops(cfg, params)
  dots = ops['dot_general']
  assert len(dots) > 20
  for eqn in dots:
    dtypes = [v.aval.dtype for v in eqn.invars]
    assert all(d == jnp.bfloat16 for d in dtypes), (dtypes, [v.aval.shape for v in eqn.invars])
  # float32 comes out of two products only (jrl.precision.einsum_f32): the
  # attention scores [B, K, G, T, S] (in some axis order) and the logits [N, V].
  # Their backward matmuls read a bf16 cotangent (checked above).
  f32_out = [e.outvars[0].aval.shape for e in dots if e.outvars[0].aval.dtype == jnp.float32]
  assert len(f32_out) >= 1 + CFG.num_layers
  for shape in f32_out:
    assert shape[-1] == CFG.vocab_size or len(shape) == 5, shape
  for name in ('exp', 'log', 'reduce_max', 'rsqrt'):
    assert ops[name], name
    for eqn in ops[name]:
      assert eqn.invars[0].aval.dtype == jnp.float32, (name, eqn.invars[0].aval)


def test_params_gradients_and_optimizer_state_stay_f32():
  graphdef, params = M.create(CFG.replace(remat='full'), KEY)
  loss, grads = jax.jit(jax.value_and_grad(_loss_fn(graphdef)))(params)
  assert loss.dtype == jnp.float32
  tx = optax.adamw(1e-3)
  opt_state = tx.init(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  for tree in (params, grads, opt_state, updates, new_params):
    for leaf in jax.tree.leaves(tree):
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        assert leaf.dtype == jnp.float32


def test_small_updates_accumulate_in_the_f32_master_weights():
  graphdef, params = M.create(CFG, KEY)
  grads = jax.grad(_loss_fn(graphdef))(params)
  # Adam's first step moves every weight by lr = 1e-6, about 5e-5 of a
  # weight of size 0.02: far below bfloat16's resolution (2^-8 relative), far
  # above float32's. The float32 master weights take the whole update.
  tx = optax.adam(1e-6)
  updates, _ = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  kernel = lambda p: np.asarray(p['layers'][0]['mlp']['up']['kernel'][...])
  g = kernel(grads)
  moved = kernel(new) - kernel(params)
  big = np.abs(g) > 1e-6  # (Adam divides by |g| + 1e-8)
  np.testing.assert_allclose(moved[big], -1e-6 * np.sign(g[big]), rtol=1e-2)
  # A bfloat16 copy of the weights would have kept almost none of it.
  as_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
  assert np.mean(as_bf16(kernel(new)) != as_bf16(kernel(params))) < 0.1


def test_bf16_loss_and_gradients_track_the_f32_model():
  f32 = CFG.replace(compute_dtype='float32')
  graphdef32, params = M.create(f32, KEY)
  graphdef16 = M.abstract(CFG)[0]
  loss32, grads32 = jax.value_and_grad(_loss_fn(graphdef32))(params)
  loss16, grads16 = jax.value_and_grad(_loss_fn(graphdef16))(params)
  np.testing.assert_allclose(float(loss16), float(loss32), rtol=1e-2)
  g32 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads32)])
  g16 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads16)])
  cosine = g16 @ g32 / (np.linalg.norm(g16) * np.linalg.norm(g32))
  assert cosine > 0.99, cosine
  assert not np.array_equal(g16, g32)  # bf16 really ran


def test_lora_adapters_are_f32_and_train_in_f32():
  cfg = CFG.replace(lora=M.LoraConfig(rank=4, alpha=8.0))
  graphdef, params = M.create(cfg, KEY)
  adapters, base = lora.split(params)

  def loss(adapters):
    logp, _ = M.next_token_logprobs(graphdef, lora.join(adapters, base), TOKENS)
    return -jnp.mean(logp[:, 1:])

  grads = jax.grad(loss)(adapters)
  for leaf in jax.tree.leaves(adapters) + jax.tree.leaves(grads):
    assert leaf.dtype == jnp.float32
