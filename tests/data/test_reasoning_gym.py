"""`task.kind='reasoning_gym'` (jrl/data/reasoning_gym.py) with the real
reasoning-gym 0.1.25: held-out questions never in training, the mixture's
weights, errors naming the config field, the curriculum's rule, per-dataset
metrics, and the curriculum's state through the prompt stream."""

import copy

import numpy as np
import pytest

reasoning_gym = pytest.importorskip(
  'reasoning_gym', reason='the [reasoning-gym] extra (pip install -e ".[reasoning-gym]")'
)

from configs import common  # noqa: E402
from jrl.data import PromptStream, tasks  # noqa: E402
from jrl.data import reasoning_gym as rg_task  # noqa: E402


def task_config(datasets='chain_sum', eval_size=20, settings=None, **fields):
  """A `task` section for reasoning-gym; `fields` as 'a.b': value under `task`."""
  c = common.task_section()
  c.kind = 'reasoning_gym'
  c.reasoning_gym.datasets = datasets
  c.eval_size = eval_size
  for name, values in (settings or {}).items():
    c.reasoning_gym.settings[name] = values
  for key, value in fields.items():
    *parents, leaf = key.split('.')
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


SMALL = {'chain_sum': {'min_terms': 2, 'max_terms': 2, 'min_digits': 1, 'max_digits': 1}}


def test_held_out_questions_never_appear_in_training():
  """Two one-digit terms make few distinct questions, so other seeds repeat
  held-out ones: training draws those again, and none reaches training."""
  task = tasks.Task(task_config(eval_size=60, settings=SMALL), seed=0)
  held = {row['prompt'] for row in task.held_out}
  train = [task.train.example(i)['prompt'] for i in range(3000)]
  assert not held & set(train)
  assert task.generator.skipped['held_out'] > 0  # the exclusion was needed, and it worked
  assert len(set(train)) > 50
  # Seeds: training entries come from seeds train_seed·size + j, held-out from eval_seed·size + j.
  size = task.generator.size
  assert task.train.example(0)['reasoning_gym']['kwargs']['seed'] == 0 * size
  assert task.held_out[0]['reasoning_gym']['kwargs']['seed'] == 1 * size


def test_rows_carry_the_entry_and_its_dataset():
  task = tasks.Task(task_config(), seed=0)
  row = task.train.example(7)
  spec = row['reasoning_gym']
  ds = reasoning_gym.create_dataset('chain_sum', **spec['kwargs'])
  entries = [ds[j] for j in range(task.generator.size)]
  assert spec['entry'] in entries  # an entry of the dataset, as it made it
  assert row['prompt'] == spec['entry']['question'] and row['answer'] == spec['entry']['answer']
  assert row['dataset'] == 'chain_sum' and 'level' not in row
  assert task.train.example(7) == row  # the same example every time it is asked for
  fresh = tasks.Task(task_config(), seed=0)  # ... and in every process
  assert fresh.train.example(7) == row and fresh.held_out == task.held_out


def test_mixture_weights_are_respected():
  task = tasks.Task(task_config('basic_arithmetic:1,chain_sum:0.5', eval_size=30), seed=0)
  n = 3000
  names = [task.train.example(i)['dataset'] for i in range(n)]
  share = names.count('basic_arithmetic') / n
  sigma = np.sqrt((2 / 3) * (1 / 3) / n)
  assert abs(share - 2 / 3) < 4 * sigma, share
  assert set(names) == {'basic_arithmetic', 'chain_sum'}
  held = [row['dataset'] for row in task.held_out]
  assert (held.count('basic_arithmetic'), held.count('chain_sum')) == (20, 10)


def test_allocate_splits_by_largest_remainders():
  assert rg_task.allocate(10, {'a': 1, 'b': 1, 'c': 1}) == {'a': 4, 'b': 3, 'c': 3}
  assert rg_task.allocate(7, {'a': 3, 'b': 1}) == {'a': 5, 'b': 2}
  assert sum(rg_task.allocate(200, {'a': 0.3, 'b': 0.7, 'c': 0.01}).values()) == 200


