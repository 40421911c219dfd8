"""Chat templates of each model family: jrl renders and encodes them as transformers does.

Each family formats a conversation its own way: Llama 3 with header ids,
Qwen (2, 2.5, 3 and the MoE) with ChatML and, for Qwen3, a thinking block
that `enable_thinking=False` closes empty; Gemma 2 / 3 with
`<start_of_turn>` turns, the assistant named `model` and no system role (the
system text opens the first user turn); Mistral with `[INST]` blocks and
strict user / assistant alternation. The templates below are written here
in each family's turn format (none is downloaded), each in a tokenizer
directory trained in the test with the family's special tokens and its
generation_config.json stop ids. For every family, jrl's `HFTokenizer`
renders the same prompt text as `transformers.AutoTokenizer` from the same
directory, the task encoder's prompt ids equal transformers' tokenized
template (one BOS, whether the template writes it or the encoder adds it),
the stop ids include the family's end-of-turn token, and a conversation the
template refuses raises the same error in both.
"""

import json
import os

import jinja2
import pytest
import transformers

from jrl.data import tasks
from jrl.models import tokenizer as T
from tests.helpers import train_byte_bpe

LLAMA3 = """{{ bos_token -}}
{% for message in messages %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{%- endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# ChatML; earlier assistant turns lose their reasoning, and with
# enable_thinking=False the generation prompt closes an empty thinking block.
QWEN3 = """{% for message in messages %}
  {% set content = message['content'] %}
  {% if message['role'] == 'assistant' and not loop.last %}
    {% set content = content.split('</think>')[-1].lstrip('\\n') %}
  {% endif %}
<|im_start|>{{ message['role'] }}
{{ content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
  {% if enable_thinking is defined and not enable_thinking %}
<think>

</think>

  {% endif %}
{% endif %}"""

# Gemma: no system role (its text opens the first user turn), the assistant
# is `model`, and turns must alternate starting with the user.
GEMMA = """{{ bos_token -}}
{% set prefix = '' %}
{% set turns = messages %}
{% if messages and messages[0]['role'] == 'system' %}
  {% set prefix = messages[0]['content'] + '\\n\\n' %}
  {% set turns = messages[1:] %}
{% endif %}
{% for message in turns %}
  {% if (message['role'] == 'user') != loop.index0 is even %}
    {{ raise_exception('Turns must alternate: user, assistant, user, ...') }}
  {% endif %}
  {% set text = (prefix if loop.first else '') + message['content'] %}
<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}
{{ text | trim }}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}
<start_of_turn>model
{% endif %}"""

# Mistral: [INST] blocks, the system text inside the first one, answers
# closed by the eos token; no BOS in the template (the encoder adds it).
MISTRAL = """{% set system = '' %}
{% set turns = messages %}
{% if messages and messages[0]['role'] == 'system' %}
  {% set system = messages[0]['content'] + '\\n\\n' %}
  {% set turns = messages[1:] %}
{% endif %}
{% for message in turns %}
  {% if (message['role'] == 'user') != loop.index0 is even %}
    {{ raise_exception('Turns must alternate: user, assistant, user, ...') }}
  {% endif %}
  {% if message['role'] == 'user' %}
