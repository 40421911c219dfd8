"""Tests for jrl.models.tokenizer: HFTokenizer and CharTokenizer.

Every Hugging Face tokenizer here is trained in the test on a few sentences
with the `tokenizers` package and written to a temporary directory together
with a tokenizer_config.json and a ChatML-style chat template written below;
nothing is downloaded. HFTokenizer is checked against `transformers` loading
the same directory (ids, decoded text, rendered chat prompts), and against
hand-written expected prompts.
"""

import datetime
import json
import os
import re
import string

import jinja2
import numpy as np
import pytest
import transformers

from jrl.models import tokenizer as T
from tests.helpers import train_byte_bpe

SPECIAL_TOKENS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<pad>']

CORPUS = [
  'The quick brown fox jumps over the lazy dog.',
  'Hello, world! How are you today?',
  'A tokenizer splits text into tokens; tokens map to ids.',
  'Reinforcement learning from human feedback uses a reward model.',
  'Café, naïve, déjà vu: non-ASCII text also round trips.',
  'def f(x):\n  return x * 2\n',
]

# ChatML with a default system prompt, a loop over messages, a `tool` role
# rendered with `tojson`, optional tool schemas rendered with `tojson(indent=2)`,
# `raise_exception` for any other role, and the generation prompt. The block
# tags sit on their own, indented lines so that the `trim_blocks` /
# `lstrip_blocks` settings decide the output.
CHATML_TEMPLATE = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
  {% set system = messages[0]['content'] %}
  {% set loop_messages = messages[1:] %}
{% else %}
  {% set system = 'You are a helpful assistant.' %}
  {% set loop_messages = messages %}
{% endif %}
<|im_start|>system
{{ system }}
{%- if tools %}

# Tools
{{ tools | tojson(indent=2) }}
{%- endif %}
<|im_end|>
{% for message in loop_messages %}
  {% if message['role'] not in ['user', 'assistant', 'tool'] %}
    {{ raise_exception('Invalid role: ' + message['role']) }}
  {% endif %}
