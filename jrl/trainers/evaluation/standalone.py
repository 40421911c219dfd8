"""Held-out evaluation without a trainer: of a Hugging Face directory or of a
run's checkpoint.

    from jrl.trainers.evaluation import standalone as standalone_eval
    standalone_eval.evaluate(config, model_path='models/smollm2', samples=4, out='before.jsonl')
    standalone_eval.evaluate(config, step=450)   # checkpoint 450 of config.workdir
    # -> {'eval/accuracy': ..., 'eval/accuracy_se': ..., 'eval/sampled/mean@4': ..., ...}

(`launch/eval.py` is the command line.) Only what evaluation needs is built:
the mesh, the tokenizer and prompt encoder, the held-out examples
(`task.eval_path`, or the generated arithmetic held-out set), the model, a
sampler and a `HeldOut` (`jrl.trainers.evaluation.held_out`), which decodes every
problem greedily and, with `eval.samples` = n > 0, n times at
`eval.temperature`, and scores them with `eval.reward`. No training examples
are read, and no optimiser, training reward service or topology is made.

The parameters come from

* `model_path`: a Hugging Face directory (e.g. a run's `hf_export`, or the
  model before training). It replaces `model.path`; its tokenizer is used
  unless the config names one (`tokenizer`, e.g. 'char'). LoRA is off: an
  exported LoRA run's directory holds the merged weights.
* otherwise checkpoint `step` (default: the latest) of `config.workdir`: only
  the state's `params` (and `step`, the updates so far) are restored, laid
  out like the model the config describes (`model.path` and `model.lora`
  as in training), the optimiser state and the algorithm's state are not
  read.

One row per problem (greedy completion and score, samples and scores) goes
to `out` (overwritten), or, by default, is appended to
workdir/eval_samples.jsonl as the evaluations during training are.
"""

import os
import sys
import threading

import jax
import jax.numpy as jnp

from jrl import checkpoint, distributed, parallel, trace
from jrl.data import ANSWER_EXTRACTORS, read_prompts, tasks
from jrl.trainers import checks, setup
from jrl.trainers.evaluation.held_out import EXAMPLES_FILE, HeldOut
from jrl.trainers.rollouts import engines

# The reward model (pairwise accuracy) and the agent (tool-use episodes, task
# 'arith_tool') are evaluated by their own trainers; an algorithm says whether
# its policy is evaluated here (`checks.Algorithm.standalone_eval`).
EPISODE_TASKS = ('arith_tool',)


def evaluated_here():
  """The registered algorithms whose policy `evaluate` scores on held-out prompts."""
  return tuple(name for name, record in checks.REGISTRY.items() if record.standalone_eval)


def supports(config):
  """Whether `evaluate` can evaluate `config`'s policy (else only its trainer can)."""
  return config.algorithm in evaluated_here() and config.task.kind not in EPISODE_TASKS


def configured(config, model_path=None, samples=None, temperature=None):
  """A copy of `config` with the evaluation's fields set: `model.path` (and no
  LoRA) for a Hugging Face directory, `eval.samples`, `eval.temperature`
  (None: as configured)."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    if model_path is not None:
      config.model.path = model_path
      config.model.lora.rank = 0
    if samples is not None:
      config.eval.samples = int(samples)
    if temperature is not None:
      config.eval.temperature = float(temperature)
  return config


def held_out_examples(config, enc, tok):
  """The held-out examples as {'prompt', 'answer', ...} dicts, checked as in
  training: every prompt fits `task.max_prompt_len` (or is dropped with
  `task.long_prompts='filter'`). A prompt file's training split is not read."""
  task_config = config.task
  checker = tasks.ExampleChecker.of(task_config, enc, tok)
  if task_config.kind in ('file', 'jsonl'):
    examples = _eval_file(task_config, checker.prompt)
  else:
    examples = tasks.Task(task_config, config.seed, checker.prompt).held_out
  if not examples:
    raise ValueError(f'no held-out examples to evaluate (`task.kind` {task_config.kind!r}).')
  return examples


def _eval_file(task_config, check):
  """The first `task.eval_size` rows of `task.eval_path`, read as `tasks.Task` reads it."""
  if not task_config.eval_path:
    raise ValueError('`task.eval_path` is empty: there are no held-out examples to evaluate.')
  if not os.path.exists(task_config.eval_path):
    raise FileNotFoundError(f'`task.eval_path` {task_config.eval_path}: no such file.')
  if task_config.long_prompts not in tasks.Task.LONG_PROMPTS:
    raise ValueError(
      f'`task.long_prompts` must be one of {tasks.Task.LONG_PROMPTS}, '
      f'got {task_config.long_prompts!r}.'
    )
  if task_config.answer_extractor not in ANSWER_EXTRACTORS:
    raise ValueError(
      f'`task.answer_extractor` must be one of {ANSWER_EXTRACTORS}, '
      f'got {task_config.answer_extractor!r}.'
    )
  read = read_prompts(
    task_config.eval_path,
    prompt_key=task_config.prompt_key,
    answer_key=task_config.answer_key,
    answer_extractor=task_config.answer_extractor,
    check=check,
    drop=(tasks.PromptTooLong,) if task_config.long_prompts == 'filter' else (),
  )
  if read.dropped and distributed.is_main():
    where, why = read.dropped[0]
    print(
      f'eval: dropped {len(read.dropped)} of {len(read.rows) + len(read.dropped)} rows of '
      f'{task_config.eval_path} (task.long_prompts=filter); the first, {where}: {why}',
      file=sys.stderr,
    )
  return read.rows[: task_config.eval_size]


