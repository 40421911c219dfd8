"""`partial`: partial rollouts, new weights taken between decode dispatches
with samples in flight, their cache kept or recomputed (see `run`).

    python launch/bench.py partial [--size cpu-20m --prompts 8 --group 8 --max_new 128]
    python launch/bench.py partial --model_path models/smollm2 --prompts 4 --max_new 128
"""

import statistics
import time

import jax
import numpy as np

from launch.benches import common

HELP = 'partial rollouts: the cache of samples in flight kept or recomputed on a swap'


def add_arguments(parser):
  parser.add_argument('--size', choices=sorted(common.MODEL_SIZES), default='cpu-20m')
  parser.add_argument('--model_path', default=None, help='a converted checkpoint (models/smollm2)')
  parser.add_argument('--prompts', type=int, default=8)
  parser.add_argument('--group', type=int, default=8)
  parser.add_argument('--prompt_len', type=int, default=64)
  parser.add_argument('--max_new', type=int, default=128)
  parser.add_argument('--steps', type=int, default=8, help='decode steps per dispatch')
  parser.add_argument('--swap_every', type=int, default=4, help='dispatches per new version')
  parser.add_argument('--versions', type=int, default=3, help='new versions taken per rollout')
  parser.add_argument(
    '--drift', type=float, default=1e-3, help='each version moves every weight by this (relative)'
  )
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--out', default='', help='write the figures as JSON here')


def drifted(params, scale, seed):
  """`params` with every weight moved by `scale` times its own RMS, in a
  random direction (a stand-in for an update of that relative size)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  moved = []
  for x, k in zip(leaves, keys, strict=True):
    rms = jax.numpy.sqrt(jax.numpy.mean(jax.numpy.square(x.astype(np.float32))))
    moved.append((x + scale * rms * jax.random.normal(k, x.shape, np.float32)).astype(x.dtype))
  return jax.tree.unflatten(tree, moved)


def run(args):
  """One rollout (every sample exactly --max_new tokens) with the weights
  changed every --swap_every dispatches, --versions times (each version the
  last moved by --drift of every weight's RMS), three ways on the same
  requests and seeds: no swap (one version, the reference cost), swaps with
  the cache kept, swaps with the cache recomputed (`kv_on_swap`).

  Figures: median seconds per rollout over --repeats after a warm-up call,
  tokens/s, the seconds the swaps took, and for each way the gap between the
  logprobs it recorded and each token's version's own logprobs (the trainer's
  forward pass of the whole sequence with that version's weights): the
  recomputed cache is exact, the kept one samples from a mixture whose
  distance grows with --drift.
  """
  from jrl import models, sampler

  if args.model_path:
    from jrl.models import hf

    ckpt = hf.load(args.model_path)
    config, graphdef, params = ckpt.config, ckpt.graphdef, ckpt.params
  else:
    config = models.ModelConfig(**common.MODEL_SIZES[args.size])
    graphdef, params = models.create(config, jax.random.PRNGKey(0))
  versions = [params]
  for v in range(args.versions):
    versions.append(drifted(versions[-1], args.drift, seed=v))
  rng = np.random.default_rng(0)
  requests = [
    sampler.Request(
      prompt=[int(t) for t in rng.integers(0, config.vocab_size, args.prompt_len)],
      max_new_tokens=args.max_new,
      min_new_tokens=args.max_new,
      temperature=1.0,
      seed=i,
    )
    for i in range(args.prompts)
  ]
  g, page = args.group, 16
  engine_config = sampler.SamplerConfig(
    num_slots=args.prompts * g,
    num_pages=1 + args.prompts * sampler.pages_needed(args.prompt_len, args.max_new, g, page),
    page_size=page,
    max_prompt_len=args.prompt_len,
    max_new_tokens=args.max_new,
  )
  smp = sampler.Sampler(graphdef, config, engine_config, steps_per_dispatch=args.steps)

  def weights_at(d):
    v = min(d // args.swap_every, args.versions)
    return (versions[v], v) if v else None

  ways = {
    'no swap': {},
    'keep': dict(weights_at=weights_at, kv_on_swap='keep'),
    'recompute': dict(weights_at=weights_at, kv_on_swap='recompute'),
  }
  logprobs = jax.jit(models.next_token_logprobs, static_argnums=0)
  print(
    f'partial: {config.num_params() / 1e6:.1f}M-param model'
    f'{" " + args.model_path if args.model_path else " (random)"}, {args.prompts} prompts x '
    f'G={g}, {args.max_new} new tokens each, {args.steps} steps per dispatch, a new version '
    f'every {args.swap_every} dispatches ({args.versions} in all), drift {args.drift:g}, '
    f'backend {jax.default_backend()}'
  )
  figures = {}
  for name, options in ways.items():

    def call(options=options):
      smp.load_weights(params, 0)
      start = time.perf_counter()
      out = smp.generate(params, requests, group_size=g, **options)
      return out, time.perf_counter() - start

    call()  # compiles
    runs = [call() for _ in range(args.repeats)]
    out = runs[-1][0]
    seconds = statistics.median(t for _, t in runs)
    flat = [(r, c) for r, grp in zip(requests, out, strict=True) for c in grp]
    tokens = np.asarray([list(r.prompt) + [int(t) for t in c.tokens] for r, c in flat], np.int32)
    mask = np.ones(tokens.shape, bool)
    got = np.stack([c.logprobs for _, c in flat])
    own = np.zeros_like(got)
    token_versions = np.stack(
      [c.versions if c.versions is not None else np.zeros(len(c.tokens), np.int32) for _, c in flat]
    )
    for v in np.unique(token_versions):
      want = np.asarray(logprobs(graphdef, versions[v], tokens, mask, temperature=1.0)[0])
      want = want[:, args.prompt_len :]
      own = np.where(token_versions == v, want, own)
    gap = np.abs(got - own)
    n = int(tokens.shape[0] * args.max_new)
    figures[name] = dict(
      seconds=seconds,
      tokens_per_s=n / seconds,
      swaps=smp.stats.weight_swaps,
      swap_seconds=smp.stats.swap_seconds,
      logp_gap_mean=float(gap.mean()),
      logp_gap_max=float(gap.max()),
    )
    f = figures[name]
    print(
      f'  {name:10s} {seconds:7.2f} s  {f["tokens_per_s"]:8.1f} tokens/s  {f["swaps"]} swaps '
      f'taking {f["swap_seconds"]:.3f} s  |recorded - own version logprob|: mean '
      f'{f["logp_gap_mean"]:.2e}, max {f["logp_gap_max"]:.2e}'
    )
  ratio = figures['recompute']['seconds'] / figures['keep']['seconds']
  print(f'recompute / keep: x{ratio:.2f} seconds per rollout')
  figures['recompute_over_keep'] = ratio
  common.write_json(args.out, dict(args=vars(args), figures=figures))
