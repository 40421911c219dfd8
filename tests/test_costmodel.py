"""Traces (`jrl.trace`), the cost model (`jrl.costmodel`) and the planner
(`launch/plan.py`).

Memory estimates are checked against the sizes of the real objects (the
model's parameters, optax's AdamW state, the sampler's page pool); the
generation simulator against the real sampler's dispatch count; traces of a
real run against the trace-event JSON schema.
"""

import dataclasses
import importlib.util
import json
import os
import threading

import jax
import jsonschema
import numpy as np
import pytest

from jrl import costmodel, models, sampler, trace, trainers
from jrl.data import packing
from jrl.trainers.optim import make_optimizer
from tests.helpers import QUIET, optim_config, shrunk_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location('plan', f'{REPO}/launch/plan.py')
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)


# Traces ---------------------------------------------------------------------------------


def test_tracer_tracks_threads_and_validates_against_the_schema(tmp_path):
  tracer = trace.Tracer()
  with tracer.span('update', iteration=0):
    pass

  def rollout():
    with tracer.span('generate'):
      pass

  worker = threading.Thread(target=rollout, name='rollout_0')
  worker.start()
  worker.join()
  path = tmp_path / 'trace.json'
  tracer.write(str(path), {'note': 'x'})
  data = json.loads(path.read_text())
  jsonschema.validate(data, trace.SCHEMA)
  names = {e['args']['name'] for e in data['traceEvents'] if e['name'] == 'thread_name'}
  assert names == {'trainer', 'rollout'}
  tids = {e['name']: e['tid'] for e in data['traceEvents'] if e['ph'] == 'X'}
  assert tids['update'] != tids['generate']
  assert data['otherData'] == {'note': 'x'}


def test_schema_rejects_malformed_events():
  bad = [
    {'traceEvents': [{'name': 'x', 'ph': 'X', 'pid': 0, 'tid': 1, 'ts': 0}]},  # no dur
    {'traceEvents': [{'name': 'x', 'ph': 'Q', 'pid': 0, 'tid': 1, 'ts': 0, 'dur': 1}]},
    {'traceEvents': [{'name': 'x', 'ph': 'X', 'pid': 0, 'tid': 1, 'ts': -1, 'dur': 1}]},
    {'traceEvents': [{'name': 'thread_name', 'ph': 'M', 'pid': 0, 'tid': 1}]},  # no args
    {'events': []},
  ]
  for doc in bad:
    with pytest.raises(jsonschema.ValidationError):
      jsonschema.validate(doc, trace.SCHEMA)


def test_busy_time_is_the_union_of_spans_and_bubbles_follow():
  tracer = trace.Tracer()
  # generate [0, 2] and [1, 3] overlap -> 3 s busy; update [4, 5].
  tracer.add('generate', 0.0, 2.0)
  tracer.add('generate', 1.0, 3.0)
  tracer.add('update', 4.0, 5.0)
  tracer.add('decode', 0.5, 1.0, 'sampler')
  assert tracer.busy(('generate',), 0.0, 10.0) == pytest.approx(3.0)
  assert tracer.busy(('generate',), 2.5, 10.0) == pytest.approx(0.5)
  b = tracer.bubbles(0.0, 5.0)
  assert b['time/rollout_idle_frac'] == pytest.approx(0.4)
  assert b['time/train_idle_frac'] == pytest.approx(0.8)
  disabled = trace.Tracer(enabled=False)
  with disabled.span('update'):
    pass
  assert disabled.events == []


@pytest.fixture(scope='module')
def traced_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('traced'))
  overrides = {
    **QUIET,
    'topology.kind': 'one_step_off',
    'rl.kl_coef': 0.01,
    'rl.steps': 3,
    'reward.mode': 'inline',
  }
  trainers.run(shrunk_config(workdir, overrides))
  with open(os.path.join(workdir, 'trace.json'), encoding='utf-8') as f:
    return json.load(f), workdir


