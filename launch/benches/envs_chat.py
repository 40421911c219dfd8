"""`envs --openai`: multi-turn rollouts in the chat format, with each step a
tool that waits: the token-level environment pool, the message layer
(`jrl.envs.chat.Conversation`) and a black-box agent written with the
`openai` client through jrl's endpoint (`jrl.envs.openai_endpoint`), on
the same model, prompts, seeds and waits (see `run`).

    python launch/bench.py envs --openai [--env_ms 200 --prompts 8 --group 8 --max_new 128]
"""

import statistics
import threading
import time

import jax
import numpy as np

from launch.benches import common

# ChatML without a tools branch (SmolLM2's form).
TEMPLATE = """{% for message in messages %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']


def chat_tokenizer(vocab_size=2048):
  """A byte-level BPE tokenizer trained here on generated text, with the
  ChatML template (nothing is downloaded)."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  from jrl.models import tokenizer as T

  rng = np.random.default_rng(0)
  words = ['count', 'tool', 'says', 'ok', 'the', 'answer', 'is', 'step', 'go', 'on', 'user']
  corpus = [' '.join(rng.choice(words, 12)) + f' {i}' for i in range(2000)]
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(corpus, trainer=trainer)
  return T.HFTokenizer(tok, chat_template=TEMPLATE, bos=None, eos='<|im_end|>')


def tool_message(k):
  return {'role': 'user', 'content': f'tool says ok {k}'}


def make_envs(tokenizer, endpoint, wait_s, max_turns):
  """name -> factory() of an environment, three ways of the same task: after
  each model turn, wait `wait_s` (the tool), then add `tool_message(k)`;
  after `max_turns` answers the episode ends."""
  from jrl.envs import Environment, Step, chat
  from jrl.envs.openai_endpoint import AgentEnv

  end = chat.turn_end(tokenizer)[1]

  class Messages(Environment):
    """The message layer: each answer rendered by the template."""

    turn_stop_tokens = (end,)

    def reset(self, example):
      messages = [{'role': 'user', 'content': example['prompt']}]
      self.conversation, self.k = chat.Conversation(tokenizer, messages), 0
      return self.conversation.prompt_ids()

    def step(self, turn_tokens):
      self.conversation.add_turn(turn_tokens)
      time.sleep(wait_s)
      self.k += 1
      if self.k > max_turns:
        return Step([], done=True)
      return Step(self.conversation.append([tool_message(self.k)]))

  # The token level: the answers' tokens computed once (each after a turn's
  # end token), appended as they are.
  def answer_tokens(k):
    probe = chat.Conversation(tokenizer, [{'role': 'user', 'content': 'x'}])
    probe.add_turn([end])
    return probe.append([tool_message(k)])

  answers = [None] + [answer_tokens(k) for k in range(1, max_turns + 1)]

  class Tokens(Messages):
    def step(self, turn_tokens):
      time.sleep(wait_s)
      self.k += 1
      if self.k > max_turns:
        return Step([], done=True)
      return Step(list(answers[self.k]))

  def agent(base_url, api_key, example):
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{'role': 'user', 'content': example['prompt']}]
    for k in range(1, max_turns + 2):
      answer = client.chat.completions.create(model='policy', messages=messages)
      messages.append({'role': 'assistant', 'content': answer.choices[0].message.content})
      time.sleep(wait_s)  # its tool
      if k <= max_turns:
        messages.append(tool_message(k))
    return 1.0

  return {
    'pooled, tokens': Tokens,
    'pooled, messages': Messages,
    'pooled, OpenAI agent': lambda: AgentEnv(tokenizer, endpoint, agent, turn_timeout_s=120),
  }


def rollout(smp, params, examples, group, make_env, pool, limits, request_args):
  """One rollout of `examples` x `group` episodes, steps in `pool` (parked)."""
  from jrl import sampler
  from jrl.envs import EnvPool

  envs = [[make_env() for _ in range(group)] for _ in examples]
  prompts = []
  for row, example in zip(envs, examples, strict=True):
    prompts.append(row[0].reset(example))
    for env in row[1:]:
      env.reset(example)
  requests = [sampler.Request(prompt=p, seed=i, **request_args) for i, p in enumerate(prompts)]
  start_of_turn, lock = {}, threading.Lock()

  def answer(outcome, key, end):
    step, failure, message = outcome
    if failure:
      raise RuntimeError(f'episode {key}: {failure}: {message}')
    if step.done:
      return 'done'
    with lock:
      start_of_turn[key] = end + len(step.tokens)
    return list(step.tokens)

  def on_turn_end(i, g, tokens, logprobs=None):
    at = start_of_turn.get((i, g), 0)
    outcome = pool.submit(envs[i][g], [int(t) for t in tokens[at:]], logprobs=logprobs, **limits)
    return EnvPool.then(outcome, lambda out: answer(out, (i, g), len(tokens)))

  start = time.perf_counter()
  out = smp.generate(params, requests, group_size=group, on_turn_end=on_turn_end)
  return out, time.perf_counter() - start


