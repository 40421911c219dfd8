"""A synthetic, verifiable task generated on the fly: multi-digit arithmetic.

Example i of a task is a pure function of (seed, i): the same index always
gives the same problem, so data needs no files and a stream's position is
one integer. Problems look like

    prompt "47+85="      answer "132"

with operands of `digits` digits (leading digit nonzero unless digits = 1)
and operators drawn from `ops` ('+', '-', '*'). Subtraction is arranged so
the result is non-negative. Train and held-out splits use different seeds,
and held-out problems that also occur in the training stream's first
`dedup_window` examples are skipped, so evaluation measures generalisation.

`carry_slip` > 0 adds a worked answer from an imperfect teacher: each
example also has a 'response' (what SFT imitates; rewards and evaluation
read 'answer'), which for an addition whose units carry over drops that
carry with probability `carry_slip` ("47+85=" -> "122"), the same for the
same index: demonstrations that SFT imitates, errors included, while a
verifier (exact match against 'answer') does not reward them.

`reverse_answers` writes every answer units digit first ("47+85=" ->
"231"), the order in which the digits of a sum are computed: a small model
learns addition in this order far more reliably from scratch (the default
job's warm-up learned it with three seeds of three, against two of three
with the usual order: docs/results.md, "RL against SFT alone at equal compute").
The teachers' slips are the same numbers, reversed ("130" -> "031").

`rounding_slip` > 0 is a teacher that, for an addition whose sum has a
digit more than its operands ("47+85=", 132), gives with that probability
only an estimate: the sum rounded down to tens ("130"). Above 0.5 a units
digit of 0 is its most frequent answer to every such problem, so a model
that imitates it (greedily) gets them wrong unless the sum ends in 0,
however long it trains; the other problems' true answers teach the units
digit, which stays in its samples for a verifier to reward.
"""

import dataclasses

import numpy as np

_OPS = ('+', '-', '*')


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """Multi-digit arithmetic problems with exact integer answers."""

  digits: int = 2
  ops: str = '+'
  seed: int = 0
  carry_slip: float = 0.0  # P(the teacher's response drops the units carry of an addition)
  rounding_slip: float = 0.0  # P(the teacher rounds a sum with a new digit down to tens)
  reverse_answers: bool = False  # answers written units digit first ("47+85=" -> "231")

  def __post_init__(self):
    if not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
      raise ValueError(f'`digits` must be an int in [1, 9], got {self.digits!r}.')
    bad = [op for op in self.ops if op not in _OPS]
    if not self.ops or bad:
      raise ValueError(f'`ops` must be a non-empty string of {_OPS}, got {self.ops!r}.')
    if not 0.0 <= self.carry_slip <= 1.0:
      raise ValueError(f'`carry_slip` must be in [0, 1], got {self.carry_slip!r}.')
    if not 0.0 <= self.rounding_slip <= 1.0:
      raise ValueError(f'`rounding_slip` must be in [0, 1], got {self.rounding_slip!r}.')
    if not isinstance(self.reverse_answers, bool):
      raise ValueError(f'`reverse_answers` must be a bool, got {self.reverse_answers!r}.')

  def example(self, index):
    """{'prompt', 'answer'} of problem `index` (any non-negative int)."""
    rng = np.random.default_rng([self.seed, int(index)])
    lo = 0 if self.digits == 1 else 10 ** (self.digits - 1)
    hi = 10**self.digits
    a, b = (int(x) for x in rng.integers(lo, hi, size=2))
    op = self.ops[int(rng.integers(len(self.ops)))]
    if op == '-' and b > a:
      a, b = b, a
    value = {'+': a + b, '-': a - b, '*': a * b}[op]
    example = {'prompt': f'{a}{op}{b}=', 'answer': self._write(value)}
    if self.carry_slip or self.rounding_slip:
      # Both draws are made for every example (fixed per index), after the problem's.
      slip, rounds = rng.random(2) < (self.carry_slip, self.rounding_slip)
      response = value - 10 if slip and op == '+' and a % 10 + b % 10 >= 10 else value
      rounds = rounds and op == '+' and value >= 10**self.digits  # a sum with a new digit
      example['response'] = self._write(response - response % 10 if rounds else response)
    return example

  def _write(self, number):
    return str(number)[::-1] if self.reverse_answers else str(number)

  def prompt_len(self):
    return 2 * self.digits + 2

  def held_out(self, size, eval_seed, dedup_window=100_000):
    """`size` problems from seed `eval_seed` that are not among the first
    `dedup_window` training problems."""
    train = {self.example(i)['prompt'] for i in range(min(dedup_window, 20 * size))}
    other = dataclasses.replace(self, seed=eval_seed)
    out, i = [], 0
    while len(out) < size:
      ex = other.example(i)
      if ex['prompt'] not in train:
        out.append(ex)
      i += 1
      if i > 100 * size:
        raise ValueError(
          f'could not find {size} held-out problems unseen in training; the problem space of '
          f'{self.digits}-digit `{self.ops}` is too small: raise `digits`.'
        )
    return out