def test_run_trace_is_valid_and_covers_every_stage(traced_run):
  data, workdir = traced_run
  jsonschema.validate(data, trace.SCHEMA)
  spans = [e for e in data['traceEvents'] if e['ph'] == 'X']
  names = {e['name'] for e in spans}
  for stage in ('step', 'sft_update', 'generate', 'prefill', 'decode', 'reward', 'reference',
                'proximal', 'update', 'checkpoint'):  # fmt: skip
    assert stage in names, stage
  tracks = {e['args']['name'] for e in data['traceEvents'] if e['name'] == 'thread_name'}
  assert tracks == {'trainer', 'rollout'}  # one-step-off generates in the background
  decode = [e for e in spans if e['name'] == 'decode']
  assert all({'active', 'steps', 'max_pages'} <= set(e['args']) for e in decode)
  assert data['otherData']['config']['topology']['kind'] == 'one_step_off'
  records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  rl = [r for r in records if r.get('phase') == 1.0]
  assert all(0.0 <= r['time/rollout_idle_frac'] <= 1.0 for r in rl)


def test_calibration_from_a_run_trace(traced_run):
  data, _ = traced_run
  coeffs = costmodel.calibrate(data)
  fields = coeffs.__dataclass_fields__
  values = {k: getattr(coeffs, k) for k in fields if k != 'source'}
  assert all(np.isfinite(v) and v >= 0 for v in values.values()), values
  assert coeffs.train_token_s > 0 and coeffs.decode_fixed_s + coeffs.decode_page_s > 0
  workload = costmodel.workload_from_config(data['otherData']['config'])
  model = costmodel.trace_model(data)
  pred = costmodel.predict(model, workload, costmodel.Layout('one_step_off'), coeffs)
  assert pred['step'] > 0 and pred['generate'] > 0 and pred['proximal'] > 0
  # A model with twice the FLOPs per token costs twice as much per token.
  doubled = costmodel.calibrate(data, model=model, reference_model=model)
  assert doubled.train_token_s == pytest.approx(coeffs.train_token_s)


def test_calibration_needs_decode_spans():
  with pytest.raises(ValueError, match='decode spans'):
    costmodel.calibrate({'traceEvents': [], 'otherData': {}}, costmodel.Workload(1, 2, 4, 4, 4))


# Tokens run: padded and packed -------------------------------------------------------


def test_tokens_run_padded_and_packed_by_hand():
  # Four sequences of 4 prompt tokens + responses [12, 4, 8, 4] = [16, 8, 12, 8]
  # tokens, 44 real, in rows of seq_len = 4 + 12 = 16.
  w = costmodel.Workload(2, 2, 4, 7.0, 12, packing=True)
  lengths = [12, 4, 8, 4]
  padded = costmodel.tokens_run(dataclasses.replace(w, packing=False), lengths)
  assert (padded.real, padded.run, padded.rows) == (44, 64, 4)
  assert padded.efficiency == pytest.approx(44 / 64)
  # First-fit-decreasing: [16], [12], [8, 8] -> 3 rows (row_count(3) = 3).
  packed = costmodel.tokens_run(w, lengths)
  assert (packed.real, packed.run, packed.rows, packed.row_len) == (44, 48, 3, 16)
  assert packed.efficiency == pytest.approx(44 / 48)
  # Two batch shards: the row count rounds up to 4 rows.
  assert costmodel.tokens_run(w, lengths, shards=2).run == 64
  # Rows of 32: [16, 12], [8, 8] -> 2 rows of 32.
  wide = costmodel.tokens_run(dataclasses.replace(w, pack_row_len=32), lengths)
  assert (wide.run, wide.rows, wide.row_len) == (64, 2, 32)
  # Minibatches of 2 pack apart: [16] [8] and [12] [8] (12 + 8 > 16) -> 4 rows.
  split = costmodel.tokens_run(dataclasses.replace(w, minibatch_rows=2), lengths)
  assert (split.run, split.most_rows) == (64, 2)
  # A budget of 32 tokens (2 rows) per micro-batch: [16] [12] and [8, 8] -> 2 + 1 rows.
  micro = costmodel.tokens_run(dataclasses.replace(w, micro_batch_tokens=32), lengths)
  assert (micro.run, micro.micro_batches) == (48, 2)
  with pytest.raises(ValueError, match='3 response lengths for 4 rows'):
    costmodel.tokens_run(w, lengths[:3])
  with pytest.raises(ValueError, match='pack_row_len'):
    dataclasses.replace(w, pack_row_len=8)
  with pytest.raises(ValueError, match='needs `packing`'):
    dataclasses.replace(w, packing=False, micro_batch_tokens=64)


