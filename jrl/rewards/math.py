"""Answer checking for math-style tasks.

`extract_answer` finds the final answer in a completion: the content of the
last `\\boxed{...}`, else what follows the last `####`, else what follows
"the answer is", else the last number. `math_answer` compares it with the
reference numerically (thousands separators, fractions a/b, decimals and
percent are normalised); `exact_match` compares the stripped completion
with the reference string.
"""

import re
from fractions import Fraction

from jrl.rewards.base import register

_NUMBER = re.compile(r'-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?|-?\.\d+')


def _boxed(text):
  start = text.rfind('\\boxed{')
  if start < 0:
    return None
  depth, i = 1, start + len('\\boxed{')
  for j in range(i, len(text)):
    if text[j] == '{':
      depth += 1
    elif text[j] == '}':
      depth -= 1
      if depth == 0:
        return text[i:j]
  return None


def extract_answer(text):
  """The final answer string of `text`, or None."""
  boxed = _boxed(text)
  if boxed is not None:
    return boxed.strip()
  if '####' in text:
    tail = text.rsplit('####', 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None
  lower = text.lower()
  key = 'the answer is'
  if key in lower:
    tail = text[lower.rfind(key) + len(key) :].strip()
    if tail:
      first = tail.split()[0].rstrip('.,;')
      return first if _NUMBER.fullmatch(first) else tail.rstrip('.').strip()
  numbers = _NUMBER.findall(text)
  return numbers[-1] if numbers else None


def to_number(text):
  """A Fraction for '1,234', '-3.5', '3/4', '12%', '\\frac{3}{4}', '$5', or None."""
  if text is None:
    return None
  t = text.strip().replace('$', '').replace('\\!', '').replace(' ', '')
  frac = re.fullmatch(r'\\d?frac\{(-?\d+)\}\{(-?\d+)\}', t)
  if frac:
    num, den = int(frac.group(1)), int(frac.group(2))
    return Fraction(num, den) if den else None
  t = t.rstrip('.')
  percent = t.endswith('%')
  t = t.rstrip('%').replace(',', '')
  try:
    value = Fraction(t)
  except (ValueError, ZeroDivisionError):
    return None
  return value / 100 if percent else value


@register('math_answer')
def math_answer(prompts, completions, metadata):
  """1.0 if the extracted answer equals metadata['answer'] numerically (or as
  text when either is not a number), 0.0 if not, None if no answer is found."""
  del prompts
  out = []
  for completion, meta in zip(completions, metadata, strict=True):
    got = extract_answer(completion)
    if got is None:
      out.append(None)
      continue
    ref = str(meta['answer'])
    a, b = to_number(got), to_number(ref)
    if a is not None and b is not None:
      out.append(float(a == b))
    else:
      out.append(float(got.strip() == ref.strip()))
  return out


@register('exact_match')
def exact_match(prompts, completions, metadata):
  """1.0 if the completion, stripped of surrounding whitespace, is the answer."""
  del prompts
  return [
    float(c.strip() == str(m['answer']).strip()) for c, m in zip(completions, metadata, strict=True)
  ]
