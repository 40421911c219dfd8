"""Tests for GSM8K-schema prompt files (`jrl.data.sources.read_prompts`, the
trainer's `Task` and `Encoder`) and the word-problem generator
(`jrl.data.word_problems`, `launch/make_word_problems.py`).

Readers: JSONL and Parquet give the same examples; keys map from config;
the '####' extractor; bad rows name the file and line (Parquet: the row);
too-long prompts are dropped and counted with `task.long_prompts='filter'`
and refused by default. Generator: at least a dozen templates over three
difficulties, deterministic, every answer an integer that the worked solution
and an independent formula per template agree on, splits disjoint. Last, the
shrunken GRPO job takes a step on a generated file.
"""

import ast
import json
import operator
import os
import re
import subprocess
import sys
from fractions import Fraction

import ml_collections
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from configs import grpo_arith
from jrl import trainers
from jrl.data import sources, tasks, word_problems
from jrl.metrics import read_jsonl as read_metrics
from jrl.models.tokenizer import CharTokenizer, HFTokenizer
from jrl.trainers import controller

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GSM_ROWS = [
  {'question': 'Tom has 3 apples and buys 4 more. How many?', 'answer': '3 + 4 = 7\n#### 7'},
  {'question': 'A shop sells 1,200 pens a day. How many in 2 days?', 'answer': 'x\n#### 2,400'},
  {'question': 'It is 5 degrees and falls by 12. What now?', 'answer': '5 - 12 = -7\n####  -7 '},
]
EXPECTED = [
  {'prompt': GSM_ROWS[0]['question'], 'answer': '7', 'solution': GSM_ROWS[0]['answer']},
  {'prompt': GSM_ROWS[1]['question'], 'answer': '2400', 'solution': GSM_ROWS[1]['answer']},
  {'prompt': GSM_ROWS[2]['question'], 'answer': '-7', 'solution': GSM_ROWS[2]['answer']},
]
GSM = {'prompt_key': 'question', 'answer_extractor': 'gsm8k'}


def write(tmp_path, name, rows):
  """`rows` as tmp_path/name, JSONL or Parquet by the extension."""
  path = str(tmp_path / name)
  if sources.is_parquet(path):
    return sources.write_parquet(path, rows)
  return sources.write_jsonl(path, rows)


def write_lines(path, lines):
  with open(path, 'wb') as f:
    f.write(b'\n'.join(lines) + b'\n')
  return str(path)


def where(path, i):
  """How an error names row `i` (0-based) of a file written by `write`."""
  return f'{path}: row {i}' if sources.is_parquet(path) else f'{path}:{i + 1}'


# Reading -------------------------------------------------------------------------


@pytest.mark.parametrize('name', ['gsm.jsonl', 'gsm.parquet'])
def test_gsm8k_rows_read_with_key_mapping_and_extractor(tmp_path, name):
  rows = [{**r, 'id': i} for i, r in enumerate(GSM_ROWS)]
  got = sources.read_prompts(write(tmp_path, name, rows), **GSM)
  assert got.rows == [{**e, 'id': i} for i, e in enumerate(EXPECTED)]
  assert got.dropped == []


def test_jsonl_and_parquet_read_the_same_rows(tmp_path):
  rows = [p.row() for p in word_problems.generate(300, 0, 'train')]
  from_jsonl = sources.read_prompts(write(tmp_path, 'wp.jsonl', rows), **GSM)
  from_parquet = sources.read_prompts(write(tmp_path, 'wp.parquet', rows), **GSM)
  assert from_jsonl == from_parquet
  assert len(from_jsonl.rows) == 300
  assert from_jsonl.rows[0]['difficulty'] in (1, 2, 3)


def test_parquet_chat_messages_read_as_messages(tmp_path):
  messages = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '1+1='}]
  path = write(tmp_path, 'chat.parquet', [{'prompt': messages, 'answer': '2'}])
  assert sources.read_prompts(path).rows == [{'prompt': messages, 'answer': '2'}]


@pytest.mark.parametrize('name', ['rows.jsonl', 'rows.parquet'])
def test_default_keys_and_other_answer_key(tmp_path, name):
  path = write(tmp_path, name, [{'prompt': '1+1=', 'target': 2, 'answer': 'ignored'}])
  assert sources.read_prompts(path, answer_key='target').rows == [{'prompt': '1+1=', 'answer': '2'}]
  # Without a mapping the GSM8K file lacks `prompt`: the error names the field and row.
  gsm = write(tmp_path, 'gsm_' + name, GSM_ROWS)
  with pytest.raises(ValueError, match=re.escape(f'{where(gsm, 0)}: missing field `prompt`.')):
    sources.read_prompts(gsm)


