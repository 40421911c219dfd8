"""`python -m jrl.rewards.server`: see `jrl.rewards.server.cli`."""

from jrl.rewards.server.cli import main

if __name__ == '__main__':
  main()
