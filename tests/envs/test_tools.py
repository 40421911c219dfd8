"""`jrl.envs`: the calculator, the call format, the tool environment, and
`run_step`'s containment of environments that raise, hang or return garbage."""

import time

import pytest

from jrl.envs import ArithToolTask, Step, ToolEnv, ToolError, calculator, parse_call, run_step
from jrl.envs.arith import exact_answer, make_env
from jrl.models.tokenizer import load_tokenizer

TOK = load_tokenizer('char')


@pytest.mark.parametrize(
  'expr, want',
  [('47*8+13', '389'), ('2**10', '1024'), ('(3+4)*-2', '-14'), ('7/2', '3.5'), ('8/2', '4'),
   ('17//5', '3'), ('17%5', '2'), (' 1 + 2 ', '3')],
)  # fmt: skip
def test_calculator(expr, want):
  assert calculator(expr) == want


@pytest.mark.parametrize(
  'expr, message',
  [('1/0', 'division by zero'), ('2**100', 'exponent'), ('9' * 13 + '*9', 'too large'),
   ('__import__("os")', 'only numbers'), ('1+', 'not an arithmetic'), ('x', 'only numbers'),
   ('1' * 201, 'longer than')],
)  # fmt: skip
def test_calculator_refuses_with_a_message(expr, message):
  with pytest.raises(ToolError, match=message):
    calculator(expr)


def test_parse_call():
  assert parse_call('let me compute {calc:1+2}') == ('calc', '1+2')
  assert parse_call('{python:print({1: 2})}') == ('python', 'print({1: 2})')
  assert parse_call('{ calc : 3*4}') == ('calc', ' 3*4')
  with pytest.raises(ValueError, match='no call'):
    parse_call('no call here')
  for text in ('abc}', '{calc}', '{1x:2}'):
    with pytest.raises(ValueError, match=r'no \{name:'):
      parse_call(text)


def test_tool_env_answers_counts_and_scores():
  env = make_env(TOK)
  ex = ArithToolTask(0).example(0)
  assert TOK.decode(env.reset(ex)) == ex['prompt']
  (close,) = env.turn_stop_tokens
  assert TOK.decode([close]) == '}'
  step = env.step(TOK.encode('{calc:' + ex['expression'] + '}'))
  assert TOK.decode(step.tokens) == f'[{ex["answer"]}]' and step.info == {'tool_calls': 1}
  bad = env.step(TOK.encode('{calc:1/0}'))
  assert TOK.decode(bad.tokens) == '[error: divisio]' and bad.info['tool_failures'] == 1
  invalid = env.step(TOK.encode('{sql:drop}'))
  assert TOK.decode(invalid.tokens) == '[invalid: no to]' and invalid.info['invalid_calls'] == 1
  assert not any(s.done for s in (step, bad, invalid))
  assert env.final_reward(f'{{calc:x}}[1]{ex["answer"]}') == 1.0
  assert env.final_reward('[1]0') == 0.0
  assert exact_answer('12', {'answer': '12'}) == 1.0


def test_tool_env_refuses_a_multi_token_close_marker():
  from jrl.models.tokenizer import CharTokenizer

  with pytest.raises(ValueError, match='close_char'):
    ToolEnv(CharTokenizer(), close_char='}}')


def test_demonstrations_are_correct_episodes():
  ex = ArithToolTask(3).example(5)
  tool = ArithToolTask.demonstration(ex, use_tool=True)
  assert [by_model for _, by_model in tool] == [True, False, True]
  assert tool[1][0] == f'[{ex["answer"]}]' and tool[2][0] == ex['answer']
  assert ArithToolTask.demonstration(ex, use_tool=False) == [(ex['answer'], True)]


class Scripted:
  """An environment whose step does what the test asks."""

  turn_stop_tokens = (5,)

  def __init__(self, behaviour):
    self.behaviour = behaviour

  def step(self, turn):
    return self.behaviour(turn)


