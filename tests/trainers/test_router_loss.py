"""The MoE router's load-balancing loss in the policy loss (`rl.router_aux_coef`):
added as coef x the model's router loss, its gradient reaches the router,
and packed rows give the padded value (micro-batches weigh each one's
router loss by its share of the real tokens, an approximation: the loss's
batch statistics are not additive)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import models, trainers
from jrl.data import packing
from jrl.trainers import policy_step
from tests.helpers import shrunk_config

MOE = models.ModelConfig(
  vocab_size=64,
  width=32,
  mlp_width=64,
  num_layers=1,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  family='qwen3_moe',
  num_experts=4,
  experts_per_token=2,
  moe_mlp_width=16,
)
LENGTHS, PROMPTS = [20, 5, 9, 3, 12, 7], [6, 2, 4, 1, 5, 3]


def moe_batch():
  rng = np.random.default_rng(0)
  b, t = len(LENGTHS), 20
  tokens = np.zeros((b, t), np.int32)
  mask = np.zeros((b, t), bool)
  loss_mask = np.zeros((b, t), bool)
  for i, (n, p) in enumerate(zip(LENGTHS, PROMPTS, strict=True)):
    tokens[i, :n] = rng.integers(1, MOE.vocab_size, n)
    mask[i, :n] = True
    loss_mask[i, p:n] = True
  f32 = lambda x: jnp.asarray(np.where(loss_mask, x, 0.0), jnp.float32)
  batch = policy_step.PolicyBatch(
    tokens=jnp.asarray(tokens),
    mask=jnp.asarray(mask),
    loss_mask=jnp.asarray(loss_mask),
    old_logp=f32(-4.0),
    ref_logp=f32(0.0),
    advantages=f32(rng.normal(0.0, 1.0, (b, 1))),
  )
  return batch, tokens, mask


def router_grads(grads):
  return [g for path, g in jax.tree_util.tree_leaves_with_path(grads) if 'router' in str(path)]


def test_the_router_loss_is_added_with_its_coefficient_and_trains_the_router():
  graphdef, params = models.create(MOE, jax.random.PRNGKey(1))
  batch, tokens, mask = moe_batch()
  *_, aux = models.next_token_logprobs(graphdef, params, tokens, mask, with_router_loss=True)
  assert float(aux) > 0
  grad = jax.jit(jax.value_and_grad(policy_step.policy_loss, has_aux=True), static_argnums=(1, 3))
  off = policy_step.StepConfig()
  on = off._replace(router_aux_coef=0.5)
  (loss_off, m_off), g_off = grad(params, graphdef, batch, off)
  (loss_on, m_on), g_on = grad(params, graphdef, batch, on)
  np.testing.assert_allclose(float(loss_on) - float(loss_off), 0.5 * float(aux), rtol=1e-5)
  np.testing.assert_allclose(float(m_on['actor/router_loss']), float(aux), rtol=1e-6)
  assert 'actor/router_loss' not in m_off
  # The router's gradient changes by the router loss's; the rest is the policy's.
  moved = [
    np.abs(np.asarray(a - b)).max()
    for a, b in zip(router_grads(g_on), router_grads(g_off), strict=True)
  ]
  assert len(moved) == MOE.num_layers and min(moved) > 1e-6

  # Packed rows: the same loss and router gradients.
  packed = jax.tree.map(jnp.asarray, packing.pack_padded(tokens, mask, 20))
  (loss_p, _), g_p = grad(params, graphdef, batch._replace(packed=packed), on)
  np.testing.assert_allclose(float(loss_p), float(loss_on), rtol=1e-5, atol=1e-6)
  for a, b in zip(router_grads(g_p), router_grads(g_on), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_a_negative_router_coefficient_is_named(tmp_path):
  config = shrunk_config(tmp_path, {'rl.router_aux_coef': -1.0})
  with pytest.raises(ValueError, match=r'rl\.router_aux_coef'):
    trainers.validate(config, 1)
  assert policy_step.step_config(shrunk_config(tmp_path).rl).router_aux_coef == 0.0