def _coeffs(**fields):
  zero = dict.fromkeys(
    ['decode_compute_s', 'decode_mem_s', 'decode_page_s', 'prefill_fixed_s', 'prefill_token_s',
     'update_fixed_s', 'reshard_s'],
    0.0,
  )  # fmt: skip
  base = dict(decode_fixed_s=0.01, forward_token_s=1e-6, train_token_s=3e-6, reward_s=1e-3)
  return costmodel.Coefficients(**{**zero, **base, **fields})


# 128 sequences of 64 prompt tokens and long-tailed responses (mean 100, 5% at
# 960) in rows of 1,024: 20,990 real tokens. Padded: 128 rows. Packed: each
# minibatch of 32 holds 4,680-5,758 tokens, 5 or 6 rows by first-fit-decreasing,
# rounded to 6 by row_count -> 24 rows, 0.1875 of the padded tokens.
LONG_TAIL = costmodel.Workload(
  16, 8, 64, 100.0, 960, 0.05, epochs=2, minibatch_rows=32, reference=True, packing=True
)


@pytest.mark.parametrize('shards', [1, 2, 4])
def test_tokens_run_packs_as_the_trainer_packs(shards):
  lengths = LONG_TAIL.response_lengths()
  mask = np.arange(LONG_TAIL.seq_len)[None, :] < (64 + np.asarray(lengths))[:, None]
  tokens = np.where(mask, 5, 0).astype(np.int32)
  rows = [
    packing.pack_padded(tokens[k : k + 32], mask[k : k + 32], 1024, shards).tokens.shape[0]
    for k in range(0, 128, 32)
  ]
  tok = costmodel.tokens_run(LONG_TAIL, shards=shards)
  assert (tok.rows, tok.most_rows, tok.real) == (sum(rows), max(rows), int(mask.sum()))


def test_packing_shortens_the_predicted_training_passes_by_the_token_ratio():
  model, layout = tiny(), costmodel.Layout('one_step_off')
  packed_w = LONG_TAIL
  padded_w = dataclasses.replace(packed_w, packing=False)
  packed = costmodel.predict(model, packed_w, layout, _coeffs())
  padded = costmodel.predict(model, padded_w, layout, _coeffs())
  assert padded['tokens_run'] == 128 * 1024 and padded['tokens_real'] == 20990
  assert packed['tokens_run'] == 24 * 1024 and packed['tokens_real'] == 20990
  assert padded['packing_efficiency'] == pytest.approx(20990 / 131072)
  assert packed['packing_efficiency'] == pytest.approx(20990 / 24576)
  for stage in ('reference', 'proximal', 'update'):
    assert packed[stage] == pytest.approx(0.1875 * padded[stage]), stage
  assert padded['update'] == pytest.approx(2 * 131072 * 3e-6)  # two epochs
  assert packed['generate'] == padded['generate']
  assert packed['step'] < padded['step']
  # Micro-batches of 2,048 tokens: each minibatch's two rows of 1,024 that hold its
  # longest sequences, then the rest in rows of 256 (8 per micro-batch) where that runs
  # no more tokens than rows of 1,024 (rows 2 + 2 + 1 or 2 + 2 + 2 of 1,024, 22 in all):
  # 2,048 + 2,048 + 768 (3 rows) < 5,120; 2,048 + 2,048 + 2,048 (8) = 6,144 (a tie:
  # the shorter rows); the same; 2,048 + 2,048 + 1,024 (4) = 5,120.
  budget = dataclasses.replace(packed_w, micro_batch_tokens=2048)
  micro = costmodel.predict(model, budget, layout, _coeffs())
  assert micro['tokens_run'] == 4864 + 6144 + 6144 + 5120 < 22 * 1024
  assert micro['update'] == pytest.approx(22272 / 131072 * padded['update'])


