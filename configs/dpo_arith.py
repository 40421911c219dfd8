"""DPO on the default task: SFT warm-up, then DPO on pairs with a known true
preference (the correct answer over an answer off by 1-10).

    python launch/train.py --config configs/dpo_arith.py
    python launch/train.py --config configs/dpo_arith.py --config.dpo.loss=ipo
    python launch/train.py --config configs/dpo_arith.py --config.dpo.train_path=pairs.jsonl

`dpo.loss` may also be hinge, simpo or orpo.
"""

from configs import common, grpo_arith


def get_config(arg=None):
  c = grpo_arith.get_config()
  c.unlock()
  c.algorithm = 'dpo'
  c.workdir = 'runs/dpo_arith'
  c.dpo = common.dpo_section()
  c.dpo.beta = 0.1
  c.dpo.pairs_per_step = 32
  c.rl.steps = 100  # DPO steps
  c.optim.lr = 5e-5
  c.lock()
  return common.variant(c, arg)
