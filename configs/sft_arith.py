"""Supervised fine-tuning only, on the default job's task and teacher (the
baseline to GRPO at equal compute).

python launch/train.py --config configs/sft_arith.py
"""

from configs import common, grpo_arith


def get_config(arg=None):
  c = common.derive(grpo_arith.get_config(), 'sft')  # its model, task, teacher and SFT settings
  c.workdir = 'runs/sft_arith'
  # The default job's 900 SFT + 100 GRPO iterations took the time of 1,135 SFT
  # iterations (launch/rl_vs_sft.py on 2 cores: 0.083 s per SFT, 0.194 s per GRPO iteration).
  c.sft.steps = 1135
  c.lock()
  return common.variant(c, arg)
