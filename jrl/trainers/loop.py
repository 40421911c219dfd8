"""The controller of the GRPO family: generate → score → reference → advantages
→ update → log → checkpoint, with an optional SFT warm-up first.

`run(config)` is what `launch/train.py` calls. It reads top to bottom:

1. set-up: mesh, tokenizer, model (fresh or from a Hugging Face directory),
   data streams, rewards, sampler, optimiser, jitted steps;
2. resume from the latest checkpoint in `workdir` if there is one;
3. iterations: an SFT batch while `it < sft.steps`, else one RL step;
4. metrics every iteration, held-out evaluation every `eval.every`,
   a checkpoint every `checkpoint.every`, a plot and an export at the end.

All randomness is a function of (`seed`, iteration), and the data streams'
positions are checkpointed, so a run resumed from a checkpoint produces the
same parameters and metrics as one that never stopped.
"""

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import signal
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl import checkpoint as ckpt_lib
from jrl import distributed, models, parallel, rewards, sampler, trace
from jrl import losses as L
from jrl import metrics as metrics_lib
from jrl.data import (
  ANSWER_EXTRACTORS,
  ArithmeticTask,
  PromptFile,
  PromptStream,
  read_prompts,
  read_sft_jsonl,
)
from jrl.models import hf as hf_lib
from jrl.models.tokenizer import load_tokenizer
from jrl.rewards import shaping as reward_norm
from jrl.rewards.format import overlong_penalty
from jrl.rewards.server import RemoteRewardService
from jrl.trainers import checks, common, policy, sft
from jrl.trainers.optim import make_optimizer

GROUP_ESTIMATORS = ('grpo', 'dr_grpo', 'rloo', 'loo', 'reinforce_pp_baseline')
TOPOLOGIES = ('colocated', 'disaggregated', 'one_step_off')


def _seed(*parts):
  """A 31-bit seed from any tuple of ints and strings (stable across runs)."""
  digest = hashlib.sha256(repr(parts).encode()).digest()
  return int.from_bytes(digest[:4], 'little') & 0x7FFFFFFF


class Sampled(NamedTuple):
  """A generated and scored batch on the host (before the reference model)."""

  batch: common.SequenceBatch  # [B·G, L] NumPy
  old_logp: np.ndarray  # [B·G, L] the sampler's logprobs on response tokens
  rewards: np.ndarray  # [B·G] float32 total reward (overlong penalty included)
  version: int  # the iteration whose parameters generated it
  metrics: dict


class Rollout(NamedTuple):
  """One scored rollout batch, rows b·G + g, placed on the mesh."""

  batch: common.SequenceBatch  # [B·G, L]
  old_logp: jax.Array  # [B·G, L] the sampler's logprobs on response tokens
  ref_logp: jax.Array  # [B·G, L] reference logprobs (zeros without a reference)
  rewards: np.ndarray  # [B·G] float32 total reward (overlong penalty included)
  metrics: dict
  num_tokens: int = 0  # real tokens in the batch
  version: int = 0  # the iteration whose parameters generated it


def _advantage_metrics(adv, loss_mask):
  values = distributed.fetch(adv)[distributed.fetch(loss_mask)]
  return {
    'advantages/mean': float(values.mean()),
    'advantages/std': float(values.std()),
    'advantages/max': float(values.max()),
    'advantages/min': float(values.min()),
  }


# Config checks -----------------------------------------------------------------


def validate(config, batch_shards):
  """Raises ValueError naming the field for anything inconsistent.

  Every numeric field is first checked against its range (`checks.FIELDS`);
  what follows are the checks between fields and against the devices.
  """
  checks.check_fields(config)
  rl = config.rl

  def need(cond, field, msg):
    if not cond:
      raise ValueError(f'`{field}`: {msg}')

  need(
    rl.group_size >= 2 or rl.advantage not in GROUP_ESTIMATORS,
    'rl.group_size',
    f'must be >= 2 for the group estimator {rl.advantage!r}.',
  )
  need(rl.advantage in policy.ESTIMATORS, 'rl.advantage', f'must be one of {policy.ESTIMATORS}.')
  need(rl.policy_loss in policy.POLICY_LOSSES, 'rl.policy_loss', f'one of {policy.POLICY_LOSSES}.')
  need(rl.loss_agg in L.AGGREGATION_MODES, 'rl.loss_agg', f'one of {L.AGGREGATION_MODES}.')
  rows = rl.prompts_per_step * rl.group_size
  need(
    rows % rl.minibatch_size == 0,
    'rl.minibatch_size',
    f'must divide prompts_per_step x group_size = {rows}.',
  )
  need(
    rl.minibatch_size % batch_shards == 0,
    'rl.minibatch_size',
    f'must be divisible by the mesh batch axes data x fsdp = {batch_shards}.',
  )
  need(
    config.sft.batch_size % batch_shards == 0,
    'sft.batch_size',
    f'must be divisible by the mesh batch axes data x fsdp = {batch_shards}.',
  )
  need(
    0 <= rl.overlong_buffer < rl.max_new_tokens,
    'rl.overlong_buffer',
    'must be in [0, max_new_tokens).',
  )
  need(config.sampler.num_slots >= rl.group_size, 'sampler.num_slots', 'must be >= rl.group_size.')
  need(rl.kl_in in ('loss', 'reward'), 'rl.kl_in', "must be 'loss' or 'reward'.")
  need(
    rl.kl_estimator != 'k3_ratio_corrected' or rl.kl_in == 'loss',
    'rl.kl_estimator',
    "'k3_ratio_corrected' weights the KL by π/π_old, which exists only in the loss: "
    "set rl.kl_in='loss' or another estimator.",
  )
  tc = config.topology
  need(tc.kind in TOPOLOGIES, 'topology.kind', f'must be one of {TOPOLOGIES}.')
  need(
    tc.kind != 'disaggregated' or tc.rollout_devices >= 1,
    'topology.rollout_devices',
    'must be >= 1 for a disaggregated topology.',
  )
  need(
    tc.rollout_devices < jax.device_count(),
    'topology.rollout_devices',
    f'must leave devices for training (there are {jax.device_count()}).',
  )
  need(
    tc.kind != 'colocated' or tc.rollout_devices == 0,
    'topology.rollout_devices',
    "must be 0 for a colocated topology (use 'disaggregated').",
  )
  need(
    tc.kind != 'one_step_off' or config.algorithm == 'grpo',
    'topology.kind',
    "one_step_off runs the GRPO family (algorithm 'grpo') only.",
  )
  need(
    rl.prompts_per_step % jax.process_count() == 0,
    'rl.prompts_per_step',
    f'must be divisible by the number of processes ({jax.process_count()}).',
  )


