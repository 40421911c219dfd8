"""Supervised fine-tuning only, on the default task (the baseline to GRPO).

python launch/train.py --config configs/sft_arith.py
"""

from configs import common, grpo_arith


def get_config(arg=None):
  c = common.derive(grpo_arith.get_config(), 'sft')  # its model, task and SFT settings
  c.workdir = 'runs/sft_arith'
  c.sft.steps = 550  # as many iterations as the default job's SFT + GRPO
  c.lock()
  return common.variant(c, arg)
