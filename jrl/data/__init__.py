"""jrl.data: prompt sources (synthetic tasks, JSONL files) and grain streams."""

from jrl.data.arith import ArithmeticTask
from jrl.data.sources import (
  PromptStream,
  read_jsonl,
  read_preference_jsonl,
  read_sft_jsonl,
  read_unlabelled_pairs_jsonl,
)
