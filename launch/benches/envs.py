"""`envs`: multi-turn rollouts whose environment step waits (an I/O-bound
tool), with the steps in a worker pool (parked samples, the others keep
decoding) against each step waited for in the sampler's loop (see `run`).

    python launch/bench.py envs [--env_ms 200 --prompts 8 --group 8 --max_new 128 --workers 16]
    python launch/bench.py envs --mcp      # also each step as an MCP tool call (the [mcp] extra)
    python launch/bench.py envs --openai   # chat episodes: tokens, messages, an agent
                                           # through the endpoint (benches/envs_chat.py)
"""

import statistics
import time

import jax
import numpy as np

from launch.benches import common

HELP = 'agentic rollouts: environment steps in a pool vs inline'


def add_arguments(parser):
  parser.add_argument('--size', choices=sorted(common.MODEL_SIZES), default='cpu-20m')
  parser.add_argument('--prompts', type=int, default=8)
  parser.add_argument('--group', type=int, default=8)
  parser.add_argument('--prompt_len', type=int, default=64)
  parser.add_argument('--max_new', type=int, default=128)
  parser.add_argument('--turn_len', type=int, default=24, help='mean model turn (tokens)')
  parser.add_argument('--max_turns', type=int, default=4, help='environment steps per episode')
  parser.add_argument('--env_tokens', type=int, default=4, help='tokens of each answer')
  parser.add_argument('--env_ms', type=float, default=200.0, help='each step waits this long')
  parser.add_argument('--workers', type=int, default=16, help='pool threads (agent.env_workers)')
  parser.add_argument('--steps', type=int, default=8, help='decode steps per dispatch')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--out', default='', help='write the figures as JSON here')
  parser.add_argument(
    '--mcp',
    action='store_true',
    help='also pooled with each step an MCP tool call (the [mcp] extra)',
  )
  parser.add_argument(
    '--openai',
    action='store_true',
    help='chat episodes instead: token level, message level and an openai-client agent '
    'through the endpoint (the [openai] extra; launch/benches/envs_chat.py)',
  )


# The MCP server of the 'pooled, MCP' way: one tool that waits, asynchronously
# (so that the server answers the parked samples' calls concurrently).
MCP_SERVER = """
import asyncio
from mcp.server.mcpserver import MCPServer

server = MCPServer('wait')


@server.tool()
async def wait(ms: float) -> str:
  \"\"\"Answers after `ms` milliseconds.\"\"\"
  await asyncio.sleep(ms / 1000)
  return 'ok'


if __name__ == '__main__':
  server.run()
"""


def make_env_class():
  from jrl.envs import Environment, Step

  class WaitingTool(Environment):
    """Answers every turn with the same tokens after `wait_s` of sleep (a
    remote call); ends the episode after `max_turns` answers."""

    def __init__(self, wait_s, answer, max_turns):
      self.wait_s, self.answer, self.max_turns, self.turns = wait_s, answer, max_turns, 0

    def reset(self, example):
      self.turns = 0
      return example

    def step(self, turn_tokens):
      time.sleep(self.wait_s)
      self.turns += 1
      return Step(list(self.answer), done=self.turns > self.max_turns)

  return WaitingTool


def make_mcp_env_class(tools):
  """The same environment with its wait spent in an MCP tool call."""
  from jrl.envs import Environment, Step

  (wait,) = [t for t in tools.tools() if t.name == 'wait']

  class MCPTool(Environment):
    def __init__(self, wait_s, answer, max_turns):
      self.wait_ms, self.answer, self.max_turns, self.turns = 1e3 * wait_s, answer, max_turns, 0

    def reset(self, example):
      self.turns = 0
      return example

    def step(self, turn_tokens):
      assert wait.fn(ms=self.wait_ms) == 'ok'
      self.turns += 1
      return Step(list(self.answer), done=self.turns > self.max_turns)

  return MCPTool


def rollout(smp, params, requests, group, make_env, pool, parking, limits):
  """One `generate` of multi-turn episodes; (completions, seconds)."""
  from jrl.envs import EnvPool

  envs = [[make_env() for _ in range(group)] for _ in requests]
  for row, r in zip(envs, requests, strict=True):
    for env in row:
      env.reset(r.prompt)
  start_of_turn = {}

  def answer(outcome, key, end):
    step, failure, _ = outcome
    if failure:
      return failure
    if step.done:
      return 'done'
    start_of_turn[key] = end + len(step.tokens)
    return list(step.tokens)

  def on_turn_end(i, g, tokens, logprobs=None):
    turn = tokens[start_of_turn.get((i, g), 0) :]
    outcome = pool.submit(envs[i][g], turn, **limits)
    if not parking:
      return answer(outcome.result(), (i, g), len(tokens))
    return EnvPool.then(outcome, lambda out: answer(out, (i, g), len(tokens)))

  start = time.perf_counter()
  out = smp.generate(params, requests, group_size=group, on_turn_end=on_turn_end)
  return out, time.perf_counter() - start


