"""Tests for jrl.models.hf: Hugging Face checkpoints in and out.

Tiny random Llama 3 (with Llama 3 rope scaling), Qwen2 (q/k/v biases; tied and
untied embeddings) and Qwen3 (q/k norm, head_dim != width / heads) checkpoints
are written once per module with `transformers`, every parameter randomised
(Hugging Face initialises biases to 0 and norm weights to 1, which would hide
a missing bias or a transposed norm). `jrl.models.hf.load` must then give the
same float32 logits as the Hugging Face model on left- and right-padded
batches; load -> save must be bit-exact and readable by `transformers`;
loading onto a (fsdp, tensor) mesh must equal the single-device load, each
device reading only its slice; and bad checkpoints must fail with an error
that names the file or the field.

Nothing here calls `torch.load`: checkpoints go through safetensors only.
"""

import json
import os
import pickle
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from jax.sharding import PartitionSpec as P

from jrl import models, parallel
from jrl.models import hf, safetensors_io
from jrl.models.config import ModelConfig, rope_inv_freq

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

# Llama 3 scaling chosen so that the head_dim=8 frequencies (unscaled
# wavelengths 6.3, 20, 63, 199 with theta=100) fall in all three bands: below
# original_max / high_freq_factor = 16 (kept), between 16 and original_max /
# low_freq_factor = 64 (blended) and above 64 (divided by `factor`); checked
# by `test_llama3_scaling_covers_every_band`.
LLAMA3_ROPE = {
  'rope_type': 'llama3',
  'rope_theta': 100.0,
  'factor': 8.0,
  'low_freq_factor': 1.0,
  'high_freq_factor': 4.0,
  'original_max_position_embeddings': 64,
}

# name -> (transformers config class, model class, config kwargs). Shapes
# differ between families and are non-square so a transposed or swapped
# kernel cannot go unnoticed.
SPECS = {
  'llama': (
    transformers.LlamaConfig,
    transformers.LlamaForCausalLM,
    dict(
      vocab_size=160,
      hidden_size=32,
      intermediate_size=80,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      rope_parameters=LLAMA3_ROPE,
      rms_norm_eps=1e-5,
      bos_token_id=1,
      eos_token_id=2,
      tie_word_embeddings=False,
    ),
  ),
  'qwen2': (
    transformers.Qwen2Config,
    transformers.Qwen2ForCausalLM,
    dict(
      vocab_size=128,
      hidden_size=48,
      intermediate_size=96,
      num_hidden_layers=2,
      num_attention_heads=6,
      num_key_value_heads=2,
      rope_parameters={'rope_type': 'default', 'rope_theta': 1000.0},
      tie_word_embeddings=False,
    ),
  ),
  'qwen2_tied': (
    transformers.Qwen2Config,
    transformers.Qwen2ForCausalLM,
    dict(
      vocab_size=136,
      hidden_size=32,
      intermediate_size=72,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=1,
      tie_word_embeddings=True,
    ),
  ),
  'qwen3': (
    transformers.Qwen3Config,
    transformers.Qwen3ForCausalLM,
    dict(
      vocab_size=144,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,  # != 32 / 4
      tie_word_embeddings=False,
    ),
  ),
}
FAMILIES = tuple(SPECS)

_LOGITS = jax.jit(models.logits, static_argnums=0)
_VALUES = jax.jit(models.values, static_argnums=0)


# ----------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------


