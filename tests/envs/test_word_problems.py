"""The calculator task of configs/agent_smollm2_tools.py (`jrl.envs.word_problems`).

Every generated problem's worked solution yields its calculations; a
demonstration (with the tool or without) played back through the
environment is the episode the environment renders and scores 1.0; and the
three ways to the task (a Python tool, the same tool served by the MCP
server `jrl/envs/calculator_mcp.py`, the `openai`-client agent through
jrl's endpoint) give the same episode, token for token, on the same model
turns. SmolLM2's template (no tools branch) on a small byte-level BPE.
"""

import pytest

from jrl.data import word_problems as generator
from jrl.envs import word_problems as wp
from jrl.envs.arith import calculate
from tests.envs.test_chat import _turn, tokenizers  # noqa: F401


def _examples(n=12):
  """Rows as the trainer reads them (`task.answer_extractor='gsm8k'`)."""
  rows = [p.row() for p in generator.generate(n, seed=3, split='train')]
  out = [
    {'prompt': r['question'], 'answer': r['answer'].rsplit('#### ', 1)[1], 'solution': r['answer']}
    for r in rows
  ]
  return out, [r['difficulty'] for r in rows]


def test_each_calculation_of_a_worked_solution_is_read():
  examples, difficulty = _examples(30)
  assert set(difficulty) == {1, 2, 3}
  for ex, steps in zip(examples, difficulty, strict=True):
    work = wp.working(ex['solution'])
    assert len(work) == steps, ex['solution']
    for expression, value in work:
      assert float(calculate(expression)) == pytest.approx(float(value)), expression
    assert work[-1][1] == ex['answer']


@pytest.mark.parametrize('use_tool', [True, False])
def test_a_demonstration_is_the_episode_the_environment_renders_and_scores(tokenizers, use_tool):  # noqa: F811
  tok = tokenizers['smollm2']
  examples, difficulty = _examples()
  for ex, steps in zip(examples, difficulty, strict=True):
    demo_env = wp.make_chat_env(tok)
    demo_env.reset(ex)
    segments = wp.chat_demonstration(ex, use_tool, demo_env)
    env = wp.make_chat_env(tok)
    env.reset(ex)
    calls = 0
    for i, (ids, by_model) in enumerate(segments):
      if not by_model:
        continue
      step = env.step(ids)
      calls += step.info.get('tool_calls', 0)
      if i + 1 < len(segments):  # the environment's answer is the demonstration's next piece
        assert not segments[i + 1][1] and step.tokens == list(segments[i + 1][0])
    assert step.done and step.reward == 1.0, tok.decode([t for s, _ in segments for t in s])
    assert calls == (steps if use_tool else 0)
    stats = env.conversation.stats  # each tool message appended checked against a full render
    assert (stats['exact'], stats['rewritten'], stats['token_diff']) == (calls, 0, 0)


def test_a_wrong_answer_scores_zero(tokenizers):  # noqa: F811
  tok = tokenizers['smollm2']
  ex = _examples(1)[0][0]
  env = wp.make_chat_env(tok)
  env.reset(ex)
  step = env.step(_turn(tok, env.conversation, f'The answer is {int(ex["answer"]) + 1}.'))
  assert step.done and step.reward == 0.0


def _untitled(schema):
  """`schema` without its 'title' keys, at any depth."""
  if isinstance(schema, dict):
    return {k: _untitled(v) for k, v in schema.items() if k != 'title'}
  return schema


def test_python_mcp_and_openai_agent_give_the_same_episode(tokenizers):  # noqa: F811
  pytest.importorskip('mcp', reason='the [mcp] extra')
  pytest.importorskip('openai', reason='the [openai] extra')
  tok = tokenizers['smollm2']
  examples, difficulty = _examples(4)
  ex = examples[difficulty.index(2)]
  envs = [wp.make_chat_env(tok), wp.make_mcp_env(tok), wp.make_agent_env(tok)]
  prompts = [env.reset(ex) for env in envs]
  assert prompts[2] == prompts[0]
  # The MCP server's schema is the Python tool's plus pydantic's titles.
  assert [_untitled(t.schema()) for t in envs[1].conversation.tools.values()] == wp.TOOLS
  demo_env = wp.make_chat_env(tok)
  demo_env.reset(ex)
  turns = [ids for ids, by_model in wp.chat_demonstration(ex, True, demo_env) if by_model]
  for turn in turns:
    steps = [env.step(list(turn)) for env in envs]
    assert steps[1].tokens == steps[0].tokens and steps[2].tokens == steps[0].tokens
  assert [s.reward for s in steps] == [1.0, 1.0, 1.0] and all(s.done for s in steps)
  n = len(prompts[0])
  assert envs[1].conversation.ids[len(prompts[1]) :] == envs[0].conversation.ids[n:]
  assert envs[2].conversation.ids == envs[0].conversation.ids
