"""Model families beyond Llama / Qwen dense: Mistral, Gemma 2, Gemma 3 (text)
and Qwen3-MoE.

For each family a tiny random checkpoint is built with transformers' own
classes from a config (no download), every parameter randomised, and saved
with `save_pretrained`. Then, per family:

* jrl's float32 logits match transformers' to 1e-4 on left- and
  right-padded prompts longer than the sliding window (12 tokens, window 4),
  and the window, soft-caps, post-norms, rope bases and routing each matter
  (turning one off moves the logits well beyond the tolerance);
* load -> save -> load is bit-exact and transformers reads the save;
* greedy sampler tokens (paged KV cache, pages of 2 tokens, so that sliding
  layers skip pages) equal the argmax of a full forward recomputed at every
  step;
* one GRPO policy step on the 8 fake devices with tensor (and expert for
  MoE) sharding gives the single-device loss and gradient norm.

Qwen3-MoE also checks its router load-balancing loss against transformers'
`aux_loss`, the two dispatches (sorted ragged and dense) against each other,
and the expert axis of the mesh.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
import torch
import transformers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jrl import models, parallel
from jrl.models import hf
from jrl.models.config import LinearRopeScaling
from jrl.sampler import Request, Sampler, SamplerConfig
from jrl.sampler import attention as paged
from jrl.trainers import common, policy_step
from tests.helpers import step_config
from tests.sampler import margins

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

WINDOW = 4
T = 12  # prompt length of the parity batch: three windows

# name -> (config class, model class, config kwargs). Soft-caps are small so
# that tanh is far from linear on these logits; rope bases differ per layer type.
SPECS = {
  'mistral': (
    transformers.MistralConfig,
    transformers.MistralForCausalLM,
    dict(
      vocab_size=96,
      hidden_size=32,
      intermediate_size=72,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=8,
      sliding_window=WINDOW,
      rope_parameters={'rope_type': 'default', 'rope_theta': 500.0},
      tie_word_embeddings=False,
    ),
  ),
  'gemma2': (
    transformers.Gemma2Config,
    transformers.Gemma2ForCausalLM,
    dict(
      vocab_size=112,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=3,  # sliding, full, sliding
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      sliding_window=WINDOW,
      query_pre_attn_scalar=24,
      attn_logit_softcapping=2.0,
      final_logit_softcapping=3.0,
      rope_parameters={'rope_type': 'default', 'rope_theta': 300.0},
    ),
  ),
  'gemma3': (
    transformers.Gemma3TextConfig,
    transformers.Gemma3ForCausalLM,
    dict(
      vocab_size=120,
      hidden_size=32,
      intermediate_size=48,
      num_hidden_layers=3,
      num_attention_heads=4,
      num_key_value_heads=1,
      head_dim=16,
      sliding_window=WINDOW,
      layer_types=['sliding_attention', 'full_attention', 'sliding_attention'],
      query_pre_attn_scalar=32,
      rope_parameters={
        'sliding_attention': {'rope_type': 'default', 'rope_theta': 50.0},
        'full_attention': {'rope_type': 'linear', 'factor': 4.0, 'rope_theta': 2000.0},
      },
    ),
  ),
  'qwen3_moe': (
    transformers.Qwen3MoeConfig,
    transformers.Qwen3MoeForCausalLM,
    dict(
      vocab_size=128,
      hidden_size=32,
      intermediate_size=64,
      moe_intermediate_size=24,
      num_hidden_layers=3,  # MoE, dense (mlp_only_layers), MoE
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=8,
      num_experts=8,
      num_experts_per_tok=2,
      norm_topk_prob=True,
      decoder_sparse_step=1,
      mlp_only_layers=[1],
      tie_word_embeddings=False,
    ),
  ),
}
FAMILIES = tuple(SPECS)

_LOGITS = jax.jit(models.logits, static_argnums=0)


def _randomise(model, seed):
  """Every parameter random: norm weights ~ N(1, 0.3²) (so (1 + w) ≈ 2 for
  Gemma), everything else ~ N(0, 0.15²)."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name:
        torch.nn.init.normal_(p, mean=1.0, std=0.3)
      else:
        torch.nn.init.normal_(p, std=0.15)