<|im_start|>{{ message['role'] }}
  {% if message['role'] == 'tool' %}
{{ {'output': message['content']} | tojson }}
  {%- else %}
{{ message['content'] }}
  {%- endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = {
  'user_only': [{'role': 'user', 'content': 'Hello, world!'}],
  'with_system': [
    {'role': 'system', 'content': 'You answer in one word.'},
    {'role': 'user', 'content': 'How are you today?'},
    {'role': 'assistant', 'content': 'Fine.'},
    {'role': 'user', 'content': 'And the fox?'},
  ],
  'non_ascii': [
    {'role': 'system', 'content': 'Réponds en français, s’il te plaît.'},
    {'role': 'user', 'content': 'Café, naïve, déjà vu — 日本語 😀'},
  ],
  'tool': [
    {'role': 'user', 'content': 'Run f(2).'},
    {'role': 'assistant', 'content': 'Calling f.'},
    {'role': 'tool', 'content': 'résultat: "4" <ok> & done'},
  ],
  'multiline': [
    {'role': 'user', 'content': 'def f(x):\n  return x * 2\n'},
    {'role': 'assistant', 'content': '  leading spaces\n\ntrailing newline\n'},
  ],
}

TOOLS = [
  {
    'type': 'function',
    'function': {'name': 'f', 'description': 'Doubles x, naïvely.', 'parameters': {}},
  }
]

TEXTS = [
  'The quick brown fox jumps over the lazy dog.',
  'Hello, world!',
  'Café, naïve, déjà vu — 日本語 😀',
  'def f(x):\n  return x * 2\n',
  '<|im_start|>user\nHi<|im_end|>\n<|endoftext|>',
  '',
  '   spaces   and\ttabs\t',
]


def _train_tokenizer():
  """A byte-level BPE trained on CORPUS, with SPECIAL_TOKENS added."""
  return train_byte_bpe(CORPUS, SPECIAL_TOKENS, 400)


@pytest.fixture(scope='module')
def trained():
  return _train_tokenizer()


def _write_json(path, obj):
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(obj, f, ensure_ascii=False)


def _make_dir(
  path, tok, *, config=None, template_file=None, generation_config=None, tokenizer_json=True
):
  """Writes a checkpoint-style tokenizer directory and returns its path as str."""
  os.makedirs(path, exist_ok=True)
  if tokenizer_json:
    tok.save(os.path.join(path, 'tokenizer.json'))
  if config is not None:
    _write_json(os.path.join(path, 'tokenizer_config.json'), config)
  if template_file is not None:
    with open(os.path.join(path, 'chat_template.jinja'), 'w', encoding='utf-8') as f:
      f.write(template_file)
  if generation_config is not None:
    _write_json(os.path.join(path, 'generation_config.json'), generation_config)
  return str(path)


def _chatml_config(**overrides):
  # bos and pad as plain strings, eos in the {"content": ...} dict form.
  config = {
    'bos_token': '<|endoftext|>',
    'eos_token': {
      '__type': 'AddedToken',
      'content': '<|im_end|>',
      'lstrip': False,
      'normalized': False,
      'rstrip': False,
      'single_word': False,
      'special': True,
    },
    'pad_token': '<pad>',
    'chat_template': CHATML_TEMPLATE,
  }
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def chatml_dir(tmp_path_factory, trained):
  return _make_dir(tmp_path_factory.mktemp('chatml'), trained, config=_chatml_config())


@pytest.fixture(scope='module')
def jrl_tok(chatml_dir):
  return T.HFTokenizer.from_dir(chatml_dir)


@pytest.fixture(scope='module')
def hf_tok(chatml_dir):
  return transformers.AutoTokenizer.from_pretrained(chatml_dir)


# ----------------------------------------------------------------------------
# HFTokenizer.from_dir: parity with transformers on the same directory.


def test_special_tokens_and_ids(jrl_tok, trained):
  ids = {t: trained.token_to_id(t) for t in SPECIAL_TOKENS}
  assert len(set(ids.values())) == len(SPECIAL_TOKENS)
  assert jrl_tok.bos_token == '<|endoftext|>'
  assert jrl_tok.eos_token == '<|im_end|>'  # read from the {"content": ...} form
  assert jrl_tok.pad_token == '<pad>'
  assert jrl_tok.bos_id == ids['<|endoftext|>']
  assert jrl_tok.eos_ids == (ids['<|im_end|>'],)
  assert jrl_tok.pad_id == ids['<pad>']
  assert jrl_tok.vocab_size == trained.get_vocab_size(with_added_tokens=True)
  assert jrl_tok.chat_template_source == CHATML_TEMPLATE


def test_special_ids_match_transformers(jrl_tok, hf_tok):
  assert jrl_tok.bos_id == hf_tok.bos_token_id
  assert jrl_tok.eos_ids == (hf_tok.eos_token_id,)
  assert jrl_tok.pad_id == hf_tok.pad_token_id
  assert jrl_tok.vocab_size == len(hf_tok)


@pytest.mark.parametrize('text', TEXTS)
def test_encode_decode_match_transformers(jrl_tok, hf_tok, text):
  ids = jrl_tok.encode(text)
  assert ids == hf_tok.encode(text, add_special_tokens=False)
  assert jrl_tok.decode(ids) == hf_tok.decode(ids) == text
  assert jrl_tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(
    ids, skip_special_tokens=True
  )


def test_special_tokens_encode_to_single_ids(jrl_tok, trained):
  ids = jrl_tok.encode('<|im_start|>user\nHi<|im_end|>')
  assert ids[0] == trained.token_to_id('<|im_start|>')
  assert ids[-1] == trained.token_to_id('<|im_end|>')
  assert jrl_tok.decode(ids, skip_special_tokens=True) == 'user\nHi'


def test_decode_accepts_any_int_sequence(jrl_tok):
  ids = jrl_tok.encode('Hello, world!')
  assert jrl_tok.decode(tuple(ids)) == 'Hello, world!'
  assert jrl_tok.decode(iter(ids)) == 'Hello, world!'


@pytest.mark.parametrize('add_generation_prompt', [True, False])
@pytest.mark.parametrize('name', sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(jrl_tok, hf_tok, name, add_generation_prompt):
  messages = CONVERSATIONS[name]
  got = jrl_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  want = hf_tok.apply_chat_template(
    messages, tokenize=False, add_generation_prompt=add_generation_prompt
  )
  assert got == want
  # And the prompt tokenizes the same way.
  assert jrl_tok.encode(got) == hf_tok.encode(want, add_special_tokens=False)


def test_chat_template_with_tools_kwarg_matches_transformers(jrl_tok, hf_tok):
  messages = CONVERSATIONS['user_only']
  got = jrl_tok.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)
  want = hf_tok.apply_chat_template(
    messages, tokenize=False, add_generation_prompt=True, tools=TOOLS
  )
  assert got == want
  assert '"description": "Doubles x, naïvely."' in got  # tojson keeps non-ASCII
  assert '\n  {\n    "type": "function",' in got  # indent=2 reached json.dumps


def test_chat_template_hand_written_expected(jrl_tok):
  """The rendered prompt spelled out, independent of transformers."""
  got = jrl_tok.apply_chat_template(CONVERSATIONS['with_system'], add_generation_prompt=True)
  assert got == (
    '<|endoftext|>\n'
    '<|im_start|>system\nYou answer in one word.<|im_end|>\n'
    '<|im_start|>user\nHow are you today?<|im_end|>\n'
    '<|im_start|>assistant\nFine.<|im_end|>\n'
    '<|im_start|>user\nAnd the fox?<|im_end|>\n'
    '<|im_start|>assistant\n'
  )
  got = jrl_tok.apply_chat_template(CONVERSATIONS['user_only'], add_generation_prompt=False)
  assert got == (
    '<|endoftext|>\n'
    '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'
    '<|im_start|>user\nHello, world!<|im_end|>\n'
  )


def test_chat_template_default_add_generation_prompt_is_true(jrl_tok):
  messages = CONVERSATIONS['user_only']
  assert jrl_tok.apply_chat_template(messages) == jrl_tok.apply_chat_template(
    messages, add_generation_prompt=True
  )
  assert jrl_tok.apply_chat_template(messages).endswith('<|im_end|>\n<|im_start|>assistant\n')


def test_tojson_is_not_html_escaped_nor_ascii_only(jrl_tok):
  """jinja2's built-in `tojson` would write \\u0027, \\u003c, \\u0026; HF's does not."""
  got = jrl_tok.apply_chat_template(CONVERSATIONS['tool'], add_generation_prompt=False)
  assert '<|im_start|>tool\n{"output": "résultat: \\"4\\" <ok> & done"}<|im_end|>\n' in got


def test_invalid_role_raises_template_error(jrl_tok, hf_tok):
  messages = [{'role': 'user', 'content': 'hi'}, {'role': 'wizard', 'content': 'abracadabra'}]
  with pytest.raises(jinja2.exceptions.TemplateError, match=r'^Invalid role: wizard$'):
    jrl_tok.apply_chat_template(messages)
  # transformers raises the same error from the same template.
  with pytest.raises(jinja2.exceptions.TemplateError, match=r'^Invalid role: wizard$'):
    hf_tok.apply_chat_template(messages, tokenize=False)


def test_chat_template_is_sandboxed(tmp_path, trained):
  template = '{{ messages.__class__.__mro__ }}'
  path = _make_dir(tmp_path, trained, config={'chat_template': template})
  with pytest.raises(jinja2.exceptions.SecurityError):
    T.HFTokenizer.from_dir(path).apply_chat_template(CONVERSATIONS['user_only'])


def test_chat_template_cannot_mutate_messages(tmp_path, trained):
  """The environment is immutable: a template cannot edit the caller's messages."""
  template = "{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}"
  path = _make_dir(tmp_path, trained, config={'chat_template': template})
  messages = [dict(m) for m in CONVERSATIONS['user_only']]
  with pytest.raises(jinja2.exceptions.SecurityError):
    T.HFTokenizer.from_dir(path).apply_chat_template(messages)
  assert messages == CONVERSATIONS['user_only']


def test_strftime_now_and_loopcontrols(tmp_path, trained):
  template = (
    "{{ strftime_now('%Y') }}|"
    '{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}'
    "{{ m['content'] }}{% endfor %}"
  )
  path = _make_dir(tmp_path, trained, config={'chat_template': template})
  before = datetime.datetime.now().strftime('%Y')
  got = T.HFTokenizer.from_dir(path).apply_chat_template(CONVERSATIONS['with_system'])
  after = datetime.datetime.now().strftime('%Y')
  assert got in (f'{before}|You answer in one word.', f'{after}|You answer in one word.')


def test_template_sees_unset_special_tokens_as_empty(tmp_path, trained):
  template = '[{{ bos_token }}][{{ eos_token }}][{{ pad_token }}]'
  path = _make_dir(tmp_path, trained, config={'chat_template': template})
  assert T.HFTokenizer.from_dir(path).apply_chat_template([]) == '[][][]'


def test_unpassed_tools_and_documents_render_like_transformers(tmp_path, trained):
  """transformers always passes `tools` and `documents` (None when not given) to
  the template, so `tools is none` holds there when the caller passes no tools."""
  template = (
    '{% if tools is not none %}TOOLS {% endif %}'
    '{% if documents is none %}no-docs {% endif %}'
    "{{ messages[-1]['content'] }}"
  )
  path = _make_dir(tmp_path, trained, config=_chatml_config(chat_template=template))
  messages = CONVERSATIONS['user_only']
  want = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
    messages, tokenize=False
  )
  assert want == 'no-docs Hello, world!'
  assert T.HFTokenizer.from_dir(path).apply_chat_template(messages) == want