def test_settings_reach_the_dataset():
  task = tasks.Task(task_config(settings=SMALL), seed=0)
  for i in range(50):
    entry = task.train.example(i)['reasoning_gym']['entry']
    assert entry['metadata']['num_terms'] == 2 and entry['metadata']['num_digits'] == 1


@pytest.mark.parametrize(
  ('fields', 'settings', 'match'),
  [
    ({'reasoning_gym.datasets': 'chain_summ'}, None, r"datasets`.*'chain_summ'.*'chain_sum'"),
    ({'reasoning_gym.datasets': 'composite'}, None, r'datasets`.*no dataset .composite.'),
    ({'reasoning_gym.datasets': 'chain_sum:-1'}, None, r'datasets`.*positive weight'),
    ({'reasoning_gym.datasets': 'chain_sum:x'}, None, r'datasets`.*is not a number'),
    ({'reasoning_gym.datasets': 'chain_sum,chain_sum'}, None, r'datasets`.*named twice'),
    ({}, {'chain_sum': {'max_termz': 3}}, r"settings\.chain_sum\.max_termz`.*'max_terms'"),
    ({}, {'chain_sum': {'min_terms': 0}}, r'settings\.chain_sum`: reasoning-gym refuses'),
    ({}, {'chain_sum': {'seed': 3}}, r'settings\.chain_sum\.seed`: set by jrl'),
    ({}, {'chain_summ': {'min_terms': 2}}, r"settings\.chain_summ`: .*no dataset.*'chain_sum'"),
    ({'eval_seed': 0}, None, r'train_seed` and `task\.eval_seed` are both 0'),
    ({'train_seed': 2**31}, None, r'task\.train_seed` must be'),
    ({'reasoning_gym.size': 10, 'eval_size': 11}, None, r'eval_size`=11.*size`=10'),
    ({'reasoning_gym.answer': 'boxed'}, None, r'reasoning_gym\.answer` must be one of'),
    ({'reasoning_gym.threshold': 1.5}, None, r'reasoning_gym\.threshold` must be'),
    ({'reasoning_gym.datasets': 'puzzle24'}, None, r'datasets`.*unsafe_scorers'),
    ({'reasoning_gym.curriculum.raise_at': 2.0}, None, r'curriculum\.raise_at` must be'),
    (
      {'reasoning_gym.curriculum.raise_at': 0.5, 'reasoning_gym.curriculum.lower_at': 0.6},
      None,
      r'curriculum\.lower_at` \(0\.6\) must be below',
    ),
    (
      {'reasoning_gym.curriculum.raise_at': 0.5, 'reasoning_gym.curriculum.window': 0},
      None,
      r'curriculum\.window` must be',
    ),
    (
      {'reasoning_gym.curriculum.raise_at': 0.5, 'reasoning_gym.curriculum.start_level': 99},
      None,
      r'curriculum\.start_level`=99: chain_sum has levels 0 to',
    ),
    (
      {'reasoning_gym.datasets': 'acre', 'reasoning_gym.curriculum.raise_at': 0.5},
      None,
      r'curriculum\.raise_at`: reasoning-gym has no curriculum for .acre.',
    ),
    (
      {'reasoning_gym.curriculum.raise_at': 0.5},
      SMALL,
      r'settings\.chain_sum\.max_digits`: the curriculum sets',
    ),
    ({'long_prompts': 'drop'}, None, r'task\.long_prompts` must be one of'),
  ],
)
def test_bad_config_names_the_field(fields, settings, match):
  with pytest.raises(ValueError, match=match):
    tasks.Task(task_config(settings=settings, **fields), seed=0)


