"""The test layouts of code data sets, read into one of three kinds of tests.

    tests = parse(row)                  # the layout detected from the row's fields
    tests = parse(row, 'humaneval')     # or named (`reward.code.format`)
    tests.kind                          # 'stdin' | 'call' | 'asserts'
    tests.format                        # the layout it was read from

Kinds:
  StdinTests   (input, expected stdout) pairs; stdout compared line by line
               after stripping trailing whitespace.
  CallTests    a function (or a class's method) called with arguments; the
               return value judged outside the sandbox (`compare.Expect`).
  AssertTests  assert code run beside the program, in a process of its own
               that calls the program's names over pipes
               (`reward.code.asserts='in_program'`, see sandbox/driver.py).

Layouts (`FORMATS`), each read from the row's own fields:
  'stdin'          jrl's: tests = [{"input": str, "output": str}, ...]
  'call'           jrl's: tests = {"fn_name": str, "class_name": str | null,
                   "cases": [{"args": [...], "kwargs": {...}, "output": v,
                   "accept": [v, ...], ...Expect fields}], "encoding": "json" |
                   "tagged", "prefix": str, ...Expect fields for every case}
  'apps'           APPS / TACO: input_output (or tests) = {"inputs", "outputs",
                   "fn_name"?}; with fn_name call-based, else stdin
  'codecontests'   public_tests / private_tests / generated_tests =
                   {"input": [...], "output": [...]}
  'livecodebench'  public_test_cases / private_test_cases (JSON, or the
                   compressed form of the release files) with "testtype"
                   'stdin' or 'functional', and metadata = {"func_name": ...}
  'humaneval'      test (a `check(candidate)` of asserts) + entry_point;
                   the row's prompt is the program's prefix
  'mbpp'           test_list (assert statements) [+ test_setup_code]
HumanEval and MBPP asserts are converted into call-based cases by
`convert.py`; a row that does not convert entirely is refused, naming what
did not convert, unless `asserts='in_program'` keeps it as AssertTests.

Every error is a ValueError naming the field; the data readers add the file
and line. Keys a layout does not know are refused, never ignored.
"""

import base64
import dataclasses
import json
import logging
import pickle
import zlib

from jrl.rewards.code import compare, convert
from jrl.rewards.code.cases import AssertTests, CallCase, CallTests, StdinTests

FORMATS = ('auto', 'stdin', 'call', 'apps', 'codecontests', 'livecodebench', 'humaneval', 'mbpp')
ASSERTS = ('refuse', 'in_program')
_log = logging.getLogger(__name__)
_logged = set()


def _json_field(row, key):
  value = row[key]
  if isinstance(value, str | bytes):
    try:
      return json.loads(value)
    except ValueError as e:
      raise ValueError(f'field `{key}` is not valid JSON: {e}') from None
  return value


def _text(value, where):
  if isinstance(value, list) and all(isinstance(v, str) for v in value):
    return '\n'.join(value)  # APPS: a list of lines
  if not isinstance(value, str):
    raise ValueError(f'{where} must be a string, got {type(value).__name__}')
  return value


def _nonempty(cases, where):
  if not cases:
    raise ValueError(f'{where} holds no test case: nothing to score a program against.')
  return cases


def stdin_cases(tests, where='field `tests`'):
  if not isinstance(tests, list):
    raise ValueError(f'{where} must be a list of {{"input": str, "output": str}}')
  out = []
  for i, case in enumerate(tests):
    if not isinstance(case, dict) or set(case) - {'input', 'output'} or len(case) != 2:
      raise ValueError(f'{where}[{i}] must be {{"input": str, "output": str}}, got {case!r:.200}')
    out.append(
      (_text(case['input'], f'{where}[{i}].input'), _text(case['output'], f'{where}[{i}].output'))
    )
  return StdinTests(tuple(_nonempty(out, where)))


_EXPECT_KEYS = {f.name for f in dataclasses.fields(compare.Expect)} - {'values'}
_CALL_KEYS = {'fn_name', 'class_name', 'cases', 'encoding', 'prefix', *_EXPECT_KEYS}
_CASE_KEYS = {'args', 'kwargs', 'output', 'accept', *_EXPECT_KEYS}


def _expect(fields, values, where):
  try:
    return compare.Expect(values=tuple(values), **fields)
  except (TypeError, ValueError) as e:
    raise ValueError(f'{where}: {e}') from None


