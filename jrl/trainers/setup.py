"""Set-up shared by every algorithm, as plain functions: seeds, the mesh, the
tokenizer and prompt encoder, the task's examples and streams, the model,
the optimisers, the checkpointer, the metrics writer and the tracer.

`build_resources(config, mesh)` calls them in order and returns a `Resources`
record; an algorithm's `build(config)` starts from it and adds only what
that algorithm needs (a rollout worker and a topology for the online ones).
The checkpointer and the writer are made by the controller when the run
starts (`jrl.trainers.controller.train`).
"""

import dataclasses
import hashlib
import json
import os
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jrl import checkpoint as ckpt_lib
from jrl import distributed, models, parallel, trace, xla_options
from jrl import metrics as metrics_lib
from jrl.data import PromptStream, read_sft_jsonl, tasks
from jrl.models import hf as hf_lib
from jrl.models import lora as lora_lib
from jrl.models.tokenizer import load_tokenizer
from jrl.trainers import checks, common
from jrl.trainers.optim import make_optimizer


def seed(*parts):
  """A 31-bit seed from any tuple of ints and strings (stable across runs)."""
  digest = hashlib.sha256(repr(parts).encode()).digest()
  return int.from_bytes(digest[:4], 'little') & 0x7FFFFFFF


class Model(NamedTuple):
  """The policy's definition: what `models` and the sampler need besides params."""

  config: Any  # models.ModelConfig
  graphdef: Any  # nnx.GraphDef (static)
  hf_config: dict | None  # the source directory's config.json (None: a fresh model)


class Resources(NamedTuple):
  """What every algorithm's run is built on (see `build_resources`)."""

  config: Any  # the whole (locked) ml_collections config
  workdir: str  # absolute; checkpoints, metrics.jsonl, trace.json live here
  mesh: jax.sharding.Mesh  # the training mesh
  tokenizer: Any
  encoder: tasks.Encoder
  checker: tasks.ExampleChecker
  task: tasks.Task
  streams: dict  # name -> PromptStream; every position is checkpointed
  model: Model
  params: Any  # the initial policy parameters, laid out on `mesh`
  seq_len: int  # T = task.max_prompt_len + task.max_response_len
  stop_tokens: tuple  # the tokenizer's end-of-sequence ids
  batch_sharding: jax.sharding.NamedSharding  # rows over data x fsdp
  tracer: trace.Tracer
  is_main: bool  # process 0 writes metrics, traces and exports
  train_xla: Any  # `train.xla_flags` as compiler options of the training programs (or None)


# The devices --------------------------------------------------------------------


def meshes(config, rollout_devices=0):
  """(training mesh, rollout mesh). With `rollout_devices` > 0 the last that many
  devices sample on a mesh of their own and the others train; else both are
  the same mesh over all devices."""
  mc = config.mesh
  devices = jax.devices()
  rollout = None
  if 0 < rollout_devices < len(devices):
    devices, rollout = devices[:-rollout_devices], devices[-rollout_devices:]
  mesh = parallel.make_mesh(mc.data, mc.fsdp, mc.tensor, devices=devices)
  if rollout is None:
    return mesh, mesh
  return mesh, parallel.make_mesh(-1, 1, 1, devices=rollout)


def batch_shards(mesh):
  """Rows are split over the data and fsdp axes."""
  return mesh.shape['data'] * mesh.shape['fsdp']


# Tokens and examples -----------------------------------------------------------


def tokenizer(config):
  path = config.tokenizer or config.model.path
  if not path:
    raise ValueError("`tokenizer` must be 'char' or a directory (or set `model.path`).")
  return load_tokenizer(path)


def encoder(config, tok):
  task_config = config.task
  return tasks.Encoder(
    tok,
    task_config.chat_template,
    task_config.add_bos,
    system_prompt=task_config.system_prompt,
    template_kwargs=task_config.chat_template_kwargs.to_dict(),
  )


def _with_code_tests(check, reward_config):
  """`check`, then the row's code tests read as code_tests will (a ValueError
  names the field; the readers add the file and line)."""
  from jrl.rewards.code import Settings, formats

  code_settings = Settings.of(reward_config)

  def both(item):
    check(item)
    formats.parse(item, code_settings.format, code_settings.asserts)

  return both


