"""verifiers environments trained by jrl (jrl/envs/verifiers_env.py), with
verifiers 0.4.0 installed. verifiers pins `openai<3` and `mcp==2.0.0`, which
jrl's test extra does not meet, so these run in an environment of their own
(docs/your_own_environment.md, "verifiers"), from the checkout's root:

    python3 -m venv .venv-verifiers && \
      .venv-verifiers/bin/pip install -e ".[verifiers]" pytest pytest-xdist && \
      .venv-verifiers/bin/python -m pytest -m verifiers -n 0 tests/third_party/test_verifiers.py

Skipped where verifiers is not installed (the main suite's environment).

A small deterministic taskset written here (sums, with an exact-answer
reward, a keyed partial-credit reward, and one that reads what the task's
`setup` left on the trace) is played by verifiers' own harnesses, run as
subprocesses, against jrl's OpenAI-compatible endpoint: the rewards jrl
computes on its transcript equal those verifiers computes on its own record
of the same rollout, name by name, and the single-turn reward function's on
the same answers; a bash harness's tool calls go through the endpoint; a
reward that raises, a harness that hangs or dies, a rollout past its time
end only their own episode, the harness's processes killed; and many
episodes in flight through jrl's sampler, one of them failing, score the
others as verifiers does.
"""

import asyncio
import time

import pytest

vf = pytest.importorskip('verifiers.v1', reason='verifiers is not installed ([verifiers] extra)')
from jrl.envs import EnvPool, chat  # noqa: E402
from jrl.envs import verifiers_env as V  # noqa: E402
from jrl.envs.openai_endpoint import AgentEndpoint  # noqa: E402
from jrl.models import tokenizer as T  # noqa: E402
from tests.helpers import train_byte_bpe  # noqa: E402

pytestmark = pytest.mark.verifiers

SYSTEM = 'You answer with a number only.'

# ChatML, without a tools branch: jrl declares tools in the system turn and the
# model calls them as <tool_call>{...}</tool_call> ('text' family).
CHATML = """{% for message in messages %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
CORPUS = [
  SYSTEM,
  'What is 12+30? What is 47*8+13?',
  '<tool_call>{"name": "bash", "arguments": {"command": "echo 389"}}</tool_call>',
  'You are a coding agent. You have access to a bash tool for running shell commands.',
]


@pytest.fixture(scope='module')
def tok():
  bpe = train_byte_bpe(CORPUS, ['<|endoftext|>', '<|im_start|>', '<|im_end|>'], 400)
  return T.HFTokenizer(bpe, chat_template=CHATML, bos=None, eos='<|im_end|>')


@pytest.fixture(scope='module')
def endpoint():
  server = AgentEndpoint().start()
  yield server
  server.close()


# The taskset ---------------------------------------------------------------------------


class SumData(vf.TaskData):
  answer: str
  mode: str = 'ok'  # 'raise': its `exact` reward raises


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
  async def setup(self, trace, runtime):
    trace.info['digits'] = len(self.data.answer)

  @vf.reward
  async def exact(self, task, trace) -> float:
    await asyncio.sleep(0)
    if task.mode == 'raise':
      raise ValueError('a reward bug')
    return float(trace.last_reply == task.answer)

  @vf.reward(weight=0.5)
  async def partial(self, task, trace):
    """Keyed scores: the share of the answer's digits in place, the length right."""
    reply = trace.last_reply
    same = sum(a == b for a, b in zip(reply, task.answer, strict=False))
    return {'digits_right': same / len(task.answer), 'length_right': float(len(reply) == 2)}

  @vf.reward(weight=0.25)
  async def short(self, trace) -> float:
    """What `setup` left on the trace: a reply no longer than the answer."""
    return float(len(trace.last_reply) <= trace.info['digits'])

  @vf.metric
  async def turns(self, trace) -> float:
    return float(len(trace.assistant_messages))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
  def __init__(self, config, sums=((12, 30), (7, 5), (40, 2), (9, 90), (3, 3), (50, 11)), **kw):
    super().__init__(config)
    self.sums, self.kw = sums, kw

  def load(self):
    for a, b in self.sums:
      data = SumData(prompt=f'What is {a}+{b}?', system_prompt=SYSTEM, answer=str(a + b), **self.kw)
      yield SumTask(data, self.config.task)


class Endless(SumTaskset):
  INFINITE = True

  def load(self):
    k = 0
    while True:
      yield SumTask(SumData(prompt=f'What is {k}+1?', answer=str(k + 1)), self.config.task)
      k += 1


