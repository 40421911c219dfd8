"""`sampler`: a GRPO-shaped rollout, jrl's paged sampler against the dense
static-batch baseline or `transformers`' `generate` (see `run`).

    python launch/bench.py sampler [--size cpu-20m --prompts 16 --group 8 --max_new 256]
    python launch/bench.py sampler --model_path models/smollm2 --baseline hf [--prompts 8]
    python launch/bench.py sampler --model_path models/smollm2 --baseline vllm [--vllm_threads 2]
"""

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from launch.benches import common

HELP = 'paged sampler vs dense static-batch baseline'


def add_arguments(parser):
  parser.add_argument('--size', choices=sorted(common.MODEL_SIZES), default='cpu-20m')
  parser.add_argument('--compute_dtype', default='float32')
  parser.add_argument('--prompts', type=int, default=16)
  parser.add_argument('--group', type=int, default=8)
  parser.add_argument('--min_prompt', type=int, default=64)
  parser.add_argument('--max_prompt', type=int, default=256)
  parser.add_argument('--max_new', type=int, default=256)
  parser.add_argument('--num_stop', type=int, default=64, help='stop tokens (sets the length tail)')
  parser.add_argument(
    '--slots', type=int, default=None, help='sampler slots (default: prompts x group)'
  )
  parser.add_argument('--page_size', type=int, default=16)
  parser.add_argument('--steps', type=int, default=16, help='decode steps per dispatch')
  parser.add_argument('--repeats', type=int, default=1)
  parser.add_argument('--mode', choices=('natural', 'long_tail'), default='natural')
  parser.add_argument('--prefill_chunk', type=int, default=None, help='tokens per prefill chunk')
  parser.add_argument('--cache_dir', default='', help='persistent compilation cache directory')
  parser.add_argument('--model_path', default=None, help='a converted checkpoint (models/smollm2)')
  parser.add_argument('--baseline', choices=('dense', 'hf', 'vllm'), default='dense')
  parser.add_argument(
    '--chat_prompts',
    action='store_true',
    help='with --model_path: word problems in its chat template, every sample --max_new tokens',
  )
  parser.add_argument(
    '--free_len', action='store_true', help='--chat_prompts: end tokens allowed from the start'
  )
  parser.add_argument(
    '--vllm_threads', type=int, default=0, help='cores vLLM binds (0: its default, one kept)'
  )
  parser.add_argument('--vllm_kv_gib', type=int, default=2, help="vLLM's KV cache, GiB")
  parser.add_argument(
    '--vllm_weights_dir', default='', help='where versions are written (default: a temp dir)'
  )


def print_mismatch(graphdef, params, requests, groups, width, name='vllm'):
  """The engine's logprobs of its sampled tokens against the trainer's
  (`models.next_token_logprobs` on prompt + completion): mean, max and tail."""
  from jrl import models

  fn = jax.jit(models.next_token_logprobs, static_argnums=0)
  diffs = []
  for request, group in zip(requests, groups, strict=True):
    for c in group:
      seq = np.zeros((1, width), np.int32)
      n, k = len(request.prompt), len(c.tokens)
      seq[0, :n], seq[0, n : n + k] = request.prompt, c.tokens
      mask = np.arange(width)[None] < n + k
      trainer = np.asarray(fn(graphdef, params, seq, mask)[0])[0, n : n + k]
      diffs.append(np.abs(trainer - c.logprobs))
  diff = np.concatenate(diffs)
  tails = ', '.join(f'{np.mean(diff > b):.1%} > {b:g}' for b in (1e-4, 1e-3, 1e-2, 1e-1))
  print(
    f'  {name} logprobs vs the trainer: mean |diff| {diff.mean():.2e}, max {diff.max():.2e} '
    f'over {diff.size} tokens ({tails})'
  )