def examples(config, enc, tok):
  """(checker, task, streams). Every example is encoded once now: a character
  the tokenizer lacks or a prompt over `task.max_prompt_len` fails here with
  its file and line."""
  task_config = config.task
  checker = tasks.ExampleChecker.of(task_config, enc, tok)
  # SFT reads (prompt, response) pairs from `sft.train_path`, else the task's
  # (prompt, answer) examples: then their answers must fit a row too.
  sft = config.sft if 'sft' in config else None
  sft_check = checker.sft if sft is not None and sft.steps else None
  train_check = checker.prompt
  if sft_check is not None and not sft.train_path:
    train_check = sft_check
  prompt_check = checker.prompt
  if 'reward' in config and 'code_tests' in config.reward.functions:
    prompt_check = _with_code_tests(prompt_check, config.reward)
    train_check = _with_code_tests(train_check, config.reward)
  task = tasks.Task(task_config, config.seed, prompt_check, train_check)
  sft_source = task.train
  if sft_check is not None and sft.train_path:
    sft_source = read_sft_jsonl(sft.train_path, check=sft_check)
  if sft is not None and sft.examples:
    sft_source = first_examples(sft_source, sft.examples)
  streams = {
    'rl_stream': PromptStream(task.train, seed=seed(config.seed, 'rl')),
    'sft_stream': PromptStream(sft_source, seed=seed(config.seed, 'sft')),
  }
  return checker, task, streams


def first_examples(source, n):
  """The first `n` examples of `source` (`sft.examples`): a list of rows or a
  generated task (`example(i)`)."""
  if hasattr(source, 'example'):
    return [source.example(i) for i in range(n)]
  if len(source) < n:
    raise ValueError(
      f'`sft.examples`: {n} demonstrations asked for, the SFT source has {len(source)} rows.'
    )
  return list(source)[:n]


# The model and its optimisers ---------------------------------------------------


def build_model(config, tok, mesh):
  """(Model, params laid out on `mesh`): from `model.path` or freshly initialised,
  with `model.remat` and `model.scan_layers`. With `model.lora.rank` > 0 fresh
  adapters (A random, B zero) are attached to the base, which is the same as
  without them: the params then hold `lora_a` / `lora_b` next to each
  targeted kernel, and the Model's config and graphdef are the adapted ones."""
  model_section = config.model
  model, params = _base_model(config, tok, mesh)
  if model_section.lora.rank:
    lora_config = models.LoraConfig(
      rank=int(model_section.lora.rank),
      alpha=float(model_section.lora.alpha),
      targets=tuple(model_section.lora.targets),
    )
    key = jax.random.PRNGKey(seed(config.seed, 'lora'))
    model_config, graphdef, params = lora_lib.attach(
      model.graphdef, params, lora_config, key, mesh=mesh
    )
    model = model._replace(config=model_config, graphdef=graphdef)
  return model, params


def _base_model(config, tok, mesh):
  """`build_model` without adapters."""
  model_section = config.model
  # 'auto' remat: the model runs without; the update's plan picks its own (memory_plan).
  remat = 'none' if model_section.remat == 'auto' else model_section.remat
  memory = {
    'remat': remat,
    'scan_layers': model_section.scan_layers,
    'attention_impl': model_section.attention,
  }
  if model_section.path:
    ck = hf_lib.load(
      model_section.path,
      mesh=mesh,
      param_dtype=model_section.param_dtype,
      compute_dtype=model_section.compute_dtype,
      **memory,
    )
    if ck.config.vocab_size < tok.vocab_size:
      raise ValueError(
        f'`model.path` vocabulary ({ck.config.vocab_size}) is smaller than the tokenizer '
        f'({tok.vocab_size}).'
      )
    return Model(ck.config, ck.graphdef, ck.hf_config), ck.params
  model_config = models.ModelConfig(
    vocab_size=tok.vocab_size,
    width=model_section.width,
    mlp_width=model_section.mlp_width,
    num_layers=model_section.num_layers,
    num_heads=model_section.num_heads,
    num_kv_heads=model_section.num_kv_heads,
    head_dim=model_section.head_dim,
    tie_embeddings=model_section.tie_embeddings,
    init_std=model_section.init_std,
    param_dtype=model_section.param_dtype,
    compute_dtype=model_section.compute_dtype,
    **memory,
  )
  graphdef, params = models.create_sharded(model_config, jax.random.PRNGKey(config.seed), mesh)
  return Model(model_config, graphdef, None), params


