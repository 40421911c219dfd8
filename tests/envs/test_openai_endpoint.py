"""Black-box agents through the OpenAI-compatible endpoint
(`jrl.envs.openai_endpoint`), with the real `openai` client (the [openai]
extra, in the [test] extra).

A deterministic agent written with the `openai` client gives, turn for
turn, the same episode tokens and reward as the native chat environment
(`ChatToolEnv`) on the same model turns; an agent that edits its history
is refused (HTTP 409) and ends its episode; one that raises or goes silent
ends its episode; unsupported requests get HTTP 400.
"""

import json
import time

import numpy as np
import pytest

openai = pytest.importorskip('openai', reason='the [openai] extra (pip install -e ".[openai]")')

from jrl.envs import Environment, EnvPool, Step, chat  # noqa: E402
from jrl.envs.openai_endpoint import AgentEndpoint, AgentEnv  # noqa: E402
from tests.envs.test_chat import _call_text, _turn, calculator, tokenizers  # noqa: E402, F401

SYSTEM = 'You answer with a number only.'
EXAMPLE = {'prompt': 'What is 47*8+13?', 'answer': '389'}
TOOLS = [chat.function_tool(calculator).schema()]


def honest_agent(base_url, api_key, example):
  """An agent loop as people write it with the openai client."""
  client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
  messages = [
    {'role': 'system', 'content': SYSTEM},
    {'role': 'user', 'content': example['prompt']},
  ]
  while True:
    answer = client.chat.completions.create(model='policy', messages=messages, tools=TOOLS)
    message = answer.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if not message.tool_calls:
      return float((message.content or '').strip() == example['answer'])
    for call in message.tool_calls:
      result = calculator(**json.loads(call.function.arguments))
      messages.append({'role': 'tool', 'tool_call_id': call.id, 'content': result})


@pytest.fixture(scope='module')
def endpoint():
  server = AgentEndpoint().start()
  yield server
  server.close()


def _native(tok):
  return chat.ChatToolEnv(
    tok, [calculator], system=SYSTEM, answer_fn=lambda text, ex: float(text.strip() == ex['answer'])
  )


@pytest.mark.parametrize('name', ['hermes', 'smollm2', 'llama3.1'])
def test_an_openai_client_agent_gives_the_native_episode(tokenizers, endpoint, name):  # noqa: F811
  tok = tokenizers[name]
  native, through = _native(tok), AgentEnv(tok, endpoint, honest_agent)
  assert through.turn_stop_tokens == native.turn_stop_tokens
  assert through.reset(EXAMPLE) == native.reset(EXAMPLE)
  fmt = native.conversation.family
  turns = [_call_text(fmt, 'calculator', {'expression': '47*8+13'}), '389']
  for text in turns:
    turn = _turn(tok, native.conversation, text)
    a, b = native.step(turn), through.step(turn)
    assert (a.tokens, a.done, a.reward) == (b.tokens, b.done, b.reward), (name, text)
    # The tools the agent ran count as the episode's calls (env/tool_use_rate).
    assert b.info.get('tool_calls', 0) == a.info.get('tool_calls', 0), (name, text)
  assert b.done and b.reward == 1.0
  assert through.conversation.ids == native.conversation.ids


def test_an_agent_that_edits_its_history_is_refused(tokenizers, endpoint):  # noqa: F811
  seen = {}

  def editor(base_url, api_key, example):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{'role': 'user', 'content': example['prompt']}]
    client.chat.completions.create(model='policy', messages=messages)
    messages.append({'role': 'assistant', 'content': 'something it never said'})
    messages.append({'role': 'user', 'content': 'go on'})
    try:
      client.chat.completions.create(model='policy', messages=messages)
    except openai.APIStatusError as e:
      seen['status'] = e.status_code
      raise

  tok = tokenizers['hermes']
  env = AgentEnv(tok, endpoint, editor)
  env.reset(EXAMPLE)
  with pytest.raises(RuntimeError, match='edited its history'):
    env.step(_turn(tok, env.conversation, '12'))
  for _ in range(100):  # the agent's thread reads the answer
    if 'status' in seen:
      break
    time.sleep(0.05)
  assert seen['status'] == 409


def test_an_agent_that_raises_or_goes_silent_ends_its_episode(tokenizers, endpoint):  # noqa: F811
  tok = tokenizers['hermes']

  def broken(base_url, api_key, example):
    raise ValueError('agent bug')

  env = AgentEnv(tok, endpoint, broken, turn_timeout_s=5)
  env.reset(EXAMPLE)
  with pytest.raises(RuntimeError, match='agent bug'):
    env.step(_turn(tok, env.conversation, '1'))

  def silent(base_url, api_key, example):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'x'}])
    time.sleep(30)

  env = AgentEnv(tok, endpoint, silent, turn_timeout_s=0.5)
  env.reset(EXAMPLE)
  with pytest.raises(RuntimeError, match='sent no request'):
    env.step(_turn(tok, env.conversation, '1'))


