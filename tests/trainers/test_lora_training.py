"""The model's training-memory fields from a config: `model.lora` (adapters
trained, the base frozen), `model.remat` and `model.scan_layers`.

The end-to-end run shrinks the real job (`configs/grpo_arith.py`, STYLE.md
point 15): 1 SFT + 2 RL iterations with rank-4 adapters on the attention
projections, scored by the share of digits in a completion (spread out at
initialisation, so the updates are not zero), exported at the end.
"""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jrl import models, parallel, rewards, trainers
from jrl.models import hf as hf_lib
from jrl.models import lora
from jrl.models.tokenizer import CharTokenizer
from jrl.trainers import common, controller, policy_step, setup
from jrl.trainers.optim import make_optimizer
from tests.helpers import QUIET, assert_trees_equal, optim_config, records, shrunk_config

DIGITS = 'test_lora_digit_share'


def digit_share(prompts, completions, metadata):
  del prompts, metadata
  return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture(scope='module', autouse=True)
def test_reward():
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(rewards.REGISTRY, DIGITS, digit_share)  # removed after the module
    yield


def config_of(workdir, overrides=None):
  return shrunk_config(
    workdir,
    {**QUIET, 'reward.functions': (DIGITS,), 'reward.mode': 'inline', **(overrides or {})},
  )


def trees_differ(a, b):
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return any(bool(np.any(np.asarray(x) != np.asarray(y))) for x, y in pairs)


