"""Reward-model training: a Bradley-Terry objective on (prompt, chosen, rejected).

The reward model is the policy's transformer with a scalar head instead of
the LM head: the backbone comes from `model.path` (a policy checkpoint,
usually the SFT stage's export) and the head starts from a fresh random
init. A pair is scored as two rows, prompt + response (no end-of-sequence
token: `jrl.rewards.RewardModel` scores completions as the sampler returns
them, without their stop token), each taking the head's value at its last
real token; the loss is `jrl.losses.bradley_terry_loss` with an optional
margin and centring term.

Pairs come from JSONL files (`rm.train_path`, `rm.eval_path`) or, on the
arithmetic task, are made with a known true preference: the correct answer
over an answer off by 1 to 10 (held-out pairs from the task's held-out
problems), so accuracy can be read against the truth. Held-out pairwise
accuracy and margin are measured every `eval.every` iterations. The
export (`export_hf`) is a Hugging Face `*ForSequenceClassification`
directory that `reward.model_path` and `ppo.critic_path` read.
"""

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl import distributed, models
from jrl import losses as L
from jrl.data import PromptStream, read_preference_jsonl
from jrl.trainers import common, loop
from jrl.trainers.dpo import corrupt_answer
from jrl.trainers.ppo import critic_from_policy


class PairBatch(NamedTuple):
  tokens: jax.Array  # [2P, L]: rows 0..P-1 chosen, P..2P-1 rejected
  mask: jax.Array  # [2P, L] bool
  margin: jax.Array  # [P] float32 required margin per pair


def pair_loss(params, graphdef, batch, center_coef):
  """Mean Bradley-Terry loss of a batch of pairs, and its metrics."""
  scores = models.sequence_scores(graphdef, params, batch.tokens, batch.mask)
  p = scores.shape[0] // 2
  loss, metrics = L.bradley_terry_loss(
    scores[:p], scores[p:], margin=batch.margin, center_coef=center_coef
  )
  names = {
    'rewards_chosen': 'rm/chosen',
    'rewards_rejected': 'rm/rejected',
    'reward_margin': 'rm/margin',
    'reward_accuracy': 'rm/accuracy',
  }
  return jnp.mean(loss), {names[k]: v for k, v in metrics.items()}


def train_step(state, batch, *, graphdef, tx, schedule, center_coef):
  (loss, metrics), grads = jax.value_and_grad(pair_loss, has_aux=True)(
    state.params, graphdef, batch, center_coef
  )
  state, opt_metrics = common.apply_gradients(state, grads, loss, tx, schedule)
  metrics['rm/loss'] = loss
  metrics.update({f'rm/{k}': v for k, v in opt_metrics.items()})
  return state, metrics


def arith_pairs(examples, seed):
  """Correct answer chosen over a near miss, for each {'prompt', 'answer'} example."""
  rng = np.random.default_rng(seed)
  return [
    {'prompt': ex['prompt'], 'chosen': ex['answer'], 'rejected': corrupt_answer(ex['answer'], rng)}
    for ex in examples
  ]