def _randomise(model, seed):
  """Every parameter random: kernels and embeddings ~ N(0, 0.15²), norm
  weights ~ N(1, 0.3²), biases ~ N(0, 0.3²)."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name:
        torch.nn.init.normal_(p, mean=1.0, std=0.3)
      elif name.endswith('bias'):
        torch.nn.init.normal_(p, std=0.3)
      else:
        torch.nn.init.normal_(p, std=0.15)


def _build(name, seed):
  config_cls, model_cls, kwargs = SPECS[name]
  config = config_cls(**kwargs, attn_implementation='eager')
  model = model_cls(config).eval()
  _randomise(model, seed)
  return model


def _batch(vocab, padding, seed, low=0):
  """tokens [3, 9] int32 and mask [3, 9] int32 (row lengths 9, 6, 2)."""
  rng = np.random.default_rng(seed)
  b, t, lengths = 3, 9, (9, 6, 2)
  tokens = rng.integers(low, vocab, size=(b, t)).astype(np.int32)
  mask = np.zeros((b, t), np.int32)
  for i, n in enumerate(lengths):
    if padding == 'left':
      mask[i, t - n :] = 1
    else:
      mask[i, :n] = 1
  tokens = np.where(mask == 1, tokens, 0).astype(np.int32)
  return tokens, mask


def _positions(mask):
  return np.maximum(np.cumsum(mask, axis=-1) - 1, 0)


def _torch_inputs(tokens, mask):
  return dict(
    input_ids=torch.as_tensor(tokens, dtype=torch.long),
    attention_mask=torch.as_tensor(mask, dtype=torch.long),
    position_ids=torch.as_tensor(_positions(mask), dtype=torch.long),
  )


def _hf_logits(model, tokens, mask):
  with torch.no_grad():
    return model(**_torch_inputs(tokens, mask)).logits.float().numpy()


def _jrl_logits(ckpt, tokens, mask):
  return np.asarray(_LOGITS(ckpt.graphdef, ckpt.params, jnp.asarray(tokens), jnp.asarray(mask)))


def _assert_close_on(mask, actual, expected, tol):
  real = mask.astype(bool)
  assert actual.shape == expected.shape
  np.testing.assert_allclose(actual[real], expected[real], rtol=tol, atol=tol)


def _assert_bit_exact(a, b):
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype, name
    assert a[name].shape == b[name].shape, name
    # Compare bytes: NaN-safe and exact for bfloat16.
    assert a[name].tobytes() == b[name].tobytes(), name


def _copy(src, dst):
  shutil.copytree(src, dst)
  return str(dst)


def _edit_config(path, fn):
  cfg_path = os.path.join(path, 'config.json')
  with open(cfg_path, encoding='utf-8') as f:
    cfg = json.load(f)
  fn(cfg)
  with open(cfg_path, 'w', encoding='utf-8') as f:
    json.dump(cfg, f)


def _edit_tensors(path, fn):
  """Rewrites <path>/model.safetensors with fn(dict of np arrays)."""
  st_path = os.path.join(path, 'model.safetensors')
  tensors = safetensors.numpy.load_file(st_path)
  fn(tensors)
  safetensors_io.save_file(tensors, st_path, {'format': 'pt'})
  return st_path


# ----------------------------------------------------------------------------
# Module fixtures: each checkpoint is written once.
# ----------------------------------------------------------------------------


@pytest.fixture(scope='module')
def ref(tmp_path_factory):
  """{family: (directory, the in-memory Hugging Face reference model)}."""
  out = {}
  for seed, name in enumerate(FAMILIES):
    model = _build(name, seed)
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path)
    out[name] = (path, model)
  return out


@pytest.fixture(scope='module')
def loaded(ref):
  """{family: hf.load of the checkpoint on the default device}."""
  return {name: hf.load(path) for name, (path, _) in ref.items()}


@pytest.fixture(scope='module')
def llama_dir(ref):
  return ref['llama'][0]


# ----------------------------------------------------------------------------
# 1. Parity with transformers.
# ----------------------------------------------------------------------------


def test_fixture_checkpoints_are_fully_random(ref):
  # Guards the other tests: no bias left at 0, no norm weight left at 1.
  for name, (path, _) in ref.items():
    tensors = safetensors.numpy.load_file(os.path.join(path, 'model.safetensors'))
    for tname, x in tensors.items():
      assert np.std(x) > 0.05, (name, tname)
  names = safetensors.numpy.load_file(os.path.join(ref['qwen2'][0], 'model.safetensors'))
  assert 'model.layers.0.self_attn.q_proj.bias' in names
  names = safetensors.numpy.load_file(os.path.join(ref['qwen3'][0], 'model.safetensors'))
  assert 'model.layers.1.self_attn.k_norm.weight' in names
  names = safetensors.numpy.load_file(os.path.join(ref['qwen2_tied'][0], 'model.safetensors'))
  assert 'lm_head.weight' not in names


def test_config_read_from_each_family(loaded):
  llama = loaded['llama'].config
  assert (llama.family, llama.width, llama.mlp_width, llama.vocab_size) == ('llama', 32, 80, 160)
  assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 8)
  assert llama.rms_eps == 1e-5 and llama.rope_theta == 100.0
  assert llama.rope_scaling == models.RopeScaling(8.0, 1.0, 4.0, 64)
  assert not llama.qkv_bias and not llama.qk_norm and not llama.tie_embeddings
  qwen2 = loaded['qwen2'].config
  assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.rope_theta == 1000.0
  assert qwen2.rope_scaling is None
  assert loaded['qwen2_tied'].config.tie_embeddings
  assert 'lm_head' not in loaded['qwen2_tied'].params
  qwen3 = loaded['qwen3'].config
  assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 16


def test_llama3_scaling_covers_every_band(ref, loaded):
  # The rope parameters exercise all three Llama 3 bands (kept, blended,
  # divided by `factor`), and jrl's inverse frequencies equal HF's bitwise.
  config = loaded['llama'].config
  s = config.rope_scaling
  plain = rope_inv_freq(config.replace(rope_scaling=None))
  wavelen = 2 * np.pi / plain
  high = wavelen < s.original_max_positions / s.high_freq_factor
  low = wavelen > s.original_max_positions / s.low_freq_factor
  assert high.any() and low.any() and (~high & ~low).any()
  scaled = rope_inv_freq(config)
  np.testing.assert_array_equal(scaled[high], plain[high])
  np.testing.assert_allclose(scaled[low], plain[low] / s.factor, rtol=1e-6)
  assert np.all(scaled[~high & ~low] < plain[~high & ~low])
  assert np.all(scaled[~high & ~low] > plain[~high & ~low] / s.factor)
  hf_inv = ref['llama'][1].model.rotary_emb.inv_freq.numpy()
  np.testing.assert_array_equal(scaled, hf_inv)


@pytest.mark.parametrize('padding', ['left', 'right'])
@pytest.mark.parametrize('name', FAMILIES)
def test_logits_match_transformers(ref, loaded, name, padding):
  _, model = ref[name]
  ckpt = loaded[name]
  tokens, mask = _batch(ckpt.config.vocab_size, padding, seed=len(name))
  expected = _hf_logits(model, tokens, mask)
  actual = _jrl_logits(ckpt, tokens, mask)
  # Logits are O(1): a wrong bias, norm or rope would be off by far more.
  assert np.abs(expected[mask.astype(bool)]).max() > 0.5
  _assert_close_on(mask, actual, expected, 1e-4)


def test_left_and_right_padding_agree(loaded):
  # The same rows, padded either way, give the same logits at real tokens.
  ckpt = loaded['qwen2']
  left_tokens, left_mask = _batch(ckpt.config.vocab_size, 'left', seed=3)
  left = _jrl_logits(ckpt, left_tokens, left_mask)
  right_tokens = np.zeros_like(left_tokens)
  right_mask = np.zeros_like(left_mask)
  for i in range(left_tokens.shape[0]):
    real = left_tokens[i][left_mask[i] == 1]
    right_tokens[i, : len(real)] = real
    right_mask[i, : len(real)] = 1
  right = _jrl_logits(ckpt, right_tokens, right_mask)
  np.testing.assert_allclose(right[right_mask == 1], left[left_mask == 1], rtol=1e-5, atol=1e-5)


def _to_legacy(cfg):
  rope = cfg.pop('rope_parameters')
  cfg['rope_theta'] = rope.pop('rope_theta')
  cfg['rope_scaling'] = rope


def test_legacy_rope_config_gives_the_same_logits(ref, loaded, tmp_path):
  path, model = ref['llama']
  legacy = _copy(path, tmp_path / 'legacy')
  _edit_config(legacy, _to_legacy)
  with open(os.path.join(legacy, 'config.json'), encoding='utf-8') as f:
    cfg = json.load(f)
  assert 'rope_parameters' not in cfg and cfg['rope_scaling']['rope_type'] == 'llama3'

  ckpt = hf.load(legacy)
  assert ckpt.config == loaded['llama'].config
  tokens, mask = _batch(ckpt.config.vocab_size, 'left', seed=5)
  expected = _hf_logits(model, tokens, mask)
  _assert_close_on(mask, _jrl_logits(ckpt, tokens, mask), expected, 1e-4)

  # Saved back in the legacy style, and transformers still reads it the same.
  out = str(tmp_path / 'saved')
  hf.save(out, ckpt.config, ckpt.params, hf_config=ckpt.hf_config)
  with open(os.path.join(out, 'config.json'), encoding='utf-8') as f:
    saved_cfg = json.load(f)
  assert 'rope_parameters' not in saved_cfg
  assert saved_cfg['rope_theta'] == 100.0
  assert saved_cfg['rope_scaling']['original_max_position_embeddings'] == 64
  assert saved_cfg['rope_scaling']['factor'] == 8.0
  reread = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation='eager').eval()
  _assert_close_on(mask, _hf_logits(reread, tokens, mask), expected, 1e-5)


# ----------------------------------------------------------------------------
# 2. Round trips.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('name', FAMILIES)
def test_save_is_read_by_transformers(ref, loaded, tmp_path, name):
  path, model = ref[name]
  ckpt = loaded[name]
  out = str(tmp_path / 'out')
  hf.save(out, ckpt.config, ckpt.params, hf_config=ckpt.hf_config, source_dir=path)
  reread = transformers.AutoModelForCausalLM.from_pretrained(
    out, attn_implementation='eager'
  ).eval()
  assert type(reread) is type(model)
  # Every tensor transformers holds came from our file, unchanged.
  expected_sd = model.state_dict()
  for tname, x in reread.state_dict().items():
    assert torch.equal(x, expected_sd[tname]), tname
  tokens, mask = _batch(ckpt.config.vocab_size, 'right', seed=7)
  _assert_close_on(mask, _hf_logits(reread, tokens, mask), _hf_logits(model, tokens, mask), 1e-6)
  # source_dir files are copied.
  assert os.path.exists(os.path.join(out, 'generation_config.json'))


@pytest.mark.parametrize('name', FAMILIES)
def test_load_save_load_is_bit_exact(ref, loaded, tmp_path, name):
  path, _ = ref[name]
  ckpt = loaded[name]
  first = hf.to_host(ckpt.params)
  # to_host gives the file's tensors, in Hugging Face names and layout.
  _assert_bit_exact(first, safetensors.numpy.load_file(os.path.join(path, 'model.safetensors')))
  out = str(tmp_path / 'out')
  hf.save(out, ckpt.config, ckpt.params, hf_config=ckpt.hf_config)
  again = hf.load(out)
  assert again.config == ckpt.config
  _assert_bit_exact(hf.to_host(again.params), first)


def test_config_fields_survive_the_round_trip(ref, tmp_path):
  src = _copy(ref['llama'][0], tmp_path / 'src')

  def add_extra(cfg):
    cfg['my_extra_field'] = {'nested': [1, 2, 3]}
    cfg['pad_token_id'] = 3

  _edit_config(src, add_extra)
  with open(os.path.join(src, 'config.json'), encoding='utf-8') as f:
    before = json.load(f)
  ckpt = hf.load(src)
  out = str(tmp_path / 'out')
  hf.save(out, ckpt.config, ckpt.params, hf_config=ckpt.hf_config)
  with open(os.path.join(out, 'config.json'), encoding='utf-8') as f:
    after = json.load(f)
  for key in ('bos_token_id', 'eos_token_id', 'pad_token_id', 'my_extra_field', 'architectures'):
    assert after[key] == before[key], key
  assert (after['bos_token_id'], after['eos_token_id']) == (1, 2)
  assert after['rope_parameters'] == LLAMA3_ROPE
  # Everything transformers wrote is still there with the same value.
  assert {k: after.get(k) for k in before} == before


def test_fresh_config_round_trips_through_from_hf(loaded):
  for ckpt in loaded.values():
    assert ModelConfig.from_hf(ckpt.config.to_hf()) == ckpt.config


def test_bfloat16_checkpoint_round_trip(ref, tmp_path):
  # A bfloat16 Hugging Face save, loaded as bfloat16, saved and loaded again:
  # every tensor bit-exact, and the file written in BF16.
  bf16 = _build('qwen2', seed=1).to(torch.bfloat16)
  bf16_dir = str(tmp_path / 'bf16')
  bf16.save_pretrained(bf16_dir)
  assert safetensors_io.SafetensorsFile(os.path.join(bf16_dir, 'model.safetensors')).dtype(
    'model.norm.weight'
  ) == np.dtype(ml_dtypes.bfloat16)

  ckpt = hf.load(bf16_dir, param_dtype='bfloat16')
  host = hf.to_host(ckpt.params)
  for tname, x in bf16.state_dict().items():
    assert host[tname].dtype == ml_dtypes.bfloat16, tname
    expected_bits = x.view(torch.int16).numpy()
    np.testing.assert_array_equal(host[tname].view(np.int16), expected_bits, err_msg=tname)

  out = str(tmp_path / 'out')
  hf.save(out, ckpt.config, ckpt.params, hf_config=ckpt.hf_config)
  written = safetensors_io.SafetensorsFile(os.path.join(out, 'model.safetensors'))
  assert {written.dtype(n) for n in written.keys()} == {np.dtype(ml_dtypes.bfloat16)}
  again = hf.load(out, param_dtype='bfloat16')
  _assert_bit_exact(hf.to_host(again.params), host)

  # The float32 default reads the same bfloat16 values, exactly upcast.
  f32 = hf.to_host(hf.load(out).params)
  for tname, x in host.items():
    assert f32[tname].dtype == np.float32
    np.testing.assert_array_equal(f32[tname], x.astype(np.float32))


def test_param_dtype_override_on_float32_checkpoint(loaded, ref, tmp_path):
  ckpt = hf.load(ref['qwen3'][0], param_dtype='bfloat16')
  f32 = hf.to_host(loaded['qwen3'].params)
  host = hf.to_host(ckpt.params)
  for tname, x in f32.items():
    np.testing.assert_array_equal(host[tname], x.astype(ml_dtypes.bfloat16))
  out = str(tmp_path / 'out')
  hf.save(out, ckpt.config, ckpt.params, hf_config=ckpt.hf_config)
  _assert_bit_exact(hf.to_host(hf.load(out, param_dtype='bfloat16').params), host)


def test_multi_file_save_loads_back(ref, loaded, tmp_path):
  _, model = ref['llama']
  ckpt = loaded['llama']
  host = hf.to_host(ckpt.params)
  biggest = max(x.nbytes for x in host.values())
  out = str(tmp_path / 'sharded')
  hf.save(out, ckpt.config, ckpt.params, hf_config=ckpt.hf_config, max_shard_bytes=biggest)
  files = sorted(f for f in os.listdir(out) if f.endswith('.safetensors'))
  assert len(files) > 2
  assert files[0] == f'model-00001-of-{len(files):05d}.safetensors'
  assert 'model.safetensors' not in files
  with open(os.path.join(out, 'model.safetensors.index.json'), encoding='utf-8') as f:
    index = json.load(f)
  assert set(index['weight_map']) == set(host)
  assert set(index['weight_map'].values()) == set(files)
  assert index['metadata']['total_size'] == sum(x.nbytes for x in host.values())
  for fname in files:
    f = safetensors_io.SafetensorsFile(os.path.join(out, fname))
    assert sum(int(np.prod(f.shape(n))) * 4 for n in f.keys()) <= biggest
    assert all(index['weight_map'][n] == fname for n in f.keys())

  again = hf.load(out)
  _assert_bit_exact(hf.to_host(again.params), host)
  # transformers reads the sharded directory too.
  reread = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation='eager').eval()
  tokens, mask = _batch(ckpt.config.vocab_size, 'left', seed=11)
  _assert_close_on(mask, _hf_logits(reread, tokens, mask), _hf_logits(model, tokens, mask), 1e-6)

  # A shard listed in the index but gone is named.
  os.remove(os.path.join(out, files[1]))
  with pytest.raises(FileNotFoundError, match=re.escape(files[1])):
    hf.load(out)


@pytest.mark.parametrize('first_shard_bytes', [2000, None], ids=['sharded_first', 'single_first'])
def test_save_over_an_earlier_save_reads_the_new_weights(loaded, tmp_path, first_shard_bytes):
  # Saving into a directory that holds an earlier checkpoint (one file or
  # several) must leave a directory that both jrl and transformers read as the
  # new weights: no stale index or shard may win over what was just written.
  ckpt = loaded['llama']
  out = str(tmp_path / 'out')
  first = {} if first_shard_bytes is None else {'max_shard_bytes': first_shard_bytes}
  second = {'max_shard_bytes': 2000} if first_shard_bytes is None else {}
  hf.save(out, ckpt.config, ckpt.params, hf_config=ckpt.hf_config, **first)
  new_params = jax.tree.map(lambda x: x + 1.0, ckpt.params)
  hf.save(out, ckpt.config, new_params, hf_config=ckpt.hf_config, **second)
  new = hf.to_host(new_params)
  _assert_bit_exact(hf.to_host(hf.load(out).params), new)
  reread = transformers.LlamaForCausalLM.from_pretrained(out)
  for tname, x in reread.state_dict().items():
    np.testing.assert_array_equal(x.numpy(), new[tname], err_msg=tname)


# ----------------------------------------------------------------------------
# 3. Loading onto a mesh.
# ----------------------------------------------------------------------------


@pytest.fixture(scope='module')
def mesh():
  return parallel.make_mesh(data=1, fsdp=4, tensor=2)


def test_load_onto_mesh_matches_single_device(llama_dir, loaded, mesh):
  single = loaded['llama']
  sharded = hf.load(llama_dir, mesh=mesh)
  shardings = {
    '/'.join(map(str, parallel.path_keys(p))): x.sharding
    for p, x in jax.tree_util.tree_leaves_with_path(sharded.params)
  }
  assert all(s.mesh == mesh for s in shardings.values())
  assert not all(s.is_fully_replicated for s in shardings.values())
  assert shardings['embed/embedding'].spec == P('tensor', 'fsdp')
  assert shardings['layers/0/mlp/gate/kernel'].spec == P('fsdp', 'tensor')
  assert shardings['layers/1/mlp/down/kernel'].spec == P('tensor', 'fsdp')
  assert shardings['lm_head/kernel'].spec == P('fsdp', 'tensor')
  assert shardings['final_norm/scale'].is_fully_replicated
  _assert_bit_exact(hf.to_host(sharded.params), hf.to_host(single.params))

  tokens, mask = _batch(single.config.vocab_size, 'left', seed=13)
  # jit with sharded params, one program for the whole mesh.
  sharded_logits = _jrl_logits(sharded, tokens, mask)
  _assert_close_on(mask, sharded_logits, _jrl_logits(single, tokens, mask), 1e-5)


def test_save_from_mesh_is_bit_exact(llama_dir, loaded, mesh, tmp_path):
  sharded = hf.load(llama_dir, mesh=mesh)
  out = str(tmp_path / 'out')
  hf.save(out, sharded.config, sharded.params, hf_config=sharded.hf_config)
  _assert_bit_exact(hf.to_host(hf.load(out).params), hf.to_host(loaded['llama'].params))


def test_each_device_reads_only_its_slice(llama_dir, mesh, monkeypatch):
  calls = []
  original = safetensors_io.SafetensorsFile.read

  def recording_read(self, name, index=None):
    calls.append((name, index, self.shape(name)))
    return original(self, name, index)

  monkeypatch.setattr(safetensors_io.SafetensorsFile, 'read', recording_read)
  hf.load(llama_dir, mesh=mesh)

  def read_size(index, shape):
    return np.empty(shape, np.int8)[() if index is None else index].size

  # [F, D] in the file, sharded over all 8 devices (fsdp x tensor): 8 distinct
  # eighths, none the whole tensor.
  name = 'model.layers.0.mlp.gate_proj.weight'
  reads = [(index, shape) for n, index, shape in calls if n == name]
  full = int(np.prod(reads[0][1]))
  assert len(reads) >= 8
  assert all(read_size(i, s) == full // 8 for i, s in reads)
  assert len({str(i) for i, _ in reads}) == 8
  # No call for any tensor read the whole of an fsdp-sharded one.
  for n, index, shape in calls:
    if n.endswith(('_proj.weight', 'embed_tokens.weight', 'lm_head.weight')):
      assert read_size(index, shape) < int(np.prod(shape)), n


# ----------------------------------------------------------------------------
# 4. Scalar heads.
# ----------------------------------------------------------------------------


def test_scalar_head_from_policy_checkpoint(llama_dir, loaded):
  policy = loaded['llama']
  critic = hf.load(llama_dir, lm_head=False, scalar_head=True, head_key=jax.random.PRNGKey(0))
  assert 'lm_head' not in critic.params
  kernel = hf.to_host(critic.params)['score.weight']
  assert kernel.shape == (1, 32)
  assert 0.5 * critic.config.init_std < kernel.std() < 2 * critic.config.init_std
  body = {k: v for k, v in hf.to_host(critic.params).items() if k != 'score.weight'}
  expected = {k: v for k, v in hf.to_host(policy.params).items() if k != 'lm_head.weight'}
  _assert_bit_exact(body, expected)
  # The same key gives the same head.
  again = hf.load(llama_dir, lm_head=False, scalar_head=True, head_key=jax.random.PRNGKey(0))
  np.testing.assert_array_equal(hf.to_host(again.params)['score.weight'], kernel)
  other = hf.load(llama_dir, lm_head=False, scalar_head=True, head_key=jax.random.PRNGKey(1))
  assert not np.array_equal(hf.to_host(other.params)['score.weight'], kernel)


def test_scalar_head_needs_head_key(llama_dir):
  with pytest.raises(ValueError, match='head_key'):
    hf.load(llama_dir, lm_head=False, scalar_head=True)


def test_scalar_head_on_mesh(llama_dir, mesh):
  single = hf.load(llama_dir, lm_head=False, scalar_head=True, head_key=jax.random.PRNGKey(1))
  sharded = hf.load(
    llama_dir, mesh=mesh, lm_head=False, scalar_head=True, head_key=jax.random.PRNGKey(1)
  )
  shardings = [x.sharding for x in jax.tree.leaves(sharded.params)]
  assert all(s.mesh == mesh for s in shardings)
  _assert_bit_exact(hf.to_host(sharded.params), hf.to_host(single.params))


@pytest.fixture(scope='module')
def reward_model(llama_dir, tmp_path_factory):
  """A critic from the Llama policy, saved: (directory, Checkpoint)."""
  critic = hf.load(llama_dir, lm_head=False, scalar_head=True, head_key=jax.random.PRNGKey(0))
  out = str(tmp_path_factory.mktemp('reward_model'))
  hf.save(out, critic.config, critic.params, hf_config=critic.hf_config)
  return out, critic


def test_scalar_head_save_writes_sequence_classification(reward_model):
  out, critic = reward_model
  with open(os.path.join(out, 'config.json'), encoding='utf-8') as f:
    cfg = json.load(f)
  assert cfg['architectures'] == ['LlamaForSequenceClassification']
  assert cfg['num_labels'] == 1
  names = safetensors_io.SafetensorsFile(os.path.join(out, 'model.safetensors')).keys()
  assert 'score.weight' in names and 'lm_head.weight' not in names
  # It loads back as a reward model without a head key, bit-exact.
  again = hf.load(out, lm_head=False, scalar_head=True)
  _assert_bit_exact(hf.to_host(again.params), hf.to_host(critic.params))


def test_scalar_head_matches_transformers(reward_model):
  # Per-token scores: HF's ForSequenceClassification pools at the last
  # non-pad token, which needs pad_token_id, so the un-pooled scores are
  # compared through HF's own modules (`model.model` then `model.score`) on an
  # unpadded batch; the pooled output is then compared with
  # `sequence_scores` on a right-padded batch with pad_token_id=0 set and
  # real tokens drawn from [1, V), so the pooling cannot hit a real token.
  out, critic = reward_model
  rm = transformers.AutoModelForSequenceClassification.from_pretrained(
    out, attn_implementation='eager', pad_token_id=0
  ).eval()
  assert type(rm) is transformers.LlamaForSequenceClassification
  assert rm.config.num_labels == 1

  tokens = np.random.default_rng(17).integers(1, 160, size=(2, 7)).astype(np.int32)
  mask = np.ones_like(tokens)
  with torch.no_grad():
    hidden = rm.model(**_torch_inputs(tokens, mask)).last_hidden_state
    per_token = rm.score(hidden)[..., 0].numpy()
    pooled = rm(**_torch_inputs(tokens, mask)).logits[:, 0].numpy()
  values = np.asarray(_VALUES(critic.graphdef, critic.params, jnp.asarray(tokens)))
  assert np.abs(per_token).max() > 0.01
  np.testing.assert_allclose(values, per_token, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(values[:, -1], pooled, rtol=1e-4, atol=1e-5)

  tokens, mask = _batch(160, 'right', seed=19, low=1)
  with torch.no_grad():
    pooled = rm(**_torch_inputs(tokens, mask)).logits[:, 0].numpy()
  scores = models.sequence_scores(critic.graphdef, critic.params, tokens, mask)
  np.testing.assert_allclose(np.asarray(scores), pooled, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# 5. Bad input.
# ----------------------------------------------------------------------------


def test_missing_directory(tmp_path):
  missing = str(tmp_path / 'nope')
  with pytest.raises(FileNotFoundError, match=re.escape(missing) + '.*directory not found'):
    hf.load(missing)


def test_missing_config_json(llama_dir, tmp_path):
  path = _copy(llama_dir, tmp_path / 'ckpt')
  os.remove(os.path.join(path, 'config.json'))
  with pytest.raises(FileNotFoundError, match=r'config\.json'):
    hf.load(path)


def test_invalid_json_config(llama_dir, tmp_path):
  path = _copy(llama_dir, tmp_path / 'ckpt')
  with open(os.path.join(path, 'config.json'), 'w', encoding='utf-8') as f:
    f.write('{"hidden_size": 32,')
  with pytest.raises(ValueError, match=r'config\.json.*invalid JSON'):
    hf.load(path)


@pytest.mark.parametrize(
  ('edit', 'match'),
  [
    (lambda c: c.update(architectures=['GPT2LMHeadModel'], model_type='gpt2'), 'architectures'),
    (lambda c: c.pop('hidden_size'), 'hidden_size'),
    (lambda c: c.pop('vocab_size'), 'vocab_size'),
    (lambda c: c.update(use_sliding_window=True, sliding_window=4), 'use_sliding_window'),
    (lambda c: c.update(hidden_act='gelu'), 'hidden_act'),
    (lambda c: c.update(rope_parameters={'rope_type': 'yarn', 'factor': 2.0}), 'yarn'),
    (lambda c: c['rope_parameters'].pop('low_freq_factor'), 'low_freq_factor'),
    (lambda c: c.update(num_key_value_heads=3), 'num_kv_heads'),
    # A Llama architecture labelled as another family was loaded silently as Llama.
    (lambda c: c.update(model_type='qwen2'), r"`model_type`='qwen2' contradicts `architectures`"),
  ],
  ids=[
    'gpt2',
    'no_hidden_size',
    'no_vocab_size',
    'sliding',
    'gelu',
    'yarn',
    'rope_key',
    'gqa',
    'model_type',
  ],
)
def test_bad_config_field_is_named(llama_dir, tmp_path, edit, match):
  path = _copy(llama_dir, tmp_path / 'ckpt')
  _edit_config(path, edit)
  with pytest.raises(ValueError, match=match) as info:
    hf.load(path)
  assert 'config.json' in str(info.value)


def test_wrong_tensor_shape_names_tensor_and_file(llama_dir, tmp_path):
  path = _copy(llama_dir, tmp_path / 'ckpt')
  name = 'model.layers.1.mlp.up_proj.weight'
  st_path = _edit_tensors(path, lambda t: t.update({name: np.ascontiguousarray(t[name].T)}))
  with pytest.raises(ValueError, match=re.escape(name)) as info:
    hf.load(path)
  assert st_path in str(info.value)
  assert '[32, 80]' in str(info.value) and '[80, 32]' in str(info.value)


def test_config_json_invalid_utf8_names_the_file(llama_dir, tmp_path):
  # Before: a bare UnicodeDecodeError that named no file.
  path = _copy(llama_dir, tmp_path / 'ckpt')
  with open(os.path.join(path, 'config.json'), 'wb') as f:
    f.write(b'{"model_type": "ll\xffama"}')
  with pytest.raises(ValueError, match=r'config\.json: invalid JSON'):
    hf.load(path)


@pytest.mark.parametrize('dtype', [np.int8, np.uint8, np.int32, np.bool_])
def test_integer_tensor_for_a_float_weight_is_refused(llama_dir, tmp_path, dtype):
  # Before: cast to float32 and loaded silently (an int8 tensor is quantised
  # data, not weights).
  path = _copy(llama_dir, tmp_path / 'ckpt')
  name = 'model.layers.0.mlp.up_proj.weight'
  st_path = _edit_tensors(path, lambda t: t.update({name: np.ones_like(t[name], dtype)}))
  with pytest.raises(
    ValueError, match=re.escape(f'{name}` has dtype {np.dtype(dtype).name}')
  ) as info:
    hf.load(path)
  assert st_path in str(info.value) and 'expected a float type' in str(info.value)


@pytest.mark.parametrize(
  ('value', 'dtype', 'match'),
  [
    (np.nan, np.float32, r'contains NaN or Inf \(2 NaN values\)'),
    (-np.inf, np.float32, r'contains NaN or Inf \(2 Inf values\)'),
    (np.nan, ml_dtypes.bfloat16, r'contains NaN or Inf \(2 NaN values\)'),
  ],
  ids=['nan', 'inf', 'nan_bf16'],
)
def test_non_finite_weights_are_refused(llama_dir, tmp_path, value, dtype, match):
  # Before: loaded silently; the first forward pass returned NaN logits.
  path = _copy(llama_dir, tmp_path / 'ckpt')
  name = 'model.layers.1.self_attn.q_proj.weight'

  def poison(tensors):
    for key in tensors:
      tensors[key] = tensors[key].astype(dtype)
    tensors[name][3, 5] = tensors[name][7, 1] = value

  st_path = _edit_tensors(path, poison)
  with pytest.raises(ValueError, match=re.escape(f'`{name}`') + ' ' + match) as info:
    hf.load(path)
  assert st_path in str(info.value)


def test_non_finite_weights_are_refused_on_a_mesh(llama_dir, tmp_path, mesh):
  # Each device checks the slice it reads.
  path = _copy(llama_dir, tmp_path / 'ckpt')
  name = 'model.embed_tokens.weight'
  _edit_tensors(path, lambda t: t[name].__setitem__((-1, -1), np.nan))
  with pytest.raises(ValueError, match=re.escape(f'`{name}` contains NaN')):
    hf.load(path, mesh=mesh)


def test_weights_overflowing_param_dtype_are_refused(llama_dir, tmp_path):
  # 1e6 is finite in float32 but inf in float16: loading with
  # param_dtype='float16' used to turn it into inf silently.
  path = _copy(llama_dir, tmp_path / 'ckpt')
  name = 'model.norm.weight'
  _edit_tensors(path, lambda t: t[name].__setitem__(0, 1e6))
  hf.load(path)  # float32: fine
  with pytest.raises(
    ValueError, match=re.escape(f'`{name}` has values beyond the range of float16')
  ):
    hf.load(path, param_dtype='float16')


def test_truncated_file(llama_dir, tmp_path):
  path = _copy(llama_dir, tmp_path / 'ckpt')
  st_path = os.path.join(path, 'model.safetensors')
  size = os.path.getsize(st_path)
  with open(st_path, 'r+b') as f:
    f.truncate(size - 10)
  with pytest.raises(ValueError, match='truncated') as info:
    hf.load(path)
  assert st_path in str(info.value)


@pytest.mark.parametrize('where', ['length', 'json'])
def test_corrupt_header(llama_dir, tmp_path, where):
  path = _copy(llama_dir, tmp_path / 'ckpt')
  st_path = os.path.join(path, 'model.safetensors')
  with open(st_path, 'r+b') as f:
    if where == 'length':
      f.write(b'\xde\xad\xbe\xef' * 4)  # header length and start of JSON
    else:
      f.seek(8)
      f.write(b'\xff\xfe garbage ')
  with pytest.raises(ValueError, match='corrupt') as info:
    hf.load(path)
  assert st_path in str(info.value)


def test_only_pickle_checkpoint_is_refused_unread(llama_dir, tmp_path, monkeypatch):
  path = str(tmp_path / 'ckpt')
  os.makedirs(path)
  shutil.copyfile(os.path.join(llama_dir, 'config.json'), os.path.join(path, 'config.json'))
  with open(os.path.join(path, 'pytorch_model.bin'), 'wb') as f:
    f.write(b'not read')

  def never(*args, **kwargs):
    raise AssertionError('a pickle file was read')

  monkeypatch.setattr(torch, 'load', never)
  monkeypatch.setattr(pickle, 'load', never)
  monkeypatch.setattr(pickle, 'loads', never)
  with pytest.raises(FileNotFoundError, match=r'pytorch_model\.bin.*never read') as info:
    hf.load(path)
  assert 'safetensors' in str(info.value)


def test_missing_tensor_is_named(llama_dir, tmp_path):
  path = _copy(llama_dir, tmp_path / 'ckpt')
  name = 'model.layers.1.self_attn.k_proj.weight'
  _edit_tensors(path, lambda t: t.pop(name))
  with pytest.raises(ValueError, match=re.escape(name) + '.*missing'):
    hf.load(path)


def test_unexpected_tensor_is_named(llama_dir, tmp_path):
  path = _copy(llama_dir, tmp_path / 'ckpt')
  name = 'model.layers.0.self_attn.extra_proj.weight'
  _edit_tensors(path, lambda t: t.update({name: np.zeros((4, 4), np.float32)}))
  with pytest.raises(ValueError, match=re.escape(name)) as info:
    hf.load(path)
  assert 'not used' in str(info.value)


def test_lm_head_next_to_tied_embeddings_is_ignored(ref, tmp_path):
  # An lm_head.weight next to tie_word_embeddings=true is ignored (HF ties it).
  path = _copy(ref['qwen2_tied'][0], tmp_path / 'ckpt')
  _edit_tensors(path, lambda t: t.update({'lm_head.weight': t['model.embed_tokens.weight'].copy()}))
  ckpt = hf.load(path)
  assert 'lm_head' not in ckpt.params


def test_llama_attention_bias_is_refused(tmp_path):
  # Llama with attention_bias=true also has an o_proj bias, which jrl's model
  # does not have: the load must fail, naming that tensor, not drop it.
  config_cls, model_cls, kwargs = SPECS['llama']
  model = model_cls(config_cls(**{**kwargs, 'attention_bias': True}))
  path = str(tmp_path / 'ckpt')
  model.save_pretrained(path)
  with pytest.raises(ValueError, match=r'o_proj\.bias'):
    hf.load(path)
