"""reasoning-gym's procedural task sets as a jrl task: `task.kind='reasoning_gym'`.

reasoning-gym 0.1.25 (`pip install -e ".[reasoning-gym]"`) makes ~100 kinds of
verifiable problems (arithmetic, algorithms, logic, puzzles, ...) from a seed,
offline. This module turns the `task.reasoning_gym` section of a config into
an endless training stream, a held-out list and a curriculum:

    task.reasoning_gym.datasets = 'chain_sum'                          # one dataset
    task.reasoning_gym.datasets = 'basic_arithmetic:1,chain_sum:0.5'   # a weighted mixture
    task.reasoning_gym.settings.chain_sum.max_terms = 4                # the dataset's own fields

Each row is {'prompt': the entry's question, 'answer': its `answer` field as
text ('' when None; shown, never scored), 'dataset': its name, 'reasoning_gym':
what the `reasoning_gym` reward needs to score it with the dataset's own
scorer (jrl/rewards/reasoning_gym.py)}, and 'level' with a curriculum.

Training example i: a dataset drawn by the mixture's weights, then an entry
index drawn in [0, `task.reasoning_gym.size`), both from a generator seeded
by (`task.train_seed`, i). reasoning-gym seeds entry j of a dataset made
with seed s from s + j; training datasets are made with seed `train_seed` x
`size` and held-out ones with `eval_seed` x `size`, so with `train_seed` !=
`eval_seed` no training entry shares a seed with a held-out one. Small
problem spaces repeat questions under other seeds, so a training entry
whose question text is a held-out question is drawn again: held-out
questions never appear in training, at any curriculum level.

The held-out list: `task.eval_size` entries split over the datasets by the
mixture's weights (largest remainders), entries 0, 1, ... of each
held-out dataset, at the curriculum's starting level.

The curriculum (`task.reasoning_gym.curriculum.raise_at` set): every dataset
starts at `start_level` of reasoning-gym's curriculum for it (its global
level: every attribute, e.g. basic_arithmetic's number of terms and digits,
at that level or its last). After each rollout the scores of each dataset's
completions join its window; once the window holds `window` scores, a mean of
at least `raise_at` raises the dataset a level and one at most `lower_at`
lowers it, and the window starts over. Levels and windows are saved with the
prompt stream's position in checkpoints, so a resumed run draws the same
problems. The score is the `reasoning_gym` reward's (its per-function value),
or the trained total when that reward is not among `reward.functions`.

Per-dataset metrics each rollout: `task/<dataset>/reward` (mean score),
`task/<dataset>/prompts`, and with a curriculum `task/<dataset>/level`;
held-out accuracy per dataset with `eval.group_key='dataset'`.

Nothing here imports reasoning-gym until a task is built.
"""

import dataclasses
import difflib

import numpy as np

from jrl import distributed
from jrl.rewards import reasoning_gym as scoring

FIELD = '`task.reasoning_gym'  # the start of every field name in errors
REWARD = 'reasoning_gym'  # the reward whose scores the curriculum reads
MAX_DRAWS = 100  # entry draws per example before a dataset is given up on
RECENT = 4096  # recent training examples kept (a rollout's are read again by `observe`)
SEED_LIMIT = 2**32  # pool_matrix seeds numpy's global generator with seed + index


def parse_datasets(spec):
  """{name: weight} of `task.reasoning_gym.datasets`: 'name' or 'name:w,name:w,...'."""
  field = f'{FIELD}.datasets`'
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"{field} must name a dataset or a mixture 'a:1,b:0.5', got {spec!r}.")
  weights = {}
  for part in spec.split(','):
    name, sep, weight = part.strip().partition(':')
    name = name.strip()
    try:
      value = float(weight) if sep else 1.0
    except ValueError:
      raise ValueError(f'{field}: the weight of {name!r} is not a number: {weight!r}.') from None
    if not name or not (value > 0 and np.isfinite(value)):
      raise ValueError(f'{field}: {part.strip()!r} needs a name and a positive weight.')
    if name in weights:
      raise ValueError(f'{field}: {name!r} is named twice.')
    weights[name] = value
  return weights