TASKSET = SumTaskset(vf.TasksetConfig())
TRAIN, HELD_OUT = V.task_rows(TASKSET, held_out=2)


def expected(reply, answer, digits):
  """The taskset's reward, by hand."""
  same = sum(a == b for a, b in zip(reply, answer, strict=False))
  partial = 0.5 * (same / len(answer) + float(len(reply) == 2))
  return float(reply == answer) + partial + 0.25 * float(len(reply) <= digits)


def _turn(tok, conv, text):
  """The tokens a model that follows the template samples for `text`."""
  return tok.encode(conv.turn_prefix + text) + [conv.end_id]


def _bash_env(tok, endpoint, **kw):
  """An episode played by verifiers' bash harness: a chat loop with a `bash` tool."""
  harness = {'id': 'bash', 'edit': False, 'compaction': None}
  return V.VerifiersEnv(tok, endpoint, TASKSET, harness=harness, host_code=True, **kw)


# Rows ----------------------------------------------------------------------------------


def test_rows_are_the_tasks_and_the_held_out_ones_are_kept_apart():
  assert len(TRAIN) == 4 and len(HELD_OUT) == 2
  tasks = list(TASKSET)
  for row, task in zip(HELD_OUT + TRAIN, tasks, strict=True):
    assert row['prompt'] == [
      {'role': 'system', 'content': SYSTEM},
      {'role': 'user', 'content': task.data.prompt},
    ]
    assert row['answer'] == task.data.answer
    again = V.task_of(TASKSET, row)
    assert type(again) is SumTask and again.key == task.key and again.data == task.data
  assert {r['answer'] for r in HELD_OUT} == {'42', '12'}
  train, held_out = V.task_rows(Endless(vf.TasksetConfig()), train=3, held_out=1)
  assert [r['answer'] for r in held_out] == ['1']
  assert [r['answer'] for r in train] == ['2', '3', '4']
  with pytest.raises(ValueError, match='yields tasks forever: give `train`'):
    V.task_rows(Endless(vf.TasksetConfig()), held_out=1)
  with pytest.raises(ValueError, match='too few for 6 held-out'):
    V.task_rows(TASKSET, held_out=6)
  twice = SumTaskset(vf.TasksetConfig(), sums=((1, 2), (1, 2)))
  with pytest.raises(ValueError, match='appear in training too'):
    V.task_rows(twice, held_out=1)
  no_prompt = SumTask(SumData(answer='1'))
  with pytest.raises(ValueError, match='has no prompt'):
    V.task_row(no_prompt)
  with pytest.raises(ValueError, match='no `verifiers` field'):
    V.task_of(TASKSET, {'prompt': 'x', 'answer': '1'})


# Rewards -------------------------------------------------------------------------------


@pytest.mark.parametrize('reply', ['42', '24', '4', '420'])
def test_rewards_through_the_endpoint_equal_verifiers_own(tok, endpoint, reply):
  row = TRAIN[0]  # 12+30
  env = V.VerifiersEnv(tok, endpoint, TASKSET, check_rewards=True, turn_timeout_s=60)
  ids = env.reset(row)
  assert ids == chat.Conversation(tok, row['prompt']).prompt_ids()  # the harness's own prompt
  step = env.step(_turn(tok, env.conversation, reply))
  env.finish('done', [])
  want = expected(reply, '42', 2)
  assert step.done and step.reward == pytest.approx(want)
  jrl_scores, theirs = env.rewards['jrl'], env.rewards['verifiers']
  assert jrl_scores == theirs  # name by name, computed by verifiers on its own record
  assert set(theirs) == {'exact', 'digits_right', 'length_right', 'short'}
  assert env.verifiers_trace.last_reply == reply and env.verifiers_trace.ok
  assert env.verifiers_trace.metrics == env.transcript.metrics == {'turns': 1.0}
  # The single-turn reward function, on the same answer without a harness.
  score = V.reward_fn(TASKSET)
  assert score([None], [reply], [row]) == [pytest.approx(want)]


