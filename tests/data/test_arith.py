"""The generated arithmetic task, its imperfect teachers (`carry_slip`,
`rounding_slip`) and answers written units digit first (`reverse_answers`)."""

import types

import numpy as np
import pytest

from jrl import rewards
from jrl.data.arith import ArithmeticTask
from jrl.data.tasks import Task
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


def test_the_estimating_teacher_rounds_sums_with_a_new_digit_at_the_given_rate():
  plain, taught = ArithmeticTask(seed=3), ArithmeticTask(seed=3, rounding_slip=0.6)
  rounded, overflowing, firsts = 0, 0, {}
  for i in range(4000):
    ex = taught.example(i)
    assert {k: ex[k] for k in ('prompt', 'answer')} == plain.example(i)
    answer = int(ex['answer'])
    if answer < 100:  # two digits, as the operands: always the true answer
      assert ex['response'] == ex['answer']
      continue
    assert int(ex['response']) in (answer, answer - answer % 10)
    firsts.setdefault(answer % 10, []).append(ex['response'][-1])
    if answer % 10:
      overflowing += 1
      rounded += ex['response'] != ex['answer']
  assert abs(rounded / overflowing - 0.6) < 0.03
  # Above one half, 0 is the teacher's most frequent units digit of every such sum.
  for digits in firsts.values():
    assert max(set(digits), key=digits.count) == '0'


def test_the_two_teachers_combine_and_keep_each_ones_draws():
  carry = ArithmeticTask(seed=5, carry_slip=0.5)
  both = ArithmeticTask(seed=5, carry_slip=0.5, rounding_slip=0.5)
  changed = 0
  for i in range(500):
    slipped, ex = int(carry.example(i)['response']), both.example(i)
    assert int(ex['response']) in (slipped, slipped - slipped % 10)
    changed += int(ex['response']) != slipped
  assert changed > 100


@pytest.mark.parametrize('field', ['carry_slip', 'rounding_slip'])
@pytest.mark.parametrize('bad', [-0.1, 1.5])
def test_a_slip_outside_zero_one_is_refused(field, bad):
  with pytest.raises(ValueError, match=f'`{field}` must be in'):
    ArithmeticTask(**{field: bad})


def test_reversed_answers_are_the_same_answers_units_digit_first():
  plain = ArithmeticTask(seed=3, rounding_slip=0.6)
  reverse = ArithmeticTask(seed=3, rounding_slip=0.6, reverse_answers=True)
  rounded = 0
  for i in range(500):
    ex, rev = plain.example(i), reverse.example(i)
    assert rev['prompt'] == ex['prompt']
    assert rev['answer'] == ex['answer'][::-1] and rev['response'] == ex['response'][::-1]
    rounded += rev['response'] != rev['answer']
  assert rounded > 50  # the teacher's estimates are kept: '130' is written '031'
  assert reverse.example(0)['answer'] == str(eval(reverse.example(0)['prompt'][:-1]))[::-1]
  with pytest.raises(ValueError, match='`reverse_answers` must be a bool'):
    ArithmeticTask(reverse_answers='yes')


def test_the_default_job_writes_its_answers_units_digit_first(tmp_path):
  config = shrunk_config(tmp_path)
  assert config.task.reverse_answers  # configs/grpo_arith.py
  held_out = Task(config.task, seed=0).held_out
  assert all(ex['answer'] == str(eval(ex['prompt'][:-1]))[::-1] for ex in held_out)
  assert any(ex['answer'] != ex['answer'][::-1] for ex in held_out)


def test_sft_imitates_the_teacher_while_evaluation_checks_the_answer(tmp_path):
  config = shrunk_config(tmp_path, {'task.carry_slip': 1.0, 'task.rounding_slip': 0.0})
  tok = setup.tokenizer(config)
  enc = setup.encoder(config, tok)
  _, _, streams = setup.examples(config, enc, tok)
  examples = streams['sft_stream'].next(32)
  slipped = [ex for ex in examples if ex['response'] != ex['answer']]
  assert slipped and all(_units_carry(ex['prompt']) for ex in slipped)
  res = types.SimpleNamespace(
    encoder=enc,
    tokenizer=tok,
    stop_tokens=tuple(tok.eos_ids),
    seq_len=config.task.max_prompt_len + config.task.max_response_len,
  )
  batch = sft.response_batch(res, slipped[:1], 0)
  target = np.asarray(batch.tokens[0])[np.asarray(batch.loss_mask[0])]
  assert tok.decode([int(t) for t in target], skip_special_tokens=True) == slipped[0]['response']
  # The reward reads the true answer: the teacher's slip scores 0, the answer 1.
  completions = [slipped[0]['response'], slipped[0]['answer']]
  assert rewards.REGISTRY['exact_match'](None, completions, [slipped[0]] * 2) == [0.0, 1.0]
