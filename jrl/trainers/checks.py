"""Checks run at set-up, before anything is compiled: every config section
against its ranges and between its fields, and every example against the
tokenizer and the length limits of the config.

Each config section is checked next to the code that reads it: the module
declares a `Section` (its numeric fields with their ranges, `FIELDS`-style,
and a function for the checks between fields and against the devices), and
each algorithm lists the sections it reads (`grpo.SECTIONS`, ...).
`validate(config, batch_shards, sections)` checks the sections every
algorithm has (`SHARED`: the run's fields, mesh, model, task, train, optim,
eval, checkpoint, log), then the algorithm's. A value out of range,
non-finite or of the wrong type raises ValueError naming the field:

    `sft.batch_size` must be >= 1, got 0.

`ExampleChecker` encodes examples once when they are read, so that a
character the tokenizer cannot encode or a prompt longer than
`task.max_prompt_len` fails at set-up with the file and line (or the index
of a generated example), not when the stream first draws the row mid-run.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax

from jrl import xla_options
from jrl.models.config import ATTENTION_IMPLS, LORA_TARGETS, REMAT_POLICIES


class Range(NamedTuple):
  """A numeric field's constraint: an int or a float in [lo, hi] (or open bounds)."""

  integer: bool
  lo: float | None = None
  hi: float | None = None
  lo_open: bool = False  # lo < value instead of lo <= value
  hi_open: bool = False
  also: tuple = ()  # special values allowed outside the range (e.g. -1: auto)

  def describe(self):
    parts = []
    if self.lo is not None:
      parts.append(f'{">" if self.lo_open else ">="} {self.lo}')
    if self.hi is not None:
      parts.append(f'{"<" if self.hi_open else "<="} {self.hi}')
    text = ' and '.join(parts) if parts else 'finite'
    if self.also:
      text += ', or ' + ' or '.join(str(a) for a in self.also)
    return text

  def contains(self, value):
    if value in self.also:
      return True
    if not math.isfinite(value):
      return False
    if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
      return False
    return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)


def count(lo=0, **kw):
  """An int >= lo (steps, sizes, counts)."""
  return Range(True, lo, **kw)


def positive(optional=False):
  """A float > 0 (learning rates, temperatures, timeouts); `optional`: or
  None (a clamp or bound that is off)."""
  return Range(False, 0, lo_open=True, also=(None,) if optional else ())


def non_negative(optional=False):
  """A float >= 0 (coefficients and clamps where 0 means off); `optional`: or None."""
  return Range(False, 0, also=(None,) if optional else ())


def fraction(lo_open=False, hi_open=False):
  """A float in [0, 1] (probabilities, discounts, shares)."""
  return Range(False, 0, 1, lo_open=lo_open, hi_open=hi_open)


# The numeric fields of the sections every algorithm has (configs/common.py
# `SHARED` and the run's own fields). `tests/test_validation.py` checks that no
# numeric field of a config in configs/ is without a range (here or in the
# `Section` of the module that reads it).
FIELDS = {
  'seed': count(0),
  'max_nonfinite_steps': count(1),
  # mesh: -1 takes the devices left over.
  'mesh.data': count(1, also=(-1,)),
  'mesh.fsdp': count(1, also=(-1,)),
  'mesh.tensor': count(1, also=(-1,)),
  'model.width': count(1),
  'model.mlp_width': count(1),
  'model.num_layers': count(1),
  'model.num_heads': count(1),
  'model.num_kv_heads': count(1),
  'model.head_dim': count(1),
  'model.init_std': positive(),
  'model.lora.rank': count(0),  # 0: off
  'model.lora.alpha': positive(),
  'task.digits': count(1, hi=9),
  'task.carry_slip': fraction(),
  'task.rounding_slip': fraction(),
  'task.train_seed': count(0),
  'task.eval_seed': count(0),
  'task.eval_size': count(0),
  'task.max_prompt_len': count(1),
  'task.max_response_len': count(1),
  # reasoning-gym (jrl/data/reasoning_gym.py); `settings.<dataset>.<field>` are the
  # dataset's own fields, checked by its config class when the task is built
  'task.reasoning_gym.size': count(1),
  'task.reasoning_gym.threshold': Range(False, 0, 1, lo_open=True, also=(None,)),
  'task.reasoning_gym.curriculum.raise_at': Range(False, 0, 1, also=(None,)),
  'task.reasoning_gym.curriculum.lower_at': Range(False, 0, 1, also=(None,)),
  'task.reasoning_gym.curriculum.window': count(1),
  'task.reasoning_gym.curriculum.start_level': count(0),
  'train.chunk_size': count(1),
  'train.pack_row_len': count(0),  # 0: max_prompt_len + max_response_len
  'train.micro_batch_tokens': count(0),  # 0: no token-budget micro-batches
  'train.memory_limit_gib': non_negative(),  # 0: a device's free memory
  'optim.lr': positive(),
  'optim.warmup_steps': count(0),
  'optim.decay_steps': count(0),
  'optim.end_lr_ratio': fraction(),
  'optim.weight_decay': non_negative(),
  'optim.b1': fraction(lo_open=True, hi_open=True),
  'optim.b2': fraction(lo_open=True, hi_open=True),
  'optim.eps': positive(),
  'optim.clip_norm': non_negative(),
  'optim.grad_accum': count(1),
  'eval.every': count(0),
  'eval.samples': count(0),
  'eval.temperature': positive(),
  'checkpoint.every': count(1),
  'checkpoint.keep': count(1),
  'log.every': count(1),
  'log.samples_every': count(0),
}
SHARED = ('mesh', 'model', 'task', 'train', 'optim', 'eval', 'checkpoint', 'log')