def test_the_single_turn_reward_function_scores_a_batch_and_leaves_failures_unscored():
  score = V.reward_fn(TASKSET, timeout_s=5)
  rows = TRAIN[:3]
  replies = ['42', '12', '4']
  got = score([None] * 3, replies, rows)
  answers = [row['answer'] for row in rows]
  want = [expected(r, a, len(a)) for r, a in zip(replies, answers, strict=True)]
  assert got == pytest.approx(want)
  broken = SumTaskset(vf.TasksetConfig(), mode='raise')
  rows = V.task_rows(broken)[0][:2]
  assert V.reward_fn(broken)([None, None], ['42', '1'], rows) == [None, None]

  class NeedsBox(SumTask):
    @vf.reward
    async def file(self, trace, runtime) -> float:
      return 1.0

  class BoxTaskset(vf.Taskset[NeedsBox, vf.TasksetConfig]):
    def load(self):
      yield NeedsBox(SumData(prompt='What is 1+1?', answer='2'), self.config.task)

  boxed = BoxTaskset(vf.TasksetConfig())
  (row,), _ = V.task_rows(boxed)
  with pytest.raises(ValueError, match=r"rewards \['file'\] need a runtime"):
    V.reward_fn(boxed)([None], ['2'], [row])


score = V.reward_fn(TASKSET, timeout_s=10)  # `reward.functions` of the test below


def test_the_reward_service_runs_the_single_turn_function_in_its_worker_processes():
  """Named by import path, as a config names it, in `reward.mode='process'`."""
  from jrl import rewards

  service = rewards.RewardService([f'{__name__}:score'], mode='process', workers=1)
  try:
    rows = TRAIN + [{**TRAIN[0], 'verifiers': {**TRAIN[0]['verifiers'], 'mode': 'raise'}}]
    replies = ['42', '98', '6', '7', '42']
    scored = service([''] * 5, replies, rows)
  finally:
    service.close()
  answers = [row['answer'] for row in TRAIN]
  want = [expected(r, a, len(a)) for r, a in zip(replies, answers, strict=False)]
  assert scored.total[:4].tolist() == pytest.approx(want)
  assert scored.unscored == {f'{__name__}:score': 1}  # the row whose reward raised


def test_a_bash_harness_calls_its_tool_through_the_endpoint(tok, endpoint):
  with pytest.raises(ValueError, match=r"'bash' runs the model's commands.*host_code=True"):
    V.VerifiersEnv(tok, endpoint, TASKSET, harness='bash')
  env = _bash_env(tok, endpoint, check_rewards=True)
  env.reset(TRAIN[0])
  assert list(env.conversation.tools) == ['bash']  # declared by the harness's request
  call = chat.call_text('text', 'bash', {'command': 'echo $((12+30))'})
  step = env.step(_turn(tok, env.conversation, call))
  assert not step.done
  assert '42' in tok.decode(step.tokens)  # the tool's output, rendered by the template
  step = env.step(_turn(tok, env.conversation, '42'))
  env.finish('done', [])
  assert step.done and step.reward == pytest.approx(expected('42', '42', 2))
  assert env.rewards['jrl'] == env.rewards['verifiers']
  trace = env.verifiers_trace
  assert [m.role for m in trace.messages] == ['system', 'user', 'assistant', 'tool', 'assistant']
  assert [m.role for m in env.transcript.messages] == [m.role for m in trace.messages]
  assert env.transcript.metrics == trace.metrics == {'turns': 2.0}


# Failures ------------------------------------------------------------------------------


def _gone(pid, within_s=10.0):
  """Whether process `pid` has exited within `within_s` (a zombie waiting for
  its reaper counts: it runs nothing)."""
  deadline = time.monotonic() + within_s
  while time.monotonic() < deadline:
    try:
      with open(f'/proc/{pid}/stat') as f:
        state = f.read().rpartition(')')[2].split()[0]
    except FileNotFoundError:
      return True
    if state in ('Z', 'X'):
      return True
    time.sleep(0.1)
  return False


@pytest.mark.parametrize('kind', ['hangs', 'times_out', 'dies'])
def test_a_harness_that_hangs_dies_or_runs_too_long_ends_only_its_episode(
  tok, endpoint, tmp_path, kind
):
  pid_file = tmp_path / 'pid'
  commands = {
    'hangs': f'echo $$ > {pid_file}; sleep 600',
    'times_out': f'echo $$ > {pid_file}; sleep 600',
    'dies': f'echo $PPID > {pid_file}; kill -9 $PPID',
  }
  limits = {'hangs': dict(turn_timeout_s=3), 'times_out': dict(rollout_timeout_s=8)}
  bad = _bash_env(tok, endpoint, **limits.get(kind, {}))
  good = V.VerifiersEnv(tok, endpoint, TASKSET, check_rewards=True)
  bad.reset(TRAIN[0])
  good.reset(TRAIN[1])
  call = chat.call_text('text', 'bash', {'command': commands[kind]})
  why = {
    'hangs': 'sent no request and did not return in 3.0 s',
    'times_out': 'verifiers rollout stopped: agent_timeout',
    'dies': r'verifiers rollout failed: HarnessError: .*exited -9',
  }[kind]
  with pytest.raises(RuntimeError, match=why):
    bad.step(_turn(tok, bad.conversation, call))
  bad.finish('env_error', [])
  assert _gone(int(pid_file.read_text()))  # the harness's processes are killed
  step = good.step(_turn(tok, good.conversation, '99'))  # the other episode goes on
  good.finish('done', [])
  assert step.done and step.reward == pytest.approx(expected('99', '99', 2))