def test_settings_of_a_dataset_outside_the_mixture_are_unused(capsys):
  """So that `--config.task.reasoning_gym.datasets=...` can leave a dataset
  the experiment file configured."""
  task = tasks.Task(task_config('basic_arithmetic', settings=SMALL), seed=0)
  assert task.generator.settings == {'basic_arithmetic': {}}
  assert 'settings.chain_sum` is unused' in capsys.readouterr().out


def test_an_evaluating_scorer_is_allowed_when_asked():
  task = tasks.Task(
    task_config('puzzle24', eval_size=2, **{'reasoning_gym.unsafe_scorers': True}), seed=0
  )
  assert task.train.example(0)['reasoning_gym']['unsafe'] is True


def test_long_prompts_are_filtered_or_refused():
  """A check raising PromptTooLong: with 'filter' such rows are left out of
  held-out (counted) and drawn again in training; with 'error' they stop the run."""
  limit = 80

  def check(row):
    if len(row['prompt']) > limit:
      raise tasks.PromptTooLong(f'field `prompt` is {len(row["prompt"])} characters')

  config = task_config('basic_arithmetic:1,chain_sum:1', eval_size=40, long_prompts='filter')
  task = tasks.Task(config, 0, check)
  assert task.filtered['eval'] > 0
  assert len(task.held_out) == 40 - task.filtered['eval']
  assert all(len(row['prompt']) <= limit for row in task.held_out)
  assert all(len(task.train.example(i)['prompt']) <= limit for i in range(200))
  assert task.generator.skipped['filtered'] > 0
  with pytest.raises(ValueError, match=r"'reasoning_gym' held-out .* entry \d+: field `prompt`"):
    tasks.Task(task_config('basic_arithmetic:1,chain_sum:1', eval_size=40), 0, check)


def curriculum_task(datasets='chain_sum', **fields):
  fields = {
    'reasoning_gym.curriculum.raise_at': 0.75,
    'reasoning_gym.curriculum.lower_at': 0.25,
    'reasoning_gym.curriculum.window': 8,
    **fields,
  }
  return tasks.Task(task_config(datasets, eval_size=10, **fields), seed=0).generator


def scores(examples, values, g=4):
  """per_fn and total for `examples`, each dataset's rows scoring `values[name]`."""
  s = np.asarray([[values[ex['dataset']]] * g for ex in examples], np.float32)
  return {'reasoning_gym': s}, np.full_like(s, np.nan)


def test_curriculum_rises_at_the_threshold_and_falls_at_the_floor():
  gen = curriculum_task()
  assert gen.levels == {'chain_sum': 0}
  first = gen.example(0)
  assert first['level'] == 0
  config_at = {}
  for level in range(2):
    kwargs = gen._kwargs('chain_sum', 'train', level)
    config_at[level] = (kwargs['max_terms'], kwargs['max_digits'])
  assert config_at[0] != config_at[1]
  examples = [gen.example(i) for i in range(4)]
  # One rollout of 4 prompts x 4 = 16 scores >= the window of 8: mean 0.7 < 0.75 stays.
  metrics = gen.observe(examples, *scores(examples, {'chain_sum': 0.7}))
  assert gen.levels == {'chain_sum': 0} and metrics['task/chain_sum/level'] == 0
  assert metrics['task/chain_sum/reward'] == pytest.approx(0.7)
  metrics = gen.observe(examples, *scores(examples, {'chain_sum': 0.8}))
  assert gen.levels == {'chain_sum': 1} and metrics['task/chain_sum/level'] == 1
  assert gen.windows == {'chain_sum': []}  # the window starts over at a new level
  later = gen.example(100)
  assert later['level'] == 1
  kwargs = later['reasoning_gym']['kwargs']
  assert (kwargs['max_terms'], kwargs['max_digits']) == config_at[1]
  assert gen.example(0)['level'] == 1  # asked again after the move: the new level
  gen.observe(examples, *scores(examples, {'chain_sum': 0.2}))
  assert gen.levels == {'chain_sum': 0}
  gen.observe(examples, *scores(examples, {'chain_sum': 0.0}))
  assert gen.levels == {'chain_sum': 0}  # never below 0