# ----------------------------------------------------------------------------
# Where the template and the extra eos ids come from.


def test_chat_template_jinja_file_is_read(tmp_path, trained):
  config = _chatml_config()
  del config['chat_template']
  path = _make_dir(tmp_path, trained, config=config, template_file=CHATML_TEMPLATE)
  tok = T.HFTokenizer.from_dir(path)
  assert tok.chat_template_source == CHATML_TEMPLATE
  hf = transformers.AutoTokenizer.from_pretrained(path)
  for messages in CONVERSATIONS.values():
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == want


def test_chat_template_jinja_file_without_tokenizer_config(tmp_path, trained):
  path = _make_dir(tmp_path, trained, template_file='{{ messages | length }} messages')
  tok = T.HFTokenizer.from_dir(path)
  assert tok.apply_chat_template(CONVERSATIONS['with_system']) == '4 messages'
  assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (None, (), 0)


def test_chat_template_jinja_file_with_invalid_utf8_names_the_file(tmp_path, trained):
  # Before: a bare UnicodeDecodeError that named no file.
  path = _make_dir(tmp_path, trained)
  jinja_path = os.path.join(path, 'chat_template.jinja')
  with open(jinja_path, 'wb') as f:
    f.write(b'{{ messages | length }} \xff messages')
  with pytest.raises(ValueError, match=re.escape(f'{jinja_path}: invalid UTF-8')):
    T.HFTokenizer.from_dir(path)