def allocate(total, weights):
  """{name: count}, counts summing to `total` in the proportions of `weights`
  (largest remainders; ties to the first named)."""
  names = list(weights)
  share = np.asarray([weights[n] for n in names], np.float64)
  exact = total * share / share.sum()
  counts = np.floor(exact).astype(int)
  order = sorted(range(len(names)), key=lambda k: -(exact[k] - counts[k]))
  for k in order[: total - int(counts.sum())]:
    counts[k] += 1
  return dict(zip(names, counts.tolist(), strict=True))


def _known(names):
  """Refuses names reasoning-gym does not register (and its own 'composite')."""
  from reasoning_gym.factory import DATASETS

  known = sorted(n for n in DATASETS if n != 'composite')
  for name in names:
    if name not in known:
      close = difflib.get_close_matches(name, known, n=3)
      hint = f' Did you mean {", ".join(map(repr, close))}?' if close else ''
      raise ValueError(
        f'{FIELD}.datasets`: reasoning-gym has no dataset {name!r}.{hint} It has {len(known)}: '
        f'{", ".join(known)} (a mixture is written "a:1,b:0.5", not with "composite").'
      )
  return known


def _config_fields(name):
  from reasoning_gym.factory import DATASETS

  return [f.name for f in dataclasses.fields(DATASETS[name][1])]


def _settings(section, weights, known):
  """{name: {field: value}} of `task.reasoning_gym.settings`, checked against
  each dataset's config fields (seed and size are jrl's). A known dataset
  outside the mixture keeps its settings unused (so that the mixture can
  change on the command line), and is printed."""
  out = {name: {} for name in weights}
  for name, fields in section.items():
    where = f'{FIELD}.settings.{name}`'
    if name not in known:
      close = difflib.get_close_matches(name, known, n=1)
      hint = f' Did you mean {close[0]!r}?' if close else ''
      raise ValueError(f'{where}: reasoning-gym has no dataset {name!r}.{hint}')
    if name not in weights:
      if distributed.is_main():
        print(f'task: {where} is unused: {name} is not in `task.reasoning_gym.datasets`.')
      continue
    fields = fields.to_dict() if hasattr(fields, 'to_dict') else fields
    if not isinstance(fields, dict):
      raise ValueError(f"{where} must hold the dataset's fields, got {fields!r}.")
    allowed = [f for f in _config_fields(name) if f not in ('seed', 'size')]
    for key, value in fields.items():
      if key in ('seed', 'size'):
        raise ValueError(
          f'{FIELD}.settings.{name}.{key}`: set by jrl (`task.train_seed`, `task.eval_seed`, '
          '`task.reasoning_gym.size`).'
        )
      if key not in allowed:
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f' Did you mean {close[0]!r}?' if close else ''
        raise ValueError(
          f'{FIELD}.settings.{name}.{key}`: {name} has no setting {key!r}.{hint} '
          f'Its settings: {", ".join(allowed)}.'
        )
      out[name][key] = value
  return out


def _curriculum(name):
  from reasoning_gym.factory import create_curriculum, has_curriculum

  if not has_curriculum(name):
    raise ValueError(
      f'{FIELD}.curriculum.raise_at`: reasoning-gym has no curriculum for {name!r}; '
      'train it without one (raise_at=None) or leave it out of the mixture.'
    )
  return create_curriculum(name)


def _levels(curriculum):
  """The number of global levels of a reasoning-gym curriculum."""
  return max((len(a.levels) for a in curriculum.attributes.values()), default=1)


def _curriculum_fields(curriculum, level):
  """{config field: value} that `curriculum` sets at global `level`."""
  from reasoning_gym.coaching.attributes import RangeAttributeDefinition

  curriculum.set_global_level(level)
  config = curriculum.generate_configuration()
  fields = {}
  for attr in curriculum.attributes.values():
    if isinstance(attr, RangeAttributeDefinition):
      names = (attr.lower_field_name, attr.upper_field_name)
    else:
      names = (attr.field_name,)
    for n in names:
      fields[n] = getattr(config, n)
  return fields


