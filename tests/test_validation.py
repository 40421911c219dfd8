"""Bad config values and bad examples fail at set-up with an error that names
the field, or the file and line (or the generated example), before anything
is compiled; every config in configs/ still validates.

Config values go through `checks.validate` (which runs `checks.check_fields`
first); examples through `trainers.build`, which encodes every prompt once
while it reads the task. The launcher is run once in a subprocess, to show
that `--config.x=<bad>` exits non-zero within seconds with the message.
"""

import glob
import importlib
import json
import os
import re
import subprocess
import sys
import time

import ml_collections
import pytest
from ml_collections.config_flags import config_flags

from configs import common as config_common
from configs import grpo_arith
from jrl import trainers
from jrl.data import ArithmeticTask, read_preference_jsonl, tasks
from jrl.models.tokenizer import CharTokenizer
from jrl.trainers import checks, controller
from tests.helpers import QUIET, SHRINK, set_fields, shrunk_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_NAMES = sorted(
  os.path.basename(p)[:-3]
  for p in glob.glob(os.path.join(REPO, 'configs', '*.py'))
  if not os.path.basename(p).startswith(('_', 'common'))
)


def default_config(name):
  return importlib.import_module(f'configs.{name}').get_config()


def arith_config(workdir, overrides=None):
  """The shrunken `grpo_arith` job, without evaluation or writers."""
  fields = {**SHRINK, **QUIET, 'workdir': str(workdir), **(overrides or {})}
  return set_fields(grpo_arith.get_config(), fields)


# Config fields ------------------------------------------------------------------


# (field, bad value, what the message says). Each was accepted before, or
# failed later with an error that named no field.
BAD_FIELDS = [
  ('sft.batch_size', 0, '>= 1'),  # before: ValueError from min() of an empty sequence
  ('sampler.page_size', 0, '>= 1'),  # before: ZeroDivisionError in the sampler
  ('eval.every', -1, '>= 0'),  # before: accepted, evaluated every iteration
  ('sampling.top_p', 1.5, '> 0 and <= 1'),
  ('sampling.top_p', 0.0, '> 0 and <= 1'),
  ('sampling.top_k', -1, '>= 0'),
  # The kernels' own checks (jrl.losses.PolicyLoss.make), under the field's name.
  ('rl.loss.ppo.eps_low', 1.0, '< 1 (the lower clip 1 - eps_low stays > 0)'),
  ('rl.adv.reinforce_pp.gamma', 1.01, 'in [0, 1]'),
  ('rl.loss.ppo.dual_clip_c', 0.5, '> 1'),
  ('rl.loss.sapo.tau_pos', 0.0, '> 0'),
  ('rl.kl.output_clamp', 0.0, '> 0'),
  ('task.max_prompt_len', 0, '>= 1'),
  ('train.chunk_size', 0, '>= 1'),
  ('rl.overlong_penalty', -1.0, '>= 0'),
  ('sampling.temperature', float('nan'), '> 0'),
  ('optim.lr', float('inf'), '> 0'),
  ('optim.end_lr_ratio', 2.0, '>= 0 and <= 1'),
  ('optim.b2', 1.0, '> 0 and < 1'),
  ('sampler.num_pages', 1, '>= 2, or 0'),
  ('sampler.num_slots', 0, '>= 1'),
  ('sampler.steps_per_dispatch', 0, '>= 1'),
  ('checkpoint.keep', 0, '>= 1'),
  ('log.every', 0, '>= 1'),
  ('task.eval_size', -5, '>= 0'),
  ('task.train_seed', -1, '>= 0'),
  ('reward.workers', 0, '>= 1'),
  ('reward.timeout_s', 0.0, '> 0'),
  ('model.num_layers', 0, '>= 1'),
  ('mesh.fsdp', 0, '>= 1, or -1'),
]


@pytest.mark.parametrize(
  ('field', 'value', 'rule'), BAD_FIELDS, ids=[f'{f}={v}' for f, v, _ in BAD_FIELDS]
)
def test_bad_field_is_named_with_its_range_and_value(tmp_path, field, value, rule):
  config = arith_config(tmp_path, {field: value})
  with pytest.raises(ValueError) as info:
    trainers.validate(config, 1)
  assert str(info.value) == f'`{field}` must be {rule}, got {value!r}.'


