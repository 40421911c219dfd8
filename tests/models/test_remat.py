"""Activation checkpointing (`ModelConfig.remat`) and scanned layers (`scan_layers`).

Both change how the training forward runs, never what it computes: every
policy, unrolled or scanned, must give the plain model's loss and gradients
to float tolerance (STYLE.md point 14: an equivalence with the obvious
implementation), on a dense model with biases and q/k norm, on a Mistral-like
model whose every layer is windowed, and on a MoE model with its router loss.
XLA's compiled memory analysis must show less temporary memory with remat
than without, and the sampler's cached path must ignore both fields.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrl.models as M
from jrl.sampler import paged

CFG = M.ModelConfig(
  vocab_size=64,
  width=32,
  mlp_width=64,
  num_layers=3,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  qkv_bias=True,
  qk_norm=True,
)
MISTRAL = CFG.replace(qkv_bias=False, qk_norm=False, sliding_window=3, family='mistral')
MOE = CFG.replace(
  family='qwen3_moe', qkv_bias=False, num_experts=4, experts_per_token=2, moe_mlp_width=16
)
KEY = jax.random.key(0)
B, T = 3, 12


def _batch(vocab=CFG.vocab_size):
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, vocab)
  mask = jnp.ones((B, T), bool).at[0, :4].set(False)  # one left-padded row
  return tokens, mask


def _loss_fn(cfg):
  graphdef, _ = M.abstract(cfg)
  tokens, mask = _batch()

  def loss(params):
    logp, _, aux = M.next_token_logprobs(graphdef, params, tokens, mask, with_router_loss=True)
    return -jnp.sum(logp * mask) / jnp.sum(mask) + 0.1 * aux

  return loss


@functools.cache
def _reference(cfg):
  """(params, loss, grads) of the plain model (no remat, no scan)."""
  _, params = M.create(cfg, KEY)
  loss, grads = jax.jit(jax.value_and_grad(_loss_fn(cfg)))(params)
  return params, loss, grads


def _assert_trees_close(actual, expected, rtol, atol):
  flat_a = jax.tree_util.tree_leaves_with_path(actual)
  flat_e = jax.tree.leaves(expected)
  assert len(flat_a) == len(flat_e)
  for (path, a), e in zip(flat_a, flat_e, strict=True):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
    )


@pytest.mark.parametrize(
  'remat, scan',
  [(r, s) for r in M.config.REMAT_POLICIES for s in (False, True) if (r, s) != ('none', False)],
)
def test_remat_and_scan_give_the_plain_loss_and_gradients(remat, scan):
  params, loss_ref, grads_ref = _reference(CFG)
  loss, grads = jax.jit(jax.value_and_grad(_loss_fn(CFG.replace(remat=remat, scan_layers=scan))))(
    params
  )
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
  _assert_trees_close(grads, grads_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('base', [MISTRAL, MOE], ids=['sliding', 'moe'])
def test_scanned_remat_matches_on_windowed_and_moe_models(base):
  params, loss_ref, grads_ref = _reference(base)
  cfg = base.replace(remat='full', scan_layers=True)
  loss, grads = jax.jit(jax.value_and_grad(_loss_fn(cfg)))(params)
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
  _assert_trees_close(grads, grads_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('scan', [False, True])
def test_remat_with_lora_gives_the_same_adapter_gradients(scan):
  from jrl.models import lora

  cfg = CFG.replace(lora=M.LoraConfig(rank=2, alpha=4.0))
  _, params = M.create(cfg, KEY)
  # Non-zero B, so that every adapter gets a gradient.
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.1 if lora.is_adapter(p) else x, params
  )
  adapters, base = lora.split(params)

  def grads(c):
    loss = _loss_fn(c)
    return jax.jit(jax.value_and_grad(lambda a: loss(lora.join(a, base))))(adapters)

  loss_ref, grads_ref = grads(cfg)
  loss, got = grads(cfg.replace(remat='full', scan_layers=scan))
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
  _assert_trees_close(got, grads_ref, rtol=1e-5, atol=1e-7)


def test_remat_gradients_without_jit():
  # Op by op (no jit) is slow: one layer is enough to run jax.checkpoint eagerly.
  cfg = CFG.replace(num_layers=1)
  params, loss_ref, grads_ref = _reference(cfg)
  loss, grads = jax.value_and_grad(_loss_fn(cfg.replace(remat='full')))(params)
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
  _assert_trees_close(grads, grads_ref, rtol=1e-5, atol=1e-7)


def test_bf16_remat_matches_bf16_plain():
  cfg = CFG.replace(compute_dtype='bfloat16')
  params, loss_ref, grads_ref = _reference(cfg)
  loss, grads = jax.jit(jax.value_and_grad(_loss_fn(cfg.replace(remat='full'))))(params)
  # The recomputation repeats the same bf16 operations: equal up to rounding.
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-3)
  for g in jax.tree.leaves(grads):
    assert g.dtype == jnp.float32
  _assert_trees_close(grads, grads_ref, rtol=0.05, atol=5e-3)


# Memory: a model whose activations dwarf its weights (B·T = 512 tokens, 4 layers).
MEM_CFG = M.ModelConfig(
  vocab_size=256, width=64, mlp_width=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16
)


def _temp_bytes(cfg, batch=4, seq=128):
  graphdef, params = M.abstract(cfg)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

  def loss(p, tok):
    logp, _ = M.next_token_logprobs(graphdef, p, tok)
    return -jnp.mean(logp)

  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_remat_needs_less_temporary_memory():
  plain = _temp_bytes(MEM_CFG)
  full = _temp_bytes(MEM_CFG.replace(remat='full'))
  projections = _temp_bytes(MEM_CFG.replace(remat='dots_no_batch'))
  scanned = _temp_bytes(MEM_CFG.replace(remat='full', scan_layers=True))
  # Without remat every layer's attention scores and probabilities
  # ([B, H, T, T] float32, 1 MiB each here) live until the backward pass.
  assert full < 0.5 * plain, (full, plain)
  assert scanned < 0.5 * plain, (scanned, plain)
  assert full < projections < plain, (full, projections, plain)


def test_remat_memory_hardly_grows_with_depth():
  def growth(remat):
    shallow = _temp_bytes(MEM_CFG.replace(num_layers=2, remat=remat))
    deep = _temp_bytes(MEM_CFG.replace(num_layers=6, remat=remat))
    return deep - shallow

  # Saved activations: one [B, T, D] block input per layer (128 KiB) with remat.
  assert growth('full') < 0.15 * growth('none'), (growth('full'), growth('none'))


def test_sampler_prefill_ignores_remat_and_scan():
  _, params = M.create(CFG, KEY)
  tokens = jax.random.randint(jax.random.key(3), (8,), 0, CFG.vocab_size)
  plain = paged.prefill(M.abstract(CFG)[0], params, tokens, jnp.int32(6))
  graphdef = M.abstract(CFG.replace(remat='full', scan_layers=True))[0]
  other = paged.prefill(graphdef, params, tokens, jnp.int32(6))
  np.testing.assert_array_equal(np.asarray(other.logits), np.asarray(plain.logits))
  np.testing.assert_array_equal(np.asarray(other.k), np.asarray(plain.k))


@pytest.mark.parametrize(
  'changes, pattern',
  [
    (dict(remat='some'), '`remat`'),
    (dict(scan_layers=1), '`scan_layers`'),
    (dict(attention_impl='flash'), '`attention_impl`'),
    (dict(scan_layers=True, sliding_window=4, layer_types=('sliding', 'full', 'full')), 'scan'),
    (
      dict(
        scan_layers=True,
        family='qwen3_moe',
        num_experts=4,
        experts_per_token=2,
        moe_mlp_width=16,
        dense_layers=(0,),
      ),
      'scan',
    ),
  ],
)
def test_bad_remat_and_scan_fields_are_named(changes, pattern):
  with pytest.raises(ValueError, match=pattern):
    CFG.replace(**changes)


def test_remat_fields_are_not_written_to_hf_config():
  out = CFG.replace(remat='full', scan_layers=True).to_hf()
  assert not {'remat', 'scan_layers', 'lora'} & set(out)
  back = M.ModelConfig.from_hf(out, remat='dots')
  assert back.remat == 'dots' and not back.scan_layers