def streaming_agent(base_url, api_key, example):
  """`honest_agent` streaming its answers and asking for logprobs; it returns
  the logprobs it was given with its reward."""
  client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
  messages = [
    {'role': 'system', 'content': SYSTEM},
    {'role': 'user', 'content': example['prompt']},
  ]
  seen = []
  while True:
    stream = client.chat.completions.create(
      model='policy',
      messages=messages,
      tools=TOOLS,
      stream=True,
      logprobs=True,
      stream_options={'include_usage': True},
    )
    content, calls, usage = '', {}, None
    for chunk in stream:
      usage = chunk.usage or usage
      for choice in chunk.choices:
        content += choice.delta.content or ''
        if choice.logprobs and choice.logprobs.content:
          seen.append([t.logprob for t in choice.logprobs.content])
        for call in choice.delta.tool_calls or []:
          calls[call.index] = call
    assert usage is not None and usage.completion_tokens == len(seen[-1])
    message = {'role': 'assistant', 'content': content or None}
    if calls:
      message['tool_calls'] = [
        {'id': c.id, 'type': 'function', 'function': c.function.model_dump()}
        for _, c in sorted(calls.items())
      ]
    messages.append({k: v for k, v in message.items() if v is not None})
    if not calls:
      example['seen'] = seen
      return float(content.strip() == example['answer'])
    for c in calls.values():
      result = calculator(**json.loads(c.function.arguments))
      messages.append({'role': 'tool', 'tool_call_id': c.id, 'content': result})


def test_a_streaming_agent_gets_the_turns_and_their_logprobs(tokenizers, endpoint):  # noqa: F811
  tok = tokenizers['hermes']
  example = dict(EXAMPLE)
  native, through = _native(tok), AgentEnv(tok, endpoint, streaming_agent)
  assert through.reset(example) == native.reset(EXAMPLE)
  fmt = native.conversation.family
  given = []
  for k, text in enumerate([_call_text(fmt, 'calculator', {'expression': '47*8+13'}), '389']):
    turn = _turn(tok, native.conversation, text)
    given.append([-0.25 * (k + 1) - j / 64 for j in range(len(turn))])
    a, b = native.step(turn), through.step(turn, logprobs=given[-1])
    assert (a.tokens, a.done, a.reward) == (b.tokens, b.done, b.reward), text
  assert b.done and b.reward == 1.0
  assert example['seen'] == given  # each turn's logprobs as the sampler drew them


def test_unsupported_requests_and_unknown_keys_are_refused(endpoint):
  client = openai.OpenAI(base_url=endpoint.base_url, api_key='not-a-key', max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    client.chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'x'}])
  episode = endpoint.open_episode()
  client = openai.OpenAI(base_url=endpoint.base_url, api_key=episode.key, max_retries=0)
  messages = [{'role': 'user', 'content': 'x'}]
  with pytest.raises(openai.BadRequestError, match=r'`n` = 2.*rl\.group_size'):
    client.chat.completions.create(model='policy', messages=messages, n=2)
  with pytest.raises(openai.BadRequestError, match='`top_logprobs` = 3'):
    client.chat.completions.create(model='policy', messages=messages, logprobs=True, top_logprobs=3)
  with pytest.raises(openai.BadRequestError, match='`max_tokens` must be an integer >= 1'):
    client.chat.completions.create(model='policy', messages=messages, max_tokens=0)
  with pytest.raises(openai.BadRequestError, match=r'`temperature` must be a number in \[0, 2\]'):
    client.chat.completions.create(model='policy', messages=messages, temperature=2.5)
  endpoint.close_episode(episode)


# -- many agents in flight, through the sampler --------------------------------------

TURNS = 3  # user messages an episode's agent (and its native twin) adds


