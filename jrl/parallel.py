"""Meshes, logical-axis rules and parameter shardings.

jrl runs on a `jax.sharding.Mesh` with four named axes:

* `data`: pure data parallelism (parameters replicated);
* `fsdp`: data parallelism with parameters (and optimiser state) sharded
  along their `embed` dimension (ZeRO-3 style; XLA gathers them per layer);
* `expert`: expert parallelism: the stacked expert weights of MoE layers
  [E, D, F] are split along E (size 1 unless asked for; other parameters
  and the batch are replicated over it, so each device runs its experts on
  the tokens and XLA sums the expert outputs over the axis);
* `tensor`: tensor (model) parallelism over heads, MLP width (an expert's
  too) and vocabulary.

Every parameter carries logical axis names (`('embed', 'mlp')`, ...; the
model defines them), and `RULES` maps logical names to mesh axes. A
dimension that the mesh axis does not divide is replicated instead, so any
mesh shape works with any model (at some cost in memory).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'expert', 'tensor')
BATCH_AXES = ('data', 'fsdp')  # the batch dimension is split over both

# logical axis -> mesh axis (None: replicated).
RULES = {
  'vocab': 'tensor',
  'embed': 'fsdp',
  'q_heads': 'tensor',
  'kv_heads': 'tensor',
  'mlp': 'tensor',
  'norm': None,
  'head_out': None,
  'router': None,  # [D, E] router kernel: small, replicated
  'expert': 'expert',  # E of the stacked expert weights
  'expert_mlp': 'tensor',  # F of one expert
}


def make_mesh(data=-1, fsdp=1, tensor=1, devices=None, *, expert=1):
  """A (data, fsdp, expert, tensor) mesh; one size may be -1 to take the
  remaining devices.

  Args:
    data, fsdp, tensor, expert: axis sizes; their product must equal the
      device count.
    devices: devices to use (default: all of `jax.devices()`).

  Returns:
    jax.sharding.Mesh with axis names MESH_AXES (auto sharding mode).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {'data': data, 'fsdp': fsdp, 'expert': expert, 'tensor': tensor}
  for name, size in sizes.items():
    if not isinstance(size, int) or size == 0 or size < -1:
      raise ValueError(f'mesh axis `{name}` must be a positive int or -1, got {size!r}.')
  free = [name for name, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ValueError(f'at most one mesh axis may be -1, got {free}.')
  known = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if len(devices) % known:
      raise ValueError(
        f'{len(devices)} devices cannot be split into mesh axes {sizes} '
        f'(the fixed axes multiply to {known}).'
      )
    sizes[free[0]] = len(devices) // known
  if math.prod(sizes.values()) != len(devices):
    raise ValueError(
      f'mesh axes {sizes} multiply to {math.prod(sizes.values())}, '
      f'but there are {len(devices)} devices.'
    )
  shape = tuple(sizes[name] for name in MESH_AXES)
  grid = np.asarray(devices, dtype=object).reshape(shape)
  return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def spec_for(shape, logical_axes, mesh, rules=None, units=None):
  """PartitionSpec for one array from its logical axes.

  A dimension is sharded over the rule's mesh axis only if that axis has size
  > 1, is not already used by another dimension, and splits the dimension
  into whole units (`units[name]`, e.g. a head's width for flattened head
  dimensions; 1 by default).
  """
  rules = RULES if rules is None else rules
  units = units or {}
  if len(logical_axes) != len(shape):
    raise ValueError(f'logical axes {logical_axes} do not match shape {shape}.')
  used, spec = set(), []
  for dim, name in zip(shape, logical_axes, strict=True):
    if name is not None and name not in rules:
      raise ValueError(f'no sharding rule for logical axis `{name}`; rules: {sorted(rules)}.')
    axis = None if name is None else rules[name]
    size = mesh.shape[axis] if axis is not None else 1
    if axis is None or size == 1 or dim % (size * units.get(name, 1)) or axis in used:
      spec.append(None)
    else:
      spec.append(axis)
      used.add(axis)
  return P(*spec)


# The decode layout: weights whole on every batch shard (data and fsdp), still
# split over tensor and expert, so a decode step reads its weights locally
# instead of all-gathering every fsdp-sharded matrix on every step.
DECODE_RULES = {**RULES, 'embed': None}


def decode_shardings(mesh, params, logical_axes_fn, units=None):
  """`param_shardings` with `DECODE_RULES`: the layout a sampler reads best."""
  return param_shardings(mesh, params, logical_axes_fn, DECODE_RULES, units)


def bytes_per_device(params, shardings):
  """Bytes one device holds of `params` laid out with `shardings` (the
  largest, where a dimension does not split evenly)."""
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
    shape = sharding.shard_shape(leaf.shape)
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total


# Collective ops of compiled HLO, and the shape of what each moves.
_COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')
_HLO_SHAPE = re.compile(r'\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]')
_HLO_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'bf16': 2, 'f16': 2}


