"""Grade-school word problems in GSM8K's schema, generated from templates.

    python launch/make_word_problems.py --out data/word_problems --train 5000 --eval 500

writes train.jsonl and eval.jsonl with rows like

    {"question": "Ava buys 3 pens at $4 each and pays with a $20 bill. ...",
     "answer": "The pens cost 3 * 4 = 12 dollars.\\nAva gets 20 - 12 = 8 dollars in ...\\n#### 8",
     "difficulty": 2, "template": "buy_change"}

Read them with `task.prompt_key='question'`, `task.answer_extractor='gsm8k'`.

Each template draws its numbers, checks divisibility by construction (every
quotient is drawn first and multiplied out), and writes a worked solution of
one line per arithmetic step; `difficulty` is that number of steps (1, 2 or
3). Answers are non-negative integers. Only printable ASCII is used, so the
built-in character tokenizer encodes every problem.

Problem `i` of a split is a pure function of (seed, split, i). The two
splits are disjoint by construction: a problem belongs to the held-out split
exactly when a hash of its question falls in the held-out bucket
(`EVAL_BUCKETS`), so neither split depends on the other's size; repeated
questions within a split are skipped.

The templates are in `jrl/data/word_templates.py`, the words and draws they
use in `jrl/data/word_vocab.py`; this module turns them into splits.
"""

import hashlib
import os
from typing import NamedTuple

import numpy as np

from jrl.data import sources
from jrl.data.word_templates import BY_NAME, TEMPLATES, Template
from jrl.data.word_vocab import (
  COLLECTIBLES,
  FRUIT,
  GROUPS,
  MACHINES,
  NAMES,
  PACKED_GOODS,
  SHOP_ITEMS,
  SINGLE_THINGS,
  Draw,
  eq,
)

DIFFICULTIES = (1, 2, 3)
EVAL_BUCKETS = 5  # one question hash in EVAL_BUCKETS belongs to the held-out split


class Problem(NamedTuple):
  """One generated problem; `params` are the numbers and words it was drawn with."""

  template: str
  difficulty: int  # arithmetic steps of the worked solution
  question: str
  steps: tuple  # the worked solution, one line per step
  answer: int
  params: dict

  def row(self):
    """The GSM8K-schema row: question, answer ('<steps>\\n#### N'), difficulty, template."""
    solution = '\n'.join((*self.steps, f'#### {self.answer}'))
    return {
      'question': self.question,
      'answer': solution,
      'difficulty': self.difficulty,
      'template': self.template,
    }


# Splits ----------------------------------------------------------------------------


def problem(seed, split, index, weights=(1, 1, 1)):
  """Candidate problem `index` of `split` ('train' | 'eval'): a pure function of
  its arguments. `weights` are the relative frequencies of difficulties 1, 2, 3."""
  rng = np.random.default_rng([seed, ('train', 'eval').index(split), index])
  p = np.asarray(weights, np.float64)
  difficulty = DIFFICULTIES[int(rng.choice(len(DIFFICULTIES), p=p / p.sum()))]
  template = Draw(rng).pick([t for t in TEMPLATES if t.difficulty == difficulty])
  params, question, steps, answer = template.make(Draw(rng))
  return Problem(template.name, difficulty, question, tuple(steps), answer, params)


def split_of(question):
  """'eval' for questions in the held-out hash bucket, else 'train'."""
  digest = hashlib.sha256(question.encode()).digest()
  return 'eval' if int.from_bytes(digest[:4], 'little') % EVAL_BUCKETS == 0 else 'train'


def generate(n, seed, split, weights=(1, 1, 1)):
  """`n` distinct problems of `split` ('train' | 'eval'), deterministic in (seed, weights)."""
  if split not in ('train', 'eval'):
    raise ValueError(f"`split` must be 'train' or 'eval', got {split!r}.")
  if len(weights) != len(DIFFICULTIES) or min(weights) < 0 or sum(weights) <= 0:
    raise ValueError(f'`weights` must be 3 non-negative numbers, not all 0, got {weights!r}.')
  out, seen, index = [], set(), 0
  limit = 100 * n + 1000
  while len(out) < n:
    p = problem(seed, split, index, weights)
    index += 1
    if split_of(p.question) == split and p.question not in seen:
      seen.add(p.question)
      out.append(p)
    if index > limit:
      raise ValueError(f'found only {len(out)} distinct {split} problems in {limit} draws.')
  return out


def write_splits(out_dir, n_train, n_eval, seed, weights=(1, 1, 1), parquet=False):
  """Writes train.jsonl and eval.jsonl (and .parquet copies) under `out_dir`;
  returns {file name: {difficulty: rows}}."""
  os.makedirs(out_dir, exist_ok=True)
  summary = {}
  for split, n in (('train', n_train), ('eval', n_eval)):
    rows = [p.row() for p in generate(n, seed, split, weights)]
    names = [f'{split}.jsonl'] + ([f'{split}.parquet'] if parquet else [])
    sources.write_jsonl(os.path.join(out_dir, names[0]), rows)
    if parquet:
      sources.write_parquet(os.path.join(out_dir, names[1]), rows)
    counts = {k: sum(r['difficulty'] == k for r in rows) for k in DIFFICULTIES}
    summary.update({name: counts for name in names})
  return summary


__all__ = [
  'BY_NAME',
  'COLLECTIBLES',
  'DIFFICULTIES',
  'EVAL_BUCKETS',
  'FRUIT',
  'GROUPS',
  'MACHINES',
  'NAMES',
  'PACKED_GOODS',
  'SHOP_ITEMS',
  'SINGLE_THINGS',
  'TEMPLATES',
  'Draw',
  'Problem',
  'Template',
  'eq',
  'generate',
  'problem',
  'split_of',
  'write_splits',
]
