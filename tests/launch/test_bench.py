"""Smoke tests for `launch/bench.py grpo --setup real` (the GRPO step of
configs/grpo_smollm2_gsm.py, once per remat policy and LoRA rank),
`launch/bench.py update` (padded vs packed rows) and `launch/bench.py
sampler` (the paged engine against the static batch and `transformers`).

The checkpoint is a tiny random Llama in SmolLM2's layout, written the way
`launch/prepare_model.py` makes models/smollm2: a llama.cpp-style GGUF (the
helpers of tests/models/test_gguf.py) converted by `jrl.models.gguf.convert`.
Only the code path and the printout are checked; speed goals live in the
benchmark itself.
"""

import importlib.util
import json
import math
import os
import re
import sys
import types

import numpy as np
import pytest

from jrl.models import gguf as jrl_gguf
from launch.benches import common as bench_common
from tests.models import test_gguf

_LAUNCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), 'launch')


def _load_bench():
  spec = importlib.util.spec_from_file_location('jrl_launch_bench', f'{_LAUNCH}/bench.py')
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


bench = _load_bench()

# A short system prompt (the experiment's is longer than the tiny tokenizer's
# 160-token prompt limit), 8 rows of at most 4 new tokens, rewards in-process.
TINY = [
  'task.system_prompt=Answer.',
  'rl.prompts_per_step=2',
  'rl.group_size=4',
  'rl.minibatch_size=8',
  'task.max_response_len=4',
  'rl.overlong_buffer=0',
  'sampler.num_slots=8',
  'reward.mode=inline',
]
STAGES = ('generate', 'reward', 'reference', 'update', 'step')
NUMBER = r'-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|\bnan\b|\binf\b'


@pytest.fixture(scope='module')
def tiny_smollm2(tmp_path_factory):
  root = tmp_path_factory.mktemp('tiny_smollm2')
  tok = test_gguf._train_tokenizer()
  vocab = tok.get_vocab_size(with_added_tokens=True)
  weights = test_gguf._random_weights(np.random.default_rng(0), vocab, tied=True)
  path = str(root / 'tiny.gguf')
  test_gguf.write_gguf(path, weights, tok, quantised=False)
  out = str(root / 'smollm2')
  jrl_gguf.convert(path, out)
  return out


def _numbers(line):
  values = [float(v) for v in re.findall(NUMBER, line)]
  assert values, line
  assert all(math.isfinite(v) for v in values), line
  return values


def test_real_setup_prints_one_block_per_combination(tiny_smollm2, tmp_path, capsys):
  out_path = str(tmp_path / 'figures.json')
  argv = ['grpo', '--setup', 'real', '--model_path', tiny_smollm2, '--steps', '2']
  argv += ['--remat', 'full', '--lora_rank', '0,4', '--peak_n', '128', '--kl_coef', '0.001']
  argv += ['--out', out_path]
  for field in TINY:
    argv += ['--set', field]
  bench.main(argv)
  out = capsys.readouterr().out
  blocks = re.split(r'\n  (?=remat=)', out)[1:]
  heads = [b.split(':')[0] for b in blocks]
  assert heads == [f'remat=full lora={r} kl_coef=0.001 layout=padded' for r in ('-', 4)]
  for block in blocks:
    lines = block.splitlines()
    assert '8 rows of' in lines[0] and '200 training prompts' in lines[0]
    progress = [line for line in lines if re.match(r'\s+step \d+/2:', line)]
    assert len(progress) == 2 and all('generate' in line for line in progress)
    body = {line.split()[0]: line for line in lines[1:] if line not in progress}
    for stage in STAGES:
      (seconds,) = _numbers(body[stage])
      assert seconds >= 0
    assert _numbers(body['first'])[0] > 0
    for name in ('generate:', 'reference:', 'update:'):
      assert 'tokens/s' in body[name]
      assert _numbers(body[name])[0] > 0
    mfu = re.search(r'MFU ([0-9.]+)% of a ([0-9.]+) GFLOP/s', body['update:'])
    assert mfu and 0 < float(mfu.group(1)) and float(mfu.group(2)) > 0
    for name in ('generate:', 'reference:'):  # MFU per phase
      assert re.search(r'MFU [0-9.e+-]+%', body[name])
    assert ('LoRA: no base-weight gradients' in body['update:']) == ('lora=4' in lines[0])
    # remat set by the flag: only the budget is planned (a tiny model: by the bound).
    assert re.search(r'memory plan of the update: remat=full micro_batch_tokens=0', out)
    assert 'cumulative' in body['process']
    assert _numbers(body['process'])[0] > 0
  trainable = [_numbers(b.split('trainable: ')[1].splitlines()[0])[0] for b in blocks]
  assert trainable[0] > trainable[1]  # full fine-tuning trains more than the adapters

  with open(out_path, encoding='utf-8') as f:
    figures = json.load(f)
  assert figures['set'][-1] == 'rl.kl_coef=0.001'
  assert [(r['remat'], r['lora_rank']) for r in figures['runs']] == [('full', 0), ('full', 4)]
  for run in figures['runs']:
    assert set(run['median_s']) == set(STAGES) and len(run['steps_s']) == 2
    assert run['median_s']['reference'] > 0 and run['memory_plan']['remat'] == 'full'
    assert set(run['mfu']) == {'generate', 'reference', 'update'}
    assert all(0 < v < 1 for v in run['mfu'].values())