@pytest.mark.parametrize(
  ('text', 'value'),
  [
    ('#### 42', '42'),
    ('so 1000 + 234 = 1,234\n#### 1,234', '1234'),
    ('####   7  \n', '7'),
    ('It drops 3 - 10 = -7\n#### -7', '-7'),
    ('#### 1,000,000', '1000000'),
    ('#### 2.5', '2.5'),
    ('first #### 1\n#### 2', '2'),  # the last marker counts
  ],
)
def test_gsm8k_extractor(text, value):
  assert sources.extract_gsm8k_answer(text) == value


@pytest.mark.parametrize('name', ['rows.jsonl', 'rows.parquet'])
@pytest.mark.parametrize(
  ('answer', 'message'),
  [
    ('7', "field `answer` has no '####' before the final answer."),
    ('3 + 4 = 7\n####  ', "field `answer` has nothing after its last '####'."),
  ],
  ids=['no_marker', 'empty'],
)
def test_gsm8k_extractor_errors_name_file_and_line(tmp_path, name, answer, message):
  rows = [dict(r) for r in GSM_ROWS]
  rows[2]['answer'] = answer
  path = write(tmp_path, name, rows)
  with pytest.raises(ValueError, match=re.escape(f'{where(path, 2)}: {message}')):
    sources.read_prompts(path, **GSM)


def test_gsm8k_extractor_refuses_a_number(tmp_path):
  path = write(tmp_path, 'rows.jsonl', [{'question': 'q', 'answer': 7}])
  with pytest.raises(ValueError, match=r'rows\.jsonl:1: field `answer` must be a string ending'):
    sources.read_prompts(path, **GSM)


@pytest.mark.parametrize('name', ['rows.jsonl', 'rows.parquet'])
@pytest.mark.parametrize(
  ('bad', 'message'),
  [
    ({'answer': '#### 1'}, 'missing field `question`.'),
    ({'question': None, 'answer': '#### 1'}, 'missing field `question`.'),
    ({'question': 'q?'}, 'missing field `answer`.'),
    ({'question': '', 'answer': '#### 1'}, 'field `question` must be a non-empty string.'),
  ],
  ids=['no_question', 'null_question', 'no_answer', 'empty_question'],
)
def test_bad_rows_name_file_and_row(tmp_path, name, bad, message):
  rows = [dict(r) for r in GSM_ROWS * 4]
  rows[9] = bad
  path = write(tmp_path, name, rows)
  with pytest.raises(ValueError, match=re.escape(f'{where(path, 9)}: {message}')):
    sources.read_prompts(path, **GSM)


@pytest.mark.parametrize(
  ('line', 'message'),
  [
    (b'{"question": "q", "answer": "#### 1"', 'invalid JSON'),
    (b'["q", "#### 1"]', 'expected a JSON object, got list.'),
    (b'{"question": 12, "answer": "#### 1"}', 'field `question` must be a string or a list'),
    (b'{"question": "q", "answer": ["#### 1"]}', 'field `answer` must be a string or number.'),
    (b'{"question": "caf\xe9?", "answer": "#### 1"}', 'invalid UTF-8 (byte 0xe9 at column 18'),
  ],
  ids=['json', 'not_object', 'prompt_type', 'answer_type', 'utf8'],
)
def test_bad_jsonl_lines_name_file_and_line(tmp_path, line, message):
  lines = [json.dumps(r).encode() for r in GSM_ROWS * 4]
  lines.insert(2, b'')  # blank lines count: line numbers are the file's
  lines[7] = line
  path = write_lines(tmp_path / 'rows.jsonl', lines)
  with pytest.raises(ValueError, match=re.escape(f'{path}:8: {message}')):
    sources.read_prompts(path, **GSM)


