"""Offline preference optimisation: DPO, IPO, hinge (SLiC), SimPO and ORPO.

Pairs (prompt, chosen, rejected) come from a JSONL file (`dpo.train_path`)
or, on the arithmetic task, are made on the fly with a known true preference:
the correct answer is chosen, a corrupted one rejected. Chosen and rejected
rows go through the policy in one [2P, L] forward; the reference model (the
policy after the SFT warm-up) is scored once per step, outside the gradient.
"""

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl import losses as L
from jrl import models
from jrl.data import PromptStream, read_preference_jsonl
from jrl.trainers import common, loop

DPO_LOSSES = ('dpo', 'ipo', 'hinge', 'simpo', 'orpo')
_REFERENCE_FREE = ('simpo', 'orpo')
_AVERAGED = ('ipo', 'simpo', 'orpo')  # these take length-averaged logprobs


class DPOBatch(NamedTuple):
  tokens: jax.Array  # [2P, L]: rows 0..P-1 chosen, P..2P-1 rejected
  mask: jax.Array  # [2P, L] bool
  loss_mask: jax.Array  # [2P, L] bool response tokens
  ref_logp: jax.Array  # [2P] float32 reference sequence logprobs (sum or mean)


class DPOLossConfig(NamedTuple):
  loss: str = 'dpo'
  beta: float = 0.1
  label_smoothing: float = 0.0
  simpo_gamma: float = 0.5
  chunk_size: int = 1024


def sequence_logprobs(graphdef, params, tokens, mask, loss_mask, average, chunk_size=1024):
  """[B] sum (or mean) of the response tokens' logprobs."""
  logp, _ = models.next_token_logprobs(graphdef, params, tokens, mask, chunk_size=chunk_size)
  m = loss_mask.astype(jnp.float32)
  total = jnp.sum(logp * m, axis=-1)
  return total / jnp.maximum(jnp.sum(m, axis=-1), 1.0) if average else total


def preference_loss(params, graphdef, batch, cfg):
  average = cfg.loss in _AVERAGED
  seq = sequence_logprobs(
    graphdef, params, batch.tokens, batch.mask, batch.loss_mask, average, cfg.chunk_size
  )
  p = seq.shape[0] // 2
  chosen, rejected = seq[:p], seq[p:]
  ref_c, ref_r = batch.ref_logp[:p], batch.ref_logp[p:]
  if cfg.loss == 'dpo':
    loss, metrics = L.dpo_loss(
      chosen, rejected, ref_c, ref_r, beta=cfg.beta, label_smoothing=cfg.label_smoothing
    )
  elif cfg.loss == 'ipo':
    loss, metrics = L.ipo_loss(chosen, rejected, ref_c, ref_r, beta=cfg.beta)
  elif cfg.loss == 'hinge':
    loss, metrics = L.hinge_loss(chosen, rejected, ref_c, ref_r, beta=cfg.beta)
  elif cfg.loss == 'simpo':
    loss, metrics = L.simpo_loss(chosen, rejected, beta=cfg.beta, gamma=cfg.simpo_gamma)
  else:
    loss, metrics = L.orpo_loss(chosen, rejected, lam=cfg.beta)
  loss = jnp.mean(loss)
  names = {
    'rewards_chosen': 'rewards/chosen',
    'rewards_rejected': 'rewards/rejected',
    'reward_margin': 'rewards/margins',
    'reward_accuracy': 'rewards/accuracies',
  }
  out = {names.get(k, f'dpo/{k}'): v for k, v in metrics.items()}
  out['logps/chosen'] = jax.lax.stop_gradient(jnp.mean(chosen))
  out['logps/rejected'] = jax.lax.stop_gradient(jnp.mean(rejected))
  return loss, out


def train_step(state, batch, *, graphdef, tx, schedule, cfg):
  """One optimiser step on a batch of pairs; non-finite steps are skipped."""
  (loss, metrics), grads = jax.value_and_grad(preference_loss, has_aux=True)(
    state.params, graphdef, batch, cfg
  )
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule)
  metrics['dpo/loss'] = loss
  metrics.update({f'dpo/{k}': v for k, v in opt_metrics.items()})
  return state, metrics


