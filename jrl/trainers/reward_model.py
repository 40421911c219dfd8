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

An offline algorithm: `RewardModel` makes no sampler, no reward workers and no
topology.
"""

import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl import distributed, models, parallel
from jrl import losses as L
from jrl.data import PromptStream, packing, read_preference_jsonl, tasks
from jrl.trainers import checks, common, controller, setup, signals


class PairBatch(NamedTuple):
  tokens: jax.Array  # [2P, T]: rows 0..P-1 chosen, P..2P-1 rejected
  mask: jax.Array  # [2P, T] bool
  margin: jax.Array  # [P] float32 required margin per pair
  packed: Any = None  # jrl.data.packing.PackedInputs of the rows (`train.packing`), else None


def sequence_scores(graphdef, params, tokens, mask, packed=None):
  """[B] float32 scores: the scalar head at each row's last real token (on
  packed rows when `packed` is given, where each sequence's last token is
  its segment's last)."""
  if packed is None:
    return models.sequence_scores(graphdef, params, tokens, mask)
  v = models.values(
    graphdef, params, packed.tokens, positions=packed.positions, segment_ids=packed.segment_ids
  )
  v_BxT = packing.unpack_on_device(v, packed.index, packed.valid)
  last_B = jnp.maximum(jnp.sum(mask.astype(jnp.int32), axis=-1) - 1, 0)
  return jnp.take_along_axis(v_BxT, last_B[:, None], axis=-1)[:, 0]


def pair_loss(params, graphdef, batch, center_coef):
  """Mean Bradley-Terry loss of a batch of pairs, and its metrics."""
  scores = sequence_scores(graphdef, params, batch.tokens, batch.mask, batch.packed)
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


def check(config, batch_shards):
  """The `rm` section against the mesh and the task."""
  rm = config.rm
  if (2 * rm.pairs_per_step) % batch_shards:
    raise ValueError(
      f'`rm.pairs_per_step` x 2 must be divisible by the mesh batch axes ({batch_shards}).'
    )
  if not rm.train_path and config.task.kind != 'arith':
    raise ValueError('`rm.train_path` is required unless `task.kind` is "arith".')
  checks.no_micro_batches(config, batch_shards)


# The `rm` section: Bradley-Terry training on preference pairs. No `sft`
# warm-up (start from an SFT export) and no sampler: evaluation scores pairs.
SECTION = checks.Section(
  'rm',
  {
    'rm.steps': checks.count(0),
    'rm.pairs_per_step': checks.count(1),
    'rm.margin': checks.non_negative(),
    'rm.center_coef': checks.non_negative(),
  },
  check,
)
SECTIONS = (SECTION,)


def pair_sources(config, resources):
  """(`next_pairs(n, iteration)`, held-out pairs): `rm.train_path` and
  `rm.eval_path`, or arithmetic pairs from the task's streams."""
  rm = config.rm
  if rm.train_path:
    # Chosen and rejected are scored without an eos token.
    check_pair = functools.partial(resources.checker.pair, eos=False)
    pairs = PromptStream(
      read_preference_jsonl(rm.train_path, check=check_pair), seed=setup.seed(config.seed, 'rm')
    )
    resources.streams['rm_stream'] = pairs
    held_out = read_preference_jsonl(rm.eval_path, check=check_pair) if rm.eval_path else []
    return lambda n, iteration: pairs.next(n), held_out

  def task_pairs(n, iteration):
    examples = resources.streams['rl_stream'].next(n)
    return tasks.arith_pairs(examples, setup.seed(config.seed, iteration, 'corrupt'))

  return task_pairs, tasks.arith_pairs(resources.task.held_out, setup.seed(config.seed, 'rm_eval'))


def pack_pairs(resources, pairs):
  """[2P, T] rows: prompt + chosen for P pairs, then prompt + rejected."""
  prompts = [resources.encoder.prompt_ids(p['prompt']) for p in pairs]
  chosen = [resources.tokenizer.encode(str(p['chosen'])) for p in pairs]
  rejected = [resources.tokenizer.encode(str(p['rejected'])) for p in pairs]
  return common.pack_sequences(
    prompts + prompts, chosen + rejected, resources.seq_len, resources.tokenizer.pad_id
  )


