"""Judging a call's return value, outside the sandbox.

The driver (`jrl/rewards/sandbox/driver.py`) sends back the value a call
returned as tagged JSON text: exact builtin types only (None, bool, int,
float, str, bytes, complex, list, tuple, dict, set, frozenset; subclasses as
their builtin contents). `decode` rebuilds the plain value here, so nothing
the program defined (an `__eq__` that always holds, a lying `__class__`)
survives the trip, and `matches` compares it with the expected value, which
never entered the sandbox.

    spec = Expect(values=(3,))                                  # got == 3
    spec = Expect(values=(0.33,), cmp='close', tol=1e-6)        # abs(got - 0.33) < 1e-6
    spec = Expect(values=([1, 2],), unordered=True)             # same elements, any order
    matches(decode('{"$t": [1, 2]}'), Expect(values=((1, 2),)))  # True

Comparison `cmp`:
  'eq'       got == value, Python's == on plain values (1 == 1.0 == True, as
             the asserts of HumanEval and MBPP mean), or with `strict` the
             same types at every level (bool is not int, int is not float,
             tuple is not list);
  'is'       got is value, for True / False / None (`assert f(x) is True`);
  'truthy' / 'falsy'   bool(got) (`assert f(x)`, `assert not f(x)`);
  'close'    abs(got - value) < tol (`<=` with `inclusive`);
  'isclose'  math.isclose(got, value, rel_tol=rel_tol, abs_tol=tol).
`transform` ('set' | 'sorted' | 'list' | 'tuple') is applied to got first (and to the
expected value for 'set' and 'sorted'); `json` turns tuples into lists at
every level first (data sets stored as JSON: APPS, LiveCodeBench); `tol` with
'eq' compares floats within tol at every level; `values` holds alternatives,
any of which passes.
"""

import base64
import dataclasses
import json
import math

TAGS = ('$d', '$t', '$s', '$fs', '$b', '$c', '$f')
CMPS = ('eq', 'is', 'truthy', 'falsy', 'close', 'isclose')
TRANSFORMS = (None, 'set', 'sorted', 'list', 'tuple')


class BadValue(ValueError):
  """The driver's value text is not a tagged plain value."""


@dataclasses.dataclass(frozen=True)
class Expect:
  """What a call must return (see the module docstring)."""

  values: tuple = ()  # expected values; any of them passes ('eq', 'is', 'close', 'isclose')
  cmp: str = 'eq'
  transform: str | None = None
  tol: float | None = None  # absolute tolerance ('close', 'isclose', floats in 'eq')
  rel_tol: float | None = None  # 'isclose'
  inclusive: bool = False  # 'close': <= instead of <
  unordered: bool = False  # top-level sequence in any order
  strict: bool = False  # 'eq': the same types at every level
  json: bool = False  # tuples as lists before comparing

  def __post_init__(self):
    if self.cmp not in CMPS:
      raise ValueError(f'cmp must be one of {CMPS}, got {self.cmp!r}')
    if self.transform not in TRANSFORMS:
      raise ValueError(f'transform must be one of {TRANSFORMS}, got {self.transform!r}')
    if self.cmp in ('close',) and self.tol is None:
      raise ValueError("cmp 'close' needs a tolerance `tol`")
    if self.cmp not in ('truthy', 'falsy') and not self.values:
      raise ValueError(f'cmp {self.cmp!r} needs at least one expected value')


def encode(value):
  """A JSON-able tagged form of a plain `value` (the driver's encoding, for
  call arguments and for storing expected values in JSON rows)."""
  t = type(value)
  if value is None or t in (bool, int, str):
    return value
  if t is float:
    return value if math.isfinite(value) else {'$f': repr(value)}
  if t is list:
    return [encode(v) for v in value]
  if t is tuple:
    return {'$t': [encode(v) for v in value]}
  if t is dict:
    return {'$d': [[encode(k), encode(v)] for k, v in value.items()]}
  if t in (set, frozenset):
    return {'$s' if t is set else '$fs': [encode(v) for v in value]}
  if t in (bytes, bytearray):
    return {'$b': base64.b64encode(bytes(value)).decode('ascii')}
  if t is complex:
    return {'$c': [encode(value.real), encode(value.imag)]}
  raise TypeError(
    f'a {t.__name__} is not a plain value (None, bool, int, float, str, '
    'bytes, complex, list, tuple, dict, set, frozenset)'
  )


