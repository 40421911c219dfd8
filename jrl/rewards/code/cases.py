"""What a code row's tests are once read (`formats.parse`), and how stdout is compared."""

import dataclasses

from jrl.rewards.code import compare


@dataclasses.dataclass(frozen=True)
class StdinTests:
  cases: tuple  # ((stdin text, expected stdout text), ...)
  format: str = 'stdin'
  kind = 'stdin'

  def __len__(self):
    return len(self.cases)


@dataclasses.dataclass(frozen=True)
class CallCase:
  args: tuple  # positional arguments (plain values)
  kwargs: dict  # keyword arguments
  expect: compare.Expect


@dataclasses.dataclass(frozen=True)
class CallTests:
  fn_name: str
  cases: tuple  # (CallCase, ...)
  class_name: str | None = None  # the method of this class if the program defines it
  prefix: str = ''  # prepended to a completion that does not define fn_name itself
  format: str = 'call'
  kind = 'call'

  def __len__(self):
    return len(self.cases)


@dataclasses.dataclass(frozen=True)
class AssertTests:
  check: str  # code defining check(candidate)
  entry_point: str
  prefix: str = ''
  format: str = 'humaneval'
  kind = 'asserts'

  def __len__(self):
    return 1


def normalize_output(text):
  """Trailing whitespace stripped from every line, trailing blank lines dropped."""
  lines = [line.rstrip() for line in text.replace('\r\n', '\n').split('\n')]
  while lines and not lines[-1]:
    lines.pop()
  return '\n'.join(lines)
