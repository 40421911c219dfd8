"""Assert-style tests (HumanEval's `check(candidate)`, MBPP's `test_list`)
turned into call-based cases, so that their expected values stay outside the
sandbox.

    converted = humaneval_check(row['test'])
    converted.cases       # (CallCase, ...), or None when something did not convert
    converted.problems    # why not: ['line 12: for _ in range(100): ...', ...]

An assert converts when it calls the function under test with literal
arguments and compares the result in one of these ways (f the function, v w
literals):

    f(...) == v    v == f(...)    f(...) is True|False|None    f(...)    not f(...)
    abs(f(...) - v) < w   (or <=, or abs(v - f(...)))    math.isclose(f(...), v, rel_tol=, abs_tol=)
    set(f(...)) == set(v) | v    sorted(f(...)) == sorted(v) | v    tuple(f(...)) == tuple(v) | v
    list(f(...)) == list(v) | v

Literals are Python literals and constant arithmetic on them (`2 ** 10`,
`-1.5`, `float('inf')`, `list(range(5))`, `'ab' * 3`, bounded). Statements that
cannot change a verdict (docstrings, `print(...)`, `pass`, imports, `assert
True`) are skipped; anything else (a loop, a helper call, random inputs, an
assignment) is a problem, and a row converts only when nothing is left over:
a partial conversion would pass programs that the data set fails.
"""

import ast
from typing import NamedTuple

from jrl.rewards.code.cases import CallCase
from jrl.rewards.code.compare import Expect

_MAX_LEN = 100_000  # elements of a constant sequence (range, repetition)


class Converted(NamedTuple):
  cases: tuple | None  # CallCase tuple, None if a problem remains
  problems: tuple  # str: 'line N: <statement>: why'
  fn_name: str | None  # the function the asserts call (MBPP)


class _NotLiteral(ValueError):
  pass  # deliberate: a marker exception


_BINOPS = {
  ast.Add: lambda a, b: a + b,
  ast.Sub: lambda a, b: a - b,
  ast.Mult: lambda a, b: a * b,
  ast.Div: lambda a, b: a / b,
  ast.FloorDiv: lambda a, b: a // b,
  ast.Mod: lambda a, b: a % b,
}
_CONSTRUCTORS = {
  'list': list,
  'tuple': tuple,
  'set': set,
  'frozenset': frozenset,
  'float': float,
  'int': int,
  'str': str,
  'dict': dict,
  'bool': bool,
}


def _bounded(value):
  if isinstance(value, str | bytes | list | tuple) and len(value) > _MAX_LEN:
    raise _NotLiteral('a constant too large')
  if isinstance(value, int) and value.bit_length() > 4096:
    raise _NotLiteral('a constant too large')
  return value


def literal(node):
  """The value of a literal expression node (raises _NotLiteral)."""
  if isinstance(node, ast.Constant):
    return node.value
  if isinstance(node, ast.Tuple):
    return tuple(literal(e) for e in node.elts)
  if isinstance(node, ast.List):
    return [literal(e) for e in node.elts]
  if isinstance(node, ast.Set):
    return {literal(e) for e in node.elts}
  if isinstance(node, ast.Dict):
    if any(k is None for k in node.keys):
      raise _NotLiteral('a ** in a dict')
    return {literal(k): literal(v) for k, v in zip(node.keys, node.values, strict=True)}
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd | ast.Not):
    v = literal(node.operand)
    return -v if isinstance(node.op, ast.USub) else +v if isinstance(node.op, ast.UAdd) else not v
  if isinstance(node, ast.BinOp):
    a, b = literal(node.left), literal(node.right)
    if isinstance(node.op, ast.Pow):
      if not (isinstance(a, int | float) and isinstance(b, int | float)) or abs(b) > 256:
        raise _NotLiteral('a power out of bounds')
      return _bounded(a**b)
    if isinstance(node.op, ast.Mult) and isinstance(b, int) and isinstance(a, str | list | tuple):
      if len(a) * max(b, 0) > _MAX_LEN:
        raise _NotLiteral('a repetition too large')
    op = _BINOPS.get(type(node.op))
    if op is None:
      raise _NotLiteral(f'operator {type(node.op).__name__}')
    try:
      return _bounded(op(a, b))
    except (TypeError, ZeroDivisionError, OverflowError) as e:
      raise _NotLiteral(str(e)) from None
  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
    name = node.func.id
    args = [literal(a) for a in node.args]
    if name == 'range' and all(isinstance(a, int) for a in args) and 1 <= len(args) <= 3:
      r = range(*args)
      if len(r) > _MAX_LEN:
        raise _NotLiteral('a range too long')
      return r
    if name in _CONSTRUCTORS and len(args) <= 1:
      try:
        return _bounded(
          _CONSTRUCTORS[name](*[list(a) if isinstance(a, range) else a for a in args])
        )
      except (TypeError, ValueError) as e:
        raise _NotLiteral(str(e)) from None
  raise _NotLiteral(f'{type(node).__name__} is not a literal')