def test_chat_template_jinja_file_takes_priority_like_transformers(tmp_path, trained):
  """transformers: "If independent chat template file(s) exist, they take priority
  over template entries in the tokenizer config"."""
  path = _make_dir(
    tmp_path,
    trained,
    config=_chatml_config(chat_template='from tokenizer_config.json'),
    template_file='from chat_template.jinja',
  )
  messages = CONVERSATIONS['user_only']
  want = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
    messages, tokenize=False
  )
  assert want == 'from chat_template.jinja'
  assert T.HFTokenizer.from_dir(path).apply_chat_template(messages) == want


def test_named_chat_templates_use_default(tmp_path, trained):
  named = [
    {'name': 'tool_use', 'template': 'TOOL USE {{ messages | length }}'},
    {'name': 'default', 'template': CHATML_TEMPLATE},
    {'name': 'rag', 'template': 'RAG'},
  ]
  path = _make_dir(tmp_path, trained, config=_chatml_config(chat_template=named))
  tok = T.HFTokenizer.from_dir(path)
  assert tok.chat_template_source == CHATML_TEMPLATE
  hf = transformers.AutoTokenizer.from_pretrained(path)
  for messages in CONVERSATIONS.values():
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == want


def test_named_chat_templates_without_default_fall_back_to_jinja_file(tmp_path, trained):
  named = [{'name': 'rag', 'template': 'RAG'}]
  path = _make_dir(
    tmp_path, trained, config=_chatml_config(chat_template=named), template_file='FILE'
  )
  assert T.HFTokenizer.from_dir(path).apply_chat_template([]) == 'FILE'


