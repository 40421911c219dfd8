"""Black-box agents: an OpenAI-compatible chat-completions endpoint served by
the sampler during rollout.

    endpoint = AgentEndpoint().start()      # http://127.0.0.1:PORT/v1

    def agent(base_url, api_key, example):  # unchanged agent code, openai client
      client = openai.OpenAI(base_url=base_url, api_key=api_key)
      messages = [{'role': 'user', 'content': example['prompt']}]
      while True:
        answer = client.chat.completions.create(model='policy', messages=messages, tools=TOOLS)
        ...                                  # run its tools, append messages
      return reward                          # the episode's reward (or None: `reward_fn`)

    make_env = lambda tokenizer: AgentEnv(tokenizer, endpoint, agent)   # agent.env

Each episode runs the agent in a thread of its own with a key of its own
(its `api_key`): the endpoint groups the agent's requests into the episode
by that key. The agent's first request opens the conversation (its
messages and `tools`, rendered by the checkpoint's chat template: see
`jrl.envs.chat`); the sampler then generates the assistant's turn, which
goes back to the agent as a chat completion (content, and `tool_calls`
parsed from the model's own format); the agent's next request must repeat
the conversation so far and add messages (tool results, user turns),
which are appended as the tokens the template renders for them; the
agent's return ends the episode with its reward. So the tokens the trainer
trains on are exactly the ones the sampler produced, and many agents are
in flight at once, batched by the sampler (a waiting agent's sample is
parked, `jrl.envs.EnvPool`).

What is checked and how failures end: a request whose history differs
from what the episode recorded (an agent that edits or drops earlier
messages) is answered with HTTP 409 and ends its episode ('env_error',
counted as unscored); so does an agent that raises, or does not send its
next request or return within `turn_timeout_s`.

What a request may ask: `tools` (declared to the template on the first
request), `logprobs: true` (each token of the turn with the logprob the
sampler drew it with, the turn's end token included: the numbers the
trainer's importance ratios start from), `stream: true` (server-sent
events: the answer's chunks once the turn is sampled, then `[DONE]`;
`stream_options.include_usage` adds the usage chunk), `max_tokens` or
`max_completion_tokens` (the turn ends after that many tokens, with
`finish_reason` 'length'; the agent's next request goes on from the cut
turn as from any other) and `temperature` (0: greedy; absent: the run's
`sampling.temperature`), both for the turn this request asks for (the
sampler's `Continuation`). A turn drawn at another temperature than the
run's is a sample of another policy than the trainer's: its logprobs (and
`logprobs: true`) are those it was drawn with, as for any off-policy
token, and the held-out evaluation stays greedy whatever the agent asks.
`top_p` is the run's (`sampling.top_p`): one decode program serves every
slot, so a request's is not applied (`system_fingerprint` says so).
Refused with HTTP 400 naming the field: `top_logprobs` > 0 (the sampler
keeps the drawn token's logprob only), `n` > 1 (an episode is one
trajectory; a group's samples are `rl.group_size` episodes, each its own
agent run), and a `max_tokens` or `temperature` out of range.
"""

import dataclasses
import http.server
import json
import queue
import secrets
import threading
import time

from jrl.envs.base import Environment, Step, TurnSampling
from jrl.envs.chat import Conversation, Tool, parse_tool_calls


@dataclasses.dataclass
class Pending:
  """One chat-completions request waiting for the sampler's answer."""

  body: dict
  reply: queue.Queue = dataclasses.field(default_factory=lambda: queue.Queue(1))


class _Episode:
  def __init__(self):
    self.key = 'jrl-' + secrets.token_hex(12)
    self.inbox = queue.Queue()  # Pending requests, then ('done', reward) or ('error', why)
    self.closed = False