def test_kl_flag_and_set_field_together_are_refused(tiny_smollm2):
  argv = ['grpo', '--setup', 'real', '--model_path', tiny_smollm2, '--kl_coef', '0.01']
  with pytest.raises(SystemExit, match=r'--kl_coef and --set rl\.kl_coef'):
    bench.main([*argv, '--set', 'rl.kl_coef=0.02'])


def test_missing_checkpoint_names_the_path_and_the_command(tmp_path):
  missing = str(tmp_path / 'smollm2')
  with pytest.raises(SystemExit, match=re.escape(missing) + '.*prepare_model.py --out'):
    bench.main(['grpo', '--setup', 'real', '--model_path', missing])


def test_real_only_flags_are_refused_on_other_setups():
  with pytest.raises(SystemExit, match='--setup real'):
    bench.main(['grpo', '--setup', 'default', '--lora_rank', '0,16'])


def test_set_fields_parses_each_field_as_its_type():
  from configs import grpo_smollm2_gsm

  config = bench_common.set_fields(
    grpo_smollm2_gsm.get_config(),
    ['rl.group_size=4', 'rl.kl_coef=0.01', 'log.plot=false', 'task.system_prompt=', 'seed=3'],
  )
  assert (config.rl.group_size, config.rl.kl_coef, config.log.plot) == (4, 0.01, False)
  assert (config.task.system_prompt, config.seed) == ('', 3)
  with pytest.raises(ValueError, match='KEY=VALUE'):
    bench_common.set_fields(config, ['rl.group_size'])


def test_every_grpo_setup_applies_to_the_default_config():
  from configs import grpo_arith
  from launch.benches import grpo as grpo_bench

  for name, overrides in grpo_bench.GRPO_SETUPS.items():
    config = bench_common.bench_config(grpo_arith.get_config(), 2, overrides)
    for section, fields in overrides.items():
      for field, value in fields.items():
        assert config[section][field] == value, (name, section, field)
  with pytest.raises(KeyError, match=r'`rl\.max_new_tokens`: the config has no such field'):
    bench_common.bench_config(grpo_arith.get_config(), 2, {'rl': {'max_new_tokens': 64}})


def test_update_bench_packs_a_long_tailed_batch_into_fewer_rows(capsys):
  lengths = bench_common.long_tailed_lengths(64, 512, 0.25, seed=0)
  assert lengths.max() == 512 and lengths.min() >= 16
  assert 0.2 * 512 < lengths.mean() < 0.3 * 512
  argv = ['update', '--size', 'cpu-tiny', '--batch', '8', '--max_len', '64', '--repeats', '1']
  bench.main(argv + ['--micro_tokens', '128'])
  out = capsys.readouterr().out
  rows = re.search(r'padded (\d+) rows x 64 .*packed (\d+) rows x 64', out)
  assert rows and int(rows.group(2)) < int(rows.group(1)) == 8
  for name in ('padded', 'packed', 'micro', 'micro/1L'):
    assert re.search(rf'  {name} +[\d.]+ ms/step .* MFU \(real tokens\) +[\d.]+%', out), out
  assert re.search(r'packed / padded time: x[\d.]+', out)
  # Micro-batches of 128 tokens: rows of 64 (2 per micro-batch), then the short tail in
  # shorter rows (the buckets of 64: 32, 16); with one row length, rows of 64 only.
  micro = re.search(r'  micro .*rows x length (\[.*?\])', out).group(1)
  one_length = re.search(r'  micro/1L .*rows x length (\[.*?\])', out).group(1)
  assert '(2, 64)' in micro and set(re.findall(r', (\d+)\)', one_length)) == {'64'}


SAMPLER_TINY = ['--prompts', '2', '--group', '2', '--min_prompt', '8', '--max_prompt', '16']
SAMPLER_TINY += ['--max_new', '8', '--page_size', '4', '--steps', '4', '--repeats', '1']


def _engine_lines(out):
  """{engine: (tokens/s, first call s, compile s)} of the sampler bench's printout."""
  found = re.findall(
    r'\n  (\S.*?) +([\d.]+) output tokens/s steady .*?first call ([\d.]+) s of which compile '
    r'([\d.]+) s',
    out,
  )
  return {name: tuple(float(v) for v in values) for name, *values in found}


