"""LoRA: low-rank adapters on the projections of jrl's transformer.

With `ModelConfig.lora = LoraConfig(rank=r, alpha=α, targets=(...))` every
targeted projection y = x W of every layer computes

    y = x W + (α / r) · (x A) B,    A [in, r] ~ N(0, 1/in),  B [r, out] = 0

(Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), so
a fresh adapter leaves the model exactly as it was. The adapters are leaves
of the same parameter tree, `lora_a` and `lora_b` next to the `kernel` they
adapt (type `nnx.LoRAParam`), so every function of `(graphdef, params)`
(training forward, sampler, reference logprobs) runs them unmerged, without
a second copy of the base weights.

    config, graphdef, params = lora.attach(graphdef, base_params, LoraConfig(16, 32.0), key)
    adapters, base = lora.split(params)        # train `adapters`, keep `base` frozen
    params = lora.join(adapters, base)         # the tree the model functions take
    merged = lora.merge(config, params)        # base layout: W + (α / r) A B
    lora.save_adapters(path, config, params)   # PEFT's adapter_model.safetensors + config
    config, graphdef, params = lora.load_adapters(path, graphdef, base_params)

Training with a frozen base: take gradients with respect to `adapters` only
(`jax.grad(loss)(adapters, base, ...)` with `loss` calling `join`), and give
the optimiser `adapters` only, so that gradients and optimiser state hold
adapter-sized arrays. `trainable_mask` labels the full tree instead, for
`optax.multi_transform` (gradients are then computed for the base too and
thrown away, which costs memory during the step but none in the state).

Conventions as PEFT's `LoraConfig` (r, lora_alpha, target_modules): scale
α / r (not rsLoRA's α / √r), no bias adapters, no dropout. PEFT initialises
A with Kaiming-uniform (std 1 / √(3·in)); jrl draws A from N(0, 1 / in), a
√3 larger start with the same zero product.

Why not qwix (Google's library, used by Tunix): it adds adapters by
intercepting `dot_general` inside an already-built model, which needs a
forward pass to create the parameters and rebuilds the model class on every
call, so two LoRA models of one config have unequal graphdefs (a jit cache
miss for every rebuild, and `abstract` / `hf.load` would not agree with
`create`). jrl owns its projection layer, so the adapters are ten lines in
`Dense`, created with the model and named in the logical-axis table.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl import distributed, parallel
from jrl.models import hf_names, logical_axes, transformer
from jrl.models.config import LORA_TARGETS, LoraConfig

ADAPTER_KEYS = ('lora_a', 'lora_b')
ADAPTER_WEIGHTS = 'adapter_model.safetensors'
ADAPTER_CONFIG = 'adapter_config.json'
_PEFT_PREFIX = 'base_model.model.'  # PEFT's wrapper around the transformers model


def is_adapter(path):
  """Whether the parameter at `path` (a jax key path or a tuple of keys) is an adapter."""
  keys = parallel.path_keys(path) if path and not isinstance(path[0], str | int) else path
  return bool(keys) and keys[-1] in ADAPTER_KEYS


def _is_adapter_filter(path, _):
  return is_adapter(path)


def split(params):
  """(adapters, base): two disjoint nnx.States of the same arrays (no copies)."""
  return nnx.split_state(params, _is_adapter_filter, ...)


def join(adapters, base):
  """The full parameter tree from `split`'s halves (no copies)."""
  return nnx.merge_state(base, adapters)


def trainable_mask(params):
  """A tree like `params` with True on adapters and False on the base, for
  `optax.masked` or `optax.multi_transform` (labels: `jax.tree.map(lambda t:
  'train' if t else 'freeze', mask)`)."""
  return jax.tree_util.tree_map_with_path(lambda p, _: is_adapter(p), params)


def num_bytes(tree):
  """Bytes of the arrays (or ShapeDtypeStructs) of a pytree."""
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _model_of(graphdef, params):
  """The Transformer of (graphdef, params) (a view: no copies)."""
  return nnx.merge(graphdef, params)


def _adapter_pairs(adapters):
  """{kernel path less 'kernel', e.g. ('layers', 0, 'attn', 'q'): {'lora_a': A, 'lora_b': B}}."""
  out = {}
  for key_path, leaf in jax.tree_util.tree_leaves_with_path(adapters):
    keys = parallel.path_keys(key_path)
    out.setdefault(keys[:-1], {})[keys[-1]] = leaf
  return out


