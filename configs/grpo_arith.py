"""The default job: a 3M-parameter model learns 2-digit addition on the CPU.

    python launch/train.py --config configs/grpo_arith.py

The character tokenizer, a fresh 4-layer model, problems generated on the
fly, answers written units digit first ("47+85=" -> "231", 132 reversed:
`task.reverse_answers`, the order in which the digits of a sum are
computed, which a small model learns from scratch far more reliably). The
worked answers of the SFT warm-up come from an imperfect teacher: for a sum
with a new digit (three digits here) it gives, 60% of the time, only an
estimate rounded down to tens (130, written "031"; `task.rounding_slip`).
900 SFT steps learn the teacher's addition, estimates included, so greedy
answers to most of those problems have a units digit of 0 however long SFT
runs; 100 GRPO steps (G = 8, an exact-match reward on the true answer) then
raise held-out accuracy well beyond SFT's (docs/results.md, "RL against SFT alone at
equal compute"). Held-out accuracy is measured with greedy decoding every
`eval.every` iterations (`eval/accuracy` in runs/grpo_arith/metrics.jsonl,
on the console, and in curves.png). About five minutes on a 2-core CPU.
`--config.task.rounding_slip=0` gives a perfect teacher.
"""

from configs import common


def arith_job():
  """The unlocked GRPO config the arithmetic jobs share (configs/ppo_arith.py,
  dpo_arith.py, agent_arith.py, rlhf_*.py): the model, the task with a
  perfect teacher, a 450-step SFT warm-up, the GRPO phase."""
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
  return c


def get_config(arg=None):
  c = arith_job()
  c.task.rounding_slip = 0.6  # the imperfect teacher
  c.task.reverse_answers = True  # units digit first: every seed's warm-up learns to add
  c.sft.steps = 900  # long enough to learn its addition (tens and hundreds) well
  c.lock()
  return common.variant(c, arg)
