"""The `reasoning_gym` reward (jrl/rewards/reasoning_gym.py) with the real
reasoning-gym 0.1.25: its scores are the datasets' own scorers' on the same
answers, partial credit included, through the trainer's reward workers too;
answers are read as reasoning-gym reads them; scorers that evaluate model
text are refused; hostile completions run nothing."""

import inspect
import json
import re
import sys
from decimal import Decimal

import pytest

reasoning_gym = pytest.importorskip(
  'reasoning_gym', reason='the [reasoning-gym] extra (pip install -e ".[reasoning-gym]")'
)

from reasoning_gym.dataset import ProceduralDataset  # noqa: E402
from reasoning_gym.factory import DATASETS  # noqa: E402
from reasoning_gym.utils import extract_answer  # noqa: E402

from jrl import rewards  # noqa: E402
from jrl.rewards import reasoning_gym as rg_reward  # noqa: E402
from tests.rewards import hostile  # noqa: E402

# Datasets whose scorers give partial credit, one whose answers are ranges of
# a config setting, and graph_color, whose entries have no `answer` (None).
DATASETS_USED = (
  'basic_arithmetic',
  'chain_sum',
  'spell_backward',
  'word_sorting',
  'sentence_reordering',
  'decimal_arithmetic',
  'graph_color',
)


def make_row(name, j=0, threshold=None, extract='answer_tag', **settings):
  kwargs = {**settings, 'seed': 5, 'size': 50}
  entry = reasoning_gym.create_dataset(name, **kwargs)[j]
  spec = {
    'dataset': name,
    'kwargs': kwargs,
    'entry': entry,
    'extract': extract,
    'threshold': threshold,
    'unsafe': False,
  }
  return {'prompt': entry['question'], 'answer': str(entry['answer']), 'reasoning_gym': spec}


def candidates(entry):
  """Answers right, half-right and wrong for an entry."""
  answer = entry['answer']
  if answer is None:  # graph_color: a coloring from the metadata, and that coloring broken
    right = entry['metadata']['possible_answer']
    broken = {v: 1 for v in right}
    return [json.dumps(right), json.dumps(broken), 'no idea']
  answer = str(answer)
  return [answer, answer + ' extra words', answer[:-1], answer[::-1], 'x', '']


def completion(answer):
  return f'<think>Working it out.</think>\n<answer>{answer}</answer>'


def cases():
  out = []
  for name in DATASETS_USED:
    for j in range(3):
      row = make_row(name, j)
      out += [(row, completion(a)) for a in candidates(row['reasoning_gym']['entry'])]
  return out


def test_scores_are_the_datasets_own_scorers():
  """Equal to `score_answer` of the dataset made with the same settings, on
  the answer reasoning-gym's own `extract_answer` reads, for right, partly
  right and wrong answers (and graph_color, whose entries have no answer)."""
  rows_completions = cases()
  rows = [r for r, _ in rows_completions]
  texts = [c for _, c in rows_completions]
  got = rewards.get_reward_fn('reasoning_gym')([''] * len(texts), texts, rows)
  want = []
  for row, text in rows_completions:
    spec = row['reasoning_gym']
    ds = reasoning_gym.create_dataset(spec['dataset'], **spec['kwargs'])
    want.append(ds.score_answer(extract_answer(text), spec['entry']))
  assert got == pytest.approx(want, abs=0)
  assert any(0.0 < v < 1.0 for v in got), 'no partial-credit case'
  assert 1.0 in got and 0.0 in got
  graph = [v for (row, _), v in zip(rows_completions, got, strict=True) if row['answer'] == 'None']
  assert graph.count(1.0) == 3  # right colorings score 1 though the entry's answer is None


def test_scores_through_the_reward_workers_equal_in_process():
  """Run as the trainer runs it (worker processes, rows pickled): the same scores."""
  rows_completions = cases()[:40]
  rows = [r for r, _ in rows_completions]
  texts = [c for _, c in rows_completions]
  direct = rg_reward.reasoning_gym_score([''] * len(texts), texts, rows)
  with rewards.RewardService(['reasoning_gym'], mode='process', workers=1, timeout_s=60) as s:
    scored = s([''] * len(texts), texts, rows)
  assert scored.failures['reasoning_gym'] == 0, scored.errors
  assert scored.per_fn['reasoning_gym'].tolist() == pytest.approx(direct)