def collectives(hlo_text):
  """{op: (count, bytes)} of the collectives in an HLO module's text
  (`compiled.as_text()`), per device: each all-gather / all-reduce /
  reduce-scatter / all-to-all / collective-permute and the bytes of its
  output (an async `-start` op's last tuple element). An op inside a loop
  body counts once per appearance, not per trip."""
  found = {}
  for line in hlo_text.splitlines():
    if '=' not in line:
      continue
    for op in _COLLECTIVES:
      marker = next((m for m in (f' {op}(', f' {op}-start(') if m in line), None)
      if marker is None:
        continue
      shapes = _HLO_SHAPE.findall(line.split('=', 1)[1].split(marker)[0])
      if shapes:
        dtype, dims = shapes[-1]
        n = math.prod(int(d) for d in dims.split(',') if d)
        size = n * _HLO_BYTES.get(dtype, 8 if '64' in dtype else 4)
        count, total = found.get(op, (0, 0))
        found[op] = (count + 1, total + size)
  return found


def param_shardings(mesh, params, logical_axes_fn, rules=None, units=None):
  """A NamedSharding for every leaf of `params` (arrays or ShapeDtypeStructs).

  Args:
    mesh: the mesh.
    params: a pytree (e.g. an nnx.State) of arrays or ShapeDtypeStructs.
    logical_axes_fn: path tuple -> logical axes (the model's table).
    rules: logical -> mesh axis mapping (default RULES).
    units: logical name -> size of the smallest piece a shard may hold.

  Returns:
    A pytree of NamedSharding with the structure of `params`.
  """

  def one(path, leaf):
    keys = path_keys(path)
    spec = spec_for(leaf.shape, logical_axes_fn(keys), mesh, rules, units)
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, params)


def path_keys(path):
  """A jax key path as a tuple of plain str / int keys (no `.value` suffix)."""
  keys = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      keys.append(k.key)
    elif isinstance(k, jax.tree_util.SequenceKey):
      keys.append(k.idx)
    elif isinstance(k, jax.tree_util.GetAttrKey):
      if k.name != 'value':
        keys.append(k.name)
    else:
      keys.append(str(k))
  return tuple(keys)


def batch_sharding(mesh, ndim=2):
  """Batch-major arrays: first dimension split over (data, fsdp)."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh):
  return NamedSharding(mesh, P())


class on_mesh:
  """`fn` called under `jax.set_mesh(mesh)`, so the code it traces knows its
  mesh (`jax.sharding.get_abstract_mesh()`): attention then runs kernels that
  `jax.jit` does not partition (TPU splash attention) once per shard. Only
  the calls are scoped: other threads and meshes (a rollout mesh of its own)
  are not affected. The context is part of jit's cache key, so the same
  jitted function called with and without it compiles twice. Attributes of
  `fn` (`_cache_size`, ...) read through; `lower` lowers under the mesh."""

  def __init__(self, mesh, fn):
    self.mesh, self.fn = mesh, fn

  def __call__(self, *args, **kwargs):
    with jax.set_mesh(self.mesh):
      return self.fn(*args, **kwargs)

  def lower(self, *args, **kwargs):
    with jax.set_mesh(self.mesh):
      return self.fn.lower(*args, **kwargs)

  def __getattr__(self, name):
    if name in ('mesh', 'fn'):  # not set yet (a copy being built): no recursion
      raise AttributeError(name)
    return getattr(self.fn, name)