def call_tests(tests, where='field `tests`', prefix=''):
  """jrl's call-based layout (see the module docstring)."""
  if not isinstance(tests, dict):
    raise ValueError(f'{where} must be an object with fn_name and cases')
  unknown = set(tests) - _CALL_KEYS
  if unknown:
    raise ValueError(f'{where} has unknown keys {sorted(unknown)}; known: {sorted(_CALL_KEYS)}')
  fn_name = tests.get('fn_name')
  if not isinstance(fn_name, str) or not fn_name.isidentifier():
    raise ValueError(f'{where}.fn_name must be an identifier, got {fn_name!r:.80}')
  class_name = tests.get('class_name')
  if class_name is not None and (not isinstance(class_name, str) or not class_name.isidentifier()):
    raise ValueError(f'{where}.class_name must be an identifier or null, got {class_name!r:.80}')
  encoding = tests.get('encoding', 'json')
  if encoding not in ('json', 'tagged'):
    raise ValueError(f"{where}.encoding must be 'json' or 'tagged', got {encoding!r:.40}")
  decode = compare.from_tagged if encoding == 'tagged' else (lambda v: v)
  shared = {k: tests[k] for k in _EXPECT_KEYS if k in tests}
  if encoding == 'json':
    shared.setdefault('json', True)
  cases = tests.get('cases')
  if not isinstance(cases, list):
    raise ValueError(f'{where}.cases must be a list')
  out = []
  for i, case in enumerate(cases):
    at = f'{where}.cases[{i}]'
    if not isinstance(case, dict):
      raise ValueError(f'{at} must be an object with args and output')
    unknown = set(case) - _CASE_KEYS
    if unknown:
      raise ValueError(f'{at} has unknown keys {sorted(unknown)}; known: {sorted(_CASE_KEYS)}')
    try:
      args = decode(case.get('args', []))
      kwargs = decode(case.get('kwargs', {'$d': []} if encoding == 'tagged' else {}))
      values = [decode(case['output'])] if 'output' in case else []
      values += [decode(v) for v in case.get('accept', [])]
    except compare.BadValue as e:
      raise ValueError(f'{at}: {e}') from None
    if type(args) not in (list, tuple):
      raise ValueError(f'{at}.args must be a list of arguments')
    if type(kwargs) is not dict or not all(isinstance(k, str) for k in kwargs):
      raise ValueError(f'{at}.kwargs must map argument names to values')
    fields = {**shared, **{k: case[k] for k in _EXPECT_KEYS if k in case}}
    out.append(CallCase(tuple(args), dict(kwargs), _expect(fields, values, at)))
  _nonempty(out, f'{where}.cases')
  return CallTests(fn_name, tuple(out), class_name, str(tests.get('prefix', prefix)))


def apps(row):
  """APPS / TACO: input_output (or tests) = {"inputs", "outputs", "fn_name"?}."""
  key = 'input_output' if 'input_output' in row else 'tests'
  io = _json_field(row, key)
  if not isinstance(io, dict) or 'inputs' not in io or 'outputs' not in io:
    raise ValueError(f'field `{key}` must be an object with "inputs" and "outputs"')
  unknown = set(io) - {'inputs', 'outputs', 'fn_name'}
  if unknown:
    raise ValueError(f'field `{key}` has unknown keys {sorted(unknown)}')
  inputs, outputs = io['inputs'], io['outputs']
  if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
    raise ValueError(f'field `{key}`: "inputs" and "outputs" must be lists of one length')
  fn_name = io.get('fn_name')
  if fn_name is None:
    pairs = [
      {'input': _text(i, f'`{key}`.inputs[{n}]'), 'output': _text(o, f'`{key}`.outputs[{n}]')}
      for n, (i, o) in enumerate(zip(inputs, outputs, strict=True))
    ]
    return dataclasses.replace(stdin_cases(pairs, f'field `{key}`'), format='apps')
  cases = []
  for n, (args, out) in enumerate(zip(inputs, outputs, strict=True)):
    if not isinstance(args, list):
      raise ValueError(f"field `{key}`.inputs[{n}] must be the list of a call's arguments")
    # APPS's judge accepts the output or, for a one-element list, its element
    accept = [out[0]] if isinstance(out, list) and len(out) >= 1 else []
    cases.append({'args': args, 'output': out, 'accept': accept})
  tests = call_tests(
    {'fn_name': fn_name, 'class_name': 'Solution', 'cases': cases}, f'field `{key}`'
  )
  return dataclasses.replace(tests, format='apps')


