"""`launch/accel_check.py` in its CPU mode (tiny shapes, the Pallas kernels in
interpret mode), so the accelerator check cannot rot between loans of an
accelerator; its budget, failure and timeout handling; and
`launch/accel_wheels.py`'s offline install."""

import json
import os
import sys
import zipfile

import pytest

_LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), 'launch')
sys.path.insert(0, _LAUNCH)

import accel_check  # noqa: E402
import accel_parts  # noqa: E402
import accel_wheels  # noqa: E402

CORE = [name for name, spec in accel_check.PARTS.items() if spec[2] == '0.5b']


def test_tiny_mode_runs_every_part_and_writes_the_figures(tmp_path, capsys):
  out = tmp_path / 'accel.json'
  report = accel_check.main(['--mode', 'tiny', '--inline', '--out', str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(report, default=str))
  parts = report['parts']
  assert {k: parts[k]['status'] for k in CORE} == {k: 'ok' for k in CORE}, {
    k: parts[k].get('error') for k in CORE
  }
  assert parts['sampler_1.5b']['status'] == 'skipped'
  fig = {k: parts[k]['figures'] for k in CORE}
  # Both Pallas kernels ran (interpret mode) against the gather path, NaN planted.
  assert set(fig['paged_attention']['checks']) == {
    'pallas_gpu/float32',
    'pallas_gpu/bfloat16',
    'pallas_tpu/bfloat16',
  }
  assert fig['paged_attention']['pallas_gpu/float32']['max_abs_err'] < 1e-5
  assert fig['train_attention']['implementation'] == 'splash'
  assert fig['train_attention']['packed']['grad_rel_err'] < 0.05
  # The sampler's logprobs are the trainer's; bf16 differs, but little.
  match = fig['logprob_match']
  assert match['float32']['mean_abs'] < 1e-5 < match['bfloat16']['mean_abs'] < 0.05
  assert match['float32']['tokens'] == 4 * 2 * 8
  assert fig['bf16_update']['param_dtypes_bf16_step'] == ['float32']
  assert 0 < fig['bf16_update']['grad_rel_err'] < 0.05
  assert fig['sampler']['output_tokens'] > 0 and fig['sampler']['kv_bytes_peak'] > 0
  assert fig['sampler_gather']['implementation'] == 'gather'
  for budget in accel_parts.WORKLOADS['tiny'].micro_tokens:
    assert fig['update'][f'micro_{budget}']['tokens_per_s'] > 0
  assert fig['update']['micro_64']['micro_batches'] > fig['update']['micro_128']['micro_batches']
  stages = fig['grpo_step']['stages_s']
  assert stages['step'] > 0 and stages['reference'] > 0 and stages['update'] > 0
  printed = capsys.readouterr().out
  for name in accel_check.PARTS:
    assert f'\n{name} ' in printed


def test_a_broken_part_is_reported_and_the_rest_run(tmp_path, monkeypatch):
  def broken(ctx):
    raise RuntimeError('kernel exploded')

  seen = []

  def mismatched(ctx, impl='auto'):
    seen.append(dict(ctx.earlier))
    return {'checks': {'finite': False}, 'headline': 'h'}

  monkeypatch.setattr(accel_parts, 'device', broken)
  monkeypatch.setattr(accel_parts, 'sampler', mismatched)
  report = accel_check.check(
    ['device', 'sampler'], 'tiny', 60, str(tmp_path / 'r.json'), inline=True, backend='cpu'
  )
  assert report['parts']['device']['status'] == 'failed'
  assert 'kernel exploded' in report['parts']['device']['error']
  assert report['parts']['sampler']['status'] == 'mismatch: finite'
  assert 'kernel exploded' in accel_check.table(report)
  assert seen == [{'device': {'failed': 'failed'}}]  # later parts know it gave nothing


def test_later_parts_leave_a_kernel_whose_check_failed():
  Context = accel_parts.Context
  assert Context('tiny', {}).kernel('paged_attention', 'gather') == 'auto'  # not checked
  good = {'paged_attention': {'checks': {'pallas_gpu/float32': True}}}
  assert Context('tiny', good).kernel('paged_attention', 'gather') == 'auto'
  failed = {'paged_attention': {'failed': 'timeout'}, 'train_attention': {'checks': {'x': False}}}
  assert Context('tiny', failed).kernel('paged_attention', 'gather') == 'gather'
  assert Context('tiny', failed).kernel('train_attention', 'xla') == 'xla'


def test_the_budget_skips_parts_and_says_why(tmp_path):
  report = accel_check.check(
    ['device', 'grpo_step'], 'full', 20, str(tmp_path / 'r.json'), inline=True, backend='gpu'
  )
  device, step = report['parts']['device'], report['parts']['grpo_step']
  assert device['status'] == 'skipped' and step['status'] == 'skipped'
  assert 'needs about 90 s' in step['reason']


def test_each_part_runs_in_a_process_killed_at_the_time_left(tmp_path):
  ok = accel_check._subprocess('device', 'tiny', {}, timeout=120)
  assert ok['figures']['backend'] == 'cpu' and ok['peak_rss_bytes'] > 0
  late = accel_check._subprocess('device', 'tiny', {}, timeout=0.2)
  assert late['timeout'] and 'killed after' in late['error']


def _wheel(folder, name, version):
  """A minimal pure-Python wheel of distribution `name`."""
  mod = name.replace('-', '_')
  info = f'{mod}-{version}.dist-info'
  path = os.path.join(folder, f'{mod}-{version}-py3-none-any.whl')
  with zipfile.ZipFile(path, 'w') as z:
    z.writestr(f'{mod}/__init__.py', 'VALUE = 7\n')
    z.writestr(f'{info}/METADATA', f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')
    z.writestr(
      f'{info}/WHEEL',
      'Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n',
    )
    z.writestr(f'{info}/RECORD', '')
  return path


def test_install_puts_only_missing_distributions_into_the_target(tmp_path, monkeypatch):
  wheels, target = tmp_path / 'wheels', tmp_path / 'site'
  wheels.mkdir()
  monkeypatch.setattr(accel_wheels, 'CARRY', {'jrl-carry-probe': '0.1', 'numpy': '2.0'})
  with pytest.raises(SystemExit, match=r"no wheel for \['jrl-carry-probe', 'numpy'\]"):
    accel_wheels.wheels(str(wheels))
  _wheel(str(wheels), 'jrl-carry-probe', '0.1')
  _wheel(str(wheels), 'numpy', '2.0')  # present here: never installed over the image's
  assert accel_wheels.install(str(wheels), str(target)) == ['jrl-carry-probe']
  assert (target / 'jrl_carry_probe' / '__init__.py').read_text() == 'VALUE = 7\n'
  assert not (target / 'numpy').exists()