@pytest.mark.parametrize(
  'gen_eos, want',
  [
    # int: added after the tokenizer_config eos.
    ('im_start', ('im_end', 'im_start')),
    # int equal to the tokenizer_config eos: not duplicated.
    ('im_end', ('im_end',)),
    # list: order kept, duplicates of the config eos and within the list dropped.
    (['endoftext', 'im_end', 'endoftext', 'im_start'], ('im_end', 'endoftext', 'im_start')),
    ([], ('im_end',)),
    (None, ('im_end',)),
  ],
)
def test_generation_config_eos_ids(tmp_path, trained, gen_eos, want):
  name_to_id = {
    'endoftext': trained.token_to_id('<|endoftext|>'),
    'im_start': trained.token_to_id('<|im_start|>'),
    'im_end': trained.token_to_id('<|im_end|>'),
  }
  if isinstance(gen_eos, str):
    gen_eos = name_to_id[gen_eos]
  elif isinstance(gen_eos, list):
    gen_eos = [name_to_id[n] for n in gen_eos]
  path = _make_dir(
    tmp_path,
    trained,
    config=_chatml_config(),
    generation_config={'bos_token_id': 0, 'eos_token_id': gen_eos},
  )
  tok = T.HFTokenizer.from_dir(path)
  assert tok.eos_ids == tuple(name_to_id[n] for n in want)
  assert tok.pad_id == trained.token_to_id('<pad>')  # pad is unaffected


def test_generation_config_without_eos_key(tmp_path, trained):
  path = _make_dir(
    tmp_path, trained, config=_chatml_config(), generation_config={'temperature': 0.7}
  )
  assert T.HFTokenizer.from_dir(path).eos_ids == (trained.token_to_id('<|im_end|>'),)


def test_generation_config_eos_without_tokenizer_config(tmp_path, trained):
  ids = [trained.token_to_id('<|im_end|>'), trained.token_to_id('<|endoftext|>')]
  path = _make_dir(tmp_path, trained, generation_config={'eos_token_id': ids})
  tok = T.HFTokenizer.from_dir(path)
  assert tok.eos_ids == tuple(ids)
  assert tok.pad_id == ids[0]  # no pad token: first eos id