def codecontests(row):
  """CodeContests: public_tests / private_tests / generated_tests, each
  {"input": [...], "output": [...]}."""
  pairs = []
  for key in ('public_tests', 'private_tests', 'generated_tests'):
    if key not in row or row[key] is None:
      continue
    block = _json_field(row, key)
    if not isinstance(block, dict) or set(block) != {'input', 'output'}:
      raise ValueError(f'field `{key}` must be {{"input": [...], "output": [...]}}')
    if len(block['input']) != len(block['output']):
      raise ValueError(f'field `{key}`: "input" and "output" differ in length')
    pairs += [
      {'input': i, 'output': o} for i, o in zip(block['input'], block['output'], strict=True)
    ]
  return dataclasses.replace(
    stdin_cases(pairs, 'fields `public_tests`/`private_tests`'), format='codecontests'
  )


class _NoGlobals(pickle.Unpickler):
  """Plain data only: a pickle that names any class or function is refused."""

  def find_class(self, module, name):
    raise pickle.UnpicklingError(f'refused: the pickle names {module}.{name}')


def _lcb_cases(value, key):
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except ValueError:  # the release files compress the private cases
      try:
        raw = zlib.decompress(base64.b64decode(value))
        import io

        value = json.loads(_NoGlobals(io.BytesIO(raw)).load())
      except Exception as e:
        raise ValueError(f'field `{key}` is neither JSON nor compressed test cases: {e}') from None
  if not isinstance(value, list):
    raise ValueError(f'field `{key}` must be a list of test cases')
  return value


def livecodebench(row):
  """LiveCodeBench: public_test_cases / private_test_cases with testtype, metadata.func_name."""
  raw = []
  for key in ('public_test_cases', 'private_test_cases', 'tests'):
    if key in row and row[key] not in (None, ''):
      raw += [(f'{key}[{i}]', c) for i, c in enumerate(_lcb_cases(row[key], key))]
  types = set()
  for where, case in raw:
    if not isinstance(case, dict) or set(case) - {'input', 'output', 'testtype'}:
      raise ValueError(
        f'field `{where}` must be {{"input", "output", "testtype"}}, got {case!r:.200}'
      )
    types.add(case.get('testtype'))
  if types == {'stdin'}:
    pairs = [{'input': c['input'], 'output': c['output']} for _, c in raw]
    return dataclasses.replace(
      stdin_cases(pairs, 'field `public_test_cases`'), format='livecodebench'
    )
  if types != {'functional'}:
    raise ValueError(
      "test cases must all have testtype 'stdin' or all 'functional', "
      f'got {sorted(map(str, types))}'
    )
  meta = _json_field(row, 'metadata') if 'metadata' in row else {}
  fn_name = meta.get('func_name') if isinstance(meta, dict) else None
  if not fn_name:
    raise ValueError(
      'functional test cases need the function name in field `metadata` ({"func_name": ...})'
    )
  cases = []
  for where, case in raw:
    try:
      args = [json.loads(line) for line in case['input'].split('\n') if line.strip()]
      output = json.loads(case['output'])
    except (ValueError, AttributeError) as e:
      raise ValueError(
        f'field `{where}`: input lines and output must be JSON values: {e}'
      ) from None
    cases.append({'args': args, 'output': output})
  tests = call_tests({'fn_name': fn_name, 'class_name': 'Solution', 'cases': cases}, 'test cases')
  return dataclasses.replace(tests, format='livecodebench')


def _asserts(row, converted, check, entry_point, prefix, fmt, asserts):
  if converted.cases is not None:
    return CallTests(entry_point, converted.cases, None, prefix, fmt)
  if asserts == 'in_program':
    return AssertTests(check, entry_point, prefix, fmt)
  raise ValueError(
    f'the {fmt} asserts do not convert to call-based tests ({"; ".join(converted.problems)}); '
    "reward.code.asserts='in_program' runs them beside the program instead"
  )


