"""Tests for the job launchers `launch/gcloud_tpu.py` and `launch/xm_launch.py`.

They check the exact commands and job spec built from flags, that overrides
reach train.py unchanged (spaces and quotes included), that `--dry_run` runs
nothing, and that bad flags fail with errors naming the flag. Nothing here
needs gcloud, xmanager or the network: subprocess is stubbed, and `launch()`
runs against a small fake of the xmanager API.
"""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import types

import pytest

_LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), 'launch')


def _load(name):
  """Imports launch/<name>.py by path (launch/ is not a package)."""
  spec = importlib.util.spec_from_file_location(f'jrl_launch_{name}', f'{_LAUNCH}/{name}.py')
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


gcloud_tpu = _load('gcloud_tpu')
xm_launch = _load('xm_launch')

CONFIG = 'configs/grpo_arith.py'
BASIC = ['--tpu', 'my-tpu', '--zone', 'us-west4-a', '--config', CONFIG]
TRICKY = ['--config.workdir=runs/a b', '--config.task.ops=+\'"*', '--config.rl.steps=3']


def _no_subprocess(*args, **kwargs):
  raise AssertionError(f'subprocess.run called: {args}')


# -- gcloud_tpu: commands ---------------------------------------------------------------


def test_gcloud_basic_job_commands():
  cmds = gcloud_tpu.build_commands(gcloud_tpu.parse_args(BASIC))
  archive = gcloud_tpu.archive_path('my-tpu')
  ssh = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'my-tpu', '--worker=all', '--command']
  where = ['--zone', 'us-west4-a']
  assert cmds == [
    ['git', '-C', gcloud_tpu.REPO_ROOT, 'archive', '--format=tar.gz', '-o', archive, 'HEAD'],
    ['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', archive, 'my-tpu:/tmp/jrl.tar.gz']
    + ['--worker=all', *where],
    [*ssh, 'mkdir -p ~/jrl && tar -xzf /tmp/jrl.tar.gz -C ~/jrl', *where],
    [
      *ssh,
      'cd ~/jrl && python3 -m venv .venv && . .venv/bin/activate && pip install -e . "jax[tpu]"',
      *where,
    ],
    [
      *ssh,
      'cd ~/jrl && . .venv/bin/activate && python launch/train.py --config configs/grpo_arith.py',
      *where,
    ],
  ]


def test_gcloud_create_spot_project():
  argv = BASIC + ['--create', '--accelerator_type', 'v5litepod-16', '--spot', '--project', 'p1']
  cmds = gcloud_tpu.build_commands(gcloud_tpu.parse_args(argv + ['--runtime_version', 'v2-x']))
  assert cmds[0] == [
    'gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'my-tpu',
    '--accelerator-type', 'v5litepod-16', '--version', 'v2-x', '--spot',
    '--zone', 'us-west4-a', '--project', 'p1',
  ]  # fmt: skip
  assert len(cmds) == 6
  for cmd in cmds[2:]:  # every gcloud command names the project
    assert cmd[-4:] == ['--zone', 'us-west4-a', '--project', 'p1']
  create = ['--create', '--accelerator_type', 't', '--runtime_version', 'v']
  assert '--spot' not in gcloud_tpu.build_commands(gcloud_tpu.parse_args(BASIC + create))[0]


def test_gcloud_overrides_reach_train_unchanged():
  opts = gcloud_tpu.parse_args(BASIC[:2] + TRICKY[:1] + BASIC[2:] + TRICKY[1:])
  assert opts.overrides == tuple(TRICKY)
  script = gcloud_tpu.build_commands(opts)[-1][8]
  train = shlex.split(script.split(' && ')[-1])  # what the remote shell passes to python
  assert train == ['python', 'launch/train.py', '--config', CONFIG, *TRICKY]


