"""vLLM behind jrl's engine contract (third_party/vllm): run where vLLM is
installed (docs/vllm.md), with

    pytest -m vllm -n 0 tests/third_party

Skipped where vLLM is not installed; CI (`.ci/run`) runs them after the
suite in an environment of their own, as this does from the checkout's
root:

    python3 -m venv .venv-vllm && . .venv-vllm/bin/activate && \
      pip install -e ".[test,vllm]" && pip uninstall -y torchvision torchaudio torchcodec && \
      pytest -m vllm -n 0 tests/third_party/test_vllm.py

Against jrl's own paged sampler and the trainer's logprobs, on a tiny random
model (head size 32, which vLLM's CPU attention runs) and on SmolLM2-135M:
greedy tokens equal, sampled tokens' logprobs equal the trainer's, a pushed
weight change moves the tokens to the new weights', each per-sample control
is honoured or refused by name, and a GRPO run logs the engines' mismatch.
"""

import os
import types

import jax
import numpy as np
import pytest

import jrl.models as M
from jrl import trainers
from jrl.models import hf
from jrl.sampler import Request, Sampler, SamplerConfig
from jrl.trainers import controller
from tests.helpers import QUIET, records, shrunk_config

vllm = pytest.importorskip('vllm', reason='vLLM is not installed (docs/vllm.md)')
from third_party.vllm import engine as vllm_engine  # noqa: E402

pytestmark = pytest.mark.vllm

CFG = M.ModelConfig(
  vocab_size=96,
  width=64,
  mlp_width=128,
  num_layers=2,
  num_heads=2,
  num_kv_heads=1,
  head_dim=32,
  init_std=0.2,
)
GRAPHDEF, PARAMS_A = M.create(CFG, jax.random.key(3))
MAX_NEW = 12
PROMPTS = [[5, 9, 13, 2, 40, 41, 7], [1, 2, 3], [30, 31, 32, 33, 34, 35, 36, 37, 38], [8, 8, 9]]
_logprobs = jax.jit(M.next_token_logprobs, static_argnums=0)


def jrl_sampler(cfg=CFG, graphdef=GRAPHDEF, max_new=MAX_NEW):
  ecfg = SamplerConfig(
    num_slots=8, num_pages=128, page_size=4, max_prompt_len=16, max_new_tokens=max_new
  )
  return Sampler(graphdef, cfg, ecfg, steps_per_dispatch=4)


def make(tmp_path, model_config=CFG, fields=None):
  config = shrunk_config(
    str(tmp_path),
    {
      'sampler.engine': 'vllm',
      'sampler.vllm.kv_space_gib': 1,
      'task.max_prompt_len': 16,
      'task.max_response_len': MAX_NEW,
      **(fields or {}),
    },
  )
  model = types.SimpleNamespace(config=model_config, hf_config=None)
  return vllm_engine.make_engine(config, model, None, ())


@pytest.fixture(scope='module')
def engine(tmp_path_factory):
  e = make(tmp_path_factory.mktemp('vllm'))
  e.load_weights(PARAMS_A, 0)
  yield e
  e.close()


def greedy_requests(prompts=PROMPTS, **kw):
  return [Request(prompt=p, max_new_tokens=MAX_NEW, greedy=True, **kw) for p in prompts]


def tokens_of(groups):
  return [[c.tokens.tolist() for c in group] for group in groups]


def trainer_logprobs(params, prompt, tokens, graphdef=GRAPHDEF):
  """The trainer's logprob of each of `tokens` after `prompt`."""
  seq = np.asarray([list(prompt) + list(tokens)], np.int32)
  return np.asarray(_logprobs(graphdef, params, seq)[0])[0, len(prompt) :]


def test_greedy_tokens_equal_jrls_sampler(engine):
  want = jrl_sampler().generate(PARAMS_A, greedy_requests())
  got = engine.generate(0, greedy_requests())
  assert tokens_of(got) == tokens_of(want)
  assert all(c.finish_reason == 'length' for g in got for c in g)