def test_packed_activations_are_the_packed_micro_batch():
  model, layout = tiny(), costmodel.Layout()
  padded = costmodel.memory(model, dataclasses.replace(LONG_TAIL, packing=False), layout)
  packed = costmodel.memory(model, LONG_TAIL, layout)
  # 32 padded rows per minibatch against at most 6 packed rows, of 1,024 tokens each.
  ratio = packed['train']['activations'] / padded['train']['activations']
  assert ratio == pytest.approx(6 / 32)
  budget = costmodel.memory(model, dataclasses.replace(LONG_TAIL, micro_batch_tokens=2048), layout)
  assert budget['train']['activations'] / padded['train']['activations'] == pytest.approx(2 / 32)
  # Half the minibatch per micro-batch: half the packed rows.
  half = costmodel.memory(model, LONG_TAIL, dataclasses.replace(layout, micro_rows=16))
  assert half['train']['activations'] / padded['train']['activations'] == pytest.approx(3 / 32)


def _span(name, ts, dur_s, **args):
  return {'name': name, 'ph': 'X', 'pid': 0, 'tid': 1, 'ts': ts, 'dur': dur_s * 1e6, 'args': args}


def _synthetic_trace(rl, train_s, forward_s):
  """A trace of three steps whose update and reference spans last `train_s`
  and `forward_s`, with a config carrying `rl`'s fields."""
  events = []
  for i in range(3):
    t = i * 1e7
    events += [
      _span('prefill', t, 0.01 + 0.001 * i, tokens=8 * (i + 1)),
      _span('decode', t + 1e5, 0.04 * (1 + i), steps=4, max_pages=1 + i, active=16),
      _span('reward', t + 2e6, 0.016),
      _span('reference', t + 3e6, forward_s),
      _span('update', t + 4e6, train_s),
    ]
  base = dict(
    prompts_per_step=4, group_size=4, max_prompt_len=8, max_new_tokens=24, epochs=2,
    minibatch_size=8, kl_coef=0.1,
  )  # fmt: skip
  sampler_config = dict(num_slots=16, page_size=8, steps_per_dispatch=4)
  return {
    'traceEvents': events,
    'otherData': {'config': {'rl': {**base, **rl}, 'sampler': sampler_config}},
  }


def test_calibration_counts_the_tokens_the_traced_run_ran():
  lengths = [24, 2, 3, 4, 2, 3, 4, 5, 2, 2, 3, 6, 4, 2, 24, 3]
  seqs = [8 + n for n in lengths]  # seq_len 32; rows of 64 when packed
  packed_cfg = {'packing': True, 'pack_row_len': 64}
  w_packed = costmodel.workload_from_config(
    _synthetic_trace(packed_cfg, 0, 0)['otherData']['config']
  )
  w_padded = costmodel.workload_from_config(_synthetic_trace({}, 0, 0)['otherData']['config'])
  assert (w_packed.packing, w_packed.row_len, w_padded.packing, w_padded.row_len) == (
    True, 64, False, 32,
  )  # fmt: skip
  # Minibatches of 8 sequences, by first-fit-decreasing into rows of 64:
  # [32, 13, 12] [12, 11, 11, 10, 10] and [32, 14, 12] [11, 11, 10, 10, 10]: 4 rows,
  # 256 tokens run against 16 x 32 = 512 padded.
  run = {'packed': costmodel.tokens_run(w_packed, lengths).run, 'padded': 16 * 32}
  assert run['packed'] == 256 and costmodel.tokens_run(w_packed, lengths).real == sum(seqs)
  train_s, forward_s = 2e-6, 1e-6  # per token run, the truth of both traces
  for src, cfg in (('packed', packed_cfg), ('padded', {})):
    trace_dict = _synthetic_trace(cfg, 2 * run[src] * train_s, run[src] * forward_s)
    coeffs = costmodel.calibrate(trace_dict, lengths=lengths)
    assert coeffs.train_token_s == pytest.approx(train_s), src
    assert coeffs.forward_token_s == pytest.approx(forward_s), src
    for dst, w in (('packed', w_packed), ('padded', w_padded)):
      pred = costmodel.predict(tiny(), w, costmodel.Layout(), coeffs, lengths=lengths)
      assert pred['update'] == pytest.approx(2 * run[dst] * train_s), (src, dst)
      assert pred['reference'] == pytest.approx(run[dst] * forward_s), (src, dst)