def test_threshold_turns_partial_credit_into_zero_or_one():
  row = make_row('spell_backward', 0)
  right = row['reasoning_gym']['entry']['answer']
  texts = [completion(right), completion(right[:-1]), completion('zz')]
  partial = rg_reward.reasoning_gym_score([''] * 3, texts, [row] * 3)
  assert partial[0] == 1.0 and 0.5 <= partial[1] < 1.0 and partial[2] == 0.0
  strict = make_row('spell_backward', 0, threshold=0.99)
  loose = make_row('spell_backward', 0, threshold=0.5)
  assert rg_reward.reasoning_gym_score([''] * 3, texts, [strict] * 3) == [1.0, 0.0, 0.0]
  assert rg_reward.reasoning_gym_score([''] * 3, texts, [loose] * 3) == [1.0, 1.0, 0.0]


def test_settings_the_scorer_reads_are_the_rows():
  """decimal_arithmetic's scorer allows an error of one unit in the last of
  its config's decimal places: the row's settings decide, as the dataset that
  made it would (one place: 0.05 off is right; the default three: wrong)."""
  row = make_row('decimal_arithmetic', 0, min_num_decimal_places=1, max_num_decimal_places=1)
  entry = row['reasoning_gym']['entry']
  near = str(Decimal(entry['answer']) + Decimal('0.05'))
  default = reasoning_gym.create_dataset('decimal_arithmetic')
  assert default.score_answer(near, entry) == 0.0
  got = rg_reward.reasoning_gym_score([''] * 2, [completion(near), completion('0')], [row] * 2)
  assert got == [1.0, 0.0]


@pytest.mark.parametrize(
  'text',
  [
    'no tags at all',
    '<answer>1</answer> then <answer> 2 </answer>',
    '<answer>\n7\n</answer>',
    '<answer></answer>',
    '<answer> </answer>',
    '<answer>open only',
    '<answer>a<answer>b</answer>',
    '</answer><answer>x</answer><answer>',
    '<answer>1</answer><answer>2',
    '<answer>multi\nline</answer>',
  ],
)
def test_answer_tag_reads_as_reasoning_gym_does(text):
  assert rg_reward.extract(text, 'answer_tag') == extract_answer(text)


def test_other_extractors():
  assert rg_reward.extract('work\n\n  42  \n\n', 'last_line') == '42'
  assert rg_reward.extract('  42 \n', 'whole') == '42'
  assert rg_reward.extract('   ', 'last_line') is None
  assert rg_reward.extract('3 - 5 = -2. The answer is -2.', 'last_number') == '-2'
  assert rg_reward.extract('in all 1,234 legs', 'last_number') == '1234'
  assert rg_reward.extract('about 2.50 each', 'last_number') == '2.50'
  assert rg_reward.extract('no digits', 'last_number') is None
  with pytest.raises(ValueError, match=r'task\.reasoning_gym\.answer'):
    rg_reward.extract('x', 'first_line')
  row = make_row('chain_sum', 0, extract='last_line')
  right = row['reasoning_gym']['entry']['answer']
  texts = [f'I add them.\n{right}', f'{right}\nthat is all']
  assert rg_reward.reasoning_gym_score([''] * 2, texts, [row] * 2) == [1.0, 0.0]
  row['reasoning_gym']['extract'] = 'last_number'
  texts = [f'1 + 2 = 3, so the answer is {right}.', f'{right}, or maybe {int(right) + 1}']
  assert rg_reward.reasoning_gym_score([''] * 2, texts, [row] * 2) == [1.0, 0.0]


