"""Hugging Face checkpoints: `config.json` + `*.safetensors` in a local directory.

`load(path)` reads the config, then every tensor, each placed directly in its
final sharding: with a mesh, each device reads only its own slice of the file
(`jax.make_array_from_callback` over a memory map), so no device ever holds a
full host copy of a sharded tensor. `save(path, ...)` writes the parameters
back with Hugging Face names and layouts, in their stored dtype, so that
load → save is bit-exact and `transformers` reads the result.

Nothing is downloaded and pickle files (`*.bin`, `*.pt`, `*.pth`) are never
read. A tensor is refused, with its file and name, if its shape differs from
the one config.json implies, if it is not stored as a float type (F16, BF16,
F32, F64: an int8 tensor is a quantised checkpoint, not weights), or if it
holds NaN or Inf (or values the requested `param_dtype` cannot hold).

Name map (jrl path -> Hugging Face name; kernels are stored [in, out] here
and [out, in] there):

    embed/embedding                 model.embed_tokens.weight
    layers/i/attn_norm/scale        model.layers.i.input_layernorm.weight
    layers/i/attn/{q,k,v,o}/kernel  model.layers.i.self_attn.{q,k,v,o}_proj.weight   (T)
    layers/i/attn/{q,k,v}/bias      model.layers.i.self_attn.{q,k,v}_proj.bias
    layers/i/attn/{q,k}_norm/scale  model.layers.i.self_attn.{q,k}_norm.weight
    layers/i/mlp_norm/scale         model.layers.i.post_attention_layernorm.weight
    layers/i/mlp/{gate,up,down}/kernel  model.layers.i.mlp.{gate,up,down}_proj.weight (T)
    final_norm/scale                model.norm.weight
    lm_head/kernel                  lm_head.weight                                  (T)
    score/kernel                    score.weight                                    (T)

Gemma 2 / 3 blocks norm four times (no `mlp_norm`):

    layers/i/post_attn_norm/scale   model.layers.i.post_attention_layernorm.weight
    layers/i/pre_mlp_norm/scale     model.layers.i.pre_feedforward_layernorm.weight
    layers/i/post_mlp_norm/scale    model.layers.i.post_feedforward_layernorm.weight

LoRA adapters (`lora_a`, `lora_b` next to a kernel) are folded into the
kernel when saving: `save` writes W + (α / r) A B tensor by tensor on the
host, so the file is a plain model; `jrl.models.lora.save_adapters` writes
the adapters alone in PEFT's layout.

Mixture-of-experts layers (Qwen3-MoE) stack their E experts in one array;
the file has one tensor per expert, as the checkpoints on the Hub do:

    layers/i/moe/router/kernel    model.layers.i.mlp.gate.weight                       (T)
    layers/i/moe/{gate,up}        model.layers.i.mlp.experts.{e}.{gate,up}_proj.weight (T each)
                                  ([E, D, F] here, E tensors [F, D] there)
    layers/i/moe/down             model.layers.i.mlp.experts.{e}.down_proj.weight      (T each)
"""

import glob
import json
import os
import shutil
from typing import Any, NamedTuple

import jax
import numpy as np

from jrl import distributed, parallel
from jrl.models import logical_axes, transformer
from jrl.models.config import FAMILIES, ModelConfig
from jrl.models.hf_names import _EXPERT, expert_names, hf_name
from jrl.models.safetensors_io import DTYPES, SafetensorsFile, save_file

_PICKLE_PATTERNS = ('*.bin', '*.pt', '*.pth', '*.ckpt', '*.pkl')
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)  # buffers some old checkpoints carry
_INDEX = 'model.safetensors.index.json'
_FLOAT_DTYPES = tuple(DTYPES[k] for k in ('F16', 'BF16', 'F32', 'F64'))  # weights must be one
_COPIED_FILES = (
  'tokenizer.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  'generation_config.json',
  'vocab.json',
  'merges.txt',
)


class Checkpoint(NamedTuple):
  """What `load` returns."""

  config: ModelConfig
  graphdef: Any
  params: Any  # nnx.State of jax.Arrays
  hf_config: dict  # the config.json read, written back unchanged by `save`