def from_tagged(obj):
  """The plain value of a tagged JSON object (raises BadValue)."""
  if obj is None or type(obj) in (bool, int, float, str):
    return obj
  if type(obj) is list:
    return [from_tagged(v) for v in obj]
  if type(obj) is not dict or len(obj) != 1:
    raise BadValue('an object that is not a one-key tag')
  ((tag, body),) = obj.items()
  try:
    if tag == '$t':
      return tuple(from_tagged(v) for v in _list(body))
    if tag == '$d':
      return {from_tagged(_pair(p)[0]): from_tagged(_pair(p)[1]) for p in _list(body)}
    if tag == '$s':
      return {from_tagged(v) for v in _list(body)}
    if tag == '$fs':
      return frozenset(from_tagged(v) for v in _list(body))
    if tag == '$b':
      return base64.b64decode(body, validate=True)
    if tag == '$c':
      re, im = _pair(body)
      return complex(float(from_tagged(re)), float(from_tagged(im)))
    if tag == '$f' and body in ('nan', 'inf', '-inf'):
      return float(body)
  except BadValue:
    raise
  except (TypeError, ValueError) as e:  # unhashable set members, bad base64
    raise BadValue(f'tag {tag!r}: {e}') from None
  raise BadValue(f'unknown tag {str(tag)[:20]!r}')


def _list(body):
  if type(body) is not list:
    raise BadValue('a tag whose body is not a list')
  return body


def _pair(body):
  if type(body) is not list or len(body) != 2:
    raise BadValue('a tag whose body is not a pair')
  return body


def decode(text):
  """The plain value of the driver's tagged JSON `text` (raises BadValue)."""
  try:
    obj = json.loads(text)
  except (ValueError, RecursionError) as e:
    raise BadValue(f'not JSON: {str(e)[:100]}') from None
  try:
    return from_tagged(obj)
  except RecursionError:
    raise BadValue('nested too deeply') from None


def jsonify(value):
  """Tuples as lists at every level (JSON has no tuples)."""
  if type(value) in (list, tuple):
    return [jsonify(v) for v in value]
  if type(value) is dict:
    return {k: jsonify(v) for k, v in value.items()}
  return value


def _number(x):
  return type(x) in (int, float)


def _equal(got, want, tol, strict):
  if strict and type(got) is not type(want):
    return False
  if tol is not None and _number(got) and _number(want):
    return math.isclose(got, want, rel_tol=0.0, abs_tol=tol) or got == want
  if type(got) in (list, tuple) and type(want) in (list, tuple):
    if type(got) is not type(want) or len(got) != len(want):
      return False
    return all(_equal(g, w, tol, strict) for g, w in zip(got, want, strict=True))
  if type(got) is dict and type(want) is dict:
    if got.keys() != want.keys():
      return False
    return all(_equal(got[k], want[k], tol, strict) for k in want)
  return got == want


def _sort_key(value):
  return json.dumps(encode(value), sort_keys=True, default=repr)


def _unordered_equal(got, want, tol, strict):
  if type(got) not in (list, tuple) or type(want) not in (list, tuple) or len(got) != len(want):
    return False
  got, want = sorted(got, key=_sort_key), sorted(want, key=_sort_key)
  if all(_equal(g, w, tol, strict) for g, w in zip(got, want, strict=True)):
    return True
  if tol is None:
    return False
  left = list(want)  # within a tolerance the sorted orders may differ: match greedily
  for g in got:
    hit = next((i for i, w in enumerate(left) if _equal(g, w, tol, strict)), None)
    if hit is None:
      return False
    left.pop(hit)
  return True


def _transform(value, how):
  if how is None:
    return value
  if how == 'set':
    return set(value) if type(value) in (list, tuple, set, frozenset, str, dict) else value
  if how == 'sorted':
    return sorted(value) if type(value) in (list, tuple, set, frozenset, str) else value
  if how == 'tuple':
    return tuple(value) if type(value) in (list, tuple, str, set, frozenset, dict) else value
  return list(value) if type(value) in (list, tuple, str, set, frozenset, dict) else value


def matches(got, spec):
  """Whether the plain value `got` meets `spec` (an Expect); never raises."""
  try:
    return _matches(got, spec)
  except (TypeError, ValueError, OverflowError, RecursionError, ArithmeticError):
    return False  # e.g. sorted() of mixed types, a number minus a string


def _matches(got, spec):
  got = _transform(got, spec.transform)
  if spec.json:
    got = jsonify(got)
  if spec.cmp == 'truthy':
    return bool(got)
  if spec.cmp == 'falsy':
    return not got
  for want in spec.values:
    if spec.transform in ('set', 'sorted'):
      want = _transform(want, spec.transform)
    if spec.json:
      want = jsonify(want)
    if spec.cmp == 'is':
      if got is want or (want is None and got is None):
        return True
    elif spec.cmp == 'close':
      if _number(got) or type(got) is bool:
        gap = abs(got - want)
        if gap < spec.tol or (spec.inclusive and gap <= spec.tol):
          return True
    elif spec.cmp == 'isclose':
      if (_number(got) or type(got) is bool) and math.isclose(
        got,
        want,
        rel_tol=spec.rel_tol if spec.rel_tol is not None else 1e-9,
        abs_tol=spec.tol or 0.0,
      ):
        return True
    elif spec.unordered:
      if _unordered_equal(got, want, spec.tol, spec.strict):
        return True
    elif _equal(got, want, spec.tol, spec.strict):
      return True
  return False
