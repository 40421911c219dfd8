"""The agent trainer on an environment in the checkpoint's chat format
(`agent.env = 'jrl.envs.arith:make_chat_env'`, `jrl.envs.chat`).

A tiny chat checkpoint (ChatML, no tools branch: the calculator is declared
in the system prompt): the SFT warm-up's rows are the chat episodes the
conversation renders (the model's call and answer as targets, the tool's
message as context), and after the warm-up the sampler's episodes end at
the model's own turn end, where the environment decides (a call gets the
tool's message; an answer ends the episode with its reward), never by
the end-of-turn token taken as end-of-sequence.
"""

import json
import time

import numpy as np
import pytest

from configs import agent_arith
from jrl import trainers
from jrl.envs import arith
from jrl.trainers import controller
from jrl.trainers.rollouts import episodes
from tests.helpers import set_fields, write_tiny_chat_model


@pytest.fixture(scope='module')
def job(tmp_path_factory):
  root = tmp_path_factory.mktemp('chat_agent')
  model_dir = str(root / 'model')
  write_tiny_chat_model(model_dir, family='qwen2', max_positions=1024)
  config = set_fields(
    agent_arith.get_config(),
    {
      'workdir': str(root / 'run'),
      'model.path': model_dir,
      'tokenizer': '',  # the checkpoint's, with its chat template
      'agent.env': 'jrl.envs.arith:make_chat_env',
      'agent.sft_tool_frac': 1.0,
      'task.max_prompt_len': 640,  # characters: the system prompt declares the tool
      'task.max_response_len': 120,
      'agent.max_env_tokens': 48,  # an agent's user message: its template's tokens too
      'task.eval_size': 4,
      'sft.steps': 0,  # demonstration_batch is tested directly
      'sft.batch_size': 8,
      'sft.lr': 3e-3,
      'rl.steps': 1,
      'rl.prompts_per_step': 4,
      'rl.group_size': 2,
      'rl.minibatch_size': 8,
      'sampler.num_slots': 8,
      'eval.every': 0,
      'log.plot': False,
      'log.tensorboard': False,
    },
  )
  job = trainers.build(config)
  state = controller.train(job)  # the warm-up and one RL step, end to end
  yield config, job, state
  controller.close(job)


def test_demonstrations_are_chat_episodes_with_the_tool_message_as_context(job):
  config, job_, _ = job
  worker = job_.topology.worker
  tok = worker.tokenizer
  examples = worker.held_out[:2]
  batch = episodes.demonstration_batch(config, tok, worker.stop_tokens, 1024, examples, 0)
  for row, ex in enumerate(examples):
    tokens, mask = np.asarray(batch.tokens[row]), np.asarray(batch.mask[row]).astype(bool)
    loss = np.asarray(batch.loss_mask[row]).astype(bool)
    text = tok.decode(tokens[mask].tolist())
    env = arith.make_chat_env(tok)
    assert text.startswith(tok.decode(env.reset(ex)))  # the conversation's own prompt
    assert '<tool_call>' in text and '<tool_response>' in text, text
    targets = tok.decode(tokens[loss].tolist())
    context = tok.decode(tokens[mask & ~loss].tolist())
    assert '"name": "calculate"' in targets and ex['answer'] in targets
    assert '<tool_response>' in context and '<tool_response>' not in targets
    # The rows equal a full render of the episode's conversation.
    conv = env.conversation
    call = arith.chat.call_text(conv.family, 'calculate', {'expression': ex['expression']})
    turn = env.model_turn(call)
    env.step(turn)
    env.step(env.model_turn(ex['answer']))
    assert tokens[mask].tolist() == conv.ids
    assert conv.stats['exact'] == 1


def test_the_environment_decides_at_the_models_turn_end(job):
  _, job_, state = job
  worker = job_.topology.worker
  end = worker.turn_stops[0]
  assert end in worker.stop_tokens  # <|im_end|> ends the turn and is an end of sequence
  _, results = worker.run_episodes(
    state.params, worker.held_out[:2], group_size=2, greedy=True, iteration=1, version=1
  )
  reasons = [ep.reason for row in results for _, ep in row]
  assert 'stop' not in reasons, reasons  # the end token went to the environment
  assert set(reasons) <= {'done', 'length', 'max_turns'}, reasons
  for row in results:
    for completion, ep in row:
      if ep.reason == 'done':
        assert int(completion.tokens[-1]) == end