def test_parquet_invalid_utf8_names_row_and_column(tmp_path):
  # Arrow does not validate strings when it reads: the reader finds the cell.
  # 2,500 rows, so the bad one lies in the third batch the reader converts.
  questions = [f'q{i}?'.encode() for i in range(2500)]
  questions[2100] = b'caf\xe9?'
  table = pa.table(
    {
      'question': pa.array(questions, pa.binary()).view(pa.string()),
      'answer': ['#### 1'] * 2500,
    }
  )
  path = str(tmp_path / 'bad.parquet')
  pq.write_table(table, path)
  with pytest.raises(ValueError) as info:
    sources.read_prompts(path, **GSM)
  assert str(info.value).startswith(
    f'{path}: row 2100: column `question`: invalid UTF-8 (byte 0xe9 at offset 3'
  )


def test_parquet_wrong_type_and_unreadable_file(tmp_path):
  path = write(tmp_path, 'ints.parquet', [{'question': 5, 'answer': '#### 1'}] * 3)
  with pytest.raises(ValueError, match=re.escape(f'{path}: row 0: field `question` must be')):
    sources.read_prompts(path, **GSM)
  bogus = write_lines(tmp_path / 'bogus.parquet', [b'{"question": "q", "answer": "#### 1"}'])
  with pytest.raises(ValueError, match=re.escape(f'{bogus}: cannot read as Parquet')):
    sources.read_prompts(bogus, **GSM)
  with pytest.raises(FileNotFoundError, match=r'missing\.parquet: file not found'):
    sources.read_prompts(str(tmp_path / 'missing.parquet'))


# Long prompts: dropped with a count, or refused -----------------------------------


def char_checker(max_prompt_len, seq_len=None):
  tok = CharTokenizer()
  encoder = tasks.Encoder(tok, False, False)
  return tasks.ExampleChecker(
    encoder.prompt_ids, tok.encode, max_prompt_len, seq_len or max_prompt_len + 8
  )


def task_config(train_path, eval_path='', **fields):
  c = grpo_arith.get_config().task
  with c.unlocked():
    c.update(kind='file', train_path=train_path, eval_path=eval_path, **GSM)
    c.update(fields)
  return c


def long_rows(n=12, long=(1, 4, 7, 10)):
  """GSM8K rows whose question has 12 characters, or 40 for the rows in `long`."""
  rows = []
  for i in range(n):
    question = f'{i:02d} ' + ('x' * 36 if i in long else 'x' * 8) + '?'
    rows.append({'question': question, 'answer': f'#### {i}'})
  return rows


@pytest.mark.parametrize('ext', ['jsonl', 'parquet'])
def test_filter_drops_long_prompts_and_counts_them(tmp_path, ext):
  train = write(tmp_path, f'train.{ext}', long_rows(12))
  held_out = write(tmp_path, f'eval.{ext}', long_rows(6))  # rows 1 and 4 are long
  check = char_checker(max_prompt_len=20)
  task = tasks.Task(task_config(train, held_out, long_prompts='filter'), 0, check.prompt)
  assert [ex['answer'] for ex in task.train] == ['0', '2', '3', '5', '6', '8', '9', '11']
  assert [ex['answer'] for ex in task.held_out] == ['0', '2', '3', '5']
  assert task.filtered == {'train': 4, 'eval': 2}
  got = sources.read_prompts(train, check=check.prompt, drop=(tasks.PromptTooLong,), **GSM).dropped
  assert [w for w, _ in got] == [where(train, i) for i in (1, 4, 7, 10)]
  assert got[0][1] == 'field `prompt` is 40 tokens, more than `task.max_prompt_len`=20.'


@pytest.mark.parametrize('ext', ['jsonl', 'parquet'])
def test_error_mode_refuses_the_first_long_prompt(tmp_path, ext):
  train = write(tmp_path, f'train.{ext}', long_rows(12))
  check = char_checker(max_prompt_len=20)
  with pytest.raises(
    ValueError, match=re.escape(f'{where(train, 1)}: field `prompt` is 40 tokens')
  ):
    tasks.Task(task_config(train), 0, check.prompt)  # long_prompts='error', the default


def test_filter_still_refuses_bad_rows(tmp_path):
  check = char_checker(max_prompt_len=20)
  rows = long_rows(12)
  rows[5]['question'] = 'caf\u00e9?'  # outside the char tokenizer: not a length problem
  train = write(tmp_path, 'train.jsonl', rows)
  with pytest.raises(ValueError, match=re.escape(f"{train}:6: field `prompt`: character 'é'")):
    tasks.Task(task_config(train, long_prompts='filter'), 0, check.prompt)
  rows = long_rows(12)
  rows[8] = {'question': 'q?'}
  train = write(tmp_path, 'missing.parquet', rows)
  with pytest.raises(ValueError, match=re.escape(f'{train}: row 8: missing field `answer`.')):
    tasks.Task(task_config(train, long_prompts='filter'), 0, check.prompt)


