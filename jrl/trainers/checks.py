"""Checks run at set-up, before anything is compiled: every numeric config
field against its range, and every example against the tokenizer and the
length limits of the config.

`check_fields(config)` walks `FIELDS`, a table of the numeric fields of
`configs/common.py` (its `base()` and the algorithm sections) with the range
each must lie in; sections a config lacks are skipped. A value out of range,
non-finite or of the wrong type raises ValueError naming the field:

    `sft.batch_size` must be >= 1, got 0.

`ExampleChecker` encodes examples once when they are read, so that a
character the tokenizer cannot encode or a prompt longer than
`rl.max_prompt_len` fails at set-up with the file and line (or the index of a
generated example), not when the stream first draws the row mid-run.

`validate(config, batch_shards)` runs `check_fields` and then the checks
between fields and against the devices (the model's remat policy and LoRA
targets, group sizes, minibatches over the mesh, the topology).
"""

import math
from typing import NamedTuple

import jax

from jrl import losses as L
from jrl.models.config import ATTENTION_IMPLS, LORA_TARGETS, REMAT_POLICIES

TOPOLOGIES = ('colocated', 'disaggregated', 'one_step_off')


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


def positive():
  """A float > 0 (learning rates, temperatures, timeouts)."""
  return Range(False, 0, lo_open=True)


def non_negative():
  """A float >= 0 (coefficients and clamps where 0 means off)."""
  return Range(False, 0)


def fraction(lo_open=False, hi_open=False):
  """A float in [0, 1] (probabilities, discounts, shares)."""
  return Range(False, 0, 1, lo_open=lo_open, hi_open=hi_open)


# Every numeric field of the default configs. `tests/test_validation.py` checks
# that no numeric field of a config in configs/ is missing here.
FIELDS = {
  'seed': count(0),
  'max_nonfinite_steps': count(1),
  # mesh: -1 takes the devices left over.
  'mesh.data': count(1, also=(-1,)),
  'mesh.fsdp': count(1, also=(-1,)),
  'mesh.tensor': count(1, also=(-1,)),
  'topology.rollout_devices': count(0),
  'topology.staleness': count(0, hi=1),
  'topology.is_cap': Range(False, 1),
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
  'task.train_seed': count(0),
  'task.eval_seed': count(0),
  'task.eval_size': count(0),
  'reward.unscored_value': Range(False),
  'reward.workers': count(1),
  'reward.timeout_s': positive(),
  'reward.max_unscored_frac': fraction(),
  'reward.max_unscored_steps': count(1),
  'reward.judge_max_new_tokens': count(1),
  'reward.judge_max_prompt_len': count(1),
  'reward.clip': non_negative(),
  'sft.steps': count(0),
  'sft.batch_size': count(1),
  'sft.lr': positive(),
  'sft.warmup_steps': count(0),
  'rl.steps': count(0),
  'log.samples_every': count(0),
  'rl.prompts_per_step': count(1),
  'rl.group_size': count(1),
  'rl.max_prompt_len': count(1),
  'rl.max_new_tokens': count(1),
  'rl.temperature': positive(),
  'rl.top_k': count(0),
  'rl.top_p': fraction(lo_open=True),
  'rl.epochs': count(1),
  'rl.minibatch_size': count(1),
  'rl.adv_eps': non_negative(),
  'rl.gamma': fraction(),
  'rl.eps_low': fraction(hi_open=True),  # the ratio's lower clip 1 - eps_low stays > 0
  'rl.eps_high': non_negative(),
  'rl.dual_clip_c': Range(False, 1, lo_open=True, also=(0,)),  # c > 1 (0: off)
  'rl.log_ratio_clamp': non_negative(),
  'rl.loss_norm': non_negative(),
  'rl.kl_coef': non_negative(),
  'rl.kl_input_clamp': non_negative(),
  'rl.kl_output_clamp': non_negative(),
  'rl.sapo_tau_pos': positive(),
  'rl.sapo_tau_neg': positive(),
  'rl.vespo_k_pos': non_negative(),
  'rl.vespo_lambda_pos': non_negative(),
  'rl.vespo_k_neg': non_negative(),
  'rl.vespo_lambda_neg': non_negative(),
  'rl.off_policy_mask_threshold': non_negative(),
  'rl.entropy_coef': Range(False),
  'rl.overlong_buffer': count(0),
  'rl.overlong_penalty': non_negative(),
  'rl.dynamic_sampling_max_draws': count(0),
  'rl.chunk_size': count(1),
  'rl.pack_row_len': count(0),  # 0: max_prompt_len + max_new_tokens
  'rl.micro_batch_tokens': count(0),  # 0: no token-budget micro-batches
  'rl.router_aux_coef': non_negative(),
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
  'sampler.num_slots': count(1),
  'sampler.page_size': count(1),
  'sampler.num_pages': count(2, also=(0,)),  # page 0 is scratch; 0: sized automatically
  'sampler.steps_per_dispatch': count(1),
  'eval.every': count(0),
  'eval.samples': count(0),
  'eval.temperature': positive(),
  'checkpoint.every': count(1),
  'checkpoint.keep': count(1),
  'log.every': count(1),
  # Algorithm sections (configs/common.py `*_section`), checked when present.
  'ppo.gamma': fraction(),
  'ppo.lam': fraction(),
  'ppo.value_clip': non_negative(),
  'ppo.critic_lr': positive(),
  'ppo.kl_target': positive(),
  'ppo.kl_horizon': count(1),
  'agent.max_turns': count(1),
  'agent.step_timeout_s': positive(),
  'agent.max_env_tokens': count(1),
  'agent.sft_tool_frac': fraction(),
  'rm.pairs_per_step': count(1),
  'rm.margin': non_negative(),
  'rm.center_coef': non_negative(),
  'dpo.beta': positive(),
  'dpo.label_smoothing': Range(False, 0, 0.5, hi_open=True),
  'dpo.simpo_gamma': non_negative(),
  'dpo.pairs_per_step': count(1),
}


