"""Benchmarks that print figures. Speed and memory goals live here, not in tests.

    python launch/bench.py logprobs [--tokens 2048 --vocab 32768 --width 256 --chunk 256]

`logprobs`: target-token logprobs and their gradient, from final hidden
states and the unembedding matrix, computed (a) naively, materialising the
[B·T, V] float32 logits, and (b) with `jrl.losses.token_logprobs_from_hidden`
in chunks. Prints XLA's compiled temporary memory for each and the median
wall time over `--repeats` runs, and the ratios chunked / naive.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jrl.losses as L


def _naive_logprobs(hidden, unembed, targets):
  logits = (hidden @ unembed).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _median_seconds(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def bench_logprobs(args):
  b = 4
  t = args.tokens // b
  key_h, key_w, key_t = jax.random.split(jax.random.PRNGKey(0), 3)
  dtype = jnp.dtype(args.dtype)
  hidden = jax.random.normal(key_h, (b, t, args.width), dtype)
  unembed = (jax.random.normal(key_w, (args.width, args.vocab)) / args.width**0.5).astype(dtype)
  targets = jax.random.randint(key_t, (b, t), 0, args.vocab)

  def chunked(h, w, tg):
    return L.token_logprobs_from_hidden(h, w, tg, chunk_size=args.chunk)[0]

  variants = {'naive': _naive_logprobs, 'chunked': chunked}
  print(
    f'logprobs: B·T={b * t} V={args.vocab} D={args.width} dtype={dtype.name} '
    f'chunk={args.chunk} backend={jax.default_backend()}'
  )
  print(f'full float32 logits would be {b * t * args.vocab * 4 / 2**20:.1f} MiB')
  results = {}
  for name, fn in variants.items():
    fwd = jax.jit(lambda h, w, tg, fn=fn: jnp.sum(fn(h, w, tg)))
    grad = jax.jit(jax.grad(lambda h, w, tg, fn=fn: jnp.sum(fn(h, w, tg)), argnums=(0, 1)))
    row = {}
    for kind, f in (('fwd', fwd), ('grad', grad)):
      compiled = f.lower(hidden, unembed, targets).compile()
      row[kind + '_temp_mib'] = compiled.memory_analysis().temp_size_in_bytes / 2**20
      row[kind + '_ms'] = 1e3 * _median_seconds(compiled, (hidden, unembed, targets), args.repeats)
    results[name] = row
    print(
      f'  {name:8s} fwd: temp {row["fwd_temp_mib"]:8.1f} MiB, {row["fwd_ms"]:8.2f} ms   '
      f'grad: temp {row["grad_temp_mib"]:8.1f} MiB, {row["grad_ms"]:8.2f} ms'
    )
  n, c = results['naive'], results['chunked']
  print(
    f'  chunked/naive: fwd temp x{c["fwd_temp_mib"] / n["fwd_temp_mib"]:.3f}, '
    f'grad temp x{c["grad_temp_mib"] / n["grad_temp_mib"]:.3f}, '
    f'fwd time x{c["fwd_ms"] / n["fwd_ms"]:.2f}, grad time x{c["grad_ms"] / n["grad_ms"]:.2f}'
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest='bench', required=True)
  p = sub.add_parser('logprobs', help='chunked vs naive token logprobs')
  p.add_argument('--tokens', type=int, default=2048, help='B·T positions (B = 4)')
  p.add_argument('--vocab', type=int, default=32768)
  p.add_argument('--width', type=int, default=256)
  p.add_argument('--chunk', type=int, default=256)
  p.add_argument('--dtype', default='bfloat16')
  p.add_argument('--repeats', type=int, default=5)
  args = parser.parse_args()
  {'logprobs': bench_logprobs}[args.bench](args)


if __name__ == '__main__':
  main()