def test_gcloud_env_exports_and_remote_dir():
  argv = BASIC + ['--env', 'JRL_NUM_PROCESSES=4', '--env', 'MSG=a b', '--env', 'EMPTY=']
  opts = gcloud_tpu.parse_args(argv + ['--remote_dir', '~/my dir', '--nosetup'])
  cmds = gcloud_tpu.build_commands(opts)
  assert len(cmds) == 4  # no setup step
  assert cmds[-1][8] == (
    "cd ~/'my dir' && . .venv/bin/activate && export JRL_NUM_PROCESSES=4 && "
    "export MSG='a b' && export EMPTY='' && python launch/train.py --config configs/grpo_arith.py"
  )
  opts = gcloud_tpu.parse_args(BASIC + ['--remote_dir', '/srv/j rl', '--no-setup'])
  untar = "mkdir -p '/srv/j rl' && tar -xzf /tmp/jrl.tar.gz -C '/srv/j rl'"
  assert gcloud_tpu.build_commands(opts)[-2][8] == untar


# -- gcloud_tpu: main -------------------------------------------------------------------


def test_gcloud_dry_run_prints_and_runs_nothing(monkeypatch, capsys):
  monkeypatch.setattr(subprocess, 'run', _no_subprocess)
  argv = BASIC + ['--dry_run', '--env', 'A=x y'] + TRICKY
  gcloud_tpu.main(argv)
  lines = capsys.readouterr().out.splitlines()
  assert lines == [shlex.join(c) for c in gcloud_tpu.build_commands(gcloud_tpu.parse_args(argv))]
  assert [shlex.split(line) for line in lines] == gcloud_tpu.build_commands(
    gcloud_tpu.parse_args(argv)
  )


def test_gcloud_run_stops_at_first_failure(monkeypatch, capsys):
  ran = []

  def fake_run(cmd, **kwargs):
    ran.append(cmd)
    return subprocess.CompletedProcess(cmd, 0 if len(ran) < 3 else 3, stdout='')

  monkeypatch.setattr(subprocess, 'run', fake_run)
  with pytest.raises(SystemExit, match=r'exit status 3 from: gcloud compute tpus tpu-vm scp'):
    gcloud_tpu.main(BASIC)
  assert ran[0][3:5] == ['status', '--porcelain']  # the dirty-tree check
  assert ran[1][3] == 'archive' and ran[2][4] == 'scp' and len(ran) == 3


@pytest.mark.parametrize(
  'argv, flag',
  [
    (BASIC[2:], '--tpu'),
    (BASIC[:2] + BASIC[4:], '--zone'),
    (BASIC[:4], '--config'),
    (BASIC[:5] + ['configs/no_such.py'], '--config'),
    (BASIC + ['--create', '--runtime_version', 'v'], '--accelerator_type'),
    (BASIC + ['--create', '--accelerator_type', 't'], '--runtime_version'),
    (BASIC + ['--env', 'NOEQUALS'], '--env'),
    (BASIC + ['--env', '1BAD=x'], '--env'),
    (BASIC + ['--env', 'A=1', '--env', 'A=2'], '--env'),
  ],
)
def test_gcloud_validation_names_the_flag(argv, flag, monkeypatch):
  with pytest.raises(ValueError, match=flag):
    gcloud_tpu.parse_args(argv)
  monkeypatch.setattr(subprocess, 'run', _no_subprocess)
  with pytest.raises(SystemExit, match=flag):
    gcloud_tpu.main(argv)


# -- xm_launch --------------------------------------------------------------------------

XM_ARGV = ['--config', CONFIG, '--executor', 'vertex', '--accelerator', 'h100']
XM_ARGV += ['--accelerator_count', '8', '--num_hosts', '2', '--env', 'A=x y', *TRICKY]


def test_xm_job_spec():
  assert xm_launch.job_spec(xm_launch.parse_args(XM_ARGV)) == {
    'name': 'grpo_arith',
    'entrypoint': 'launch/train.py',
    'args': ['--config', CONFIG, *TRICKY],
    'num_hosts': 2,
    'accelerator': 'h100',
    'accelerator_count': 8,
    'env': {'A': 'x y'},
    'executor': 'vertex',
    'base_image': 'python:3.11',
  }
  spec = xm_launch.job_spec(xm_launch.parse_args(['--config', CONFIG, '--name', 'run1']))
  assert (spec['name'], spec['executor'], spec['accelerator'], spec['num_hosts']) == (
    'run1',
    'local',
    None,
    1,
  )


