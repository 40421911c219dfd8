"""Page-pool sizing on the host: worst-case pages of a group, of a pool, and
the static page bound of a `generate` call."""

import math


def attend_pages(num_pages_S, num_steps, cfg):
  """A static page bound for `generate`: the most pages any slot can hold after
  `num_steps` more tokens, rounded up to a power of two (capped at M), so at
  most log2(M) + 1 compiled variants and usually one or two per call."""
  m = cfg.max_pages_per_slot
  bound = int(max(num_pages_S, default=0)) + math.ceil(num_steps / cfg.page_size) + 1
  return min(1 << max(0, math.ceil(math.log2(bound))), m)


def pool_pages(max_prompt_len, max_new, group_size, page_size, num_slots):
  """Pages (scratch included) for `num_slots // group_size` groups in flight at
  their worst case. A prompt that fills no whole page shares nothing, so the
  worst case is not always the longest prompt: take the maximum over lengths."""
  per_group = max(
    pages_needed(n, max_new, group_size, page_size) for n in range(1, max_prompt_len + 1)
  )
  return 1 + per_group * max(1, num_slots // group_size)


def pages_needed(prompt_len, max_new, group_size, page_size):
  """Worst-case pages a group of `group_size` samples of one prompt can hold:
  the shared full prompt pages plus each sample's private pages."""
  n_full = prompt_len // page_size
  per_slot = math.ceil((prompt_len + max_new - 1) / page_size)
  return n_full + group_size * (per_slot - n_full)


def group_pages(prompt_len, max_news, page_size):
  """Worst-case pages of a group whose samples have their own `max_news`:
  the shared full prompt pages plus each sample's private pages."""
  n_full = prompt_len // page_size
  return n_full + sum(math.ceil((prompt_len + m - 1) / page_size) - n_full for m in max_news)
