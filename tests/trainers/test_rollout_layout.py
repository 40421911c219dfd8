"""How the rollout sits on the training mesh.

Decode weights under fsdp (`sampler.decode_weights`): a colocated sampler
reads a copy of the policy laid out for decoding (whole on each batch
shard, split over tensor), made once per policy version, instead of the
trainer's fsdp-sharded arrays that every decode step would have to reach
across the fsdp axis for. The collectives of one compiled decode dispatch
are read from its HLO (`parallel.collectives`), before and after; the
samples are the same; the topology makes the copy only where it helps and
fits; the cost model and the planner count it.

The held-out evaluation of the offline algorithms (SFT, DPO) reads the
same copy.

Data-parallel replicas in training runs (`sampler.replicas`): the same
figures as one replica. (On two processes: tests/test_distributed.py.)
"""

import json

import jax
import numpy as np
import pytest

from jrl import costmodel, parallel, trainers
from jrl import models as M
from jrl.sampler import Request, Sampler, SamplerConfig
from jrl.trainers import controller
from jrl.trainers.rollouts import engines
from tests.helpers import QUIET, records, shrunk_config
from tests.sampler import margins

CFG = M.ModelConfig(
  vocab_size=64, width=32, mlp_width=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)
ECFG = SamplerConfig(num_slots=8, num_pages=64, page_size=4, max_prompt_len=16, max_new_tokens=10)


def _setup(mesh_shape):
  mesh = parallel.make_mesh(*mesh_shape)
  graphdef, params = M.create_sharded(CFG, jax.random.key(0), mesh)
  decode = parallel.decode_shardings(mesh, params, M.param_logical_axes, M.head_units(CFG))
  return mesh, graphdef, params, decode


def _decode_collectives(sampler, params):
  """{op: (count, bytes)} of one compiled decode step with `params`' layout."""
  compiled = sampler._generate.lower(
    params, sampler.init_state(), num_steps=1, max_pages=ECFG.max_pages_per_slot, truncate=False
  ).compile()
  return parallel.collectives(compiled.as_text())


def test_the_decode_layout_drops_fsdp_and_keeps_tensor():
  _, _, params, decode = _setup((1, 4, 2))
  train = jax.tree.map(lambda x: x.sharding.spec, params)
  specs = jax.tree.leaves(jax.tree.map(lambda s: s.spec, decode))
  assert not any('fsdp' in str(s) for s in specs)
  assert any('fsdp' in str(s) for s in jax.tree.leaves(train))  # the trainer's has it
  # Every tensor split of the trainer's layout is kept.
  for t, d in zip(jax.tree.leaves(train), specs, strict=True):
    assert [a if a == 'tensor' else None for a in t] == [a if a == 'tensor' else None for a in d]
  # Each device holds the whole model over its tensor shard: 4x its fsdp share.
  shard = parallel.bytes_per_device(params, jax.tree.map(lambda x: x.sharding, params))
  whole = parallel.bytes_per_device(params, decode)
  assert shard < whole <= 4 * shard


@pytest.mark.parametrize('mesh_shape', [(2, 4, 1), (1, 4, 2)], ids=['data2_fsdp4', 'fsdp4_tp2'])
def test_gathered_weights_cut_the_collectives_of_a_decode_step_and_sample_the_same(mesh_shape):
  mesh, graphdef, params, decode = _setup(mesh_shape)
  gathered = jax.device_put(params, decode)
  sampler = Sampler(graphdef, CFG, ECFG, mesh=mesh, steps_per_dispatch=2)
  before = _decode_collectives(sampler, params)
  after = _decode_collectives(sampler, gathered)
  count = lambda c: sum(n for n, _ in c.values())
  size = lambda c: sum(b for _, b in c.values())
  print(f'{mesh_shape}: per decode step {count(before)} collectives, {size(before)} bytes '
        f'-> {count(after)}, {size(after)} bytes')  # fmt: skip
  assert count(before) > 0
  if mesh_shape[2] == 1:  # no tensor axis: nothing is left to communicate
    assert after == {}
  else:  # only the tensor-parallel collectives are left
    assert 0 < count(after) < count(before) and size(after) < size(before)
  if mesh_shape[2] != 1:
    return  # the samples are compared once, on the mesh without a tensor axis
  requests = [
    Request(prompt=list(range(1 + i, 4 + 2 * i)), max_new_tokens=6, seed=i, temperature=0.8)
    for i in range(3)
  ]
  want = sampler.generate(params, requests, group_size=2)
  got = sampler.generate(gathered, requests, group_size=2)
  # Two layouts, two programs: the same tokens up to a draw rounding could
  # flip (tests/sampler/margins.py).
  upto = margins.fragile_points(graphdef, params, requests, want)
  assert sum(map(sum, upto)) >= 0.75 * sum(len(w.tokens) for row in want for w in row)
  for w_row, g_row, n_row in zip(want, got, upto, strict=True):
    for w, g, n in zip(w_row, g_row, n_row, strict=True):
      np.testing.assert_array_equal(g.tokens[:n], w.tokens[:n])
      np.testing.assert_allclose(g.logprobs[:n], w.logprobs[:n], atol=1e-6, rtol=0)


