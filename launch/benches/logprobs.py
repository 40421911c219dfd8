"""`logprobs`: target-token logprobs and their gradient, from final hidden
states and the unembedding matrix, computed (a) naively, materialising the
[B·T, V] float32 logits, and (b) with `jrl.losses.token_logprobs_from_hidden`
in chunks. Prints XLA's compiled temporary memory for each and the median
wall time over `--repeats` runs, and the ratios chunked / naive.

    python launch/bench.py logprobs [--tokens 2048 --vocab 32768 --width 256 --chunk 256]
"""

import jax
import jax.numpy as jnp

import jrl.losses as L
from launch.benches import common

HELP = 'chunked vs naive token logprobs'


def add_arguments(parser):
  parser.add_argument('--tokens', type=int, default=2048, help='B·T positions (B = 4)')
  parser.add_argument('--vocab', type=int, default=32768)
  parser.add_argument('--width', type=int, default=256)
  parser.add_argument('--chunk', type=int, default=256)
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--repeats', type=int, default=5)


def _naive_logprobs(hidden, unembed, targets):
  logits = (hidden @ unembed).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def run(args):
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
      row[kind + '_ms'] = 1e3 * common.median_seconds(
        compiled, (hidden, unembed, targets), args.repeats
      )
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
