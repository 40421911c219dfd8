"""The reward service: concurrency, timeouts, contained failures, HTTP."""

import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from jrl import models
from jrl.models.tokenizer import CharTokenizer
from jrl.rewards import RewardService, format_think_answer, make_regex_reward, overlong_penalty
from jrl.rewards import base as rewards_base
from jrl.rewards.model import RewardModel
from jrl.rewards.server import RemoteRewardService, make_server
from tests.rewards import fixtures  # registers the test functions


def _batch(n, **meta):
  return ['p'] * n, [f'c{i}' for i in range(n)], [dict(meta) for _ in range(n)]


def _children():
  """Pids of live processes whose parent is this process."""
  me, out = os.getpid(), []
  for pid in os.listdir('/proc'):
    if not pid.isdigit():
      continue
    try:
      with open(f'/proc/{pid}/stat') as f:
        fields = f.read().rsplit(')', 1)[1].split()
    except OSError:
      continue
    if int(fields[1]) == me and fields[0] != 'Z':
      out.append(int(pid))
  return out


@pytest.fixture(scope='module')
def process_service():
  service = RewardService(
    ['test_const', 'test_length'],
    weights=[1.0, 0.5],
    mode='process',
    workers=2,
    timeout_s=3.0,
    chunk_size=4,
  )
  yield service
  service.close()


def test_weights_chunks_and_per_function_scores(process_service):
  prompts, completions, metadata = _batch(10)
  scored = process_service(prompts, completions, metadata)
  lengths = np.asarray([len(c) for c in completions], np.float32)
  np.testing.assert_array_equal(scored.per_fn['test_const'], np.ones(10))
  np.testing.assert_array_equal(scored.per_fn['test_length'], lengths)
  np.testing.assert_allclose(scored.total, 1.0 + 0.5 * lengths)
  assert scored.failures == {'test_const': 0, 'test_length': 0}
  assert scored.unscored == {'test_const': 0, 'test_length': 0}


@pytest.mark.parametrize('mode', ['process', 'thread', 'inline'])
def test_failures_are_contained_and_counted(mode):
  names = ['test_const', 'test_raise', 'test_nan', 'test_wrong_length']
  with RewardService(
    names, mode=mode, workers=2, timeout_s=5.0, chunk_size=4, unscored_value=-1.0
  ) as service:
    scored = service(*_batch(8))
  assert scored.failures['test_raise'] == 2  # two chunks of 4
  assert scored.failures['test_wrong_length'] == 2
  assert scored.unscored['test_raise'] == 8
  assert scored.unscored['test_nan'] == 2  # the first of each chunk
  assert scored.failures['test_nan'] == 0
  assert any('ZeroDivisionError: verifier bug' in e for e in scored.errors)
  # const 1 + raise (-1) + nan (1 or -1) + wrong length (-1)
  expected = np.asarray([1 - 1 - 1 - 1, 1 - 1 + 1 - 1, 1 - 1 + 1 - 1, 1 - 1 + 1 - 1] * 2)
  np.testing.assert_allclose(scored.total, expected)


def test_process_mode_kills_hung_and_crashed_workers_and_keeps_serving():
  before = set(_children())
  with RewardService(
    ['test_hang', 'test_crash', 'test_const'],
    mode='process',
    workers=2,
    timeout_s=1.0,
    chunk_size=4,
  ) as service:
    start = time.monotonic()
    scored = service(*_batch(8))
    elapsed = time.monotonic() - start
    assert scored.timeouts['test_hang'] == 2
    assert scored.failures['test_crash'] == 2
    assert scored.unscored['test_const'] == 0
    assert elapsed < 10
    assert service._pool.restarts >= 4
    # The replaced workers serve the next call.
    again = service(*_batch(4))
    np.testing.assert_array_equal(again.per_fn['test_const'], np.ones(4))
  # Every worker (and what it started) is gone after close.
  deadline = time.monotonic() + 5
  while set(_children()) - before and time.monotonic() < deadline:
    time.sleep(0.05)
  assert set(_children()) - before == set()


def test_thread_mode_times_out_slow_calls():
  with RewardService(['test_slow'], mode='thread', workers=2, timeout_s=0.5) as service:
    start = time.monotonic()
    scored = service(*_batch(2, sleep=3.0))
    assert time.monotonic() - start < 2.0
  assert scored.timeouts['test_slow'] == 1
  assert scored.unscored['test_slow'] == 2