def attach(graphdef, base_params, lora_config, key, *, mesh=None, rules=None):
  """Adds fresh adapters (A random, B zero) to a base model.

  Args:
    graphdef, base_params: a model without adapters (`create`, `hf.load`).
    lora_config: the LoraConfig.
    key: PRNG key of the A matrices (the same values `create(config, key)`
      gives a model whose config has this `lora`).
    mesh, rules: lay the adapters out on `mesh` by the logical-axis rules
      (None: the default device).

  Returns:
    (config, graphdef, params): the config with `lora` set, its graphdef, and
    the base arrays joined with the adapters (the base is not copied).
  """
  model = _model_of(graphdef, base_params)
  if model.config.lora is not None:
    raise ValueError('attach: the model already has adapters (config.lora is set).')
  config = model.config.replace(lora=lora_config)
  heads = {'lm_head': model.has_lm_head, 'scalar_head': model.score is not None}
  new_graphdef, abstract_params = transformer.abstract(config, **heads)
  abstract_adapters, abstract_base = split(abstract_params)
  _check_same_tree(abstract_base, base_params)
  out_shardings = None
  if mesh is not None:
    out_shardings = parallel.param_shardings(
      mesh,
      abstract_adapters,
      logical_axes.param_logical_axes,
      rules,
      logical_axes.head_units(config),
    )

  def init(k):
    # Builds the whole model and keeps the adapters: XLA drops the rest.
    return split(transformer.create(config, k, **heads)[1])[0]

  adapters = jax.jit(init, out_shardings=out_shardings)(key)
  return config, new_graphdef, join(adapters, base_params)


def _check_same_tree(expected, got):
  want = {parallel.path_keys(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(expected)}
  have = {parallel.path_keys(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(got)}
  if want != have:
    missing = sorted(map(str, set(want) - set(have)))[:3]
    extra = sorted(map(str, set(have) - set(want)))[:3]
    shapes = [str(k) for k in set(want) & set(have) if want[k] != have[k]][:3]
    raise ValueError(
      f'base parameters do not match the model: missing {missing}, unexpected {extra}, '
      f'shapes differ at {shapes}.'
    )


def merge(config, params):
  """Base-layout parameters with every adapter folded in: W + (α / r) A B.

  Computed in float32 and stored in W's dtype. Only the targeted kernels
  are new arrays; every other leaf is the very array of `params`. Run the
  result with the graphdef of the model without adapters:
  `models.abstract(config.replace(lora=None))[0]` (or the graphdef that
  `attach` was given).
  """
  if config.lora is None:
    raise ValueError('merge: config.lora is None (the model has no adapters).')
  adapters, base = split(params)
  pairs = _adapter_pairs(adapters)
  scale = config.lora.scale

  def fold(key_path, w):
    keys = parallel.path_keys(key_path)
    if keys[-1] != 'kernel' or keys[:-1] not in pairs:
      return w
    pair = pairs[keys[:-1]]
    a, b = pair['lora_a'].astype(jnp.float32), pair['lora_b'].astype(jnp.float32)
    delta = jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)

  return jax.tree_util.tree_map_with_path(fold, base)


def merge_host(kernel, lora_a, lora_b, scale):
  """`merge` for one kernel on the host (NumPy, float32 math, W's dtype)."""
  delta = np.asarray(lora_a, np.float32) @ np.asarray(lora_b, np.float32)
  return (np.asarray(kernel, np.float32) + np.float32(scale) * delta).astype(kernel.dtype)


# PEFT files --------------------------------------------------------------------


def _peft_module(kernel_path):
  """PEFT's module name of a jrl kernel path (e.g. 'model.layers.0.self_attn.q_proj')."""
  name, _ = hf_names.hf_name(tuple(kernel_path) + ('kernel',))
  return name.removesuffix('.weight')


def save_adapters(path, config, params, *, base_model_name_or_path=None):
  """Writes the adapters as a PEFT LoRA directory: `adapter_model.safetensors`
  (lora_A [r, in], lora_B [out, r] per target module, PEFT names) and
  `adapter_config.json`, which `peft.PeftModel.from_pretrained` loads onto
  the transformers model that `jrl.models.hf.save` writes for the base.

  On several processes every one must call it; process 0 writes.
  """
  if config.lora is None:
    raise ValueError('save_adapters: config.lora is None (the model has no adapters).')
  adapters, _ = split(params)
  pairs = _adapter_pairs(adapters)
  if jax.process_index() != 0:
    distributed.fetch(adapters)
    return
  from jrl.models.safetensors_io import save_file

  tensors = {}
  for kernel_path, pair in sorted(pairs.items(), key=lambda kv: str(kv[0])):
    module = _PEFT_PREFIX + _peft_module(kernel_path)
    a, b = distributed.fetch(pair['lora_a']), distributed.fetch(pair['lora_b'])
    tensors[f'{module}.lora_A.weight'] = np.ascontiguousarray(a.T)
    tensors[f'{module}.lora_B.weight'] = np.ascontiguousarray(b.T)
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), {'format': 'pt'})
  lc = config.lora
  peft_config = {
    'peft_type': 'LORA',
    'task_type': 'CAUSAL_LM',
    'base_model_name_or_path': base_model_name_or_path,
    'r': lc.rank,
    'lora_alpha': lc.alpha,
    'lora_dropout': lc.dropout,
    'target_modules': list(lc.targets),
    'bias': 'none',
    'fan_in_fan_out': False,
    'use_rslora': False,
    'use_dora': False,
    'init_lora_weights': True,
    'inference_mode': True,
    'modules_to_save': None,
    'layers_to_transform': None,
    'rank_pattern': {},
    'alpha_pattern': {},
  }
  with open(os.path.join(path, ADAPTER_CONFIG), 'w', encoding='utf-8') as f:
    json.dump(peft_config, f, indent=2, sort_keys=True)


