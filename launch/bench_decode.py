"""Where a decode step's time goes: the paged sampler on a real checkpoint,
and the pieces of its step timed alone on the same shapes.

    python launch/bench_decode.py --model_path models/smollm2 --prompts 8 --group 8 --new 128

The whole: `Sampler.generate` of --prompts real-length random prompts x
--group samples, every sample exactly --new tokens (`min_new_tokens`),
temperature 1 (median of --repeats calls after a compiling one). The
pieces, each a jitted function on [S = prompts x group] rows, median of
--repeats x 20 calls: the output projection [S, D] x [D, V] and the
float32 log-softmax over it; drawing the tokens (`jrl.sampler.sampling.
sample`); splitting the per-slot keys; what is left is the layers and the
paged attention, the page bookkeeping and the host's dispatches. JSON with
--out.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

try:  # imported as launch.<module> (tests), or run as a script from launch/
  from launch import machine
except ImportError:
  import machine


def median_seconds(fn, args, repeats, inner=20):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / inner)
  return statistics.median(times)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--model_path', default='models/smollm2')
  p.add_argument('--prompts', type=int, default=8)
  p.add_argument('--group', type=int, default=8)
  p.add_argument('--prompt_len', type=int, default=96)
  p.add_argument('--new', type=int, default=128)
  p.add_argument('--steps_per_dispatch', type=int, default=16)
  p.add_argument('--page_size', type=int, default=16)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--out', default='')
  args = p.parse_args(argv)

  from flax import nnx

  from jrl import sampler
  from jrl.models import hf
  from jrl.sampler import controls, sampling

  ckpt = hf.load(args.model_path)
  config, graphdef, params = ckpt.config, ckpt.graphdef, ckpt.params
  s = args.prompts * args.group
  rng = np.random.default_rng(0)
  requests = [
    sampler.Request(
      prompt=rng.integers(0, config.vocab_size, args.prompt_len),
      max_new_tokens=args.new,
      min_new_tokens=args.new,
      temperature=1.0,
      seed=i,
    )
    for i in range(args.prompts)
  ]
  per_group = sampler.pages_needed(args.prompt_len, args.new, args.group, args.page_size)
  engine = sampler.SamplerConfig(
    num_slots=s,
    num_pages=1 + per_group * args.prompts,
    page_size=args.page_size,
    max_prompt_len=args.prompt_len,
    max_new_tokens=args.new,
  )
  smp = sampler.Sampler(graphdef, config, engine, steps_per_dispatch=args.steps_per_dispatch)
  smp.generate(params, requests, group_size=args.group)  # compiles
  whole = []
  for _ in range(args.repeats):
    start = time.perf_counter()
    smp.generate(params, requests, group_size=args.group)
    whole.append(time.perf_counter() - start)
  whole_s = statistics.median(whole)
  step_s = whole_s / args.new  # the prefill included: a small share of it

  model = nnx.merge(graphdef, params)
  hidden = jnp.asarray(rng.standard_normal((s, config.width)), model.config.compute_dtype)
  project = jax.jit(lambda h: controls.model_logits(nnx.merge(graphdef, params), h))
  logits = project(hidden)
  log_softmax = jax.jit(lambda z: jax.nn.log_softmax(z, axis=-1))
  keys = jax.random.split(jax.random.key(0), s)
  params_s = sampling.SamplingParams(
    jnp.ones(s), jnp.zeros(s, jnp.int32), jnp.ones(s), jnp.zeros(s, bool)
  )
  draw = jax.jit(lambda z, k: sampling.sample(z, k, params_s, truncate=False))
  rng_data = jax.random.key_data(keys)
  split = jax.jit(controls.split_keys)
  pieces = {
    'output projection': median_seconds(project, (hidden,), args.repeats),
    'log-softmax': median_seconds(log_softmax, (logits,), args.repeats),
    'sampling': median_seconds(draw, (logits, keys), args.repeats),
    'key split': median_seconds(split, (rng_data,), args.repeats),
  }
  rest = step_s - sum(pieces.values())
  print(
    f'decode ({args.model_path}): {config.num_params() / 1e6:.1f}M params, vocab '
    f'{config.vocab_size}, {s} slots, prompts of {args.prompt_len}, {args.new} new tokens, '
    f'{args.steps_per_dispatch} steps per dispatch, backend {jax.default_backend()}'
  )
  print(f'  whole generate: {whole_s:.2f} s, {s * args.new / whole_s:.0f} tokens/s')
  print(f'  one decode step: {1e3 * step_s:7.1f} ms')
  for name, sec in pieces.items():
    print(f'    {name:18s} {1e3 * sec:7.1f} ms  ({100 * sec / step_s:4.1f}%)')
  print(f'    {"layers and rest":18s} {1e3 * rest:7.1f} ms  ({100 * rest / step_s:4.1f}%)')
  if args.out:
    with open(args.out, 'w', encoding='utf-8') as f:
      json.dump(
        {
          'machine': machine.record(),
          'whole_s': whole,
          'step_s': step_s,
          'pieces_s': pieces,
          'args': vars(args),
        },
        f,
        indent=2,
      )


if __name__ == '__main__':
  from jrl import hostmem

  hostmem.ensure_huge_pages()  # re-executes once with XLA's buffers on huge pages
  main()
