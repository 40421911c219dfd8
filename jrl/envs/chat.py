"""Multi-turn episodes as chat messages, on the token core.

An episode is a conversation rendered by the checkpoint's own chat template,
kept as one exact token sequence: the model's turns are exactly the tokens
it sampled, and each message the environment adds (a tool's result, a user
or environment message) is appended as the tokens the template renders for
it, i.e. the text by which rendering the conversation with the message
exceeds rendering it without. Nothing the model wrote is re-tokenised.

    conv = Conversation(tokenizer, [{'role': 'user', 'content': 'What is 47*8+13?'}],
                        tools=[function_tool(calculator)])
    ids = conv.prompt_ids()                # the prompt, tools declared
    message, calls = conv.add_turn(turn)   # the model's sampled turn, its end token last
    ids = conv.append([tool_message(call, '389')])   # tokens to append after the turn

After every `append` the sequence is checked against a full render of the
same conversation (`stats`): 'exact' when the text the sequence holds plus
the appended text is the full render, 'rewritten' when the template
renders earlier turns differently from what was sampled (Qwen3 drops the
reasoning of earlier turns; a template that re-renders a tool call's JSON
canonically); 'token_diff' when the text is exact but encoding the full
render splits it into other tokens (the model sampled a non-canonical
tokenisation, or a boundary merges). The sequence keeps the sampled tokens
in every case (what the trainer trains on is what the sampler produced);
`on_rewrite='end'` ends the episode instead of going on after a rewrite.
The text of special tokens in an added message's content is removed before
rendering (`stats['special_removed']`), so a tool result cannot forge a
turn boundary.

Tool calls are parsed from the model's own format by family
(`template_family`): 'hermes' (Qwen 2.5 / 3, Hermes: JSON in
<tool_call>...</tool_call>), 'llama3' (a JSON object {"name", "parameters"}
as the whole turn, optionally after <|python_tag|>), and 'text' for
templates without tools (SmolLM2's): the hermes format taught in the system
prompt. Tools are declared through the template's `tools` argument where
the template uses it, else in the system prompt. A call that cannot be read
becomes a `ToolCall` with an `error`, answered with a message the model
sees; it never raises.

`ChatToolEnv` is a `jrl.envs.Environment` on top: the episode's tools are
Python functions with type hints (`function_tool`: the JSON schema from the
signature and docstring, as TRL and OpenEnv users write them) or `Tool`s;
a turn without a call is the final answer, scored by `answer_fn`.
"""

import collections
import concurrent.futures
import dataclasses
import inspect
import json
import re
import types
import typing
from collections.abc import Callable

from jrl.envs.base import Environment, Step
from jrl.envs.tools import ToolError

FAMILIES = ('hermes', 'llama3', 'text')
REWRITE_POLICIES = ('append', 'end')
_SENTINEL = 'JRL_TURN_END_PROBE'


class RenderError(ValueError):
  """The template cannot render the conversation incrementally."""


# -- tools ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tool:
  """A tool the model may call: its name, description, JSON-schema
  parameters, and `fn(**arguments) -> result` (str() of the result is what
  the model sees; raise `ToolError` for a failure the model should read)."""

  name: str
  description: str
  parameters: dict
  fn: Callable

  def schema(self):
    """The OpenAI / Hugging Face function schema chat templates take."""
    return {
      'type': 'function',
      'function': {
        'name': self.name,
        'description': self.description,
        'parameters': self.parameters,
      },
    }


_JSON_TYPES = {str: 'string', int: 'integer', float: 'number', bool: 'boolean', type(None): 'null'}


def _json_type(hint, where):
  """The JSON schema of a type hint (str, int, float, bool, list[...],
  dict[str, ...], Optional / unions, Literal)."""
  if hint in _JSON_TYPES:
    return {'type': _JSON_TYPES[hint]}
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (list, tuple, collections.abc.Sequence):
    return {'type': 'array', **({'items': _json_type(args[0], where)} if args else {})}
  if origin is dict or hint is dict:
    return {'type': 'object'}
  if hint is list:
    return {'type': 'array'}
  if origin is typing.Literal:
    return {'enum': list(args)}
  if origin in (typing.Union, types.UnionType):
    return {'anyOf': [_json_type(a, where) for a in args]}
  raise ValueError(f'{where}: no JSON schema for the type {hint!r}')