def _batch(vocab, padding, seed):
  """tokens [3, T] int32 and mask [3, T] int32 (row lengths T, 9, 3)."""
  rng = np.random.default_rng(seed)
  lengths = (T, 9, 3)
  tokens = rng.integers(0, vocab, size=(3, T)).astype(np.int32)
  mask = np.zeros((3, T), np.int32)
  for i, n in enumerate(lengths):
    if padding == 'left':
      mask[i, T - n :] = 1
    else:
      mask[i, :n] = 1
  return np.where(mask == 1, tokens, 0).astype(np.int32), mask


def _hf_out(model, tokens, mask, **kwargs):
  positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
  with torch.no_grad():
    return model(
      input_ids=torch.as_tensor(tokens, dtype=torch.long),
      attention_mask=torch.as_tensor(mask, dtype=torch.long),
      position_ids=torch.as_tensor(positions, dtype=torch.long),
      **kwargs,
    )


def _jrl_logits(graphdef, params, tokens, mask):
  return np.asarray(_LOGITS(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask)))


def _max_diff(mask, a, b):
  real = mask.astype(bool)
  return float(np.abs(a[real] - b[real]).max())


@pytest.fixture(scope='module')
def ref(tmp_path_factory):
  """{family: (checkpoint directory, transformers model)}."""
  out = {}
  for seed, name in enumerate(FAMILIES):
    config_cls, model_cls, kwargs = SPECS[name]
    model = model_cls(config_cls(**kwargs, attn_implementation='eager')).eval()
    _randomise(model, seed)
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path)
    out[name] = (path, model)
  return out


@pytest.fixture(scope='module')
def loaded(ref):
  return {name: hf.load(path) for name, (path, _) in ref.items()}


# ----------------------------------------------------------------------------
# 1. Config and parity with transformers.
# ----------------------------------------------------------------------------


def test_configs_read_from_each_family(loaded):
  mistral = loaded['mistral'].config
  assert mistral.family == 'mistral' and mistral.sliding_window == WINDOW
  assert all(mistral.is_sliding(i) for i in range(2)) and mistral.layer_types is None
  gemma2 = loaded['gemma2'].config
  assert gemma2.layer_types == ('sliding', 'full', 'sliding')
  assert (gemma2.attn_softcap, gemma2.final_softcap) == (2.0, 3.0)
  assert gemma2.attn_scale == pytest.approx(24**-0.5)
  assert gemma2.norm_plus_one and gemma2.embed_scale and gemma2.post_norms
  assert gemma2.activation == 'gelu_tanh' and gemma2.tie_embeddings and not gemma2.qk_norm
  gemma3 = loaded['gemma3'].config
  assert gemma3.qk_norm and gemma3.attn_softcap is None and gemma3.final_softcap is None
  assert (gemma3.rope_theta, gemma3.local_rope_theta) == (2000.0, 50.0)
  assert gemma3.rope_scaling == LinearRopeScaling(4.0)
  moe = loaded['qwen3_moe'].config
  assert (moe.num_experts, moe.experts_per_token, moe.moe_mlp_width) == (8, 2, 24)
  assert moe.norm_topk_prob and moe.dense_layers == (1,)
  assert [moe.is_moe(i) for i in range(3)] == [True, False, True]
  params = loaded['qwen3_moe'].params
  assert params['layers'][0]['moe']['gate'].shape == (8, 32, 24)
  assert params['layers'][0]['moe']['down'].shape == (8, 24, 32)
  assert 'mlp' in params['layers'][1] and 'moe' not in params['layers'][1]


def test_fresh_configs_round_trip_through_from_hf(loaded):
  for ckpt in loaded.values():
    assert models.ModelConfig.from_hf(ckpt.config.to_hf()) == ckpt.config
    assert models.ModelConfig.from_hf(ckpt.config.to_hf(ckpt.hf_config)) == ckpt.config


@pytest.mark.parametrize('padding', ['left', 'right'])
@pytest.mark.parametrize('name', FAMILIES)
def test_logits_match_transformers(ref, loaded, name, padding):
  _, model = ref[name]
  ckpt = loaded[name]
  tokens, mask = _batch(ckpt.config.vocab_size, padding, seed=len(name))
  expected = _hf_out(model, tokens, mask).logits.float().numpy()
  actual = _jrl_logits(ckpt.graphdef, ckpt.params, tokens, mask)
  assert np.abs(expected[mask.astype(bool)]).max() > 0.5
  diff = _max_diff(mask, actual, expected)
  print(f'{name} {padding}: max |logit diff| = {diff:.2e}')
  assert diff < 1e-4