def run(args):
  """Multi-turn chat episodes on a random model of --size whose vocabulary is
  a ChatML tokenizer's: a model turn ends at <|im_end|> (a logit bias makes
  turns of about --turn_len tokens), the tool waits --env_ms, its answer is
  a user message, --max_turns answers per episode, all steps in a pool of
  --workers threads (samples parked while their step runs). Three ways of
  the same task, on the same requests and seeds:

  - pooled, tokens: today's token-level environment, its answers' tokens
    computed once;
  - pooled, messages: the message layer, each answer rendered by the chat
    template (`Conversation.append`, checked against a full render);
  - pooled, OpenAI agent: an agent loop written with the `openai` client,
    one thread per episode, talking to the endpoint over HTTP, whose tool
    is its own sleep; the answers are rendered as in 'messages'.

  Figures: median seconds per rollout over --repeats (after a warm-up call
  each that compiles; the ways in turn, round robin), model tokens per
  second, and whether the trajectories equal those of 'pooled, tokens'
  token for token.
  """
  from jrl import models, sampler
  from jrl.envs import EnvPool, chat
  from jrl.envs.openai_endpoint import AgentEndpoint

  tokenizer = chat_tokenizer()
  size = dict(common.MODEL_SIZES[args.size], vocab_size=tokenizer.vocab_size)
  config = models.ModelConfig(**size)
  graphdef, params = models.create(config, jax.random.PRNGKey(0))
  end = chat.turn_end(tokenizer)[1]
  specials = [ids[0] for ids in map(tokenizer.encode, SPECIALS) if len(ids) == 1]
  # Uniform logits: P(end) = e^b / (V - 1 + e^b) = 1 / turn_len.
  bias = float(np.log((tokenizer.vocab_size - 1) / max(args.turn_len - 1, 1)))
  request_args = dict(
    max_new_tokens=args.max_new,
    temperature=1.0,
    stop_tokens=(end,),
    logit_bias={end: bias},
    banned_tokens=tuple(t for t in specials if t != end),
  )
  examples = [{'prompt': f'count {i}'} for i in range(args.prompts)]
  g, page = args.group, 16
  prompt_len = 32
  answer_len = 32
  engine_config = sampler.SamplerConfig(
    num_slots=args.prompts * g,
    num_pages=1 + args.prompts * sampler.pages_needed(prompt_len, args.max_new, g, page),
    page_size=page,
    max_prompt_len=prompt_len,
    max_new_tokens=args.max_new,
    max_stop_tokens=1,
    max_forced_tokens=answer_len,
  )
  smp = sampler.Sampler(graphdef, config, engine_config, steps_per_dispatch=args.steps)
  endpoint = AgentEndpoint().start()
  pool = EnvPool(args.workers)
  limits = dict(timeout_s=120.0, vocab_size=tokenizer.vocab_size, max_tokens=answer_len)
  ways = make_envs(tokenizer, endpoint, args.env_ms / 1e3, args.max_turns)
  print(
    f'envs --openai: {config.num_params() / 1e6:.1f}M-param random model, ChatML vocabulary '
    f'of {tokenizer.vocab_size}, {args.prompts} prompts x G={g}, up to {args.max_new} new '
    f'tokens, turns of ~{args.turn_len} tokens, {args.max_turns} tool answers of '
    f'{args.env_ms:.0f} ms per episode, {args.workers} workers, backend {jax.default_backend()}'
  )

  def run_once(make_env):
    return rollout(smp, params, examples, g, make_env, pool, limits, request_args)

  # Round robin over the ways, so that a change in the machine's load
  # (a shared machine) falls on each of them alike.
  times, outs = {name: [] for name in ways}, {}
  for make_env in ways.values():
    run_once(make_env)  # compiles
  for _ in range(args.repeats):
    for name, make_env in ways.items():
      outs[name], seconds = run_once(make_env)
      times[name].append(seconds)
  figures, reference = {}, None
  for name in ways:
    flat = [c for row in outs[name] for c in row]
    reference = reference or flat
    same = all(
      np.array_equal(a.tokens, b.tokens) and np.array_equal(a.env_mask, b.env_mask)
      for a, b in zip(flat, reference, strict=True)
    )
    model_tokens = sum(int(np.sum(~c.env_mask)) for c in flat)
    seconds = statistics.median(times[name])
    turns = sum(int(np.sum(np.diff(c.env_mask.astype(int)) == 1)) for c in flat)
    figures[name] = dict(
      seconds=seconds,
      model_tokens=model_tokens,
      tokens_per_s=model_tokens / seconds,
      tool_answers=turns,
      same_trajectories=same,
    )
    print(
      f'  {name:22s} {seconds:7.2f} s  {model_tokens / seconds:8.1f} model tokens/s  '
      f'{turns} tool answers appended  same trajectories as tokens: {same}'
    )
  pool.close()
  endpoint.close()
  base = figures['pooled, tokens']['tokens_per_s']
  for name in ('pooled, messages', 'pooled, OpenAI agent'):
    ratio = figures[name]['tokens_per_s'] / base
    print(f'{name} / pooled, tokens: x{ratio:.2f} model tokens/s')
    figures[f'{name.removeprefix("pooled, ")} over tokens'] = ratio
  common.write_json(args.out, dict(args=vars(args), figures=figures))