def test_the_topology_copies_only_where_it_helps_and_fits():
  mesh, _, params, _ = _setup((2, 4, 1))
  whole = parallel.bytes_per_device(
    params, parallel.decode_shardings(mesh, params, M.param_logical_axes, M.head_units(CFG))
  )
  make = lambda mode, limit=None, m=mesh: engines.decode_shardings(mode, m, CFG, params, limit)
  assert make('sharded') is None
  assert make('gathered') is not None
  assert make('auto') is not None  # the CPU reports no memory limit
  assert make('auto', limit=4 * whole) is not None  # a quarter of the memory holds it
  assert make('auto', limit=4 * whole - 1) is None  # it does not: the trainer's layout
  data_only = parallel.make_mesh(8, 1, 1)  # no fsdp: the trainer's layout already decodes
  assert make('gathered', m=data_only) is None


def test_a_colocated_run_samples_from_the_copy_with_the_same_figures(tmp_path):
  """One GRPO iteration on a 2 data x 4 fsdp mesh: the rollout reads a
  gathered copy (made in a 'reshard' span), and logs what the run reading
  the trainer's own arrays logs."""
  logged, sampled = {}, {}
  for mode in ('sharded', 'gathered'):
    overrides = {**QUIET, 'workdir': str(tmp_path / mode), 'mesh.data': 2, 'mesh.fsdp': 4}
    overrides.update({'sft.steps': 0, 'rl.steps': 1, 'reward.mode': 'inline'})
    overrides.update({'sampler.decode_weights': mode})
    config = shrunk_config(tmp_path, overrides)
    job = trainers.build(config)
    assert (job.topology.decode is None) == (mode == 'sharded')
    seen = []

    def sample(params, iteration, seen=seen, original=job.topology.worker.sample):
      seen.append(params)
      return original(params, iteration)

    job.topology.worker.sample = sample
    generated = []

    def generate(*args, original=job.topology.worker._generate, generated=generated):
      out = original(*args)
      generated.append((jax.device_get(args[2]), *out))  # the params, before donation
      return out

    job.topology.worker._generate = generate
    controller.train(job)
    sampled[mode] = (job.topology.worker.engine.graphdef, *generated[0])
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(seen[0])}
    assert any('fsdp' in s for s in specs) == (mode == 'sharded')
    logged[mode] = records(str(tmp_path / mode))[-1]
    with open(tmp_path / mode / 'trace.json', encoding='utf-8') as f:
      spans = [e['name'] for e in json.load(f)['traceEvents'] if e.get('ph') == 'X']
    # The copy is made once per policy version (here: for the one rollout).
    assert ('reshard' in spans) == (mode == 'gathered')
  # Two programs: the same samples up to a draw rounding could flip
  # (tests/sampler/margins.py); the figures are compared when no such draw
  # came before a sample's end.
  graphdef, params, requests, want = sampled['sharded']
  got = sampled['gathered'][3]
  upto = margins.fragile_points(graphdef, params, requests, want)
  whole = True
  for w_row, g_row, n_row in zip(want, got, upto, strict=True):
    for w, g, n in zip(w_row, g_row, n_row, strict=True):
      np.testing.assert_array_equal(g.tokens[:n], w.tokens[:n])
      whole &= n == len(w.tokens) and np.array_equal(g.tokens, w.tokens)
  assert sum(map(sum, upto)) >= 0.75 * sum(len(w.tokens) for row in want for w in row)
  if whole:
    for key in ('reward/mean', 'response_length/mean', 'actor/pg_loss', 'actor/entropy'):
      np.testing.assert_allclose(logged['gathered'][key], logged['sharded'][key], rtol=1e-5)