def _plain(value):
  if isinstance(value, range):
    raise _NotLiteral('a bare range')
  return value


def _call_of(node, fn):
  """(args, kwargs) if `node` calls `fn` (a name) with literal arguments, else None."""
  if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == fn):
    return None
  if any(isinstance(a, ast.Starred) for a in node.args) or any(
    k.arg is None for k in node.keywords
  ):
    raise _NotLiteral('starred arguments')
  args = tuple(_plain(literal(a)) for a in node.args)
  kwargs = {k.arg: _plain(literal(k.value)) for k in node.keywords}
  return args, kwargs


def _wrapped(node, fn):
  """(transform, args, kwargs) for f(...), set(f(...)), sorted(f(...)), list(f(...))."""
  found = _call_of(node, fn)
  if found is not None:
    return (None, *found)
  if (
    isinstance(node, ast.Call)
    and isinstance(node.func, ast.Name)
    and node.func.id in ('set', 'sorted', 'list', 'tuple')
    and len(node.args) == 1
    and not node.keywords
  ):
    found = _call_of(node.args[0], fn)
    if found is not None:
      return (node.func.id, *found)
  return None


def _expected(node):
  value = literal(node)
  if isinstance(value, range):
    value = list(value)
  return value


def _abs_gap(node, fn):
  """(args, kwargs, value) for abs(f(...) - v) or abs(v - f(...))."""
  if not (
    isinstance(node, ast.Call)
    and isinstance(node.func, ast.Name)
    and node.func.id == 'abs'
    and len(node.args) == 1
    and isinstance(node.args[0], ast.BinOp)
    and isinstance(node.args[0].op, ast.Sub)
  ):
    return None
  left, right = node.args[0].left, node.args[0].right
  found = _call_of(left, fn)
  if found is not None:
    return (*found, literal(right))
  found = _call_of(right, fn)
  if found is not None:
    return (*found, literal(left))
  return None


def _case(test, fn):
  """The CallCase an assert's test expression stands for (raises _NotLiteral)."""
  if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
    found = _call_of(test.operand, fn)
    if found is not None:
      return CallCase(found[0], found[1], Expect(cmp='falsy'))
  found = _call_of(test, fn)
  if found is not None:
    return CallCase(found[0], found[1], Expect(cmp='truthy'))
  if (
    isinstance(test, ast.Call)
    and isinstance(test.func, ast.Attribute)
    and test.func.attr == 'isclose'
  ):
    if (
      isinstance(test.func.value, ast.Name) and test.func.value.id == 'math' and len(test.args) == 2
    ):
      found = _call_of(test.args[0], fn)
      tols = {k.arg: literal(k.value) for k in test.keywords}
      if found is not None and set(tols) <= {'rel_tol', 'abs_tol'}:
        return CallCase(
          found[0],
          found[1],
          Expect(
            values=(literal(test.args[1]),),
            cmp='isclose',
            rel_tol=tols.get('rel_tol', 1e-9),
            tol=tols.get('abs_tol', 0.0),
          ),
        )
  if isinstance(test, ast.Compare) and len(test.ops) == 1:
    op, left, right = test.ops[0], test.left, test.comparators[0]
    if isinstance(op, ast.Eq):
      for call_side, value_side in ((left, right), (right, left)):
        wrapped = _wrapped(call_side, fn)
        if wrapped is not None:
          transform, args, kwargs = wrapped
          value = value_side
          if (
            transform in ('set', 'sorted', 'tuple', 'list')
            and isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == transform
            and len(value.args) == 1
          ):
            value = value.args[0]
          want = _expected(value)
          if transform == 'set':
            want = set(want) if isinstance(want, list | tuple | set | frozenset | str) else want
          elif transform == 'sorted':
            want = sorted(want) if isinstance(want, list | tuple | set | str) else want
          elif transform in ('tuple', 'list') and value is not value_side:
            want = tuple(want) if transform == 'tuple' else list(want)
          return CallCase(args, kwargs, Expect(values=(want,), transform=transform))
    if isinstance(op, ast.Is):
      found = _call_of(left, fn)
      if (
        found is not None and isinstance(right, ast.Constant) and right.value in (True, False, None)
      ):
        return CallCase(found[0], found[1], Expect(values=(right.value,), cmp='is'))
    if isinstance(op, ast.Lt | ast.LtE):
      gap = _abs_gap(left, fn)
      if gap is not None:
        args, kwargs, value = gap
        tol = literal(right)
        if isinstance(tol, int | float) and not isinstance(tol, bool) and tol > 0:
          return CallCase(
            args,
            kwargs,
            Expect(values=(value,), cmp='close', tol=float(tol), inclusive=isinstance(op, ast.LtE)),
          )
  raise _NotLiteral('not a comparison of the call with a literal')