class Rule:
  """`task.reasoning_gym.curriculum`: when a dataset's level moves."""

  def __init__(self, section):
    self.raise_at = section.raise_at
    self.lower_at = section.lower_at
    self.window = section.window
    self.start_level = section.start_level
    where = f'{FIELD}.curriculum'
    for key in ('raise_at', 'lower_at'):
      value = section[key]
      if value is not None and not (isinstance(value, int | float) and 0 <= value <= 1):
        raise ValueError(f'{where}.{key}` must be None or a score in [0, 1], got {value!r}.')
    if self.raise_at is not None and self.lower_at is not None and self.lower_at >= self.raise_at:
      raise ValueError(
        f'{where}.lower_at` ({self.lower_at}) must be below its raise_at ({self.raise_at}).'
      )
    if not (isinstance(self.window, int) and self.window >= 1):
      raise ValueError(f'{where}.window` must be a count of completions >= 1, got {self.window!r}.')
    if not (isinstance(self.start_level, int) and self.start_level >= 0):
      raise ValueError(f'{where}.start_level` must be a level >= 0, got {self.start_level!r}.')

  @property
  def on(self):
    return self.raise_at is not None

  def step(self, level, top, window):
    """(new level, whether the window starts over) after `window` (its scores)."""
    if len(window) < self.window:
      return level, False
    mean = float(np.mean(window))
    if mean >= self.raise_at and level < top:
      return level + 1, True
    if self.lower_at is not None and mean <= self.lower_at and level > 0:
      return level - 1, True
    return level, False


