"""Benchmark: one GRPO update's forward + backward in each training layout.

    python launch/bench_layouts.py --size real --prompts 2 --group 8 --completion 128

A batch shaped like a GRPO step (`--prompts` prompts of 85-97 tokens, `--group`
completions of exactly `--completion` tokens each, rows padded to
`--max_prompt_len` + `--completion`), random weights of a `launch/bench.py`
model size. Each layout runs `policy_step.loss_and_grads` over its parts
(micro-batches summed): 'full' is the plain [B, T] forward (logits at every
position), then padded rows cut to the batch and logits at the completion
window (`jrl.data.layouts`), the same in micro-batches of `--micro_tokens`,
and shared-prompt rows. Prints seconds (median of `--repeats`), the ratio to
the first layout, the largest loss difference and the XLA temporaries of
one part's compiled program (`--remat`: the model's remat policy, `--attention` its training
attention kernel);
`--out FILE` writes them as JSON.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jrl import models
from jrl.trainers import common, policy_step
from launch import machine
from launch.benches.common import MODEL_SIZES


def grpo_batch(prompts, group, completion, max_prompt_len, vocab, seed=0):
  rng = np.random.default_rng(seed)
  t = max_prompt_len + completion
  b = prompts * group
  tokens, mask, loss_mask = (np.zeros((b, t), d) for d in (np.int32, bool, bool))
  for j in range(prompts):
    p = int(rng.integers(85, 98)) if max_prompt_len >= 97 else max_prompt_len
    prompt = rng.integers(1, vocab, p)
    for k in range(group):
      i = j * group + k
      tokens[i, :p] = prompt
      tokens[i, p : p + completion] = rng.integers(1, vocab, completion)
      mask[i, : p + completion] = True
      loss_mask[i, p : p + completion] = True
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  adv = np.where(loss_mask, rng.normal(size=(b, 1)), 0.0)
  return policy_step.PolicyBatch(
    jnp.asarray(tokens),
    jnp.asarray(mask),
    jnp.asarray(loss_mask),
    f32(np.where(loss_mask, -5.0, 0.0)),
    f32(np.zeros((b, t))),
    f32(adv),
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--size', default='cpu-20m', choices=sorted(MODEL_SIZES))
  parser.add_argument('--prompts', type=int, default=2)
  parser.add_argument('--group', type=int, default=8)
  parser.add_argument('--completion', type=int, default=128)
  parser.add_argument('--max_prompt_len', type=int, default=128)
  parser.add_argument('--micro_tokens', type=int, default=2048, help='0: no micro-batch row')
  parser.add_argument('--remat', default='none')
  parser.add_argument('--attention', default='auto', help='training attention kernel')
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--layouts', default='full,padded,padded_micro,shared_prompt')
  parser.add_argument('--out', default='')
  args = parser.parse_args(argv)

  config = models.ModelConfig(
    **MODEL_SIZES[args.size], remat=args.remat, attention_impl=args.attention
  )
  graphdef, params = models.create(config, jax.random.PRNGKey(0))
  batch = grpo_batch(
    args.prompts, args.group, args.completion, args.max_prompt_len, config.vocab_size
  )
  tokens, mask, loss_mask = (np.asarray(x) for x in (batch.tokens, batch.mask, batch.loss_mask))
  state = common.init_state(params, optax.sgd(0.0))
  cfg = policy_step.StepConfig(chunk_size=1024)

  def loss_and_grads(state, batch):
    loss, _, grads = policy_step.loss_and_grads(state, batch, graphdef=graphdef, step_config=cfg)
    return loss, grads

  step = jax.jit(loss_and_grads)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  kinds = {
    'padded': ('padded', 0),
    'padded_micro': ('padded', args.micro_tokens),
    'packed': ('packed', 0),
    'shared_prompt': ('shared_prompt', 0),
    'shared_prompt_micro': ('shared_prompt', args.micro_tokens),
  }
  print(
    f'{args.size}: {config.num_params() / 1e6:.1f}M params, {args.prompts} prompts x G='
    f'{args.group}, completions of {args.completion}, rows of {tokens.shape[1]}; '
    f'{int(mask.sum())} real tokens; backend {jax.default_backend()}',
    flush=True,
  )
  results, reference = {}, None
  for name in args.layouts.split(','):
    if name == 'full':
      parts = [None]
    else:
      kind, budget = kinds[name]
      parts = common.Packer(tokens.shape[1], sharding, budget, kind).split(tokens, mask, loss_mask)

    def run(parts=parts):
      out = [step(state, batch._replace(packed=p)) for p in parts]
      return sum(float(loss) for loss, _ in out)

    probe = batch if parts[0] is None else batch._replace(packed=parts[0])
    temp = step.lower(state, probe).compile().memory_analysis().temp_size_in_bytes
    start = time.perf_counter()
    loss = run()
    first = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      run()
      times.append(time.perf_counter() - start)
    sec = float(np.median(times))
    reference = reference or (name, sec, loss)
    run_tokens = sum(int(np.asarray(mask).size if p is None else p.tokens.size) for p in parts)
    results[name] = dict(
      seconds=sec,
      first_call_s=first,
      parts=len(parts),
      tokens_run=run_tokens,
      ratio_to_first=sec / reference[1],
      loss_diff=abs(loss - reference[2]),
      temp_bytes_per_part=int(temp),
    )
    print(
      f'  {name:20s} {sec:8.2f} s  x{sec / reference[1]:.2f} of {reference[0]}  '
      f'{len(parts)} part(s), {run_tokens} tokens run, {temp / 2**30:.2f} GiB of XLA '
      f'temporaries per part  (first call {first:.1f} s, '
      f'|loss diff| {abs(loss - reference[2]):.2e})',
      flush=True,
    )
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'machine': machine.record(), 'args': vars(args), 'results': results}, f, indent=1)


if __name__ == '__main__':
  from jrl import hostmem

  hostmem.ensure_huge_pages()  # re-executes once with XLA's buffers on huge pages
  main()