def _arg_docs(doc):
  """{name: description} from a Google-style 'Args:' section."""
  out, inside, name = {}, False, None
  for line in (doc or '').splitlines():
    stripped = line.strip()
    if stripped in ('Args:', 'Arguments:', 'Parameters:'):
      inside = True
      continue
    if inside:
      if not stripped or (stripped.endswith(':') and ' ' not in stripped):
        inside = stripped == ''
        continue
      match = re.match(r'(\w+)\s*(\([^)]*\))?\s*:\s*(.*)', stripped)
      if match:
        name = match.group(1)
        out[name] = match.group(3)
      elif name:
        out[name] += ' ' + stripped
  return out


def function_tool(fn, name=None, description=None):
  """A `Tool` from a Python function with type hints: its parameters'
  schema from the signature (a default makes a parameter optional), its
  description from the docstring's first paragraph and 'Args:' section.
  Raises ValueError naming the function and parameter without a hint."""
  name = name or fn.__name__
  hints = typing.get_type_hints(fn)
  doc = inspect.getdoc(fn) or ''
  arg_docs = _arg_docs(doc)
  properties, required = {}, []
  for param in inspect.signature(fn).parameters.values():
    if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
      continue
    if param.name not in hints:
      raise ValueError(f'tool {name!r}: parameter {param.name!r} has no type hint')
    schema = _json_type(hints[param.name], f'tool {name!r}, parameter {param.name!r}')
    if param.name in arg_docs:
      schema['description'] = arg_docs[param.name]
    properties[param.name] = schema
    if param.default is param.empty:
      required.append(param.name)
  summary = description or doc.split('\n\n')[0].replace('\n', ' ').strip()
  parameters = {'type': 'object', 'properties': properties, 'required': required}
  return Tool(name, summary, parameters, fn)


def as_tool(obj):
  """A `Tool` as it is, or `function_tool` of a function."""
  return obj if isinstance(obj, Tool) else function_tool(obj)


# -- tool calls -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One call the model wrote: `name` and `arguments`, or the `error` that
  says why it could not be read (name and arguments then None)."""

  name: str | None
  arguments: dict | None
  error: str | None = None
  id: str = ''


_HERMES = re.compile(r'<tool_call>(.*?)(</tool_call>|$)', re.DOTALL)


def _read_call(body, keys, index):
  """A ToolCall from JSON text `body` whose arguments are under one of `keys`."""
  call_id = f'call_{index}'
  try:
    data = json.loads(body)
  except ValueError as e:
    return ToolCall(None, None, f'the call is not valid JSON ({e})', call_id)
  if not isinstance(data, dict) or not isinstance(data.get('name'), str):
    return ToolCall(None, None, 'a call is a JSON object with a string "name"', call_id)
  arguments = next((data[k] for k in keys if k in data), {})
  if isinstance(arguments, str):  # some models write the arguments as a JSON string
    try:
      arguments = json.loads(arguments)
    except ValueError:
      pass
  if not isinstance(arguments, dict):
    return ToolCall(None, None, f'the "{keys[0]}" of a call must be a JSON object', call_id)
  return ToolCall(data['name'], arguments, None, call_id)


def parse_tool_calls(text, family):
  """(content without the calls, [ToolCall]) of a model turn's text (its end
  token removed) in `family`'s format; never raises for what the model wrote."""
  if family not in FAMILIES:
    raise ValueError(f'tool-call family must be one of {FAMILIES}, got {family!r}')
  if family == 'llama3':
    body = text.strip()
    body = body.removeprefix('<|python_tag|>').strip()
    if not body.startswith('{'):
      return text, []
    return '', [_read_call(body, ('parameters', 'arguments'), 0)]
  calls = []
  for i, match in enumerate(_HERMES.finditer(text)):
    if not match.group(2):
      calls.append(ToolCall(None, None, 'a <tool_call> is not closed by </tool_call>', f'call_{i}'))
    else:
      calls.append(_read_call(match.group(1).strip(), ('arguments', 'parameters'), i))
  return _HERMES.sub('', text).strip(), calls


