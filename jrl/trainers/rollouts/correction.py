"""Corrections of a rollout's behaviour logprobs before the update.

Two reasons the logprobs a rollout was sampled with are not the trainer's
under the parameters it updates from: the rollout is of an older policy
version (one-step-off, async: decoupled PPO with a proximal pass), or an
engine other than jrl's sampler produced it (vLLM: different kernels and
arithmetic). Both get the trainer's logprobs recomputed at the current
parameters and importance weights trainer / behaviour (`topology.is_*`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jrl import distributed
from jrl import losses as L
from jrl.trainers import common

# Per-token |trainer - engine| logprob bounds of the mismatch histogram.
LOGP_DIFF_BOUNDS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def recomputes_logprobs(sampler_config):
  """Whether every rollout's logprobs are recomputed by the trainer and the
  engine's corrected by importance weights (`sampler.recompute_logprobs`:
  'auto' does for an engine other than jrl's, whose logprobs are not the
  trainer's). `sampler_config`: the `sampler` section."""
  mode = sampler_config.recompute_logprobs
  return mode == 'on' or (mode == 'auto' and sampler_config.engine != 'jrl')


def logp_mismatch_metrics(trainer_logp, engine_logp, mask):
  """The engine's logprobs against the trainer's, over the trained tokens:
  `rollout/engine_logp_diff_mean` and `_max`, and
  `rollout/engine_logp_diff_over/<b>`, the fraction of tokens whose
  |difference| exceeds b (a histogram by its tail)."""
  diff = np.abs(np.asarray(distributed.fetch(trainer_logp)) - distributed.fetch(engine_logp))
  diff = diff[np.asarray(distributed.fetch(mask)) > 0]
  if not diff.size:
    return {}
  metrics = {
    'rollout/engine_logp_diff_mean': float(diff.mean()),
    'rollout/engine_logp_diff_max': float(diff.max()),
  }
  for bound in LOGP_DIFF_BOUNDS:
    metrics[f'rollout/engine_logp_diff_over/{bound:g}'] = float(np.mean(diff > bound))
  return metrics


def proximal(logprobs, params, generated, it, resources, *, rows, topology_config, recompute):
  """Decoupled PPO for a rollout of an older policy (one-step-off, async),
  and the correction of an outside engine's logprobs (`recompute`, from
  `recomputes_logprobs`): the proximal logprobs (`logprobs`, the run's
  jitted logprob step, at the current `params`, over minibatches of `rows`),
  the importance weights proximal / behaviour (per token, sequence or
  geometric mean, truncated or masked: the `topology` section's `is_*`,
  `jrl.losses.importance_weights`) and their metrics. Otherwise a rollout
  of the current version (`generated.version == it`) keeps its behaviour
  logprobs, weights 1."""
  if generated.version == it and not recompute:
    return generated.old_logp, jnp.ones_like(generated.old_logp), {}
  with resources.tracer.span('proximal'):
    old_logp = common.minibatched(logprobs, params, generated.batch, rows, resources.batch_sharding)
    jax.block_until_ready(old_logp)
  is_weights, is_metrics = L.importance_weights(
    old_logp,
    generated.old_logp,
    generated.batch.loss_mask,
    level=topology_config.is_level,
    mode=topology_config.is_mode,
    high=topology_config.is_cap,
    low=topology_config.is_low or None,
  )
  metrics = {f'rollout/{k}': float(v) for k, v in is_metrics.items()}
  metrics['rollout/behaviour_logp_diff_abs'] = float(
    L.token_mean(jnp.abs(old_logp - generated.old_logp), generated.batch.loss_mask)
  )
  if recompute and generated.version == it:  # the same weights: only the engines differ
    metrics.update(logp_mismatch_metrics(old_logp, generated.old_logp, generated.batch.loss_mask))
  return old_logp, is_weights, metrics