def host(tree):
  """{path keys: NumPy copy} of a parameter tree (taken before a step donates it)."""
  return {parallel.path_keys(p): np.array(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


# 1. LoRA training ------------------------------------------------------------------


@pytest.fixture(scope='module')
def lora_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('lora')
  config = config_of(
    workdir,
    {
      'model.lora.rank': 4,
      'sft.steps': 1,
      'rl.steps': 2,
      'optim.lr': 1e-2,
      'optim.weight_decay': 0.1,  # decay must not reach the frozen base either
      'checkpoint.every': 1,
      'export_hf': True,
    },
  )
  job = trainers.build(config)
  initial = host(job.state.params)
  state = controller.train(job)
  return config, workdir, job, initial, state


def test_lora_run_trains_the_adapters_and_leaves_the_base_bitwise(lora_run):
  config, workdir, job, initial, state = lora_run
  mc = job.resources.model.config
  assert mc.lora == models.LoraConfig(4, 16.0, ('q_proj', 'k_proj', 'v_proj', 'o_proj'))
  final = host(state.params)
  assert final.keys() == initial.keys()
  adapters = [k for k in final if lora.is_adapter(k)]
  # q, k, v, o of each layer, an A and a B each.
  assert len(adapters) == 2 * 4 * config.model.num_layers
  for k in final:
    if k in adapters:
      assert np.any(final[k] != initial[k]), f'{k} did not train'
    else:
      assert final[k].tobytes() == initial[k].tobytes(), f'{k} of the base changed'
  recs = records(workdir)
  assert [r['step'] for r in recs] == [1, 2, 3]
  for r in recs[config.sft.steps :]:
    assert r['actor/nonfinite'] == 0.0 and r['actor/grad_norm'] > 0


def test_lora_optimizer_state_holds_only_adapter_sized_moments(lora_run):
  config, _, _, _, state = lora_run
  adapters, _ = lora.split(state.params)
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
  # Adam's mu and nu per adapter, nothing for the base (two int32 counters besides).
  assert len(moments) == 2 * len(jax.tree.leaves(adapters))
  assert lora.num_bytes(moments) == 2 * lora.num_bytes(adapters)
  lora_bytes = lora.num_bytes(state.opt_state)
  assert lora_bytes <= 2 * lora.num_bytes(adapters) + 16
  # The same optimiser training every parameter: 2 x (base + adapters).
  full = jax.eval_shape(make_optimizer(config.optim)[0].init, state.params)
  assert lora_bytes < 0.1 * lora.num_bytes(full)


def test_lora_run_resumes_from_its_checkpoint_with_the_adapters(lora_run, tmp_path):
  """Restarted as if killed before its last checkpoint, the job restores the
  one before (adapters, frozen base, adapter-only optimiser state) and
  redoes the last iteration to the same state."""
  config, workdir, _, _, state = lora_run
  resumed_dir = tmp_path / 'resumed'
  shutil.copytree(workdir, resumed_dir)
  shutil.rmtree(resumed_dir / 'checkpoints' / str(config.sft.steps + config.rl.steps))
  with config.unlocked():
    resumed_config = config.copy_and_resolve_references()
  resumed_config.workdir = str(resumed_dir)
  resumed_config.export_hf = False
  resumed = controller.train(trainers.build(resumed_config))
  assert_trees_equal(resumed, state)
  strip = lambda r: {k: v for k, v in r.items() if not k.startswith(('time/', 'throughput/'))}
  assert list(map(strip, records(resumed_dir))) == list(map(strip, records(workdir)))


def test_lora_export_writes_the_merged_weights_and_the_peft_adapters(lora_run):
  _, workdir, job, _, state = lora_run
  mc = job.resources.model.config
  out = os.path.join(str(workdir), 'hf_export')
  with open(os.path.join(out, 'config.json'), encoding='utf-8') as f:
    hf_config = json.load(f)
  assert not [k for k in hf_config if 'lora' in k or k in ('remat', 'scan_layers')]
  # The merged weights are lora.merge's, as a plain model without adapters.
  exported = hf_lib.load(out)
  assert exported.config.lora is None
  want = host(lora.merge(mc, state.params))
  got = host(exported.params)
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=str(k))
  # The adapters alone, in PEFT's layout, read back bit-exactly onto the base.
  adapter_dir = os.path.join(out, setup.ADAPTER_DIR)
  assert sorted(os.listdir(adapter_dir)) == sorted([lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS])
  adapters, base = lora.split(state.params)
  base_graphdef = models.abstract(mc.replace(lora=None))[0]
  loaded_config, _, loaded = lora.load_adapters(adapter_dir, base_graphdef, base)
  assert loaded_config.lora == mc.lora
  assert_trees_equal(lora.split(loaded)[0], adapters)


TINY = models.ModelConfig(
  vocab_size=16, width=16, mlp_width=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8
)


def tiny_lora_policy():
  """(config, graphdef, params) of a tiny policy whose adapters are not zero."""
  graphdef, base = models.create(TINY, jax.random.key(0))
  config, graphdef, params = lora.attach(
    graphdef, base, models.LoraConfig(2, 4.0), jax.random.key(1)
  )
  nudge = lambda p, x: x + 0.1 if parallel.path_keys(p)[-1] == 'lora_b' else x
  return config, graphdef, jax.tree_util.tree_map_with_path(nudge, params)


def test_frozen_base_optimizer_accumulates_and_decays_the_adapters_only():
  _, _, params = tiny_lora_policy()
  optim = optim_config(lr=0.1, grad_accum=2, weight_decay=0.5, clip_norm=1.0)
  tx, _ = make_optimizer(optim, trainable=lora.trainable_mask)
  opt_state = tx.init(params)
  adapters, base = lora.split(params)
  # Adam's two moments and MultiSteps' accumulated gradients: adapter-sized only.
  arrays = [x for x in jax.tree.leaves(opt_state) if x.ndim > 0]
  assert lora.num_bytes(arrays) == 3 * lora.num_bytes(adapters)
  grads = jax.tree.map(jnp.ones_like, params)
  for micro_step in range(2):
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    new_adapters, new_base = lora.split(params)
    assert_trees_equal(new_base, base)  # no update, no weight decay
    assert trees_differ(new_adapters, adapters) == (micro_step == 1)  # one update per 2


def test_a_lora_policys_critic_starts_from_the_merged_weights_without_adapters():
  config, _, params = tiny_lora_policy()
  mesh = parallel.make_mesh()
  critic_graphdef, critic = setup.critic_from_policy(config, params, jax.random.key(2), mesh)
  got, merged = host(critic), host(lora.merge(config, params))
  assert not [k for k in got if lora.is_adapter(k)]
  assert ('score', 'kernel') in got
  for k in got:
    if k[0] != 'score':
      np.testing.assert_array_equal(got[k], merged[k], err_msg=str(k))
  # The critic (its optimiser has no `trainable`) trains every parameter.
  assert critic_graphdef == models.abstract(TINY, lm_head=False, scalar_head=True)[0]


# 2. remat and scan_layers ----------------------------------------------------------


def first_steps(workdir, overrides):
  """(model config, SFT metrics, RL metrics, parameters) after the first SFT
  step of a shrunken job and one GRPO update on a fixed batch (no sampling)."""
  config = config_of(workdir, {'sft.steps': 1, 'sft.warmup_steps': 0, 'rl.steps': 1, **overrides})
  job = trainers.build(config)
  try:
    state, sft_m = job.iterate(job.state, 0)
    sft_m = sft_m.metrics
    state = job.start_rl(state)
    steps = job.steps
    resources, rows = job.resources, config.rl.minibatch_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, resources.tokenizer.vocab_size, (rows, resources.seq_len), np.int32)
    mask = np.arange(resources.seq_len)[None] < rng.integers(8, resources.seq_len, (rows, 1))
    loss_mask = mask & (np.arange(resources.seq_len)[None] >= 4)
    batch = common.place(common.SequenceBatch(tokens, mask, loss_mask), resources.batch_sharding)
    old_logp = steps.logprobs(state.params, batch.tokens, batch.mask)
    advantages = jax.device_put(
      np.where(loss_mask, rng.standard_normal((rows, 1)), 0).astype(np.float32),
      resources.batch_sharding,
    )
    full = policy_step.PolicyBatch(
      batch.tokens, batch.mask, batch.loss_mask, old_logp, jnp.zeros_like(old_logp), advantages
    )
    state, rl_m = steps.rl(state, full)
    rl_m = {k: float(v) for k, v in jax.device_get(rl_m).items()}
    return job.resources.model.config, sft_m, rl_m, host(state.params)
  finally:
    controller.close(job)


