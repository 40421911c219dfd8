"""The peer figure of `launch/bench.py grpo --setup real`: TRL's GRPOTrainer on
the same model, prompts and settings, in a virtual environment of its own.

torch, transformers and TRL are never dependencies of jrl; this script
imports nothing from it (the system prompt is read from the config file's
text), so it runs in a venv that holds only the peer:

    python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch trl accelerate
    python launch/make_word_problems.py --out data/word_problems --mix 3,1,1   # jrl's venv
    /tmp/trl-venv/bin/python launch/bench_trl.py --model models/smollm2 \\
        --data data/word_problems/train.jsonl --steps 3 --out trl.json

One step: --prompts prompts x --group completions of exactly --completion
new tokens (the end tokens forbidden until then, `min_new_tokens`), sampled
at temperature 1 with transformers' `generate`, then one optimiser update
over all of them (micro-batches of --micro_batch rows, gradient
accumulation), float32, --threads threads, no gradient checkpointing; the
reward is the word problem's "The answer is N" check. Per step it prints
and records the seconds of generation (`model.generate`), of the reference
forward (beta > 0) and of the rest (the update); medians leave out the
first step, as jrl's bench does.
"""

import argparse
import ast
import json
import os
import re
import resource
import statistics
import time

try:  # imported as launch.<module> (tests), or run as a script from launch/
  from launch import machine
except ImportError:
  import machine


def system_prompt(path):
  """The SYSTEM_PROMPT string constant of a config file (read, not imported)."""
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  for node in tree.body:
    if isinstance(node, ast.Assign) and any(
      getattr(t, 'id', '') == 'SYSTEM_PROMPT' for t in node.targets
    ):
      return ast.literal_eval(node.value)
  raise SystemExit(f'{path}: no SYSTEM_PROMPT constant')


def answer_reward(completions, answer, **_):
  """1.0 when the completion's 'The answer is N' matches the row's final answer."""
  out = []
  for completion, truth in zip(completions, answer, strict=True):
    text = completion[-1]['content'] if isinstance(completion, list) else completion
    found = re.findall(r'answer is\s*\$?(-?[\d,]+(?:\.\d+)?)', text)
    want = truth.split('####')[-1].strip().replace(',', '')
    out.append(float(bool(found) and found[-1].replace(',', '').rstrip('.') == want))
  return out


class Clock:
  """Seconds spent in wrapped callables, per phase, since the last `take`."""

  def __init__(self):
    self.spent = {}

  def wrap(self, phase, fn):
    def timed(*args, **kwargs):
      start = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - start

    return timed

  def take(self):
    spent, self.spent = self.spent, {}
    return spent


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--model', default='models/smollm2', help='a Hugging Face directory')
  p.add_argument('--data', default='data/word_problems/train.jsonl', help='question/answer JSONL')
  p.add_argument('--system_prompt_from', default='configs/grpo_smollm2_gsm.py')
  p.add_argument('--prompts', type=int, default=8)
  p.add_argument('--group', type=int, default=8)
  p.add_argument('--completion', type=int, default=128, help='new tokens, exactly')
  p.add_argument('--micro_batch', type=int, default=8, help='rows per forward/backward')
  p.add_argument('--steps', type=int, default=3)
  p.add_argument('--beta', type=float, default=0.0, help='KL coefficient (> 0: reference model)')
  p.add_argument('--lr', type=float, default=1e-6)
  p.add_argument('--threads', type=int, default=2)
  p.add_argument('--out', default='', help='write the figures as JSON here')
  args = p.parse_args(argv)

  import torch
  import transformers
  import trl
  from datasets import Dataset

  torch.set_num_threads(args.threads)
  rows = []
  with open(args.data, encoding='utf-8') as f:
    for line in f:
      row = json.loads(line)
      rows.append(row)
  need = args.prompts * args.steps
  if len(rows) < need:
    raise SystemExit(f'{args.data}: {len(rows)} rows, {need} needed')
  system = system_prompt(args.system_prompt_from)
  data = Dataset.from_list(
    [
      {
        'prompt': [
          {'role': 'system', 'content': system},
          {'role': 'user', 'content': r['question']},
        ],
        'answer': r['answer'],
      }
      for r in rows[:need]
    ]
  )
  rows_per_step = args.prompts * args.group
  config = trl.GRPOConfig(
    output_dir=os.path.join('/tmp', f'trl-bench-{os.getpid()}'),
    per_device_train_batch_size=args.micro_batch,
    gradient_accumulation_steps=rows_per_step // args.micro_batch,
    num_generations=args.group,
    max_completion_length=args.completion,
    generation_kwargs={'min_new_tokens': args.completion},
    temperature=1.0,
    beta=args.beta,
    learning_rate=args.lr,
    max_steps=args.steps,
    num_iterations=1,
    logging_steps=1,
    save_strategy='no',
    report_to='none',
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    shuffle_dataset=False,
    seed=0,
  )
  model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(args.model)
  clock, steps = Clock(), []

  class Steps(transformers.TrainerCallback):
    def on_train_begin(self, *a, **k):
      self.start = time.perf_counter()

    def on_step_end(self, *a, **k):
      now = time.perf_counter()
      spent = clock.take()
      total = now - self.start
      self.start = now
      gen, ref = spent.get('generate', 0.0), spent.get('reference', 0.0)
      steps.append({'step': total, 'generate': gen, 'reference': ref, 'update': total - gen - ref})
      print(
        f'  step {len(steps)}/{args.steps}: {total:.1f} s (generate {gen:.1f}, reference '
        f'{ref:.1f}, update and the rest {total - gen - ref:.1f})',
        flush=True,
      )

  trainer = trl.GRPOTrainer(
    model=model,
    reward_funcs=answer_reward,
    args=config,
    train_dataset=data,
    processing_class=tok,
    callbacks=[Steps()],
  )
  trainer.model.generate = clock.wrap('generate', trainer.model.generate)
  if trainer.ref_model is not None:
    trainer.ref_model.forward = clock.wrap('reference', trainer.ref_model.forward)
  print(
    f'TRL {trl.__version__} GRPOTrainer (torch {torch.__version__}, {args.threads} threads): '
    f'{args.prompts} prompts x {args.group} completions of {args.completion} tokens, '
    f'micro-batches of {args.micro_batch}, beta {args.beta}, lr {args.lr}',
    flush=True,
  )
  trainer.train()
  steady = steps[1:] or steps
  med = {k: statistics.median(s[k] for s in steady) for k in steady[0]}
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  for k in ('generate', 'reference', 'update', 'step'):
    print(f'  {k:10s} {med[k]:8.3f} s')
  print(f'  process peak resident memory: {rss / 2**30:.2f} GiB', flush=True)
  if args.out:
    figures = {
      'peer': f'trl {trl.__version__}',
      'machine': machine.record(),
      'args': vars(args),
      'median_s': med,
      'steps': steps,
      'peak_rss_bytes': rss,
    }
    with open(args.out, 'w', encoding='utf-8') as f:
      json.dump(figures, f, indent=2)


if __name__ == '__main__':
  main()
