"""PPO with a critic on the default task: SFT warm-up, then PPO with GAE and an
adaptive KL penalty in the reward.

    python launch/train.py --config configs/ppo_arith.py
"""

from configs import common, grpo_arith


def get_config(arg=None):
  c = common.derive(grpo_arith.arith_job(), 'ppo')
  c.workdir = 'runs/ppo_arith'
  c.rl.group_size = 4  # PPO needs no groups; 4 samples per prompt keep batches full
  c.rl.prompts_per_step = 32
  c.rl.advantage = 'grpo'  # unused by PPO (GAE); kept for validation
  c.rl.kl_coef = 0.02  # initial β of the KL penalty
  c.rl.kl_in = 'reward'
  c.rl.kl.estimator = 'k1'
  c.rl.epochs = 2
  c.lock()
  return common.variant(c, arg)
