"""jrl.data: prompt sources (synthetic tasks, JSONL and Parquet files) and grain streams."""

from jrl.data.arith import ArithmeticTask
from jrl.data.sources import (
  ANSWER_EXTRACTORS,
  PromptFile,
  PromptStream,
  extract_gsm8k_answer,
  prompt_rows,
  read_jsonl,
  read_preference_jsonl,
  read_prompts,
  read_sft_jsonl,
  read_unlabelled_pairs_jsonl,
  write_jsonl,
  write_parquet,
)