def _skippable(stmt):
  if isinstance(stmt, ast.Pass | ast.Import | ast.ImportFrom):
    return True
  if isinstance(stmt, ast.Expr):
    v = stmt.value
    if isinstance(v, ast.Constant):
      return True
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == 'print':
      return True
    if isinstance(v, ast.Name) and v.id == 'print':  # a bare name: no effect
      return True
  if (
    isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant) and stmt.test.value is True
  ):
    return True
  return False


def _statements(stmts, fn, problems, cases, label='line {}'):
  for stmt in stmts:
    if _skippable(stmt):
      continue
    where = f'{label.format(stmt.lineno)}: {" ".join(ast.unparse(stmt).split())[:100]}'
    if not isinstance(stmt, ast.Assert):
      problems.append(f'{where}: not an assert')
      continue
    try:
      cases.append(_case(stmt.test, fn))
    except (_NotLiteral, ValueError, TypeError, RecursionError) as e:
      problems.append(f'{where}: {e}')


def humaneval_check(test_code):
  """Converted for HumanEval's `check(candidate)` test code."""
  try:
    tree = ast.parse(test_code)
  except (SyntaxError, ValueError, RecursionError) as e:
    return Converted(None, (f'the test code does not parse: {e}',), None)
  problems, cases, check = [], [], None
  for stmt in tree.body:
    if isinstance(stmt, ast.FunctionDef) and stmt.name == 'check':
      check = stmt
    elif isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == ['METADATA']:
      continue
    elif not (_skippable(stmt) or isinstance(stmt, ast.FunctionDef)):
      problems.append(
        f'line {stmt.lineno}: {" ".join(ast.unparse(stmt).split())[:100]}: runs at import'
      )
  if check is None or len(check.args.args) != 1:
    return Converted(None, ('no `def check(candidate)` of one argument',), None)
  _statements(check.body, check.args.args[0].arg, problems, cases)
  if not cases and not problems:
    problems.append('no assert to convert')
  return Converted(None if problems else tuple(cases), tuple(problems), None)


def called_name(lines):
  """The first function name called in an assert of `lines`, or None."""
  for line in lines:
    try:
      tree = ast.parse(line)
    except (SyntaxError, ValueError, RecursionError):
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id not in ('set', 'sorted', 'list', 'abs', 'tuple', 'str', 'int', 'float'):
          return node.func.id
  return None


def assert_lines(lines, setup=''):
  """Converted for MBPP's assert statements (one function, named in them)."""
  fn = called_name(lines)
  if fn is None:
    return Converted(None, ('no assert calls a function by name',), None)
  problems, cases = [], []
  if setup.strip():
    problems.append('test_setup_code is not empty: the asserts depend on it')
  for i, line in enumerate(lines):
    try:
      tree = ast.parse(line)
    except (SyntaxError, ValueError, RecursionError) as e:
      problems.append(f'test {i}: does not parse: {e}')
      continue
    _statements(tree.body, fn, problems, cases, label=f'test_list[{i}]')
  if not cases and not problems:
    problems.append('no assert to convert')
  return Converted(None if problems else tuple(cases), tuple(problems), fn)