class _Handler(http.server.BaseHTTPRequestHandler):
  endpoint = None  # set per server
  protocol_version = 'HTTP/1.1'

  def log_message(self, *args):
    del args  # deliberate: quiet

  def _send(self, status, payload):
    data = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header('Content-Type', 'application/json')
    self.send_header('Content-Length', str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _error(self, status, message):
    self._send(status, {'error': {'message': message, 'type': 'invalid_request_error'}})

  def do_GET(self):
    if self.path.rstrip('/') == '/v1/models':
      self._send(200, {'object': 'list', 'data': [{'id': 'policy', 'object': 'model'}]})
    else:
      self._error(404, f'no route {self.path}')

  def do_POST(self):
    if self.path.rstrip('/') != '/v1/chat/completions':
      return self._error(404, f'no route {self.path}')
    key = self.headers.get('Authorization', '').removeprefix('Bearer ').strip()
    episode = self.endpoint.episodes.get(key)
    if episode is None or episode.closed:
      return self._error(401, 'unknown or finished episode key')
    try:
      length = int(self.headers.get('Content-Length', '0'))
      if length > self.endpoint.max_body_bytes:
        return self._error(413, 'request body too large')
      body = json.loads(self.rfile.read(length))
      if not isinstance(body, dict) or not isinstance(body.get('messages'), list):
        return self._error(400, 'a body with a "messages" list is needed')
    except ValueError as e:
      return self._error(400, f'bad JSON: {e}')
    refused = _refused(body)
    if refused:
      return self._error(400, refused)
    pending = Pending(body)
    episode.inbox.put(pending)
    try:
      status, payload = pending.reply.get(timeout=self.endpoint.reply_timeout_s)
    except queue.Empty:
      return self._error(504, 'the sampler did not answer in time')
    if status == 200 and body.get('stream'):
      usage = (body.get('stream_options') or {}).get('include_usage', False)
      return self._stream(_chunks(payload, usage))
    self._send(status, payload)

  def _stream(self, chunks):
    """Server-sent events: each chunk, then [DONE]; the connection closes after."""
    self.send_response(200)
    self.send_header('Content-Type', 'text/event-stream')
    self.send_header('Cache-Control', 'no-cache')
    self.send_header('Connection', 'close')
    self.end_headers()
    for chunk in chunks:
      self.wfile.write(b'data: ' + json.dumps(chunk).encode() + b'\n\n')
    self.wfile.write(b'data: [DONE]\n\n')
    self.wfile.flush()
    self.close_connection = True


def _refused(body):
  """Why the endpoint cannot serve `body` as asked (a message naming the
  field), or ''."""
  n = body.get('n', 1)
  if n not in (None, 1):
    return (
      f'`n` = {n!r}: an episode is one trajectory; several samples of a prompt are '
      'rl.group_size episodes, each its own agent run'
    )
  for field in ('max_tokens', 'max_completion_tokens'):
    value = body.get(field)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
      return f'`{field}` must be an integer >= 1, got {value!r}'
  t = body.get('temperature')
  if t is not None and (not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t <= 2):
    return f'`temperature` must be a number in [0, 2], got {t!r}'
  top = body.get('top_logprobs') or 0
  if top:
    return f'`top_logprobs` = {top!r}: the sampler keeps the logprob of the drawn token only'
  if body.get('stream_options') is not None and not isinstance(body['stream_options'], dict):
    return '`stream_options` must be an object'
  return ''


def _chunks(payload, include_usage):
  """A chat completion as the chunks of a stream (`chat.completion.chunk`):
  the role, the content (with its logprobs), each tool call, the finish
  reason, and the usage if asked."""
  (choice,) = payload['choices']
  message = choice['message']
  head = {k: payload[k] for k in ('id', 'created', 'model', 'system_fingerprint')}
  head['object'] = 'chat.completion.chunk'

  def chunk(delta, finish_reason=None, logprobs=None):
    c = {'index': 0, 'delta': delta, 'finish_reason': finish_reason, 'logprobs': logprobs}
    return {**head, 'choices': [c]}

  out = [chunk({'role': 'assistant', 'content': ''})]
  if message.get('content') or choice.get('logprobs'):
    out.append(chunk({'content': message.get('content') or ''}, logprobs=choice.get('logprobs')))
  for k, call in enumerate(message.get('tool_calls') or []):
    out.append(chunk({'tool_calls': [{'index': k, **call}]}))
  out.append(chunk({}, finish_reason=choice['finish_reason']))
  if include_usage:
    out.append({**head, 'choices': [], 'usage': payload['usage']})
  return out


class AgentEndpoint:
  """The HTTP endpoint (see the module); one per run, shared by its episodes.

  Args:
    host, port: where it listens (127.0.0.1; port 0 picks a free one).
    reply_timeout_s: how long a request waits for the sampler.
    max_body_bytes: larger requests are refused.
  """

  def __init__(self, host='127.0.0.1', port=0, *, reply_timeout_s=600.0, max_body_bytes=1 << 22):
    self.host, self.port = host, port
    self.reply_timeout_s = float(reply_timeout_s)
    self.max_body_bytes = int(max_body_bytes)
    self.episodes = {}
    self._server = None

  def start(self):
    handler = type('Handler', (_Handler,), {'endpoint': self})
    self._server = http.server.ThreadingHTTPServer((self.host, self.port), handler)
    self._server.daemon_threads = True
    self.port = self._server.server_address[1]
    threading.Thread(target=self._server.serve_forever, daemon=True, name='agent-endpoint').start()
    return self

  @property
  def base_url(self):
    return f'http://{self.host}:{self.port}/v1'

  def open_episode(self):
    episode = _Episode()
    self.episodes[episode.key] = episode
    return episode

  def close_episode(self, episode):
    episode.closed = True
    self.episodes.pop(episode.key, None)

  def close(self):
    if self._server is not None:
      self._server.shutdown()
      self._server.server_close()


def _sampling(body):
  """The `TurnSampling` a request asks for its turn (absent fields: the run's)."""
  limit = body.get('max_completion_tokens') or body.get('max_tokens')
  return TurnSampling(max_tokens=limit or 0, temperature=body.get('temperature'))


def _tool(schema):
  """A `chat.Tool` (declared, never called here) from an OpenAI tool schema."""
  fn = schema.get('function', schema)
  return Tool(fn['name'], fn.get('description', ''), fn.get('parameters', {}), None)


def _same(sent, got):
  """Whether the agent's copy of a message is the one the episode recorded."""
  keys = ('role', 'content', 'tool_call_id')
  if any((sent.get(k) or None) != (got.get(k) or None) for k in keys):
    return False
  calls = lambda m: [
    (c['function']['name'], json.loads(c['function']['arguments'] or '{}'))
    for c in m.get('tool_calls') or []
  ]
  try:
    return calls(sent) == calls(got)
  except (KeyError, TypeError, ValueError):
    return False


class AgentEnv(Environment):
  """An episode of a black-box agent talking to the endpoint (see the module).

  Args:
    tokenizer: the checkpoint's tokenizer (with its chat template).
    endpoint: a started `AgentEndpoint`.
    agent: fn(base_url, api_key, example) -> reward (float) or None.
    reward_fn: fn(messages, example) -> reward, when the agent returns None.
    family, on_rewrite, template_kwargs: as `jrl.envs.chat.Conversation`.
    turn_timeout_s: the agent's time for its next request (or to return).
  """

  def __init__(
    self,
    tokenizer,
    endpoint,
    agent,
    *,
    reward_fn=None,
    family=None,
    on_rewrite='append',
    template_kwargs=None,
    turn_timeout_s=60.0,
  ):
    self.tokenizer = tokenizer
    self.endpoint = endpoint
    self.agent = agent
    self.reward_fn = reward_fn
    self.options = dict(family=family, on_rewrite=on_rewrite, template_kwargs=template_kwargs)
    self.turn_timeout_s = float(turn_timeout_s)
    probe = Conversation(tokenizer, [{'role': 'user', 'content': 'x'}], **self.options)
    self.turn_stop_tokens = (probe.end_id,)
    self.episode = self.conversation = self.pending = None
    self.turn_logprobs = None  # the latest turn's, from the sampler (`wants_logprobs`)
    self.sent = []  # the conversation as the agent sees it
    self.example = None
    self.failure = None

  def reset(self, example):
    self.example = example
    self.episode = self.endpoint.open_episode()
    episode = self.episode

    def run():
      try:
        outcome = ('done', self.agent(self.endpoint.base_url, episode.key, example))
      except BaseException as e:
        outcome = ('error', f'the agent raised {type(e).__name__}: {e}')
      episode.inbox.put(outcome)

    threading.Thread(target=run, daemon=True, name='agent').start()
    first = self._next()
    if not isinstance(first, Pending):  # it ended without asking: a one-line prompt
      self.failure = first[1] if first[0] == 'error' else 'the agent returned before any request'
      first = Pending({'messages': [{'role': 'user', 'content': ''}]})
    messages = first.body['messages']
    tools = [_tool(t) for t in first.body.get('tools') or []]
    self.conversation = Conversation(self.tokenizer, messages, tools=tools, **self.options)
    self.sent = [dict(m) for m in messages]
    self.pending = first
    self.sampling = _sampling(first.body)
    return self.conversation.prompt_ids()

  def _next(self):
    try:
      return self.episode.inbox.get(timeout=self.turn_timeout_s)
    except queue.Empty:
      return ('error', f'the agent sent no request and did not return in {self.turn_timeout_s} s')

  wants_logprobs = True

  def _logprobs(self, turn_ids):
    """The turn's tokens and the logprobs they were drawn with, in the API's
    shape ({'content': [{token, logprob, bytes, top_logprobs}]}), or None
    when the sampler gave none for it (a turn cut by the episode's end)."""
    lps = self.turn_logprobs
    if lps is None or len(lps) != len(turn_ids):
      return None
    content = []
    for token, lp in zip(turn_ids, lps, strict=True):
      text = self.tokenizer.decode([int(token)])
      content.append(
        {'token': text, 'logprob': float(lp), 'bytes': list(text.encode()), 'top_logprobs': []}
      )
    return {'content': content, 'refusal': None}

  def _answer(self, message, calls, turn_ids, finish_reason=None):
    content, _ = parse_tool_calls(message['content'], self.conversation.family)
    tool_calls = [
      {
        'id': call.id,
        'type': 'function',
        'function': {'name': call.name, 'arguments': json.dumps(call.arguments)},
      }
      for call in calls
      if call.error is None
    ]
    reply = {'role': 'assistant', 'content': content or None}
    if tool_calls:
      reply['tool_calls'] = tool_calls
    self.sent.append(reply)
    n_turn = len(turn_ids)
    prompt = len(self.conversation.ids) - n_turn
    logprobs = self._logprobs(turn_ids) if self.pending.body.get('logprobs') else None
    payload = {
      'id': 'chatcmpl-' + secrets.token_hex(8),
      'object': 'chat.completion',
      'created': int(time.time()),
      'model': 'policy',
      'system_fingerprint': 'jrl: top_p as the trainer configures it',
      'choices': [
        {
          'index': 0,
          'message': reply,
          'finish_reason': finish_reason or ('tool_calls' if tool_calls else 'stop'),
          'logprobs': logprobs,
        }
      ],
      'usage': {
        'prompt_tokens': prompt,
        'completion_tokens': n_turn,
        'total_tokens': prompt + n_turn,
      },
    }
    self.pending.reply.put((200, payload))
    self.pending = None

  def step(self, turn_tokens, logprobs=None):
    if self.failure is not None:
      self.endpoint.close_episode(self.episode)
      raise RuntimeError(self.failure)
    self.turn_logprobs = logprobs
    message, calls = self.conversation.add_turn(turn_tokens)
    # A turn without its end token was cut by the request's `max_tokens`.
    cut = not turn_tokens or int(turn_tokens[-1]) not in self.turn_stop_tokens
    self._answer(message, calls, list(turn_tokens), 'length' if cut else None)
    outcome = self._next()
    if not isinstance(outcome, Pending):
      self.endpoint.close_episode(self.episode)
      kind, value = outcome
      if kind == 'error':
        raise RuntimeError(value)
      if value is None and self.reward_fn is not None:
        value = self.reward_fn(self.sent, self.example)
      return Step([], done=True, reward=float(value or 0.0))
    messages = outcome.body['messages']
    n = len(self.sent)
    kept = len(messages) > n and all(
      _same(s, g) for s, g in zip(self.sent, messages[:n], strict=True)
    )
    if not kept:
      outcome.reply.put((409, {'error': {'message': 'the history differs from the episode'}}))
      self.endpoint.close_episode(self.episode)
      raise RuntimeError('the agent edited its history (HTTP 409)')
    new = [self._for_template(m) for m in messages[n:]]
    self.sent += [dict(m) for m in messages[n:]]
    self.pending = outcome
    self.sampling = _sampling(outcome.body)
    # The agent ran the tools itself: its tool messages count as the calls made.
    ran = sum(m.get('role') == 'tool' for m in messages[n:])
    info = {'agent_requests': 1, 'tool_calls': ran}
    return Step(self.conversation.append(new), info=info)

  def _for_template(self, message):
    """A message the agent added, as the template renders it."""
    if message.get('role') == 'tool' and self.conversation.family == 'text':
      return {
        'role': 'user',
        'content': f'<tool_response>\n{message.get("content")}\n</tool_response>',
      }
    return {k: v for k, v in message.items() if k in ('role', 'content', 'name', 'tool_call_id')}

  def final_reward(self, trajectory_text):
    """The model ended the episode with end-of-sequence outside a turn end."""
    del trajectory_text
    return 0.0

  def finish(self, reason, last_turn_tokens):
    """The sampler ended the episode (its token budget, the turn limit, ...)
    while the agent waits: its request gets the turn so far, finish_reason
    'length', and the episode's key closes."""
    if self.pending is not None and self.conversation is not None:
      text = self.tokenizer.decode(last_turn_tokens)
      message = {'role': 'assistant', 'content': text}
      self.turn_logprobs = None
      self._answer(message, [], list(last_turn_tokens), finish_reason='length')
    if self.episode is not None:
      self.endpoint.close_episode(self.episode)
    del reason