def test_openai_client_agents_run_through_the_sampler(job, monkeypatch):
  """The same task as black-box agents (`jrl.envs.openai_endpoint`): each
  episode's agent talks to the endpoint with the `openai` client, and the
  sampler answers all of them, batched, greedy here."""
  openai = pytest.importorskip('openai', reason='the [openai] extra')
  from jrl.envs import chat
  from jrl.envs.openai_endpoint import AgentEndpoint, AgentEnv

  _, job_, state = job
  worker = job_.topology.worker
  native = arith.make_chat_env(worker.tokenizer)
  requests_seen = []

  def agent(base_url, api_key, example):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [
      {'role': 'system', 'content': native.system},
      {'role': 'user', 'content': example['prompt']},
    ]
    tools = [chat.function_tool(arith.calculate).schema()]
    for _ in range(3):
      answer = client.chat.completions.create(model='policy', messages=messages, tools=tools)
      requests_seen.append(api_key)
      message = answer.choices[0].message
      messages.append(message.model_dump(exclude_none=True))
      if not message.tool_calls:
        return float((message.content or '').strip() == example['answer'])
      for call in message.tool_calls:
        result = arith.calculate(**json.loads(call.function.arguments))
        messages.append({'role': 'tool', 'tool_call_id': call.id, 'content': result})
    return 0.0

  endpoint = AgentEndpoint().start()
  try:
    monkeypatch.setattr(worker, 'make_env', lambda tok: AgentEnv(tok, endpoint, agent))
    examples = worker.held_out[:2]
    requests, results = worker.run_episodes(
      state.params, examples, group_size=2, greedy=True, iteration=1, version=1
    )
  finally:
    endpoint.close()
  eps = [ep for row in results for _, ep in row]
  for _ in range(100):  # the agents' threads read their last answers
    if len(set(requests_seen)) == 4:
      break
    time.sleep(0.05)
  assert len(set(requests_seen)) == 4  # four agents, each with its own key, all answered
  assert set(ep.reason for ep in eps) <= {'done', 'length', 'max_turns'}, [ep.error for ep in eps]
  # The prompts the agents opened are the native environment's, token for token.
  for request, example in zip(requests, examples, strict=True):
    assert list(request.prompt) == native.reset(example)


def test_an_agents_max_tokens_and_temperature_apply_to_its_turns(job, monkeypatch):
  """Each request's `max_tokens` cuts the turn it asks for (finish_reason
  'length', the agent goes on from the cut turn), and `temperature` 0 in a
  sampling run gives the greedy run's episodes token for token (the same
  requests, so the same batches and programs: exact equality holds)."""
  openai = pytest.importorskip('openai', reason='the [openai] extra')
  from jrl.envs import EnvPool
  from jrl.envs.openai_endpoint import AgentEndpoint, AgentEnv

  _, job_, state = job
  worker = job_.topology.worker
  told = []

  def agent(base_url, api_key, example, temperature):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{'role': 'user', 'content': example['prompt']}]
    for limit in (3, 5):
      answer = client.chat.completions.create(
        model='policy', messages=messages, max_tokens=limit, temperature=temperature
      )
      choice = answer.choices[0]
      told.append((limit, choice.finish_reason, answer.usage.completion_tokens))
      messages.append({'role': 'assistant', 'content': choice.message.content})
      messages.append({'role': 'user', 'content': 'go on'})
    return 1.0

  def run(greedy, temperature):
    endpoint = AgentEndpoint().start()
    pool = EnvPool(4)  # the run's closed with its job
    try:
      make = lambda tok: AgentEnv(
        tok, endpoint, lambda url, key, ex: agent(url, key, ex, temperature)
      )
      monkeypatch.setattr(worker, 'make_env', make)
      monkeypatch.setattr(worker, 'pool', pool)
      _, results = worker.run_episodes(
        state.params, worker.held_out[:2], group_size=2, greedy=greedy, iteration=1, version=1
      )
    finally:
      endpoint.close()
      pool.close()
    return results

  greedy_run = run(True, None)
  sampled = run(False, 0.0)
  assert told and all(n <= limit for limit, _, n in told), told
  assert all(n == limit for limit, reason, n in told if reason == 'length'), told
  assert sum(reason == 'length' for _, reason, _ in told) >= len(told) // 2
  for want_row, got_row in zip(greedy_run, sampled, strict=True):
    for (want, want_ep), (got, got_ep) in zip(want_row, got_row, strict=True):
      assert got_ep.reason == want_ep.reason == 'done', (got_ep.error, want_ep.error)
      np.testing.assert_array_equal(got.tokens, want.tokens)
      # The model's turns: at most 3, then at most 5 tokens.
      runs = np.split(got.env_mask, np.flatnonzero(np.diff(got.env_mask)) + 1)
      model_turns = [len(r) for r in runs if not r[0]]
      assert len(model_turns) == 2 and model_turns[0] <= 3 and model_turns[1] <= 5
