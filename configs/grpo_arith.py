"""The default job: a 3M-parameter model learns 2-digit addition on the CPU.

    python launch/train.py --config configs/grpo_arith.py

The character tokenizer, a fresh 4-layer model, problems generated on the
fly ("47+85=" -> "132"). An SFT warm-up of 450 steps teaches the format and
gets part of the way; 100 GRPO steps (G = 8, exact-match reward) then raise
held-out accuracy, measured with greedy decoding every `eval.every`
iterations (`eval/accuracy` in runs/grpo_arith/metrics.jsonl, on the
console, and in curves.png). A few minutes on a 2-core CPU.
"""

from configs import common


def get_config(arg=None):
  c = common.base('grpo')
  c.workdir = 'runs/grpo_arith'
  c.model.width = 256
  c.model.mlp_width = 768
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 64
  c.task.digits = 2
  c.task.ops = '+'
  c.task.max_prompt_len = 8
  c.task.max_response_len = 6
  c.sft.steps = 450
  c.sft.batch_size = 64
  c.sft.lr = 1e-3
  c.rl.steps = 100
  c.rl.prompts_per_step = 16
  c.rl.group_size = 8
  c.rl.minibatch_size = 64
  c.optim.lr = 1e-4
  c.optim.warmup_steps = 5
  c.eval.every = 25
  c.checkpoint.every = 25
  c.log.every = 5
  c.lock()
  return common.variant(c, arg)