class RewardModelTrainer(loop.Trainer):
  """The controller for reward-model training (`algorithm='reward_model'`)."""

  def _setup_algorithm(self):
    config, rm = self.config, self.config.rm
    if config.sft.steps:
      raise ValueError('`sft.steps` must be 0 for reward-model training (train the SFT first).')
    if rm.center_coef < 0:
      raise ValueError(f'`rm.center_coef` must be >= 0, got {rm.center_coef}.')
    if rm.margin < 0:
      raise ValueError(f'`rm.margin` must be >= 0, got {rm.margin}.')
    if rm.pairs_per_step < 1:
      raise ValueError(f'`rm.pairs_per_step` must be >= 1, got {rm.pairs_per_step}.')
    shards = self.mesh.shape['data'] * self.mesh.shape['fsdp']
    if (2 * rm.pairs_per_step) % shards:
      raise ValueError(
        f'`rm.pairs_per_step` x 2 must be divisible by the mesh batch axes ({shards}).'
      )
    if rm.train_path:
      # Chosen and rejected are scored without an eos token.
      check = functools.partial(self.example_checker.pair, eos=False)
      self.pairs = PromptStream(
        read_preference_jsonl(rm.train_path, check=check), seed=loop._seed(config.seed, 'rm')
      )
      self.streams['rm_stream'] = self.pairs
      self.held_out_pairs = read_preference_jsonl(rm.eval_path, check=check) if rm.eval_path else []
    elif config.task.kind == 'arith':
      self.pairs = None  # made from the task stream
      self.held_out_pairs = arith_pairs(self.task.held_out, loop._seed(config.seed, 'rm_eval'))
    else:
      raise ValueError('`rm.train_path` is required unless `task.kind` is "arith".')
    self._head_key = jax.random.PRNGKey(loop._seed(config.seed, 'rm_head'))
    self.rm_graphdef = None

  def _needs_reference(self):
    return False

  def _new_state(self, params, tx):
    """The reward model (policy backbone + fresh scalar head) is what trains."""
    if 'score' in params:  # already a reward model (restarting from a checkpoint state)
      rm_params = params
    else:
      self.rm_graphdef, rm_params = critic_from_policy(
        self.model_config, params, self._head_key, self.mesh
      )
    state = common.init_state(rm_params, tx)
    return common.place_on_mesh(state, self.mesh)

  def __init__(self, config):
    super().__init__(config)
    self._rm_step = jax.jit(
      functools.partial(
        train_step,
        graphdef=self.rm_graphdef,
        tx=self.tx,
        schedule=self.schedule,
        center_coef=config.rm.center_coef,
      ),
      donate_argnums=(0,),
      out_shardings=self.step_shardings,
    )
    self._scores = jax.jit(functools.partial(models.sequence_scores, self.rm_graphdef))

  def _next_pairs(self, n):
    if self.pairs is not None:
      return self.pairs.next(n)
    examples = self.rl_stream.next(n)
    return arith_pairs(examples, loop._seed(self.config.seed, self.iteration, 'corrupt'))

  def _pack(self, pairs):
    prompts = [self.encoder.prompt_ids(p['prompt']) for p in pairs]
    chosen = [self.tokenizer.encode(str(p['chosen'])) for p in pairs]
    rejected = [self.tokenizer.encode(str(p['rejected'])) for p in pairs]
    return common.pack_sequences(
      prompts + prompts, chosen + rejected, self.seq_len, self.tokenizer.pad_id
    )

  def rl_iteration(self):
    t_step = time.perf_counter()
    rm = self.config.rm
    pairs = self._next_pairs(rm.pairs_per_step)
    batch = self._pack(pairs)
    margin = np.asarray(
      [float(p.get('margin', rm.margin)) for p in pairs], np.float32
    )  # a per-row "margin" field overrides the configured one
    rows = self._place(common.SequenceBatch(batch.tokens, batch.mask, batch.mask))
    placed = PairBatch(rows.tokens, rows.mask, jax.device_put(margin, self.replicated))
    start = time.perf_counter()
    with self.tracer.span('update', iteration=self.iteration):
      self.state, m = self._rm_step(self.state, placed)
      m = {k: float(v) for k, v in jax.device_get(m).items()}
    m['time/update'] = time.perf_counter() - start
    m['time/step'] = time.perf_counter() - t_step
    m['phase'] = 1.0
    m['actor/nonfinite'] = m['rm/nonfinite']
    return m

  def score_pairs(self, pairs, batch_rows=None):
    """(chosen scores [P], rejected scores [P]) of preference pairs under the current model."""
    shards = self.mesh.shape['data'] * self.mesh.shape['fsdp']
    rows = batch_rows or 2 * self.config.rm.pairs_per_step
    rows = max(shards, rows - rows % shards)
    packed = self._pack(pairs)
    tokens, mask = np.asarray(packed.tokens), np.asarray(packed.mask)
    n = tokens.shape[0]
    pad = -n % rows
    tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), np.int32)])
    mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), bool)])
    mask[n:, 0] = True  # padding rows score one token; dropped below
    out = []
    for start in range(0, tokens.shape[0], rows):
      sl = slice(start, start + rows)
      placed = self._place(common.SequenceBatch(tokens[sl], mask[sl], mask[sl]))
      out.append(distributed.fetch(self._scores(self.state.params, placed.tokens, placed.mask)))
    scores = np.concatenate(out)[:n]
    p = len(pairs)
    return scores[:p], scores[p:]

  def evaluate(self):
    """Held-out pairwise accuracy and mean margin."""
    if not self.held_out_pairs:
      return {}
    with self.tracer.span('eval'):
      chosen, rejected = self.score_pairs(self.held_out_pairs)
    return {
      'eval/pair_accuracy': float(np.mean(chosen > rejected)),
      'eval/margin': float(np.mean(chosen - rejected)),
      'eval/reward_mean': float(np.mean(np.concatenate([chosen, rejected]))),
    }