def _host_tensors(name, host, transposed):
  """[(HF name, array in HF layout)] for one parameter on the host."""
  if _EXPERT not in name:
    return [(name, host.T if transposed else host)]
  return [
    (n, np.ascontiguousarray(x.T if transposed else x))
    for n, x in zip(expert_names(name, host.shape[0]), host, strict=True)
  ]


def _read_json(path):
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: file not found.')
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: invalid JSON ({e}).') from None


def load_config(path, **overrides):
  """(ModelConfig, raw config.json dict) from a checkpoint directory."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f'{path}: checkpoint directory not found.')
  cfg_path = os.path.join(path, 'config.json')
  hf = _read_json(cfg_path)
  return ModelConfig.from_hf(hf, source=cfg_path, **overrides), hf


def _open_files(path):
  """{tensor name: SafetensorsFile} for the checkpoint in `path`."""
  files = sorted(glob.glob(os.path.join(path, '*.safetensors')))
  index_path = os.path.join(path, _INDEX)
  if os.path.exists(index_path):
    index = _read_json(index_path)
    weight_map = index.get('weight_map')
    if not isinstance(weight_map, dict):
      raise ValueError(f'{index_path}: missing or invalid `weight_map`.')
    opened = {}
    for fname in sorted(set(weight_map.values())):
      fpath = os.path.join(path, fname)
      if not os.path.exists(fpath):
        raise FileNotFoundError(f'{fpath}: listed in {_INDEX} but not found.')
      opened[fname] = SafetensorsFile(fpath)
    names = {}
    for name, fname in weight_map.items():
      if name not in opened[fname]:
        raise ValueError(
          f'{os.path.join(path, fname)}: tensor `{name}` listed in {_INDEX} is missing.'
        )
      names[name] = opened[fname]
    return names
  if not files:
    pickles = [p for pat in _PICKLE_PATTERNS for p in glob.glob(os.path.join(path, pat))]
    hint = (
      f' Found {os.path.basename(pickles[0])}: pickle checkpoints are never read; '
      'convert them to safetensors first.'
      if pickles
      else ''
    )
    raise FileNotFoundError(f'{path}: no *.safetensors files.{hint}')
  names = {}
  for fpath in files:
    f = SafetensorsFile(fpath)
    for name in f.keys():
      if name in names:
        raise ValueError(f'{fpath}: tensor `{name}` also appears in {names[name].path}.')
      names[name] = f
  return names


def _check_finite(file_path, name, stored, cast):
  """Refuses NaN / Inf in a tensor (read slice), and values that overflow the cast."""
  if np.isfinite(cast).all():
    return
  nan = int(np.isnan(stored).sum())
  inf = int(np.isinf(stored).sum())
  if nan or inf:
    what = ' and '.join(f'{n} {kind}' for n, kind in ((nan, 'NaN'), (inf, 'Inf')) if n)
    raise ValueError(f'{file_path}: tensor `{name}` contains NaN or Inf ({what} values).')
  raise ValueError(
    f'{file_path}: tensor `{name}` has values beyond the range of {cast.dtype.name} '
    f'(largest magnitude {float(np.abs(stored.astype(np.float64)).max()):.3g}).'
  )


def load(
  path,
  *,
  mesh=None,
  rules=None,
  lm_head=True,
  scalar_head=False,
  head_key=None,
  **config_overrides,
):
  """Loads a Hugging Face checkpoint directory into a (sharded) parameter pytree.

  Args:
    path: directory with config.json and *.safetensors (single file or with
      model.safetensors.index.json).
    mesh: place parameters on this mesh by the logical rules; None: on the
      default device.
    rules: logical -> mesh axis rules (default `jrl.parallel.RULES`).
    lm_head: build the LM head (policy / reference). An `lm_head.weight` in
      the file is ignored when False (critic from a policy checkpoint).
    scalar_head: build the scalar `score` head. If the file has no
      `score.weight` (a policy checkpoint), it is initialised with `head_key`.
    head_key: PRNG key for a missing scalar head (required then).
    **config_overrides: ModelConfig fields, e.g. param_dtype='bfloat16'.

  Returns:
    Checkpoint(config, graphdef, params, hf_config).
  """
  config, hf_config = load_config(path, **config_overrides)
  if config.lora is not None:
    raise ValueError(
      f'{path}: `lora` cannot be loaded with the base; load it without, then add adapters '
      'with jrl.models.lora.attach (fresh) or lora.load_adapters (a PEFT directory).'
    )
  tensors = _open_files(path)
  graphdef, abstract_params = transformer.abstract(config, lm_head=lm_head, scalar_head=scalar_head)
  if mesh is not None:
    shardings = parallel.param_shardings(
      mesh, abstract_params, logical_axes.param_logical_axes, rules, logical_axes.head_units(config)
    )
  else:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract_params)

  used = set()
  missing_head = []

  def check_tensor(name, jrl_path, expected):
    if name not in tensors:
      raise ValueError(f'{path}: tensor `{name}` (for {"/".join(map(str, jrl_path))}) is missing.')
    f = tensors[name]
    if tuple(f.shape(name)) != tuple(expected):
      raise ValueError(
        f'{f.path}: tensor `{name}` has shape {list(f.shape(name))}, expected '
        f'{list(expected)} from config.json.'
      )
    stored_dtype = f.dtype(name)
    if stored_dtype not in _FLOAT_DTYPES:
      raise ValueError(
        f'{f.path}: tensor `{name}` has dtype {stored_dtype.name}, expected a float type '
        '(F16, BF16, F32 or F64).'
      )
    used.add(name)
    return f

  def read_one(f, name, index, transposed, dtype):
    stored = f.read(name, index[::-1]).T if transposed else f.read(name, index)
    with np.errstate(over='ignore'):  # an overflow is reported by `_check_finite`
      out = stored.astype(dtype)
    _check_finite(f.path, name, stored, out)
    return out

  def load_one(key_path, leaf, sharding):
    jrl_path = parallel.path_keys(key_path)
    name, transposed = hf_name(jrl_path)
    if name == 'score.weight' and name not in tensors:
      missing_head.append((key_path, leaf, sharding))
      return None
    dtype = leaf.dtype
    if _EXPERT in name:
      # [E, ...] from E tensors: each device reads its experts' slices only.
      per_expert = leaf.shape[1:][::-1] if transposed else leaf.shape[1:]
      names = expert_names(name, leaf.shape[0])
      files = [check_tensor(n, jrl_path, per_expert) for n in names]

      def read_stacked(index):
        experts = range(leaf.shape[0])[index[0]]
        parts = [read_one(files[e], names[e], index[1:], transposed, dtype) for e in experts]
        return np.stack(parts) if parts else np.zeros((0,) + leaf.shape[1:], dtype)

      return jax.make_array_from_callback(leaf.shape, sharding, read_stacked)
    f = check_tensor(name, jrl_path, leaf.shape[::-1] if transposed else leaf.shape)
    return jax.make_array_from_callback(
      leaf.shape, sharding, lambda index: read_one(f, name, index, transposed, dtype)
    )

  params = jax.tree_util.tree_map_with_path(load_one, abstract_params, shardings)
  if missing_head:
    if head_key is None:
      raise ValueError(
        f'{path}: no `score.weight` in the checkpoint; pass `head_key` to initialise '
        'the scalar head (critic or reward model from a policy checkpoint).'
      )
    std = config.init_std
    (key_path, leaf, sharding) = missing_head[0]
    head = jax.jit(
      lambda k: (std * jax.random.normal(k, leaf.shape)).astype(leaf.dtype),
      out_shardings=sharding,
    )(head_key)
    params = jax.tree_util.tree_map_with_path(
      lambda p, x: head if p == key_path else x, params, is_leaf=lambda x: x is None
    )

  ignorable = {'lm_head.weight'} if (config.tie_embeddings or not lm_head) else set()
  extra = sorted(
    n for n in tensors if n not in used and n not in ignorable and not n.endswith(_IGNORED_SUFFIXES)
  )
  if extra:
    raise ValueError(
      f'{path}: {len(extra)} tensors are not used by a {config.family} model of this '
      f'config: {extra[:5]}{" ..." if len(extra) > 5 else ""}.'
    )
  return Checkpoint(config, graphdef, params, hf_config)


def save(path, config, params, *, hf_config=None, source_dir=None, max_shard_bytes=4 * 2**30):
  """Writes `params` as a Hugging Face checkpoint directory.

  Args:
    path: output directory (created).
    config: the ModelConfig.
    params: the parameter pytree (any sharding; gathered tensor by tensor).
    hf_config: the config.json dict read at load time, kept as is apart from
      the fields jrl owns; None writes a fresh one.
    source_dir: copy tokenizer and generation files from this directory.
    max_shard_bytes: split into `model-0000i-of-0000n.safetensors` with an
      index above this size.

  On several processes every one must call `save` (tensors are gathered
  collectively); process 0 writes the files.
  """
  if jax.process_index() != 0:
    for leaf in jax.tree.leaves(params):
      distributed.fetch(leaf)
    return
  os.makedirs(path, exist_ok=True)
  # Weights of an earlier save in this directory would shadow the new ones.
  for stale in glob.glob(os.path.join(path, '*.safetensors')) + [os.path.join(path, _INDEX)]:
    if os.path.exists(stale):
      os.remove(stale)
  out_config = config.to_hf(hf_config)
  if 'score' in params and not any(
    'SequenceClassification' in a for a in out_config.get('architectures', [])
  ):
    family_arch = FAMILIES[config.family][1] + ('Text' if config.family == 'gemma3' else '')
    out_config['architectures'] = [f'{family_arch}ForSequenceClassification']
    out_config['num_labels'] = 1

  shards, current, size = [], {}, 0
  for name, param, transposed in _host_params(config, params):
    # One parameter at a time on the host (a stacked one as its E tensors).
    for tname, host in _host_tensors(name, param, transposed):
      if current and size + host.nbytes > max_shard_bytes:
        shards.append(current)
        current, size = {}, 0
      current[tname] = host
      size += host.nbytes
  shards.append(current)

  metadata = {'format': 'pt'}
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, 'model.safetensors'), metadata)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
      save_file(shard, os.path.join(path, fname), metadata)
      weight_map.update(dict.fromkeys(shard, fname))
    total = sum(a.nbytes for s in shards for a in s.values())
    with open(os.path.join(path, _INDEX), 'w', encoding='utf-8') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  with open(os.path.join(path, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(out_config, f, indent=2, sort_keys=True)
  if source_dir is not None:
    for fname in _COPIED_FILES:
      src = os.path.join(source_dir, fname)
      if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(os.path.join(path, fname)):
        shutil.copyfile(src, os.path.join(path, fname))


def _host_params(config, params):
  """Yields (HF name, host array in jrl layout, transposed) one parameter at a
  time, LoRA adapters folded into their kernels."""
  from jrl.models import lora

  adapters = {}
  for key_path, leaf in jax.tree_util.tree_leaves_with_path(params):
    keys = parallel.path_keys(key_path)
    if lora.is_adapter(keys):
      adapters.setdefault(keys[:-1], {})[keys[-1]] = leaf
  if adapters and (config is None or config.lora is None):
    raise ValueError('params hold LoRA adapters: pass the config whose `lora` made them.')
  for key_path, leaf in jax.tree_util.tree_leaves_with_path(params):
    keys = parallel.path_keys(key_path)
    if lora.is_adapter(keys):
      continue
    name, transposed = hf_name(keys)
    host = distributed.fetch(leaf)
    pair = adapters.get(keys[:-1]) if keys[-1] == 'kernel' else None
    if pair is not None:
      a, b = distributed.fetch(pair['lora_a']), distributed.fetch(pair['lora_b'])
      host = lora.merge_host(host, a, b, config.lora.scale)
    yield name, host, transposed


def to_host(params, config=None):
  """{Hugging Face name: np.ndarray in HF layout}, for comparisons and export
  (LoRA adapters folded in; `config` is needed then)."""
  out = {}
  for name, host, transposed in _host_params(config, params):
    out.update(_host_tensors(name, host, transposed))
  return out


__all__ = ['Checkpoint', 'expert_names', 'hf_name', 'load', 'load_config', 'save', 'to_host']