def _lookup(config, field):
  """The value at a dotted path, or (False, None) if a section or field is absent."""
  node = config
  for part in field.split('.'):
    if part not in node:
      return False, None
    node = node[part]
  return True, node


def check_field(field, value, rule):
  """Raises ValueError naming `field` unless `value` satisfies `rule`."""
  is_bool = isinstance(value, bool)
  if rule.integer and (is_bool or not isinstance(value, int)):
    raise ValueError(f'`{field}` must be an int, got {value!r} ({type(value).__name__}).')
  if is_bool or not isinstance(value, int | float):
    raise ValueError(f'`{field}` must be a number, got {value!r} ({type(value).__name__}).')
  if not rule.contains(value):
    raise ValueError(f'`{field}` must be {rule.describe()}, got {value!r}.')


def check_fields(config):
  """Checks each field of `FIELDS` that `config` has; raises ValueError naming the first bad one."""
  for field, rule in FIELDS.items():
    present, value = _lookup(config, field)
    if present:
      check_field(field, value, rule)


# Examples ------------------------------------------------------------------------


class PromptTooLong(ValueError):
  """A prompt longer than `rl.max_prompt_len` (`task.long_prompts='filter'` drops these)."""


class ExampleChecker:
  """Encodes examples as the trainer will, and refuses those it could not train on.

  Each method takes one example (a dict as `jrl.data` returns it) and raises
  ValueError saying which field is wrong; the JSONL readers prefix the file
  and line (`jrl.data.sources`, `check=`), `check_generated` the example's
  index.
  """

  def __init__(self, prompt_ids, encode, max_prompt_len, seq_len):
    """
    Args:
      prompt_ids: prompt (text or chat messages) -> token ids, as the trainer
        builds them (chat template, bos).
      encode: text -> token ids (responses, answers).
      max_prompt_len: `rl.max_prompt_len`.
      seq_len: tokens of a packed training row (`rl.max_prompt_len +
        rl.max_new_tokens`); a response is followed by one eos token.
    """
    self.prompt_ids = prompt_ids
    self.encode = encode
    self.max_prompt_len = max_prompt_len
    self.seq_len = seq_len

  def _ids(self, example, key, fn):
    try:
      return fn(example[key])
    except ValueError as e:  # e.g. a character outside the tokenizer's vocabulary
      raise ValueError(f'field `{key}`: {e}') from None

  def prompt(self, example):
    """The prompt encodes and fits in `rl.max_prompt_len`; returns its length."""
    n = len(self._ids(example, 'prompt', self.prompt_ids))
    if n > self.max_prompt_len:
      raise PromptTooLong(
        f'field `prompt` is {n} tokens, more than `rl.max_prompt_len`={self.max_prompt_len}.'
      )
    return n

  def _completion(self, example, key, prompt_len, eos=True):
    m = len(self._ids(example, key, lambda text: self.encode(str(text))))
    if prompt_len + m + int(eos) > self.seq_len:
      raise ValueError(
        f'prompt ({prompt_len} tokens) + `{key}` ({m} tokens){" + eos" if eos else ""} exceed '
        f'`rl.max_prompt_len` + `rl.max_new_tokens` = {self.seq_len} tokens.'
      )

  def sft(self, example):
    """An SFT row: prompt, and prompt + response (or answer) + eos fit a row."""
    n = self.prompt(example)
    self._completion(example, 'response' if 'response' in example else 'answer', n)

  def pair(self, example, eos=True):
    """A preference pair: prompt, and prompt + chosen / rejected (+ eos) fit a row."""
    n = self.prompt(example)
    for key in ('chosen', 'rejected'):
      self._completion(example, key, n, eos)


def check_generated(name, examples, check):
  """Runs `check` on (index, example) pairs of a generated task, naming the index."""
  for i, example in examples:
    try:
      check(example)
    except ValueError as e:
      raise ValueError(f'{name} example {i}: {e}') from None


# Between fields --------------------------------------------------------------