def test_a_reward_that_raises_ends_only_its_episode(tok, endpoint):
  broken = SumTaskset(vf.TasksetConfig(), mode='raise')
  bad = V.VerifiersEnv(tok, endpoint, broken)
  good = V.VerifiersEnv(tok, endpoint, TASKSET)
  bad.reset(V.task_rows(broken)[0][0])
  good.reset(TRAIN[0])
  with pytest.raises(RuntimeError, match='a reward bug'):
    bad.step(_turn(tok, bad.conversation, '42'))
  bad.finish('env_error', [])
  step = good.step(_turn(tok, good.conversation, '42'))
  good.finish('done', [])
  assert step.reward == pytest.approx(expected('42', '42', 2))


# Through the sampler -------------------------------------------------------------------


def _episodes(tok, envs, rows):
  """The episodes of a tiny random model, one per (env, row), their steps in
  an EnvPool with parked samples: {finish reason, reward} per episode."""
  import jax

  from jrl import models, sampler

  end = chat.turn_end(tok)[1]
  config = models.ModelConfig(
    vocab_size=tok.vocab_size,
    width=32,
    mlp_width=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    init_std=0.1,
  )
  graphdef, params = models.create(config, jax.random.key(0))
  prompts = [env.reset(row) for env, row in zip(envs, rows, strict=True)]
  engine = sampler.SamplerConfig(
    num_slots=4,
    num_pages=160,
    page_size=8,
    max_prompt_len=64,
    max_new_tokens=32,
    max_forced_tokens=24,
  )
  smp = sampler.Sampler(graphdef, config, engine, steps_per_dispatch=4)
  specials = [ids[0] for ids in map(tok.encode, chat.special_texts(tok)) if len(ids) == 1]
  requests = [
    sampler.Request(
      prompt=p,
      max_new_tokens=32,
      stop_tokens=(end,),
      seed=i,
      logit_bias={end: 4.0},
      banned_tokens=tuple(t for t in specials if t != end),
    )
    for i, p in enumerate(prompts)
  ]
  pool, out = EnvPool(8), [{} for _ in envs]

  def settle(outcome, i):
    step, failure, message = outcome
    if failure:
      out[i].update(reason=failure, error=message)
      return failure
    assert step.done  # the null harness plays one turn
    out[i].update(reason='done', reward=step.reward)
    return 'done'

  def on_turn_end(i, g, tokens, logprobs):
    limits = dict(timeout_s=60, vocab_size=tok.vocab_size, max_tokens=24)
    future = pool.submit(envs[i], list(map(int, tokens)), logprobs=logprobs, **limits)
    return EnvPool.then(future, lambda o: settle(o, i))

  groups = smp.generate(params, requests, group_size=1, on_turn_end=on_turn_end)
  pool.close()
  for i, ((c,), env) in enumerate(zip(groups, envs, strict=True)):
    out[i].setdefault('reason', c.finish_reason)
    out[i]['text'] = tok.decode([int(t) for t in c.tokens])
    env.finish(out[i]['reason'], [])
  return out, smp.stats


def test_episodes_in_flight_through_the_sampler_score_as_verifiers_does(tok, endpoint):
  broken = SumTaskset(vf.TasksetConfig(), mode='raise')
  rows = TRAIN + [V.task_rows(broken)[0][0]]
  envs = [V.VerifiersEnv(tok, endpoint, TASKSET, check_rewards=True) for _ in TRAIN]
  envs.append(V.VerifiersEnv(tok, endpoint, broken, check_rewards=True))
  out, stats = _episodes(tok, envs, rows)
  assert stats.env_parked_peak >= 2  # rollouts waited at once while others decoded
  assert out[-1]['reason'] == 'env_error' and 'a reward bug' in out[-1]['error']
  for got, env in zip(out[:-1], envs[:-1], strict=True):
    assert got['reason'] == 'done', got
    assert env.rewards['jrl'] == env.rewards['verifiers']
    reply = env.verifiers_trace.last_reply
    answer = env.transcript.task.data.answer
    assert got['reward'] == pytest.approx(expected(reply, answer, len(answer)))
    # The model's turn, in both records, is the text the sampler drew for it.
    (turn,) = env.transcript.assistant_messages
    assert turn.content and turn.content in got['text']
    assert env.verifiers_trace.assistant_messages[0].content == turn.content
  assert len({got['text'] for got in out[:-1]}) == len(out) - 1


