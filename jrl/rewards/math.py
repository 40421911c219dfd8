"""Answer checking for math tasks: extraction, normalisation, equivalence.

`extract_answer(text)` finds the final answer of a completion: the content
of the last `\\boxed{...}` (or `\\fbox{...}`), else what follows the last
`####`, else what follows the last "the answer is" / "answer:", else the
last number in the text.

`normalize(answer)` removes what does not change the value: surrounding
`$`, `\\left` / `\\right`, `\\!` and `\\,`, `\\text{...}` / `\\mathrm{...}`
wrappers, degree signs, a leading "x =", units and trailing words
("12 apples", "5 cm", "$5.00 dollars"), thousands separators ("1,234").

`is_equivalent(a, b)` is true when the normalised strings are equal, or
both are numbers equal within a relative tolerance (fractions, decimals,
`\\frac` / `\\dfrac` / `\\tfrac`, mixed signs, percentages: "50%" equals
both "50" and "0.5"), or, when sympy is installed, both parse as
expressions whose difference simplifies to 0 (`\\sqrt{2}/2` and
`1/\\sqrt{2}`, `2\\pi` and `\\pi+\\pi`). Tuples and intervals are compared
element by element.

Registered rewards: `math_answer` (1 / 0, None when no answer is found) and
`exact_match` (the stripped completion equals the answer).
"""

import math
import re
from fractions import Fraction

from jrl.rewards.base import register

_NUMBER = re.compile(r'-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?|-?\.\d+')
_UNIT_WORDS = re.compile(r'(?<=[\d.}%])\s+[a-zA-Z][a-zA-Z .²³/^-]*$')


def _braced(text, start):
  """Content of the {...} group opening at text[start] == '{', or None."""
  depth = 0
  for j in range(start, len(text)):
    if text[j] == '{':
      depth += 1
    elif text[j] == '}':
      depth -= 1
      if depth == 0:
        return text[start + 1 : j]
  return None


def _last_boxed(text):
  for key in ('\\boxed', '\\fbox'):
    start = text.rfind(key + '{')
    if start >= 0:
      return _braced(text, start + len(key))
  start = text.rfind('\\boxed ')
  if start >= 0:
    return text[start + len('\\boxed ') :].split('$')[0].strip()
  return None


def extract_answer(text):
  """The final answer string of a completion, or None."""
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed.strip()
  if '####' in text:
    tail = text.rsplit('####', 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None
  lower = text.lower()
  for key in ('the answer is', 'answer:'):
    at = lower.rfind(key)
    if at >= 0:
      tail = text[at + len(key) :].strip()
      if tail:
        line = tail.splitlines()[0].strip().rstrip('.').strip()
        number = _NUMBER.match(line.lstrip('$'))
        return number.group(0) if number and number.end() == len(line.lstrip('$')) else line
  numbers = _NUMBER.findall(text)
  return numbers[-1] if numbers else None


def _unwrap(text, command):
  """Replaces every `\\command{x}` by `x`."""
  key = '\\' + command + '{'
  while key in text:
    start = text.find(key)
    inner = _braced(text, start + len(key) - 1)
    if inner is None:
      break
    text = text[:start] + inner + text[start + len(key) + len(inner) + 1 :]
  return text


def normalize(answer):
  """A canonical string for `answer` (see the module docstring)."""
  if answer is None:
    return None
  t = str(answer).strip()
  t = t.strip('$').strip()
  for command in ('text', 'textbf', 'mathrm', 'mathbf', 'boxed', 'mbox'):
    t = _unwrap(t, command)
  t = t.replace('\\%', '%')
  for token in ('\\left', '\\right', '\\!', '\\,', '\\;', '\\:', '\\displaystyle', '\\$'):
    t = t.replace(token, '')
  t = t.replace('^\\circ', '').replace('^{\\circ}', '').replace('°', '')
  t = t.replace('dfrac', 'frac').replace('tfrac', 'frac')
  t = t.rstrip('.').strip()
  # "x = 5" -> "5" (a single variable on the left).
  if re.fullmatch(r'[a-zA-Z]\s*=\s*.+', t):
    t = t.split('=', 1)[1].strip()
  # Units and trailing words after a number: "12 apples", "5 cm".
  if re.match(r'^-?[\d.,]', t):
    t = _UNIT_WORDS.sub('', t).strip()
  # Thousands separators: 1,234,567 (not tuples like 1,2).
  if re.fullmatch(r'-?\d{1,3}(,\d{3})+(\.\d+)?%?', t):
    t = t.replace(',', '')
  return t.replace(' ', '')


def to_number(text):
  """A Fraction (exact) or float for a normalised numeric answer, or None."""
  if text is None:
    return None
  t = normalize(text)
  sign = 1
  if t.startswith('-'):
    sign, t = -1, t[1:]
  frac = re.fullmatch(r'\\frac\{([^{}]+)\}\{([^{}]+)\}', t) or re.fullmatch(r'\\frac(\d)(\d)', t)
  if frac:
    num, den = to_number(frac.group(1)), to_number(frac.group(2))
    if num is None or den is None or den == 0:
      return None
    return sign * Fraction(num) / Fraction(den) if _exact(num, den) else sign * num / den
  percent = t.endswith('%')
  t = t.rstrip('%')
  try:
    value = Fraction(t)
  except (ValueError, ZeroDivisionError):
    try:
      value = float(t)
    except ValueError:
      return None
    if not math.isfinite(value):
      return None
  return sign * (value / 100 if percent else value)


def _exact(*values):
  return all(isinstance(v, Fraction | int) for v in values)


def _numbers_equal(a, b, rel_tol):
  if _exact(a, b):
    return a == b
  return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=1e-12)