# Each feature, switched off, moves the logits: the parity above really
# tests it. (field changes, family)
ABLATIONS = {
  'window': ({'sliding_window': None, 'layer_types': None}, 'mistral'),
  'gemma2_window': ({'sliding_window': None, 'layer_types': None}, 'gemma2'),
  'attn_softcap': ({'attn_softcap': None}, 'gemma2'),
  'final_softcap': ({'final_softcap': None}, 'gemma2'),
  'attn_scale': ({'attn_scale': None}, 'gemma2'),
  'local_rope': ({'local_rope_theta': None}, 'gemma3'),
  'rope_scaling': ({'rope_scaling': None}, 'gemma3'),
  'norm_topk_prob': ({'norm_topk_prob': False}, 'qwen3_moe'),
}


@pytest.mark.parametrize('ablation', sorted(ABLATIONS))
def test_each_feature_changes_the_logits(loaded, ablation):
  changes, name = ABLATIONS[ablation]
  ckpt = loaded[name]
  tokens, mask = _batch(ckpt.config.vocab_size, 'right', seed=1)
  full = _jrl_logits(ckpt.graphdef, ckpt.params, tokens, mask)
  graphdef, _ = models.abstract(ckpt.config.replace(**changes))
  ablated = _jrl_logits(graphdef, ckpt.params, tokens, mask)
  assert _max_diff(mask, full, ablated) > 1e-2


def test_sliding_window_keys_outside_do_not_matter(loaded):
  # Mistral, every layer windowed over 2 layers: the last position's logits
  # depend on the last 2·(W − 1) + 1 tokens only.
  ckpt = loaded['mistral']
  tokens, mask = _batch(ckpt.config.vocab_size, 'right', seed=2)
  tokens, mask = tokens[:1], mask[:1]
  changed = tokens.copy()
  reach = 2 * (WINDOW - 1) + 1
  changed[0, : T - reach] = (changed[0, : T - reach] + 1) % ckpt.config.vocab_size
  a = _jrl_logits(ckpt.graphdef, ckpt.params, tokens, mask)[0, -1]
  b = _jrl_logits(ckpt.graphdef, ckpt.params, changed, mask)[0, -1]
  np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  changed[0, T - reach] = (changed[0, T - reach] + 1) % ckpt.config.vocab_size
  c = _jrl_logits(ckpt.graphdef, ckpt.params, changed, mask)[0, -1]
  assert np.abs(a - c).max() > 1e-4


# ----------------------------------------------------------------------------
# 2. Mixture of experts.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize('padding', ['left', 'right'])
def test_router_loss_matches_transformers(ref, loaded, padding):
  _, model = ref['qwen3_moe']
  ckpt = loaded['qwen3_moe']
  tokens, mask = _batch(ckpt.config.vocab_size, padding, seed=5)
  expected = float(_hf_out(model, tokens, mask, output_router_logits=True).aux_loss)
  fn = jax.jit(functools.partial(models.hidden_states, with_router_loss=True), static_argnums=0)
  _, aux = fn(ckpt.graphdef, ckpt.params, jnp.asarray(tokens), jnp.asarray(mask))
  assert float(aux) == pytest.approx(expected, rel=1e-5)
  # k = 2 of 8 experts: perfectly balanced would be 2, the most skewed 16.
  assert 1.5 < float(aux) < 16


def test_router_loss_of_a_balanced_router_is_k():
  # Hand-computed: uniform router probabilities give Σ_e (k/E)·(1/E)·E = k.
  logits = [jnp.zeros((6, 4)), jnp.zeros((6, 4))]
  mask = jnp.ones((2, 3), bool)
  loss = models.router_load_balancing_loss(logits, mask, num_experts=4, k=2)
  assert float(loss) == pytest.approx(2.0)
  # A router that sends everything to expert 0 (k = 1): E · 1 · 1 = E.
  skewed = [jnp.asarray(np.tile([50.0, 0, 0, 0], (6, 1)))]
  assert float(models.router_load_balancing_loss(skewed, mask, 4, 1)) == pytest.approx(4.0)
  assert float(models.router_load_balancing_loss([], mask, 4, 1)) == 0.0


