"""RLHF pipeline, stage 2 of 3: a Bradley-Terry reward model on preference pairs.

    python launch/train.py --config configs/rlhf_rm.py

Starts from stage 1's export (`runs/rlhf_sft/hf_export`, the backbone; the
scalar head is new) and trains on pairs made from the task with a known
true preference: the correct answer over one off by 1-10. Held-out
pairwise accuracy (`eval/pair_accuracy`) is measured every `eval.every`
steps; the result is exported to `runs/rlhf_rm/hf_export` for stage 3.
Pairs from a file: `--config.rm.train_path=pairs.jsonl --config.rm.eval_path=...`.
"""

from configs import common, grpo_arith


def get_config(arg=None):
  c = common.derive(grpo_arith.arith_job(), 'reward_model')  # its task and sizes
  c.workdir = 'runs/rlhf_rm'
  c.model.path = 'runs/rlhf_sft/hf_export'
  c.rm.pairs_per_step = 32
  c.rm.center_coef = 0.01
  c.rm.steps = 300
  c.optim.lr = 1e-4
  c.optim.warmup_steps = 10
  c.eval.every = 50
  c.checkpoint.every = 100
  c.export_hf = True
  c.lock()
  return common.variant(c, arg)