def critic_from_policy(config, policy_params, key, mesh):
  """(graphdef, params) of a critic: a copy of the policy's backbone plus a
  fresh scalar head, laid out on `mesh`. A LoRA policy's critic has no
  adapters: it starts from the merged weights W + (α / r) A B, and all of it
  trains."""
  if config.lora is not None:
    policy_params = lora_lib.merge(config, policy_params)
    config = config.replace(lora=None)
  graphdef, fresh = models.create_sharded(config, key, mesh, lm_head=False, scalar_head=True)
  pure = nnx.to_pure_dict(fresh)
  source = nnx.to_pure_dict(policy_params)
  for name in pure:
    if name != 'score':
      pure[name] = jax.tree.map(jnp.copy, source[name])  # own buffers: states are donated
  nnx.replace_by_pure_dict(fresh, pure)
  return graphdef, fresh


def trainable(config):
  """The `trainable` argument of `make_optimizer` for the policy: with
  `model.lora.rank` > 0 only the adapters train (`lora.trainable_mask`), else
  everything (None)."""
  return lora_lib.trainable_mask if config.model.lora.rank else None


def optimizer(config):
  """(tx, schedule) of the main phase (`optim`); with LoRA the base is frozen."""
  return make_optimizer(config.optim, trainable=trainable(config))


def sft_optimizer(config):
  """(tx, schedule) of the SFT warm-up: `optim` with `sft.lr` and `sft.warmup_steps`
  and no decay. The optimiser state and step restart when RL begins. With
  LoRA the base is frozen, as in `optimizer`."""
  sft_optim = config.optim.copy_and_resolve_references()
  with sft_optim.unlocked():
    sft_optim.lr = config.sft.lr
    sft_optim.warmup_steps = config.sft.warmup_steps
    sft_optim.decay_steps = 0
  return make_optimizer(sft_optim, trainable=trainable(config))


def new_state(params, tx, mesh, extra=None):
  """A TrainState with fresh optimiser state, placed on the mesh."""
  return common.place_on_mesh(common.init_state(params, tx, extra), mesh)


def step_shardings(state, mesh):
  """out_shardings of a jitted step: it returns the state in the layout it
  received it (compiled once), and replicated metrics."""
  return (jax.tree.map(lambda x: x.sharding, state), parallel.replicated(mesh))


# Side effects: files ------------------------------------------------------------


def checkpointer(config, workdir):
  return ckpt_lib.Checkpointer(
    os.path.join(workdir, 'checkpoints'),
    keep=config.checkpoint.keep,
    async_save=config.checkpoint.async_save,
    allow_unverified=config.checkpoint.allow_unverified,
  )


def writer(config, workdir, total, start):
  """The metrics writer (process 0; the others write nothing)."""
  if not distributed.is_main():
    return metrics_lib.NullWriter()
  return metrics_lib.MetricsWriter(
    workdir,
    total,
    resume_step=start,
    tensorboard=config.log.tensorboard,
    log_every=config.log.every,
    wandb=_wandb_settings(config),
  )


def _wandb_settings(config):
  """`log.wandb_*` as MetricsWriter's `wandb` argument (None: off)."""
  if not config.log.wandb_project:
    return None
  return {
    'project': config.log.wandb_project,
    'mode': config.log.wandb_mode,
    'entity': config.log.wandb_entity,
    'name': config.log.wandb_name,
    'config': json.loads(config.to_json_best_effort()),
  }


CONFIG_FILE = 'config.json'  # in the workdir: the resolved config and the command line


