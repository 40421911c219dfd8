"""Runs `launch/train.py` on every worker of a Cloud TPU VM slice with gcloud.

    python launch/gcloud_tpu.py --tpu my-v5e --zone us-west4-a --config configs/grpo_qwen.py \
        [--create --accelerator_type v5litepod-16 --runtime_version v2-alpha-tpuv5-lite --spot] \
        [--project my-project] [--env JAX_TRACEBACK_FILTERING=off] [--dry_run] \
        [--config.rl.steps=200 ...]

Runs these commands in order and stops at the first that fails (`--dry_run`
prints them, shell-quoted, and runs nothing):

  1. `--create` only: `gcloud compute tpus tpu-vm create` the slice.
  2. `git archive` the committed tree (HEAD) into a local tarball: what ships is
     the last commit, so commit first (a dirty tree is warned about).
  3. `scp` the tarball to every worker and untar it into `--remote_dir`, over
     any earlier copy (its `.venv` and `runs/` stay).
  4. `--setup` (on by default, `--nosetup` skips it): a venv in `--remote_dir`
     with `pip install -e . jax[tpu]` (one resolve, so jrl's jax pin holds).
  5. On every worker at once: `python launch/train.py --config <config>
     <overrides>`, with `--env` exported first. The ssh stays attached until
     training ends.

Overrides are the arguments starting with `--config.` (written `--config.x=y`);
they and the config path reach train.py unchanged, so the path is relative to
the repository root. On TPU VMs jax finds the coordinator itself; elsewhere pass
JRL_COORDINATOR_ADDRESS / JRL_NUM_PROCESSES / JRL_PROCESS_ID with `--env`.
"""

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE_ARCHIVE = '/tmp/jrl.tar.gz'  # where the tarball lands on each worker


@dataclasses.dataclass(frozen=True)
class Options:
  tpu: str
  zone: str
  config: str  # path relative to the repository root, passed through unchanged
  project: str | None = None
  create: bool = False
  accelerator_type: str | None = None  # e.g. v5litepod-16
  runtime_version: str | None = None  # e.g. v2-alpha-tpuv5-lite
  spot: bool = False
  remote_dir: str = '~/jrl'
  setup: bool = True
  dry_run: bool = False
  env: tuple[tuple[str, str], ...] = ()  # (KEY, VALUE) exported on the workers
  overrides: tuple[str, ...] = ()  # `--config.x=y` arguments for train.py


def parse_env(items):
  """['K=V', ...] -> ((K, V), ...); raises ValueError naming --env."""
  env = {}
  for item in items or ():
    key, sep, value = item.partition('=')
    if not sep or not re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*', key):
      raise ValueError(f'--env {item!r}: expected KEY=VALUE with KEY a shell variable name')
    if key in env:
      raise ValueError(f'--env {key} is given twice')
    env[key] = value
  return tuple(env.items())


def parse_args(argv):
  """Command-line arguments (without the program name) -> validated Options."""
  overrides = [a for a in argv if a.startswith('--config.')]
  p = argparse.ArgumentParser(prog='gcloud_tpu.py', allow_abbrev=False)
  p.add_argument('--tpu', help='TPU VM name (required)')
  p.add_argument('--zone', help='zone of the TPU VM (required)')
  p.add_argument('--project', help='GCP project (default: gcloud config)')
  p.add_argument('--config', help='config file, relative to the repository root (required)')
  p.add_argument('--create', action='store_true', help='create the TPU VM first')
  p.add_argument('--accelerator_type', help='with --create, e.g. v5litepod-16')
  p.add_argument('--runtime_version', help='with --create, e.g. v2-alpha-tpuv5-lite')
  p.add_argument('--spot', action='store_true', help='with --create: a spot VM')
  p.add_argument('--remote_dir', default='~/jrl', help='checkout on each worker')
  p.add_argument('--setup', action=argparse.BooleanOptionalAction, default=True)
  p.add_argument('--nosetup', dest='setup', action='store_false', help='skip the pip install')
  p.add_argument('--dry_run', action='store_true', help='print the commands, run nothing')
  p.add_argument('--env', action='append', help='KEY=VALUE exported on the workers (repeatable)')
  a = p.parse_args([x for x in argv if not x.startswith('--config.')])

  for flag in ('tpu', 'zone', 'config'):
    if not getattr(a, flag):
      raise ValueError(f'--{flag} is required')
  if not os.path.isfile(os.path.join(REPO_ROOT, a.config)):
    raise ValueError(f'--config {a.config!r}: no such file under {REPO_ROOT}')
  if a.create:
    for flag in ('accelerator_type', 'runtime_version'):
      if not getattr(a, flag):
        raise ValueError(f'--create needs --{flag}')
  return Options(
    **{k: v for k, v in vars(a).items() if k != 'env'},
    env=parse_env(a.env),
    overrides=tuple(overrides),
  )


