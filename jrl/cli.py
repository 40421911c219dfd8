"""The `jrl` console command: one entry point for the scripts in launch/.

    jrl train --config configs/grpo_arith.py --config.rl.steps=10
    jrl eval --config configs/grpo_arith.py
    jrl plan --model qwen2.5-7b --hardware h100 --chips 64
    jrl bench sampler

`jrl COMMAND ARGS...` runs `launch/SCRIPT.py ARGS...` exactly as
`python launch/SCRIPT.py ARGS...` would (same flags, same exit code), so the
two stay interchangeable. The scripts live in the source tree next to the
`jrl` package, which is where `pip install -e .` leaves them.
"""

import os
import runpy
import sys

# command -> (script in launch/, what it does)
COMMANDS = {
  'train': ('train.py', 'train with a config (GRPO, PPO, DPO, SFT, reward model, agent)'),
  'eval': ('eval.py', 'held-out evaluation of a run or checkpoint'),
  'export': ('export.py', 'write a Hugging Face directory from any saved checkpoint'),
  'plan': ('plan.py', 'memory and time plan for a model on a cluster'),
  'bench': ('bench.py', 'benchmarks: model, sampler, logprobs, grpo, rewards, ...'),
  'label': ('label.py', 'label preference pairs with a judge'),
  'local': ('local.py', 'several local processes joined by jax.distributed'),
  'gcloud-tpu': ('gcloud_tpu.py', 'start a run on every worker of a TPU VM slice'),
  'xm': ('xm_launch.py', 'start a run as an XManager experiment'),
  'prepare-model': ('prepare_model.py', 'GGUF file -> Hugging Face directory'),
  'word-problems': ('make_word_problems.py', 'generate grade-school word problems'),
}


def launch_dir():
  """The launch/ folder of the source tree this package was installed from."""
  return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'launch')


def usage():
  lines = ['usage: jrl COMMAND [ARGS...]', '', 'commands:']
  lines += [f'  {name:<14} {doc}' for name, (_, doc) in COMMANDS.items()]
  lines += ['', '`jrl COMMAND --help` shows the flags of a command.']
  return '\n'.join(lines)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ('-h', '--help', 'help'):
    print(usage())
    return 0
  command, args = argv[0], argv[1:]
  if command not in COMMANDS:
    print(f'jrl: unknown command {command!r}.\n\n{usage()}', file=sys.stderr)
    return 2
  script = os.path.join(launch_dir(), COMMANDS[command][0])
  if not os.path.exists(script):
    print(
      f'jrl: {script} is missing: the `jrl` command runs the scripts of a source checkout '
      '(pip install -e .).',
      file=sys.stderr,
    )
    return 2
  sys.argv = [script, *args]
  sys.path.insert(0, os.path.dirname(launch_dir()))  # `configs` and `launch` importable
  try:
    runpy.run_path(script, run_name='__main__')
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      return e.code or 0
    print(e.code, file=sys.stderr)  # sys.exit('message')
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