def test_filter_refuses_a_file_of_only_long_prompts(tmp_path):
  train = write(tmp_path, 'train.jsonl', long_rows(4, long=range(4)))
  check = char_checker(max_prompt_len=20)
  with pytest.raises(ValueError, match=re.escape(f'{train}: all 4 rows were dropped (the first: ')):
    tasks.Task(task_config(train, long_prompts='filter'), 0, check.prompt)


@pytest.mark.parametrize(
  ('field', 'value'), [('long_prompts', 'drop'), ('answer_extractor', 'hashes')]
)
def test_task_choices_name_the_field(tmp_path, field, value):
  train = write(tmp_path, 'train.jsonl', GSM_ROWS)
  with pytest.raises(ValueError, match=re.escape(f'`task.{field}` must be one of')):
    tasks.Task(task_config(train, **{field: value}), 0)


def test_old_kind_jsonl_still_reads_prompt_rows(tmp_path):
  train = write(tmp_path, 'train.jsonl', [{'prompt': '1+1=', 'answer': '2'}])
  c = grpo_arith.get_config().task
  with c.unlocked():
    c.update(kind='jsonl', train_path=train)
  assert tasks.Task(c, 0).train == [{'prompt': '1+1=', 'answer': '2'}]


# System prompt and template variables -----------------------------------------------


TEMPLATE = (
  '{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}'
  '{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}'
  '{% if add_generation_prompt %}[assistant]{% endif %}'
)


def template_tokenizer():
  model = tokenizers.models.WordLevel({'[UNK]': 0}, unk_token='[UNK]')
  return HFTokenizer(tokenizers.Tokenizer(model), chat_template=TEMPLATE)


def test_system_prompt_and_template_kwargs_reach_the_template():
  tok = template_tokenizer()
  plain = tasks.Encoder(tok, True, False)
  assert plain.prompt_text('2+2?') == '[user]2+2?[assistant]'
  enc = tasks.Encoder(
    tok, True, False, system_prompt='Answer after ####.', template_kwargs={'enable_thinking': False}
  )
  assert enc.prompt_text('2+2?') == '[system]Answer after ####.[user]2+2?[no-think][assistant]'
  # A conversation with its own system message keeps it.
  own = [{'role': 'system', 'content': 'Mine.'}, {'role': 'user', 'content': 'hi'}]
  assert enc.prompt_text(own) == '[system]Mine.[user]hi[no-think][assistant]'
  # The char tokenizer's template: "role: content" lines.
  char = tasks.Encoder(CharTokenizer(), True, False, system_prompt='Be brief.')
  assert char.prompt_text('1+1=') == 'system: Be brief.\nuser: 1+1=\nassistant: '


def test_system_prompt_needs_the_chat_template():
  with pytest.raises(ValueError, match=r'`task\.system_prompt` needs `task\.chat_template`'):
    tasks.Encoder(CharTokenizer(), False, False, system_prompt='Be brief.')


def test_system_prompt_counts_towards_the_prompt_length(tmp_path):
  # 'system: ' + 30 + '\n' + 'user: ' + 12 + '\n' + 'assistant: ' = 69 characters.
  tok = CharTokenizer()
  encoder = tasks.Encoder(tok, True, False, system_prompt='s' * 30)
  train = write(tmp_path, 'train.jsonl', long_rows(6, long=()))
  config = task_config(train, long_prompts='filter')
  check = tasks.ExampleChecker(encoder.prompt_ids, tok.encode, 69, 80)
  assert len(tasks.Task(config, 0, check.prompt).train) == 6
  check = tasks.ExampleChecker(encoder.prompt_ids, tok.encode, 68, 80)
  with pytest.raises(ValueError, match='all 6 rows were dropped'):
    tasks.Task(config, 0, check.prompt)


# The generator ----------------------------------------------------------------------


