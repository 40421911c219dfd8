"""The numerics parts of `launch/accel_check.py`: the paged-attention kernel
and the training attention kernel against their references, the sampler's
logprobs against the trainer's, a bfloat16 update against a float32 one.
Each is `part(ctx) -> dict` of figures with a `checks` entry."""

import functools

import accel_parts as P
import jax
import jax.numpy as jnp
import numpy as np

from jrl import models


def _paged_case(rng, slots, heads, kv_heads, d, page, max_pages, dtype, garbage):
  """Pools, a page table, lengths and queries; `garbage` wherever no slot may read."""
  n_pages = 1 + slots * max_pages
  lengths = rng.integers(1, max_pages * page + 1, slots).astype(np.int32)
  perm = rng.permutation(np.arange(1, n_pages))
  table = np.zeros((slots, max_pages), np.int32)
  owned = np.zeros((n_pages, page), bool)
  for s in range(slots):
    used = -(-lengths[s] // page)
    table[s, :used] = perm[s * max_pages : s * max_pages + used]
    for pos in range(lengths[s]):
      owned[table[s, pos // page], pos % page] = True
  k = rng.normal(size=(kv_heads, n_pages, page, d)).astype(np.float32)
  v = rng.normal(size=(kv_heads, n_pages, page, d)).astype(np.float32)
  k[:, ~owned], v[:, ~owned] = garbage, garbage
  q = rng.normal(size=(slots, heads, d)).astype(np.float32)
  return [jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(table), jnp.asarray(lengths)]


def paged_attention(ctx):
  """The sampler's Pallas paged-attention kernel of this backend against the
  gather path on the same pages, float32 and bfloat16 caches. NaN fills every
  position no slot may read (the GPU kernel and the gather path zero them);
  the TPU kernel, which does not zero masked values, gets large finite
  garbage there instead. Off an accelerator both kernels run in Pallas
  interpret mode (the TPU one under `force_tpu_interpret_mode`)."""
  import contextlib

  from jrl.sampler import attention

  backend = jax.default_backend()
  impls = {'gpu': ['pallas_gpu'], 'tpu': ['pallas_tpu']}.get(backend, ['pallas_gpu', 'pallas_tpu'])
  c = ctx.model_config()
  full = ctx.mode == 'full'
  slots, max_pages = (128, 64) if full else (4, 4)
  out, checks = {}, {}
  for impl in impls:
    for dtype in ('float32', 'bfloat16'):
      if impl == 'pallas_tpu' and dtype == 'float32':
        continue  # it reads keys and values as bfloat16; 'auto' keeps float32 on gather
      garbage = 1e4 if impl == 'pallas_tpu' else np.nan
      case = _paged_case(
        np.random.default_rng(0),
        slots,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        ctx.work.page,
        max_pages,
        jnp.dtype(dtype),
        garbage,
      )
      clean = [jnp.where(jnp.isfinite(x) & (jnp.abs(x) < 1e3), x, 0) for x in case[1:3]]
      want = jax.jit(attention.paged_attention_gather)(case[0], *clean, *case[3:])
      interpret = contextlib.nullcontext()
      if impl == 'pallas_tpu' and backend != 'tpu':
        from jax.experimental.pallas import tpu as pltpu

        interpret = pltpu.force_tpu_interpret_mode()
      with interpret:
        kernel = jax.jit(functools.partial(attention.paged_attention, impl))
        got = kernel(*case)
        err = P.max_abs(got, want)
        tol = 2e-2 if dtype == 'bfloat16' else 1e-4
        name = f'{impl}/{dtype}'
        checks[name] = bool(np.isfinite(err) and err <= tol)
        out[name] = {'max_abs_err': err, 'tol': tol}
        if full:
          out[name]['kernel_ms'] = P.median_ms(kernel, *case)
          out[name]['gather_ms'] = P.median_ms(
            jax.jit(attention.paged_attention_gather), case[0], *clean, *case[3:]
          )
  worst = max(v['max_abs_err'] for v in out.values())
  return {
    **out,
    'checks': checks,
    'shape': dict(
      slots=slots,
      heads=c.num_heads,
      kv_heads=c.num_kv_heads,
      head_dim=c.head_dim,
      page=ctx.work.page,
      pages_per_slot=max_pages,
    ),
    'headline': f'{", ".join(out)}: max |err| {worst:.2g}',
  }


def _attention_rows(t, vocab, rng):
  """Packed rows (segment ids, a padding tail) and right-padded rows of length t."""
  cuts = [t // 3, t // 2, t - t // 3 - t // 2 - 8]
  packed = np.concatenate([np.full(n, i + 1) for i, n in enumerate(cuts)] + [np.zeros(8)])
  segs = np.stack([packed, np.concatenate([np.full(t - 40, 1), np.zeros(40)])]).astype(np.int32)
  tokens = rng.integers(1, vocab, (2, t)).astype(np.int32)
  return jnp.asarray(tokens), jnp.asarray(segs)


def train_attention(ctx):
  """The training passes' attention kernel of this backend (cuDNN flash on a
  GPU, Pallas splash on a TPU; splash in interpret mode on the CPU) against
  XLA's: token logprobs and their parameter gradients, packed rows (segment
  ids) and padded rows, bfloat16 compute."""
  backend = jax.default_backend()
  impl = {'gpu': 'cudnn'}.get(backend, 'splash')
  w = ctx.work
  base = ctx.model_config(
    num_layers=2 if ctx.mode == 'full' else 1,
    vocab_size=min(ctx.model_config().vocab_size, 4096),
    compute_dtype='bfloat16',
  )
  tokens, segs = _attention_rows(w.attn_len, base.vocab_size, np.random.default_rng(0))

  def run(implementation, layout):
    config = base.replace(attention_impl=implementation)
    graphdef, params = models.create(config, jax.random.PRNGKey(0))
    kwargs = {'segment_ids': segs} if layout == 'packed' else {'mask': segs > 0}

    def loss(p):
      logp, _ = models.next_token_logprobs(graphdef, p, tokens, **kwargs)
      real = (segs > 0) & (logp != 0)
      return jnp.sum(jnp.where(real, logp, 0.0)) / jnp.sum(real), logp

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, logp), grads = fn(params)
    ms = P.median_ms(fn, params, repeats=3) if ctx.mode == 'full' else None
    return logp, grads, ms

  out, checks = {'implementation': impl}, {}
  for layout in ('packed', 'padded'):
    logp, grads, ms = run(impl, layout)
    ref_logp, ref_grads, ref_ms = run('xla', layout)
    err, grad_rel = P.max_abs(logp, ref_logp, segs > 0), P.rel_err(grads, ref_grads)
    checks[layout] = err <= 0.1 and grad_rel <= 0.05
    out[layout] = {'logp_max_abs_err': err, 'grad_rel_err': grad_rel, 'ms': ms, 'xla_ms': ref_ms}
  return {
    **out,
    'checks': checks,
    'headline': f'{impl} vs xla, bf16: logp |err| packed {out["packed"]["logp_max_abs_err"]:.2g} '
    f'padded {out["padded"]["logp_max_abs_err"]:.2g}; grad rel {out["packed"]["grad_rel_err"]:.2g}',
  }


def logprob_match(ctx):
  """The sampler's logprobs of the tokens it drew against the trainer's
  recomputed ones (`next_token_logprobs` on prompt + completion), float32
  and bfloat16 compute, on a model of the workload's widths and
  `check_layers` layers (the sampler's attention: 'auto')."""
  w = ctx.work
  out, checks = {}, {}
  max_new = min(64, w.max_new)
  for dtype, tol in (('float32', 0.02), ('bfloat16', 0.1)):
    config = ctx.model_config(num_layers=w.check_layers, compute_dtype=dtype)
    graphdef, params = models.create(config, jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    requests = P.grpo_requests(
      ctx, config.vocab_size, rng, prompts=min(8, w.prompts), max_new=max_new, lengths='fixed'
    )
    impl = ctx.kernel('paged_attention', 'gather')
    smp = P.make_engine(ctx, config, graphdef, requests, max_new, impl)
    groups = smp.generate(params, requests, group_size=w.group)
    rows = [(r.prompt, c) for r, grp in zip(requests, groups, strict=True) for c in grp]
    t = max(len(p) + len(c.tokens) for p, c in rows)
    tokens = np.zeros((len(rows), t), np.int32)
    mask, sampled = np.zeros((len(rows), t), bool), np.zeros((len(rows), t), np.float32)
    done = np.zeros((len(rows), t), bool)
    for i, (p, c) in enumerate(rows):
      n = len(p) + len(c.tokens)
      tokens[i, :n] = np.concatenate([p, c.tokens])
      mask[i, :n] = True
      done[i, len(p) : n] = True
      sampled[i, len(p) : n] = c.logprobs
    fn = jax.jit(lambda p, tk, m, g=graphdef: models.next_token_logprobs(g, p, tk, m)[0])
    trainer = np.asarray(fn(params, jnp.asarray(tokens), jnp.asarray(mask)))
    diff = np.abs(trainer - sampled)[done]
    out[dtype] = {
      'mean_abs': float(diff.mean()),
      'max_abs': float(diff.max()),
      'tol_mean': tol,
      'tokens': int(done.sum()),
      'sampler_attention': impl,
    }
    checks[dtype] = bool(diff.mean() <= tol)
  return {
    **out,
    'checks': checks,
    'headline': 'sampler vs trainer logprobs, mean |diff| '
    + ', '.join(f'{k} {v["mean_abs"]:.2g} (max {v["max_abs"]:.2g})' for k, v in out.items()),
  }


def bf16_update(ctx):
  """One GRPO update (policy_step.loss_and_grads, then apply_update: AdamW)
  with bfloat16 compute and float32 master weights against the same step in
  float32 (at 'highest' matmul precision): loss, gradients, the applied update, and that the
  parameters stay float32."""
  import optax

  from jrl.trainers import common, policy_step

  w = ctx.work
  rows, t = (8, 512) if ctx.mode == 'full' else (4, 32)
  results = {}
  for dtype in ('float32', 'bfloat16'):
    config = ctx.model_config(num_layers=w.check_layers, compute_dtype=dtype)
    graphdef, params = models.create(config, jax.random.PRNGKey(0))
    batch, _, _ = P.benches.policy_batch(np.random.default_rng(0), rows, t, config.vocab_size)
    tx = optax.adamw(1e-5)
    cfg = policy_step.StepConfig(chunk_size=1024)
    state = common.init_state(params, tx)
    grads_fn = jax.jit(
      functools.partial(policy_step.loss_and_grads, graphdef=graphdef, step_config=cfg)
    )
    # The update of those gradients (what train_step and the micro-batched step apply).
    apply = jax.jit(
      functools.partial(policy_step.apply_update, tx=tx, schedule=optax.constant_schedule(1e-5))
    )
    with jax.default_matmul_precision('highest' if dtype == 'float32' else 'default'):
      loss, metrics, grads = grads_fn(state, batch)
      new, _ = apply(state, grads, loss, metrics)
    delta = jax.tree.map(lambda a, b: a - b, new.params, params)
    dtypes = {str(x.dtype) for x in jax.tree.leaves(new.params)}
    results[dtype] = (float(loss), grads, delta, dtypes)
  (l32, g32, d32, _), (l16, g16, d16, dt16) = results['float32'], results['bfloat16']
  loss_rel = abs(l16 - l32) / max(abs(l32), 1e-12)
  grad_rel, update_rel = P.rel_err(g16, g32), P.rel_err(d16, d32)
  checks = {'loss': loss_rel <= 0.02, 'grads': grad_rel <= 0.1, 'master_f32': dt16 == {'float32'}}
  return {
    'loss_f32': l32,
    'loss_bf16': l16,
    'loss_rel_err': loss_rel,
    'grad_rel_err': grad_rel,
    'update_rel_err': update_rel,
    'param_dtypes_bf16_step': sorted(dt16),
    'rows': [rows, t],
    'checks': checks,
    'headline': f'bf16 vs f32 step: loss rel {loss_rel:.2g}, grads rel {grad_rel:.2g}, '
    f'update rel {update_rel:.2g}, master {",".join(sorted(dt16))}',
  }