# Set-up ------------------------------------------------------------------------


class Task:
  """Training and held-out examples as {'prompt', 'answer'} dicts.

  `filtered` counts the rows of prompt files left out for prompts longer than
  `rl.max_prompt_len` (`task.long_prompts='filter'`): {'train': n, 'eval': n}.
  """

  CHECKED_EXAMPLES = 256  # generated training examples run through `check`
  LONG_PROMPTS = ('error', 'filter')

  def __init__(self, task_config, seed, check=None, train_check=None):
    """`check(example)` (e.g. `checks.ExampleChecker.prompt`) runs on every
    held-out example, `train_check` (default: `check`) on every training one:
    each row of a prompt file, the first `CHECKED_EXAMPLES` of a generated task.
    Their ValueError is raised with the file and line (or row), or the index;
    with `task.long_prompts='filter'`, a file's rows whose prompt is too long
    (`checks.PromptTooLong`) are dropped and counted instead."""
    kind = task_config.kind
    train_check = train_check or check
    self.filtered = {'train': 0, 'eval': 0}
    if kind == 'arith':
      self.generator = ArithmeticTask(
        digits=task_config.digits, ops=task_config.ops, seed=task_config.train_seed
      )
      self.train = self.generator
      self.held_out = self.generator.held_out(task_config.eval_size, task_config.eval_seed)
    elif kind == 'arith_tool':
      from jrl.envs.arith import ArithToolTask

      self.generator = ArithToolTask(seed=task_config.train_seed)
      self.train = self.generator
      self.held_out = self.generator.held_out(task_config.eval_size, task_config.eval_seed)
    elif kind in ('file', 'jsonl'):
      train = self._read(task_config, 'train', train_check)
      held_out = self._read(task_config, 'eval', check) if task_config.eval_path else None
      self.train = train.rows
      self.held_out = held_out.rows[: task_config.eval_size] if held_out else []
    else:
      raise ValueError(
        f"`task.kind` must be 'arith', 'arith_tool', 'file' or 'jsonl', got {kind!r}."
      )
    if check is not None and kind not in ('file', 'jsonl'):
      # Generated problems share one format: the first ones stand for the rest.
      train = ((i, self.train.example(i)) for i in range(self.CHECKED_EXAMPLES))
      checks.check_generated(f'task {kind!r} training', train, train_check)
      checks.check_generated(f'task {kind!r} held-out', enumerate(self.held_out), check)
    self.seed = seed

  def _read(self, task_config, split, check) -> PromptFile:
    """The `split` file ('train' | 'eval'), its too-long prompts dropped if asked."""
    long_prompts = task_config.long_prompts
    if long_prompts not in self.LONG_PROMPTS:
      raise ValueError(
        f'`task.long_prompts` must be one of {self.LONG_PROMPTS}, got {long_prompts!r}.'
      )
    extractor = task_config.answer_extractor
    if extractor not in ANSWER_EXTRACTORS:
      raise ValueError(
        f'`task.answer_extractor` must be one of {ANSWER_EXTRACTORS}, got {extractor!r}.'
      )
    path = task_config[f'{split}_path']
    read = read_prompts(
      path,
      prompt_key=task_config.prompt_key,
      answer_key=task_config.answer_key,
      answer_extractor=extractor,
      check=check,
      drop=(checks.PromptTooLong,) if long_prompts == 'filter' else (),
    )
    self.filtered[split] = len(read.dropped)
    if read.dropped and distributed.is_main():
      where, why = read.dropped[0]
      print(
        f'task: dropped {len(read.dropped)} of {len(read.rows) + len(read.dropped)} {split} '
        f'rows of {path} (task.long_prompts=filter); the first, {where}: {why}'
      )
    return read


class Encoder:
  """Turns example prompts into token ids (raw text or the chat template).

  With the chat template, `system_prompt` (if set) opens every conversation
  that has no system message of its own, and `template_kwargs` (e.g.
  {'enable_thinking': False}) are passed to the template's render.
  """

  def __init__(self, tokenizer, use_chat_template, add_bos, system_prompt='', template_kwargs=None):
    if system_prompt and not use_chat_template:
      raise ValueError('`task.system_prompt` needs `task.chat_template` = True.')
    self.tokenizer = tokenizer
    self.use_chat_template = use_chat_template
    self.add_bos = add_bos
    self.system_prompt = system_prompt
    self.template_kwargs = dict(template_kwargs or {})

  def prompt_text(self, prompt):
    if not (isinstance(prompt, list) or self.use_chat_template):
      return prompt
    messages = prompt if isinstance(prompt, list) else [{'role': 'user', 'content': prompt}]
    if self.system_prompt and not (messages and messages[0]['role'] == 'system'):
      messages = [{'role': 'system', 'content': self.system_prompt}, *messages]
    return self.tokenizer.apply_chat_template(
      messages, add_generation_prompt=True, **self.template_kwargs
    )

  def prompt_ids(self, prompt):
    ids = self.tokenizer.encode(self.prompt_text(prompt))
    if self.add_bos and self.tokenizer.bos_id is not None:
      ids = [self.tokenizer.bos_id, *ids]
    return ids


def build_model(config, tokenizer, mesh):
  """(ModelConfig, graphdef, params, hf_config or None)."""
  m = config.model
  if m.path:
    ck = hf_lib.load(m.path, mesh=mesh, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype)
    if ck.config.vocab_size < tokenizer.vocab_size:
      raise ValueError(
        f'`model.path` vocabulary ({ck.config.vocab_size}) is smaller than the tokenizer '
        f'({tokenizer.vocab_size}).'
      )
    return ck.config, ck.graphdef, ck.params, ck.hf_config
  model_config = models.ModelConfig(
    vocab_size=tokenizer.vocab_size,
    width=m.width,
    mlp_width=m.mlp_width,
    num_layers=m.num_layers,
    num_heads=m.num_heads,
    num_kv_heads=m.num_kv_heads,
    head_dim=m.head_dim,
    tie_embeddings=m.tie_embeddings,
    init_std=m.init_std,
    param_dtype=m.param_dtype,
    compute_dtype=m.compute_dtype,
  )
  graphdef, params = models.create_sharded(model_config, jax.random.PRNGKey(config.seed), mesh)
  return model_config, graphdef, params, None


