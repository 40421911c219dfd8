"""reasoning-gym's scorers as a jrl reward (`reward.functions=('reasoning_gym',)`).

reasoning-gym (`pip install -e ".[reasoning-gym]"`, pinned to 0.1.25) makes
procedural task sets, each with its own `score_answer(answer, entry)`: a
float in [0, 1], with partial credit for some wrong answers (0.01 for a
wrong one in the right form, a share of the right cells of a grid, ...).
The reward is that scorer's value on the answer read from the completion,
never a comparison with the entry's `answer` field (for five datasets,
e.g. graph_color and rubiks_cube, that field is None: many answers are
right and only the scorer knows which).

The rows come from `jrl.data.reasoning_gym` (`task.kind='reasoning_gym'`);
each carries what scoring needs under `row['reasoning_gym']`:

    dataset    the reasoning-gym dataset name
    kwargs     the settings the dataset was made with (its scorer may read
               them, e.g. decimal_arithmetic's precision), seed and size included
    entry      the entry as the dataset made it: {'question', 'answer', 'metadata'}
    extract    how the answer is read: 'answer_tag' | 'last_line' | 'whole'
    threshold  None: the scorer's value (partial credit kept); t: 1.0 when the
               value is at least t, else 0.0
    unsafe     whether the run allows a scorer that evaluates the answer as Python

Reading the answer (`extract`):

* 'answer_tag' (reasoning-gym's convention, its default system prompt asks
  for it): the text of the last `<answer>...</answer>`, stripped;
* 'last_line': the last line that is not blank, stripped;
* 'last_number': the last number (an integer or decimal, its sign kept,
  thousands commas dropped), for datasets whose answers are numbers
  (basic_arithmetic, chain_sum, leg_counting, ...) and a model too small to
  keep to a format (SmolLM2-135M writes no answer tags);
* 'whole': the whole completion, stripped.

No answer found is 0.0 (the policy's doing), never unscored; an answer the
scorer raises on is 0.0 too (a malformed answer), so one completion never
leaves its chunk unscored.

Model text is hostile. Nine scorers of 0.1.25 run the answer through
Python's `eval` or sympy's `parse_expr` (which calls `eval`): a policy could
run code in the reward workers. Those datasets (`EVALUATES_ANSWERS`) are
refused unless `task.reasoning_gym.unsafe_scorers` is set, here as in the
task.
"""

import collections
import re

from jrl.rewards.base import register

EXTRACTORS = ('answer_tag', 'last_line', 'last_number', 'whole')

# Datasets whose score_answer evaluates the model's answer as Python (eval, or
# sympy's parse_expr), found by reading their scorers' source (reasoning-gym 0.1.25;
# tests/rewards/test_reasoning_gym.py re-reads it).
EVALUATES_ANSWERS = frozenset(
  {
    'binary_matrix',
    'countdown',
    'intermediate_integration',
    'n_queens',
    'polynomial_multiplication',
    'puzzle24',
    'simple_integration',
    'spiral_matrix',
    'string_insertion',
  }
)

MAX_ANSWER_CHARS = 20_000  # a longer extracted answer is wrong, never given to a scorer
_OPEN, _CLOSE = '<answer>', '</answer>'
_NUMBER = re.compile(r'-?\d+(?:,\d{3})*(?:\.\d+)?')
_CACHED = 64  # datasets kept per process (one per dataset and curriculum level)
_datasets = collections.OrderedDict()


def extract(completion, how):
  """The answer `how` reads from `completion` (module docstring), or None."""
  if how == 'answer_tag':
    # The matches of `<answer>(.*?)</answer>` left to right, in linear time (the
    # regex rescans to the end from every unclosed tag: quadratic on hostile text).
    answer, pos = None, 0
    while (start := completion.find(_OPEN, pos)) >= 0:
      end = completion.find(_CLOSE, start + len(_OPEN))
      if end < 0:
        break
      answer, pos = completion[start + len(_OPEN) : end], end + len(_CLOSE)
    return None if answer is None else answer.strip()
  if how == 'last_line':
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else None
  if how == 'last_number':
    numbers = _NUMBER.findall(completion)
    return numbers[-1].replace(',', '') if numbers else None
  if how == 'whole':
    return completion.strip() or None
  raise ValueError(f'`task.reasoning_gym.answer` must be one of {EXTRACTORS}, got {how!r}.')


def dataset(name, kwargs):
  """The reasoning-gym dataset `name` made with `kwargs` (cached per process)."""
  key = (name, repr(sorted(kwargs.items())))
  if key not in _datasets:
    import reasoning_gym  # an optional extra: imported only when a row needs it

    _datasets[key] = reasoning_gym.create_dataset(name, **kwargs)
    while len(_datasets) > _CACHED:
      _datasets.popitem(last=False)
  _datasets.move_to_end(key)
  return _datasets[key]


def check_safe(name, unsafe):
  """Refuses a dataset whose scorer evaluates answers, unless `unsafe`."""
  if name in EVALUATES_ANSWERS and not unsafe:
    raise ValueError(
      f"reasoning-gym's scorer of {name!r} evaluates the model's answer as Python (eval or "
      "sympy's parse_expr): a policy could run code in the reward workers. Set "
      '`task.reasoning_gym.unsafe_scorers`=True to train on it anyway.'
    )


def score(completion, spec):
  """The reward of one completion of the row whose `reasoning_gym` field is `spec`."""
  check_safe(spec['dataset'], spec.get('unsafe', False))
  answer = extract(completion, spec['extract'])
  if answer is None or len(answer) > MAX_ANSWER_CHARS:
    return 0.0
  scorer = dataset(spec['dataset'], spec['kwargs']).score_answer
  try:
    value = float(scorer(answer, spec['entry']))
  except Exception:  # a malformed answer the scorer does not catch: wrong, not unscored
    return 0.0
  if spec['threshold'] is not None:
    return float(value >= spec['threshold'])
  return value


@register('reasoning_gym')
def reasoning_gym_score(prompts, completions, metadata):
  """Each completion's score by its row's reasoning-gym dataset (module docstring)."""
  del prompts
  out = []
  for i, (completion, meta) in enumerate(zip(completions, metadata, strict=True)):
    spec = meta.get('reasoning_gym') if isinstance(meta, dict) else None
    if spec is None:
      raise ValueError(
        f"row {i} has no 'reasoning_gym' field: the reasoning_gym reward scores the rows of "
        "`task.kind`='reasoning_gym'."
      )
    out.append(score(completion, spec))
  return out