def chat_requests(args):
  """--prompts word problems in the chat template of --model_path's tokenizer,
  its end tokens forbidden until --max_new (every sample that long, as in
  the GRPO step compared with TRL; allowed with --free_len). Returns
  (requests, stop tokens).

  With the end tokens forbidden, both engines record the logprobs of the
  distribution without them, which the trainer's (over the whole
  vocabulary) exceed by log(1 - p(end)): use --free_len to see the
  engines' own mismatch."""
  from jrl import sampler
  from jrl.data import tasks
  from jrl.models.tokenizer import load_tokenizer

  tok = load_tokenizer(args.model_path)
  encoder = tasks.Encoder(tok, True, False, system_prompt='Solve the problem step by step.')
  rng = np.random.default_rng(0)
  requests = []
  for i in range(args.prompts):
    a, b, c = (int(x) for x in rng.integers(2, 60, 3))
    question = (
      f'A farmer has {a} rows of trees with {b} trees in each row. He plants {c} more '
      'trees. How many trees does he have now? Give the final answer as a number.'
    )
    requests.append(
      sampler.Request(
        prompt=encoder.prompt_ids(question),
        max_new_tokens=args.max_new,
        min_new_tokens=0 if args.free_len else args.max_new,
        temperature=1.0,
        stop_tokens=tuple(tok.eos_ids),
        seed=i,
      )
    )
  return requests, tuple(tok.eos_ids)


class Groups(list):
  """Completion groups with the bytes of the engine's KV cache (`cache_bytes`)."""


def vllm_generate(args, ckpt, requests, group_size):
  """jrl's vLLM adapter (third_party/vllm) on the checkpoint: started and
  given the weights (timed: the cold start), then one `generate` per call.
  Prints the cold start, a weight push and the engine processes' memory."""
  import types

  import ml_collections
  import psutil

  from third_party.vllm import engine as vllm_engine

  c = ml_collections.ConfigDict()
  c.workdir, c.seed = args.vllm_dir, 0
  c.task = dict(max_prompt_len=args.max_prompt, max_response_len=args.max_new)
  c.sampler = dict(num_slots=args.slots)
  c.sampler.vllm = dict(
    kv_space_gib=args.vllm_kv_gib,
    threads=args.vllm_threads,
    weights_dir=args.vllm_weights_dir,
    enforce_eager=False,
  )
  model = types.SimpleNamespace(config=ckpt.config, hf_config=ckpt.hf_config)
  engine = vllm_engine.make_engine(c, model, None, ())
  start = time.perf_counter()
  engine.load_weights(ckpt.params, 0)
  cold = time.perf_counter() - start
  pushes = []
  for version in (1, 2, 3):
    # New arrays, as an update makes (an array caches its host copy once fetched).
    fresh = jax.block_until_ready(jax.tree.map(jnp.copy, ckpt.params))
    engine.load_weights(fresh, version)
    pushes.append((engine.stats.push_seconds, engine.stats.export_seconds))
  push, export = statistics.median(p[0] for p in pushes), statistics.median(p[1] for p in pushes)
  children = psutil.Process().children(recursive=True)
  rss = sum(p.memory_info().rss for p in children if p.is_running())
  print(
    f'  vllm: cold start {cold:.1f} s (export, start, compile); a weight push {push:.2f} s '
    f'(export {export:.2f} s + reload; median of 3, the first {pushes[0][0]:.2f} s, of which '
    f'export {pushes[0][1]:.2f} s); '
    f'its processes hold {rss / 2**30:.2f} GiB'
  )

  def run():
    out = Groups(engine.generate(3, requests, group_size=group_size))
    out.cache_bytes = args.vllm_kv_gib * 2**30  # its KV cache is allocated whole
    return out

  return run


def hf_generate(path, requests, group_size, max_new, stop):
  """A call of `transformers`' `generate` on the checkpoint at `path` for the
  same requests: the prompts left-padded into one batch, `group_size` return
  sequences each, sampling at temperature 1 without truncation, `stop` as the
  end-of-sequence ids. The call returns the completion lengths (up to and
  including the first stop token) and the bytes of its KV cache (float32, the
  batch x the padded prompt plus the longest completion)."""
  import types

  import torch
  import transformers

  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  width = max(len(r.prompt) for r in requests)
  ids = torch.zeros((len(requests), width), dtype=torch.long)
  mask = torch.zeros((len(requests), width), dtype=torch.long)
  for i, r in enumerate(requests):
    ids[i, width - len(r.prompt) :] = torch.as_tensor(np.asarray(r.prompt))
    mask[i, width - len(r.prompt) :] = 1
  stops = list(stop)
  hf = model.config
  kv_heads = getattr(hf, 'num_key_value_heads', hf.num_attention_heads)
  head_dim = getattr(hf, 'head_dim', None) or hf.hidden_size // hf.num_attention_heads
  per_token = 2 * hf.num_hidden_layers * kv_heads * head_dim * 4

  def run():
    with torch.no_grad():
      out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new,
        num_return_sequences=group_size,
        eos_token_id=stops or None,
        pad_token_id=stops[0] if stops else 0,
      )
    new = out[:, width:].numpy()
    hit = np.isin(new, stops)
    lengths = [int(np.argmax(h)) + 1 if h.any() else new.shape[1] for h in hit]
    return types.SimpleNamespace(
      lengths=lengths, cache_bytes=per_token * new.shape[0] * (width + new.shape[1])
    )

  return run