@pytest.mark.parametrize(
  ('section', 'field', 'value', 'rule'),
  [
    ('ppo', 'lam', 1.5, '>= 0 and <= 1'),
    ('ppo', 'kl_horizon', 0, '>= 1'),
    ('dpo', 'label_smoothing', 0.5, '>= 0 and < 0.5'),
    ('dpo', 'pairs_per_step', 0, '>= 1'),
    ('rm', 'pairs_per_step', -2, '>= 1'),
    ('agent', 'max_env_tokens', 0, '>= 1'),
    ('agent', 'env_workers', -1, '>= 0'),
    ('agent', 'sft_tool_frac', -0.1, '>= 0 and <= 1'),
  ],
)
def test_bad_field_of_an_algorithm_section_is_named(tmp_path, section, field, value, rule):
  algorithm = {'rm': 'reward_model'}.get(section, section)
  config = shrunk_config(tmp_path, {'algorithm': algorithm, f'{section}.{field}': value})
  with pytest.raises(
    ValueError, match=re.escape(f'`{section}.{field}` must be {rule}, got {value!r}.')
  ):
    trainers.validate(config, 1)


@pytest.mark.parametrize(
  ('value', 'rule', 'kind'),
  [
    (2.5, checks.count(1), 'must be an int, got 2.5 (float)'),
    (True, checks.count(1), 'must be an int, got True (bool)'),
    ('3', checks.positive(), "must be a number, got '3' (str)"),
    (None, checks.positive(), 'must be a number, got None (NoneType)'),
  ],
)
def test_wrong_type_is_named(value, rule, kind):
  # Unlocked configs (and `ignore_type` overrides) can carry any type.
  with pytest.raises(ValueError, match=re.escape(f'`sft.batch_size` {kind}.')):
    checks.check_field('sft.batch_size', value, rule)


def test_ints_are_accepted_for_float_fields():
  checks.check_field('optim.lr', 1, checks.positive())


@pytest.mark.parametrize('name', CONFIG_NAMES)
def test_every_default_config_validates(name):
  config = default_config(name)
  checks.check_fields(config)
  trainers.validate(config, 1)


@pytest.mark.parametrize('name', CONFIG_NAMES)
def test_every_config_holds_the_sections_its_algorithm_reads_and_no_others(name):
  """Offline algorithms carry no rollout sections (rl, reward, topology),
  the reward model not even a sampler; every section a config has is one
  its algorithm reads, and each is checked by the module that reads it."""
  config = default_config(name)
  sections = {k for k, v in config.items() if isinstance(v, ml_collections.ConfigDict)}
  read = set(checks.SHARED) | {s.name for s in trainers.sections_read(config)}
  assert sections == read, (sections - read, read - sections)
  if config.algorithm in ('sft', 'dpo', 'reward_model'):
    assert not sections & {'rl', 'reward', 'topology'}


def test_a_section_the_algorithm_reads_must_be_there(tmp_path):
  config = shrunk_config(tmp_path, {'algorithm': 'dpo'})
  config.unlock()
  del config['dpo']
  with pytest.raises(ValueError, match=r"^`dpo`: algorithm 'dpo' reads this section"):
    trainers.validate(config, 1)


KERNEL_CHECKED = (
  'task.reasoning_gym.settings.',
  'rl.loss.',
  'rl.adv.',
  'rl.reduction.loss_norm',
  'rl.kl.input_clamp',
  'rl.kl.output_clamp',
  'rl.off_policy_mask_threshold',
)


@pytest.mark.parametrize('name', CONFIG_NAMES)
def test_every_numeric_field_of_the_default_configs_has_a_range(name):
  """A numeric field added to a config without a rule (in `checks.FIELDS` or
  the `Section` of the module that reads it) fails here."""

  def numeric_fields(node, prefix=''):
    for key, value in node.items():
      if isinstance(value, ml_collections.ConfigDict):
        yield from numeric_fields(value, f'{prefix}{key}.')
      elif isinstance(value, int | float) and not isinstance(value, bool):
        yield f'{prefix}{key}'

  # A reasoning-gym dataset's own settings are checked by the dataset's config
  # class when the task is built (tests/data/test_reasoning_gym.py), and the
  # arguments of the losses and estimators by the kernels' own checks
  # (tests/trainers/test_loss_settings.py), not here.
  fields = {f for f in numeric_fields(default_config(name)) if not f.startswith(KERNEL_CHECKED)}
  missing = sorted(fields - set(trainers.numeric_fields()))
  assert not missing, f'configs/{name}.py: fields without a range: {missing}'