def validate(config, batch_shards):
  """Raises ValueError naming the field for anything inconsistent.

  Every numeric field is first checked against its range (`FIELDS`);
  what follows are the checks between fields and against the devices.
  """
  check_fields(config)
  rl = config.rl

  def need(cond, field, msg):
    if not cond:
      raise ValueError(f'`{field}`: {msg}')

  check_model(config.model, config.algorithm)
  steps = config.log.profile_steps
  total = config.sft.steps + rl.steps
  need(
    isinstance(steps, tuple | list)
    and all(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= total for i in steps),
    'log.profile_steps',
    f'must be iterations between 1 and sft.steps + rl.steps = {total}, got {steps!r}.',
  )
  need(
    rl.group_size >= 2 or rl.advantage not in L.GROUP_ADVANTAGES,
    'rl.group_size',
    f'must be >= 2 for the group estimator {rl.advantage!r}.',
  )
  estimators, policy_losses = tuple(L.ADVANTAGE_ESTIMATORS), tuple(L.POLICY_LOSSES)
  need(rl.advantage in estimators, 'rl.advantage', f'must be one of {estimators}.')
  need(rl.policy_loss in policy_losses, 'rl.policy_loss', f'one of {policy_losses}.')
  need(rl.loss_agg in L.AGGREGATION_MODES, 'rl.loss_agg', f'one of {L.AGGREGATION_MODES}.')
  rows = rl.prompts_per_step * rl.group_size
  need(
    rows % rl.minibatch_size == 0,
    'rl.minibatch_size',
    f'must divide prompts_per_step x group_size = {rows}.',
  )
  need(
    rl.minibatch_size % batch_shards == 0,
    'rl.minibatch_size',
    f'must be divisible by the mesh batch axes data x fsdp = {batch_shards}.',
  )
  seq_len = rl.max_prompt_len + rl.max_new_tokens
  need(
    not rl.pack_row_len or rl.pack_row_len >= seq_len,
    'rl.pack_row_len',
    f'must be 0 or at least max_prompt_len + max_new_tokens = {seq_len} (a row holds '
    'the longest sequence).',
  )
  row_len = rl.pack_row_len or seq_len
  need(
    not rl.micro_batch_tokens or (rl.packing and rl.micro_batch_tokens >= row_len),
    'rl.micro_batch_tokens',
    f'must be 0, or with rl.packing on at least one packed row ({row_len} tokens).',
  )
  need(
    not rl.micro_batch_tokens or config.algorithm in ('grpo', 'ppo', 'agent', 'sft'),
    'rl.micro_batch_tokens',
    f'token-budget micro-batches run grpo, ppo, agent and sft (with their SFT warm-up), '
    f'not {config.algorithm!r} (its pair losses are not split yet).',
  )
  need(
    config.sft.batch_size % batch_shards == 0,
    'sft.batch_size',
    f'must be divisible by the mesh batch axes data x fsdp = {batch_shards}.',
  )
  need(
    0 <= rl.overlong_buffer < rl.max_new_tokens,
    'rl.overlong_buffer',
    'must be in [0, max_new_tokens).',
  )
  need(config.sampler.num_slots >= rl.group_size, 'sampler.num_slots', 'must be >= rl.group_size.')
  need(rl.kl_in in ('loss', 'reward'), 'rl.kl_in', "must be 'loss' or 'reward'.")
  need(
    rl.kl_estimator != 'k3_ratio_corrected' or rl.kl_in == 'loss',
    'rl.kl_estimator',
    "'k3_ratio_corrected' weights the KL by π/π_old, which exists only in the loss: "
    "set rl.kl_in='loss' or another estimator.",
  )
  tc = config.topology
  need(tc.kind in TOPOLOGIES, 'topology.kind', f'must be one of {TOPOLOGIES}.')
  need(
    tc.kind != 'disaggregated' or tc.rollout_devices >= 1,
    'topology.rollout_devices',
    'must be >= 1 for a disaggregated topology.',
  )
  need(
    tc.rollout_devices < jax.device_count(),
    'topology.rollout_devices',
    f'must leave devices for training (there are {jax.device_count()}).',
  )
  need(
    tc.kind != 'colocated' or tc.rollout_devices == 0,
    'topology.rollout_devices',
    "must be 0 for a colocated topology (use 'disaggregated').",
  )
  need(
    tc.kind != 'one_step_off' or config.algorithm == 'grpo',
    'topology.kind',
    "one_step_off runs the GRPO family (algorithm 'grpo') only.",
  )
  need(
    rl.prompts_per_step % jax.process_count() == 0,
    'rl.prompts_per_step',
    f'must be divisible by the number of processes ({jax.process_count()}).',
  )


def check_model(model, algorithm):
  """The non-numeric training-memory fields of `model` (remat, scan_layers,
  lora); raises ValueError naming the field."""
  if model.remat not in REMAT_POLICIES:
    raise ValueError(f'`model.remat` must be one of {REMAT_POLICIES}, got {model.remat!r}.')
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