def run(args):
  """GRPO-shaped rollout: jrl's paged sampler against the dense static-batch baseline.

  Modes: 'natural' (stop tokens make lengths geometric, capped at --max_new);
  'long_tail' (no stop tokens; every sample has its own max_new_tokens, a
  quarter of them --max_new and the rest 16 to --max_new / 8 tokens), where
  the paged engine also runs without compaction. For each engine: the first
  call (compile included), the seconds spent compiling in it, and the
  steady state (median of --repeats later calls).

  `--model_path`: a converted checkpoint (e.g. models/smollm2) instead of a
  random model of --size. `--baseline hf`: the baseline is `transformers`'
  `generate` on the checkpoint (natural mode: the same prompts, G return
  sequences each, the stop tokens as its end-of-sequence ids, sampling at
  temperature 1) instead of the static-batch JAX sampler.
  """
  from jrl import models, sampler
  from jrl.sampler import baseline

  if args.cache_dir:
    sampler.enable_compilation_cache(args.cache_dir)
  if args.baseline in ('hf', 'vllm') and not (args.model_path and args.mode == 'natural'):
    raise SystemExit(f'--baseline {args.baseline} needs --model_path and the natural mode')
  if args.model_path:
    from jrl.models import hf

    ckpt = hf.load(args.model_path, compute_dtype=args.compute_dtype)
    config, graphdef, params = ckpt.config, ckpt.graphdef, ckpt.params
  else:
    config = models.ModelConfig(**common.MODEL_SIZES[args.size], compute_dtype=args.compute_dtype)
    graphdef, params = models.create(config, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  g = args.group
  long_tail = args.mode == 'long_tail'
  if long_tail:
    stop = ()
    short = lambda: min(args.max_new, int(rng.integers(16, max(17, args.max_new // 8 + 1))))
    limits = [
      [args.max_new if rng.random() < 0.25 else short() for _ in range(g)]
      for _ in range(args.prompts)
    ]
  else:
    # Stop tokens make lengths geometric with mean ~V/num_stop, capped at max_new.
    stop = tuple(int(t) for t in rng.choice(config.vocab_size, args.num_stop, replace=False))
    limits = [args.max_new] * args.prompts
  requests = [
    sampler.Request(
      prompt=rng.integers(0, config.vocab_size, rng.integers(args.min_prompt, args.max_prompt + 1)),
      max_new_tokens=limits[i],
      temperature=1.0,
      stop_tokens=stop,
      seed=i,
    )
    for i in range(args.prompts)
  ]
  if args.chat_prompts:
    requests, stop = chat_requests(args)
  page = args.page_size
  args.slots = args.slots or args.prompts * g  # the whole batch in flight, as a static batch
  per_group = max(sampler.pages_needed(len(r.prompt), args.max_new, g, page) for r in requests)
  engine_config = sampler.SamplerConfig(
    num_slots=args.slots,
    num_pages=1 + per_group * max(1, args.slots // g),
    page_size=page,
    max_prompt_len=args.max_prompt,
    max_new_tokens=args.max_new,
    max_stop_tokens=max(1, len(stop)),
  )
  make = lambda compaction: sampler.Sampler(
    graphdef,
    config,
    engine_config,
    steps_per_dispatch=args.steps,
    prefill_chunk=args.prefill_chunk,
    compaction=compaction,
  )
  engines = {'paged': make(True)}
  if long_tail:
    engines['paged, no compaction'] = make(False)
  smp = engines['paged']

  def run_dense():
    return baseline.dense_generate(graphdef, params, config, requests, g, args.max_new)

  print(
    f'sampler ({args.mode}): {config.num_params() / 1e6:.1f}M-param model'
    f'{" " + args.model_path if args.model_path else ""}, {args.prompts} '
    f'prompts x G={g}, prompts {args.min_prompt}-{args.max_prompt} tokens, up to '
    f'{args.max_new} new, {args.slots} slots, backend {jax.default_backend()}'
  )
  runs = {
    name: functools.partial(e.generate, params, requests, group_size=g)
    for name, e in engines.items()
  }

  def baseline_run():
    # Started only after jrl's runs, so that vLLM's processes (or the
    # baseline's memory) are not there while jrl is measured.
    if args.baseline == 'hf':
      return hf_generate(args.model_path, requests, g, args.max_new, stop)
    if args.baseline == 'vllm':
      import tempfile

      args.vllm_dir = tempfile.mkdtemp(prefix='jrl-bench-vllm-')
      return vllm_generate(args, ckpt, requests, g)
    return run_dense

  runs[args.baseline] = None
  base = args.baseline
  results = {}
  for name, fn in runs.items():
    fn = fn or baseline_run()
    start = time.perf_counter()
    with common.compile_seconds() as compiled:
      out = fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      out = fn()
      times.append(time.perf_counter() - start)
    if name == 'dense':
      tokens = int(out.mask.sum())
      lengths = list(out.mask.sum(axis=1))
    elif name == 'hf':
      tokens, lengths = int(sum(out.lengths)), list(out.lengths)
    else:  # jrl's sampler or the vLLM adapter: Completions
      tokens = sum(len(c.tokens) for grp in out for c in grp)
      lengths = [len(c.tokens) for grp in out for c in grp]
    results[name] = dict(
      sec=statistics.median(times),
      first=first,
      compile=compiled[0],
      programs=compiled[1],
      tokens=tokens,
      out=out,
      lengths=lengths,
      stats=getattr(engines.get(name), 'stats', None),
    )
  for name in engines:
    if base == 'dense' and results[name]['lengths'] != results['dense']['lengths']:
      print(f'  WARNING: {name} and dense produced different completion lengths')

  itemsize = jnp.dtype(config.compute_dtype).itemsize
  kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
  paged_bytes = smp.stats.peak_pages * page * kv_token_bytes
  dense_bytes = results[base]['out'].cache_bytes
  prompt_paged = sum(
    (len(r.prompt) // page + g * (len(r.prompt) % page > 0)) * page for r in requests
  )
  prompt_dense = len(requests) * g * max(len(r.prompt) for r in requests)
  lengths = np.asarray(results['paged']['lengths'])
  print(
    f'  completion lengths: mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, '
    f'max {lengths.max()}, {np.mean(lengths == args.max_new):.0%} hit max_new'
  )
  for name, r in results.items():
    extra = ''
    if r['stats'] is not None:
      st = r['stats']
      rows = st.decode_rows / max(1, st.decode_steps)
      extra = (
        f'; {st.prefills} prompts in {st.prefill_calls} prefill calls, {st.dispatches} '
        f'dispatches ({st.compactions} on fewer rows than slots), {rows:.1f} rows per decode step; '
        f'prefill {st.prefill_seconds:.1f} s, decode {st.decode_seconds:.1f} s'
      )
    print(
      f'  {name:21s} {r["tokens"] / r["sec"]:8.0f} output tokens/s steady ({r["tokens"]} tokens '
      f'in {r["sec"]:.2f} s, median of {args.repeats}); first call {r["first"]:.1f} s of '
      f'which compile {r["compile"]:.1f} s ({r["programs"]} programs){extra}'
    )
  rate = lambda name: results[name]['tokens'] / results[name]['sec']
  p, d = results['paged'], results[base]
  print(f'  tokens/s paged/{base}: x{rate("paged") / rate(base):.2f}')
  print(f'  first call paged/{base}: x{p["first"] / d["first"]:.2f}')
  if long_tail:
    print(f'  tokens/s compaction/none: x{rate("paged") / rate("paged, no compaction"):.2f}')
  if base == 'vllm':
    width = args.max_prompt + args.max_new
    print_mismatch(graphdef, params, requests, p['out'], width, name='paged')
    print_mismatch(graphdef, params, requests, d['out'], width)
  print(
    f'  KV memory: paged peak {paged_bytes / 2**20:.1f} MiB in use '
    f'({smp.stats.peak_pages} pages of {page}) vs {base} {dense_bytes / 2**20:.1f} MiB '
    f'allocated: x{paged_bytes / dense_bytes:.3f}'
  )
  print(
    f'  prompt KV: paged {prompt_paged} token slots vs {base} {prompt_dense} '
    f'(x{prompt_paged / prompt_dense:.3f}; (G-1)/G cut would be x{1 / g:.3f})'
  )