def test_launcher_exits_with_the_field_before_compiling(tmp_path):
  start = time.monotonic()
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(REPO, 'launch', 'train.py'),
      '--config',
      os.path.join(REPO, 'configs', 'grpo_arith.py'),
      '--config.sft.batch_size=0',
      f'--config.workdir={tmp_path / "run"}',
    ],
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': ''},
    cwd=REPO,
  )
  elapsed = time.monotonic() - start
  assert proc.returncode != 0
  assert 'ValueError: `sft.batch_size` must be >= 1, got 0.' in proc.stderr
  assert elapsed < 30, f'took {elapsed:.1f} s'


# Examples against the tokenizer and the lengths --------------------------------


def write_rows(path, rows, bad_line=None, bad_bytes=None):
  """A JSONL file of `rows`; line `bad_line` (1-based) replaced by `bad_bytes`."""
  with open(path, 'wb') as f:
    for lineno, row in enumerate(rows, 1):
      line = bad_bytes if lineno == bad_line else json.dumps(row, ensure_ascii=False).encode()
      f.write(line + b'\n')
  return str(path)


def arith_rows(n=30):
  return [{'prompt': f'{i}+{i}=', 'answer': str(2 * i)} for i in range(n)]


def jsonl_config(tmp_path, train_path, overrides=None):
  fields = {'task.kind': 'jsonl', 'task.train_path': train_path, 'sft.steps': 0}
  return arith_config(tmp_path, {**fields, **(overrides or {})})


@pytest.mark.parametrize(
  ('line', 'match'),
  [
    # Before: ValueError "character '€' at offset 1 is not in the character
    # vocabulary" when the stream first drew the row, mid-run.
    ({'prompt': '3€+1=', 'answer': '4'}, r"prompts\.jsonl:17: field `prompt`: character '€'"),
    # Before: "request 3: prompt length 43 must be in [1, max_prompt_len=8]" mid-run.
    (
      {'prompt': '1' * 40 + '+1=', 'answer': '4'},
      r'prompts\.jsonl:17: field `prompt` is 43 tokens, more than `task\.max_prompt_len`=8',
    ),
  ],
  ids=['char', 'too_long'],
)
def test_prompt_file_row_is_refused_at_set_up(tmp_path, line, match):
  rows = arith_rows()
  rows[16] = line
  path = write_rows(tmp_path / 'prompts.jsonl', rows)
  with pytest.raises(ValueError, match=match):
    trainers.build(jsonl_config(tmp_path, path))


def test_held_out_file_row_is_refused_at_set_up(tmp_path):
  train = write_rows(tmp_path / 'train.jsonl', arith_rows())
  rows = arith_rows(5)
  rows[2] = {'prompt': 'x\ty=', 'answer': '1'}
  eval_path = write_rows(tmp_path / 'eval.jsonl', rows)
  config = jsonl_config(tmp_path, train, {'task.eval_path': eval_path})
  with pytest.raises(ValueError, match=r"eval\.jsonl:3: field `prompt`: character '\\t'"):
    trainers.build(config)


def test_invalid_utf8_in_the_prompt_file_names_the_line(tmp_path):
  # Before: UnicodeDecodeError "... in position 581" with no file or line.
  path = write_rows(tmp_path / 'prompts.jsonl', arith_rows(), 17, b'{"prompt": "1+\xff=", "a": 1}')
  with pytest.raises(
    ValueError, match=r'prompts\.jsonl:17: invalid UTF-8 \(byte 0xff at column 15'
  ):
    trainers.build(jsonl_config(tmp_path, path))


def test_sft_file_row_longer_than_a_row_is_refused(tmp_path):
  # Before: "row 5: prompt 6 + response 30 tokens exceed the length 14" at an SFT step.
  sft_rows = [{'prompt': r['prompt'], 'response': r['answer']} for r in arith_rows()]
  sft_rows[8]['response'] = '9' * 30
  sft_path = write_rows(tmp_path / 'sft.jsonl', sft_rows)
  config = arith_config(tmp_path, {'sft.train_path': sft_path})
  with pytest.raises(
    ValueError,
    match=r'sft\.jsonl:9: prompt \(4 tokens\) \+ `response` \(30 tokens\) \+ eos exceed '
    r'`task\.max_prompt_len` \+ `task\.max_response_len` = 14 tokens',
  ):
    trainers.build(config)