def _formula(name, p):
  """Each template's answer from its parameters, written out again here."""
  return {
    'buy_items': lambda: p['n'] * p['p'],
    'give_away': lambda: p['have'] - p['give'],
    'share_equally': lambda: Fraction(p['total'], p['k']),
    'half_of': lambda: Fraction(p['total'], 2),
    'rate_time': lambda: p['rate'] * p['time'],
    'age_later': lambda: p['age'] + p['years'],
    'find_more': lambda: p['have'] + p['more'],
    'eat_some': lambda: p['have'] - p['eat'],
    'twice_as_many': lambda: 2 * p['have'],
    'buy_change': lambda: p['bill'] - p['n'] * p['p'],
    'age_sum': lambda: 2 * p['age'] + p['older'],
    'third_rest': lambda: Fraction(2 * p['total'], 3),
    'pack_bags': lambda: Fraction(p['batches'] * p['per_batch'], p['bag']),
    'two_readers': lambda: (p['r1'] + p['r2']) * p['hours'],
    'collect_share': lambda: Fraction(p['morning'] + p['afternoon'], p['baskets']),
    'weekly_savings': lambda: p['per_week'] * p['weeks'] - p['spent'],
    'two_purchases': lambda: p['n1'] * p['p1'] + p['n2'] * p['p2'],
    'budget_left': lambda: p['money'] - p['n'] * p['p'] - p['price'],
    'half_then_give': lambda: Fraction(p['total'], 2) - p['give'] + p['buy'],
    'age_three': lambda: p['age'] + 2 * p['age'] + (2 * p['age'] - p['younger']),
    'thirds_cartons': lambda: Fraction(p['total'] - Fraction(p['total'], 3), p['carton']),
    'trip_distance': lambda: p['r1'] * p['h1'] + p['r2'] * p['h2'],
  }[name]()


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: Fraction}


def _exact(node):
  """An arithmetic expression's value, with exact division."""
  if isinstance(node, ast.Constant) and isinstance(node.value, int):
    return Fraction(node.value)
  if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
    return _OPS[type(node.op)](_exact(node.left), _exact(node.right))
  raise AssertionError(f'not plain arithmetic: {ast.dump(node)}')


EQUATION = re.compile(r'(\d+(?: [-+*/] \d+)+) = (\d+)')


@pytest.fixture(scope='module')
def problems():
  return word_problems.generate(3000, 0, 'train') + word_problems.generate(600, 0, 'eval')


def test_at_least_a_dozen_templates_over_three_difficulties():
  templates = word_problems.TEMPLATES
  assert len(templates) >= 12
  assert len({t.name for t in templates}) == len(templates)
  assert {t.difficulty for t in templates} == {1, 2, 3}
  for difficulty in (1, 2, 3):
    assert sum(t.difficulty == difficulty for t in templates) >= 4
  topics = {t.topic for t in templates}
  assert {'people', 'items', 'prices', 'halves', 'thirds', 'rates', 'ages', 'sharing'} <= (
    topics | {'people'}  # every template names people; 'people' is no topic of its own
  )


def test_every_answer_is_a_correct_integer(problems):
  seen = set()
  for p in problems:
    seen.add(p.template)
    assert isinstance(p.answer, int) and p.answer >= 0, p
    assert _formula(p.template, p.params) == p.answer, p
    equations = [EQUATION.search(line) for line in p.steps]
    assert all(equations), p.steps  # one equation a line
    assert len(equations) == p.difficulty
    for m in equations:  # every step's arithmetic is right, and exact
      assert _exact(ast.parse(m.group(1), mode='eval').body) == int(m.group(2)), m.group(0)
    assert int(equations[-1].group(2)) == p.answer
    row = p.row()
    assert row['answer'].endswith(f'\n#### {p.answer}')
    assert sources.extract_gsm8k_answer(row['answer']) == str(p.answer)
    assert set(row) == {'question', 'answer', 'difficulty', 'template'}
  assert seen == set(word_problems.BY_NAME)  # every template was drawn and checked


def test_each_difficulty_present_and_mix(problems):
  counts = {k: sum(p.difficulty == k for p in problems) for k in (1, 2, 3)}
  assert min(counts.values()) > len(problems) / 5, counts
  only_hard = word_problems.generate(50, 0, 'train', weights=(0, 0, 1))
  assert {p.difficulty for p in only_hard} == {3}
  with pytest.raises(ValueError, match='`weights` must be 3 non-negative numbers'):
    word_problems.generate(5, 0, 'train', weights=(1, 1))


def test_deterministic_and_seeded():
  a = word_problems.generate(200, 3, 'train')
  assert a == word_problems.generate(200, 3, 'train')
  assert a[:50] == word_problems.generate(50, 3, 'train')  # a prefix of a longer run
  assert a != word_problems.generate(200, 4, 'train')


