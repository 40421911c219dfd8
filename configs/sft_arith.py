"""Supervised fine-tuning only, on the default task (the baseline to GRPO).

python launch/train.py --config configs/sft_arith.py
"""

from configs import common, grpo_arith


def get_config(arg=None):
  c = grpo_arith.get_config()
  c.algorithm = 'sft'
  c.workdir = 'runs/sft_arith'
  c.sft.steps = 550  # as many iterations as the default job's SFT + GRPO
  c.rl.steps = 0
  return common.variant(c, arg)
