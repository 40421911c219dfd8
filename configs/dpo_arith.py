"""DPO on the default task: SFT warm-up, then DPO on pairs with a known true
preference (the correct answer over an answer off by 1-10).

    python launch/train.py --config configs/dpo_arith.py
    python launch/train.py --config configs/dpo_arith.py --config.dpo.loss=ipo
    python launch/train.py --config configs/dpo_arith.py --config.dpo.train_path=pairs.jsonl

`dpo.loss` may also be hinge, simpo or orpo.
"""

from configs import common, grpo_arith


def get_config(arg=None):
  c = common.derive(grpo_arith.arith_job(), 'dpo')  # its model, task and SFT warm-up
  c.workdir = 'runs/dpo_arith'
  c.dpo.beta = 0.1
  c.dpo.pairs_per_step = 32
  c.dpo.steps = 100
  c.optim.lr = 5e-5
  c.lock()
  return common.variant(c, arg)
