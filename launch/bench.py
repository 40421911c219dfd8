"""Benchmarks that print figures. Speed and memory goals live here, not in tests.

    python launch/bench.py logprobs [--tokens 2048 --vocab 32768 --width 256 --chunk 256]
    python launch/bench.py model [--size cpu-20m|cpu-moe-60m|gpu-0.5b|gpu-moe-1b --seq 256]
    python launch/bench.py model --size real --batch 2 --seq 256 --remat none,full --lora_rank 0,16
    python launch/bench.py sampler [--size cpu-20m --prompts 16 --group 8 --max_new 256]
    python launch/bench.py sampler --model_path models/smollm2 --baseline hf [--prompts 8]
    python launch/bench.py grpo [--setup default|larger --steps 4]
    python launch/bench.py grpo --setup real --steps 3 --remat none,full --lora_rank 0,16 \\
        [--model_path models/smollm2 --kl_coef 0.001 --set rl.prompts_per_step=4]
    python launch/bench.py update [--size cpu-20m --batch 16 --max_len 1024 --mean_frac 0.25]
    python launch/bench.py topology [--setup default|larger --steps 10]
    python launch/bench.py costmodel [--steps 8 --warmup 2]
    python launch/bench.py rewards [--n 2000 --programs 40 --humaneval_rounds 5]
    python launch/bench.py envs [--env_ms 200 --prompts 8 --group 8 --workers 16]  # or: async
    python launch/bench.py partial [--swap_every 4 --versions 3 --drift 1e-3]
    python launch/bench.py outside_envs [--games 8 --trials 20 --episodes 256]

Each benchmark is a module of launch/benches/ (its docstring says what it
measures and what every figure means); this file is their command line.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.benches import (
  calibration,
  envs,
  grpo,
  logprobs,
  model,
  outside_envs,
  partial,
  rewards,
  sampler,
  topology,
  update,
)

BENCHES = {
  'logprobs': logprobs,
  'model': model,
  'sampler': sampler,
  'grpo': grpo,
  'update': update,
  'topology': topology,
  'costmodel': calibration,
  'rewards': rewards,
  'envs': envs,
  'partial': partial,
  'outside_envs': outside_envs,
}

# Other names of a benchmark: `async` is the environment pool's (asynchronous RL's
# never-stalled decoding).
ALIASES = {'envs': ['async']}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest='bench', required=True)
  for name, module in BENCHES.items():
    raw = argparse.RawDescriptionHelpFormatter
    parser_of = sub.add_parser(
      name,
      aliases=ALIASES.get(name, []),
      help=module.HELP,
      description=module.__doc__,
      formatter_class=raw,
    )
    module.add_arguments(parser_of)
  args = parser.parse_args(argv)
  name = next((k for k, v in ALIASES.items() if args.bench in v), args.bench)
  BENCHES[name].run(args)


if __name__ == '__main__':
  from jrl import hostmem

  hostmem.ensure_huge_pages()  # re-executes once with XLA's buffers on huge pages
  main()