# Memory against the real objects -------------------------------------------------------

CONFIGS = [
  dict(tie_embeddings=True),
  dict(tie_embeddings=False, qkv_bias=True),
  dict(tie_embeddings=False, qk_norm=True, num_kv_heads=1),
]


def tiny(**overrides):
  fields = dict(
    vocab_size=61, width=32, mlp_width=80, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
  )
  return models.ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize('overrides', CONFIGS)
def test_parameter_and_optimizer_bytes_match_the_real_state(overrides):
  config = tiny(**overrides)
  _, params = models.create(config, jax.random.PRNGKey(0))
  leaves = jax.tree.leaves(params)
  assert config.num_params() == sum(x.size for x in leaves)
  tx, _ = make_optimizer(optim_config())
  opt_bytes = sum(x.nbytes for x in jax.tree.leaves(tx.init(params)) if x.ndim > 0)
  workload = costmodel.Workload(4, 4, 8, 6, 8, param_bytes=4, reference=True)
  for chips in (1, 4):
    mem = costmodel.memory(config, workload, costmodel.Layout(train_chips=chips))
    assert mem['train']['params'] * chips == sum(x.nbytes for x in leaves)
    assert mem['train']['optimizer'] * chips == opt_bytes  # AdamW: two float32 moments
    assert mem['train']['reference'] == mem['train']['params']


@pytest.mark.parametrize('prompt, new, g, slots, page', [(8, 6, 8, 64, 8), (30, 17, 4, 12, 4)])
def test_kv_pool_bytes_match_the_sampler_pool(prompt, new, g, slots, page):
  config = tiny(compute_dtype='bfloat16')
  engine_config = sampler.SamplerConfig(
    num_slots=slots,
    num_pages=sampler.pool_pages(prompt, new, g, page, slots),
    page_size=page,
    max_prompt_len=prompt,
    max_new_tokens=new,
  )
  state = sampler.paged.init_state(config, engine_config)
  pool = sum(x.nbytes for x in state.k_pages + state.v_pages)
  workload = costmodel.Workload(
    4, g, prompt, new, new, num_slots=slots, page_size=page, compute_bytes=2
  )
  assert costmodel.kv_pages(workload) == engine_config.num_pages
  assert costmodel.kv_pool_bytes(config, workload) == pool