def test_curriculum_waits_for_a_full_window_and_stops_at_the_top():
  gen = curriculum_task(**{'reasoning_gym.curriculum.window': 20})
  examples = [gen.example(i) for i in range(4)]
  gen.observe(examples, *scores(examples, {'chain_sum': 1.0}))  # 16 of 20
  assert gen.levels == {'chain_sum': 0}
  gen.observe(examples, *scores(examples, {'chain_sum': 1.0}))
  assert gen.levels == {'chain_sum': 1}
  for _ in range(40):
    gen.observe(examples, *scores(examples, {'chain_sum': 1.0}))
  assert gen.levels['chain_sum'] == gen.tops['chain_sum'] > 1


def test_curriculum_reads_only_its_datasets_scores_and_the_reasoning_gym_reward():
  """In a mixture each dataset moves on its own rows; the `reasoning_gym`
  reward's scores count, not the total (which other rewards and penalties change)."""
  gen = curriculum_task('basic_arithmetic:1,chain_sum:1')
  examples = [gen.example(i) for i in range(16)]
  per_fn, _ = scores(examples, {'basic_arithmetic': 1.0, 'chain_sum': 0.0})
  total = np.zeros_like(per_fn['reasoning_gym'])
  metrics = gen.observe(examples, per_fn, total)
  assert gen.levels == {'basic_arithmetic': 1, 'chain_sum': 0}
  assert metrics['task/basic_arithmetic/reward'] == 1.0
  assert metrics['task/chain_sum/reward'] == 0.0
  counts = [ex['dataset'] for ex in examples]
  assert metrics['task/chain_sum/prompts'] == counts.count('chain_sum')
  # Without that reward among the functions, the trained total (NaN: left out) counts.
  metrics = gen.observe(examples, {'math_answer': total}, np.where(total == 0, np.nan, 1.0))
  assert 'task/chain_sum/reward' not in metrics


def test_the_held_out_problems_stay_at_the_start_level():
  gen = curriculum_task(**{'reasoning_gym.curriculum.start_level': 1})
  assert {row['level'] for row in gen.held_out} == {1}
  assert gen.levels == {'chain_sum': 1}


def test_a_stream_feeds_the_curriculum_and_checkpoints_it():
  """PromptStream.observe gives the source its examples by stream position;
  its state (position, levels, windows) restores to the same next examples."""
  gen = curriculum_task('basic_arithmetic:1,chain_sum:1')
  stream = PromptStream(gen, seed=0)
  assert stream.observes
  g = 4
  draws = []
  for _ in range(2):
    start = stream.position
    batch = stream.next(4)
    per_fn, total = scores(batch, {'basic_arithmetic': 1.0, 'chain_sum': 0.5}, g)
    draws.append((start, {k: v.ravel() for k, v in per_fn.items()}, total.ravel()))
  metrics = stream.observe(draws, g)
  assert metrics['task/basic_arithmetic/level'] == 1.0
  assert metrics['task/chain_sum/reward'] == 0.5
  saved = copy.deepcopy(stream.state())
  assert saved['source']['levels'] == {'basic_arithmetic': 1, 'chain_sum': 0}
  want = stream.next(6)
  other = PromptStream(curriculum_task('basic_arithmetic:1,chain_sum:1'), seed=0)
  other.restore(saved)
  assert other.next(6) == want
  assert PromptStream([{'prompt': 'a'}], seed=0).observe(draws, g) == {}


def test_a_checkpoint_of_another_mixture_is_refused():
  gen = curriculum_task('chain_sum')
  with pytest.raises(ValueError, match=r'task\.reasoning_gym` changed'):
    gen.restore({'levels': {'basic_arithmetic': 0}, 'windows': {}})