def test_the_held_out_evaluation_of_an_offline_run_reads_the_copy(tmp_path, monkeypatch):
  """SFT on a 2 data x 4 fsdp mesh, evaluated before and after its step: the
  held-out sampler reads a gathered copy (a 'reshard' span per evaluation)
  and scores what the run reading the trainer's arrays scores."""
  from jrl.trainers.evaluation import held_out

  logged = {}
  for mode in ('sharded', 'gathered'):
    workdir = tmp_path / mode
    overrides = {**QUIET, 'algorithm': 'sft', 'workdir': str(workdir)}
    overrides.update({'mesh.data': 2, 'mesh.fsdp': 4, 'sft.steps': 1, 'eval.every': 1})
    overrides.update({'sampler.decode_weights': mode})
    seen = []

    def evaluate(self, params, step=None, seen=seen, original=held_out.HeldOut.evaluate):
      seen.append({str(x.sharding.spec) for x in jax.tree.leaves(params)})
      return original(self, params, step=step)

    monkeypatch.setattr(held_out.HeldOut, 'evaluate', evaluate)
    controller.train(trainers.build(shrunk_config(tmp_path, overrides)))
    assert len(seen) == 2  # at the start and after the step
    assert all(any('fsdp' in spec for spec in specs) == (mode == 'sharded') for specs in seen)
    logged[mode] = [r for r in records(str(workdir)) if 'eval/accuracy' in r]
    with open(workdir / 'trace.json', encoding='utf-8') as f:
      spans = [e['name'] for e in json.load(f)['traceEvents'] if e.get('ph') == 'X']
    assert spans.count('reshard') == (2 if mode == 'gathered' else 0)
  assert len(logged['gathered']) == 2
  for got, want in zip(logged['gathered'], logged['sharded'], strict=True):
    assert got['eval/accuracy'] == want['eval/accuracy']


def test_the_cost_model_and_the_planner_count_the_decode_copy():
  model = costmodel.model_preset('qwen2.5-0.5b')
  w = costmodel.Workload(prompts_per_step=32, group_size=8, prompt_len=128, response_mean=256,
                         response_max=512, minibatch_rows=64, num_slots=128)  # fmt: skip
  hw = costmodel.HARDWARE['tpu-v5e']
  gathered = costmodel.Layout('colocated', train_chips=8, decode_weights='gathered')
  sharded = costmodel.Layout('colocated', train_chips=8, decode_weights='sharded')
  mem_g, mem_s = costmodel.memory(model, w, gathered), costmodel.memory(model, w, sharded)
  p = model.num_params()
  assert mem_g['rollout']['rollout_weights'] == p * w.param_bytes  # whole on each chip
  assert 'rollout_weights' not in mem_s['rollout']
  c_g = costmodel.Coefficients.from_hardware(model, hw, w, gathered)
  c_s = costmodel.Coefficients.from_hardware(model, hw, w, sharded)
  assert c_s.decode_fixed_s > c_g.decode_fixed_s  # collectives every decode step
  assert c_g.reshard_s > 0 and c_s.reshard_s == 0  # one gather per policy version
  t_g, t_s = costmodel.predict(model, w, gathered, c_g), costmodel.predict(model, w, sharded, c_s)
  assert t_g['reshard'] > 0 and t_s['reshard'] == 0
  assert t_g['generate'] < t_s['generate']


def test_a_run_with_sampler_replicas_logs_the_single_replica_figures(tmp_path):
  """One SFT + one GRPO iteration with evaluation on 8 data shards: 8
  replicas of 4 slots (each device decodes its own) sample what one
  replica of 32 samples, so every logged figure but the timings agrees."""
  logged = {}
  for replicas in (1, 8):
    overrides = {**QUIET, 'workdir': str(tmp_path / str(replicas)), 'mesh.data': 8}
    overrides.update({'sft.steps': 1, 'rl.steps': 1, 'reward.mode': 'inline', 'eval.every': 2})
    overrides.update({'sampler.num_slots': 32, 'sampler.replicas': replicas})
    job = trainers.build(shrunk_config(tmp_path, overrides))
    state = job.topology.worker.engine.init_state()
    assert job.topology.worker.engine.replicas == replicas
    assert state.page_table.shape[:2] == (replicas, 32 // replicas)
    controller.train(job)
    logged[replicas] = records(str(tmp_path / str(replicas)))
  for one, eight in zip(logged[1], logged[8], strict=True):
    keys = [k for k in one if not k.startswith(('time/', 'throughput/', 'perf/'))]
    keys = [k for k in keys if 'idle' not in k and 'sampler/' not in k]
    assert any(k.startswith('eval/') for k in keys) and one['step'] == eight['step']
    for key in keys:
      assert eight[key] == pytest.approx(one[key], rel=1e-6, abs=1e-7), (one['step'], key)


def test_sampler_replicas_are_checked_against_the_slots_and_the_mesh(tmp_path):
  config = shrunk_config(tmp_path, {'sampler.replicas': 3})
  with pytest.raises(ValueError, match=r'^`sampler\.replicas`: must divide sampler\.num_slots'):
    trainers.validate(config, 8)
  config = shrunk_config(tmp_path, {'sampler.replicas': 8})  # 16 slots: 2 per replica < G
  with pytest.raises(ValueError, match=r'^`sampler\.num_slots`: divided by sampler\.replicas'):
    trainers.validate(config, 8)
  config = shrunk_config(tmp_path, {'sampler.replicas': 4, 'sampler.num_slots': 32})
  with pytest.raises(ValueError, match=r'^`sampler\.replicas`: must be 1, mesh\.data or'):
    trainers.validate(config, 2)
