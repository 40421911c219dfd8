"""RLHF pipeline, stage 1 of 3: supervised fine-tuning, exported for the next stages.

    python launch/train.py --config configs/rlhf_sft.py   # -> runs/rlhf_sft/hf_export
    python launch/train.py --config configs/rlhf_rm.py    # -> runs/rlhf_rm/hf_export
    python launch/train.py --config configs/rlhf_ppo.py   # PPO against the reward model

The CPU-sized pipeline runs on the default task (2-digit addition), where
the true preference is known (the correct answer is better than a wrong
one), so the reward model's accuracy and the policy's improvement are
measured against ground truth: `eval/pair_accuracy` of stage 2 on
held-out pairs, `eval/accuracy` (exact match) of stages 1 and 3.
"""

from configs import common, grpo_arith


def get_config(arg=None):
  c = common.derive(grpo_arith.arith_job(), 'sft')
  c.workdir = 'runs/rlhf_sft'
  c.sft.steps = 450  # as the shared arithmetic jobs' warm-up
  c.eval.every = 150
  c.export_hf = True
  c.lock()
  return common.variant(c, arg)
