"""Optimiser: AdamW with warm-up and cosine decay, gradient clipping and
gradient accumulation, from optax.

`make_optimizer(config.optim)` reads the narrow `optim` slice of a config and
returns `(tx, schedule)`; the learning-rate schedule is returned too so the
trainer can log the rate in effect. With `trainable` (LoRA: `lora.trainable_mask`)
the optimiser runs on the trainable leaves only and the others are frozen.
"""

import jax
import optax


def make_optimizer(optim, trainable=None):
  """Builds the optimiser from a config slice with fields

    lr: peak learning rate.
    warmup_steps: linear warm-up from 0 over this many updates.
    decay_steps: cosine decay over this many updates after warm-up (0: constant).
    end_lr_ratio: final rate as a fraction of `lr`.
    weight_decay, b1, b2, eps: AdamW.
    clip_norm: clip the global gradient norm to this (0: off).
    grad_accum: apply one update per this many train steps (optax.MultiSteps).

  Args:
    optim: the config slice above.
    trainable: None (every parameter trains), or params -> a tree of bools
      like params (e.g. `lora.trainable_mask`). The leaves marked False are
      frozen: their update is zero and they have no optimiser state (no
      moments, no accumulated gradients); clipping, weight decay and
      accumulation see the trainable leaves only (`optax.multi_transform`).

  Returns:
    (optax.GradientTransformation, schedule: step -> lr).
  """
  for name in ('lr', 'b1', 'b2', 'eps'):
    if not optim[name] > 0:
      raise ValueError(f'`optim.{name}` must be > 0, got {optim[name]!r}.')
  for name in ('warmup_steps', 'decay_steps', 'clip_norm', 'weight_decay'):
    if optim[name] < 0:
      raise ValueError(f'`optim.{name}` must be >= 0, got {optim[name]!r}.')
  if int(optim.grad_accum) < 1:
    raise ValueError(f'`optim.grad_accum` must be >= 1, got {optim.grad_accum!r}.')
  lr, warmup, decay = float(optim.lr), int(optim.warmup_steps), int(optim.decay_steps)
  if decay > 0:
    schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=lr,
      warmup_steps=warmup,
      decay_steps=warmup + decay,
      end_value=lr * float(optim.end_lr_ratio),
    )
  elif warmup > 0:
    schedule = optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup]
    )
  else:
    schedule = optax.constant_schedule(lr)

  def decay_mask(params):
    # No weight decay on norms, biases and other vectors.
    return jax.tree.map(lambda x: x.ndim >= 2, params)

  parts = []
  if optim.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(float(optim.clip_norm)))
  parts.append(
    optax.adamw(
      schedule,
      b1=float(optim.b1),
      b2=float(optim.b2),
      eps=float(optim.eps),
      weight_decay=float(optim.weight_decay),
      mask=decay_mask,
    )
  )
  tx = optax.chain(*parts)
  if int(optim.grad_accum) > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=int(optim.grad_accum))
  if trainable is not None:

    def labels(params):
      return jax.tree.map(lambda t: 'train' if t else 'freeze', trainable(params))

    tx = optax.multi_transform({'train': tx, 'freeze': optax.set_to_zero()}, labels)
  return tx, schedule