def test_ragged_and_dense_dispatch_agree_with_gradients(loaded):
  ckpt = loaded['qwen3_moe']
  tokens, mask = _batch(ckpt.config.vocab_size, 'left', seed=6)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  out = {}
  for impl in ('ragged', 'dense'):
    graphdef, _ = models.abstract(ckpt.config.replace(moe_impl=impl))

    def loss(params, graphdef=graphdef):
      logp, _, aux = models.next_token_logprobs(
        graphdef, params, tokens, mask, with_router_loss=True
      )
      return -jnp.sum(logp * mask) + 0.1 * aux

    out[impl] = jax.jit(jax.value_and_grad(loss))(ckpt.params)
  (l_r, g_r), (l_d, g_d) = out['ragged'], out['dense']
  assert float(l_r) == pytest.approx(float(l_d), rel=1e-5)
  for a, b in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_d), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
  # Every expert of every MoE layer was routed to and gets a gradient.
  for layer in (0, 2):
    gate = np.asarray(g_r['layers'][layer]['moe']['gate'])
    assert (np.abs(gate).reshape(8, -1).max(axis=1) > 0).all()


def test_param_counts():
  cfg = models.ModelConfig.from_hf(SPECS['qwen3_moe'][2] | {'model_type': 'qwen3_moe'})
  _, params = models.abstract(cfg)
  assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(params))
  d, f, e, k = 32, 24, 8, 2
  assert cfg.num_params() - cfg.num_params(active=True) == 2 * (e - k) * 3 * d * f
  for name in ('gemma2', 'gemma3', 'mistral'):
    kwargs = SPECS[name][2] | {'model_type': SPECS[name][0].model_type}
    cfg = models.ModelConfig.from_hf({k: v for k, v in kwargs.items() if k != 'layer_types'})
    _, params = models.abstract(cfg)
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(params)), name


# ----------------------------------------------------------------------------
# 3. Save and load.
# ----------------------------------------------------------------------------