def archive_path(tpu):
  """The local tarball of the committed tree."""
  return os.path.join(tempfile.gettempdir(), f'jrl-{tpu}.tar.gz')


def _remote(path):
  """Shell-quotes a remote path, leaving a leading `~/` to the remote shell."""
  return '~/' + shlex.quote(path[2:]) if path.startswith('~/') else shlex.quote(path)


def build_commands(opts):
  """Options -> the argv lists to run, in order."""
  tpu_vm = ['gcloud', 'compute', 'tpus', 'tpu-vm']
  where = ['--zone', opts.zone] + (['--project', opts.project] if opts.project else [])
  ssh = lambda script: [*tpu_vm, 'ssh', opts.tpu, '--worker=all', '--command', script, *where]
  remote_dir = _remote(opts.remote_dir)
  archive = archive_path(opts.tpu)
  commands = []
  if opts.create:
    slice_ = ['--accelerator-type', opts.accelerator_type, '--version', opts.runtime_version]
    commands.append([*tpu_vm, 'create', opts.tpu, *slice_, *(['--spot'] * opts.spot), *where])
  commands.append(['git', '-C', REPO_ROOT, 'archive', '--format=tar.gz', '-o', archive, 'HEAD'])
  commands.append([*tpu_vm, 'scp', archive, f'{opts.tpu}:{REMOTE_ARCHIVE}', '--worker=all', *where])
  commands.append(ssh(f'mkdir -p {remote_dir} && tar -xzf {REMOTE_ARCHIVE} -C {remote_dir}'))
  activate = f'cd {remote_dir} && . .venv/bin/activate'
  if opts.setup:
    venv = f'cd {remote_dir} && python3 -m venv .venv && . .venv/bin/activate'
    commands.append(ssh(f'{venv} && pip install -e . "jax[tpu]"'))
  exports = ''.join(f'export {k}={shlex.quote(v)} && ' for k, v in opts.env)
  train = shlex.join(['python', 'launch/train.py', '--config', opts.config, *opts.overrides])
  commands.append(ssh(f'{activate} && {exports}{train}'))
  return commands


def run(commands):
  """Runs the commands in order; exits naming the first that fails."""
  for cmd in commands:
    print('+', shlex.join(cmd), flush=True)
    try:
      rc = subprocess.run(cmd).returncode
    except FileNotFoundError:
      raise SystemExit(f'gcloud_tpu: {cmd[0]!r} not found, needed for: {shlex.join(cmd)}') from None
    if rc != 0:
      raise SystemExit(f'gcloud_tpu: exit status {rc} from: {shlex.join(cmd)}')


def main(argv):
  try:
    opts = parse_args(argv)
  except ValueError as e:
    raise SystemExit(f'gcloud_tpu: {e}') from None
  commands = build_commands(opts)
  if opts.dry_run:
    for cmd in commands:
      print(shlex.join(cmd))
    return
  dirty = subprocess.run(
    ['git', '-C', REPO_ROOT, 'status', '--porcelain', '--untracked-files=no'],
    capture_output=True,
    text=True,
  ).stdout
  if dirty:
    print('gcloud_tpu: warning: uncommitted changes are not shipped (HEAD is)', file=sys.stderr)
  run(commands)


if __name__ == '__main__':
  main(sys.argv[1:])
