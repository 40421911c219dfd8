"""LoRA adapters (jrl/models/lora.py and `Dense` in transformer.py).

Checked four ways (STYLE.md point 14): a hand-computed projection
x W + b + (α / r)(x A) B; equivalences with the obvious implementations (a
rank-r adapter with B = 0 is bitwise the base model op by op, and equal to
float tolerance under jit; merged weights W + (α / r) A B give the
unmerged model's logits; the adapters' gradients equal those taken through
the merged kernel; a sharded model equals the single-device one);
gradient checks (with the base frozen only adapters get gradients, and at
B = 0 the A gradient is exactly zero); and jit / no-jit.
Then the files: Hugging Face export of merged weights is read by
`transformers`, and the PEFT export is read by `peft` onto the transformers
base with the same logits; both round-trip; an Orbax checkpoint of the
adapters restores bit-exactly. Last, the memory saved on SmolLM2-135M's
shape, counted from abstract shapes (nothing allocated).
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from flax import nnx

import jrl.models as M
from jrl import checkpoint, parallel
from jrl.models import hf, lora, transformer
from jrl.sampler import paged

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

# Non-square everywhere: a transposed A or B cannot go unnoticed.
CFG = M.ModelConfig(
  vocab_size=96,
  width=32,
  mlp_width=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  head_dim=8,
  rms_eps=1e-5,
)
QWEN = CFG.replace(family='qwen2', qkv_bias=True, tie_embeddings=True)
LORA = M.LoraConfig(rank=4, alpha=8.0)
KEY = jax.random.key(0)
B, T = 3, 10


def _tokens(vocab=CFG.vocab_size, seed=1):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, vocab)


@functools.cache
def _base(cfg=CFG):
  return M.create(cfg, KEY)


def _randomise_b(params, seed=7, std=0.3):
  """Adapters with a non-zero B (a fresh adapter would hide a wrong product)."""
  keys = iter(jax.random.split(jax.random.key(seed), 64))

  def one(path, x):
    if parallel.path_keys(path)[-1] == 'lora_b':
      return std * jax.random.normal(next(keys), x.shape, x.dtype)
    return x

  return jax.tree_util.tree_map_with_path(one, params)


@functools.cache
def _trained(cfg=CFG):
  """(config, graphdef, params) of a LoRA model with random B."""
  graphdef, params = _base(cfg)
  config, graphdef, params = lora.attach(graphdef, params, LORA, jax.random.key(1))
  return config, graphdef, _randomise_b(params)


def _leaves(tree):
  return {parallel.path_keys(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


# 1. The projection itself ------------------------------------------------------


def test_dense_matches_hand_computed_projection():
  cfg = CFG.replace(lora=M.LoraConfig(rank=1, alpha=3.0))  # scale 3
  dense = transformer.Dense(2, 3, cfg, rngs=nnx.Rngs(params=0, lora=1), bias=True, lora=True)
  dense.kernel[...] = jnp.array([[1.0, 0.0, 2.0], [0.0, 1.0, -1.0]])
  dense.bias[...] = jnp.array([0.5, 0.0, 0.0])
  dense.lora_a[...] = jnp.array([[1.0], [2.0]])
  dense.lora_b[...] = jnp.array([[0.0, 1.0, 0.5]])
  x = jnp.array([[1.0, 1.0]])
  # x W = [1, 1, 1]; + b = [1.5, 1, 1]; x A = 3; 3 · (x A) B = [0, 9, 4.5].
  np.testing.assert_array_equal(np.asarray(dense(x)), [[1.5, 10.0, 5.5]])


def test_adapters_exist_only_on_targets_with_their_shapes():
  cfg = CFG.replace(lora=M.LoraConfig(rank=3, alpha=1.0, targets=('q_proj', 'down_proj')))
  _, params = M.abstract(cfg)
  adapters = _leaves(lora.split(params)[0])
  assert set(adapters) == {
    (*prefix, ab)
    for i in (0, 1)
    for prefix in [('layers', i, 'attn', 'q'), ('layers', i, 'mlp', 'down')]
    for ab in ('lora_a', 'lora_b')
  }
  assert adapters['layers', 0, 'attn', 'q', 'lora_a'].shape == (32, 3)  # [D, r]
  assert adapters['layers', 0, 'attn', 'q', 'lora_b'].shape == (3, 32)  # [r, H·d]
  assert adapters['layers', 1, 'mlp', 'down', 'lora_a'].shape == (48, 3)  # [F, r]
  assert adapters['layers', 1, 'mlp', 'down', 'lora_b'].shape == (3, 32)  # [r, D]


# 2. Equivalences -----------------------------------------------------------------


@pytest.mark.parametrize('compute_dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('cfg', [CFG, QWEN], ids=['llama', 'qwen2'])
def test_zero_b_adapter_is_the_base_model_bitwise(cfg, compute_dtype):
  cfg = cfg.replace(compute_dtype=compute_dtype)
  graphdef, params = M.create(cfg, KEY)
  _, lgraphdef, lparams = lora.attach(graphdef, params, LORA, jax.random.key(1))
  tokens = _tokens()
  for fn in (M.logits, M.next_token_logprobs):
    # Op by op: x W + 0 is x W.
    base, with_lora = fn(graphdef, params, tokens), fn(lgraphdef, lparams, tokens)
    for a, b in zip(jax.tree.leaves(with_lora), jax.tree.leaves(base), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Under jit XLA may fuse the zero update into the matmul and round in
    # another order (3e-5 on SmolLM2-135M's logprobs, as jit vs eager of the base).
    jitted = jax.jit(fn, static_argnums=0)
    base, with_lora = jitted(graphdef, params, tokens), jitted(lgraphdef, lparams, tokens)
    for a, b in zip(jax.tree.leaves(with_lora), jax.tree.leaves(base), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


def test_create_with_lora_keeps_the_base_weights_and_matches_attach():
  graphdef, params = _base()
  _, _, attached = lora.attach(graphdef, params, LORA, KEY)
  _, created = M.create(CFG.replace(lora=LORA), KEY)
  got, want = _leaves(created), _leaves(attached)
  assert set(got) == set(want)
  for k in got:
    if lora.is_adapter(k):  # drawn under jit by `attach`: equal up to XLA's rounding
      np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=str(k))
    else:
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=str(k))
  a = _leaves(lora.split(created)[0])[('layers', 0, 'attn', 'q', 'lora_a')]
  assert 0.1 < float(jnp.std(a)) * np.sqrt(CFG.width) < 2.0  # N(0, 1 / in)


@pytest.mark.parametrize('cfg', [CFG, QWEN], ids=['llama', 'qwen2'])
def test_merged_equals_unmerged(cfg):
  config, lgraphdef, params = _trained(cfg)
  merged = lora.merge(config, params)
  base_graphdef, base_params = _base(cfg)
  assert jax.tree.structure(merged) == jax.tree.structure(base_params)
  tokens = _tokens(cfg.vocab_size)
  unmerged_logits = np.asarray(M.logits(lgraphdef, params, tokens))
  merged_logits = np.asarray(M.logits(base_graphdef, merged, tokens))
  np.testing.assert_allclose(merged_logits, unmerged_logits, rtol=0, atol=1e-5)
  # The adapters really change the model.
  base_logits = np.asarray(M.logits(base_graphdef, base_params, tokens))
  assert np.abs(unmerged_logits - base_logits).max() > 1e-2


def test_merge_copies_only_the_targeted_kernels():
  config, _, params = _trained()
  merged = _leaves(lora.merge(config, params))
  before = _leaves(params)
  for k, x in merged.items():
    if k[-1] == 'kernel' and k[0] == 'layers':
      assert x is not before[k], k
    else:
      assert x is before[k], k  # the same array: no second copy


def test_merge_under_jit_equals_eager():
  config, _, params = _trained()
  eager = _leaves(lora.merge(config, params))
  jitted = _leaves(jax.jit(functools.partial(lora.merge, config))(params))
  for k in eager:
    np.testing.assert_allclose(np.asarray(jitted[k]), np.asarray(eager[k]), rtol=1e-6, atol=1e-7)


def test_merge_in_bf16_params_rounds_once():
  cfg = CFG.replace(param_dtype='bfloat16')
  graphdef, params = M.create(cfg, KEY)
  config, _, params = lora.attach(graphdef, params, LORA, jax.random.key(1))
  params = _randomise_b(params)
  merged = _leaves(lora.merge(config, params))
  p = _leaves(params)
  k = ('layers', 0, 'mlp', 'up')
  want = (
    np.asarray(p[(*k, 'kernel')], np.float32)
    + LORA.scale
    * np.asarray(p[(*k, 'lora_a')], np.float32)
    @ np.asarray(p[(*k, 'lora_b')], np.float32)
  ).astype(jnp.bfloat16)
  got = merged[(*k, 'kernel')]
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got), want)


# 3. Gradients --------------------------------------------------------------------


def _loss(graphdef, tokens):
  def loss(adapters, base):
    logp, _ = M.next_token_logprobs(graphdef, lora.join(adapters, base), tokens)
    return -jnp.mean(logp[:, 1:])

  return loss


@pytest.mark.parametrize('jit', [False, True])
def test_frozen_base_gradients_reach_only_the_adapters(jit):
  graphdef, params = _base()
  _, lgraphdef, lparams = lora.attach(graphdef, params, LORA, jax.random.key(1))
  adapters, base = lora.split(lparams)
  grad_fn = jax.grad(_loss(lgraphdef, _tokens()))
  grads = (jax.jit(grad_fn) if jit else grad_fn)(adapters, base)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)
  for k, g in _leaves(grads).items():
    if k[-1] == 'lora_a':
      # dL/dA = (α / r) xᵀ (dL/dy) Bᵀ = 0 while B = 0.
      np.testing.assert_array_equal(np.asarray(g), 0.0, err_msg=str(k))
    else:
      assert float(jnp.abs(g).max()) > 0, k


def test_adapter_gradients_equal_gradients_through_the_merged_kernel():
  config, lgraphdef, params = _trained()
  base_graphdef, _ = _base()
  tokens = _tokens()
  adapters, base = lora.split(params)
  unmerged = jax.grad(_loss(lgraphdef, tokens))(adapters, base)

  def merged_loss(adapters, base):
    merged = lora.merge(config, lora.join(adapters, base))
    logp, _ = M.next_token_logprobs(base_graphdef, merged, tokens)
    return -jnp.mean(logp[:, 1:])

  through_merge = jax.grad(merged_loss)(adapters, base)
  got, want = _leaves(unmerged), _leaves(through_merge)
  for k in want:
    assert float(jnp.abs(want[k]).max()) > 0, k
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-6)


def test_multi_transform_with_trainable_mask_leaves_the_base_unchanged():
  _, lgraphdef, params = _trained()
  tokens = _tokens()
  labels = jax.tree.map(lambda t: 'train' if t else 'freeze', lora.trainable_mask(params))
  tx = optax.multi_transform({'train': optax.adam(1e-2), 'freeze': optax.set_to_zero()}, labels)
  opt_state = tx.init(params)
  adapters, _ = lora.split(params)
  # Adam's two moments exist for the adapters only.
  assert lora.num_bytes(opt_state) == 2 * lora.num_bytes(adapters) + 4

  def loss(p):
    logp, _ = M.next_token_logprobs(lgraphdef, p, tokens)
    return -jnp.mean(logp[:, 1:])

  grads = jax.grad(loss)(params)
  updates, _ = tx.update(grads, opt_state, params)
  new = _leaves(optax.apply_updates(params, updates))
  old = _leaves(params)
  for k in old:
    if lora.is_adapter(k):
      assert np.any(np.asarray(new[k]) != np.asarray(old[k])), k
    else:
      np.testing.assert_array_equal(np.asarray(new[k]), np.asarray(old[k]), err_msg=str(k))


# 4. Sharding, the sampler, checkpoints ---------------------------------------------


def test_every_adapter_has_logical_axes_and_a_sharded_model_matches():
  cfg = QWEN.replace(lora=LORA)
  _, abstract_params = M.abstract(cfg)
  for keys, leaf in _leaves(abstract_params).items():
    assert len(M.param_logical_axes(keys)) == leaf.ndim, keys
  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  graphdef, sharded = M.create_sharded(cfg, KEY, mesh)
  q_b = _leaves(sharded)[('layers', 0, 'attn', 'q', 'lora_b')]
  assert q_b.sharding.spec == jax.sharding.PartitionSpec(None, 'tensor')  # whole heads
  _, single = M.create(cfg, KEY)
  single, sharded = _randomise_b(single), _randomise_b(sharded)
  tokens = _tokens(cfg.vocab_size)
  np.testing.assert_allclose(
    np.asarray(M.logits(graphdef, sharded, tokens)),
    np.asarray(M.logits(graphdef, single, tokens)),
    rtol=1e-5,
    atol=1e-5,
  )


def test_attach_on_a_mesh_lays_out_the_adapters():
  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  graphdef, params = M.create_sharded(CFG, KEY, mesh)
  _, _, lparams = lora.attach(graphdef, params, LORA, jax.random.key(1), mesh=mesh)
  for keys, leaf in _leaves(lparams).items():
    assert leaf.sharding.mesh == mesh, keys


def test_sampler_prefill_runs_the_adapters_or_the_merged_weights():
  config, lgraphdef, params = _trained()
  base_graphdef, base_params = _base()
  prompt = jax.random.randint(jax.random.key(5), (8,), 0, CFG.vocab_size)
  length = jnp.int32(6)
  unmerged = paged.prefill(lgraphdef, params, prompt, length)
  merged = paged.prefill(base_graphdef, lora.merge(config, params), prompt, length)
  np.testing.assert_allclose(
    np.asarray(unmerged.logits), np.asarray(merged.logits), rtol=0, atol=1e-5
  )
  # A fresh adapter gives the base model's prefill exactly.
  _, fresh_graphdef, fresh = lora.attach(base_graphdef, base_params, LORA, jax.random.key(1))
  np.testing.assert_array_equal(
    np.asarray(paged.prefill(fresh_graphdef, fresh, prompt, length).logits),
    np.asarray(paged.prefill(base_graphdef, base_params, prompt, length).logits),
  )


def test_adapters_and_their_optimizer_state_checkpoint_bit_exactly(tmp_path):
  _, _, params = _trained()
  adapters, _ = lora.split(params)
  state = {'adapters': adapters, 'opt': optax.adam(1e-3).init(adapters)}
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  ckpt.save(1, state, {'note': 'lora'})
  restored, meta = ckpt.restore(1, checkpoint.abstract_like(state))
  ckpt.close()
  assert meta == {'note': 'lora'}
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# 5. Hugging Face and PEFT files ---------------------------------------------------


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(input_ids=torch.tensor(np.array(tokens), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  """Directories: the base model, the merged model and the PEFT adapters."""
  root = tmp_path_factory.mktemp('lora')
  config, _, params = _trained()
  dirs = {name: str(root / name) for name in ('base', 'merged', 'adapters')}
  hf.save(dirs['base'], CFG, _base()[1])
  hf.save(dirs['merged'], config, params)
  lora.save_adapters(dirs['adapters'], config, params, base_model_name_or_path=dirs['base'])
  return dirs


def test_merged_export_is_read_by_transformers_and_jrl(exported):
  config, lgraphdef, params = _trained()
  tokens = _tokens()
  want = np.asarray(M.logits(lgraphdef, params, tokens))
  model = transformers.AutoModelForCausalLM.from_pretrained(exported['merged']).eval()
  np.testing.assert_allclose(_torch_logits(model, tokens), want, rtol=0, atol=1e-4)
  ck = hf.load(exported['merged'])
  assert ck.config.lora is None
  np.testing.assert_allclose(
    np.asarray(M.logits(ck.graphdef, ck.params, tokens)), want, rtol=0, atol=1e-5
  )
  merged = _leaves(lora.merge(config, params))
  for k, x in _leaves(ck.params).items():
    np.testing.assert_allclose(np.asarray(x), np.asarray(merged[k]), rtol=1e-6, atol=1e-7)


def test_peft_export_layout(exported):
  with open(os.path.join(exported['adapters'], lora.ADAPTER_CONFIG)) as f:
    pc = json.load(f)
  assert (pc['peft_type'], pc['r'], pc['lora_alpha'], pc['bias']) == ('LORA', 4, 8.0, 'none')
  assert sorted(pc['target_modules']) == sorted(LORA.targets)
  import safetensors.numpy

  tensors = safetensors.numpy.load_file(os.path.join(exported['adapters'], lora.ADAPTER_WEIGHTS))
  assert len(tensors) == 2 * len(LORA.targets) * CFG.num_layers
  prefix = 'base_model.model.model.layers.1.'
  assert tensors[prefix + 'self_attn.k_proj.lora_A.weight'].shape == (4, 32)  # [r, in]
  assert tensors[prefix + 'self_attn.k_proj.lora_B.weight'].shape == (16, 4)  # [out, r]
  assert tensors[prefix + 'mlp.down_proj.lora_A.weight'].shape == (4, 48)


def test_peft_loads_the_adapters_onto_the_transformers_base(exported):
  _, lgraphdef, params = _trained()
  tokens = _tokens()
  base = transformers.AutoModelForCausalLM.from_pretrained(exported['base']).eval()
  model = peft.PeftModel.from_pretrained(base, exported['adapters']).eval()
  want = np.asarray(M.logits(lgraphdef, params, tokens))
  np.testing.assert_allclose(_torch_logits(model, tokens), want, rtol=0, atol=1e-4)


def test_load_adapters_round_trip_is_bit_exact(exported):
  config, _, params = _trained()
  graphdef, base = _base()
  got_config, got_graphdef, got = lora.load_adapters(exported['adapters'], graphdef, base)
  assert got_config == config
  want = _leaves(params)
  for k, x in _leaves(got).items():
    np.testing.assert_array_equal(np.asarray(x), np.asarray(want[k]), err_msg=str(k))
  tokens = _tokens()
  np.testing.assert_array_equal(
    np.asarray(M.logits(got_graphdef, got, tokens)),
    np.asarray(M.logits(_trained()[1], params, tokens)),
  )


# 6. Memory on SmolLM2-135M's shape ------------------------------------------------

SMOLLM2 = M.ModelConfig(
  vocab_size=49152,
  width=576,
  mlp_width=1536,
  num_layers=30,
  num_heads=9,
  num_kv_heads=3,
  head_dim=64,
  tie_embeddings=True,
  rms_eps=1e-5,
  rope_theta=100000.0,
)


def _train_state_bytes(params, trainable):
  """Parameters + gradients + Adam moments, from shapes only."""
  opt_state = jax.eval_shape(optax.adamw(1e-4).init, trainable)
  return lora.num_bytes(params) + lora.num_bytes(trainable) + lora.num_bytes(opt_state)


def test_lora_memory_on_smollm2_shape():
  _, full = M.abstract(SMOLLM2)
  _, with_lora = M.abstract(SMOLLM2.replace(lora=M.LoraConfig(rank=16, alpha=32.0)))
  adapters, base = lora.split(with_lora)
  # r · (in + out) per target, 7 targets per layer, 30 layers.
  d, f, q, kv = 576, 1536, 9 * 64, 3 * 64
  per_layer = 16 * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d))
  assert sum(x.size for x in jax.tree.leaves(adapters)) == 30 * per_layer == 4_884_480
  assert sum(x.size for x in jax.tree.leaves(base)) == SMOLLM2.num_params() == 134_515_008
  full_bytes = _train_state_bytes(full, full)
  lora_bytes = _train_state_bytes(with_lora, adapters)
  # float32: 4 copies of 134.5M parameters (2.15 GB) against 1 copy + 4 of 4.9M (0.62 GB).
  assert full_bytes == 4 * 4 * 134_515_008 + 4
  assert lora_bytes == 4 * 134_515_008 + 4 * 4 * 4_884_480 + 4
  assert lora_bytes < 0.3 * full_bytes


# 7. Errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
  'kwargs, field',
  [
    (dict(rank=0, alpha=1.0), 'lora.rank'),
    (dict(rank=4, alpha=0.0), 'lora.alpha'),
    (dict(rank=4, alpha=1.0, targets=('w_proj',)), 'lora.targets'),
    (dict(rank=4, alpha=1.0, targets=()), 'lora.targets'),
    (dict(rank=4, alpha=1.0, dropout=0.1), 'lora.dropout'),
  ],
)
def test_lora_config_errors_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=f'`{field}`'):
    M.LoraConfig(**kwargs)


def test_lora_on_moe_experts_is_refused():
  moe = dict(family='qwen3_moe', num_experts=4, experts_per_token=2, moe_mlp_width=16)
  with pytest.raises(ValueError, match='MoE experts'):
    CFG.replace(**moe, lora=LORA)
  CFG.replace(**moe, lora=M.LoraConfig(rank=2, alpha=2.0, targets=('q_proj', 'v_proj')))


def test_hf_load_with_lora_and_attach_twice_are_refused(exported):
  with pytest.raises(ValueError, match=r'lora\.attach'):
    hf.load(exported['base'], lora=LORA)
  _, graphdef, params = _trained()
  with pytest.raises(ValueError, match='already has adapters'):
    lora.attach(graphdef, params, LORA, KEY)


@pytest.mark.parametrize(
  'edit, pattern',
  [
    (dict(use_rslora=True), '`use_rslora`'),
    (dict(bias='all'), '`bias`'),
    (dict(target_modules='all-linear'), '`target_modules`'),
    (dict(target_modules=['q_proj', 'lm_head']), 'lora.targets'),
    (dict(peft_type='IA3'), '`peft_type`'),
  ],
)
def test_unsupported_peft_configs_are_refused(exported, tmp_path, edit, pattern):
  import shutil

  path = str(tmp_path / 'a')
  shutil.copytree(exported['adapters'], path)
  with open(os.path.join(path, lora.ADAPTER_CONFIG)) as f:
    pc = json.load(f)
  pc.update(edit)
  with open(os.path.join(path, lora.ADAPTER_CONFIG), 'w') as f:
    json.dump(pc, f)
  with pytest.raises(ValueError, match=pattern):
    lora.read_adapter_config(path)


def test_missing_adapter_tensor_is_named(exported, tmp_path):
  import safetensors.numpy

  path = str(tmp_path / 'a')
  os.makedirs(path)
  src = os.path.join(exported['adapters'], lora.ADAPTER_WEIGHTS)
  tensors = safetensors.numpy.load_file(src)
  name = 'base_model.model.model.layers.0.mlp.up_proj.lora_B.weight'
  del tensors[name]
  safetensors.numpy.save_file(tensors, os.path.join(path, lora.ADAPTER_WEIGHTS))
  with open(os.path.join(exported['adapters'], lora.ADAPTER_CONFIG)) as f:
    text = f.read()
  with open(os.path.join(path, lora.ADAPTER_CONFIG), 'w') as f:
    f.write(text)
  graphdef, base = _base()
  with pytest.raises(ValueError, match=f'`{name}` is missing'):
    lora.load_adapters(path, graphdef, base)


def test_target_order_does_not_matter():
  a = M.LoraConfig(rank=2, alpha=2.0, targets=('v_proj', 'q_proj'))
  b = M.LoraConfig(rank=2, alpha=2.0, targets=('q_proj', 'v_proj'))
  assert a == b and hash(a) == hash(b) and a.targets == ('q_proj', 'v_proj')