@pytest.mark.parametrize('eos_form', ['string', 'dict'])
def test_pad_id_falls_back_to_first_eos(tmp_path, trained, eos_form):
  eos = '<|endoftext|>' if eos_form == 'string' else {'content': '<|endoftext|>'}
  config = {'bos_token': {'content': '<|im_start|>'}, 'eos_token': eos}
  gen = {'eos_token_id': [trained.token_to_id('<|im_end|>')]}
  path = _make_dir(tmp_path, trained, config=config, generation_config=gen)
  tok = T.HFTokenizer.from_dir(path)
  assert tok.pad_token is None
  assert tok.bos_id == trained.token_to_id('<|im_start|>')
  assert tok.eos_ids == (trained.token_to_id('<|endoftext|>'), trained.token_to_id('<|im_end|>'))
  assert tok.pad_id == trained.token_to_id('<|endoftext|>')


def test_pad_id_with_null_pad_token_falls_back_to_eos(tmp_path, trained):
  config = _chatml_config(pad_token=None)
  path = _make_dir(tmp_path, trained, config=config)
  tok = T.HFTokenizer.from_dir(path)
  assert tok.pad_id == trained.token_to_id('<|im_end|>')


def test_no_special_tokens_anywhere(tmp_path, trained):
  path = _make_dir(tmp_path, trained)
  tok = T.HFTokenizer.from_dir(path)
  assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (None, (), 0)
  assert tok.encode('Hello, world!') == trained.encode('Hello, world!').ids


# ----------------------------------------------------------------------------
# Errors name the file or the missing piece.


def test_missing_tokenizer_json(tmp_path, trained):
  path = _make_dir(tmp_path, trained, config=_chatml_config(), tokenizer_json=False)
  with pytest.raises(FileNotFoundError, match=r'tokenizer\.json'):
    T.HFTokenizer.from_dir(path)
  with pytest.raises(FileNotFoundError, match=r'tokenizer\.json'):
    T.load_tokenizer(path)


def test_missing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match=r'tokenizer\.json'):
    T.HFTokenizer.from_dir(str(tmp_path / 'does_not_exist'))


@pytest.mark.parametrize(
  'content', ['{"version": "1.0", "model": ', 'not json at all', '{"model": {"type": "Nope"}}']
)
def test_corrupt_tokenizer_json(tmp_path, content):
  tok_path = tmp_path / 'tokenizer.json'
  tok_path.write_text(content, encoding='utf-8')
  with pytest.raises(ValueError, match=r'tokenizer\.json') as info:
    T.HFTokenizer.from_dir(str(tmp_path))
  assert str(tok_path) in str(info.value)


@pytest.mark.parametrize('name', ['tokenizer_config.json', 'generation_config.json'])
def test_invalid_json_in_optional_config(tmp_path, trained, name):
  _make_dir(tmp_path, trained)
  (tmp_path / name).write_text('{"bos_token": "<s>",', encoding='utf-8')
  with pytest.raises(ValueError, match='invalid JSON') as info:
    T.HFTokenizer.from_dir(str(tmp_path))
  assert str(tmp_path / name) in str(info.value)


def test_apply_chat_template_without_template(tmp_path, trained):
  config = _chatml_config()
  del config['chat_template']
  path = _make_dir(tmp_path, trained, config=config)
  tok = T.HFTokenizer.from_dir(path)
  assert tok.chat_template_source is None
  with pytest.raises(ValueError, match='chat_template'):
    tok.apply_chat_template(CONVERSATIONS['user_only'])
  # Encoding and decoding still work without a template.
  assert tok.decode(tok.encode('Hello, world!')) == 'Hello, world!'


# ----------------------------------------------------------------------------
# CharTokenizer.

PRINTABLE = '\n' + ''.join(chr(c) for c in range(32, 127))


def test_char_vocab_and_special_ids():
  tok = T.CharTokenizer()
  assert tok.vocab_size == 3 + 95 + 1  # pad/bos/eos, printable ASCII, newline
  assert (tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, (2,))
  assert (tok.pad_token, tok.bos_token, tok.eos_token) == ('<pad>', '<bos>', '<eos>')
  assert tok.decode([0, 1, 2]) == '<pad><bos><eos>'