# Trained by jrl ------------------------------------------------------------------------


def rows(task_config):
  """`task.kind` of the run below: the taskset's rows, two held out."""
  del task_config
  return V.task_rows(TASKSET, held_out=2)


MADE = []  # the environments the run below made, in order


def make_env(tokenizer):
  """`agent.env` of the run below (`env_factory`), keeping what it makes."""
  env = _FACTORY(tokenizer)
  MADE.append(env)
  return env


_FACTORY = V.env_factory(TASKSET, check_rewards=True)


def _write_chat_model(path):
  """A byte-BPE tokenizer with ChatML and a random 2-layer model, in Hugging
  Face's layout, written with jrl's own code (this environment has no torch)."""
  import json

  import jax

  from jrl import models
  from jrl.models import hf

  bpe = train_byte_bpe(CORPUS, ['<|endoftext|>', '<|im_start|>', '<|im_end|>'], 400)
  path.mkdir()
  bpe.save(str(path / 'tokenizer.json'))
  settings = {'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>', 'chat_template': CHATML}
  (path / 'tokenizer_config.json').write_text(json.dumps(settings))
  config = models.ModelConfig(
    vocab_size=bpe.get_vocab_size(),
    width=32,
    mlp_width=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_positions=512,
    init_std=0.1,
  )
  _, params = models.create(config, jax.random.key(0))
  # A model that ends its turns: every token's embedding carries a constant
  # feature that only the end token's logit reads (about 1 in 6 per token).
  end = bpe.token_to_id('<|im_end|>')
  embedding, head = params['embed']['embedding'], params['lm_head']['kernel']
  embedding[...] = embedding[...].at[:, 0].set(3.0)
  head[...] = head[...].at[0, :].set(0.0).at[0, end].set(0.8)
  hf.save(str(path), config, params)


def test_a_run_trains_on_the_taskset_and_scores_as_verifiers_does(tmp_path):
  """`algorithm='agent'` with `task.kind` and `agent.env` naming this module:
  one GRPO step on episodes played by verifiers' harness through the
  endpoint: every episode that ended at the harness's exit is scored as
  verifiers scores it (or it would end 'env_error'), the others were cut by
  the token budget, and the step's mean reward is theirs."""
  from configs import agent_arith
  from jrl import trainers
  from jrl.trainers import controller
  from tests.helpers import records, set_fields

  _write_chat_model(tmp_path / 'model')
  config = set_fields(
    agent_arith.get_config(),
    {
      'workdir': str(tmp_path / 'run'),
      'model.path': str(tmp_path / 'model'),
      'tokenizer': '',  # the checkpoint's, with its chat template
      'task.kind': f'{__name__}:rows',
      'agent.env': f'{__name__}:make_env',
      'agent.step_timeout_s': 60.0,
      'task.max_prompt_len': 64,
      'task.max_response_len': 24,
      'task.eval_size': 2,
      'sft.steps': 0,
      'rl.steps': 1,
      'rl.prompts_per_step': 4,
      'rl.group_size': 2,
      'rl.minibatch_size': 8,  # the 8 fake devices' batch axes
      'sampler.num_slots': 8,
      'eval.every': 0,
      'log.plot': False,
      'log.tensorboard': False,
    },
  )
  job = trainers.build(config)
  try:
    controller.train(job)
  finally:
    controller.close(job)
  (step,) = [r for r in records(config.workdir) if 'env/finish/done' in r]
  assert step['samples/unscored'] == 0 and step['env/finish/env_error'] == 0, step
  assert step['env/finish/done'] > 0 and step['env/finish/done'] + step['env/finish/length'] == 1
  scored = [env for env in MADE if env.rewards]  # those whose harness saw the episode's end
  assert len(scored) == 8 * step['env/finish/done']
  for env in scored:
    assert env.rewards['jrl'] == env.rewards['verifiers']
    answer = env.transcript.task.data.answer
    reply = env.verifiers_trace.last_reply
    assert sum(env.rewards['jrl'].values()) == pytest.approx(expected(reply, answer, len(answer)))
  total = sum(sum(env.rewards['jrl'].values()) for env in scored)
  assert step['reward/mean'] == pytest.approx(total / 8)  # an episode cut by its length: 0
