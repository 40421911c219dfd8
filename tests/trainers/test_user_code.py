"""Data sources (`task.kind`), environments (`agent.env`) and rollout engines
(`sampler.engine`) named by import path, from `tests/user_code.py`: they
train, every row is checked as a prompt file's rows are, the engine is the
one that generates, and a bad path or a wrong shape names the field."""

import json
import sys

import pytest

from jrl import trainers
from jrl.data import tasks
from jrl.envs import run_step
from jrl.models.tokenizer import CharTokenizer
from jrl.trainers import controller
from jrl.trainers.rollouts import contracts, episodes
from tests import user_code
from tests.helpers import QUIET, records, shrunk_config
from tests.trainers.test_agent import agent_config

# Data sources ---------------------------------------------------------------------


ENGINE = {'sampler.engine': 'tests.user_code:make_engine'}


def test_grpo_trains_on_a_data_source_and_an_engine_given_by_import_path(tmp_path):
  user_code.ENGINES.clear()
  config = shrunk_config(
    tmp_path,
    {**QUIET, **ENGINE, 'task.kind': 'tests.user_code:make_rows', 'sft.steps': 0, 'rl.steps': 2},
  )
  job = trainers.build(config)
  (engine,) = user_code.ENGINES  # the rollout worker's, its held-out evaluation's too
  assert isinstance(engine, contracts.Engine)
  train, held_out = user_code.make_rows(config.task)
  # Rows as a prompt file's: answers become strings, other fields are kept.
  assert job.resources.task.train == [{**row, 'answer': str(row['answer'])} for row in train]
  assert len(job.resources.task.held_out) == config.task.eval_size == len(held_out)
  drawn = job.resources.streams['rl_stream'].next(4)
  assert all(row['source'] == 'sums' for row in drawn)
  controller.train(job)
  assert [r['step'] for r in records(tmp_path) if r.get('phase') == 1.0] == [1, 2]
  # Each RL step's batch came from the engine, G samples per prompt.
  assert engine.calls == 2 * [(config.rl.prompts_per_step, config.rl.group_size)]
  assert engine.stats.generated_tokens > 0
  # Colocated: each policy version loaded before it generates; the engine
  # released around each update and resumed after it.
  step = ['generate', 'release', 'resume']
  assert engine.events == [('load', 0), *step, ('load', 1), *step]
  engine.release()
  with pytest.raises(RuntimeError, match='released for an update'):
    engine.inner.generate(None, [])
  engine.resume()


def test_one_step_off_generates_through_the_update_with_the_older_version(tmp_path):
  """The next rollout generates while the update runs: never released, and
  iteration 1's batch comes from version 0 (the parameters before update 1)."""
  user_code.ENGINES.clear()
  fields = {'topology.kind': 'one_step_off', 'topology.staleness': 1}
  config = shrunk_config(tmp_path, {**QUIET, **ENGINE, **fields, 'sft.steps': 0, 'rl.steps': 2})
  controller.train(trainers.build(config))
  (engine,) = user_code.ENGINES
  assert engine.events == [('load', 0), 'generate', ('load', 0), 'generate']


@pytest.mark.parametrize(
  ('engine', 'match'),
  [
    ('sglang', r"`sampler\.engine`.* must be 'jrl' .* one of \('vllm',\) or an import path"),
    ('tests.user_code:no_such_engine', r"`sampler\.engine` '.*': .* has no 'no_such_engine'"),
    ('tests.user_code:make_not_an_engine', r"`sampler\.engine` '.*' made a dict, which is no"),
  ],
)
def test_bad_engine_names_the_field(tmp_path, engine, match):
  config = shrunk_config(tmp_path, {**QUIET, 'sampler.engine': engine, 'sft.steps': 0})
  with pytest.raises(ValueError, match=match):
    trainers.build(config)


def test_the_vllm_engine_without_vllm_names_the_field_and_the_install(tmp_path, monkeypatch):
  """`sampler.engine='vllm'` loads third_party/vllm's factory; without vLLM
  installed it says how to install it."""
  monkeypatch.setitem(sys.modules, 'vllm', None)  # installed or not: an ImportError
  config = shrunk_config(tmp_path, {**QUIET, 'sampler.engine': 'vllm', 'sft.steps': 0})
  with pytest.raises(ValueError, match=r"'vllm': vLLM is not installed.*\[vllm\]"):
    trainers.build(config)


M = 'tests.user_code:'
BAD_SOURCES = {  # id: (task.kind, what the error says after "`task.kind` ")
  'module': ('tests.no_such_module:make_rows', r"'tests\.no_such_module:make_rows': cannot import"),
  'attribute': (M + 'no_such_function', r"'tests\.user_code:no_such_function': .* has no"),
  'not_callable': (M + 'NOT_A_FUNCTION', r"'.*': a int is not a function"),
  'return_type': (
    M + 'make_rows_dict',
    r'.* must return \(train rows, held-out rows\), got a dict',
  ),
  'row_type': (M + 'make_rows_not_dicts', r'.* train row 0: must be a dict'),
  'too_long': (M + 'make_rows_long_prompt', r'.* train row 5: field `prompt` is 62 tokens'),
  'character': (M + 'make_rows_bad_character', r".* held-out row 2: field `prompt`: character '€'"),
  'name': ('sums', r"must be 'arith', .* or an import path"),
}