def _policy_loss_config(rl):
  return policy.PolicyLossConfig(
    policy_loss=rl.policy_loss,
    eps_low=rl.eps_low,
    eps_high=rl.eps_high,
    dual_clip_c=rl.dual_clip_c or None,
    log_ratio_clamp=rl.log_ratio_clamp or None,
    loss_agg=rl.loss_agg,
    loss_norm=rl.loss_norm or None,
    kl_coef=rl.kl_coef if rl.kl_in == 'loss' else 0.0,
    kl_estimator=rl.kl_estimator,
    kl_input_clamp=rl.kl_input_clamp or None,
    kl_output_clamp=rl.kl_output_clamp or None,
    entropy_coef=rl.entropy_coef,
    temperature=rl.temperature,
    chunk_size=rl.chunk_size,
    sapo_tau_pos=rl.sapo_tau_pos,
    sapo_tau_neg=rl.sapo_tau_neg,
    vespo_k_pos=rl.vespo_k_pos,
    vespo_lambda_pos=rl.vespo_lambda_pos,
    vespo_k_neg=rl.vespo_k_neg,
    vespo_lambda_neg=rl.vespo_lambda_neg,
    off_policy_mask_threshold=rl.off_policy_mask_threshold or None,
  )


def _advantage_config(rl):
  return policy.AdvantageConfig(
    estimator=rl.advantage,
    scale=rl.adv_scale,
    std=rl.adv_std,
    eps=rl.adv_eps,
    gamma=rl.gamma,
    kl_coef_in_reward=rl.kl_coef if rl.kl_in == 'reward' else 0.0,
  )


# The run -------------------------------------------------------------------------


