"""Turns unlabelled pairs into preference data with a generative judge (RLAIF).

    python launch/label.py --judge runs/judge/hf_export --tokenizer char \
        --rubric_file constitution.txt --input pairs.jsonl --output prefs.jsonl

Input rows: {"prompt", "completion_a", "completion_b"}. The judge (a jrl
causal LM, run through jrl's sampler with greedy decoding) sees each pair in
both orders; pairs it prefers consistently become {"prompt", "chosen",
"rejected"} rows (what `dpo.train_path` and `rm.train_path` read). Ties,
unparseable and inconsistent verdicts are dropped and counted, never
guessed; the counts are printed as JSON.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--judge', required=True, help='HF causal-LM checkpoint directory')
  parser.add_argument('--tokenizer', default='', help="'char' or a directory (default: --judge)")
  parser.add_argument('--rubric', default='', help='the rubric or constitution text')
  parser.add_argument('--rubric_file', default='', help='... or a file holding it')
  parser.add_argument('--input', required=True, help='JSONL of unlabelled pairs')
  parser.add_argument('--output', required=True, help='JSONL of preference rows')
  parser.add_argument('--max_new_tokens', type=int, default=512)
  parser.add_argument('--max_prompt_len', type=int, default=4096)
  parser.add_argument('--num_slots', type=int, default=16)
  parser.add_argument('--no_swap', action='store_true', help='judge one order only')
  opts = parser.parse_args(argv)
  if bool(opts.rubric) == bool(opts.rubric_file):
    parser.error('give exactly one of --rubric and --rubric_file')
  return opts


def main(argv=None):
  opts = parse_args(sys.argv[1:] if argv is None else argv)
  from jrl.data import read_unlabelled_pairs_jsonl
  from jrl.models.tokenizer import load_tokenizer
  from jrl.rewards.judge import GenerativeJudge, write_preference_jsonl

  rubric = opts.rubric
  if opts.rubric_file:
    with open(opts.rubric_file, encoding='utf-8') as f:
      rubric = f.read()
  rows = read_unlabelled_pairs_jsonl(opts.input)
  judge = GenerativeJudge.load(
    opts.judge,
    load_tokenizer(opts.tokenizer or opts.judge),
    rubric,
    mode='pairwise',
    max_new_tokens=opts.max_new_tokens,
    max_prompt_len=opts.max_prompt_len,
    num_slots=opts.num_slots,
    swap_positions=not opts.no_swap,
  )
  labelled, stats = judge.label_pairs(rows)
  write_preference_jsonl(opts.output, labelled)
  print(json.dumps({'input': len(rows), 'output': opts.output, **dict(stats)}, sort_keys=True))
  return stats


if __name__ == '__main__':
  main()
