"""On-policy distillation in the GRPO family: teachers score the student's samples.

With `distill.teachers` set (checkpoint directories jrl loads, with the
student's tokenizer), every iteration of a GRPO-family run adds, after
the rollout is placed on the mesh, one forward pass per teacher over the
sampled sequences (the reference pass's machinery: the same minibatches,
packed or shared-prompt layouts, the sampling temperature), and the
advantage becomes

    A = distill.coef · A_distill + distill.reward_coef · A_reward

where A_distill is the per-token reverse KL to the teachers'
weighted log-probabilities (`jrl.losses.distillation_advantages`:
`distill.clip`, `distill.discount`) and A_reward the run's own
advantage from its verifiable reward (`rl.advantage`). `reward_coef` = 0
is pure distillation (the reward is still computed and logged). The
teachers are fixed, so in an asynchronous run staleness concerns the
student only: the student's logprobs are the proximal ones there.

The teachers' parameters sit on the trainer's mesh next to the policy's
(their memory is not in the update's memory plan) and are loaded again
from their directories when a run resumes. Metrics: `distill/reverse_kl`
(mean per response token), `distill/teacher_prob` (the teachers' mean
probability of the sampled token), `time/teacher`.
"""

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl import losses as L
from jrl.models import hf as hf_lib
from jrl.trainers import checks, common, online


def check(config, batch_shards):
  """The `distill` section: teachers named by directory, one weight each."""
  del batch_shards
  d = config.distill
  teachers = tuple(d.teachers)
  checks.need(
    all(isinstance(t, str) and t for t in teachers),
    'distill.teachers',
    f'must be checkpoint directories (strings), got {teachers!r}.',
  )
  weights = tuple(d.teacher_weights)
  checks.need(
    not weights or len(weights) == len(teachers),
    'distill.teacher_weights',
    f'must have one weight per teacher ({len(teachers)}), got {len(weights)}.',
  )
  checks.need(
    all(isinstance(w, int | float) and w > 0 for w in weights),
    'distill.teacher_weights',
    f'must be positive numbers, got {weights!r}.',
  )
  if teachers:
    checks.need(
      d.coef > 0 or d.reward_coef > 0,
      'distill.coef',
      'and `distill.reward_coef` are both 0: the advantage would be 0.',
    )


SECTION = checks.Section(
  'distill',
  {
    'distill.coef': checks.non_negative(),
    'distill.reward_coef': checks.non_negative(),
    'distill.clip': checks.non_negative(),
    'distill.discount': checks.fraction(),
  },
  check,
)


class Teachers(NamedTuple):
  """The loaded teachers of a run."""

  params: list  # each teacher's parameters, on the trainer's mesh
  logprobs: list  # each teacher's (params, tokens, mask, loss_mask) -> [B, T]
  weights: tuple  # normalised to sum to 1
  advantages: object  # jitted (student_logp, teacher_logp [K, B, T], mask, valid) -> [B, T]


def enabled(config):
  """Whether `config` distills (a GRPO-family config with teachers)."""
  return 'distill' in config and bool(tuple(config.distill.teachers))


def load(config, resources, packer):
  """The `Teachers` of a run (None when it names none): each checkpoint
  loaded on the trainer's mesh as the policy is, its vocabulary checked
  against the tokenizer; raises ValueError naming `distill.teachers`."""
  if not enabled(config):
    return None
  d, m = config.distill, config.model
  params, fns = [], []
  for path in d.teachers:
    try:
      ck = hf_lib.load(
        path,
        mesh=resources.mesh,
        param_dtype=m.param_dtype,
        compute_dtype=m.compute_dtype,
        remat='none',
        scan_layers=m.scan_layers,
        attention_impl=m.attention,
      )
    except (OSError, ValueError, KeyError) as e:
      raise ValueError(f'`distill.teachers` {path!r}: {e}') from None
    vocab = resources.tokenizer.vocab_size
    if ck.config.vocab_size < vocab:
      raise ValueError(
        f'`distill.teachers` {path!r}: its vocabulary ({ck.config.vocab_size}) is smaller '
        f'than the tokenizer ({vocab}); a teacher must share the student tokenizer.'
      )
    params.append(ck.params)
    fns.append(
      online.logprobs_fn(
        ck.graphdef,
        config.sampling.temperature,
        config.train.chunk_size,
        packer,
        resources.train_xla,
      )
    )
  weights = tuple(float(w) for w in d.teacher_weights) or (1.0,) * len(params)
  total = sum(weights)
  weights = tuple(w / total for w in weights)
  advantages = jax.jit(
    functools.partial(
      L.distillation_advantages,
      weights_K=jnp.asarray(weights),
      clip=float(d.clip),
      discount=float(d.discount),
    )
  )
  return Teachers(params, fns, weights, advantages)


def advantages(teachers, d, rows, generated, student_logp, reward_adv, resources, metrics):
  """`d.coef` · A_distill + `d.reward_coef` · `reward_adv` [B, T] for a placed
  rollout (`d`: the `distill` section; the teachers' passes over minibatches
  of `rows`); adds the distillation metrics to `metrics`."""
  start = time.perf_counter()
  with resources.tracer.span('teacher'):
    teacher_logp = jnp.stack(
      [
        common.minibatched(fn, p, generated.batch, rows, resources.batch_sharding)
        for fn, p in zip(teachers.logprobs, teachers.params, strict=True)
      ]
    )
    jax.block_until_ready(teacher_logp)
  metrics['time/teacher'] = time.perf_counter() - start
  mask = generated.batch.loss_mask
  adv = teachers.advantages(student_logp, teacher_logp, mask=mask, valid=generated.valid)
  mixed = L.teacher_mixture(teacher_logp, teachers.weights)
  trained = online.trained_mask(generated)
  metrics.update(
    {k: float(v) for k, v in L.distillation_metrics(student_logp, mixed, trained).items()}
  )
  return d.coef * adv + d.reward_coef * reward_adv