def _latex_to_sympy(t):
  t = t.replace('\\cdot', '*').replace('\\times', '*').replace('\\pi', 'pi')
  t = re.sub(r'\\sqrt\{([^{}]+)\}', r'sqrt(\1)', t)
  t = re.sub(r'\\sqrt(\d)', r'sqrt(\1)', t)
  for _ in range(3):
    t = re.sub(r'\\frac\{([^{}]+)\}\{([^{}]+)\}', r'((\1)/(\2))', t)
  t = t.replace('{', '(').replace('}', ')').replace('^', '**')
  if '\\' in t:
    raise ValueError('unsupported LaTeX')
  return t


def _symbolic_equal(a, b):
  try:
    import sympy
    from sympy.parsing import sympy_parser as sp
  except ImportError:
    return False
  transformations = sp.standard_transformations + (sp.implicit_multiplication_application,)
  try:
    ea = sp.parse_expr(_latex_to_sympy(a), transformations=transformations, evaluate=True)
    eb = sp.parse_expr(_latex_to_sympy(b), transformations=transformations, evaluate=True)
    return bool(sympy.simplify(ea - eb) == 0)
  except Exception:  # anything sympy cannot parse or decide is "not equal"
    return False


def _split_tuple(t):
  if len(t) >= 2 and t[0] in '([' and t[-1] in ')]':
    return t[0], t[-1], t[1:-1].split(',')
  return None


def is_equivalent(a, b, rel_tol=1e-6):
  """Whether two answers denote the same value (see the module docstring)."""
  na, nb = normalize(a), normalize(b)
  if na is None or nb is None or not na or not nb:
    return False
  if na == nb:
    return True
  ta, tb = _split_tuple(na), _split_tuple(nb)
  if ta and tb:
    return (
      ta[0] == tb[0]
      and ta[1] == tb[1]
      and len(ta[2]) == len(tb[2])
      and all(is_equivalent(x, y, rel_tol) for x, y in zip(ta[2], tb[2], strict=True))
    )
  va, vb = to_number(na), to_number(nb)
  if va is not None and vb is not None:
    if _numbers_equal(va, vb, rel_tol):
      return True
    # A percentage may be written as a fraction of 1: "50%" == "0.5".
    pa, pb = na.endswith('%'), nb.endswith('%')
    if pa != pb:
      return _numbers_equal(va * (100 if pa else 1), vb * (100 if pb else 1), rel_tol)
    return False
  if va is not None or vb is not None:
    # One side numeric, the other not: only sympy can still say equal (e.g. 2\sqrt{2}).
    return _symbolic_equal(na, nb)
  return _symbolic_equal(na, nb)


@register('math_answer')
def math_answer(prompts, completions, metadata):
  """1.0 if the extracted answer is equivalent to metadata['answer'], 0.0 if
  not, None if no answer can be found in the completion."""
  del prompts
  out = []
  for completion, meta in zip(completions, metadata, strict=True):
    got = extract_answer(completion)
    out.append(None if got is None else float(is_equivalent(got, meta['answer'])))
  return out


@register('exact_match')
def exact_match(prompts, completions, metadata):
  """1.0 if the completion, stripped of surrounding whitespace, is the answer."""
  del prompts
  return [
    float(c.strip() == str(m['answer']).strip()) for c, m in zip(completions, metadata, strict=True)
  ]
