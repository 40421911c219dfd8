"""`ModelConfig` <-> a Hugging Face `config.json`, family by family: the
bodies of `ModelConfig.from_hf` and `ModelConfig.to_hf`.

`from_hf` reads old-style files (`rope_theta` / `rope_scaling`) and the newer
`rope_parameters`, and refuses what jrl cannot run exactly (an unknown
architecture, an unsupported activation, a rope type other than default /
linear / llama3, Qwen2's sliding window) with an error naming the field.
`to_hf` writes back what `from_hf` reads, under each family's own key names,
so that `from_hf(config.to_hf()) == config`. The architectures and families
are the tables `ARCHITECTURES` and `FAMILIES` of `config_fields.py`.
"""

import math

from jrl.models.config_fields import (
  _MODEL_TYPES,
  ARCHITECTURES,
  FAMILIES,
  LinearRopeScaling,
  RopeScaling,
)


def from_hf(cls, hf, *, source='config.json', overrides=None):
  """`cls` (a `ModelConfig`) from the parsed `config.json` `hf`; `overrides`
  are fields set on top. Raises ValueError naming the field and `source`."""
  overrides = overrides or {}

  def need(key):
    if key not in hf:
      raise ValueError(f'{source}: missing field `{key}`.')
    return hf[key]

  archs = hf.get('architectures') or []
  model_type = hf.get('model_type')
  family = None
  for arch in archs:
    family = ARCHITECTURES.get(arch)
    if family:
      break
  if family is None and not archs and model_type in _MODEL_TYPES:
    family = _MODEL_TYPES[model_type]
  if family is None:
    raise ValueError(
      f'{source}: unsupported architecture `architectures`={archs!r} '
      f'(model_type={model_type!r}); supported: {sorted(ARCHITECTURES)}.'
    )
  if model_type is not None and model_type != FAMILIES[family][0]:
    raise ValueError(
      f'{source}: `model_type`={model_type!r} contradicts `architectures`={archs!r} '
      f'(a {family} model); fix one of them.'
    )
  gemma = family in ('gemma2', 'gemma3')
  act_key = 'hidden_activation' if gemma and hf.get('hidden_activation') else 'hidden_act'
  act = hf.get(act_key) or ('gelu_pytorch_tanh' if gemma else 'silu')
  activation = {'silu': 'silu', 'gelu_pytorch_tanh': 'gelu_tanh'}.get(act)
  if activation is None:
    raise ValueError(
      f'{source}: `{act_key}`={act!r} is not supported (only "silu" and "gelu_pytorch_tanh").'
    )
  # Qwen2 applies the window to layers >= max_window_layers only.
  if hf.get('use_sliding_window', False) and hf.get('max_window_layers', 0) < hf.get(
    'num_hidden_layers', 0
  ):
    raise ValueError(
      f'{source}: `use_sliding_window`=true with `max_window_layers` below '
      '`num_hidden_layers` (sliding-window attention) is not supported.'
    )
  if hf.get('mlp_bias', False):
    raise ValueError(f'{source}: `mlp_bias`=true is not supported.')
  if gemma and hf.get('attention_bias', False):
    raise ValueError(f'{source}: `attention_bias`=true is not supported for {family}.')
  if hf.get('use_bidirectional_attention', False):
    raise ValueError(f'{source}: `use_bidirectional_attention`=true is not supported.')

  num_heads = need('num_attention_heads')
  num_layers = need('num_hidden_layers')
  width = need('hidden_size')
  head_dim = hf.get('head_dim') or width // num_heads
  rope = dict(hf.get('rope_parameters') or {})
  local_theta = None
  if family == 'gemma3':
    # Gemma 3 keeps one rope per layer type; rope_local_base_freq in older files.
    if 'full_attention' in rope or 'sliding_attention' in rope:
      local = dict(rope.get('sliding_attention') or {})
      rope = dict(rope.get('full_attention') or {})
      if local.get('rope_type', 'default') != 'default':
        raise ValueError(
          f'{source}: rope type {local["rope_type"]!r} on the sliding layers '
          '(`rope_parameters.sliding_attention`) is not supported; only default.'
        )
      local_theta = float(local.get('rope_theta', hf.get('rope_local_base_freq', 10000.0)))
    else:
      local_theta = float(hf.get('rope_local_base_freq', 10000.0))
  legacy = hf.get('rope_scaling') or {}
  rope_theta = rope.get('rope_theta', hf.get('rope_theta', 1e6 if family == 'gemma3' else 1e4))
  rope_type = rope.get('rope_type') or legacy.get('rope_type') or legacy.get('type') or 'default'
  scaling_src = rope if rope.get('rope_type') in ('llama3', 'linear') else legacy
  scaling = None
  if rope_type == 'llama3':
    try:
      scaling = RopeScaling(
        factor=float(scaling_src['factor']),
        low_freq_factor=float(scaling_src['low_freq_factor']),
        high_freq_factor=float(scaling_src['high_freq_factor']),
        original_max_positions=int(scaling_src['original_max_position_embeddings']),
      )
    except KeyError as e:
      raise ValueError(f'{source}: llama3 rope scaling is missing `{e.args[0]}`.') from None
  elif rope_type == 'linear':
    if 'factor' not in scaling_src:
      raise ValueError(f'{source}: linear rope scaling is missing `factor`.')
    scaling = LinearRopeScaling(factor=float(scaling_src['factor']))
  elif rope_type != 'default':
    raise ValueError(
      f'{source}: rope type {rope_type!r} (`rope_scaling`/`rope_parameters`) is not '
      'supported; supported: default, linear, llama3.'
    )

  window = hf.get('sliding_window') if family in ('mistral', 'gemma2', 'gemma3') else None
  layer_types = None
  if window is not None and gemma:
    names = hf.get('layer_types')
    if names is None:
      # Gemma 2 alternates local and global layers; Gemma 3 has one global in `pattern`.
      pattern = 2 if family == 'gemma2' else int(hf.get('sliding_window_pattern', 6))
      names = [
        'sliding_attention' if (i + 1) % pattern else 'full_attention' for i in range(num_layers)
      ]
    known = {'sliding_attention': 'sliding', 'full_attention': 'full'}
    if len(names) != num_layers or any(n not in known for n in names):
      raise ValueError(
        f'{source}: `layer_types` must list {num_layers} of {sorted(known)}, got {names!r}.'
      )
    layer_types = tuple(known[n] for n in names)
  elif (
    hf.get('layer_types') is not None
    and any(n != 'full_attention' for n in hf['layer_types'])
    and family not in ('qwen2', 'qwen3', 'qwen3_moe')
  ):
    raise ValueError(f'{source}: `layer_types` other than full attention are not supported.')

  query_scalar = hf.get('query_pre_attn_scalar', 256) if gemma else None
  num_experts = 0
  moe = {}
  if family == 'qwen3_moe':
    num_experts = int(hf.get('num_experts', hf.get('num_local_experts', 0)) or 0)
    moe = {
      'num_experts': num_experts,
      'experts_per_token': int(need('num_experts_per_tok')) if num_experts else 0,
      'moe_mlp_width': int(need('moe_intermediate_size')) if num_experts else 0,
      'norm_topk_prob': bool(hf.get('norm_topk_prob', False)),
      'moe_step': int(hf.get('decoder_sparse_step', 1)),
      'dense_layers': tuple(int(i) for i in hf.get('mlp_only_layers') or ()),
    }
  fields = {
    'vocab_size': need('vocab_size'),
    'width': width,
    'mlp_width': need('intermediate_size'),
    'num_layers': num_layers,
    'num_heads': num_heads,
    'num_kv_heads': hf.get('num_key_value_heads', num_heads),
    'head_dim': head_dim,
    'family': family,
    'rms_eps': float(hf.get('rms_norm_eps', 1e-6)),
    'rope_theta': float(rope_theta),
    'rope_scaling': scaling,
    'qkv_bias': bool(hf.get('attention_bias', family == 'qwen2')),
    'qk_norm': family in ('qwen3', 'qwen3_moe', 'gemma3'),
    'tie_embeddings': bool(hf.get('tie_word_embeddings', gemma)),
    'max_positions': int(hf.get('max_position_embeddings', 4096)),
    'init_std': float(hf.get('initializer_range', 0.02)),
    'activation': activation,
    'sliding_window': None if window is None else int(window),
    'layer_types': layer_types,
    'local_rope_theta': local_theta,
    'attn_scale': None if query_scalar is None else float(query_scalar) ** -0.5,
    'attn_softcap': _opt_float(hf.get('attn_logit_softcapping')) if gemma else None,
    'final_softcap': _opt_float(hf.get('final_logit_softcapping')) if gemma else None,
    'norm_plus_one': gemma,
    'embed_scale': gemma,
    'post_norms': gemma,
    **moe,
  }
  fields.update(overrides)
  try:
    return cls(**fields)
  except ValueError as e:
    raise ValueError(f'{source}: {e}') from None