def _assert_bit_exact(a, b):
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize('name', FAMILIES)
def test_scalar_head_is_each_familys_sequence_classification(ref, tmp_path, name):
  """A reward model or critic of each family (the backbone with a scalar
  head): saved as its family's *ForSequenceClassification, read back by
  transformers, per-token and last-token scores equal jrl's to 1e-4."""
  path, _ = ref[name]
  critic = hf.load(path, lm_head=False, scalar_head=True, head_key=jax.random.PRNGKey(3))
  out = str(tmp_path / 'rm')
  hf.save(out, critic.config, critic.params, hf_config=critic.hf_config)
  rm = transformers.AutoModelForSequenceClassification.from_pretrained(
    out, attn_implementation='eager', pad_token_id=0
  ).eval()
  assert type(rm).__name__.endswith('ForSequenceClassification'), type(rm)
  assert rm.config.num_labels == 1
  again = hf.load(out, lm_head=False, scalar_head=True)
  _assert_bit_exact(hf.to_host(again.params), hf.to_host(critic.params))
  # Unpadded rows of real tokens (id 0 is the pad id HF pools with).
  tokens = np.random.default_rng(5).integers(1, critic.config.vocab_size, (2, T)).astype(np.int32)
  mask = np.ones_like(tokens)
  with torch.no_grad():
    hidden = rm.model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).last_hidden_state
    per_token = rm.score(hidden)[..., 0].numpy()
  pooled = _hf_out(rm, tokens, mask).logits[:, 0].numpy()
  values = np.asarray(models.values(critic.graphdef, critic.params, jnp.asarray(tokens)))
  assert np.abs(per_token).max() > 0.01
  np.testing.assert_allclose(values, per_token, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(values[:, -1], pooled, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('name', FAMILIES)
def test_save_load_is_bit_exact_and_read_by_transformers(ref, loaded, tmp_path, name):
  path, model = ref[name]
  ckpt = loaded[name]
  first = hf.to_host(ckpt.params)
  # to_host gives exactly the file's tensors (per-expert tensors for MoE).
  _assert_bit_exact(first, safetensors.numpy.load_file(os.path.join(path, 'model.safetensors')))
  out = str(tmp_path / 'out')
  hf.save(out, ckpt.config, ckpt.params, hf_config=ckpt.hf_config)
  again = hf.load(out)
  assert again.config == ckpt.config
  _assert_bit_exact(hf.to_host(again.params), first)
  reread = transformers.AutoModelForCausalLM.from_pretrained(
    out, attn_implementation='eager'
  ).eval()
  assert type(reread) is type(model)
  expected_sd = model.state_dict()
  for tname, x in reread.state_dict().items():
    assert torch.equal(x, expected_sd[tname]), tname
  # A config written from scratch is read by transformers the same way too.
  fresh = str(tmp_path / 'fresh')
  hf.save(fresh, ckpt.config, ckpt.params)
  with open(os.path.join(fresh, 'config.json'), encoding='utf-8') as f:
    assert models.ModelConfig.from_hf(json.load(f)) == ckpt.config
  tokens, mask = _batch(ckpt.config.vocab_size, 'right', seed=7)
  fresh_model = transformers.AutoModelForCausalLM.from_pretrained(
    fresh, attn_implementation='eager'
  ).eval()
  np.testing.assert_allclose(
    _hf_out(fresh_model, tokens, mask).logits.numpy()[mask == 1],
    _hf_out(model, tokens, mask).logits.numpy()[mask == 1],
    atol=1e-6,
    rtol=0,
  )


def test_moe_loads_onto_an_expert_mesh(ref, loaded):
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=2, expert=4)
  sharded = hf.load(ref['qwen3_moe'][0], mesh=mesh)
  moe = sharded.params['layers'][0]['moe']
  assert moe['gate'].sharding.spec == P('expert', None, 'tensor')
  assert moe['down'].sharding.spec == P('expert', 'tensor', None)
  assert moe['router']['kernel'].sharding.spec == P(None, None)
  # Each device holds 2 of the 8 experts.
  assert {s.data.shape for s in moe['gate'].addressable_shards} == {(2, 32, 12)}
  _assert_bit_exact(hf.to_host(sharded.params), hf.to_host(loaded['qwen3_moe'].params))


# ----------------------------------------------------------------------------
# 4. The paged sampler.
# ----------------------------------------------------------------------------

PAGE = 2
MAX_PROMPT, MAX_NEW = 10, 6
PROMPT_LENS = (10, 7, 3)


def test_window_pages_are_not_gathered():
  # W = 4 with pages of 2: a slot reads 3 pages, whatever its length.
  s, k, d, m, n = 2, 1, 4, 8, 20
  assert paged.window_pages(WINDOW, PAGE, m) == 3
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(s, 2, d)), jnp.float32)
  pages = jnp.asarray(rng.normal(size=(k, n, PAGE, d)), jnp.float32)
  table = jnp.asarray(rng.permutation(np.arange(1, n))[: s * m].reshape(s, m), jnp.int32)
  lengths = jnp.asarray([15, 6], jnp.int32)
  fn = functools.partial(paged.paged_attention_gather, window=WINDOW)
  jaxpr = str(jax.make_jaxpr(fn)(q, pages, pages, table, lengths))
  assert f'f32[{k},{s},3,{PAGE},{d}]' in jaxpr
  assert f'f32[{k},{s},{m},{PAGE},{d}]' not in jaxpr
  # The same numbers as the dense attention with the window mask.
  out = fn(q, pages, pages, table, lengths)
  for i in range(s):
    keys = pages[:, table[i]].reshape(k, m * PAGE, d).swapaxes(0, 1)[None]
    pos = np.arange(m * PAGE)
    allowed = (pos < lengths[i]) & (pos >= lengths[i] - WINDOW)
    want = models.dot_attention(q[i][None, None], keys, keys, jnp.asarray(allowed)[None, None])
    np.testing.assert_allclose(np.asarray(out[i]), np.asarray(want[0, 0]), atol=1e-6)


def _greedy_recompute(graphdef, params, prompt, steps, vocab):
  """Argmax of a full forward of prompt + tokens so far, `steps` times, up
  to the first near-tie (top-2 gap under margins.DELTA) that float rounding
  could flip between the sampler's program and this one."""
  width = MAX_PROMPT + MAX_NEW
  rows = list(prompt)
  fn = _LOGITS
  for _ in range(steps):
    tokens = np.zeros((1, width), np.int32)
    mask = np.zeros((1, width), np.int32)
    tokens[0, : len(rows)] = rows
    mask[0, : len(rows)] = 1
    logits = np.asarray(fn(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask)))
    top2 = np.sort(logits[0, len(rows) - 1])[-2:]
    if top2[1] - top2[0] < margins.DELTA:
      break
    rows.append(int(np.argmax(logits[0, len(rows) - 1])))
  return rows[len(prompt) :]