def score_pairs(resources, scores, params, pairs, rows):
  """(chosen scores [P], rejected scores [P]) of preference pairs, scored in
  batches of `rows` rows (`scores(params, tokens, mask) -> [rows]`)."""
  shards = setup.batch_shards(resources.mesh)
  rows = max(shards, rows - rows % shards)
  packed = pack_pairs(resources, pairs)
  tokens, mask = np.asarray(packed.tokens), np.asarray(packed.mask)
  n = tokens.shape[0]
  pad = -n % rows
  tokens = np.concatenate([tokens, np.zeros((pad, tokens.shape[1]), np.int32)])
  mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), bool)])
  mask[n:, 0] = True  # padding rows score one token; dropped below
  out = []
  for start in range(0, tokens.shape[0], rows):
    sl = slice(start, start + rows)
    placed = common.place(
      common.SequenceBatch(tokens[sl], mask[sl], mask[sl]), resources.batch_sharding
    )
    out.append(distributed.fetch(scores(params, placed.tokens, placed.mask)))
  all_scores = np.concatenate(out)[:n]
  p = len(pairs)
  return all_scores[:p], all_scores[p:]


class Steps(NamedTuple):
  rm: Any  # train_step
  scores: Any  # (params, tokens, mask) -> [B] sequence scores


class RewardModel(controller.Job):
  """The job of reward-model training: `rm.steps` updates on
  `rm.pairs_per_step` pairs each, held-out pairwise accuracy every `eval.every`."""

  def __init__(self, config):
    self.config = config
    resources, _ = setup.start(config, SECTIONS)  # first: the checks name a missing section
    self.resources = resources
    rm = config.rm
    self.next_pairs, self.held_out = pair_sources(config, resources)
    tx, schedule = setup.optimizer(config)
    # The reward model (policy backbone + fresh scalar head) is what trains.
    head_key = jax.random.PRNGKey(setup.seed(config.seed, 'rm_head'))
    rm_graphdef, rm_params = setup.critic_from_policy(
      resources.model.config, resources.params, head_key, resources.mesh
    )
    self.state = setup.new_state(rm_params, tx, resources.mesh)
    shardings = setup.step_shardings(self.state, resources.mesh)
    rm_step = jax.jit(
      functools.partial(
        train_step, graphdef=rm_graphdef, tx=tx, schedule=schedule, center_coef=rm.center_coef
      ),
      donate_argnums=(0,),
      out_shardings=shardings,
      compiler_options=resources.train_xla,
    )
    scores = jax.jit(
      functools.partial(models.sequence_scores, rm_graphdef), compiler_options=resources.train_xla
    )
    # Traced under the training mesh (attention kernels per shard, `parallel.on_mesh`).
    self.steps = Steps(
      parallel.on_mesh(resources.mesh, rm_step), parallel.on_mesh(resources.mesh, scores)
    )
    self.replicated = shardings[1]
    self.packer = common.make_packer(config.train, resources.seq_len, resources.batch_sharding)

  def iterate(self, state, it):
    resources, rm = self.resources, self.config.rm
    t_step = time.perf_counter()
    pairs = self.next_pairs(rm.pairs_per_step, it)
    batch = pack_pairs(resources, pairs)
    margin = np.asarray(
      [float(p.get('margin', rm.margin)) for p in pairs], np.float32
    )  # a per-row "margin" field overrides the configured one
    rows = common.place(
      common.SequenceBatch(batch.tokens, batch.mask, batch.mask), resources.batch_sharding
    )
    rows = common.with_packed(rows, self.packer)
    margin = jax.device_put(margin, self.replicated)
    placed = PairBatch(rows.tokens, rows.mask, margin, rows.packed)
    start = time.perf_counter()
    with resources.tracer.span('update', iteration=it):
      state, metrics = self.steps.rm(state, placed)
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    metrics['time/update'] = time.perf_counter() - start
    metrics['time/step'] = time.perf_counter() - t_step
    metrics['phase'] = 1.0
    return state, signals.Report(metrics, signals.skipped(metrics, ('rm',)))

  def evaluate(self, state):
    """Held-out pairwise accuracy and mean margin."""
    if not self.held_out:
      return {}
    with self.resources.tracer.span('eval'):
      chosen, rejected = score_pairs(
        self.resources,
        self.steps.scores,
        state.params,
        self.held_out,
        2 * self.config.rm.pairs_per_step,
      )
    return {
      'eval/pair_accuracy': float(np.mean(chosen > rejected)),
      'eval/margin': float(np.mean(chosen - rejected)),
      'eval/reward_mean': float(np.mean(np.concatenate([chosen, rejected]))),
    }


ALGORITHM = checks.register(
  checks.Algorithm('reward_model', RewardModel, SECTIONS, steps_section='rm')
)