def test_xm_requirements():
  spec = xm_launch.job_spec(xm_launch.parse_args(XM_ARGV))
  assert xm_launch.xm_requirements(spec) == ({'h100': 8}, 2)  # one replica per host
  tpu = ['--config', CONFIG, '--accelerator', 'tpu-v5e-16', '--accelerator_count', '4']
  spec = xm_launch.job_spec(xm_launch.parse_args(tpu + ['--num_hosts', '4']))
  assert xm_launch.xm_requirements(spec) == ({'tpu_v5e': 16}, 1)  # one job spans the slice
  spec = xm_launch.job_spec(xm_launch.parse_args(['--config', CONFIG]))
  assert xm_launch.xm_requirements(spec) == ({}, 1)


def test_xm_dry_run_prints_the_spec(monkeypatch, capsys):
  monkeypatch.setattr(xm_launch, 'launch', _no_subprocess)
  xm_launch.main(XM_ARGV + ['--dry_run'])
  assert json.loads(capsys.readouterr().out) == xm_launch.job_spec(xm_launch.parse_args(XM_ARGV))


@pytest.mark.parametrize(
  'argv, flag',
  [
    ([], '--config'),
    (['--config', 'configs/no_such.py'], '--config'),
    (['--config', CONFIG, '--accelerator', 'h100'], '--accelerator_count'),
    (['--config', CONFIG, '--accelerator_count', '2'], '--accelerator_count'),
    (['--config', CONFIG, '--num_hosts', '0'], '--num_hosts'),
    (['--config', CONFIG, '--env', 'X'], '--env'),
  ],
)
def test_xm_validation_names_the_flag(argv, flag):
  with pytest.raises(ValueError, match=flag):
    xm_launch.parse_args(argv)
  with pytest.raises(SystemExit, match=flag):
    xm_launch.main(argv)


def test_xm_launch_without_xmanager_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, 'xmanager', None)  # makes the import fail even if installed
  spec = xm_launch.job_spec(xm_launch.parse_args(['--config', CONFIG]))
  with pytest.raises(ImportError, match=r'pip install -e "\.\[xmanager\]"'):
    xm_launch.launch(spec)


def _fake_xmanager(monkeypatch):
  """Installs a recording stand-in for the part of the xmanager API launch() uses."""
  calls = {}

  def record(kind):
    return lambda *args, **kwargs: types.SimpleNamespace(kind=kind, positional=args, **kwargs)

  class Experiment:
    def __init__(self, experiment_title):
      calls['title'] = experiment_title

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      return False

    def package(self, packageables):
      calls['packageables'] = packageables
      return ['packaged']

    def add(self, job):
      calls['job'] = job

  xm = types.SimpleNamespace(
    **{k: record(k) for k in ('JobRequirements', 'PythonContainer', 'Packageable', 'Job')},
    CommandList=lambda commands: ('CommandList', commands),
  )
  executors = {}
  for name in ('Local', 'Vertex', 'Kubernetes'):
    executors[name] = record(name)
    executors[name].Spec = record(f'{name}.Spec')
  xm_local = types.SimpleNamespace(create_experiment=Experiment, **executors)
  monkeypatch.setitem(sys.modules, 'xmanager', types.SimpleNamespace(xm=xm, xm_local=xm_local))
  return calls


def test_xm_launch_builds_one_job(monkeypatch):
  calls = _fake_xmanager(monkeypatch)
  spec = xm_launch.job_spec(xm_launch.parse_args(XM_ARGV))
  xm_launch.launch(spec)
  assert calls['title'] == 'grpo_arith'
  [packageable] = calls['packageables']
  container = packageable.executable_spec
  assert container.entrypoint == ('CommandList', ['python launch/train.py'])
  assert container.path == xm_launch.REPO_ROOT
  assert container.docker_instructions[-1] == 'RUN python -m pip install -e . "jax[cuda]"'
  assert packageable.executor_spec.kind == 'Vertex.Spec'
  job = calls['job']
  assert (job.executable, job.args, job.env_vars) == ('packaged', spec['args'], {'A': 'x y'})
  assert job.executor.kind == 'Vertex'
  assert job.executor.requirements.positional == ({'h100': 8},)
  assert job.executor.requirements.replicas == 2

  with pytest.raises(ValueError, match='--executor'):
    xm_launch.launch({**spec, 'executor': 'borg'})
