"""Logical axes of every parameter of `jrl.models.transformer`, for the
mesh rules of `jrl.parallel` (how each weight shards over data / fsdp /
expert / tensor)."""

_LOGICAL_AXES = {
  ('embed', 'embedding'): ('vocab', 'embed'),
  ('attn', 'q', 'kernel'): ('embed', 'q_heads'),
  ('attn', 'k', 'kernel'): ('embed', 'kv_heads'),
  ('attn', 'v', 'kernel'): ('embed', 'kv_heads'),
  ('attn', 'o', 'kernel'): ('q_heads', 'embed'),
  ('attn', 'q', 'bias'): ('q_heads',),
  ('attn', 'k', 'bias'): ('kv_heads',),
  ('attn', 'v', 'bias'): ('kv_heads',),
  ('attn', 'q_norm', 'scale'): ('norm',),
  ('attn', 'k_norm', 'scale'): ('norm',),
  ('attn_norm', 'scale'): ('norm',),
  ('mlp_norm', 'scale'): ('norm',),
  ('post_attn_norm', 'scale'): ('norm',),
  ('pre_mlp_norm', 'scale'): ('norm',),
  ('post_mlp_norm', 'scale'): ('norm',),
  ('mlp', 'gate', 'kernel'): ('embed', 'mlp'),
  ('mlp', 'up', 'kernel'): ('embed', 'mlp'),
  ('mlp', 'down', 'kernel'): ('mlp', 'embed'),
  ('moe', 'router', 'kernel'): ('embed', 'router'),
  ('moe', 'gate'): ('expert', 'embed', 'expert_mlp'),
  ('moe', 'up'): ('expert', 'embed', 'expert_mlp'),
  ('moe', 'down'): ('expert', 'expert_mlp', 'embed'),
  ('final_norm', 'scale'): ('norm',),
  ('lm_head', 'kernel'): ('embed', 'vocab'),
  # LoRA adapters: A [in, r] and B [r, out] split like the kernel's in and
  # out dimensions; the rank r is replicated.
  ('attn', 'q', 'lora_a'): ('embed', None),
  ('attn', 'q', 'lora_b'): (None, 'q_heads'),
  ('attn', 'k', 'lora_a'): ('embed', None),
  ('attn', 'k', 'lora_b'): (None, 'kv_heads'),
  ('attn', 'v', 'lora_a'): ('embed', None),
  ('attn', 'v', 'lora_b'): (None, 'kv_heads'),
  ('attn', 'o', 'lora_a'): ('q_heads', None),
  ('attn', 'o', 'lora_b'): (None, 'embed'),
  ('mlp', 'gate', 'lora_a'): ('embed', None),
  ('mlp', 'gate', 'lora_b'): (None, 'mlp'),
  ('mlp', 'up', 'lora_a'): ('embed', None),
  ('mlp', 'up', 'lora_b'): (None, 'mlp'),
  ('mlp', 'down', 'lora_a'): ('mlp', None),
  ('mlp', 'down', 'lora_b'): (None, 'embed'),
  ('score', 'kernel'): ('embed', 'head_out'),
}


def param_logical_axes(path):
  """Logical axis names of the parameter at `path` (e.g. ('layers', 0, 'attn', 'q', 'kernel')).

  Raises:
    ValueError for a path the table does not know (every parameter must have
    a rule).
  """
  key = tuple(k for k in path if not isinstance(k, int))
  if key and key[0] == 'layers':
    key = key[1:]
  if key not in _LOGICAL_AXES:
    raise ValueError(f'no logical axes for parameter {"/".join(map(str, path))}.')
  return _LOGICAL_AXES[key]


def head_units(config):
  """Head dimensions are flattened (H·d); shard them only in whole heads."""
  return {'q_heads': config.head_dim, 'kv_heads': config.head_dim}
