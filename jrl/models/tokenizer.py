"""Tokenizers: Hugging Face `tokenizer.json` with its chat template, and a
tiny built-in character tokenizer for synthetic tasks and tests.

Both expose the same small interface:

    encode(text) -> list[int]          decode(ids) -> str
    apply_chat_template(messages, add_generation_prompt=True) -> str
    vocab_size, pad_id, bos_id, eos_ids

`HFTokenizer.from_dir(path)` reads `tokenizer.json` with the `tokenizers`
package, the special tokens and chat template from `tokenizer_config.json`
(or `chat_template.jinja`), and extra end-of-sequence ids from
`generation_config.json`. The template is rendered with jinja2 in a sandbox,
with the same whitespace settings and helpers (`raise_exception`, `tojson`,
`strftime_now`) that Hugging Face provides, so the rendered prompt is
identical. Nothing is downloaded.
"""

import datetime
import json
import os

import jinja2
import jinja2.sandbox
import tokenizers


def _token_text(value):
  """Special tokens are strings or {"content": ...} dicts in tokenizer_config.json."""
  if isinstance(value, dict):
    return value.get('content')
  return value


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(
    value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def compile_chat_template(source):
  """A jinja2 template in a sandbox with Hugging Face's settings and helpers."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=['jinja2.ext.loopcontrols']
  )
  env.filters['tojson'] = _tojson
  env.globals['raise_exception'] = _raise_exception
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


class HFTokenizer:
  """A Hugging Face fast tokenizer read from a local directory."""

  def __init__(self, tokenizer, *, chat_template=None, bos=None, eos=None, pad=None, extra_eos=()):
    self._tok = tokenizer
    self.chat_template_source = chat_template
    self._template = compile_chat_template(chat_template) if chat_template else None
    self.bos_token, self.eos_token, self.pad_token = bos, eos, pad
    self.bos_id = self._id(bos)
    eos_ids = [i for i in (self._id(eos), *extra_eos) if i is not None]
    self.eos_ids = tuple(dict.fromkeys(eos_ids))
    pad_id = self._id(pad)
    self.pad_id = pad_id if pad_id is not None else (self.eos_ids[0] if self.eos_ids else 0)

  def _id(self, token):
    return None if token is None else self._tok.token_to_id(token)

  @classmethod
  def from_dir(cls, path):
    """Reads tokenizer.json (required), tokenizer_config.json, chat_template.jinja,
    generation_config.json (optional) from `path`."""
    tok_path = os.path.join(path, 'tokenizer.json')
    if not os.path.exists(tok_path):
      raise FileNotFoundError(
        f'{tok_path}: file not found (jrl reads Hugging Face fast tokenizers from '
        'tokenizer.json; slow-tokenizer files alone are not supported).'
      )
    try:
      tok = tokenizers.Tokenizer.from_file(tok_path)
    except Exception as e:  # the tokenizers package raises a bare Exception
      raise ValueError(f'{tok_path}: cannot parse tokenizer ({e}).') from None
    cfg = _read_optional_json(os.path.join(path, 'tokenizer_config.json'))
    template = cfg.get('chat_template')
    if isinstance(template, list):  # named templates: take "default"
      named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
      template = named.get('default')
    # As in Hugging Face, a separate template file takes priority over the config's.
    jinja_path = os.path.join(path, 'chat_template.jinja')
    if os.path.exists(jinja_path):
      try:
        with open(jinja_path, encoding='utf-8') as f:
          template = f.read()
      except UnicodeDecodeError as e:
        raise ValueError(f'{jinja_path}: invalid UTF-8 ({e}).') from None
    gen = _read_optional_json(os.path.join(path, 'generation_config.json'))
    extra = gen.get('eos_token_id', [])
    extra = [extra] if isinstance(extra, int) else list(extra or [])
    return cls(
      tok,
      chat_template=template,
      bos=_token_text(cfg.get('bos_token')),
      eos=_token_text(cfg.get('eos_token')),
      pad=_token_text(cfg.get('pad_token')),
      extra_eos=extra,
    )

  @property
  def vocab_size(self):
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text, add_special_tokens=False):
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens=False):
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
    """Renders `messages` ([{"role", "content"}, ...]) with the checkpoint's template."""
    if self._template is None:
      raise ValueError('no chat template (tokenizer_config.json `chat_template`) to apply.')
    variables = {
      'tools': None,
      'documents': None,
      'bos_token': self.bos_token or '',
      'eos_token': self.eos_token or '',
      'pad_token': self.pad_token or '',
      **kwargs,
    }
    return self._template.render(
      messages=messages, add_generation_prompt=add_generation_prompt, **variables
    )


def _read_optional_json(path):
  if not os.path.exists(path):
    return {}
  try:
    with open(path, encoding='utf-8') as f:
      data = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: invalid JSON ({e}).') from None
  if not isinstance(data, dict):
    raise ValueError(f'{path}: expected a JSON object, got {type(data).__name__}.')
  return data


class CharTokenizer:
  """One token per character: newline and printable ASCII, plus pad/bos/eos.

  ids: 0 <pad>, 1 <bos>, 2 <eos>, 3.. the characters of `alphabet`. Text with
  a character outside the alphabet raises ValueError naming it (nothing is
  dropped silently). The chat template is "role: content\\n" per message,
  then "assistant: " when a generation prompt is asked for.
  """

  SPECIALS = ('<pad>', '<bos>', '<eos>')
  alphabet = '\n' + ''.join(chr(c) for c in range(32, 127))

  def __init__(self):
    self._index = {ch: i + len(self.SPECIALS) for i, ch in enumerate(self.alphabet)}
    self.pad_id, self.bos_id = 0, 1
    self.eos_ids = (2,)
    self.bos_token, self.eos_token, self.pad_token = '<bos>', '<eos>', '<pad>'

  @property
  def vocab_size(self):
    return len(self.SPECIALS) + len(self.alphabet)

  def encode(self, text, add_special_tokens=False):
    ids = []
    for pos, ch in enumerate(text):
      if ch not in self._index:
        raise ValueError(
          f"character {ch!r} (U+{ord(ch):04X}) at offset {pos} is not in the char tokenizer's "
          'vocabulary (newline and printable ASCII).'
        )
      ids.append(self._index[ch])
    return [self.bos_id, *ids] if add_special_tokens else ids

  def decode(self, ids, skip_special_tokens=False):
    out = []
    for i in ids:
      i = int(i)
      if not 0 <= i < self.vocab_size:
        raise ValueError(f'token id {i} is outside the vocabulary of {self.vocab_size}.')
      if i < len(self.SPECIALS):
        if not skip_special_tokens:
          out.append(self.SPECIALS[i])
      else:
        out.append(self.alphabet[i - len(self.SPECIALS)])
    return ''.join(out)

  def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
    del kwargs
    text = ''.join(f'{m["role"]}: {m["content"]}\n' for m in messages)
    return text + ('assistant: ' if add_generation_prompt else '')


def load_tokenizer(path):
  """`HFTokenizer.from_dir(path)`, or the character tokenizer for path 'char'."""
  if path == 'char':
    return CharTokenizer()
  return HFTokenizer.from_dir(path)