def test_no_answer_and_a_raising_scorer_are_zero_not_unscored(monkeypatch):
  row = make_row('chain_sum', 0)
  ds = rg_reward.dataset('chain_sum', row['reasoning_gym']['kwargs'])

  def broken(answer, entry):
    raise TypeError('a scorer bug')

  monkeypatch.setattr(ds, 'score_answer', broken)
  texts = ['I do not know', completion('5')]
  assert rg_reward.reasoning_gym_score([''] * 2, texts, [row] * 2) == [0.0, 0.0]


def test_a_row_without_its_spec_is_refused_by_name():
  with pytest.raises(ValueError, match="no 'reasoning_gym' field"):
    rg_reward.reasoning_gym_score([''], ['<answer>1</answer>'], [{'answer': '1'}])


def _reaches_eval(cls):
  """Whether `cls.score_answer`, or a function of its module or method of its
  class that it calls (transitively), calls eval / exec / sympy's parse_expr
  on something other than the entry (the oracle answer, the problem)."""
  module = sys.modules[cls.__module__]
  seen, source = set(), []

  def visit(fn):
    text = inspect.getsource(fn)
    source.append(text)
    for name in set(re.findall(r'\b(\w+)\(', text)):
      target = getattr(cls, name, None) or getattr(module, name, None)
      if name in seen or not callable(target):
        continue
      seen.add(name)
      if str(getattr(target, '__module__', '')).startswith('reasoning_gym'):
        try:
          visit(target)
        except (OSError, TypeError):
          pass

  visit(cls.score_answer)
  calls = re.findall(r'\b(?:eval|exec|parse_expr|sympify)\(([^)]*)\)', '\n'.join(source))
  return any(not re.match(r'\s*(entry|problem)\b', arg) for arg in calls)


def test_evaluating_scorers_are_the_refused_list():
  """EVALUATES_ANSWERS is what reading the installed scorers finds."""
  found = {
    name
    for name, (cls, _) in DATASETS.items()
    if cls.score_answer is not ProceduralDataset.score_answer and _reaches_eval(cls)
  }
  found.discard('composite')  # scores through the datasets it holds
  assert found == set(rg_reward.EVALUATES_ANSWERS)


def test_an_evaluating_scorer_is_refused_unless_allowed():
  row = make_row('puzzle24', 0)
  with pytest.raises(ValueError, match='unsafe_scorers'):
    rg_reward.reasoning_gym_score([''], ['<answer>1+2</answer>'], [row])
  row['reasoning_gym']['unsafe'] = True
  ds = reasoning_gym.create_dataset('puzzle24', **row['reasoning_gym']['kwargs'])
  want = ds.score_answer('1+2', row['reasoning_gym']['entry'])
  assert rg_reward.reasoning_gym_score([''], ['<answer>1+2</answer>'], [row]) == [want]


@pytest.fixture
def canary(tmp_path):
  path = tmp_path / 'executed'
  yield path
  assert not path.exists(), 'a hostile completion ran code'


def test_hostile_completions_run_nothing_and_never_score(canary):
  """The corpus of tests/rewards/test_hostile.py, bare and inside answer tags,
  through the reward workers: no chunk fails or times out, nothing runs, no 1.0."""
  row = make_row('chain_sum', 0)
  corpus = hostile.corpus(canary)
  texts = [t for _, t in corpus] + [completion(t) for _, t in corpus]
  labels = [label for label, _ in corpus] * 2
  with rewards.RewardService(['reasoning_gym'], mode='process', workers=2, timeout_s=60) as s:
    scored = s([''] * len(texts), texts, [row] * len(texts))
  assert scored.failures['reasoning_gym'] == 0, scored.errors
  assert scored.timeouts['reasoning_gym'] == 0, scored.errors
  wrong = [label for label, v in zip(labels, scored.per_fn['reasoning_gym'], strict=True) if v == 1]
  assert not wrong, wrong


def test_the_core_does_not_import_reasoning_gym():
  """`import jrl`, its rewards, data and trainers leave reasoning-gym unimported."""
  import subprocess

  code = (
    'import sys, jrl, jrl.rewards, jrl.data, jrl.data.tasks, jrl.trainers; '
    "print('reasoning_gym' in sys.modules)"
  )
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == 'False'
