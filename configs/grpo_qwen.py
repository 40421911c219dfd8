"""GRPO on a local Hugging Face checkpoint (Qwen2/2.5/3, Llama 3) with a JSONL
prompt file and a math-answer reward.

    python launch/train.py --config configs/grpo_qwen.py \\
      --config.model.path=/models/Qwen2.5-0.5B-Instruct \\
      --config.task.train_path=gsm8k_train.jsonl --config.task.eval_path=gsm8k_test.jsonl

Rows are {"prompt": "...", "answer": "42"} (or "prompt" as chat messages);
prompts go through the checkpoint's chat template and the reward parses the
final answer (\\boxed{}, ####, "the answer is", last number). The loss is
veRL's GRPO (`common.seed_preset(c, 'verl')`: k3 KL in the loss with β = 0.001
and its clamps, dual clip 3, log-ratio clamp 20, token-mean).
"""

from configs import common


def get_config(arg=None):
  c = common.base('grpo')
  c.workdir = 'runs/grpo_qwen'
  c.tokenizer = ''  # the checkpoint's tokenizer.json
  c.export_hf = True
  c.model.path = ''  # required: a local Hugging Face checkpoint directory
  c.model.param_dtype = 'float32'
  c.model.compute_dtype = 'bfloat16'
  c.task.kind = 'jsonl'
  c.task.chat_template = True
  c.task.eval_size = 256
  c.task.max_prompt_len = 256
  c.task.max_response_len = 512
  c.reward.functions = ('math_answer',)
  c.eval.reward = 'math_answer'
  c.eval.every = 50
  c.rl.steps = 500
  c.rl.prompts_per_step = 32
  c.rl.group_size = 8
  c.rl.minibatch_size = 64
  common.seed_preset(c, 'verl')
  c.train.chunk_size = 512
  c.optim.lr = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.01
  c.sampler.num_slots = 128
  c.sampler.page_size = 16
  c.sampler.steps_per_dispatch = 16
  c.checkpoint.every = 50
  c.lock()
  return common.variant(c, arg)
