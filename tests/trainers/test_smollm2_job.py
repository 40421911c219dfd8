"""configs/grpo_smollm2_gsm.py as it is, shrunk, on a tiny random Llama of
SmolLM2's layout: word problems in GSM8K's schema through the chat template,
evaluation before and after (greedy per difficulty, mean@n / pass@n),
sample completions in the log, and an export that transformers loads and
that decodes the same greedy answers as jrl's sampler."""

import json
import os

import numpy as np
import pytest

from configs import grpo_smollm2_gsm
from jrl import trainers
from jrl.data import word_problems
from jrl.models import hf as hf_lib
from jrl.trainers.evaluation import held_out
from tests.helpers import records, set_fields, write_tiny_chat_model


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp('smollm2_job')
  model_dir = str(root / 'model')
  write_tiny_chat_model(model_dir, family='llama')
  word_problems.write_splits(str(root / 'data'), 40, 6, seed=0, weights=(3, 1, 1))
  config = set_fields(
    grpo_smollm2_gsm.get_config(),
    {
      'workdir': str(root / 'run'),
      'model.path': model_dir,
      'task.train_path': str(root / 'data' / 'train.jsonl'),
      'task.eval_path': str(root / 'data' / 'eval.jsonl'),
      'task.system_prompt': 'Answer with a number.',
      'task.max_prompt_len': 200,  # characters here: the longest questions are filtered
      'task.max_response_len': 12,
      'rl.overlong_buffer': 4,
      'rl.steps': 2,
      'rl.prompts_per_step': 2,
      'rl.group_size': 4,
      'rl.minibatch_size': 8,
      'eval.every': 2,
      'sampler.num_slots': 8,
      'log.samples_every': 1,
      'log.plot': False,
      'log.tensorboard': False,
      'optim.lr': 1e-3,
    },
  )
  trainers.run(config)
  return config, root


def test_evaluates_before_and_after_per_difficulty_with_samples(run):
  config, root = run
  recs = records(root / 'run')
  evals = [r for r in recs if 'eval/accuracy' in r]
  assert [r['step'] for r in evals] == [0, 2]
  with open(config.task.eval_path, encoding='utf-8') as f:
    difficulties = {json.loads(line)['difficulty'] for line in f}
  for r in evals:
    for d in difficulties:
      assert 0.0 <= r[f'eval/accuracy/difficulty_{d}'] <= 1.0
    assert set(r) >= {'eval/sampled/mean@2', 'eval/sampled/pass@1', 'eval/sampled/pass@2'}
    assert r['eval/sampled/pass@2'] >= r['eval/sampled/mean@2']
  for r in recs[1:]:
    assert 0.0 <= r['reward/math_answer/mean'] <= 1.0


def test_sample_completions_are_logged(run):
  _, root = run
  with open(os.path.join(root / 'run', 'samples.jsonl'), encoding='utf-8') as f:
    logged = [json.loads(line) for line in f]
  assert {r['step'] for r in logged} == {1, 2}
  assert all('completion' in r and 'reward' in r for r in logged)


def test_export_decodes_the_same_greedy_answers_in_transformers(run):
  import torch
  import transformers

  config, root = run
  export = os.path.join(root / 'run', 'hf_export')
  assert hf_lib.load(export).config.num_layers == 2
  with open(os.path.join(root / 'run', held_out.EXAMPLES_FILE), encoding='utf-8') as f:
    final = [r for r in map(json.loads, f) if r['updates']]
  assert final
  tok = transformers.AutoTokenizer.from_pretrained(export)
  model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
  for row in final:
    messages = [
      {'role': 'system', 'content': config.task.system_prompt},
      {'role': 'user', 'content': row['prompt']},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
      out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=config.task.max_response_len,
        eos_token_id=tok.convert_tokens_to_ids('<|im_end|>'),
        pad_token_id=tok.convert_tokens_to_ids('<|endoftext|>'),
      )
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert text == row['greedy'], row['prompt']
  assert not np.isnan([r['greedy_score'] for r in final]).any()