def test_sampled_tokens_logprobs_equal_the_trainers(engine):
  requests = [Request(prompt=p, max_new_tokens=MAX_NEW, seed=k) for k, p in enumerate(PROMPTS)]
  groups = engine.generate(0, requests, group_size=3)
  assert [len(g) for g in groups] == [3] * len(PROMPTS)
  for request, group in zip(requests, groups, strict=True):
    assert len({tuple(c.tokens) for c in group}) > 1  # the samples of a group differ
    for c in group:
      np.testing.assert_allclose(
        c.logprobs, trainer_logprobs(PARAMS_A, request.prompt, c.tokens), atol=1e-4
      )


@pytest.mark.parametrize('tied', [False, True])
def test_a_pushed_weight_change_moves_the_tokens_to_the_new_weights(tmp_path, tied):
  """Every weight drawn again, the LM head tied to the embedding or not (a
  tied head is exported untied: vLLM's copy of it would stay stale)."""
  cfg = CFG.replace(tie_embeddings=tied)
  graphdef, params_a = M.create(cfg, jax.random.key(3))
  _, params_b = M.create(cfg, jax.random.key(4))
  engine = make(tmp_path, cfg)
  engine.load_weights(params_a, 0)
  before = tokens_of(engine.generate(0, greedy_requests()))
  assert engine.load_weights(params_b, 1) == 1 and engine.version == 1
  after = tokens_of(engine.generate(1, greedy_requests()))
  assert after != before
  assert after == tokens_of(jrl_sampler(cfg, graphdef).generate(params_b, greedy_requests()))
  requests = [Request(prompt=p, max_new_tokens=MAX_NEW, seed=k) for k, p in enumerate(PROMPTS)]
  for request, (c,) in zip(requests, engine.generate(1, requests), strict=True):
    want = trainer_logprobs(params_b, request.prompt, c.tokens, graphdef)
    np.testing.assert_allclose(c.logprobs, want, atol=1e-4)
  assert engine.stats.weight_pushes == 2
  engine.load_weights(params_b, 1)  # the same version: nothing pushed
  assert engine.stats.weight_pushes == 2
  engine.close()


def test_per_sample_controls_are_honoured(engine):
  prompt = PROMPTS[0]
  (first,) = tokens_of(engine.generate(0, greedy_requests([prompt])))[0]
  # A stop token made likely, held back by min_new_tokens: it ends each sample right after.
  stop = 7
  req = Request(
    prompt=prompt,
    max_new_tokens=MAX_NEW,
    min_new_tokens=[3, 5],
    stop_tokens=(stop,),
    logit_bias={stop: 30.0},
    seed=1,
  )
  (group,) = engine.generate(0, [req], group_size=2)
  assert [len(c.tokens) for c in group] == [4, 6]
  assert all(c.tokens[-1] == stop and c.finish_reason == 'stop' for c in group)
  assert all(stop not in c.tokens[:-1] for c in group)
  # Per-sample budgets.
  (group,) = engine.generate(
    0, [Request(prompt=prompt, max_new_tokens=[2, 7], seed=2)], group_size=2
  )
  assert [len(c.tokens) for c in group] == [2, 7]
  # A banned token is never drawn: greedy takes the next best.
  (banned,) = engine.generate(0, greedy_requests([prompt], banned_tokens=(first[0],)))
  assert banned[0].tokens[0] != first[0]
  # Seeds: the same request gives the same samples; top-k 1 is greedy.
  req = Request(prompt=prompt, max_new_tokens=MAX_NEW, seed=5)
  assert tokens_of(engine.generate(0, [req], group_size=2)) == tokens_of(
    engine.generate(0, [req], group_size=2)
  )
  (top1,) = engine.generate(0, [Request(prompt=prompt, max_new_tokens=MAX_NEW, top_k=1)])
  assert top1[0].tokens.tolist() == first


def test_what_vllm_cannot_do_here_is_refused_by_name(engine, tmp_path):
  with pytest.raises(ValueError, match=r'`Request\.stop_sequences`'):
    engine.generate(0, greedy_requests(stop_sequences=((1, 2),)))
  with pytest.raises(ValueError, match='multi-turn'):
    engine.generate(0, greedy_requests(), on_turn_end=lambda i, g, t: None)
  with pytest.raises(ValueError, match='partial rollouts'):
    engine.generate(0, greedy_requests(), weights_at=lambda d: None)
  with pytest.raises(ValueError, match=r'`model\.head_dim` 8'):
    make(tmp_path, CFG.replace(head_dim=8))
  config = shrunk_config(str(tmp_path), {'sampler.engine': 'vllm'})
  with pytest.raises(ValueError, match='max_forced_tokens'):
    model = types.SimpleNamespace(config=CFG)
    vllm_engine.make_engine(config, model, None, (), max_forced_tokens=4)