class Section(NamedTuple):
  """A config section as the module that reads it checks it."""

  name: str  # the section's key in the config ('rl', 'sampler', ...)
  fields: dict  # dotted field -> Range, its numeric fields
  check: Callable | None = None  # (config, batch_shards) -> None; raises ValueError
  # () -> an ml_collections.ConfigDict of the section's fields at their defaults;
  # None: `configs.common.<name>_section` (the sections jrl's own algorithms share).
  defaults: Callable | None = None


class Algorithm(NamedTuple):
  """One algorithm as the rest of jrl reads it: the registry
  (`trainers.build` / `run`), the checks, `configs.common` (a config holds
  the shared sections and these) and the topologies. A new algorithm is a
  module that registers one (`register`) with its sections (their checks
  and defaults), and a config of it (docs/new_algorithm.md);
  trainers/__init__.py imports jrl's own."""

  name: str  # config.algorithm
  build: Callable  # config -> controller.Job, set up (every config error raised), not run
  sections: tuple  # the Sections it reads besides the shared ones; their names: its config's
  steps_section: str | None = None  # whose `steps` counts its iterations after `sft.steps`
  online: bool = False  # trains on its own rollouts: every `topology.kind` applies
  reads: Callable | None = None  # config -> the Sections a run of `config` reads (`sections`)
  # `jrl eval` (trainers.evaluation.standalone) scores its checkpoints on single-turn
  # tasks: the policy's greedy answers, as the held-out evaluation of a run does.
  standalone_eval: bool = False

  def sections_read(self, config):
    return self.reads(config) if self.reads else self.sections


REGISTRY = {}  # name -> Algorithm, each added as its module is imported


def register(algorithm):
  """Adds `algorithm` to the registry; returns it."""
  REGISTRY[algorithm.name] = algorithm
  return algorithm


def algorithm(config):
  """The registered Algorithm of `config.algorithm`; ValueError naming the field."""
  name = config.algorithm
  if name not in REGISTRY:
    raise ValueError(f'`algorithm` must be one of {tuple(REGISTRY)}, got {name!r}.')
  return REGISTRY[name]


def need(cond, field, msg):
  """Raises ValueError('`field`: msg') unless `cond`."""
  if not cond:
    raise ValueError(f'`{field}`: {msg}')


def iterations(config):
  """A run's iterations: `sft.steps` (a warm-up, or the whole of algorithm
  'sft') plus the algorithm's own steps (`rl.steps`, `dpo.steps`, `rm.steps`)."""
  record = REGISTRY.get(config.algorithm)
  own = record.steps_section if record else None
  warmup = config.sft.steps if 'sft' in config else 0
  return warmup + (config[own].steps if own and own in config else 0)


def lookup(config, field):
  """The value at a dotted path, or (False, None) if a section or field is absent."""
  node = config
  for part in field.split('.'):
    if part not in node:
      return False, None
    node = node[part]
  return True, node


def check_field(field, value, rule):
  """Raises ValueError naming `field` unless `value` satisfies `rule`."""
  if value is None and None in rule.also:
    return
  is_bool = isinstance(value, bool)
  if rule.integer and (is_bool or not isinstance(value, int)):
    raise ValueError(f'`{field}` must be an int, got {value!r} ({type(value).__name__}).')
  if is_bool or not isinstance(value, int | float):
    raise ValueError(f'`{field}` must be a number, got {value!r} ({type(value).__name__}).')
  if not rule.contains(value):
    raise ValueError(f'`{field}` must be {rule.describe()}, got {value!r}.')


def check_fields(config, fields=None):
  """Checks each field of `fields` (default `FIELDS`) that `config` has;
  raises ValueError naming the first bad one."""
  for field, rule in (FIELDS if fields is None else fields).items():
    present, value = lookup(config, field)
    if present:
      check_field(field, value, rule)