class NativeTwin(Environment):
  """What `talker` does, written on the message layer directly: after each
  model turn, the user message 'go on k', for TURNS turns."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.turn_stop_tokens = (chat.turn_end(tokenizer)[1],)

  def reset(self, example):
    self.conversation = chat.Conversation(
      self.tokenizer, [{'role': 'user', 'content': example['prompt']}]
    )
    self.k = 0
    return self.conversation.prompt_ids()

  def step(self, turn_tokens):
    self.conversation.add_turn(turn_tokens)
    self.k += 1
    if self.k > TURNS:
      return Step([], done=True, reward=float(self.k))
    return Step(self.conversation.append([{'role': 'user', 'content': f'go on {self.k}'}]))


def talker(base_url, api_key, example):
  """An agent that asks for its turns' logprobs and says 'go on k' TURNS times."""
  client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
  messages = [{'role': 'user', 'content': example['prompt']}]
  for k in range(1, TURNS + 2):
    answer = client.chat.completions.create(model='policy', messages=messages, logprobs=True)
    choice = answer.choices[0]
    example['logprobs'].append([t.logprob for t in choice.logprobs.content])
    messages.append({'role': 'assistant', 'content': choice.message.content})
    if k <= TURNS:
      messages.append({'role': 'user', 'content': f'go on {k}'})
  return float(k)


def _episodes(tok, make_env, examples, *, group, parking):
  """Rollouts of a tiny random model with `make_env`'s environments, the steps
  in an `EnvPool` (parked samples when `parking`)."""
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
  envs = [[make_env() for _ in range(group)] for _ in examples]
  prompts = []
  for row, example in zip(envs, examples, strict=True):
    prompts.append(row[0].reset(example))
    assert all(env.reset(example) == prompts[-1] for env in row[1:])
  engine = sampler.SamplerConfig(
    num_slots=4,
    num_pages=160,
    page_size=8,
    max_prompt_len=64,
    max_new_tokens=128,
    max_forced_tokens=24,
  )
  smp = sampler.Sampler(graphdef, config, engine, steps_per_dispatch=4)
  specials = [ids[0] for ids in map(tok.encode, chat.special_texts(tok)) if len(ids) == 1]
  requests = [
    sampler.Request(
      prompt=p,
      max_new_tokens=128,
      stop_tokens=(end,),
      seed=i,
      logit_bias={end: 3.0},
      banned_tokens=tuple(t for t in specials if t != end),
    )
    for i, p in enumerate(prompts)
  ]
  pool, start = EnvPool(8), {}

  def settle(outcome, key, end_at):
    step, failure, message = outcome
    assert failure is None, message
    if step.done:
      return 'done'
    start[key] = end_at + len(step.tokens)
    return list(step.tokens)

  def on_turn_end(i, g, tokens, logprobs):
    at = start.get((i, g), 0)
    turn = list(map(int, tokens[at:]))
    limits = dict(timeout_s=30, vocab_size=tok.vocab_size, max_tokens=24)
    out = pool.submit(envs[i][g], turn, logprobs=logprobs[at:], **limits)
    if not parking:
      return settle(out.result(), (i, g), len(tokens))
    return EnvPool.then(out, lambda o: settle(o, (i, g), len(tokens)))

  groups = smp.generate(params, requests, group_size=group, on_turn_end=on_turn_end)
  pool.close()
  return groups, smp.stats


def test_many_agents_in_flight_give_the_native_episodes(tokenizers, endpoint):  # noqa: F811
  tok = tokenizers['hermes']
  examples = [{'prompt': f'count to {n}', 'logprobs': []} for n in range(4)]
  want, _ = _episodes(tok, lambda: NativeTwin(tok), examples, group=2, parking=False)
  examples = [{'prompt': f'count to {n}', 'logprobs': []} for n in range(4)]
  got, stats = _episodes(
    tok, lambda: AgentEnv(tok, endpoint, talker), examples, group=2, parking=True
  )
  assert stats.env_parked_peak >= 2  # agents waited at once while others decoded
  turns = 0
  for row_want, row_got in zip(want, got, strict=True):
    for a, b in zip(row_want, row_got, strict=True):
      np.testing.assert_array_equal(a.tokens, b.tokens)
      np.testing.assert_array_equal(a.env_mask, b.env_mask)
      assert a.finish_reason == b.finish_reason
      turns += int(np.sum(np.diff(a.env_mask.astype(int)) == 1))
  assert turns >= 8  # multi-turn episodes, not single answers
  # What each agent was told: its finished turns' logprobs as the completion
  # records them (a turn cut by the token budget is answered without).
  end = chat.turn_end(tok)[1]
  for example, row in zip(examples, got, strict=True):
    told = sorted(map(tuple, example['logprobs']))
    recorded = []
    for c in row:
      runs = np.split(np.arange(len(c.tokens)), np.flatnonzero(np.diff(c.env_mask)) + 1)
      runs = [r for r in runs if not c.env_mask[r[0]] and c.tokens[r[-1]] == end]
      recorded += [tuple(c.logprobs[r].tolist()) for r in runs]
    assert told == sorted(recorded)