def humaneval(row, asserts='refuse'):
  """HumanEval: test = "def check(candidate): assert ...", entry_point, prompt."""
  test, entry_point = row.get('test'), row.get('entry_point')
  if (
    not isinstance(test, str) or not isinstance(entry_point, str) or not entry_point.isidentifier()
  ):
    raise ValueError('fields `test` (a string) and `entry_point` (an identifier) are needed')
  prefix = row.get('code_prefix', row.get('prompt', ''))
  if not isinstance(prefix, str):
    raise ValueError("field `code_prefix` (or a text `prompt`) must be the program's opening")
  converted = convert.humaneval_check(test)
  check = f'{test}\n' if converted.cases is None else ''
  return _asserts(row, converted, check, entry_point, prefix, 'humaneval', asserts)


def mbpp(row, asserts='refuse'):
  """MBPP: test_list = ["assert f(...) == ...", ...], test_setup_code."""
  tests = row.get('test_list')
  if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
    raise ValueError('field `test_list` must be a list of assert statements')
  tests = tests + list(row.get('challenge_test_list') or [])
  setup = row.get('test_setup_code') or ''
  converted = convert.assert_lines(tests, setup)
  entry = converted.fn_name or convert.called_name(tests)
  if entry is None:
    raise ValueError('field `test_list`: no assert calls a function by name')
  check = ''
  if converted.cases is None:
    body = '\n'.join('  ' + t for t in tests)
    check = f'{setup}\ndef check(candidate):\n  {entry} = candidate\n{body}\n'
  return _asserts(row, converted, check, entry, '', 'mbpp', asserts)


def detect(row):
  """The layout of `row`, from its fields (see the module docstring)."""
  if 'tests' in row:
    tests = _json_field(row, 'tests')
    if isinstance(tests, list):
      if tests and all(isinstance(c, dict) and 'testtype' in c for c in tests):
        return 'livecodebench'
      return 'stdin'
    if isinstance(tests, dict):
      if 'cases' in tests:
        return 'call'
      if 'inputs' in tests:
        return 'apps'
    raise ValueError(
      'field `tests`: neither a list of {"input", "output"} nor a call-based '
      'object {"fn_name", "cases"} nor APPS {"inputs", "outputs"}'
    )
  if 'input_output' in row:
    return 'apps'
  if 'public_test_cases' in row or 'private_test_cases' in row:
    return 'livecodebench'
  if 'public_tests' in row or 'private_tests' in row:
    return 'codecontests'
  if 'test' in row and 'entry_point' in row:
    return 'humaneval'
  if 'test_list' in row:
    return 'mbpp'
  raise ValueError(
    f'no test cases in this row (fields {sorted(row)[:20]}): code_tests reads `tests` '
    '(jrl stdin or call-based), `input_output` (APPS/TACO), `public_test_cases` '
    '(LiveCodeBench), `public_tests` (CodeContests), `test` + `entry_point` (HumanEval) '
    'or `test_list` (MBPP)'
  )


def parse(row, fmt='auto', asserts='refuse'):
  """The tests of one data row (its metadata): StdinTests | CallTests | AssertTests.

  Args:
    row: the row's fields (a dict).
    fmt: one of FORMATS; 'auto' detects it from the fields (and logs it once).
    asserts: 'refuse' | 'in_program', for assert tests that do not convert.
  Raises:
    ValueError naming the field.
  """
  if fmt not in FORMATS:
    raise ValueError(f'reward.code.format must be one of {FORMATS}, got {fmt!r}')
  if asserts not in ASSERTS:
    raise ValueError(f'reward.code.asserts must be one of {ASSERTS}, got {asserts!r}')
  if not isinstance(row, dict):
    raise ValueError(f'a row must be an object of fields, got {type(row).__name__}')
  name = detect(row) if fmt == 'auto' else fmt
  if fmt == 'auto' and name not in _logged:
    _logged.add(name)
    _log.info('code_tests: rows in the %r layout (detected)', name)
  if name == 'stdin':
    return stdin_cases(_json_field(row, _need(row, 'tests')))
  if name == 'call':
    return call_tests(_json_field(row, _need(row, 'tests')), prefix=str(row.get('code_prefix', '')))
  if name == 'apps':
    if 'input_output' not in row:
      _need(row, 'tests')
    return apps(row)
  if name == 'codecontests':
    return codecontests(row)
  if name == 'livecodebench':
    return livecodebench(row)
  if name == 'humaneval':
    return humaneval(row, asserts)
  return mbpp(row, asserts)


def _need(row, key):
  if key not in row:
    raise ValueError(f'missing field `{key}`')
  return key
