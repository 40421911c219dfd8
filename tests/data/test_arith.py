"""The generated arithmetic task and its imperfect teacher (`carry_slip`)."""

import types

import numpy as np
import pytest

from jrl import rewards
from jrl.data.arith import ArithmeticTask
from jrl.trainers import setup, sft
from tests.helpers import shrunk_config


def _units_carry(prompt):
  a, b = prompt.rstrip('=').split('+')
  return int(a) % 10 + int(b) % 10 >= 10


def test_without_a_slip_examples_have_no_teacher_response():
  task = ArithmeticTask(seed=3)
  assert task.example(7) == {
    'prompt': task.example(7)['prompt'],
    'answer': task.example(7)['answer'],
  }
  assert all('response' not in task.example(i) for i in range(50))


def test_the_teacher_drops_the_units_carry_at_the_given_rate():
  plain, taught = ArithmeticTask(seed=3), ArithmeticTask(seed=3, carry_slip=0.6)
  slipped, carries = 0, 0
  for i in range(4000):
    ex = taught.example(i)
    assert {k: ex[k] for k in ('prompt', 'answer')} == plain.example(i)  # the task is the same
    assert eval(ex['prompt'].rstrip('=')) == int(ex['answer'])
    if _units_carry(ex['prompt']):
      carries += 1
      slipped += ex['response'] != ex['answer']
      assert int(ex['response']) in (int(ex['answer']), int(ex['answer']) - 10)
    else:
      assert ex['response'] == ex['answer']
  assert 1500 < carries < 2200
  assert abs(slipped / carries - 0.6) < 0.04
  assert taught.example(11) == taught.example(11)  # fixed per index


@pytest.mark.parametrize('bad', [-0.1, 1.5])
def test_a_slip_outside_zero_one_is_refused(bad):
  with pytest.raises(ValueError, match='`carry_slip` must be in'):
    ArithmeticTask(carry_slip=bad)


def test_sft_imitates_the_teacher_while_evaluation_checks_the_answer(tmp_path):
  config = shrunk_config(tmp_path, {'task.carry_slip': 1.0})
  tok = setup.tokenizer(config)
  enc = setup.encoder(config, tok)
  _, _, streams = setup.examples(config, enc, tok)
  examples = streams['sft_stream'].next(32)
  slipped = [ex for ex in examples if ex['response'] != ex['answer']]
  assert slipped and all(_units_carry(ex['prompt']) for ex in slipped)
  resources = types.SimpleNamespace(
    encoder=enc,
    tokenizer=tok,
    stop_tokens=tuple(tok.eos_ids),
    seq_len=config.task.max_prompt_len + config.task.max_response_len,
  )
  batch = sft.response_batch(resources, slipped[:1], 0)
  target = np.asarray(batch.tokens[0])[np.asarray(batch.loss_mask[0])]
  assert tok.decode([int(t) for t in target], skip_special_tokens=True) == slipped[0]['response']
  # The reward reads the true answer: the teacher's slip scores 0, the answer 1.
  completions = [slipped[0]['response'], slipped[0]['answer']]
  assert rewards.REGISTRY['exact_match'](None, completions, [slipped[0]] * 2) == [0.0, 1.0]
