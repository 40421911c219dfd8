"""jrl.rewards.judge: a generative judge for RLAIF. A jrl language model reads
a rubric, a user prompt and one or two completions, and ends with a verdict
that becomes a reward or a preference label. See README.md beside this file.
"""

# `_allocate` too: tests/rewards/test_judge.py reads it as `judge._allocate`.
from jrl.rewards.judge.encoding import MIN_KEPT_TOKENS, TRUNCATION_MARKER, _allocate
from jrl.rewards.judge.generative import MODES, STAT_KEYS, GenerativeJudge
from jrl.rewards.judge.preferences import write_preference_jsonl
from jrl.rewards.judge.prompts import (
  check_scale,
  escape_delimiters,
  format_prompt,
  pairwise_prompt,
  score_prompt,
)
from jrl.rewards.judge.verdicts import (
  REFERENCE_REWARD,
  combine_orders,
  normalize_score,
  parse_pairwise,
  parse_score,
)