[INST] {{ (system if loop.first else '') + message['content'] }} [/INST]
  {%- else %}
 {{ message['content'] }}{{ eos_token }}
  {%- endif %}
{% endfor %}"""

# family: (template, special tokens, bos, eos, generation-config stop tokens,
# encoder add_bos, the end-of-turn token).
FAMILIES = {
  'llama3': (
    LLAMA3,
    [
      '<|begin_of_text|>',
      '<|end_of_text|>',
      '<|start_header_id|>',
      '<|end_header_id|>',
      '<|eot_id|>',
    ],
    '<|begin_of_text|>',
    '<|eot_id|>',
    ['<|end_of_text|>', '<|eot_id|>'],
    False,
    '<|eot_id|>',
  ),
  'qwen3': (
    QWEN3,
    ['<|endoftext|>', '<|im_start|>', '<|im_end|>', '<think>', '</think>'],
    None,
    '<|im_end|>',
    ['<|im_end|>', '<|endoftext|>'],
    False,
    '<|im_end|>',
  ),
  'gemma': (
    GEMMA,
    ['<pad>', '<eos>', '<bos>', '<start_of_turn>', '<end_of_turn>'],
    '<bos>',
    '<eos>',
    ['<eos>', '<end_of_turn>'],
    True,  # the template writes <bos> too: the encoder must not add a second
    '<end_of_turn>',
  ),
  'mistral': (
    MISTRAL,
    ['<unk>', '<s>', '</s>', '[INST]', '[/INST]'],
    '<s>',
    '</s>',
    ['</s>'],
    True,
    '</s>',
  ),
}

CORPUS = [
  'What is 2 + 3? The answer is 5.',
  'You answer with a number only.',
  'Let me think about it first, then answer.',
  'Café, naïve — 日本語 😀',
]

CONVERSATIONS = {
  'user_only': [{'role': 'user', 'content': 'What is 2 + 3?'}],
  'with_system': [
    {'role': 'system', 'content': 'You answer with a number only.'},
    {'role': 'user', 'content': 'What is 2 + 3?'},
  ],
  'multi_turn': [
    {'role': 'system', 'content': 'You answer with a number only.'},
    {'role': 'user', 'content': 'What is 2 + 3?'},
    {'role': 'assistant', 'content': '<think>\nadd them\n</think>\n\n5'},
    {'role': 'user', 'content': 'Café, naïve — 日本語 😀  '},
  ],
}


def _directory(root, family):
  template, specials, bos, eos, stops, _, _ = FAMILIES[family]
  tok = train_byte_bpe(CORPUS, specials, 320)
  path = os.path.join(root, family)
  os.makedirs(path)
  tok.save(os.path.join(path, 'tokenizer.json'))
  config = {'eos_token': eos, 'pad_token': specials[0], 'chat_template': template}
  config['bos_token'] = bos
  with open(os.path.join(path, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, ensure_ascii=False)
  with open(os.path.join(path, 'generation_config.json'), 'w') as f:
    json.dump({'eos_token_id': [tok.token_to_id(s) for s in stops]}, f)
  return path


@pytest.fixture(scope='module')
def tokenizer_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp('families')
  return {family: _directory(root, family) for family in FAMILIES}


def _pair(tokenizer_dirs, family):
  path = tokenizer_dirs[family]
  return T.HFTokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize('add_generation_prompt', [True, False])
@pytest.mark.parametrize('conversation', sorted(CONVERSATIONS))
@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_each_family_renders_as_transformers(
  tokenizer_dirs, family, conversation, add_generation_prompt
):
  ours, theirs = _pair(tokenizer_dirs, family)
  messages = CONVERSATIONS[conversation]
  if family == 'mistral' and not add_generation_prompt:
    messages = messages[:3] if len(messages) > 3 else messages  # end on an answer or a question
  got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  want = theirs.apply_chat_template(
    messages, tokenize=False, add_generation_prompt=add_generation_prompt
  )
  assert got == want
  assert ours.encode(got) == theirs.encode(want, add_special_tokens=False)


def test_the_families_formats_spelled_out(tokenizer_dirs):
  """The prompt texts, independent of transformers: what makes each family's format."""
  messages = CONVERSATIONS['multi_turn']
  render = lambda family, **kw: T.HFTokenizer.from_dir(tokenizer_dirs[family]).apply_chat_template(
    messages, **kw
  )
  assert render('gemma') == (
    '<bos><start_of_turn>user\nYou answer with a number only.\n\nWhat is 2 + 3?<end_of_turn>\n'
    '<start_of_turn>model\n<think>\nadd them\n</think>\n\n5<end_of_turn>\n'
    '<start_of_turn>user\nCafé, naïve — 日本語 😀<end_of_turn>\n'
    '<start_of_turn>model\n'
  )
  assert render('mistral') == (
    '[INST] You answer with a number only.\n\nWhat is 2 + 3? [/INST] '
    '<think>\nadd them\n</think>\n\n5</s>[INST] Café, naïve — 日本語 😀   [/INST]'
  )
  # Qwen3 drops the earlier turn's reasoning; enable_thinking=False closes an empty block.
  assert render('qwen3', enable_thinking=False) == (
    '<|im_start|>system\nYou answer with a number only.<|im_end|>\n'
    '<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n'
    '<|im_start|>assistant\n5<|im_end|>\n'
    '<|im_start|>user\nCafé, naïve — 日本語 😀  <|im_end|>\n'
    '<|im_start|>assistant\n<think>\n\n</think>\n\n'
  )
  assert render('qwen3').endswith('<|im_start|>assistant\n')
  assert render('llama3') == (
    '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n'
    'You answer with a number only.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n'
    'What is 2 + 3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    '<think>\nadd them\n</think>\n\n5<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n'
    'Café, naïve — 日本語 😀<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
  )


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_the_task_encoder_gives_transformers_prompt_ids(tokenizer_dirs, family):
  """What the trainer samples from: `tasks.Encoder` with the family's template
  (and `task.chat_template_kwargs`) encodes a prompt to the ids of
  transformers' tokenized template, with exactly one BOS where the family
  has one, and the stop ids hold the end-of-turn token."""
  ours, theirs = _pair(tokenizer_dirs, family)
  _, _, bos, _, stops, add_bos, end_of_turn = FAMILIES[family]
  kwargs = {'enable_thinking': False} if family == 'qwen3' else {}
  encoder = tasks.Encoder(
    ours, True, add_bos, system_prompt='You answer with a number only.', template_kwargs=kwargs
  )
  got = encoder.prompt_ids('What is 2 + 3?')
  want = theirs.apply_chat_template(
    CONVERSATIONS['with_system'], tokenize=True, add_generation_prompt=True, **kwargs
  )
  want = list(want['input_ids'] if hasattr(want, 'keys') else want)
  if add_bos and want[:1] != [ours.bos_id]:
    want = [ours.bos_id, *want]  # the template writes no BOS: the encoder adds it
  assert got == want
  assert got.count(ours.bos_id) == (0 if bos is None else 1)
  # Sampling stops at the family's end of turn (generation_config.json's ids).
  stop_ids = {theirs.convert_tokens_to_ids(s) for s in stops}
  assert set(ours.eos_ids) == stop_ids | {theirs.eos_token_id}
  assert theirs.convert_tokens_to_ids(end_of_turn) in ours.eos_ids


@pytest.mark.parametrize('family', ['gemma', 'mistral'])
def test_a_conversation_the_template_refuses_raises_the_same_error(tokenizer_dirs, family):
  ours, theirs = _pair(tokenizer_dirs, family)
  messages = [{'role': 'user', 'content': 'a'}, {'role': 'user', 'content': 'b'}]
  with pytest.raises(jinja2.exceptions.TemplateError, match='must alternate') as mine:
    ours.apply_chat_template(messages)
  with pytest.raises(jinja2.exceptions.TemplateError) as hf:
    theirs.apply_chat_template(messages, tokenize=False)
  assert str(mine.value) == str(hf.value)