def test_splits_are_disjoint_and_without_repeats(problems):
  train = [p.question for p in problems if word_problems.split_of(p.question) == 'train']
  held_out = [p.question for p in problems if word_problems.split_of(p.question) == 'eval']
  assert len(train) == 3000 and len(held_out) == 600
  assert len(set(train)) == len(train) and len(set(held_out)) == len(held_out)
  assert not set(train) & set(held_out)


def test_char_tokenizer_encodes_every_problem(problems):
  tok = CharTokenizer()
  for p in problems:
    row = p.row()
    tok.encode(row['question'])
    tok.encode(row['answer'])


def test_launcher_writes_the_same_files_every_time(tmp_path):
  def run(out):
    cmd = [sys.executable, 'launch/make_word_problems.py', f'--out={out}', '--train=120']
    cmd += ['--eval=40', '--seed=5', '--parquet']
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout

  out = run(tmp_path / 'a')
  assert f'{tmp_path / "a" / "train.jsonl"}: 120 rows (' in out
  run(tmp_path / 'b')
  for name in ('train.jsonl', 'eval.jsonl'):
    with open(tmp_path / 'a' / name, 'rb') as f, open(tmp_path / 'b' / name, 'rb') as g:
      assert f.read() == g.read()
  for split, n in (('train', 120), ('eval', 40)):
    jsonl = sources.read_prompts(str(tmp_path / 'a' / f'{split}.jsonl'), **GSM)
    parquet = sources.read_prompts(str(tmp_path / 'a' / f'{split}.parquet'), **GSM)
    assert jsonl == parquet and len(jsonl.rows) == n
  train, held_out = (
    {r['prompt'] for r in sources.read_prompts(str(tmp_path / 'a' / name), **GSM).rows}
    for name in ('train.jsonl', 'eval.jsonl')
  )
  assert not train & held_out


# The trainer on a generated file ---------------------------------------------------


def test_grpo_step_on_generated_gsm_jsonl(tmp_path):
  data = tmp_path / 'data'
  word_problems.write_splits(str(data), 64, 16, seed=0)
  fields = {
    'workdir': str(tmp_path / 'run'),
    'model.width': 32,
    'model.mlp_width': 64,
    'model.num_layers': 1,
    'model.head_dim': 8,
    'task.kind': 'file',
    'task.train_path': str(data / 'train.jsonl'),
    'task.eval_path': str(data / 'eval.jsonl'),
    'task.prompt_key': 'question',
    'task.answer_extractor': 'gsm8k',
    'task.long_prompts': 'filter',
    'task.chat_template': True,
    'task.system_prompt': 'Answer with a number.',
    'task.eval_size': 4,
    'sft.steps': 0,
    'rl.steps': 1,
    'rl.prompts_per_step': 4,
    'rl.group_size': 4,
    'rl.minibatch_size': 8,
    'task.max_prompt_len': 160,
    'task.max_response_len': 4,
    'sampler.num_slots': 16,
    'eval.every': 1,
    'log.plot': False,
    'log.tensorboard': False,
    'log.trace': False,
  }
  config = grpo_arith.get_config()
  for key, value in fields.items():
    section, _, name = key.rpartition('.')
    (config[section] if section else config)[name] = value
  assert isinstance(config.task.chat_template_kwargs, ml_collections.ConfigDict)

  # The prompts the trainer will see: system + user lines + 'assistant: '.
  def length(question):
    return len(f'system: Answer with a number.\nuser: {question}\nassistant: ')

  rows = sources.read_prompts(str(data / 'train.jsonl'), **GSM).rows
  too_long = sum(length(r['prompt']) > 160 for r in rows)
  assert 0 < too_long < len(rows)  # the file exercises the filter

  job = trainers.build(config)
  controller.train(job)
  task = job.resources.task
  assert task.filtered['train'] == too_long
  assert len(task.train) == len(rows) - too_long
  assert all(length(ex['prompt']) <= 160 for ex in task.train)
  assert [ex['answer'] for ex in task.held_out] == [
    r['answer']
    for r in sources.read_prompts(str(data / 'eval.jsonl'), **GSM).rows
    if length(r['prompt']) <= 160
  ][:4]
  records = read_metrics(os.path.join(config.workdir, 'metrics.jsonl'))
  assert [r['step'] for r in records] == [0, 1]  # the evaluation before training, one step
  assert 'eval/accuracy' in records[1] and 'reward/mean' in records[1]