class ReasoningGymTask:
  """Training examples `example(i)`, `held_out` rows, and a curriculum fed by
  `observe` (module docstring). The same config gives the same examples in
  every process."""

  def __init__(self, task_config, check=None, train_check=None, drop=()):
    """
    Args:
      task_config: the `task` section (its `reasoning_gym` section, `train_seed`,
        `eval_seed`, `eval_size`).
      check: row -> None or ValueError, run on every held-out row.
      train_check: the same for training rows (default: `check`).
      drop: exception types of `check` whose rows are left out and drawn
        again (`task.long_prompts='filter'`: `PromptTooLong`).
    """
    section = task_config.reasoning_gym
    self.weights = parse_datasets(section.datasets)
    known = _known(self.weights)
    self.names = list(self.weights)
    total = sum(self.weights.values())
    self.probs = np.asarray([self.weights[n] / total for n in self.names], np.float64)
    self.settings = _settings(section.settings, self.weights, known)
    self.size = section.size
    self.train_seed, self.eval_seed = task_config.train_seed, task_config.eval_seed
    self._check_seeds(task_config.eval_size)
    if section.answer not in scoring.EXTRACTORS:
      raise ValueError(
        f'{FIELD}.answer` must be one of {scoring.EXTRACTORS}, got {section.answer!r}.'
      )
    threshold = section.threshold
    if threshold is not None and not (isinstance(threshold, int | float) and 0 < threshold <= 1):
      raise ValueError(f'{FIELD}.threshold` must be None or in (0, 1], got {threshold!r}.')
    self.unsafe = bool(section.unsafe_scorers)
    for name in self.names:
      try:
        scoring.check_safe(name, self.unsafe)
      except ValueError as e:
        raise ValueError(f'{FIELD}.datasets`: {e}') from None
    self.scoring = {'extract': section.answer, 'threshold': threshold, 'unsafe': self.unsafe}
    self.rule = Rule(section.curriculum)
    self.curricula, self.tops = {}, {}
    if self.rule.on:
      for name in self.names:
        self._set_up_curriculum(name)
    self.levels = {n: self.rule.start_level for n in self.curricula}
    self.windows = {n: [] for n in self.curricula}
    self.check = check
    self.train_check = train_check or check
    self.drop = tuple(drop)
    self.skipped = {'held_out': 0, 'filtered': 0}  # training draws made again, by cause
    self._datasets = {}
    self._recent = {}
    self.held_out, self.filtered_held_out = self._held_out(task_config.eval_size)
    self.held_out_questions = frozenset(row['prompt'] for row in self.held_out)

  # Set-up ---------------------------------------------------------------------------

  def _check_seeds(self, eval_size):
    size, where = self.size, f'{FIELD}.size`'
    if not (isinstance(size, int) and size >= 1):
      raise ValueError(f'{where} must be a count of entries >= 1, got {size!r}.')
    for key, seed in (('train_seed', self.train_seed), ('eval_seed', self.eval_seed)):
      if not (isinstance(seed, int) and 0 <= seed and (seed + 1) * size <= SEED_LIMIT):
        raise ValueError(
          f'`task.{key}` must be an int with 0 <= seed and (seed + 1) x {where} <= 2**32 '
          f'(reasoning-gym seeds entries with seed + index), got {seed!r} with size {size}.'
        )
    if self.train_seed == self.eval_seed:
      raise ValueError(
        f'`task.train_seed` and `task.eval_seed` are both {self.train_seed}: the held-out '
        'entries would be training entries.'
      )
    most = max(allocate(eval_size, self.weights).values())
    if most > size:
      raise ValueError(
        f'`task.eval_size`={eval_size} asks for {most} held-out entries of one dataset, more '
        f'than {where}={size}.'
      )

  def _set_up_curriculum(self, name):
    """The curriculum of `name`, its highest usable level, and settings that do not clash."""
    curriculum = _curriculum(name)
    levels = _levels(curriculum)
    where = f'{FIELD}.curriculum.start_level`'
    if self.rule.start_level >= levels:
      raise ValueError(f'{where}={self.rule.start_level}: {name} has levels 0 to {levels - 1}.')
    try:
      owned = _curriculum_fields(curriculum, 0)
    except (AssertionError, ValueError, TypeError, AttributeError, KeyError) as e:
      raise ValueError(
        f"{FIELD}.curriculum.raise_at`: reasoning-gym's curriculum for {name} fails ({e!r}); "
        'train it without one (raise_at=None).'
      ) from None
    clash = sorted(set(owned) & set(self.settings[name]))
    if clash:
      raise ValueError(
        f'{FIELD}.settings.{name}.{clash[0]}`: the curriculum sets {", ".join(clash)} of {name} '
        'at each level; leave them out of the settings or turn the curriculum off.'
      )
    # Some of reasoning-gym's curricula have top levels their own configs refuse:
    # the usable levels stop below the first refused one.
    top = self.rule.start_level
    self.curricula[name] = curriculum
    self._config(name, 'train', self.rule.start_level, where)
    while top + 1 < levels:
      try:
        self._config(name, 'train', top + 1, f'{FIELD}.curriculum`')
      except ValueError as e:
        if distributed.is_main():
          print(f'task: the curriculum of {name} stops at level {top} of 0-{levels - 1}: {e}')
        break
      top += 1
    self.tops[name] = top

  def _kwargs(self, name, split, level):
    """The keyword arguments of reasoning_gym.create_dataset for `name`."""
    kwargs = dict(self.settings[name])
    if name in self.curricula:
      kwargs.update(_curriculum_fields(self.curricula[name], level))
    seed = self.train_seed if split == 'train' else self.eval_seed
    kwargs.update(seed=seed * self.size, size=self.size)
    return kwargs

  def _config(self, name, split, level, where=None):
    """(kwargs, the dataset's config object), checked by the dataset's own validation."""
    from reasoning_gym.factory import DATASETS

    kwargs = None
    try:
      kwargs = self._kwargs(name, split, level)
      config = DATASETS[name][1](**kwargs)
      if hasattr(config, 'validate'):
        config.validate()
    except (AssertionError, ValueError, TypeError, AttributeError, KeyError) as e:
      at = f' at curriculum level {level}' if name in self.curricula else ''
      with_kwargs = f' with {kwargs}' if kwargs is not None else ''
      where = where or f'{FIELD}.settings.{name}`'
      raise ValueError(f'{where}: reasoning-gym refuses {name}{at}{with_kwargs}: {e}') from None
    return kwargs, config

  def _dataset(self, name, split, level):
    """(kwargs, dataset) of `name` for `split` at curriculum `level` (None: no curriculum)."""
    key = (name, split, level)
    if key not in self._datasets:
      kwargs, _ = self._config(name, split, level)
      self._datasets[key] = kwargs, scoring.dataset(name, kwargs)
    return self._datasets[key]

  def _row(self, name, level, kwargs, entry):
    answer = entry['answer']
    row = {
      'prompt': entry['question'],
      'answer': '' if answer is None else str(answer),
      'dataset': name,
      'reasoning_gym': {'dataset': name, 'kwargs': kwargs, 'entry': entry, **self.scoring},
    }
    if level is not None:
      row['level'] = level
    return row

  def _held_out(self, eval_size):
    """(rows, the number left out by `drop`)."""
    rows, dropped = [], 0
    for name, count in allocate(eval_size, self.weights).items():
      level = self.levels.get(name)
      kwargs, ds = self._dataset(name, 'eval', level)
      for j in range(count):
        row = self._row(name, level, kwargs, ds[j])
        try:
          if self.check is not None:
            self.check(row)
        except self.drop:
          dropped += 1
          continue
        except ValueError as e:
          raise ValueError(f"`task.kind` 'reasoning_gym' held-out {name} entry {j}: {e}") from None
        rows.append(row)
    return rows, dropped

  # The stream -----------------------------------------------------------------------

  def example(self, i):
    """Training example `i` (module docstring), at its dataset's current level."""
    if i in self._recent:
      return self._recent[i]
    rng = np.random.default_rng((self.train_seed, i))
    name = self.names[int(rng.choice(len(self.names), p=self.probs))]
    level = self.levels.get(name)
    kwargs, ds = self._dataset(name, 'train', level)
    held, long = 0, 0
    for _ in range(MAX_DRAWS):
      j = int(rng.integers(self.size))
      entry = ds[j]
      if entry['question'] in self.held_out_questions:
        held += 1
        continue
      row = self._row(name, level, kwargs, entry)
      try:
        if self.train_check is not None:
          self.train_check(row)
      except self.drop:
        long += 1
        continue
      except ValueError as e:
        raise ValueError(
          f"`task.kind` 'reasoning_gym' training example {i} ({name} entry {j}): {e}"
        ) from None
      self.skipped['held_out'] += held
      self.skipped['filtered'] += long
      if len(self._recent) >= RECENT:
        self._recent.clear()
      self._recent[i] = row
      return row
    raise ValueError(
      f"`task.kind` 'reasoning_gym' training example {i}: {MAX_DRAWS} draws from {name} in a "
      f'row were held-out questions ({held}) or prompts over `task.max_prompt_len` ({long}, '
      'task.long_prompts=filter): give it more problems (its settings in '
      '`task.reasoning_gym.settings`), fewer held-out ones (`task.eval_size`) or room.'
    )

  def observe(self, examples, per_fn, total):
    """Per-dataset metrics of one rollout, and the curriculum's step.

    Args:
      examples: N rows (the rollout's prompts, all processes').
      per_fn: {reward function: [N, G] float}, NaN where unscored.
      total: [N, G] float, the trained reward, NaN where left out of training.
    Returns:
      {'task/<dataset>/reward', 'task/<dataset>/prompts', 'task/<dataset>/level'}.
    """
    scores_NxG = np.asarray(per_fn.get(REWARD, total), np.float64)
    if scores_NxG.shape[0] != len(examples):
      raise ValueError(f'{len(examples)} examples and scores of shape {scores_NxG.shape}.')
    seen = {}
    for row, scores in zip(examples, scores_NxG, strict=True):
      got = seen.setdefault(row['dataset'], [0, []])
      got[0] += 1
      got[1].extend(float(s) for s in scores[np.isfinite(scores)])
    metrics = {}
    for name, (prompts, scores) in sorted(seen.items()):
      metrics[f'task/{name}/prompts'] = float(prompts)
      if scores:
        metrics[f'task/{name}/reward'] = float(np.mean(scores))
      if name in self.windows:
        window = (self.windows[name] + scores)[-self.rule.window :]
        level, restart = self.rule.step(self.levels[name], self.tops[name], window)
        if level != self.levels[name]:
          self.levels[name] = level
          self._recent.clear()  # examples not yet drawn come from the new level
        self.windows[name] = [] if restart else window
    for name, level in self.levels.items():
      metrics[f'task/{name}/level'] = float(level)
    return metrics

  def state(self):
    """The curriculum's levels and windows (JSON), saved beside the stream's position."""
    return {'levels': dict(self.levels), 'windows': {n: list(w) for n, w in self.windows.items()}}

  def restore(self, state):
    levels = state.get('levels', {})
    if set(levels) != set(self.levels):
      raise ValueError(
        f'the checkpoint holds curriculum levels of {sorted(levels)}, this run has '
        f'{sorted(self.levels)}: `task.reasoning_gym` changed since it was saved.'
      )
    self.levels = {n: int(v) for n, v in levels.items()}
    self.windows = {n: [float(x) for x in w] for n, w in state.get('windows', {}).items()}
    self._recent.clear()
