"""The default agentic job: multi-step arithmetic with a calculator tool, on the CPU.

    python launch/train.py --config configs/agent_arith.py

Problems `a*b+c=` (a in 10-99, b in 2-9, c in 10-99) that a 3M-parameter
model rarely computes right by itself. The SFT warm-up shows two kinds of
correct episodes, half answering directly and half calling the calculator
(`{calc:47*8+13}` -> `[389]` -> `389`), so RL starts from a policy that
sometimes uses the tool; GRPO on the exact-match reward then raises both
the tool-use rate and the reward. Held-out accuracy and tool-use rate
(greedy) are logged as `eval/accuracy` and `eval/tool_use_rate`.
"""

from configs import common, grpo_arith


def get_config(arg=None):
  c = common.derive(grpo_arith.arith_job(), 'agent')
  c.workdir = 'runs/agent_arith'
  c.task.kind = 'arith_tool'
  c.task.eval_size = 200
  c.task.max_prompt_len = 12
  c.task.max_response_len = 32
  c.sft.steps = 150
  c.sft.lr = 1e-3
  c.rl.steps = 100
  c.rl.prompts_per_step = 16
  c.rl.group_size = 8
  c.rl.minibatch_size = 64
  c.optim.lr = 1e-4
  c.sampler.page_size = 8
  c.eval.every = 25
  c.checkpoint.every = 50
  c.log.every = 5
  c.lock()
  return common.variant(c, arg)
