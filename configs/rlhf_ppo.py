"""RLHF pipeline, stage 3 of 3: PPO against the trained reward model.

    python launch/train.py --config configs/rlhf_ppo.py

The policy starts from stage 1's export and the critic from stage 2's
reward model; the only reward is that model's score, normalised with
running statistics and clipped, with a KL penalty to the reference (the
SFT policy) in the reward. Progress is measured against ground truth:
`eval/accuracy` (exact match on held-out problems), which the reward model
never sees. `reward/length_corr` reports whether the reward model pays for
length.
"""

from configs import common, ppo_arith


def get_config(arg=None):
  c = ppo_arith.get_config()
  c.unlock()
  c.workdir = 'runs/rlhf_ppo'
  c.model.path = 'runs/rlhf_sft/hf_export'
  c.sft.steps = 0
  c.ppo.critic_path = 'runs/rlhf_rm/hf_export'
  c.reward.model_path = 'runs/rlhf_rm/hf_export'
  c.reward.functions = ('reward_model',)
  c.reward.mode = 'inline'  # the reward model holds device arrays
  c.reward.normalize = True
  c.reward.clip = 5.0
  c.rl.kl_coef = 0.05
  c.rl.kl_in = 'reward'
  c.eval.every = 25
  c.lock()
  return common.variant(c, arg)