class Trainer:
  """Holds the set-up of one run; `run()` executes it."""

  def __init__(self, config):
    self.config = config
    mc, tc = config.mesh, config.topology
    # Disaggregated (or one-step-off with `rollout_devices`): the last
    # `rollout_devices` devices sample, the others train.
    devices = jax.devices()
    rollout_devices = None
    if tc.kind != 'colocated' and 0 < tc.rollout_devices < len(devices):
      devices, rollout_devices = devices[: -tc.rollout_devices], devices[-tc.rollout_devices :]
    self.mesh = parallel.make_mesh(mc.data, mc.fsdp, mc.tensor, devices=devices)
    batch_shards = self.mesh.shape['data'] * self.mesh.shape['fsdp']
    validate(config, batch_shards)
    self.rollout_mesh = self.mesh
    if rollout_devices is not None:
      self.rollout_mesh = parallel.make_mesh(-1, 1, 1, devices=rollout_devices)
    self.staleness = tc.staleness if tc.kind == 'one_step_off' else 0
    self.workdir = os.path.abspath(config.workdir)
    os.makedirs(self.workdir, exist_ok=True)

    tok_path = config.tokenizer or config.model.path
    if not tok_path:
      raise ValueError("`tokenizer` must be 'char' or a directory (or set `model.path`).")
    self.tokenizer = load_tokenizer(tok_path)
    tk = config.task
    self.encoder = Encoder(
      self.tokenizer,
      tk.chat_template,
      tk.add_bos,
      system_prompt=tk.system_prompt,
      template_kwargs=tk.chat_template_kwargs.to_dict(),
    )
    # Every example is encoded once now: a character the tokenizer lacks or a
    # prompt over `rl.max_prompt_len` fails here with its file and line.
    self.example_checker = checks.ExampleChecker(
      self.encoder.prompt_ids,
      self.tokenizer.encode,
      config.rl.max_prompt_len,
      config.rl.max_prompt_len + config.rl.max_new_tokens,
    )
    # SFT reads (prompt, response) pairs from `sft.train_path`, else the task's
    # (prompt, answer) examples: then their answers must fit a row too.
    sft_check = self.example_checker.sft if config.sft.steps else None
    train_check = self.example_checker.prompt
    if sft_check is not None and not config.sft.train_path:
      train_check = sft_check
    self.task = Task(config.task, config.seed, self.example_checker.prompt, train_check)
    # Every stream's position is checkpointed (subclasses may add streams).
    self.rl_stream = PromptStream(self.task.train, seed=_seed(config.seed, 'rl'))
    sft_source = self.task.train
    if config.sft.train_path:
      sft_source = read_sft_jsonl(config.sft.train_path, check=sft_check)
    self.sft_stream = PromptStream(sft_source, seed=_seed(config.seed, 'sft'))
    self.streams = {'rl_stream': self.rl_stream, 'sft_stream': self.sft_stream}
    self.model_config, self.graphdef, params, self.hf_config = build_model(
      config, self.tokenizer, self.mesh
    )
    self.rollout_shardings = None
    if self.rollout_mesh is not self.mesh:
      self.rollout_shardings = parallel.param_shardings(
        self.rollout_mesh,
        params,
        models.transformer.param_logical_axes,
        units=models.transformer.head_units(self.model_config),
      )
    # Reward functions are looked up now (an unknown name fails here); worker
    # processes start at the end of the set-up, once nothing else can fail.
    rc = config.reward
    if not rc.url:
      for name in rc.functions:
        if name not in ('reward_model', 'judge'):
          rewards.get_reward_fn(name)
    self._eval_scorer = None  # started by the first evaluation
    self.stop_tokens = tuple(self.tokenizer.eos_ids)
    rl = config.rl
    self.seq_len = rl.max_prompt_len + rl.max_new_tokens
    self.tracer = trace.Tracer(enabled=config.log.trace, pid=jax.process_index())
    self._build_sampler()
    self.sampler.tracer = self.tracer

    # Optimiser and state. The reference model is the policy at the start of RL.
    # One optimiser per phase (the SFT warm-up has its own learning rate); the
    # optimiser state and step restart when RL begins.
    self.tx, self.schedule = make_optimizer(config.optim)
    sft_optim = config.optim.copy_and_resolve_references()
    with sft_optim.unlocked():
      sft_optim.lr = config.sft.lr
      sft_optim.warmup_steps = config.sft.warmup_steps
      sft_optim.decay_steps = 0
    self.sft_tx, self.sft_schedule = make_optimizer(sft_optim)
    self.accum = int(config.optim.grad_accum)
    self._setup_algorithm()
    self.uses_ref = self._needs_reference()
    first_tx = self.sft_tx if config.sft.steps else self.tx
    self.state = self._new_state(params, first_tx)
    self.state_shardings = jax.tree.map(lambda x: x.sharding, self.state)
    self.replicated = parallel.replicated(self.mesh)
    # Steps return the state in the layout they received it: compiled once.
    self.step_shardings = (self.state_shardings, self.replicated)
    self.loss_cfg = _policy_loss_config(rl)
    self.adv_cfg = _advantage_config(rl)

    batch_sharding = parallel.batch_sharding(self.mesh)
    self.batch_sharding = batch_sharding
    # Data loading sharded by process: each reads only the rows its devices hold.
    g = rl.group_size
    lo, hi = distributed.local_rows(batch_sharding, rl.prompts_per_step * g)
    if lo % g or hi % g:
      raise ValueError(
        f'`rl.group_size`: process {jax.process_index()} holds rollout rows [{lo}, {hi}), '
        f'which split groups of {g}; make prompts_per_step x group_size / processes a '
        'multiple of group_size.'
      )
    self.prompt_rows = (lo // g, hi // g)
    self.sft_rows = distributed.local_rows(batch_sharding, config.sft.batch_size)
    self.is_main = distributed.is_main()
    # One-step-off: the rollout being generated in the background, the
    # parameters it reads, and the stream positions from before it drew.
    self.reward_moments = reward_norm.init()  # running reward statistics (`reward.normalize`)
    self.pending = None
    self.pending_params = None
    self.pending_streams = None
    self.sampler_lock = threading.Lock()
    self.executor = None
    if tc.kind == 'one_step_off':
      self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='rollout')
    self._rl_step = jax.jit(
      functools.partial(
        policy.train_step,
        graphdef=self.graphdef,
        tx=self.tx,
        schedule=self.schedule,
        cfg=self.loss_cfg,
        accum=self.accum,
      ),
      donate_argnums=(0,),
      out_shardings=self.step_shardings,
    )
    self._sft_step = jax.jit(
      functools.partial(
        sft.train_step,
        graphdef=self.graphdef,
        tx=self.sft_tx,
        schedule=self.sft_schedule,
        chunk_size=rl.chunk_size,
        accum=self.accum,
      ),
      donate_argnums=(0,),
      out_shardings=self.step_shardings,
    )
    self._logprobs = jax.jit(
      functools.partial(
        models.next_token_logprobs,
        self.graphdef,
        temperature=rl.temperature,
        chunk_size=rl.chunk_size,
      )
    )
    self._advantages = jax.jit(
      functools.partial(policy.advantages, group_size=rl.group_size, cfg=self.adv_cfg)
    )
    self.checkpointer = ckpt_lib.Checkpointer(
      os.path.join(self.workdir, 'checkpoints'),
      keep=config.checkpoint.keep,
      async_save=config.checkpoint.async_save,
    )
    self.iteration = 0
    self.total = config.sft.steps + rl.steps
    self.scorer = self._make_scorer()

  def _make_scorer(self):
    rc = self.config.reward
    if rc.url:
      return RemoteRewardService(rc.url, timeout_s=rc.timeout_s, unscored_value=rc.unscored_value)
    self.sandbox_level = None
    if 'code_tests' in rc.functions:  # refuses here, at start-up, unless isolated or opted in
      self.sandbox_level = rewards.code.configure_sandbox(unsafe=rc.sandbox_unsafe)
      if self.is_main:
        print(f'code_tests: sandbox isolation {self.sandbox_level!r}', flush=True)
    return rewards.RewardService(
      rc.functions,
      rc.weights,
      unscored_value=rc.unscored_value,
      mode=rc.mode,
      workers=rc.workers,
      timeout_s=rc.timeout_s,
      inline_fns=self._inline_reward_fns(),
    )

  @property
  def eval_scorer(self):
    """The held-out scorer. Held-out answers are model output too: they are
    scored in a worker process with the training rewards' deadline, never in
    the trainer's process."""
    if self._eval_scorer is None:
      self._eval_scorer = rewards.RewardService(
        (self.config.eval.reward,),
        mode='process',
        workers=1,
        timeout_s=self.config.reward.timeout_s,
      )
    return self._eval_scorer

  def _close_scorers(self):
    self.scorer.close()
    if self._eval_scorer is not None:
      self._eval_scorer.close()
      self._eval_scorer = None

  def close(self):
    """Stops the reward workers and finishes pending checkpoint writes."""
    self._drain()
    self._close_scorers()
    self.checkpointer.wait()

  def _drain(self):
    """Waits for a background rollout (its result is regenerated on resume)."""
    if self.pending is not None:
      concurrent.futures.wait([self.pending])
    if self.executor is not None:
      self.executor.shutdown(wait=True)

  def rollout_params(self):
    """The parameters the sampler reads for the current policy version.

    Colocated: the trainer's own arrays (no copy). Disaggregated: one
    device-to-device reshard onto the rollout devices. One-step-off: a copy,
    since the update donates the trainer's buffers while generation runs.
    """
    params = self.state.params
    if self.rollout_shardings is not None:
      with self.tracer.span('reshard'):
        return jax.block_until_ready(jax.device_put(params, self.rollout_shardings))
    if self.staleness:
      return jax.tree.map(jnp.copy, params)
    return params

  def _build_sampler(self):
    config, rl = self.config, self.config.rl
    sc = config.sampler
    g = rl.group_size
    num_pages = sc.num_pages or sampler.pool_pages(
      rl.max_prompt_len, rl.max_new_tokens, g, sc.page_size, sc.num_slots
    )
    self.engine_config = sampler.EngineConfig(
      num_slots=sc.num_slots,
      num_pages=num_pages,
      page_size=sc.page_size,
      max_prompt_len=rl.max_prompt_len,
      max_new_tokens=rl.max_new_tokens,
      max_stop_tokens=max(1, len(self.stop_tokens)),
      attention_impl=sc.attention_impl,
    )._replace(**self._engine_overrides())
    self.sampler = sampler.Sampler(
      self.graphdef,
      self.model_config,
      self.engine_config,
      steps_per_dispatch=sc.steps_per_dispatch,
      mesh=self.rollout_mesh,
    )

  # Checkpoints -----------------------------------------------------------------

  def _meta(self):
    streams = {name: stream.state() for name, stream in self.streams.items()}
    if self.pending_streams is not None:
      streams = self.pending_streams
    return {
      'iteration': self.iteration,
      'streams': streams,
      'nonfinite_run': self.nonfinite_run,
      'unscored_run': self.unscored_run,
      'pending_rollout': self.pending_params is not None,
      'reward_moments': list(self.reward_moments),
      'config': json.loads(self.config.to_json_best_effort()),
    }

  def save(self, force=False):
    # One-step-off: the rollout in flight is not saved; the parameters it reads
    # are, so that a resumed run regenerates exactly the same rollout.
    with self.tracer.span('checkpoint', iteration=self.iteration):
      self.checkpointer.save(
        self.iteration, self.state, self._meta(), force=force, behaviour=self.pending_params
      )
    self.write_trace()

  def write_trace(self):
    """workdir/trace.json (process 0), for ui.perfetto.dev or chrome://tracing."""
    if self.is_main:
      model = {
        f.name: getattr(self.model_config, f.name)
        for f in dataclasses.fields(self.model_config)
        if f.name != 'rope_scaling'
      }
      other = {'config': json.loads(self.config.to_json_best_effort()), 'model': model}
      self.tracer.write(os.path.join(self.workdir, 'trace.json'), other)

  def maybe_restore(self):
    """Restores the newest intact checkpoint (damaged newer ones are skipped
    with a warning); returns its iteration, 0 when there is none."""
    abstract = ckpt_lib.abstract_like(self.state)
    latest, state, meta = self.checkpointer.restore_latest_intact(abstract)
    if latest is None:
      return 0
    self.state = state
    self.iteration = int(meta['iteration'])
    for name, stream in self.streams.items():
      stream.restore(meta['streams'][name])
    self.nonfinite_run = int(meta.get('nonfinite_run', 0))
    self.unscored_run = int(meta.get('unscored_run', 0))
    self.reward_moments = reward_norm.RunningMoments(*meta.get('reward_moments', (0, 0, 0)))
    if meta.get('pending_rollout') and self.staleness:
      behaviour = ckpt_lib.abstract_like(self.state.params)
      if self.rollout_shardings is not None:
        behaviour = jax.tree.map(
          lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
          behaviour,
          self.rollout_shardings,
        )
      self.pending_params = self.checkpointer.restore_behaviour(latest, behaviour)
    if self.is_main:
      print(f'resumed from {self.checkpointer.directory}/{latest} (iteration {self.iteration})')
    return self.iteration

  # Steps -------------------------------------------------------------------------

  def _place(self, batch):
    """Host arrays that every process holds whole -> batch-sharded global arrays."""
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), self.batch_sharding), batch)

  def _place_rows(self, batch, num_rows):
    """This process's rows of a batch -> global arrays of `num_rows` rows."""
    return jax.tree.map(lambda x: distributed.put_rows(x, self.batch_sharding, num_rows), batch)

  def sft_iteration(self):
    config = self.config
    examples = self.sft_stream.next(config.sft.batch_size, self.sft_rows)
    eos = self.stop_tokens[:1]
    prompts = [self.encoder.prompt_ids(ex['prompt']) for ex in examples]
    responses = [
      self.tokenizer.encode(str(ex['response'] if 'response' in ex else ex['answer'])) + list(eos)
      for ex in examples
    ]
    batch = common.pack_sequences(prompts, responses, self.seq_len, self.tokenizer.pad_id)
    start = time.perf_counter()
    with self.tracer.span('sft_update', iteration=self.iteration):
      self.state, m = self._sft_step(self.state, self._place_rows(batch, config.sft.batch_size))
      m = jax.device_get(m)
    m['time/update'] = time.perf_counter() - start
    m['phase'] = 0.0
    return m

  def _gather_prompts(self, ids_local):
    """Every process's prompt token lists, in global order."""
    if jax.process_count() == 1:
      return ids_local
    width = self.config.rl.max_prompt_len
    padded = np.zeros((len(ids_local), width + 1), np.int32)
    for row, ids in enumerate(ids_local):
      if len(ids) > width:
        raise ValueError(f'a prompt of {len(ids)} tokens exceeds `rl.max_prompt_len`={width}.')
      padded[row, 0] = len(ids)
      padded[row, 1 : 1 + len(ids)] = ids
    return [list(r[1 : 1 + r[0]]) for r in distributed.gather_rows(padded)]

  def _generate(self, prompt_ids, draw, params, iteration):
    rl = self.config.rl
    requests = [
      sampler.Request(
        prompt=ids,
        max_new_tokens=rl.max_new_tokens,
        temperature=rl.temperature,
        top_k=rl.top_k,
        top_p=rl.top_p,
        stop_tokens=self.stop_tokens,
        seed=_seed(self.config.seed, iteration, draw, i),
      )
      for i, ids in enumerate(prompt_ids)
    ]
    with self.sampler_lock:
      groups = self.sampler.generate(params, requests, group_size=rl.group_size)
    return requests, groups

  def _score(self, examples, groups):
    """Scores this process's groups; returns the batch's ScoredBatch (all processes)."""
    g = self.config.rl.group_size
    texts = [
      self.tokenizer.decode(
        [t for t in c.tokens if t not in self.stop_tokens], skip_special_tokens=True
      )
      for grp in groups
      for c in grp
    ]
    prompts = [self.encoder.prompt_text(ex['prompt']) for ex in examples for _ in range(g)]
    meta = [ex for ex in examples for _ in range(g)]
    scored = self.scorer(prompts, texts, meta)
    if jax.process_count() == 1:
      return scored
    names = sorted(scored.per_fn)
    counts = np.asarray(
      [[scored.unscored[n], scored.failures[n], scored.timeouts[n]] for n in names], np.int64
    )
    counts = distributed.gather_rows(counts[None]).sum(axis=0)
    return rewards.ScoredBatch(
      total=distributed.gather_rows(scored.total),
      per_fn={n: distributed.gather_rows(scored.per_fn[n]) for n in names},
      unscored={n: int(c[0]) for n, c in zip(names, counts, strict=True)},
      failures={n: int(c[1]) for n, c in zip(names, counts, strict=True)},
      timeouts={n: int(c[2]) for n, c in zip(names, counts, strict=True)},
      errors=scored.errors,
    )

  def _overlong_penalty(self, lengths):
    rl = self.config.rl
    return overlong_penalty(lengths, rl.max_new_tokens, rl.overlong_buffer, rl.overlong_penalty)

  def collect_rollout(self):
    """Generates and scores one batch of groups with the current policy."""
    return self._with_reference(self.sample(self.rollout_params(), self.iteration))

  def sample(self, params, iteration, version=None):
    """Generates and scores one batch of groups; returns a Sampled (host arrays).

    `iteration` seeds the sampling (the iteration that will train on it);
    `version` is the iteration whose parameters `params` are (default: the same).

    Touches only the sampler, the RL stream and the reward service, so it may
    run in a background thread while the trainer updates (one-step-off).

    DAPO's dynamic sampling drops groups whose rewards are all equal (no
    signal) and draws more prompts until `prompts_per_step` groups are kept;
    if `dynamic_sampling_max_draws` runs out, dropped groups fill up.
    """
    rl = self.config.rl
    g, b = rl.group_size, rl.prompts_per_step
    plo, phi = self.prompt_rows
    m = {}
    kept, dropped = [], []
    t_gen = t_reward = 0.0
    zero_var_groups = drawn_groups = gen_tokens = 0
    first_scored = None
    for draw in range(1 + (rl.dynamic_sampling_max_draws if rl.dynamic_sampling else 0)):
      examples = self.rl_stream.next(b, self.prompt_rows)
      prompt_ids = self._gather_prompts([self.encoder.prompt_ids(ex['prompt']) for ex in examples])
      start = time.perf_counter()
      with self.tracer.span('generate', iteration=iteration, draw=draw):
        requests, groups = self._generate(prompt_ids, draw, params, iteration)
      t_gen += time.perf_counter() - start
      gen_tokens += sum(len(c.tokens) for grp in groups for c in grp)
      start = time.perf_counter()
      with self.tracer.span('reward', iteration=iteration):
        scored = self._score(examples, groups[plo:phi])
      first_scored = first_scored or scored
      lengths = [len(c.tokens) for grp in groups for c in grp]
      total = (scored.total - self._overlong_penalty(lengths)).reshape(b, g)
      t_reward += time.perf_counter() - start
      zero_var = total.max(axis=1) == total.min(axis=1)
      zero_var_groups += int(zero_var.sum())
      drawn_groups += b
      for j in range(b):
        item = (requests[j], groups[j], total[j])
        (dropped if rl.dynamic_sampling and zero_var[j] else kept).append(item)
      if len(kept) >= b:
        break
    if rl.dynamic_sampling:
      m['groups/dynamic_sampling_short'] = float(len(kept) < b)
    kept = (kept + dropped)[:b]
    requests = [k[0] for k in kept]
    groups = [k[1] for k in kept]
    rewards_np = np.concatenate([k[2] for k in kept]).astype(np.float32)

    # Rows: prompt + completion, with the sampler's logprobs on the completion.
    prompts = [r.prompt for r in requests for _ in range(g)]
    completions = [c for grp in groups for c in grp]
    batch = common.pack_sequences(
      prompts, [c.tokens for c in completions], self.seq_len, self.tokenizer.pad_id
    )
    old_logp = np.zeros(batch.tokens.shape, np.float32)
    for row, c in enumerate(completions):
      start = len(prompts[row])
      old_logp[row, start : start + len(c.tokens)] = c.logprobs
    lengths = np.asarray([len(c.tokens) for c in completions])

    m['reward/mean'] = float(rewards_np.mean())
    m['reward/std'] = float(rewards_np.std())
    for name, values in first_scored.per_fn.items():
      scored_values = values[np.isfinite(values)]
      m[f'reward/{name}/mean'] = float(scored_values.mean()) if scored_values.size else 0.0
      m[f'reward/{name}/std'] = float(scored_values.std()) if scored_values.size else 0.0
      m[f'reward/{name}/unscored'] = float(first_scored.unscored[name])
      m[f'reward/{name}/failures'] = float(first_scored.failures[name])
      m[f'reward/{name}/timeouts'] = float(first_scored.timeouts[name])
      m[f'reward/{name}/unscored_frac'] = float(np.mean(~np.isfinite(values)))
    if self.sandbox_level is not None:  # 3 full, 2 no cgroup, 1 degraded (unsafe opt-in)
      m['reward/sandbox_isolation'] = float(rewards.sandbox.isolation_metric())
    if first_scored.errors:
      self.last_reward_errors = list(first_scored.errors)
      print('reward errors (scored as unscored):\n  ' + '\n  '.join(first_scored.errors))
    m['reward/length_corr'] = reward_norm.length_correlation(rewards_np, lengths)
    m['response_length/mean'] = float(lengths.mean())
    m['response_length/max'] = float(lengths.max())
    m['response_length/clip_ratio'] = float(
      np.mean([c.finish_reason == 'length' for c in completions])
    )
    m['groups/zero_variance_frac'] = zero_var_groups / drawn_groups
    m['groups/drawn'] = float(drawn_groups)
    m['time/generate'] = t_gen
    m['time/reward'] = t_reward
    m['throughput/generate_tokens_per_s'] = gen_tokens / max(t_gen, 1e-9)
    return Sampled(batch, old_logp, rewards_np, iteration if version is None else version, m)

  def _shape_rewards(self, raw, m):
    """Clipping and running normalisation (`reward.clip`, `reward.normalize`),
    in the main thread and in step order, so a resumed run shapes alike."""
    rc = self.config.reward
    if rc.normalize:
      self.reward_moments = reward_norm.update(self.reward_moments, raw)
      shaped = reward_norm.normalize(self.reward_moments, raw, clip=rc.clip)
      m['reward/running_mean'] = float(self.reward_moments.mean)
      m['reward/running_std'] = reward_norm.std(self.reward_moments)
      m['reward/shaped_mean'] = float(shaped.mean())
      return shaped
    return reward_norm.clip_rewards(raw, rc.clip)

  def _with_reference(self, sampled):
    """Places a Sampled batch on the mesh and adds reference logprobs
    (skipped when the KL coefficient is 0)."""
    m = dict(sampled.metrics)
    start = time.perf_counter()
    placed = self._place(sampled.batch)
    ref_logp = jnp.zeros(sampled.batch.tokens.shape, jnp.float32)
    if self.uses_ref:
      with self.tracer.span('reference'):
        ref_logp = self._minibatched_logprobs(self.state.extra['ref_params'], placed)
        jax.block_until_ready(ref_logp)
    t_ref = time.perf_counter() - start
    m['time/reference'] = t_ref
    num_tokens = int(np.asarray(sampled.batch.mask).sum())
    if self.uses_ref:
      m['throughput/reference_tokens_per_s'] = num_tokens / max(t_ref, 1e-9)
    return Rollout(
      batch=placed,
      old_logp=self._place(sampled.old_logp),
      ref_logp=ref_logp,
      rewards=self._shape_rewards(sampled.rewards, m),
      metrics=m,
      num_tokens=num_tokens,
      version=sampled.version,
    )

  def run_minibatches(self, step_fn, full):
    """`rl.epochs` passes of `step_fn` over minibatches of `full` (a pytree of
    [B·G, ...] arrays), in permutations fixed by (seed, iteration).

    Returns:
      (metrics averaged over minibatches, seconds).
    """
    rl = self.config.rl
    start = time.perf_counter()
    rows = rl.prompts_per_step * rl.group_size
    mb = rl.minibatch_size
    results = []
    for epoch in range(rl.epochs):
      rng = np.random.default_rng(_seed(self.config.seed, self.iteration, 'perm', epoch))
      perm = rng.permutation(rows)
      for k in range(rows // mb):
        idx = jnp.asarray(np.sort(perm[k * mb : (k + 1) * mb]))
        mini = jax.tree.map(lambda x, idx=idx: jax.device_put(x[idx], self.batch_sharding), full)
        self.state, um = step_fn(self.state, mini)
        results.append(um)
    results = jax.device_get(results)
    m = {k: float(np.mean([u[k] for u in results])) for k in results[0]}
    # The first minibatch is scored before any update: the sampler/trainer gap.
    if 'actor/logp_diff_abs' in results[0]:
      m['actor/logp_diff_abs'] = float(results[0]['actor/logp_diff_abs'])
    for k in ('actor/nonfinite', 'critic/nonfinite'):
      if k in results[0]:
        m[k] = float(np.max([u[k] for u in results]))
    return m, time.perf_counter() - start

  def _next_rollout(self):
    """The rollout this iteration trains on.

    Synchronous topologies generate it now with the current parameters.
    One-step-off (staleness 1) takes the one started during the previous
    iteration (generated by the parameters before that update) and starts
    the next one in the background, so that generation overlaps this update.
    """
    it = self.iteration
    t_wait = time.perf_counter()
    t_reshard = 0.0
    if self.pending is None:
      if self.pending_params is not None:  # resumed with a rollout in flight: regenerate it
        params, version = self.pending_params, it - 1
      else:
        start = time.perf_counter()
        params, version = self.rollout_params(), it
        t_reshard = time.perf_counter() - start
      if self.executor is not None:
        self.pending = self.executor.submit(self.sample, params, it, version)
      else:
        sampled = self.sample(params, it, version)
    if self.pending is not None:
      sampled = self.pending.result()
    t_wait = time.perf_counter() - t_wait
    self.pending = self.pending_params = self.pending_streams = None
    if self.staleness and it + 1 < self.total:
      self.pending_streams = {name: s.state() for name, s in self.streams.items()}
      self.pending_params = self.rollout_params()
      self.pending = self.executor.submit(self.sample, self.pending_params, it + 1, it)
    ro = self._with_reference(sampled)
    ro.metrics['time/reshard'] = t_reshard
    ro.metrics['time/rollout_wait'] = t_wait
    ro.metrics['rollout/staleness'] = float(it - ro.version)
    return ro

  def rl_iteration(self):
    """One GRPO-family step: rollout, advantages, updates."""
    rl = self.config.rl
    t_step = time.perf_counter()
    ro = self._next_rollout()
    m = dict(ro.metrics)
    kl_reward = None
    if self.adv_cfg.kl_coef_in_reward:
      kl_reward = L.kl_penalty(ro.old_logp, ro.ref_logp, estimator='k1', mask=ro.batch.loss_mask)
    adv = self._advantages(jnp.asarray(ro.rewards), ro.batch.loss_mask, kl_BxL=kl_reward)
    old_logp, is_weights = ro.old_logp, None
    if self.staleness:
      # Decoupled PPO: clip against the current (proximal) policy and weight by
      # the truncated ratio proximal / behaviour for the policy lag.
      is_weights = jnp.ones_like(ro.old_logp)
      if ro.version != self.iteration:
        with self.tracer.span('proximal'):
          old_logp = self._minibatched_logprobs(self.state.params, ro.batch)
          jax.block_until_ready(old_logp)
        is_weights, is_metrics = L.importance_weights(
          old_logp,
          ro.old_logp,
          ro.batch.loss_mask,
          level='token',
          mode='truncate',
          high=self.config.topology.is_cap,
        )
        m.update({f'rollout/{k}': float(v) for k, v in is_metrics.items()})
        m['rollout/behaviour_logp_diff_abs'] = float(
          L.token_mean(jnp.abs(old_logp - ro.old_logp), ro.batch.loss_mask)
        )
    full = policy.PolicyBatch(
      tokens=ro.batch.tokens,
      mask=ro.batch.mask,
      loss_mask=ro.batch.loss_mask,
      old_logp=old_logp,
      ref_logp=ro.ref_logp,
      advantages=adv,
      is_weights=is_weights,
    )
    with self.tracer.span('update', iteration=self.iteration):
      um, t_update = self.run_minibatches(self._rl_step, full)
    m.update(um)
    m.update(_advantage_metrics(adv, ro.batch.loss_mask))
    m['time/update'] = t_update
    m['time/step'] = time.perf_counter() - t_step
    m['throughput/update_tokens_per_s'] = rl.epochs * ro.num_tokens / max(t_update, 1e-9)
    m['phase'] = 1.0
    return m

  def _inline_reward_fns(self):
    """Reward functions that need this process's state: a jrl reward model."""
    rc = self.config.reward
    fns = {}
    if rc.model_path:
      from jrl.rewards.model import RewardModel

      fns['reward_model'] = RewardModel.load(rc.model_path, self.tokenizer, mesh=self.mesh)
    if rc.judge_path:
      from jrl.rewards.judge import GenerativeJudge

      judge = GenerativeJudge.load(
        rc.judge_path,
        self.tokenizer,
        rc.judge_rubric,
        mode='score',
        max_new_tokens=rc.judge_max_new_tokens,
        max_prompt_len=rc.judge_max_prompt_len,
        mesh=self.mesh,
      )
      fns['judge'] = judge.as_reward_fn()
    return fns

  def _setup_algorithm(self):
    """Subclasses build what their algorithm state needs (before the state)."""

  def _engine_overrides(self):
    """EngineConfig fields a subclass sets (multi-turn room, more stop tokens)."""
    return {}

  def _needs_reference(self):
    return self.config.rl.kl_coef > 0

  def _init_extra(self, params):
    """Algorithm state kept in TrainState.extra (same structure all run long)."""
    return {'ref_params': jax.tree.map(jnp.copy, params)} if self.uses_ref else {}

  def _start_rl_phase(self):
    """After the warm-up: fresh optimiser state for RL, and algorithm state
    (the reference policy, a critic) built from the warmed-up policy."""
    self.state = self._new_state(self.state.params, self.tx)

  def _new_state(self, params, tx):
    """A TrainState with fresh optimiser and algorithm state, placed on the mesh."""
    state = common.init_state(params, tx, self._init_extra(params))
    return common.place_on_mesh(state, self.mesh)

  def _minibatched_logprobs(self, params, batch):
    mb = self.config.rl.minibatch_size
    out = []
    for k in range(batch.tokens.shape[0] // mb):
      sl = slice(k * mb, (k + 1) * mb)
      logp, _ = self._logprobs(params, batch.tokens[sl], batch.mask[sl])
      out.append(logp)
    return jax.device_put(jnp.concatenate(out), self.batch_sharding)

  def evaluate(self):
    """Held-out accuracy with greedy decoding (the `eval.reward` function)."""
    examples = self.task.held_out
    if not examples:
      return {}
    rl = self.config.rl
    requests = [
      sampler.Request(
        prompt=self.encoder.prompt_ids(ex['prompt']),
        max_new_tokens=rl.max_new_tokens,
        greedy=True,
        stop_tokens=self.stop_tokens,
      )
      for ex in examples
    ]
    params = self.rollout_params()
    with self.sampler_lock, self.tracer.span('eval'):
      groups = self.sampler.generate(params, requests, group_size=1)
    texts = [
      self.tokenizer.decode(
        [t for t in grp[0].tokens if t not in self.stop_tokens], skip_special_tokens=True
      )
      for grp in groups
    ]
    prompts = [self.encoder.prompt_text(ex['prompt']) for ex in examples]
    scored = self.eval_scorer(prompts, texts, examples)
    return {'eval/accuracy': float(np.mean(scored.total > 0.5))}

  # The loop ----------------------------------------------------------------------

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self.stop_requested = True

  def run(self):
    """Runs to `total` iterations, or until SIGTERM: then the processes agree
    on an iteration, save a checkpoint there and return (`self.preempted`)."""
    config = self.config
    self.nonfinite_run = self.unscored_run = 0
    self.last_reward_errors = []
    self.stop_requested = self.preempted = False
    start_it = self.maybe_restore()
    writer = (
      metrics_lib.MetricsWriter(
        self.workdir,
        self.total,
        resume_step=start_it,
        tensorboard=config.log.tensorboard,
        log_every=config.log.every,
      )
      if self.is_main
      else metrics_lib.NullWriter()
    )
    previous_handler = None
    if threading.current_thread() is threading.main_thread():
      previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
    if start_it == 0 and config.eval.every:
      writer.write(0, {**self.evaluate(), 'phase': 0.0})
    try:
      while self.iteration < self.total:
        in_sft = self.iteration < config.sft.steps
        t_start = self.tracer.now()
        with self.tracer.span('step', 'step', iteration=self.iteration):
          m = self.sft_iteration() if in_sft else self.rl_iteration()
        if not in_sft and self.tracer.enabled:
          m.update(self.tracer.bubbles(t_start, self.tracer.now()))
        self.iteration += 1
        if self.iteration == config.sft.steps and self.iteration < self.total:
          self._start_rl_phase()
        nonfinite = m.get('actor/nonfinite', m.get('sft/nonfinite', 0.0))
        self.nonfinite_run = self.nonfinite_run + 1 if nonfinite else 0
        if config.eval.every and (
          self.iteration % config.eval.every == 0
          or self.iteration == self.total
          or self.iteration == config.sft.steps
        ):
          m.update(self.evaluate())
        writer.write(self.iteration, m)
        unscored = self._mostly_unscored(m)
        self.unscored_run = self.unscored_run + 1 if unscored else 0
        if self.unscored_run >= config.reward.max_unscored_steps:
          self.checkpointer.wait()
          raise RuntimeError(
            f'stopping at iteration {self.iteration}: {unscored} for '
            f'{self.unscored_run} RL iterations in a row (more than '
            f'`reward.max_unscored_frac`={config.reward.max_unscored_frac:g}); the updates had '
            f'no reward signal. {self.checkpointer.describe_latest()}'
          )
        if self.nonfinite_run >= config.max_nonfinite_steps:
          self.checkpointer.wait()  # the last save on disk, with its checksums
          raise RuntimeError(
            f'stopping at iteration {self.iteration}: {self.nonfinite_run} iterations in a row '
            f'had a non-finite loss or gradient (updates were skipped). '
            f'{self.checkpointer.describe_latest()}'
          )
        if distributed.any_process(self.stop_requested) and self.iteration < self.total:
          self.save(force=True)
          self.checkpointer.wait()  # complete and checksummed before it is reported
          self.preempted = True
          if self.is_main:
            print(
              f'SIGTERM: saved iteration {self.iteration} to {self.checkpointer.directory}; '
              'run the same command to resume.',
              flush=True,
            )
          break
        if self.iteration % config.checkpoint.every == 0 or self.iteration == self.total:
          self.save()
    finally:
      if previous_handler is not None:
        signal.signal(signal.SIGTERM, previous_handler)
      self.checkpointer.wait()
      writer.close()
      self._drain()
      self._close_scorers()
    self.checkpointer.close()
    self.write_trace()
    if self.preempted:
      return self.state
    if config.log.plot and self.is_main:
      metrics_lib.plot_curves(writer.path, os.path.join(self.workdir, 'curves.png'))
    if config.export_hf:
      self.export(os.path.join(self.workdir, 'hf_export'))
    return self.state

  def _mostly_unscored(self, m):
    """A description of the reward functions that left more than
    `reward.max_unscored_frac` of this iteration's completions unscored, with
    their failure and timeout counts and first errors; '' if none did."""
    limit = self.config.reward.max_unscored_frac
    bad = []
    for key, frac in m.items():
      if key.startswith('reward/') and key.endswith('/unscored_frac') and frac > limit:
        name = key[len('reward/') : -len('/unscored_frac')]
        bad.append(
          f'reward function {name!r} left {frac:.0%} of completions unscored '
          f'({m.get(f"reward/{name}/failures", 0):g} failed and '
          f'{m.get(f"reward/{name}/timeouts", 0):g} timed-out chunks'
        )
    if not bad:
      return ''
    errors = '; '.join(self.last_reward_errors[:3]) or 'no error recorded: it returned None or NaN'
    return ', '.join(b + ')' for b in bad) + f' (first errors: {errors})'

  def export(self, path):
    """Writes the policy as a Hugging Face checkpoint directory."""
    hf_lib.save(
      path,
      self.model_config,
      self.state.params,
      hf_config=self.hf_config,
      source_dir=self.config.model.path or None,
    )


ALGORITHMS = ('grpo', 'ppo', 'dpo', 'sft', 'reward_model', 'agent')


def make_trainer(config):
  """The controller for `config.algorithm`."""
  algorithm = config.algorithm
  if algorithm in ('grpo', 'sft'):
    return Trainer(config)
  if algorithm == 'ppo':
    from jrl.trainers.ppo import PPOTrainer

    return PPOTrainer(config)
  if algorithm == 'dpo':
    from jrl.trainers.dpo import DPOTrainer

    return DPOTrainer(config)
  if algorithm == 'agent':
    from jrl.trainers.agent import make_agent_trainer

    return make_agent_trainer(config)
  if algorithm == 'reward_model':
    from jrl.trainers.reward_model import RewardModelTrainer

    return RewardModelTrainer(config)
  raise ValueError(f'`algorithm` must be one of {ALGORITHMS}, got {algorithm!r}.')


def run(config):
  """Runs (or resumes) the job described by `config`; returns the final TrainState."""
  return make_trainer(config).run()