def run(args):
  """Multi-turn episodes on a random model: every model turn ends on one of
  a set of turn-ending tokens (geometric turns of mean --turn_len), the
  environment answers --env_tokens tokens after sleeping --env_ms, for
  --max_turns answers, then ends the episode; samples are capped at
  --max_new tokens (environment tokens included). Three ways, on the same
  requests and seeds:

  - inline: each step waited for where the turn ended, in the sampler's
    loop, so no slot decodes meanwhile (`agent.env_workers = 0`);
  - pooled: the steps in a pool of --workers threads (`jrl.envs.EnvPool`),
    the waiting sample parked with its pages while the others decode (the
    agent's default);
  - no wait: inline with steps that answer at once, the bound both approach;
  - pooled, MCP (--mcp): pooled, each step's wait an async tool of an MCP
    server over stdio (`jrl.envs.mcp_tools`), the adapter's own cost.

  Figures: median seconds per rollout over --repeats (after one warm-up
  call that compiles), model tokens per second (environment tokens not
  counted), environment steps, the sampler's seconds with nothing to decode
  (`env_wait_seconds`) and the most samples parked at once. The trajectories
  of the three are checked equal (a sample's tokens depend on its seed and
  position only).
  """
  if args.openai:
    from launch.benches import envs_chat

    return envs_chat.run(args)
  from jrl import models, sampler
  from jrl.envs import EnvPool

  config = models.ModelConfig(**common.MODEL_SIZES[args.size])
  graphdef, params = models.create(config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  vocab = config.vocab_size
  turn_stops = tuple(int(t) for t in rng.choice(vocab, max(1, vocab // args.turn_len), False))
  others = [t for t in range(vocab) if t not in turn_stops]
  answer = [int(t) for t in rng.choice(others, args.env_tokens)]
  requests = [
    sampler.Request(
      prompt=[int(t) for t in rng.integers(0, vocab, args.prompt_len)],
      max_new_tokens=args.max_new,
      temperature=1.0,
      stop_tokens=turn_stops,
      seed=i,
    )
    for i in range(args.prompts)
  ]
  g, page = args.group, 16
  slots = args.prompts * g
  engine_config = sampler.SamplerConfig(
    num_slots=slots,
    num_pages=1 + args.prompts * sampler.pages_needed(args.prompt_len, args.max_new, g, page),
    page_size=page,
    max_prompt_len=args.prompt_len,
    max_new_tokens=args.max_new,
    max_stop_tokens=len(turn_stops),
    max_forced_tokens=args.env_tokens,
  )
  smp = sampler.Sampler(graphdef, config, engine_config, steps_per_dispatch=args.steps)
  env_class = make_env_class()
  pool = EnvPool(args.workers)
  limits = dict(timeout_s=60.0, vocab_size=vocab, max_tokens=args.env_tokens)
  ways = {
    'inline': (args.env_ms / 1e3, False, env_class),
    'pooled': (args.env_ms / 1e3, True, env_class),
    'no wait': (0.0, False, env_class),
  }
  mcp_tools = None
  if args.mcp:
    import os
    import tempfile

    from jrl.envs import mcp_tools as mcp_module

    script = os.path.join(tempfile.mkdtemp(prefix='jrl_bench_mcp_'), 'server.py')
    with open(script, 'w') as f:
      f.write(MCP_SERVER)
    mcp_tools = mcp_module.MCPTools(mcp_module.python_server(script), call_timeout_s=60)
    ways['pooled, MCP'] = (args.env_ms / 1e3, True, make_mcp_env_class(mcp_tools))
  print(
    f'envs: {config.num_params() / 1e6:.1f}M-param random model, {args.prompts} prompts x '
    f'G={g} ({slots} slots), up to {args.max_new} new tokens, turns of ~{args.turn_len} '
    f'tokens, {args.max_turns} steps of {args.env_ms:.0f} ms per episode, {args.workers} '
    f'workers, backend {jax.default_backend()}'
  )
  figures, reference = {}, None
  for name, (wait_s, parking, cls) in ways.items():

    def make_env(wait_s=wait_s, cls=cls):
      return cls(wait_s, answer, args.max_turns)

    rollout(smp, params, requests, g, make_env, pool, parking, limits)  # compiles
    times, stats = [], []
    for _ in range(args.repeats):
      out, seconds = rollout(smp, params, requests, g, make_env, pool, parking, limits)
      times.append(seconds)
      stats.append(smp.stats)
    flat = [c for row in out for c in row]
    if reference is None:
      reference = flat
    same = all(
      np.array_equal(a.tokens, b.tokens) and np.array_equal(a.env_mask, b.env_mask)
      for a, b in zip(flat, reference, strict=True)
    )
    model_tokens = sum(int(np.sum(~c.env_mask)) for c in flat)
    seconds = statistics.median(times)
    figures[name] = dict(
      seconds=seconds,
      model_tokens=model_tokens,
      tokens_per_s=model_tokens / seconds,
      env_steps=stats[-1].env_turns,
      env_wait_seconds=statistics.median(s.env_wait_seconds for s in stats),
      parked_peak=max(s.env_parked_peak for s in stats),
      same_trajectories=same,
    )
    f = figures[name]
    print(
      f'  {name:8s} {seconds:7.2f} s  {f["tokens_per_s"]:8.1f} model tokens/s  '
      f'{f["env_steps"]} environment answers appended  '
      f'{f["env_wait_seconds"]:6.2f} s nothing to decode  '
      f'parked at most {f["parked_peak"]}  same trajectories: {same}'
    )
  pool.close()
  ratio = figures['pooled']['tokens_per_s'] / figures['inline']['tokens_per_s']
  print(f'pooled / inline: x{ratio:.2f} model tokens/s')
  figures['pooled_over_inline'] = ratio
  if mcp_tools is not None:
    mcp_tools.close()
    ratio = figures['pooled, MCP']['tokens_per_s'] / figures['pooled']['tokens_per_s']
    print(f'pooled, MCP / pooled: x{ratio:.2f} model tokens/s')
    figures['mcp_over_pooled'] = ratio
  common.write_json(args.out, dict(args=vars(args), figures=figures))