def to_hf(config, base=None):
  """A Hugging Face `config.json` dict of `config`; `base` (the dict read) is
  kept and updated."""
  model_type, prefix = FAMILIES[config.family]
  out = dict(base or {})
  out.setdefault('architectures', [f'{prefix}ForCausalLM'])
  out.setdefault('model_type', model_type)
  gemma = config.family in ('gemma2', 'gemma3')
  out.update(
    {
      'vocab_size': config.vocab_size,
      'hidden_size': config.width,
      'intermediate_size': config.mlp_width,
      'num_hidden_layers': config.num_layers,
      'num_attention_heads': config.num_heads,
      'num_key_value_heads': config.num_kv_heads,
      'head_dim': config.head_dim,
      'rms_norm_eps': config.rms_eps,
      'tie_word_embeddings': config.tie_embeddings,
      'max_position_embeddings': config.max_positions,
      'initializer_range': config.init_std,
    }
  )
  act = {'silu': 'silu', 'gelu_tanh': 'gelu_pytorch_tanh'}[config.activation]
  out['hidden_activation' if gemma else 'hidden_act'] = act
  if config.family not in ('qwen3', 'qwen3_moe'):
    out['attention_bias'] = config.qkv_bias
  if config.family in ('mistral', 'gemma2', 'gemma3'):
    out['sliding_window'] = config.sliding_window
  if gemma:
    if config.layer_types is not None:
      names = {'sliding': 'sliding_attention', 'full': 'full_attention'}
      out['layer_types'] = [names[t] for t in config.layer_types]
    # attn_scale came from query_pre_attn_scalar; write back the value read when it still matches.
    scalar = out.get('query_pre_attn_scalar', 256)
    if config.attn_scale is None or not math.isclose(scalar**-0.5, config.attn_scale):
      scalar = config.head_dim if config.attn_scale is None else config.attn_scale**-2
      if math.isclose(scalar, round(scalar)):
        scalar = round(scalar)  # transformers wants an int
    out['query_pre_attn_scalar'] = scalar
    out['attn_logit_softcapping'] = config.attn_softcap
    out['final_logit_softcapping'] = config.final_softcap
  if config.num_experts:
    experts_key = 'num_local_experts' if 'num_local_experts' in out else 'num_experts'
    out[experts_key] = config.num_experts
    out.update(
      {
        'num_experts_per_tok': config.experts_per_token,
        'moe_intermediate_size': config.moe_mlp_width,
        'norm_topk_prob': config.norm_topk_prob,
        'decoder_sparse_step': config.moe_step,
        'mlp_only_layers': list(config.dense_layers),
      }
    )
  if config.family == 'gemma3' and (base is None or 'rope_parameters' in base):
    out['rope_parameters'] = {
      'full_attention': rope_dict(config),
      'sliding_attention': {'rope_type': 'default', 'rope_theta': config.local_rope_theta},
    }
  elif config.family == 'gemma3':
    out['rope_theta'] = config.rope_theta
    out['rope_local_base_freq'] = config.local_rope_theta
    if config.rope_scaling is not None:
      out['rope_scaling'] = {k: v for k, v in rope_dict(config).items() if k != 'rope_theta'}
  elif base is None or 'rope_parameters' in base or 'rope_theta' not in base:
    out['rope_parameters'] = rope_dict(config)
  else:
    out['rope_theta'] = config.rope_theta
    if config.rope_scaling is not None:
      out['rope_scaling'] = {k: v for k, v in rope_dict(config).items() if k != 'rope_theta'}
  # The dtype the tensors are written in (newer files say `dtype`, older `torch_dtype`).
  if 'torch_dtype' in out:
    out['torch_dtype'] = config.param_dtype
  if 'dtype' in out or 'torch_dtype' not in out:
    out['dtype'] = config.param_dtype
  return out


def rope_dict(config):
  """rope_parameters of the global layers: type, theta and scaling fields."""
  s = config.rope_scaling
  if s is None:
    return {'rope_type': 'default', 'rope_theta': config.rope_theta}
  if isinstance(s, LinearRopeScaling):
    return {'rope_type': 'linear', 'rope_theta': config.rope_theta, 'factor': s.factor}
  return {
    'rope_type': 'llama3',
    'rope_theta': config.rope_theta,
    'factor': s.factor,
    'low_freq_factor': s.low_freq_factor,
    'high_freq_factor': s.high_freq_factor,
    'original_max_position_embeddings': s.original_max_positions,
  }


def _opt_float(value):
  return None if value is None else float(value)
