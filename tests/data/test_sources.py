"""Tests for jrl.data.sources: the JSONL readers name the file and the line of
the first bad row (invalid UTF-8, or whatever the caller's `check` refuses),
and read good files unchanged.
"""

import json
import re

import pytest

from jrl.data import sources

ROWS = {
  'read_jsonl': {'prompt': '1+1=', 'answer': '2'},
  'read_sft_jsonl': {'prompt': '1+1=', 'response': '2'},
  'read_preference_jsonl': {'prompt': '1+1=', 'chosen': '2', 'rejected': '3'},
  'read_unlabelled_pairs_jsonl': {'prompt': '1+1=', 'completion_a': '2', 'completion_b': '3'},
}


def write(path, lines):
  with open(path, 'wb') as f:
    f.write(b'\n'.join(lines) + b'\n')
  return str(path)


def good_lines(reader, n=20):
  return [json.dumps(ROWS[reader]).encode() for _ in range(n)]


@pytest.mark.parametrize('reader', sorted(ROWS))
@pytest.mark.parametrize(
  ('bad', 'column', 'byte'),
  [
    (b'{"prompt": "1+\xff="}', 15, 'ff'),  # never valid in UTF-8
    (b'{"prompt": "\xe2\x82"}', 13, 'e2'),  # a truncated 3-byte sequence ('€' is e2 82 ac)
    (b'\xc0\xaf', 1, 'c0'),  # an overlong encoding of '/'
  ],
  ids=['ff', 'truncated', 'overlong'],
)
def test_invalid_utf8_names_file_line_and_column(tmp_path, reader, bad, column, byte):
  # Before: UnicodeDecodeError "'utf-8' codec can't decode byte 0x.. in
  # position <offset in the read buffer>", naming neither file nor line.
  lines = good_lines(reader)
  lines[16] = bad
  path = write(tmp_path / 'rows.jsonl', lines)
  with pytest.raises(ValueError) as info:
    getattr(sources, reader)(path)
  assert str(info.value).startswith(f'{path}:17: invalid UTF-8 (byte 0x{byte} at column {column}: ')


def test_valid_utf8_and_blank_lines_read_unchanged(tmp_path):
  rows = [{'prompt': 'Combien coûte 3 €?', 'answer': '3'}, {'prompt': '日本', 'answer': 'x'}]
  lines = [json.dumps(rows[0], ensure_ascii=False).encode(), b'', json.dumps(rows[1]).encode()]
  path = write(tmp_path / 'rows.jsonl', lines)
  assert sources.read_jsonl(path) == rows


@pytest.mark.parametrize('reader', ['read_jsonl', 'read_sft_jsonl', 'read_preference_jsonl'])
def test_check_errors_get_the_file_and_line(tmp_path, reader):
  lines = good_lines(reader)
  lines.insert(3, b'')  # blank lines count: line numbers are the file's
  path = write(tmp_path / 'rows.jsonl', lines)
  seen = []

  def check(item):
    seen.append(item)
    if len(seen) == 6:
      raise ValueError('field `prompt`: not today.')

  with pytest.raises(ValueError, match=re.escape(f'{path}:7: field `prompt`: not today.')):
    getattr(sources, reader)(path, check=check)
  assert seen[0]['prompt'] == '1+1='