def test_sft_rows_are_not_length_checked_without_sft_steps(tmp_path):
  sft_rows = [{'prompt': '1+1=', 'response': '9' * 30}]
  sft_path = write_rows(tmp_path / 'sft.jsonl', sft_rows)
  job = trainers.build(arith_config(tmp_path, {'sft.train_path': sft_path, 'sft.steps': 0}))
  controller.close(job)


def test_generated_prompts_longer_than_max_prompt_len_are_refused(tmp_path):
  # 2-digit addition prompts ("47+85=") are 6 characters. Before: the first
  # evaluation failed with "request 0: prompt length 6 must be in [1,
  # max_prompt_len=4]", or an SFT step with "row 0: prompt 6 + response ...".
  config = arith_config(tmp_path, {'task.max_prompt_len': 4})
  with pytest.raises(
    ValueError,
    match=r"task 'arith' training example 0: field `prompt` is 6 tokens, more than "
    r'`task\.max_prompt_len`=4',
  ):
    trainers.build(config)


def test_generated_task_with_a_character_outside_the_vocabulary(tmp_path, monkeypatch):
  # A generated task whose prompts use '×': before, accepted at set-up and
  # failed at the first SFT step, naming neither the task nor the example.
  original = ArithmeticTask.example

  def times_sign(self, index):
    example = original(self, index)
    return {**example, 'prompt': example['prompt'].replace('+', '×')}

  monkeypatch.setattr(ArithmeticTask, 'example', times_sign)
  with pytest.raises(
    ValueError, match=r"task 'arith' training example 0: field `prompt`: character '×'"
  ):
    trainers.build(arith_config(tmp_path))


def char_checker(max_prompt_len=8, max_new_tokens=6):
  tok = CharTokenizer()
  return tasks.ExampleChecker(
    tok.encode, tok.encode, max_prompt_len, max_prompt_len + max_new_tokens
  )


def test_preference_pairs_are_checked_with_the_line(tmp_path):
  # DPO and reward-model pairs files go through `ExampleChecker.pair`.
  rows = [{'prompt': '1+1=', 'chosen': '2', 'rejected': '3'} for _ in range(6)]
  rows[4]['chosen'] = '2€'
  path = write_rows(tmp_path / 'pairs.jsonl', rows)
  with pytest.raises(ValueError, match=r"pairs\.jsonl:5: field `chosen`: character '€'"):
    read_preference_jsonl(path, check=char_checker().pair)


@pytest.mark.parametrize(('eos', 'fits'), [(True, False), (False, True)])
def test_pair_length_counts_the_eos_token_only_when_it_is_appended(eos, fits):
  # prompt 4 + rejected 10 = 14 tokens = max_prompt_len 8 + max_new_tokens 6.
  pair = {'prompt': '1+1=', 'chosen': '2', 'rejected': '9' * 10}
  if fits:
    char_checker().pair(pair, eos=eos)
  else:
    with pytest.raises(ValueError, match=r'`rejected` \(10 tokens\) \+ eos exceed'):
      char_checker().pair(pair, eos=eos)


@pytest.mark.parametrize('name', CONFIG_NAMES)
def test_every_config_has_a_smoke_variant(name):
  """`--config=configs/<name>.py:smoke`: the same job, SMOKE's sizes, its
  iteration counts capped (a job without an SFT warm-up keeps none)."""
  parse = config_flags.ConfigFileFlagParser('config', lock_config=True).parse
  full = default_config(name)
  smoke = parse(os.path.join(REPO, 'configs', f'{name}.py:smoke'))
  assert smoke.is_locked and smoke.algorithm == full.algorithm
  for key, value in config_common.SMOKE.items():
    (present, got), was = checks.lookup(smoke, key), checks.lookup(full, key)[1]
    if not present:  # a section this algorithm does not read
      assert key.split('.')[0] not in full, key
      continue
    assert got == (min(was, value) if key.endswith('.steps') else value), key
  trainers.validate(smoke, 1)  # every field in its range, the sections consistent
  with pytest.raises(ValueError, match="unknown config variant 'tiny'"):
    importlib.import_module(f'configs.{name}').get_config('tiny')