@pytest.mark.parametrize(('kind', 'match'), BAD_SOURCES.values(), ids=BAD_SOURCES)
def test_bad_data_source_names_the_field_and_row(tmp_path, kind, match):
  config = shrunk_config(tmp_path, {**QUIET, 'task.kind': kind, 'sft.steps': 0})
  with pytest.raises(ValueError, match=r'`task\.kind` ' + match):
    trainers.build(config)


def test_data_source_long_prompts_are_filtered_when_asked(tmp_path, capsys):
  config = shrunk_config(tmp_path, {'task.kind': 'tests.user_code:make_rows_long_prompt'})
  config.task.long_prompts = 'filter'
  tok = CharTokenizer()
  checker = tasks.ExampleChecker(tok.encode, tok.encode, max_prompt_len=8, seq_len=16)
  task = tasks.Task(config.task, config.seed, checker.prompt)
  assert task.filtered == {'train': 1, 'eval': 0}
  assert len(task.train) == 63
  assert 'train row 5' in capsys.readouterr().out


# Environments ---------------------------------------------------------------------


def test_environment_given_by_import_path_takes_turns():
  tok = CharTokenizer()
  for name in ('tests.user_code:ShopEnv', 'tests.user_code:make_shop_env'):
    spec = episodes.environment(name)
    env = episodes.new_env(spec, tok, name)
    example = {'prompt': '3 pear=', 'answer': '21', 'item': 'pear'}
    assert env.reset(example) == tok.encode('3 pear=')
    assert env.turn_stop_tokens == tuple(tok.encode('}'))

    def turn(text, env=env):
      ids = tok.encode(text)
      step, failure, _ = run_step(env, ids, timeout_s=5, vocab_size=tok.vocab_size, max_tokens=16)
      assert failure is None
      return tok.decode(step.tokens), step.info

    assert turn('{price:pear}') == ('[7]', {'tool_calls': 1})
    assert turn('{price:kiwi}') == ('[unknown item]', {'tool_calls': 1, 'tool_failures': 1})
    assert turn('{cost:pear}') == ('[no such tool]', {'invalid_calls': 1})
    assert env.final_reward('{price:pear}[7]21') == 1.0
    assert env.final_reward('{price:pear}[7]20') == 0.0
  assert episodes.environment('tests.user_code:ShopEnv').demonstration is not None
  assert episodes.environment('tests.user_code:make_shop_env').demonstration is None


BAD_ENVIRONMENTS = {  # id: (agent.env, overrides, what the error says after "`agent.env` ")
  'module': ('tests.no_such_module:Env', {}, r"'tests\.no_such_module:Env': cannot import"),
  'attribute': (M + 'NoSuchEnv', {}, r"'tests\.user_code:NoSuchEnv': .* has no"),
  'not_callable': (M + 'PRICES', {}, r"'.*': a dict is not an environment factory"),
  'signature': (M + 'make_env_without_tokenizer', {}, r'.* factory\(tokenizer\)'),
  'no_demonstration': (M + 'make_shop_env', {'sft.steps': 2}, r'.* has no `demonstration'),
  'not_an_environment': (M + 'NoStep', {}, r'.* made a NoStep without step'),
}


@pytest.mark.parametrize(
  ('env', 'overrides', 'match'), BAD_ENVIRONMENTS.values(), ids=BAD_ENVIRONMENTS
)
def test_bad_environment_names_the_field(tmp_path, env, overrides, match):
  fields = {'agent.env': env, 'task.kind': M + 'shop_rows', 'sft.steps': 0, **overrides}
  with pytest.raises(ValueError, match=r'`agent\.env` ' + match):
    trainers.build(agent_config(tmp_path, fields))


def test_agent_trains_with_an_environment_given_by_import_path(tmp_path):
  user_code.ENGINES.clear()
  fields = {
    **ENGINE,
    'agent.env': 'tests.user_code:ShopEnv',
    'task.kind': 'tests.user_code:shop_rows',
    'agent.sft_tool_frac': 1.0,
    'sft.steps': 2,
    'rl.steps': 1,
    'log.samples_every': 1,
  }
  config = agent_config(tmp_path, fields)
  trainers.run(config)
  logged = records(tmp_path)
  assert len([r for r in logged if r.get('phase') == 0.0]) == 2  # SFT on ShopEnv.demonstration
  (rl,) = [r for r in logged if r.get('phase') == 1.0]
  for key in ('env/turns', 'env/tool_calls', 'env/tool_use_rate', 'reward/mean'):
    assert key in rl, key
  assert sum(v for k, v in rl.items() if k.startswith('env/finish/')) == pytest.approx(1.0)
  # The episodes ran on the engine: turns continued through `on_turn_end`.
  (engine,) = user_code.ENGINES
  assert (config.rl.prompts_per_step, config.rl.group_size) in engine.calls
  # The sample log holds the RL batch's first group of episodes.
  samples = [json.loads(line) for line in open(tmp_path / 'samples.jsonl', encoding='utf-8')]
  assert len(samples) == config.rl.group_size
  assert all({'prompt', 'completion', 'reward', 'finish_reason'} <= set(x) for x in samples)
