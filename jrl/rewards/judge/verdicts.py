"""Verdict parsing: the pairwise verdict or the score in a judge's output,
read strictly (the output may quote hostile completions), and how verdicts
combine across orders and become numbers.

The parsing rules are in README.md beside this file ("Parsing rules").
"""

import re

from jrl.rewards.judge.prompts import check_scale

# The reward of a completion judged (as A) against a reference (as B).
REFERENCE_REWARD = {'A': 1.0, 'tie': 0.5, 'B': 0.0, None: float('nan')}

_REGION_TAGS = ('rubric', 'user_prompt', 'response_a', 'response_b', 'response', 'think')
_REGION_OPEN = re.compile(
  r'\s*<\s*(' + '|'.join(_REGION_TAGS) + r')\s*>', re.IGNORECASE
)  # at the start of a line
_FENCE = re.compile(r'\s*(```|~~~)')
_EMPHASIS = re.compile(r'[*_`]+')
_LEAD = re.compile(r'^(?:#+|[-+•])\s*')
_VERDICT_KEY = re.compile(r'(?:final\s+)?verdict\s*[:：]\s*(.*)', re.IGNORECASE)
_SCORE_KEY = re.compile(r'(?:(?:final|overall)\s+)?score\s*[:：]\s*(.*)', re.IGNORECASE)
_WRAPPERS = (('[[', ']]'), ('[', ']'), ('(', ')'), ('"', '"'), ("'", "'"), ('“', '”'))
_PAIRWISE_VALUE = re.compile(r'(?:response\s*)?(a|b|tie)', re.IGNORECASE)
# The gloss the instruction puts after each form, which a judge may copy.
_GLOSSES = {'response a is better': 'A', 'response b is better': 'B', 'neither is better': 'tie'}
_GLOSSED = re.compile(r'(.*?)\s*\(\s*(' + '|'.join(_GLOSSES) + r')\s*\)', re.IGNORECASE)
# At most 9 digits: a longer number is no score on any scale (and int() of one
# with thousands of digits raises).
_SCORE_VALUE = re.compile(r'([-+]?[0-9]{1,9})(?:\s*(?:/|out\s+of)\s*([0-9]{1,9}))?', re.IGNORECASE)


def _closes(text, tag):
  return re.search(rf'<\s*/\s*{tag}\s*>', text, re.IGNORECASE) is not None


def _key_values(text, key):
  """The values of `key` lines outside quoted regions, in order (README.md, rules 2-3)."""
  values = []
  region, fenced = None, False
  for line in text.splitlines():
    if region is not None:
      if _closes(line, region):
        region = None
      continue
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if fenced or line.lstrip().startswith('>'):
      continue
    opened = _REGION_OPEN.match(line)
    if opened:
      tag = opened.group(1).lower()
      if not _closes(line[opened.end() :], tag):
        region = tag
      continue
    bare = _LEAD.sub('', _EMPHASIS.sub('', line).strip())
    m = key.fullmatch(bare.strip())
    if m:
      values.append(m.group(1))
  return values


def _unwrap(value):
  """A value with surrounding spaces, final `.`/`!` and brackets or quotes removed."""
  value = value.strip().rstrip('.!').strip()
  changed = True
  while changed and value:
    changed = False
    for left, right in _WRAPPERS:
      if len(value) >= len(left) + len(right) and value.startswith(left) and value.endswith(right):
        value = value[len(left) : len(value) - len(right)].strip().rstrip('.!').strip()
        changed = True
        break
  return value


def parse_pairwise(text, *, allow_tie=True, truncated=False):
  """The judge's pairwise verdict: 'A', 'B', 'tie' or None (see README.md).

  Args:
    text: the judge's output only (never its prompt).
    allow_tie: whether `tie` is a valid verdict.
    truncated: the output was cut at `max_new_tokens` (then None).

  Returns:
    'A' | 'B' | 'tie' | None.
  """
  if truncated or not text:
    return None
  values = _key_values(text, _VERDICT_KEY)
  if not values:
    return None
  value, gloss = _unwrap(values[-1]), None
  glossed = _GLOSSED.fullmatch(value)
  if glossed:
    value, gloss = _unwrap(glossed.group(1)), _GLOSSES[glossed.group(2).lower()]
  m = _PAIRWISE_VALUE.fullmatch(value)
  if m is None:
    return None
  verdict = m.group(1).upper() if len(m.group(1)) == 1 else 'tie'
  if (verdict == 'tie' and not allow_tie) or gloss not in (None, verdict):
    return None
  return verdict


def parse_score(text, scale=(1, 10), *, truncated=False):
  """The judge's integer score on `scale`, as a float, or None (see README.md).

  Args:
    text: the judge's output only (never its prompt).
    scale: (lo, hi) integers, lo < hi.
    truncated: the output was cut at `max_new_tokens` (then None).

  Returns:
    float in [lo, hi] (an integer value) or None.
  """
  lo, hi = check_scale(scale)
  if truncated or not text:
    return None
  values = _key_values(text, _SCORE_KEY)
  if not values:
    return None
  m = _SCORE_VALUE.fullmatch(_unwrap(values[-1]))
  if m is None:
    return None
  if m.group(2) is not None and int(m.group(2)) != hi:
    return None
  score = int(m.group(1))
  return float(score) if lo <= score <= hi else None


def combine_orders(verdict_ab, verdict_ba):
  """One verdict from the two orders of a pair (see README.md, "Position swapping").

  Args:
    verdict_ab: the verdict with a shown as A and b as B.
    verdict_ba: the verdict with b shown as A and a as B (in the shown labels).

  Returns:
    'A' | 'B' | 'tie' | None, in the labels of the (a, b) order.
  """
  if verdict_ab is None or verdict_ba is None:
    return None
  back = {'A': 'B', 'B': 'A', 'tie': 'tie'}[verdict_ba]
  if verdict_ab == back:
    return verdict_ab
  if 'tie' in (verdict_ab, back):
    return 'tie'
  return None


def normalize_score(score, scale):
  """(score - lo) / (hi - lo) in [0, 1]; None -> NaN."""
  lo, hi = check_scale(scale)
  return float('nan') if score is None else (score - lo) / (hi - lo)