def check_model_dir(path):
  """Raises FileNotFoundError naming `path` unless it is a Hugging Face model directory."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f'model directory {path}: no such directory.')
  if not os.path.exists(os.path.join(path, 'config.json')):
    raise FileNotFoundError(
      f'model directory {path}: no config.json there (not a Hugging Face model directory).'
    )


def checkpoint_dir(config):
  """config.workdir/checkpoints; FileNotFoundError naming it when it is missing."""
  directory = os.path.join(os.path.abspath(config.workdir), 'checkpoints')
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'no checkpoint in {directory}: no such directory.')
  return directory


def restore_params(config, params, mesh, step=None):
  """(checkpoint step, updates so far, params) of checkpoint `step` (None: the
  latest) of `config.workdir`, laid out like `params` (a model as the config
  builds it); only the state's `params` and `step` are read."""
  directory = checkpoint_dir(config)
  ckpt = setup.checkpointer(config, os.path.dirname(directory))
  try:
    if step is None:
      step = ckpt.latest_step()
      if step is None:
        raise FileNotFoundError(f'no checkpoint in {directory}.')
    abstract = {
      'params': checkpoint.abstract_like(params),
      'step': jax.ShapeDtypeStruct((), jnp.int32, sharding=parallel.replicated(mesh)),
    }
    restored = ckpt.restore_fields(step, abstract)
  finally:
    ckpt.close()
  return int(step), int(restored['step']), restored['params']


def evaluate(config, *, model_path=None, step=None, samples=None, temperature=None, out=None):
  """Held-out metrics of a Hugging Face directory or of a checkpoint (module docstring).

  Args:
    config: a run's config (locked or not; not modified).
    model_path: a Hugging Face directory to evaluate (None: a checkpoint).
    step: the checkpoint of `config.workdir` (None: the latest); not with `model_path`.
    samples, temperature: `eval.samples` and `eval.temperature` (None: as configured).
    out: the JSONL file of per-problem rows, overwritten (None: appended to
      workdir/eval_samples.jsonl).

  Returns:
    {'eval/accuracy', 'eval/accuracy_se', 'eval/accuracy/<key>_<value>',
     'eval/sampled/mean@n', 'eval/sampled/pass@k', ...} as `HeldOut.evaluate`.
  Raises:
    FileNotFoundError naming the model directory or checkpoint that is missing;
    ValueError for a config it cannot evaluate.
  """
  if model_path is not None and step is not None:
    raise ValueError('evaluate: give `model_path` or a checkpoint `step`, not both.')
  if not supports(config):
    raise ValueError(
      f'evaluate: `algorithm` {config.algorithm!r} with `task.kind` {config.task.kind!r} is '
      f'evaluated by its trainer; this evaluates {evaluated_here()} on single-turn tasks.'
    )
  if model_path is not None:
    check_model_dir(model_path)
  else:
    checkpoint_dir(config)  # before the model is loaded
  config = configured(config, model_path, samples, temperature)
  mesh, _ = setup.meshes(config)
  tok = setup.tokenizer(config)
  enc = setup.encoder(config, tok)
  examples = held_out_examples(config, enc, tok)
  model, params = setup.build_model(config, tok, mesh)
  updates = None
  if model_path is None:
    step, updates, params = restore_params(config, params, mesh, step)
  stop_tokens = tuple(tok.eos_ids)
  tracer = trace.Tracer(enabled=False, pid=jax.process_index())
  sampler_ = engines.build_engine(
    config, model, mesh, stop_tokens, engines.eval_group_sizes(config)
  )
  held = HeldOut(config, enc, tok, stop_tokens, examples, sampler_, threading.Lock(), tracer)
  if out is None:
    out = os.path.join(os.path.abspath(config.workdir), EXAMPLES_FILE)
  elif distributed.is_main() and os.path.exists(out):
    os.remove(out)
  held.path = os.path.abspath(out)
  if distributed.is_main():
    os.makedirs(os.path.dirname(held.path), exist_ok=True)
  try:
    metrics = held.evaluate(params, step=updates)
  finally:
    held.close()
  source = {'model_path': model_path} if model_path is not None else {'checkpoint': step}
  return {**source, 'updates': updates, 'examples': len(examples), 'out': held.path, **metrics}
