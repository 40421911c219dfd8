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

  def __post_init__(self):
    if not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
      raise ValueError(f'`digits` must be an int in [1, 9], got {self.digits!r}.')
    bad = [op for op in self.ops if op not in _OPS]
    if not self.ops or bad:
      raise ValueError(f'`ops` must be a non-empty string of {_OPS}, got {self.ops!r}.')
    if not 0.0 <= self.carry_slip <= 1.0:
      raise ValueError(f'`carry_slip` must be in [0, 1], got {self.carry_slip!r}.')

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
    example = {'prompt': f'{a}{op}{b}=', 'answer': str(value)}
    if self.carry_slip:
      slip = rng.random() < self.carry_slip  # drawn for every example: fixed per index
      carries = op == '+' and a % 10 + b % 10 >= 10
      example['response'] = str(value - 10 if slip and carries else value)
    return example

  def max_answer_len(self):
    return len(str((10**self.digits - 1) ** 2 if '*' in self.ops else 2 * 10**self.digits))

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