def test_sampler_bench_long_tail_runs_the_engine_with_and_without_compaction(capsys):
  # Limits of 32 (long) and 16 (short) new tokens.
  bench.main(
    ['sampler', '--size', 'cpu-tiny', '--mode', 'long_tail', *SAMPLER_TINY, '--max_new', '32']
  )
  out = capsys.readouterr().out
  assert '4 slots' in out  # the whole batch in flight by default: 2 prompts x G=2
  engines = _engine_lines(out)
  assert set(engines) == {'paged', 'paged, no compaction', 'dense'}, out
  assert all(rate > 0 and first > 0 for rate, first, _ in engines.values())
  assert 'WARNING' not in out  # the same completion lengths in every engine
  assert re.search(r'tokens/s compaction/none: x[\d.]+', out)
  rows = re.search(r'paged, no compaction .* ([\d.]+) rows per decode step', out)
  assert rows and float(rows.group(1)) == 4.0


def test_sampler_bench_against_transformers_generate(tiny_smollm2, capsys):
  argv = ['sampler', '--model_path', tiny_smollm2, '--baseline', 'hf', '--num_stop', '4']
  bench.main(argv + SAMPLER_TINY)
  out = capsys.readouterr().out
  assert tiny_smollm2 in out.splitlines()[0]
  assert set(_engine_lines(out)) == {'paged', 'hf'}, out
  for ratio in ('tokens/s paged/hf', 'first call paged/hf', 'KV memory: paged peak'):
    assert ratio in out, out
  for baseline in ('hf', 'vllm'):
    with pytest.raises(SystemExit, match=f'--baseline {baseline} needs --model_path'):
      bench.main(['sampler', '--size', 'cpu-tiny', '--baseline', baseline, *SAMPLER_TINY])


def test_sampler_bench_chat_prompts_are_templated_and_held_to_max_new(tiny_smollm2):
  """`--chat_prompts`: word problems in the checkpoint's chat template, its
  end tokens as stop tokens, forbidden until --max_new unless --free_len."""
  from jrl.models.tokenizer import load_tokenizer
  from launch.benches import sampler as sampler_bench

  args = types.SimpleNamespace(model_path=tiny_smollm2, prompts=3, max_new=16, free_len=False)
  requests, stop = sampler_bench.chat_requests(args)
  tok = load_tokenizer(tiny_smollm2)
  assert stop == tuple(tok.eos_ids) and len(requests) == 3
  texts = [tok.decode(list(r.prompt)) for r in requests]
  assert all('trees' in t and 'Solve the problem' in t for t in texts), texts
  assert len(set(texts)) == 3  # three problems
  assert all(r.min_new_tokens == r.max_new_tokens == 16 and r.stop_tokens == stop for r in requests)
  args.free_len = True
  assert all(r.min_new_tokens == 0 for r in sampler_bench.chat_requests(args)[0])


def test_envs_bench_runs_inline_pooled_and_no_wait_on_the_same_trajectories(tmp_path, capsys):
  out_path = tmp_path / 'envs.json'
  # `async` names this benchmark too.
  argv = ['async', '--size', 'cpu-tiny', '--prompts', '2', '--group', '2', '--max_new', '32']
  bench.main(argv + ['--env_ms', '20', '--repeats', '1', '--turn_len', '8', '--out', str(out_path)])
  out = capsys.readouterr().out
  assert 'pooled / inline: x' in out
  figures = json.loads(out_path.read_text())['figures']
  assert set(figures) == {'inline', 'pooled', 'no wait', 'pooled_over_inline'}
  ways = [figures[k] for k in ('inline', 'pooled', 'no wait')]
  assert all(f['same_trajectories'] and f['model_tokens'] > 0 for f in ways)
  assert len({f['env_steps'] for f in ways}) == 1 and ways[0]['env_steps'] > 0
  assert figures['inline']['parked_peak'] == 0 and figures['pooled']['parked_peak'] >= 1


def test_partial_bench_recomputed_cache_is_exact_and_kept_cache_is_not(tmp_path, capsys):
  out_path = tmp_path / 'partial.json'
  argv = ['partial', '--size', 'cpu-tiny', '--prompts', '2', '--group', '2', '--max_new', '32']
  argv += ['--steps', '4', '--swap_every', '1', '--drift', '0.05', '--repeats', '1']
  bench.main(argv + ['--out', str(out_path)])
  assert 'recompute / keep: x' in capsys.readouterr().out
  figures = json.loads(out_path.read_text())['figures']
  assert figures['no swap']['swaps'] == 0 and figures['keep']['swaps'] == 3
  assert figures['recompute']['logp_gap_max'] < 1e-5 and figures['no swap']['logp_gap_max'] < 1e-5
  assert figures['keep']['logp_gap_max'] > 1e-3