def test_char_round_trip_all_characters():
  tok = T.CharTokenizer()
  text = PRINTABLE + string.ascii_letters + '\n'
  ids = tok.encode(text)
  assert len(ids) == len(text)
  assert tok.decode(ids) == text
  # Every character has its own id, none of them special, all in the vocabulary.
  char_ids = tok.encode(PRINTABLE)
  assert sorted(char_ids) == list(range(3, tok.vocab_size))
  assert tok.encode('\n') == [3]
  assert tok.encode(' ') == [4]
  assert tok.encode('~') == [tok.vocab_size - 1]


def test_char_encode_empty():
  tok = T.CharTokenizer()
  assert tok.encode('') == []
  assert tok.encode('', add_special_tokens=True) == [1]
  assert tok.decode([]) == ''


def test_char_add_special_tokens_prepends_bos():
  tok = T.CharTokenizer()
  assert tok.encode('ab', add_special_tokens=True) == [1, *tok.encode('ab')]
  assert tok.encode('ab', add_special_tokens=False) == tok.encode('ab')


def test_char_skip_special_tokens():
  tok = T.CharTokenizer()
  ids = [1, *tok.encode('hi there'), 2, 0, 0]
  assert tok.decode(ids) == '<bos>hi there<eos><pad><pad>'
  assert tok.decode(ids, skip_special_tokens=True) == 'hi there'


def test_char_decode_accepts_numpy_ints():
  tok = T.CharTokenizer()
  ids = np.asarray(tok.encode('abc'), np.int32)
  assert tok.decode(ids) == 'abc'


@pytest.mark.parametrize(
  'text, char, offset', [('héllo', 'é', 1), ('tab\there', '\t', 3), ('ok\r\n', '\r', 2)]
)
def test_char_out_of_vocabulary_raises(text, char, offset):
  with pytest.raises(ValueError) as info:
    T.CharTokenizer().encode(text)
  message = str(info.value)
  assert repr(char) in message
  assert f'offset {offset}' in message
  assert f'(U+{ord(char):04X})' in message and "not in the char tokenizer's vocabulary" in message


@pytest.mark.parametrize('bad_id', [99, 100, 10**6, -1, -3, -4])
def test_char_out_of_range_id_raises(bad_id):
  """Negative ids are outside the vocabulary too: they must not index SPECIALS
  from the end (-1 would decode as '<eos>')."""
  tok = T.CharTokenizer()
  assert tok.vocab_size == 99
  with pytest.raises(ValueError, match=str(bad_id)):
    tok.decode([5, bad_id])


def test_char_chat_template():
  tok = T.CharTokenizer()
  messages = CONVERSATIONS['with_system']
  body = (
    'system: You answer in one word.\n'
    'user: How are you today?\n'
    'assistant: Fine.\n'
    'user: And the fox?\n'
  )
  assert tok.apply_chat_template(messages) == body + 'assistant: '
  assert tok.apply_chat_template(messages, add_generation_prompt=True) == body + 'assistant: '
  assert tok.apply_chat_template(messages, add_generation_prompt=False) == body
  assert tok.apply_chat_template([], add_generation_prompt=False) == ''
  # Extra template kwargs are accepted and ignored, as HF templates accept them.
  assert tok.apply_chat_template(messages, tools=TOOLS) == body + 'assistant: '
  # The prompt encodes within the character vocabulary.
  assert tok.decode(tok.encode(body)) == body


def test_load_tokenizer(chatml_dir):
  tok = T.load_tokenizer('char')
  assert isinstance(tok, T.CharTokenizer)
  assert tok.decode(tok.encode('abc')) == 'abc'
  hf = T.load_tokenizer(chatml_dir)
  assert isinstance(hf, T.HFTokenizer)
  assert hf.encode('Hello') == T.HFTokenizer.from_dir(chatml_dir).encode('Hello')