def call_text(family, name, arguments):
  """A call of `name` with `arguments` written in `family`'s format."""
  if family == 'llama3':
    return json.dumps({'name': name, 'parameters': arguments})
  return '<tool_call>\n' + json.dumps({'name': name, 'arguments': arguments}) + '\n</tool_call>'


def template_family(template_source):
  """'hermes', 'llama3' or 'text': how a template's model writes tool calls."""
  source = template_source or ''
  if '<tool_call>' in source:
    return 'hermes'
  if '<|python_tag|>' in source or 'ipython' in source:
    return 'llama3'
  return 'text'


def tool_instructions(tools):
  """The system-prompt text that declares `tools` where the template cannot."""
  lines = [
    'You can call tools. To call one, write',
    '<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>',
    'and end your turn; its result comes back in <tool_response></tool_response>. Tools:',
  ]
  lines += [json.dumps(t.schema()['function']) for t in tools]
  return '\n'.join(lines)


# -- the conversation -------------------------------------------------------------------


def turn_end(tokenizer):
  """(text, token id) that end an assistant turn in the tokenizer's template
  (e.g. '<|im_end|>'): what follows an assistant message's content."""
  messages = [{'role': 'user', 'content': 'x'}, {'role': 'assistant', 'content': _SENTINEL}]
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
  after = text.split(_SENTINEL, 1)[1]
  ids = tokenizer.encode(after)
  if not ids:
    raise RenderError('the chat template writes nothing after an assistant turn')
  return tokenizer.decode(ids[:1]), ids[0]


def turn_prefix(tokenizer):
  """What the template writes before an assistant message's content beyond
  its generation prompt (Mistral's ' '; '' for most): a model that follows
  the template samples it at the start of its turn."""
  user = [{'role': 'user', 'content': 'x'}]
  prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True)
  text = tokenizer.apply_chat_template(
    [*user, {'role': 'assistant', 'content': _SENTINEL}], add_generation_prompt=False
  )
  head = text.split(_SENTINEL, 1)[0]
  return head[len(prompt) :] if head.startswith(prompt) else ''


def special_texts(tokenizer):
  """The text of every special token the tokenizer encodes from text (e.g.
  '<|im_end|>'), longest first; () for tokenizers without added tokens."""
  inner = getattr(tokenizer, '_tok', None)
  if inner is None or not hasattr(inner, 'get_added_tokens_decoder'):
    return ()
  texts = {t.content for t in inner.get_added_tokens_decoder().values() if t.special}
  return tuple(sorted(texts, key=len, reverse=True))


