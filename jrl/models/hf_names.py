"""Hugging Face tensor names of jrl's parameter paths (pure; no I/O), shared
by the checkpoint reader and writer (`jrl.models.hf`) and the LoRA adapter
files (`jrl.models.lora`)."""

_EXPERT = '{e}'  # placeholder for the expert index in the names of stacked expert tensors


def hf_name(path):
  """Hugging Face tensor name and whether it is stored transposed, for a jrl path.

  For a stacked expert array [E, ...] the name holds `{e}` where the expert
  index goes (see `expert_names`), and `transposed` applies to each expert's
  slice.
  """
  if path == ('embed', 'embedding'):
    return 'model.embed_tokens.weight', False
  if path == ('final_norm', 'scale'):
    return 'model.norm.weight', False
  if path == ('lm_head', 'kernel'):
    return 'lm_head.weight', True
  if path == ('score', 'kernel'):
    return 'score.weight', True
  if path[0] == 'layers':
    i, rest = path[1], path[2:]
    prefix = f'model.layers.{i}.'
    if rest == ('attn_norm', 'scale'):
      return prefix + 'input_layernorm.weight', False
    if rest == ('mlp_norm', 'scale'):
      return prefix + 'post_attention_layernorm.weight', False
    norms = {
      'post_attn_norm': 'post_attention_layernorm',
      'pre_mlp_norm': 'pre_feedforward_layernorm',
      'post_mlp_norm': 'post_feedforward_layernorm',
    }
    if len(rest) == 2 and rest[0] in norms and rest[1] == 'scale':
      return f'{prefix}{norms[rest[0]]}.weight', False
    if rest == ('moe', 'router', 'kernel'):
      return prefix + 'mlp.gate.weight', True
    if len(rest) == 2 and rest[0] == 'moe' and rest[1] in ('gate', 'up', 'down'):
      return f'{prefix}mlp.experts.{_EXPERT}.{rest[1]}_proj.weight', True
    if rest[0] == 'attn' and rest[1] in ('q', 'k', 'v', 'o'):
      kind = 'weight' if rest[2] == 'kernel' else 'bias'
      return f'{prefix}self_attn.{rest[1]}_proj.{kind}', kind == 'weight'
    if rest[0] == 'attn' and rest[1] in ('q_norm', 'k_norm'):
      return f'{prefix}self_attn.{rest[1]}.weight', False
    if rest[0] == 'mlp':
      return f'{prefix}mlp.{rest[1]}_proj.weight', True
  raise ValueError(f'no Hugging Face name for parameter {"/".join(map(str, path))}.')


def expert_names(name, num_experts):
  """The per-expert tensor names of a stacked name (just [name] otherwise)."""
  if _EXPERT not in name:
    return [name]
  return [name.replace(_EXPERT, str(e)) for e in range(num_experts)]
