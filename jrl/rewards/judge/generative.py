"""The generative judge: a jrl language model, run greedily through jrl's
sampler, as a pairwise judge (both orders), a scorer, a preference labeller
and a reward function.

How it prompts, parses, swaps positions and counts: README.md beside this file.
"""

import collections

import numpy as np

from jrl.rewards.judge.encoding import PromptEncoder
from jrl.rewards.judge.preferences import check_pair_rows, judgeable_pairs, preference_row
from jrl.rewards.judge.prompts import check_scale, pairwise_prompt, prompt_texts, score_prompt
from jrl.rewards.judge.verdicts import (
  REFERENCE_REWARD,
  combine_orders,
  normalize_score,
  parse_pairwise,
  parse_score,
)
from jrl.sampler import Request, Sampler, SamplerConfig, pages_needed

MODES = ('pairwise', 'score')
STAT_KEYS = (
  'judged',
  'unparseable',
  'inconsistent',
  'ties',
  'truncated_inputs',
  'truncated_outputs',
)


def _positive_int(value, name):
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f'`{name}` must be a positive int, got {value!r}.')
  return value


def _check_lengths(**lists):
  """The common length of the named lists, or ValueError naming them."""
  lengths = {}
  for name, values in lists.items():
    if not isinstance(values, list | tuple):
      raise ValueError(f'`{name}` must be a list, got {type(values).__name__}.')
    lengths[name] = len(values)
  if len(set(lengths.values())) > 1:
    described = ', '.join(f'`{k}` has {v}' for k, v in lengths.items())
    raise ValueError(f'the inputs must have one entry per item: {described}.')
  return next(iter(lengths.values()))


def _check_texts(name, values):
  for i, v in enumerate(values):
    if not isinstance(v, str):
      raise ValueError(f'`{name}[{i}]` must be a string, got {type(v).__name__}.')


def _new_stats():
  return dict.fromkeys(STAT_KEYS, 0)


class GenerativeJudge:
  """A jrl language model as a pairwise or scoring judge (see README.md)."""

  def __init__(
    self,
    graphdef,
    params,
    model_config,
    tokenizer,
    rubric,
    *,
    mode='pairwise',
    max_new_tokens=512,
    max_prompt_len=4096,
    num_slots=16,
    mesh=None,
    scale=(1, 10),
    swap_positions=True,
    allow_tie=True,
    chat_template=False,
    add_bos=False,
    stop_tokens=None,
    page_size=16,
    num_pages=None,
    steps_per_dispatch=8,
  ):
    """
    Args:
      graphdef, params: the judge model (`models.create` or `hf.load`); params
        are used as they are, with their sharding.
      model_config: its ModelConfig.
      tokenizer: a jrl tokenizer (encode, decode, eos_ids, apply_chat_template).
      rubric: the criteria or constitution, shown to the judge verbatim.
      mode: 'pairwise' (compare, label_pairs, reward against a reference) or
        'score' (score, reward).
      max_new_tokens: the judge's output budget (tokens).
      max_prompt_len: the longest judge prompt (tokens); longer ones have their
        completions shortened.
      num_slots: sequences decoded together.
      mesh: the mesh the params live on (None: one device).
      scale: (lo, hi) integer score range (mode 'score').
      swap_positions: judge pairs in both orders (mode 'pairwise').
      allow_tie: offer and accept `Verdict: tie` (mode 'pairwise').
      chat_template: send the judge text as one user message through the
        tokenizer's chat template.
      add_bos: put `tokenizer.bos_id` first.
      stop_tokens: ids that end the judge's output (default tokenizer.eos_ids).
      page_size: KV cache page size (tokens).
      num_pages: KV cache pages (default: every slot at its worst case, plus
        the scratch page).
      steps_per_dispatch: decode steps per jitted call.
    """
    if mode not in MODES:
      raise ValueError(f'`mode` must be one of {MODES}, got {mode!r}.')
    if not isinstance(rubric, str) or not rubric.strip():
      raise ValueError('`rubric` must be a non-empty string.')
    self.scale = check_scale(scale)
    _positive_int(max_new_tokens, 'max_new_tokens')
    _positive_int(max_prompt_len, 'max_prompt_len')
    _positive_int(num_slots, 'num_slots')
    _positive_int(page_size, 'page_size')
    if tokenizer.vocab_size > model_config.vocab_size:
      raise ValueError(
        f"`tokenizer` has {tokenizer.vocab_size} tokens, more than the judge model's "
        f'vocab_size {model_config.vocab_size}.'
      )
    stop_tokens = tuple(int(t) for t in (tokenizer.eos_ids if stop_tokens is None else stop_tokens))
    if not stop_tokens:
      raise ValueError(
        '`stop_tokens` is empty (the tokenizer has no eos_ids): the judge could never end '
        'its output, and every output cut at max_new_tokens is unparseable.'
      )
    self.graphdef, self.params, self.model_config = graphdef, params, model_config
    self.tokenizer, self.rubric, self.mode = tokenizer, rubric, mode
    self.max_new_tokens, self.max_prompt_len = max_new_tokens, max_prompt_len
    self.swap_positions, self.allow_tie = bool(swap_positions), bool(allow_tie)
    self.chat_template, self.add_bos = bool(chat_template), bool(add_bos)
    self.stop_tokens = stop_tokens
    if self.chat_template:
      try:
        tokenizer.apply_chat_template([{'role': 'user', 'content': 'x'}])
      except Exception as e:  # the tokenizer's own error, named by our flag
        raise ValueError(f'`chat_template=True` but the tokenizer cannot apply one: {e}') from e
    if num_pages is None:
      num_pages = num_slots * pages_needed(max_prompt_len, max_new_tokens, 1, page_size) + 1
    engine_config = SamplerConfig(
      num_slots=num_slots,
      num_pages=num_pages,
      page_size=page_size,
      max_prompt_len=max_prompt_len,
      max_new_tokens=max_new_tokens,
      max_stop_tokens=max(4, len(stop_tokens)),
    )
    self.sampler = Sampler(
      graphdef, model_config, engine_config, steps_per_dispatch=steps_per_dispatch, mesh=mesh
    )
    self.encoder = PromptEncoder(
      tokenizer, max_prompt_len, chat_template=self.chat_template, add_bos=self.add_bos
    )
    self.last_stats = _new_stats()
    self.last_outputs = []  # the last call's decoded judge outputs, in generation order
    self.totals = collections.Counter()

  @classmethod
  def load(cls, path, tokenizer, rubric, *, mesh=None, param_dtype=None, compute_dtype=None, **kw):
    """A judge from a Hugging Face causal-LM checkpoint directory (`hf.load`)."""
    from jrl.models import hf

    overrides = {'param_dtype': param_dtype, 'compute_dtype': compute_dtype}
    ck = hf.load(path, mesh=mesh, **{k: v for k, v in overrides.items() if v is not None})
    return cls(ck.graphdef, ck.params, ck.config, tokenizer, rubric, mesh=mesh, **kw)

  # Text -> token ids ---------------------------------------------------------------

  def escape_special_tokens(self, text):
    """`text` with every substring the tokenizer reads as a special token broken
    up by a space (`<|im_end|>` -> `< |im_end|>`), or removed if that fails."""
    return self.encoder.escape_special_tokens(text)

  # Generation ----------------------------------------------------------------------

  def _generate(self, prompt_ids):
    """Greedy judge outputs: [(text, truncated)] per prompt."""
    if not prompt_ids:
      self.last_outputs = []
      return []
    requests = [
      Request(
        prompt=ids, max_new_tokens=self.max_new_tokens, greedy=True, stop_tokens=self.stop_tokens
      )
      for ids in prompt_ids
    ]
    groups = self.sampler.generate(self.params, requests, group_size=1)
    stop = set(self.stop_tokens)
    out = []
    for (c,) in groups:
      tokens = [int(t) for t in c.tokens if int(t) not in stop]
      out.append(
        (self.tokenizer.decode(tokens, skip_special_tokens=True), c.finish_reason == 'length')
      )
    self.last_outputs = [text for text, _ in out]
    return out

  def _record(self, stats):
    self.last_stats = stats
    self.totals.update(stats)
    return stats

  def _require(self, mode, method):
    if self.mode != mode:
      raise ValueError(f'`{method}` needs mode={mode!r}; this judge has mode={self.mode!r}.')

  # Pairwise ------------------------------------------------------------------------

  def compare(self, prompts, completions_a, completions_b):
    """Which completion of each prompt is better.

    Args:
      prompts: [N] user prompts (strings or chat messages).
      completions_a, completions_b: [N] strings.

    Returns:
      (verdicts, stats): [N] of 'A' | 'B' | 'tie' | None (None: could not
      judge), and the counts of the module doc.
    """
    self._require('pairwise', 'compare')
    n = _check_lengths(prompts=prompts, completions_a=completions_a, completions_b=completions_b)
    _check_texts('completions_a', completions_a)
    _check_texts('completions_b', completions_b)
    shown = [self.escape_special_tokens(p) for p in prompt_texts(prompts)]
    a = [self.escape_special_tokens(c) for c in completions_a]
    b = [self.escape_special_tokens(c) for c in completions_b]
    orders = [(a, b)] + ([(b, a)] if self.swap_positions else [])
    prompt_ids, cut = [], np.zeros((len(orders), n), bool)
    for k, (first, second) in enumerate(orders):
      for i in range(n):
        build = lambda x, y, i=i: pairwise_prompt(
          self.rubric, shown[i], x, y, allow_tie=self.allow_tie
        )
        ids, cut[k, i] = self.encoder.fit(build, [first[i], second[i]], f'item {i}')
        prompt_ids.append(ids)
    outputs = self._generate(prompt_ids)
    parsed = np.empty((len(orders), n), object)
    truncated = np.zeros((len(orders), n), bool)
    for j, (text, was_cut) in enumerate(outputs):
      k, i = divmod(j, n)
      parsed[k, i] = parse_pairwise(text, allow_tie=self.allow_tie, truncated=was_cut)
      truncated[k, i] = was_cut
    stats = _new_stats()
    verdicts = []
    for i in range(n):
      votes = list(parsed[:, i])
      verdict = combine_orders(*votes) if self.swap_positions else votes[0]
      stats['judged'] += 1
      stats['truncated_inputs'] += int(cut[:, i].any())
      stats['truncated_outputs'] += int(truncated[:, i].any())
      if any(v is None for v in votes):
        stats['unparseable'] += 1
      elif verdict is None:
        stats['inconsistent'] += 1
      elif verdict == 'tie':
        stats['ties'] += 1
      verdicts.append(verdict)
    return verdicts, self._record(stats)

  def label_pairs(self, rows):
    """Preference rows from judged pairs, for DPO or reward-model training.

    Args:
      rows: [N] dicts {'prompt': str | messages, 'completion_a': str,
        'completion_b': str, ...}; other keys are carried over.

    Returns:
      (preference rows {'prompt', 'chosen', 'rejected', ...} for the pairs
      with a winner, stats): the compare counts plus `skipped` (pairs not
      judged: identical or empty completions, which make no valid preference
      row), `dropped` (judged, but unparseable, inconsistent or a tie) and
      `kept`. Nothing is guessed.
    """
    self._require('pairwise', 'label_pairs')
    check_pair_rows(rows)
    judged = judgeable_pairs(rows)
    verdicts, stats = self.compare(
      [rows[i]['prompt'] for i in judged],
      [rows[i]['completion_a'] for i in judged],
      [rows[i]['completion_b'] for i in judged],
    )
    out = [
      preference_row(rows[i], verdict)
      for i, verdict in zip(judged, verdicts, strict=True)
      if verdict in ('A', 'B')
    ]
    stats = dict(
      stats, skipped=len(rows) - len(judged), dropped=len(judged) - len(out), kept=len(out)
    )
    self.last_stats = stats
    return out, stats

  # Scores --------------------------------------------------------------------------

  def score(self, prompts, completions):
    """Rates each completion on the scale, normalised to [0, 1].

    Args:
      prompts: [N] user prompts (strings or chat messages).
      completions: [N] strings.

    Returns:
      [N] float32, (s - lo) / (hi - lo), NaN where the judge's output had no
      valid score. The counts go to `last_stats`.
    """
    self._require('score', 'score')
    n = _check_lengths(prompts=prompts, completions=completions)
    _check_texts('completions', completions)
    texts = prompt_texts(prompts)
    prompt_ids, cut = [], []
    for i in range(n):
      shown = self.escape_special_tokens(texts[i])
      build = lambda x, shown=shown: score_prompt(self.rubric, shown, x, self.scale)
      ids, was_cut = self.encoder.fit(
        build, [self.escape_special_tokens(completions[i])], f'item {i}'
      )
      prompt_ids.append(ids)
      cut.append(was_cut)
    outputs = self._generate(prompt_ids)
    stats = _new_stats()
    out = np.full(n, np.nan, np.float32)
    for i, (text, was_cut) in enumerate(outputs):
      s = parse_score(text, self.scale, truncated=was_cut)
      out[i] = normalize_score(s, self.scale)
      stats['judged'] += 1
      stats['unparseable'] += int(s is None)
      stats['truncated_inputs'] += int(cut[i])
      stats['truncated_outputs'] += int(was_cut)
    self._record(stats)
    return out

  # As a reward function --------------------------------------------------------------

  def as_reward_fn(self, *, use_metadata_prompt=True):
    """A batched reward function `fn(prompts, completions, metadata) -> [N] float32`.

    Mode 'score': the normalised score. Mode 'pairwise': the completion
    against `metadata[i]['reference']` (a string): 1 if it wins, 0.5 for a
    tie, 0 if it loses. NaN: could not score. For an `inline_fns` entry of
    `RewardService`; counts in `last_stats` and `totals`.

    Args:
      use_metadata_prompt: show the judge `metadata[i]['prompt']` when it is
        there (the trainer passes each example as metadata, with its raw
        prompt, whereas `prompts` holds the policy's rendered prompt text,
        chat template included), else `prompts[i]`.
    """

    def shown_prompts(prompts, metadata):
      if not use_metadata_prompt or metadata is None:
        return list(prompts)
      return [
        m['prompt'] if isinstance(m, dict) and m.get('prompt') else p
        for p, m in zip(prompts, metadata, strict=True)
      ]

    if self.mode == 'score':

      def judge_score(prompts, completions, metadata=None):
        if metadata is not None:
          _check_lengths(prompts=prompts, completions=completions, metadata=metadata)
        return self.score(shown_prompts(prompts, metadata), completions)

      return judge_score

    def judge_vs_reference(prompts, completions, metadata):
      _check_lengths(prompts=prompts, completions=completions, metadata=metadata)
      references = []
      for i, m in enumerate(metadata):
        ref = m.get('reference') if isinstance(m, dict) else None
        if not isinstance(ref, str):
          raise ValueError(
            f"`metadata[{i}]['reference']` must be a string (the completion to beat) "
            'for a pairwise judge reward.'
          )
        references.append(ref)
      verdicts, _ = self.compare(shown_prompts(prompts, metadata), list(completions), references)
      return np.array([REFERENCE_REWARD[v] for v in verdicts], np.float32)

    return judge_vs_reference