class Conversation:
  """An episode's messages and its exact token sequence (see the module).

  Args:
    tokenizer: an `HFTokenizer` (or anything with `apply_chat_template`,
      `encode`, `decode` and `chat_template_source`).
    messages: the opening messages ([{"role", "content"}, ...]).
    tools: `Tool`s or typed functions, declared to the model.
    family: the tool-call format; None: `template_family` of the template.
    on_rewrite: 'append' (go on; counted) | 'end' (`append` raises
      RenderError) when the template renders earlier turns differently.
    template_kwargs: more variables for the template (e.g. enable_thinking).
  """

  def __init__(
    self, tokenizer, messages, *, tools=(), family=None, on_rewrite='append', template_kwargs=None
  ):
    if on_rewrite not in REWRITE_POLICIES:
      raise ValueError(f'`on_rewrite` must be one of {REWRITE_POLICIES}, got {on_rewrite!r}')
    self.tokenizer = tokenizer
    source = getattr(tokenizer, 'chat_template_source', '') or ''
    self.family = family or template_family(source)
    if self.family not in FAMILIES:
      raise ValueError(f'tool-call family must be one of {FAMILIES}, got {self.family!r}')
    self.tools = {t.name: t for t in map(as_tool, tools)}
    self.on_rewrite = on_rewrite
    self.kwargs = dict(template_kwargs or {})
    messages = [dict(m) for m in messages]
    if self.tools and re.search(r'\btools\b', source) and self.family != 'text':
      self.kwargs['tools'] = [t.schema() for t in self.tools.values()]
    elif self.tools:
      note = tool_instructions(list(self.tools.values()))
      if messages and messages[0]['role'] == 'system':
        messages[0]['content'] = messages[0]['content'] + '\n\n' + note
      else:
        messages.insert(0, {'role': 'system', 'content': note})
    self.messages = messages
    self.end_text, self.end_id = turn_end(tokenizer)
    self.turn_prefix = turn_prefix(tokenizer)
    self.specials = special_texts(tokenizer)
    self.text = self._render(messages, True)
    self.ids = list(tokenizer.encode(self.text))
    self.stats = collections.Counter()
    self._reported = collections.Counter()  # `stats` as `render_info` last returned them

  def _render(self, messages, generation_prompt):
    return self.tokenizer.apply_chat_template(
      messages, add_generation_prompt=generation_prompt, **self.kwargs
    )

  def render_info(self):
    """The render checks counted since the last call, as a step's info:
    {'render_rewritten', 'render_token_diff'} (`stats` holds the episode's)."""
    stats, seen = self.stats, self._reported
    self._reported = collections.Counter(stats)
    return {
      'render_rewritten': stats['rewritten'] - seen['rewritten'],
      'render_token_diff': stats['token_diff'] - seen['token_diff'],
    }

  def prompt_ids(self):
    return list(self.ids)

  def add_turn(self, turn_ids):
    """Records the model's sampled turn (its end token last, if it wrote one);
    returns (the assistant message, its tool calls)."""
    turn_ids = [int(t) for t in turn_ids]
    text = self.tokenizer.decode(turn_ids)
    self.ids += turn_ids
    self.text += text
    content = text.removesuffix(self.end_text).removeprefix(self.turn_prefix)
    _, calls = parse_tool_calls(content, self.family)
    message = {'role': 'assistant', 'content': content}
    self.messages.append(message)
    return message, calls

  def tool_message(self, call, result):
    """The message that answers `call` with `result` (text), in the family's role."""
    if self.family == 'text':
      body = f'<tool_response>\n{result}\n</tool_response>'
      return {'role': 'user', 'content': body}
    return {'role': 'tool', 'name': call.name or '', 'tool_call_id': call.id, 'content': result}

  def _inert(self, message):
    """`message` with the text of special tokens removed from its content: a
    tool result or an agent's message cannot forge a turn boundary (counted
    as `stats['special_removed']`)."""
    content = message.get('content')
    if not isinstance(content, str):
      return dict(message)
    for text in self.specials:
      if text in content:
        self.stats['special_removed'] += content.count(text)
        content = content.replace(text, '')
    return {**message, 'content': content}

  def append(self, new_messages):
    """The tokens that add `new_messages` after the sequence, up to the
    model's next turn (the generation prompt); checked against a full
    render (`stats`). Raises RenderError when the template cannot append
    them (rendering them drops an earlier turn), or on a rewrite with
    `on_rewrite='end'`."""
    new_messages = [self._inert(m) for m in new_messages]
    before = self._render(self.messages, False)
    after = self._render(self.messages + new_messages, True)
    # The new messages' text: what follows, in `after`, the end of the turn
    # that ends `before` (the n-th end token; earlier turns may render
    # differently there, e.g. without their reasoning), then what the
    # template writes after that end token (e.g. '\n').
    n = before.count(self.end_text)
    at = -1
    for _ in range(n):
      at = after.find(self.end_text, at + 1)
      if at < 0:
        raise RenderError('rendering the new messages removes an earlier turn')
    delta = after[at + len(self.end_text) :] if n else after[len(before) :]
    if not self.text.endswith(self.end_text):  # the turn ended without its end token
      delta = after[len(before) :]
    tokens = list(self.tokenizer.encode(delta))
    if self.text + delta != after:
      self.stats['rewritten'] += 1
      if self.on_rewrite == 'end':
        raise RenderError('the template renders earlier turns differently from what was sampled')
    elif list(self.tokenizer.encode(after)) != self.ids + tokens:
      self.stats['token_diff'] += 1
    else:
      self.stats['exact'] += 1
    self.ids += tokens
    self.text += delta
    self.messages += [dict(m) for m in new_messages]
    return tokens