def test_load_many_concurrent_calls_all_return_with_counts():
  # 24 calls from 6 threads, some slow, some failing, some hanging: every call
  # returns, nothing is lost, and the counts add up. A call's clock starts when
  # it is sent to a worker, which may be a replacement still starting (0.2-0.4 s
  # idle, over 1 s on a loaded CI machine): 3 s leaves room for that.
  service = RewardService(['test_flaky'], mode='process', workers=3, timeout_s=3.0, chunk_size=8)
  modes = ['ok', 'slow', 'raise', 'hang'] * 6
  results = [None] * len(modes)

  def call(i):
    results[i] = service(*_batch(8, mode=modes[i], value=i))

  threads = [
    threading.Thread(target=lambda k=k: [call(i) for i in range(k, 24, 6)]) for k in range(6)
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  service.close()
  assert all(r is not None for r in results)
  for i, (mode, r) in enumerate(zip(modes, results, strict=True)):
    if mode in ('ok', 'slow'):
      np.testing.assert_array_equal(r.per_fn['test_flaky'], np.full(8, i))
    elif mode == 'raise':
      assert r.failures['test_flaky'] == 1 and r.unscored['test_flaky'] == 8
    else:
      assert r.timeouts['test_flaky'] == 1 and r.unscored['test_flaky'] == 8
  assert service.totals['calls'] == 24
  assert service.totals['failures'] == 6
  assert service.totals['timeouts'] == 6


@pytest.mark.parametrize('mode', ['process', 'thread', 'inline'])
def test_a_reward_function_sees_the_time_left_of_its_chunk(mode):
  """`time_left()` counts down from `timeout_s` inside the service (in worker
  processes too) and is None outside it."""
  with RewardService(['test_time_left'], mode=mode, workers=1, timeout_s=20.0) as service:
    scored = service(*_batch(3))
  left = scored.per_fn['test_time_left']
  assert scored.failures['test_time_left'] == 0, scored.errors
  assert np.all((left > 0) & (left <= 20.0)), left
  assert rewards_base.time_left() is None


def test_bad_configuration_is_refused():
  with pytest.raises(ValueError, match='no_such_fn'):
    RewardService(['no_such_fn'], mode='inline')
  with pytest.raises(ValueError, match=r'reward\.mode'):
    RewardService(['test_const'], mode='gpu')
  with pytest.raises(ValueError, match=r'reward\.weights'):
    RewardService(['test_const'], weights=[1.0, 2.0], mode='inline')
  with RewardService(['test_const'], mode='inline') as service:
    with pytest.raises(ValueError, match='metadata'):
      service(['p'], ['c'], [])


def test_http_server_and_client():
  service = RewardService(['test_const', 'test_raise'], mode='thread', workers=2, timeout_s=5)
  server = make_server(service)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  url = f'http://127.0.0.1:{server.server_address[1]}'
  try:
    client = RemoteRewardService(url, timeout_s=10)
    scored = client(*_batch(3))
    np.testing.assert_array_equal(scored.per_fn['test_const'], np.ones(3))
    assert scored.failures['test_raise'] == 1
    assert np.isnan(scored.per_fn['test_raise']).all()
    np.testing.assert_array_equal(scored.total, np.ones(3))
  finally:
    server.shutdown()
    server.server_close()
    service.close()
  # The server is gone: a failure, counted, not raised.
  down = RemoteRewardService(url, timeout_s=2)(*_batch(2))
  assert down.failures == {'remote': 1} and down.unscored == {'remote': 2}


def test_http_client_times_out_on_a_slow_server():
  service = RewardService(['test_slow'], mode='inline')
  server = make_server(service)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    url = f'http://127.0.0.1:{server.server_address[1]}'
    scored = RemoteRewardService(url, timeout_s=0.5)(*_batch(1, sleep=2.0))
    assert scored.timeouts == {'remote': 1}
  finally:
    server.server_close()  # its worker threads too: they would outlive the test
    service.close()


def test_format_and_length_rewards():
  good = '<think>3+4 is 7</think> <answer>7</answer>'
  bad = ['<answer>7</answer>', '<think>x</think>', 'plain 7', '<answer>7</answer><think>x</think>']
  assert format_think_answer([''] * 5, [good, *bad], [{}] * 5) == [1.0, 0.0, 0.0, 0.0, 0.0]
  try:
    fn = make_regex_reward('test_digits_only', r'\d+')
    assert fn([''] * 3, ['123', '12a', ''], [{}] * 3) == [1.0, 0.0, 0.0]
  finally:  # registered by name like a built-in: leave the registry as it was
    rewards_base.REGISTRY.pop('test_digits_only', None)
  # max 10 tokens, buffer 4: no penalty up to 6, then linear to the full penalty at 10.
  np.testing.assert_allclose(
    overlong_penalty([3, 6, 7, 8, 10], 10, 4, penalty=2.0), [0.0, 0.0, 0.5, 1.0, 2.0]
  )
  with pytest.raises(ValueError, match='buffer'):
    overlong_penalty([1], 10, 10)


def test_reward_model_batched_equals_one_by_one_and_runs_inline():
  tok = CharTokenizer()
  config = models.ModelConfig(
    vocab_size=tok.vocab_size,
    width=32,
    mlp_width=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
  )
  graphdef, params = models.create(config, jax.random.PRNGKey(0), lm_head=False, scalar_head=True)
  rm = RewardModel(graphdef, params, tok, max_len=32, batch_size=4, bucket=8)
  prompts = ['1+1='] * 6
  completions = ['2', '3', '22', 'two', 'a much longer completion!', '']
  batched = rm(prompts, completions)
  single = [rm([p], [c])[0] for p, c in zip(prompts, completions, strict=True)]
  np.testing.assert_allclose(batched, single, rtol=1e-5, atol=1e-6)
  # Equal to the model's own scalar head at the last token of prompt + completion.
  ids = tok.encode('1+1=' + '22')
  ref = models.sequence_scores(graphdef, params, np.asarray([ids]), np.ones((1, len(ids)), bool))
  np.testing.assert_allclose(batched[2], float(ref[0]), rtol=1e-5, atol=1e-6)
  assert len(set(np.round(batched, 6))) > 1
  with RewardService(['reward_model'], mode='process', inline_fns={'reward_model': rm}) as svc:
    np.testing.assert_allclose(svc(prompts, completions, [{}] * 6).total, batched, rtol=1e-6)


@pytest.mark.parametrize('mode', ['process', 'thread', 'inline'])
@pytest.mark.parametrize('name', ['test_exit', 'test_interrupt'])
def test_system_exit_and_interrupt_in_a_reward_are_contained(mode, name):
  """`sys.exit()` or KeyboardInterrupt inside a reward function is a failure of
  that function's chunk, never the end of the caller."""
  with RewardService([name, 'test_const'], mode=mode, workers=2, timeout_s=5.0) as service:
    scored = service(*_batch(4))
    assert scored.failures[name] == 1
    assert scored.unscored[name] == 4
    assert any(('SystemExit' in e or 'KeyboardInterrupt' in e) for e in scored.errors)
    np.testing.assert_array_equal(scored.per_fn['test_const'], np.ones(4))
    again = service(*_batch(4))  # and the service keeps serving
    np.testing.assert_array_equal(again.per_fn['test_const'], np.ones(4))


@pytest.mark.parametrize('mode', ['thread', 'inline'])
def test_a_hung_thread_is_replaced_and_starves_nobody(mode):
  """A function that never returns times out once; its thread is abandoned and
  replaced, and every later call is scored as usual."""
  fixtures.RELEASE.clear()
  try:
    with RewardService(['test_block'], mode=mode, workers=1, timeout_s=0.5) as service:
      prompts, completions, _ = _batch(2)
      hung = service(prompts, completions, [{'block': True}] * 2)
      assert hung.timeouts['test_block'] == 1
      assert service.hung_threads == 1
      for _ in range(4):
        ok = service(*_batch(2))
        assert ok.timeouts['test_block'] == 0
        np.testing.assert_array_equal(ok.per_fn['test_block'], np.ones(2))
      assert service.hung_threads == 1
  finally:
    fixtures.RELEASE.set()


_EXIT_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from jrl.rewards import RewardService
from tests.rewards import fixtures
with RewardService(['test_block'], mode={mode!r}, workers=1, timeout_s=0.5) as s:
  r = s([''], ['x'], [{{'block': True}}])
print('timeouts', r.timeouts['test_block'], flush=True)
"""


@pytest.mark.parametrize('mode', ['thread', 'inline'])
def test_a_hung_reward_never_blocks_exit(mode):
  """The process ends normally although a reward thread is still blocked."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run(
    [sys.executable, '-c', _EXIT_SCRIPT.format(root=root, mode=mode)],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert out.returncode == 0, out.stderr
  assert 'timeouts 1' in out.stdout


_USER_MODULE = """
def count_words(prompts, completions, metadata):
  return [float(len(c.split())) for c in completions]

NOT_A_FUNCTION = 3
"""


@pytest.mark.parametrize('mode', ['process', 'thread'])
@pytest.mark.parametrize('path', ['jrl_user_rewards:count_words', 'jrl_user_rewards.count_words'])
def test_reward_functions_by_import_path(tmp_path, monkeypatch, mode, path):
  """A reward function named by import path in config runs without
  registration, in worker processes too (they import it the same way)."""
  (tmp_path / 'jrl_user_rewards.py').write_text(_USER_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv(
    'PYTHONPATH', os.pathsep.join([str(tmp_path), os.environ.get('PYTHONPATH', '')])
  )
  monkeypatch.delitem(rewards_base.REGISTRY, path, raising=False)
  with RewardService([path], mode=mode, workers=1) as service:
    scored = service(['', ''], ['one two three', 'four'], [{}, {}])
  assert scored.failures[path] == 0, scored.errors
  np.testing.assert_array_equal(scored.per_fn[path], [3.0, 1.0])
  rewards_base.REGISTRY.pop(path, None)


@pytest.mark.parametrize(
  'path, cause',
  [
    ('no_such_module_xyz:fn', 'cannot import'),
    ('jrl_user_rewards:missing', 'has no'),
    ('jrl_user_rewards:NOT_A_FUNCTION', 'not a function'),
  ],
)
def test_a_bad_import_path_is_named_at_start_up(tmp_path, monkeypatch, path, cause):
  (tmp_path / 'jrl_user_rewards.py').write_text(_USER_MODULE)
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ValueError, match=cause) as info:
    RewardService([path], mode='thread')
  assert path in str(info.value)