def read_adapter_config(path):
  """The LoraConfig of a PEFT adapter directory; refuses what jrl cannot run
  exactly (rsLoRA, DoRA, bias adapters, per-layer ranks, ...), naming the field.

  `lora_dropout` is read as 0 (dropout only matters in training).
  """
  cfg_path = os.path.join(path, ADAPTER_CONFIG)
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f'{cfg_path}: file not found.')
  with open(cfg_path, encoding='utf-8') as f:
    pc = json.load(f)
  if pc.get('peft_type', 'LORA') != 'LORA':
    raise ValueError(f'{cfg_path}: `peft_type`={pc.get("peft_type")!r}, expected "LORA".')
  # PEFT options jrl does not run: each must be absent or off.
  for field in (
    'use_rslora',
    'use_dora',
    'fan_in_fan_out',
    'modules_to_save',
    'layers_to_transform',
    'rank_pattern',
    'alpha_pattern',
  ):
    if pc.get(field) not in (None, False, {}, []):
      raise ValueError(f'{cfg_path}: `{field}`={pc[field]!r} is not supported.')
  if pc.get('bias', 'none') != 'none':
    raise ValueError(f'{cfg_path}: `bias`={pc["bias"]!r} is not supported (only "none").')
  targets = pc.get('target_modules')
  if isinstance(targets, str) or not targets:
    raise ValueError(
      f'{cfg_path}: `target_modules`={targets!r} must list module names from {list(LORA_TARGETS)}.'
    )
  try:
    return LoraConfig(rank=int(pc['r']), alpha=float(pc['lora_alpha']), targets=tuple(targets))
  except KeyError as e:
    raise ValueError(f'{cfg_path}: missing field `{e.args[0]}`.') from None
  except ValueError as e:
    raise ValueError(f'{cfg_path}: {e}') from None


def load_adapters(path, graphdef, base_params, *, mesh=None, rules=None):
  """Reads a PEFT LoRA directory onto a base model (the inverse of `save_adapters`).

  Returns:
    (config, graphdef, params) as `attach` does, with the file's adapters.

  Raises:
    ValueError naming the file and tensor for a missing, extra or misshapen tensor.
  """
  from jrl.models.safetensors_io import SafetensorsFile

  lora_config = read_adapter_config(path)
  config, graphdef, params = attach(
    graphdef, base_params, lora_config, jax.random.key(0), mesh=mesh, rules=rules
  )
  wpath = os.path.join(path, ADAPTER_WEIGHTS)
  if not os.path.exists(wpath):
    raise FileNotFoundError(f'{wpath}: file not found.')
  f = SafetensorsFile(wpath)
  used = set()

  def read(key_path, leaf):
    keys = parallel.path_keys(key_path)
    if keys[-1] not in ADAPTER_KEYS:
      return leaf
    which = 'lora_A' if keys[-1] == 'lora_a' else 'lora_B'
    name = f'{_PEFT_PREFIX}{_peft_module(keys[:-1])}.{which}.weight'
    if name not in f:
      raise ValueError(f'{wpath}: tensor `{name}` is missing.')
    if tuple(f.shape(name)) != tuple(leaf.shape[::-1]):
      raise ValueError(
        f'{wpath}: tensor `{name}` has shape {list(f.shape(name))}, expected '
        f'{list(leaf.shape[::-1])} from {ADAPTER_CONFIG}.'
      )
    used.add(name)
    host = np.asarray(f.read(name)).T.astype(leaf.dtype)
    if not np.isfinite(host).all():
      raise ValueError(f'{wpath}: tensor `{name}` contains NaN or Inf.')
    return jax.device_put(host, leaf.sharding)

  params = jax.tree_util.tree_map_with_path(read, params)
  extra = sorted(set(f.keys()) - used)
  if extra:
    raise ValueError(f'{wpath}: {len(extra)} tensors are not adapters of this model: {extra[:3]}.')
  return config, graphdef, params


__all__ = [
  'ADAPTER_CONFIG',
  'ADAPTER_WEIGHTS',
  'LoraConfig',
  'attach',
  'is_adapter',
  'join',
  'load_adapters',
  'merge',
  'merge_host',
  'num_bytes',
  'read_adapter_config',
  'save_adapters',
  'split',
  'trainable_mask',
]