# -- the environment --------------------------------------------------------------------


class ChatToolEnv(Environment):
  """Tools in the model's chat format; the episode ends at a turn without a call.

  Args:
    tokenizer: the checkpoint's tokenizer (with its chat template).
    tools: `Tool`s or typed Python functions.
    answer_fn: fn(final answer text, example) -> reward.
    system: a system message (tools are declared in it where the template
      has no `tools` argument).
    family, on_rewrite, template_kwargs: as `Conversation`.
    tool_timeout_s: a call that does not return in time ends the episode
      (raises: the trainer records 'env_error' with the message).
    max_result_chars: longer results are cut (the model sees '...').
  """

  def __init__(
    self,
    tokenizer,
    tools,
    answer_fn=None,
    *,
    system=None,
    family=None,
    on_rewrite='append',
    template_kwargs=None,
    tool_timeout_s=10.0,
    max_result_chars=2000,
  ):
    self.tokenizer = tokenizer
    self.tools = [as_tool(t) for t in tools]
    self.answer_fn = answer_fn
    self.system = system
    self.options = dict(family=family, on_rewrite=on_rewrite, template_kwargs=template_kwargs)
    self.tool_timeout_s = float(tool_timeout_s)
    self.max_result_chars = int(max_result_chars)
    self.turn_stop_tokens = (turn_end(tokenizer)[1],)
    self.conversation = None
    self.example = None

  def reset(self, example):
    self.example = example
    messages = [{'role': 'system', 'content': self.system}] if self.system else []
    messages.append({'role': 'user', 'content': example['prompt']})
    self.conversation = Conversation(self.tokenizer, messages, tools=self.tools, **self.options)
    return self.conversation.prompt_ids()

  def _call(self, call):
    """(result text, counters) of one call; raises for a tool that hangs or
    breaks (the episode ends with the reason)."""
    if call.error:
      return f'error: {call.error}', {'invalid_calls': 1}
    tool = self.conversation.tools.get(call.name)
    if tool is None:
      names = ', '.join(self.conversation.tools)
      return f'error: no tool named {call.name!r} (tools: {names})', {'invalid_calls': 1}
    try:
      inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as e:
      return f'error: {call.name}: {e}', {'invalid_calls': 1}
    # A thread of its own: a call that hangs is left behind, never waited for.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f'tool-{call.name}')
    future = pool.submit(tool.fn, **call.arguments)
    pool.shutdown(wait=False)
    try:
      result = str(future.result(timeout=self.tool_timeout_s))
      counts = {'tool_calls': 1}
    except ToolError as e:
      result, counts = f'error: {e}', {'tool_calls': 1, 'tool_failures': 1}
    except concurrent.futures.TimeoutError:
      why = f'tool {call.name!r} did not answer in {self.tool_timeout_s} s'
      raise TimeoutError(why) from None
    if len(result) > self.max_result_chars:
      result = result[: self.max_result_chars - 3] + '...'
    return result, counts

  def model_turn(self, text):
    """The tokens a model that follows the template samples to write `text`
    as its turn (for demonstrations): its end token last."""
    conv = self.conversation
    return [*self.tokenizer.encode(conv.turn_prefix + text), conv.end_id]

  def step(self, turn_tokens):
    message, calls = self.conversation.add_turn(turn_tokens)
    if not calls:
      reward = 0.0
      if self.answer_fn is not None:
        reward = float(self.answer_fn(message['content'], self.example))
      return Step([], done=True, reward=reward, info=self._render_info())
    info = collections.Counter()
    replies = []
    for call in calls:
      result, counts = self._call(call)
      info.update(counts)
      replies.append(self.conversation.tool_message(call, result))
    tokens = self.conversation.append(replies)
    info.update(self._render_info())
    return Step(tokens, info=dict(info))

  def _render_info(self):
    """This step's render checks (`Conversation.render_info`)."""
    return self.conversation.render_info()

  def final_reward(self, trajectory_text):
    """The episode ended on an end-of-sequence token outside a turn end."""
    if self.answer_fn is None:
      return 0.0
    return float(self.answer_fn(trajectory_text, self.example))