def corrupt_answer(answer, rng):
  """A plausible wrong answer: the right one off by a small nonzero amount."""
  value = int(answer)
  delta = int(rng.choice([-1, 1])) * int(rng.integers(1, 11))
  wrong = value + delta
  return str(wrong if wrong >= 0 else value + abs(delta))


class DPOTrainer(loop.Trainer):
  """The controller for offline preference optimisation."""

  def _setup_algorithm(self):
    d = self.config.dpo
    if d.loss not in DPO_LOSSES:
      raise ValueError(f'`dpo.loss` must be one of {DPO_LOSSES}, got {d.loss!r}.')
    if not d.beta > 0:
      raise ValueError(f'`dpo.beta` must be > 0, got {d.beta}.')
    if d.pairs_per_step < 1:
      raise ValueError(f'`dpo.pairs_per_step` must be >= 1, got {d.pairs_per_step}.')
    if d.train_path:
      self.pairs = PromptStream(
        read_preference_jsonl(d.train_path, check=self.example_checker.pair),
        seed=loop._seed(self.config.seed, 'dpo'),
      )
      self.streams['dpo_stream'] = self.pairs
    elif self.config.task.kind == 'arith':
      self.pairs = None  # made from the task stream
    else:
      raise ValueError('`dpo.train_path` is required unless `task.kind` is "arith".')

  def _needs_reference(self):
    return self.config.dpo.loss not in _REFERENCE_FREE

  def __init__(self, config):
    super().__init__(config)
    d = config.dpo
    self.dpo_cfg = DPOLossConfig(
      loss=d.loss,
      beta=d.beta,
      label_smoothing=d.label_smoothing,
      simpo_gamma=d.simpo_gamma,
      chunk_size=config.rl.chunk_size,
    )
    self._dpo_step = jax.jit(
      functools.partial(
        train_step, graphdef=self.graphdef, tx=self.tx, schedule=self.schedule, cfg=self.dpo_cfg
      ),
      donate_argnums=(0,),
      out_shardings=self.step_shardings,
    )
    self._seq_logp = jax.jit(
      functools.partial(
        sequence_logprobs,
        self.graphdef,
        average=d.loss in _AVERAGED,
        chunk_size=config.rl.chunk_size,
      )
    )

  def _next_pairs(self, n):
    if self.pairs is not None:
      return self.pairs.next(n)
    examples = self.rl_stream.next(n)
    rng = np.random.default_rng(loop._seed(self.config.seed, self.iteration, 'corrupt'))
    return [
      {
        'prompt': ex['prompt'],
        'chosen': ex['answer'],
        'rejected': corrupt_answer(ex['answer'], rng),
      }
      for ex in examples
    ]

  def rl_iteration(self):
    t_step = time.perf_counter()
    d = self.config.dpo
    pairs = self._next_pairs(d.pairs_per_step)
    eos = list(self.stop_tokens[:1])
    prompts = [self.encoder.prompt_ids(p['prompt']) for p in pairs]
    chosen = [self.tokenizer.encode(p['chosen']) + eos for p in pairs]
    rejected = [self.tokenizer.encode(p['rejected']) + eos for p in pairs]
    batch = common.pack_sequences(
      prompts + prompts, chosen + rejected, self.seq_len, self.tokenizer.pad_id
    )
    placed = self._place(batch)
    start = time.perf_counter()
    if self.uses_ref:
      ref = self._seq_logp(
        self.state.extra['ref_params'], placed.tokens, placed.mask, placed.loss_mask
      )
    else:
      ref = jnp.zeros(placed.tokens.shape[0], jnp.float32)
    jax.block_until_ready(ref)
    t_ref = time.perf_counter() - start
    full = DPOBatch(placed.tokens, placed.mask, placed.loss_mask, ref)
    start = time.perf_counter()
    self.state, m = self._dpo_step(self.state, full)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    m['time/update'] = time.perf_counter() - start
    m['time/reference'] = t_ref
    m['time/step'] = time.perf_counter() - t_step
    m['phase'] = 1.0
    # The shared nonfinite bookkeeping reads actor/nonfinite.
    m['actor/nonfinite'] = m['dpo/nonfinite']
    return m