def test_remat_full_matches_no_remat_on_the_first_steps(tmp_path):
  """The trainer runs the config's policy (the model-level equivalence of
  every policy, scanned or not, is tests/models/test_remat.py's)."""
  cfg_0, sft_0, rl_0, params_0 = first_steps(tmp_path / 'none', {})
  cfg, sft_m, rl_m, params = first_steps(tmp_path / 'full', {'model.remat': 'full'})
  assert (cfg_0.remat, cfg.remat) == ('none', 'full')
  assert sft_0['sft/grad_norm'] > 0 and rl_0['actor/grad_norm'] > 0
  for key in ('sft/nll', 'sft/grad_norm'):
    assert sft_m[key] == pytest.approx(sft_0[key], rel=1e-5), key
  for key in ('actor/loss', 'actor/pg_loss', 'actor/grad_norm', 'actor/entropy'):
    assert rl_m[key] == pytest.approx(rl_0[key], rel=1e-5, abs=1e-7), key
  for k in params_0:
    np.testing.assert_allclose(params[k], params_0[k], rtol=1e-5, atol=1e-6, err_msg=str(k))


def test_build_model_passes_remat_scan_and_lora_for_a_checkpoint(tmp_path):
  """`model.path` gets `model.remat` / `model.scan_layers` / `model.attention` and the
  adapters too."""
  tok = CharTokenizer()
  cfg = models.ModelConfig(
    vocab_size=tok.vocab_size,
    width=32,
    mlp_width=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
  )
  path = str(tmp_path / 'model')
  hf_lib.save(path, cfg, models.create(cfg, jax.random.key(0))[1])
  config = config_of(
    tmp_path,
    {
      'model.path': path,
      'model.remat': 'dots',
      'model.scan_layers': True,
      'model.attention': 'xla',
      'model.lora.rank': 2,
      'model.lora.alpha': 4.0,
      'model.lora.targets': ('v_proj', 'q_proj', 'down_proj'),
    },
  )
  mesh = setup.meshes(config)[0]
  model, params = setup.build_model(config, tok, mesh)
  mc = model.config
  assert (mc.remat, mc.scan_layers, mc.attention_impl) == ('dots', True, 'xla')
  assert mc.lora == models.LoraConfig(2, 4.0, ('q_proj', 'v_proj', 'down_proj'))
  adapters, base = lora.split(params)
  assert len(jax.tree.leaves(adapters)) == 2 * 3 * 2
  loaded = hf_lib.load(path)
  assert_trees_equal(hf_lib.to_host(base), hf_lib.to_host(loaded.params))
  # Laid out on the mesh, and the forward runs (scanned, rematerialised, adapted).
  assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(adapters))
  tokens = jnp.zeros((8, 6), jnp.int32)
  logp, _ = models.next_token_logprobs(model.graphdef, params, tokens)
  assert np.all(np.isfinite(np.asarray(logp)))


# 3. Bad values ---------------------------------------------------------------------


@pytest.mark.parametrize(
  'overrides, field',
  [
    ({'model.lora.targets': ('nope',)}, 'model.lora.targets'),
    ({'model.lora.targets': ()}, 'model.lora.targets'),
    ({'model.lora.targets': 'q_proj'}, 'model.lora.targets'),
    ({'model.lora.targets': ('q_proj', 'q_proj')}, 'model.lora.targets'),
    ({'model.remat': 'bogus'}, 'model.remat'),
    ({'model.scan_layers': 1}, 'model.scan_layers'),
    ({'model.attention': 'flash'}, 'model.attention'),
    ({'model.attention': 'cudnn'}, 'model.attention'),  # a GPU kernel on this CPU
    ({'model.lora.rank': -1}, 'model.lora.rank'),
    ({'model.lora.alpha': 0.0}, 'model.lora.alpha'),
    ({'model.lora.rank': 4, 'algorithm': 'reward_model'}, 'model.lora.rank'),
  ],
)
def test_bad_memory_fields_are_named(tmp_path, overrides, field):
  config = config_of(tmp_path)
  with config.ignore_type():  # e.g. `model.scan_layers`=1 changes the field's type
    for key, value in overrides.items():
      *parents, name = key.split('.')
      node = config
      for parent in parents:
        node = node[parent]
      node[name] = value
  with pytest.raises(ValueError, match=re.escape(f'`{field}`')):
    trainers.validate(config, 1)