@pytest.mark.parametrize('name', FAMILIES)
def test_greedy_sampler_equals_full_forward_argmax(loaded, name):
  ckpt = loaded[name]
  cfg = ckpt.config
  ecfg = SamplerConfig(
    num_slots=2,
    num_pages=40,
    page_size=PAGE,
    max_prompt_len=MAX_PROMPT,
    max_new_tokens=MAX_NEW,
    attention_impl='gather',
  )
  sampler = Sampler(ckpt.graphdef, cfg, ecfg, steps_per_dispatch=3, prefill_buckets=(MAX_PROMPT,))
  rng = np.random.default_rng(3)
  requests = [
    Request(prompt=rng.integers(0, cfg.vocab_size, n).tolist(), max_new_tokens=MAX_NEW, greedy=True)
    for n in PROMPT_LENS
  ]
  groups = sampler.generate(ckpt.params, requests)
  for r, (c,) in zip(requests, groups, strict=True):
    want = _greedy_recompute(ckpt.graphdef, ckpt.params, r.prompt, MAX_NEW, cfg.vocab_size)
    assert len(want) >= MAX_NEW // 2, f'{name}: a near-tie at token {len(want)}'
    np.testing.assert_array_equal(
      c.tokens[: len(want)], want, err_msg=f'{name} prompt {len(r.prompt)}'
    )
  # Longest sequence 15 > W: the sliding layers really skipped pages.
  assert MAX_PROMPT + MAX_NEW - 1 > (cfg.sliding_window or 0) + PAGE


# ----------------------------------------------------------------------------
# 5. One GRPO step, sharded vs one device.
# ----------------------------------------------------------------------------

MESHES = {
  'mistral': dict(data=2, fsdp=2, tensor=2),
  'gemma2': dict(data=2, fsdp=2, tensor=2),
  'gemma3': dict(data=2, fsdp=1, tensor=4),
  'qwen3_moe': dict(data=1, fsdp=1, tensor=2, expert=4),
}


def _policy_batch(vocab, b=4, length=T, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (b, length)).astype(np.int32)
  lengths = np.asarray([length, length - 2, 8, 6])[:b]
  mask = np.arange(length)[None, :] < lengths[:, None]
  loss_mask = mask & (np.arange(length)[None, :] >= 4)
  return policy_step.PolicyBatch(
    tokens=jnp.asarray(np.where(mask, tokens, 0)),
    mask=jnp.asarray(mask),
    loss_mask=jnp.asarray(loss_mask),
    old_logp=jnp.asarray(np.where(loss_mask, -2.0 + 0.1 * rng.normal(size=(b, length)), 0.0)),
    ref_logp=jnp.zeros((b, length), jnp.float32),
    advantages=jnp.asarray(np.where(loss_mask, rng.normal(size=(b, 1)), 0.0), jnp.float32),
  )


@pytest.mark.parametrize('name', FAMILIES)
def test_grpo_step_sharded_equals_single_device(loaded, name):
  ckpt = loaded[name]
  tx = optax.sgd(1e-2)
  schedule = optax.constant_schedule(1e-2)
  cfg = step_config(policy_loss='ppo', kl_coef=0.0, chunk_size=16)
  batch = _policy_batch(ckpt.config.vocab_size)
  step = jax.jit(
    functools.partial(
      policy_step.train_step, graphdef=ckpt.graphdef, tx=tx, schedule=schedule, step_config=cfg
    )
  )
  single_state, single = step(common.init_state(ckpt.params, tx), batch)

  mesh = parallel.make_mesh(**MESHES[name])
  shardings = parallel.param_shardings(
    mesh, ckpt.params, models.param_logical_axes, units=models.head_units(ckpt.config)
  )
  params = jax.device_put(ckpt.params, shardings)
  specs = {s.spec for s in jax.tree.leaves(shardings)}
  assert any('tensor' in [a for a in s if a] for s in specs), specs
  if name == 'qwen3_moe':
    assert P('expert', None, 'tensor') in specs
  state = common.place_on_mesh(common.init_state(params, tx), mesh)
  sharded_batch = jax.device_put(batch, parallel.batch_sharding(mesh))
  sharded_state, sharded = step(state, sharded_batch)
  assert float(sharded['actor/loss']) == pytest.approx(float(single['actor/loss']), abs=1e-6)
  assert float(sharded['actor/grad_norm']) == pytest.approx(
    float(single['actor/grad_norm']), rel=1e-5
  )
  for a, b in zip(
    jax.tree.leaves(sharded_state.params), jax.tree.leaves(single_state.params), strict=True
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
  leaf = jax.tree.leaves(sharded_state.params)[0]
  assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh
