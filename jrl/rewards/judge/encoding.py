"""Judge text to prompt token ids: the chat template, special tokens from
untrusted text broken up, and completions shortened in the middle to fit
`max_prompt_len` (README.md beside this file, "Long inputs").
"""

TRUNCATION_MARKER = '\n[... truncated ...]\n'
MIN_KEPT_TOKENS = 16  # the fewest tokens of a completion worth judging


def _allocate(lengths, budget):
  """Token allowances summing to ≤ budget: short ones whole, long ones equal shares."""
  out = [0] * len(lengths)
  left = budget
  order = sorted(range(len(lengths)), key=lambda i: lengths[i])
  for rank, i in enumerate(order):
    out[i] = min(lengths[i], left // (len(lengths) - rank))
    left -= out[i]
  return out


class PromptEncoder:
  """Encodes judge prompts for one tokenizer within `max_prompt_len` tokens."""

  def __init__(self, tokenizer, max_prompt_len, *, chat_template=False, add_bos=False):
    """
    Args:
      tokenizer: a jrl tokenizer (encode, decode, bos_id, apply_chat_template).
      max_prompt_len: the longest judge prompt (tokens).
      chat_template: send the text as one user message through the
        tokenizer's chat template.
      add_bos: put `tokenizer.bos_id` first.
    """
    self.tokenizer, self.max_prompt_len = tokenizer, max_prompt_len
    self.chat_template, self.add_bos = chat_template, add_bos
    self.marker_len = len(tokenizer.encode(TRUNCATION_MARKER))
    self._special = {}  # token id -> whether it is a special (control) token

  def _is_special(self, token):
    if token not in self._special:
      tok = self.tokenizer
      self._special[token] = (
        tok.decode([token], skip_special_tokens=True) == '' and tok.decode([token]) != ''
      )
    return self._special[token]

  def escape_special_tokens(self, text):
    """`text` with every substring the tokenizer reads as a special token broken
    up by a space (`<|im_end|>` -> `< |im_end|>`), or removed if that fails."""
    for attempt in range(len(text) + 1):
      specials = {
        self.tokenizer.decode([t]) for t in set(self.tokenizer.encode(text)) if self._is_special(t)
      }
      if not specials:
        return text
      for s in sorted(specials, key=len, reverse=True):
        text = text.replace(s, f'{s[0]} {s[1:]}' if attempt == 0 and len(s) > 1 else '')
    return text

  def ids(self, text):
    """The prompt token ids of judge text `text`."""
    if self.chat_template:
      text = self.tokenizer.apply_chat_template(
        [{'role': 'user', 'content': text}], add_generation_prompt=True
      )
    ids = list(self.tokenizer.encode(text))
    if self.add_bos and self.tokenizer.bos_id is not None:
      ids = [self.tokenizer.bos_id, *ids]
    return ids

  def _cut(self, ids, allowance):
    """A completion's text kept to `allowance` tokens: head, marker, tail."""
    keep = allowance - self.marker_len
    head = keep // 2
    tail = keep - head
    decode = self.tokenizer.decode
    return decode(ids[:head]) + TRUNCATION_MARKER + decode(ids[len(ids) - tail :])

  def fit(self, build, completions, where):
    """Token ids of `build(*completions)` within max_prompt_len.

    Args:
      build: fn(*completions) -> the judge text.
      completions: the completion texts, shortened when the text is too long.
      where: names the item in the ValueError raised when nothing fits.

    Returns:
      (ids, whether the completions were shortened).
    """
    limit = self.max_prompt_len
    ids = self.ids(build(*completions))
    if len(ids) <= limit:
      return ids, False
    fixed = len(self.ids(build(*[''] * len(completions))))
    tokens = [self.tokenizer.encode(c) for c in completions]
    need = sum(min(len(t), self.marker_len + MIN_KEPT_TOKENS) for t in tokens)
    budget = limit - fixed
    while budget >= need:
      allowances = _allocate([len(t) for t in tokens], budget)
      texts = [
        c if a >= len(t) else self._cut(t, a)
        for c, t, a in zip(completions, tokens, allowances, strict=True)
      ]
      ids = self.ids(build(*texts))
      if len(ids) <= limit:
        return ids, True
      budget -= len(ids) - limit  # tokens merge differently across the cut: shrink and retry
    raise ValueError(
      f'{where}: the judge prompt without its completions takes {fixed} tokens, which leaves '
      f'too few of `max_prompt_len`={limit} for the completions (at least '
      f'{MIN_KEPT_TOKENS} tokens plus the truncation marker each): raise `max_prompt_len` '
      'or shorten the rubric or the prompt.'
    )