def _flatten(tree, prefix=''):
  """{'a.b': leaf} of nested dicts."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      flat.update(_flatten(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def config_changes(old, new):
  """'field old -> new' for every field that differs between two configs as JSON dicts."""
  old, new = _flatten(old), _flatten(new)
  missing = object()

  def show(value):
    return '(none)' if value is missing else json.dumps(value)

  changes = []
  for key in sorted(old.keys() | new.keys()):
    a, b = old.get(key, missing), new.get(key, missing)
    if a != b:
      changes.append(f'{key} {show(a)} -> {show(b)}')
  return changes


def write_config(config, workdir, argv=None):
  """workdir/config.json (process 0 calls it): the resolved config, after the
  overrides, with the command line (`argv`, default sys.argv) and its
  directory, so that the run can be reproduced. When the file already holds
  another config (a resumed run with changed fields), it is kept as
  config.<n>.json and the changed fields are printed in one line. Returns
  them ([] when nothing changed). A config.json that is not a jrl run's (a
  Hugging Face checkpoint's) is left alone, with a warning."""
  record = {
    'argv': list(sys.argv if argv is None else argv),
    'cwd': os.getcwd(),
    'config': json.loads(config.to_json_best_effort()),
  }
  path = os.path.join(workdir, CONFIG_FILE)
  changes = []
  if os.path.exists(path):
    try:
      with open(path, encoding='utf-8') as f:
        old = json.load(f)
    except ValueError:
      old = None
    if not (isinstance(old, dict) and isinstance(old.get('config'), dict) and 'argv' in old):
      print(f'warning: {path} is not a jrl run config (left as it is, not rewritten)', flush=True)
      return []
    if old['config'] == record['config']:
      return []
    n = 1
    while os.path.exists(os.path.join(workdir, f'config.{n}.json')):
      n += 1
    kept = f'config.{n}.json'
    os.replace(path, os.path.join(workdir, kept))
    changes = config_changes(old['config'], record['config'])
    changed = ', '.join(changes)
    print(f'config of {workdir} changed (the previous kept as {kept}): {changed}', flush=True)
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=2)
    f.write('\n')
  os.replace(tmp, path)
  return changes


def write_trace(resources):
  """workdir/trace.json (process 0), for ui.perfetto.dev or chrome://tracing."""
  if resources.is_main:
    mc = resources.model.config
    model = {
      f.name: getattr(mc, f.name)
      for f in dataclasses.fields(mc)
      if f.name not in ('rope_scaling', 'lora')
    }
    model['lora'] = None if mc.lora is None else dataclasses.asdict(mc.lora)
    other = {'config': json.loads(resources.config.to_json_best_effort()), 'model': model}
    resources.tracer.write(os.path.join(resources.workdir, 'trace.json'), other)


ADAPTER_DIR = 'adapter'  # export subdirectory of a LoRA run's PEFT adapters


def export(resources, params, path):
  """Writes the policy as a Hugging Face checkpoint directory.

  With LoRA, `path` holds the merged weights (W + (α / r) A B: a plain model
  that transformers loads) and `path/adapter/` the adapters alone in PEFT's
  layout (`adapter_config.json`, `adapter_model.safetensors`), which
  `peft.PeftModel.from_pretrained` applies to the base at `model.path`.
  """
  hf_lib.save(
    path,
    resources.model.config,
    params,
    hf_config=resources.model.hf_config,
    source_dir=resources.config.model.path or None,
  )
  if resources.model.config.lora is not None:
    base = resources.config.model.path
    lora_lib.save_adapters(
      os.path.join(path, ADAPTER_DIR),
      resources.model.config,
      params,
      base_model_name_or_path=os.path.abspath(base) if base else None,
    )


# All of it ----------------------------------------------------------------------


def build_resources(config, mesh):
  """Workdir, tokenizer, encoder, checked examples and streams, and the model,
  in this order (the first error a config can cause is the one
  raised)."""
  workdir = os.path.abspath(config.workdir)
  os.makedirs(workdir, exist_ok=True)
  tok = tokenizer(config)
  enc = encoder(config, tok)
  checker, task, streams = examples(config, enc, tok)
  model, params = build_model(config, tok, mesh)
  task_config = config.task
  return Resources(
    config=config,
    workdir=workdir,
    mesh=mesh,
    tokenizer=tok,
    encoder=enc,
    checker=checker,
    task=task,
    streams=streams,
    model=model,
    params=params,
    seq_len=task_config.max_prompt_len + task_config.max_response_len,
    stop_tokens=tuple(tok.eos_ids),
    batch_sharding=parallel.batch_sharding(mesh),
    tracer=trace.Tracer(enabled=config.log.trace, pid=jax.process_index()),
    is_main=distributed.is_main(),
    train_xla=xla_options.parse(config.train.xla_flags),
  )


def start(config, sections, rollout_devices=0):
  """(Resources, rollout mesh): the meshes, the config checks that need only
  the devices (`checks.validate` of the shared sections and the algorithm's
  `sections`), then `build_resources`."""
  mesh, rollout_mesh = meshes(config, rollout_devices)
  checks.validate(config, batch_shards(mesh), sections)
  return build_resources(config, mesh), rollout_mesh