def test_grpo_with_the_vllm_engine_logs_the_mismatch_every_step(tmp_path):
  fields = {'sampler.engine': 'vllm', 'sampler.vllm.kv_space_gib': 1, 'model.head_dim': 32}
  config = shrunk_config(tmp_path, {**QUIET, **fields, 'sft.steps': 0, 'rl.steps': 3})
  controller.train(trainers.build(config))
  rl = [r for r in records(tmp_path) if r.get('phase') == 1.0]
  assert [r['step'] for r in rl] == [1, 2, 3]
  for r in rl:
    assert 0.0 <= r['rollout/engine_logp_diff_max'] < 1e-4
    assert r['rollout/engine_logp_diff_over/0.001'] == 0.0
    assert 'reward/mean' in r
  assert os.path.isdir(tmp_path / 'vllm_weights')


@pytest.mark.parametrize(
  'topology',
  [
    {'topology.kind': 'disaggregated', 'topology.rollout_devices': 4},
    {'topology.kind': 'async', 'topology.max_staleness': 2},
  ],
  ids=['disaggregated', 'async'],
)
def test_the_vllm_engine_under_other_topologies(tmp_path, topology):
  """The engine's own process generates for the other topologies too: async
  rollouts in the background thread, corrected for staleness and engine."""
  fields = {'sampler.engine': 'vllm', 'sampler.vllm.kv_space_gib': 1, 'model.head_dim': 32}
  config = shrunk_config(tmp_path, {**QUIET, **fields, **topology, 'sft.steps': 0, 'rl.steps': 4})
  controller.train(trainers.build(config))
  rl = [r for r in records(tmp_path) if r.get('phase') == 1.0]
  assert [r['step'] for r in rl] == [1, 2, 3, 4]
  stale = [r['rollout/staleness'] for r in rl]
  assert stale == ([0.0, 1.0, 2.0, 2.0] if topology['topology.kind'] == 'async' else [0.0] * 4)
  for r in rl:
    if r['rollout/staleness'] == 0.0:  # the same weights: only the engines differ
      assert r['rollout/engine_logp_diff_max'] < 1e-4
    else:  # behaviour logprobs of an older version, weighted
      assert 'rollout/is_clipped_frac' in r and 'rollout/engine_logp_diff_max' not in r


SMOLLM2 = 'models/smollm2'


@pytest.mark.skipif(
  not os.path.isdir(SMOLLM2), reason='python launch/prepare_model.py --out models/smollm2'
)
def test_smollm2_greedy_tokens_and_logprobs_equal_jrls(tmp_path):
  ckpt = hf.load(SMOLLM2)
  config = shrunk_config(
    str(tmp_path),
    {
      'sampler.engine': 'vllm',
      'sampler.vllm.kv_space_gib': 2,
      'task.max_prompt_len': 16,
      'task.max_response_len': 16,
    },
  )
  model = types.SimpleNamespace(config=ckpt.config, hf_config=ckpt.hf_config)
  engine = vllm_engine.make_engine(config, model, None, ())
  engine.load_weights(ckpt.params, 0)
  prompts = [[1, 9690, 198, 2683, 359, 253, 5356], [504, 3258, 282, 4649, 314]]
  requests = [Request(prompt=p, max_new_tokens=16, greedy=True) for p in prompts]
  graphdef = M.create(ckpt.config, jax.random.key(0))[0]
  want = jrl_sampler(ckpt.config, graphdef, 16).generate(ckpt.params, requests)
  got = engine.generate(0, requests)
  assert tokens_of(got) == tokens_of(want)
  sampled = engine.generate(
    0, [Request(prompt=prompts[0], max_new_tokens=16, seed=3)], group_size=2
  )
  for c in sampled[0]:
    seq = np.asarray([prompts[0] + c.tokens.tolist()], np.int32)
    trainer = np.asarray(_logprobs(graphdef, ckpt.params, seq)[0])[0, len(prompts[0]) :]
    np.testing.assert_allclose(c.logprobs, trainer, atol=1e-3)
  engine.close()