# Between fields --------------------------------------------------------------


def validate(config, batch_shards, sections=()):
  """Raises ValueError naming the field for anything inconsistent.

  The shared ranges (`FIELDS`) and the model's fields; then every section
  present (`SHARED` and the algorithm's `sections`); the checks between the
  shared fields; then each of the algorithm's sections (a `Section` each):
  its ranges, its checks.
  """
  check_fields(config)
  check_model(config.model, config.algorithm)
  for name in (*SHARED, *(s.name for s in sections)):
    need(
      name in config,
      name,
      f'algorithm {config.algorithm!r} reads this section; the config has none '
      f'(configs/common.py `base({config.algorithm!r})` has it).',
    )
  check_shared(config)
  for section in sections:
    check_fields(config, section.fields)
    if section.check is not None:
      section.check(config, batch_shards)


def check_shared(config):
  """The checks between fields of the shared sections."""
  steps, total = config.log.profile_steps, iterations(config)
  need(
    isinstance(steps, tuple | list)
    and all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= total for i in steps),
    'log.profile_steps',
    f"must be iterations between 1 and the run's {total}, got {steps!r}.",
  )
  task, train = config.task, config.train
  seq_len = task.max_prompt_len + task.max_response_len
  need(
    not train.pack_row_len or train.pack_row_len >= seq_len,
    'train.pack_row_len',
    f'must be 0 or at least max_prompt_len + max_response_len = {seq_len} (a row holds '
    'the longest sequence).',
  )
  row_len = (train.pack_row_len or seq_len) if train.packing else seq_len
  need(
    not train.micro_batch_tokens or train.micro_batch_tokens >= row_len,
    'train.micro_batch_tokens',
    f'must be 0 or at least one row, max_prompt_len + max_response_len = {row_len} tokens'
    + (' (train.pack_row_len with packing).' if train.packing else '.'),
  )
  need(
    not (train.packing and train.shared_prompt),
    'train.shared_prompt',
    'and train.packing are two layouts of the rows: turn one off.',
  )
  need(train.memory_plan in ('auto', 'off'), 'train.memory_plan', "must be 'auto' or 'off'.")
  xla_options.check(train.xla_flags)  # names `train.xla_flags` for an option XLA refuses


def batch_divides(size, field, batch_shards):
  """`field` (a row count) splits evenly over the mesh's batch shards."""
  need(
    size % batch_shards == 0,
    field,
    f'must be divisible by the mesh batch axes data x fsdp = {batch_shards}.',
  )


def no_micro_batches(config, batch_shards):
  """The pair losses (DPO, reward model) are not split into micro-batches."""
  del batch_shards
  need(
    not config.train.micro_batch_tokens,
    'train.micro_batch_tokens',
    f'token-budget micro-batches run grpo, ppo, agent and sft (with their SFT warm-up), '
    f'not {config.algorithm!r} (its pair losses are not split yet).',
  )


def check_model(model, algorithm):
  """The non-numeric training-memory fields of `model` (remat, scan_layers,
  lora); raises ValueError naming the field."""
  if model.remat not in ('auto', *REMAT_POLICIES):
    raise ValueError(
      f"`model.remat` must be 'auto' or one of {REMAT_POLICIES}, got {model.remat!r}."
    )
  if not isinstance(model.scan_layers, bool):
    raise ValueError(f'`model.scan_layers` must be True or False, got {model.scan_layers!r}.')
  if model.attention not in ATTENTION_IMPLS:
    raise ValueError(
      f'`model.attention` must be one of {ATTENTION_IMPLS}, got {model.attention!r}.'
    )
  if model.attention == 'cudnn' and jax.default_backend() not in ('gpu', 'cuda'):
    raise ValueError(
      f"`model.attention`: 'cudnn' needs a GPU, this run's backend is "
      f"{jax.default_backend()!r}; use 'auto' or 'xla'."
    )
  targets = model.lora.targets
  if isinstance(targets, str) or not isinstance(targets, tuple | list) or not targets:
    raise ValueError(
      f'`model.lora.targets` must be a non-empty tuple of names from {list(LORA_TARGETS)}, '
      f'got {targets!r}.'
    )
  unknown = [t for t in targets if t not in LORA_TARGETS]
  if unknown:
    raise ValueError(
      f'`model.lora.targets`: unknown module names {unknown}; choose from {list(LORA_TARGETS)}.'
    )
  if len(set(targets)) != len(targets):
    raise ValueError(f'`model.lora.targets` names a module twice: {targets!r}.')
  if model.lora.rank and algorithm == 'reward_model':
    raise ValueError(
      '`model.lora.rank`: LoRA is not supported for algorithm "reward_model" (its fresh '
      'score head must train with the whole model); set it to 0.'
    )