def _raise(turn):
  raise RuntimeError('tool server down')


@pytest.mark.parametrize(
  'behaviour, reason, message',
  [
    (_raise, 'env_error', 'RuntimeError: tool server down'),
    (lambda t: time.sleep(3), 'env_timeout', 'no answer within'),
    (lambda t: 'text', 'env_invalid', 'not Step'),
    (lambda t: Step(['a']), 'env_invalid', 'ints in'),
    (lambda t: Step([999]), 'env_invalid', 'ints in'),
    (lambda t: Step([1] * 9), 'env_invalid', 'more than 8'),
    (lambda t: Step([]), 'env_invalid', 'must return tokens'),
  ],
)
def test_run_step_contains_failures(behaviour, reason, message):
  start = time.perf_counter()
  step, failure, detail = run_step(
    Scripted(behaviour), [1, 2], timeout_s=0.3, vocab_size=100, max_tokens=8
  )
  assert step is None and failure == reason and message in detail
  assert time.perf_counter() - start < 2.0  # a hung step is not waited for


def test_run_step_passes_a_good_step():
  step, failure, _ = run_step(
    Scripted(lambda t: Step([7, 8], reward=0.5)), [1], timeout_s=1, vocab_size=100, max_tokens=8
  )
  assert failure is None and step.tokens == [7, 8] and step.reward == 0.5
  done, failure, _ = run_step(
    Scripted(lambda t: Step([], done=True)), [1], timeout_s=1, vocab_size=100, max_tokens=8
  )
  assert failure is None and done.done


def test_python_tool_runs_in_the_sandbox():
  from jrl.envs.tools import python_tool

  assert python_tool('print(6 * 7)') == '42'
  with pytest.raises(ToolError, match='error'):
    python_tool('raise SystemExit(3)')
  env = ToolEnv(TOK, answer_fn=exact_answer)  # calc and python
  env.reset({'prompt': 'q', 'answer': '8'})
  step = env.step(TOK.encode('{python:print(2**3)}'))
  assert TOK.decode(step.tokens) == '[8]' and step.info == {'tool_calls': 1}


def test_env_pool_answers_without_waiting_and_a_hung_step_ends_only_its_own_episode():
  from jrl.envs import EnvPool

  pool = EnvPool(4)
  limits = dict(timeout_s=0.5, vocab_size=100, max_tokens=8)
  start = time.perf_counter()
  hung = pool.submit(Scripted(lambda t: time.sleep(3)), [1], **limits)
  raising = pool.submit(Scripted(lambda t: 1 / 0), [1], **limits)
  good = [pool.submit(Scripted(lambda t, k=k: Step([k])), [1], **limits) for k in range(6)]
  assert time.perf_counter() - start < 0.2  # submitting never waits for a step
  assert [f.result(timeout=2)[0].tokens for f in good] == [[k] for k in range(6)]
  assert raising.result(timeout=2)[1:] == ('env_error', 'ZeroDivisionError: division by zero')
  assert not hung.done()
  step, reason, message = hung.result(timeout=2)
  assert step is None and reason == 'env_timeout' and '0.5 s' in message
  assert time.perf_counter() - start < 2.0  # the hung step was not waited for
  pool.close()


def test_env_pool_deadline_counts_from_submission_so_queued_steps_cannot_wait_forever():
  from jrl.envs import EnvPool

  pool = EnvPool(1)  # one worker, taken by a hung step
  limits = dict(timeout_s=0.3, vocab_size=100, max_tokens=8)
  pool.submit(Scripted(lambda t: time.sleep(3)), [1], **limits)
  queued = pool.submit(Scripted(lambda t: Step([5])), [1], **limits)
  assert queued.result(timeout=2)[1] == 'env_timeout'
  pool.close()
  with pytest.raises(ValueError, match='at least 1 worker'):
    EnvPool(0)
