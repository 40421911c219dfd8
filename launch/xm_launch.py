"""Launches `launch/train.py` as an XManager experiment.

    python launch/xm_launch.py --config configs/grpo_qwen.py --executor vertex \
        --accelerator h100 --accelerator_count 8 --num_hosts 2 \
        [--name qwen-grpo] [--env KEY=VALUE ...] [--dry_run] [--config.rl.steps=200 ...]

`job_spec` describes the job as a plain dict (no xmanager needed); `--dry_run`
prints it as JSON. Otherwise `launch` packages the repository as a Python
container (`pip install -e .` plus `jax[tpu]` or `jax[cuda]` for the
accelerator) whose entry point is `python launch/train.py`, and adds one job to
a new `xm_local` experiment. Needs `pip install -e ".[xmanager]"`.

Executors: 'local' (xm_local.Local), 'vertex' (xm_local.Vertex), 'gke'
(xm_local.Kubernetes); other names are kept in the spec for other back ends but
`launch` refuses them. Accelerators: a GPU name known to xm.ResourceType
('h100', 'a100', ...) with `--accelerator_count` GPUs per host and `--num_hosts`
replicas, or a TPU slice 'tpu-<version>-<size>' ('tpu-v5e-16') requested as
`accelerator_count * num_hosts` chips of one job (the slice spans the hosts).

Overrides are the arguments starting with `--config.` (written `--config.x=y`);
they and the config path reach train.py unchanged. Multi-host GPU jobs pass the
coordinator with `--env JRL_COORDINATOR_ADDRESS=... --env JRL_NUM_PROCESSES=...`
where the back end does not set up `jax.distributed` itself.
"""

import argparse
import dataclasses
import json
import os
import re
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRYPOINT = 'launch/train.py'
_TPU = re.compile(r'tpu-(v\w+)-(\d+)')  # tpu-v5e-16 -> ('v5e', '16')


@dataclasses.dataclass(frozen=True)
class Options:
  config: str  # path relative to the repository root, passed through unchanged
  name: str | None = None  # experiment title (default: the config's file name)
  executor: str = 'local'
  accelerator: str | None = None  # 'h100', 'tpu-v5e-16', ...; None: CPU only
  accelerator_count: int | None = None  # per host; required with --accelerator
  num_hosts: int = 1
  base_image: str = 'python:3.11'
  dry_run: bool = False
  env: tuple[tuple[str, str], ...] = ()
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
  p = argparse.ArgumentParser(prog='xm_launch.py', allow_abbrev=False)
  p.add_argument('--config', help='config file, relative to the repository root (required)')
  p.add_argument('--name', help='experiment title (default: the config file name)')
  p.add_argument('--executor', default='local', help="'local', 'vertex' or 'gke'")
  p.add_argument('--accelerator', help="e.g. 'h100' or 'tpu-v5e-16' (default: CPU only)")
  p.add_argument('--accelerator_count', type=int, help='accelerators per host')
  p.add_argument('--num_hosts', type=int, default=1, help='hosts running train.py')
  p.add_argument('--base_image', default='python:3.11', help='container base image')
  p.add_argument(
    '--dry_run', action='store_true', help='print the job spec as JSON, launch nothing'
  )
  p.add_argument('--env', action='append', help='KEY=VALUE set in the job (repeatable)')
  a = p.parse_args([x for x in argv if not x.startswith('--config.')])

  if not a.config:
    raise ValueError('--config is required')
  if not os.path.isfile(os.path.join(REPO_ROOT, a.config)):
    raise ValueError(f'--config {a.config!r}: no such file under {REPO_ROOT}')
  if a.num_hosts < 1:
    raise ValueError(f'--num_hosts must be >= 1, got {a.num_hosts}')
  if a.accelerator and a.accelerator_count is None:
    raise ValueError(f'--accelerator {a.accelerator} needs --accelerator_count (per host)')
  if a.accelerator_count is not None and (not a.accelerator or a.accelerator_count < 1):
    raise ValueError('--accelerator_count must be >= 1 and comes with --accelerator')
  return Options(
    **{k: v for k, v in vars(a).items() if k != 'env'},
    env=parse_env(a.env),
    overrides=tuple(x for x in argv if x.startswith('--config.')),
  )


def job_spec(opts):
  """Options -> a JSON-able description of the job."""
  return {
    'name': opts.name or os.path.splitext(os.path.basename(opts.config))[0],
    'entrypoint': ENTRYPOINT,
    'args': ['--config', opts.config, *opts.overrides],
    'num_hosts': opts.num_hosts,
    'accelerator': opts.accelerator,
    'accelerator_count': opts.accelerator_count or 0,  # per host
    'env': dict(opts.env),
    'executor': opts.executor,
    'base_image': opts.base_image,
  }


def xm_requirements(spec):
  """Spec -> (resources for xm.JobRequirements, replicas)."""
  if not spec['accelerator']:
    return {}, spec['num_hosts']
  tpu = _TPU.fullmatch(spec['accelerator'])
  if tpu:  # one job whose slice spans the hosts
    return {f'tpu_{tpu[1]}': spec['accelerator_count'] * spec['num_hosts']}, 1
  return {spec['accelerator'].replace('-', '_'): spec['accelerator_count']}, spec['num_hosts']


def _jax_extra(spec):
  """The jax build for the accelerator, installed in the same pip resolve as jrl."""
  if not spec['accelerator']:
    return ''
  return ' "jax[tpu]"' if _TPU.fullmatch(spec['accelerator']) else ' "jax[cuda]"'


def launch(spec):
  """Adds the job that `spec` describes to a new xm_local experiment."""
  try:
    from xmanager import xm, xm_local
  except ImportError as e:
    raise ImportError('launch/xm_launch.py needs XManager: pip install -e ".[xmanager]"') from e

  executors = {'local': xm_local.Local, 'vertex': xm_local.Vertex, 'gke': xm_local.Kubernetes}
  executor = executors.get(spec['executor'])
  if executor is None:
    raise ValueError(f'--executor {spec["executor"]!r}: xm_local runs one of {sorted(executors)}')
  resources, replicas = xm_requirements(spec)
  try:
    requirements = xm.JobRequirements(resources, replicas=replicas)
  except (KeyError, ValueError) as e:
    raise ValueError(f'--accelerator {spec["accelerator"]!r}: {e}') from e

  executable = xm.PythonContainer(
    path=REPO_ROOT,
    base_image=spec['base_image'],
    docker_instructions=[  # the build context holds the repository under its own name
      f'COPY {os.path.basename(REPO_ROOT)}/ /jrl',
      'WORKDIR /jrl',
      f'RUN python -m pip install -e .{_jax_extra(spec)}',
    ],
    entrypoint=xm.CommandList([f'python {spec["entrypoint"]}']),
  )
  with xm_local.create_experiment(experiment_title=spec['name']) as experiment:
    [packaged] = experiment.package(
      [xm.Packageable(executable_spec=executable, executor_spec=executor.Spec())]
    )
    experiment.add(
      xm.Job(
        executable=packaged,
        executor=executor(requirements=requirements),
        args=spec['args'],
        env_vars=spec['env'],
      )
    )


def main(argv):
  try:
    opts = parse_args(argv)
  except ValueError as e:
    raise SystemExit(f'xm_launch: {e}') from None
  spec = job_spec(opts)
  if opts.dry_run:
    print(json.dumps(spec, indent=2))
    return
  launch(spec)


if __name__ == '__main__':
  main(sys.argv[1:])