def test_simulated_schedule_matches_the_sampler():
  config = tiny()
  graphdef, params = models.create(config, jax.random.PRNGKey(1))
  prompt_len, new, g, b, slots, page, k = 5, 12, 4, 6, 8, 4, 3
  engine_config = sampler.SamplerConfig(
    num_slots=slots,
    num_pages=1 + sampler.pages_needed(prompt_len, new, g, page) * (slots // g),
    page_size=page,
    max_prompt_len=prompt_len,
    max_new_tokens=new,
    max_stop_tokens=2,
  )
  smp = sampler.Sampler(graphdef, config, engine_config, steps_per_dispatch=k)
  requests = [
    sampler.Request(
      prompt=[1 + i, 2, 3, 4, 5], max_new_tokens=new, temperature=1.0, stop_tokens=(7, 9), seed=i
    )
    for i in range(b)
  ]
  groups = smp.generate(params, requests, group_size=g)
  lengths = [len(c.tokens) for grp in groups for c in grp]
  assert len(set(lengths)) > 1  # a spread of lengths, so the schedule is not trivial
  workload = costmodel.Workload(
    b, g, prompt_len, np.mean(lengths), new, num_slots=slots, page_size=page, steps_per_dispatch=k
  )
  prefills, dispatches = costmodel.simulate_generation(workload, lengths)
  assert prefills == smp.stats.prefills == b
  assert len(dispatches) == smp.stats.dispatches
  # The same decode steps, on the same rows.
  assert sum(steps for steps, _, _ in dispatches) == smp.stats.decode_steps
  assert sum(steps * rows for steps, _, rows in dispatches) == smp.stats.decode_rows
  # A long tail (one long sample per group, no stop tokens): the tail's
  # dispatches decode fewer rows than slots, in the simulation as in the sampler.
  tail = [dataclasses.replace(r, max_new_tokens=[new, 2, 3, 2], stop_tokens=()) for r in requests]
  groups = smp.generate(params, tail, group_size=g)
  lengths = [len(c.tokens) for grp in groups for c in grp]
  assert lengths == [new, 2, 3, 2] * b
  prefills, dispatches = costmodel.simulate_generation(workload, lengths)
  assert (prefills, len(dispatches)) == (smp.stats.prefills, smp.stats.dispatches)
  assert sum(steps for steps, _, _ in dispatches) == smp.stats.decode_steps
  assert sum(steps * rows for steps, _, rows in dispatches) == smp.stats.decode_rows
  assert smp.stats.decode_rows < slots * smp.stats.decode_steps


def test_response_lengths_have_the_stated_mean_max_and_clip_fraction():
  w = costmodel.Workload(16, 8, 64, 100.0, 256, response_clip_frac=0.125)
  lengths = np.asarray(w.response_lengths())
  assert lengths.size == 128 and lengths.max() == 256
  assert np.mean(lengths == 256) == pytest.approx(0.125, abs=0.01)
  assert lengths.mean() == pytest.approx(100.0, rel=0.02)


# Round stage costs for the hand-computed compositions of the topologies.
HAND_COEFFS = costmodel.Coefficients(
  decode_fixed_s=0.01,
  decode_compute_s=0.0,
  decode_mem_s=0.0,
  decode_page_s=0.0,
  prefill_fixed_s=0.0,
  prefill_token_s=0.0,
  forward_token_s=1e-4,
  train_token_s=3e-4,
  update_fixed_s=0.0,
  reward_s=0.001,
  reshard_s=0.05,
  host_frac=0.5,
)
HAND_WORKLOAD = costmodel.Workload(
  4, 4, 8, 8, 8, reference=True, steps_per_dispatch=1, num_slots=16
)


def test_topologies_compose_stages_as_documented():
  coeffs, model, w = HAND_COEFFS, tiny(), HAND_WORKLOAD
  colo = costmodel.predict(model, w, costmodel.Layout('colocated'), coeffs)
  gen, rew = colo['generate'], colo['reward']
  assert gen == pytest.approx(7 * 0.01)  # 8 tokens: 7 decode steps, all 16 rows at once
  assert colo['step'] == pytest.approx(gen + rew + colo['reference'] + colo['update'])
  dis = costmodel.predict(model, w, costmodel.Layout('disaggregated', 1, 1), coeffs)
  assert dis['step'] == pytest.approx(colo['step'] + 0.05)
  assert dis['rollout_idle'] == pytest.approx(1 - (gen + rew) / dis['step'])
  off = costmodel.predict(model, w, costmodel.Layout('one_step_off', 1, 1), coeffs)
  train = off['reference'] + off['proximal'] + off['update']
  assert off['step'] == pytest.approx(max(gen + rew, train) + 0.05)
  shared = costmodel.predict(model, w, costmodel.Layout('one_step_off'), coeffs)
  assert shared['step'] == pytest.approx(max(gen + rew, train, 0.5 * gen + train))


def test_async_pipeline_by_hand_and_a_deeper_buffer_absorbs_slow_steps():
  # No spread: k = 0 is the sum of both sides, every k >= 1 the larger one.
  assert costmodel.pipeline_step(2.0, 3.0, 0, 0.0) == pytest.approx(5.0)
  for k in (1, 2, 4):
    assert costmodel.pipeline_step(2.0, 3.0, k, 0.0) == pytest.approx(3.0)
    assert costmodel.pipeline_step(3.0, 2.0, k, 0.0) == pytest.approx(3.0)
  # Balanced sides with a spread: k = 1 waits for every slow rollout, a deeper
  # buffer less and less, never below the sides' means.
  steps = [costmodel.pipeline_step(1.0, 1.0, k, 0.4) for k in (0, 1, 2, 4)]
  assert steps[0] > steps[1] > steps[2] > steps[3] >= 1.0
  assert steps[1] > 1.1


def test_async_layouts_are_one_step_off_without_spread_and_hold_k_weight_copies():
  coeffs, model, w = HAND_COEFFS, tiny(), HAND_WORKLOAD
  layout = lambda kind, k=1: costmodel.Layout(kind, 1, 1, staleness=k)
  off = costmodel.predict(model, w, layout('one_step_off'), coeffs)
  for k in (1, 2, 4):
    assert costmodel.predict(model, w, layout('async', k), coeffs)['step'] == pytest.approx(
      off['step']
    )
  sync = costmodel.predict(model, w, layout('async', 0), coeffs)
  assert sync['step'] == pytest.approx(
    costmodel.predict(model, w, layout('disaggregated'), coeffs)['step']
  )
  # Balanced sides that vary from step to step: k = 4 beats one-step-off.
  spread = dataclasses.replace(w, generation_cv=0.5)
  slow = costmodel.predict(model, spread, layout('one_step_off'), coeffs)['step']
  assert costmodel.predict(model, spread, layout('async', 4), coeffs)['step'] <= slow
  # Memory: the rollout side holds the weights of k versions.
  one = costmodel.memory(model, w, layout('one_step_off'))['rollout']['weights']
  assert costmodel.memory(model, w, layout('async', 4))['rollout']['weights'] == 4 * one
  with pytest.raises(ValueError, match='staleness'):
    costmodel.Layout('async', 1, 1, staleness=-1)


def test_generation_cv_of_a_trace():
  spans = [10.0, 10.0, 1.0, 2.0, 3.0]  # the first two compile
  trace = {'traceEvents': [{'ph': 'X', 'name': 'generate', 'dur': d * 1e6} for d in spans]}
  assert costmodel.generation_cv(trace) == pytest.approx(np.std([1, 2, 3]) / 2)
  assert costmodel.generation_cv({'traceEvents': []}) == 0.0


# The planner -------------------------------------------------------------------------


def test_planner_ranks_feasible_layouts_within_memory():
  hw = costmodel.HARDWARE['h100']
  w = costmodel.Workload(512, 8, 512, 1024, 4096, 0.05, num_slots=256, reward_s=1e-3)
  # Llama-3-8B on one 8-GPU node: some layouts fit, some do not.
  ok, bad = plan.plan(costmodel.model_preset('llama3-8b'), hw, w, 8, top=0)
  assert ok and bad
  steps = [p['times']['step'] for p in ok]
  assert steps == sorted(steps)
  for p in ok:
    assert max(p['memory']['train']['total'], p['memory']['rollout']['total']) <= (
      plan.MEMORY_HEADROOM * hw.mem_bytes
    )
    assert p['layout'].chips == 8
    assert p['slots'] <= 256 and p['micro_rows'] >= 1
  assert all(b['why'].startswith('out of memory') for b in bad)
  assert {p['layout'].topology for p in ok} == {
    'colocated',
    'disaggregated',
    'one_step_off',
    'async',
  }
  assert {p['layout'].staleness for p in ok if p['layout'].topology == 'async'} == {2, 4}
  # More chips: more layouts fit.
  ok64, _ = plan.plan(costmodel.model_preset('llama3-8b'), hw, w, 64, top=0)
  assert len(ok64) > len(ok)


def test_planner_reports_when_nothing_fits(capsys):
  model = costmodel.model_preset('qwen2.5-32b')
  w = costmodel.Workload(64, 8, 512, 512, 1024)
  ok, bad = plan.report(model, costmodel.HARDWARE['tpu-v5e'], w, 1)
  assert not ok and bad
  assert 'no layout fits' in capsys.readouterr().out


def test_planner_names_a_bad_model(tmp_path):
  with pytest.raises(ValueError, match='--model'):
    plan.load_model(str(tmp_path / 'missing'))
  (tmp_path / 'config.json').write_text(
    json.dumps(
      {
        'architectures': ['LlamaForCausalLM'],
        'model_type': 'llama',
        'vocab_size': 100,
        'hidden_size': 64,
        'intermediate_size': 128,
        'num_hidden_layers': 2,
        'num_attention_heads': 4,
        'num_key_value_heads': 2,
      }
    )
  )
  assert plan.load_model(str(tmp_path)).width == 64


def test_roofline_decode_is_memory_bound_for_a_large_model():
  model = costmodel.model_preset('llama3-8b')
  w = costmodel.Workload(64, 8, 512, 512, 1024, num_slots=8, compute_bytes=2)
  c = costmodel.Coefficients.from_hardware(model, costmodel.HARDWARE['h100'], w, costmodel.Layout())
  # Eight slots: reading the 16 GB of weights dominates the step's arithmetic.
  assert c.decode_mem_s > c.decode_compute_s
  assert c.decode_mem_s == pytest.approx(
    model.num_params() * 2 / (costmodel.HARDWARE['h100'].mem_bw * 0.7)
  )


def test_flops_per_token_counts_the_lm_head_and_attention():
  untied, tied = tiny(tie_embeddings=False), tiny(tie_embeddings=True)
  # The embedding lookup is free; the LM head (tied or not) is a matmul.
  assert costmodel.matmul_params(untied) == costmodel.matmul_params(tied)
  q = tied.num_heads * tied.head_dim
  extra = costmodel.flops_per_token(tied, 10) - costmodel.flops_per_token(tied, 0)
  assert extra == 4 * tied.num_layers * q * 10


def test_plan_prints_real_tokens_tokens_run_and_packing_efficiency(capsys):
  argv = ['--model', 'qwen2.5-0.5b', '--hardware', 'h100', '--chips', '1', '--prompts', '16',
          '--prompt_len', '64', '--response_mean', '100', '--response_max', '960', '--slots', '64',
          '--minibatch', '32', '--epochs', '2']  # fmt: skip
  plan.main(argv)
  out = capsys.readouterr().out
  line = 'tokens per pass over a step: 20,990 real, 131,072 run (padded rows of 1024); '
  assert line + 'packing efficiency 16.0%' in out
  plan.main(argv + ['--packing'])
  line = 'tokens per pass over a step: 20,990 real, 24,576 run (packed rows of 1024); '
  assert line + 'packing efficiency 85.4%' in capsys.readouterr().out
  plan.main(argv + ['--packing', '--micro_batch_tokens', '2048'])
  line = 'tokens per pass over a step: 20,990 real, 22,272 run (packed rows of 1024 (or 512, '
  assert line + '256, 128), micro-batches of 2048 tokens per shard); packing efficiency 94.2%' in (
    capsys.readouterr().out
  )
