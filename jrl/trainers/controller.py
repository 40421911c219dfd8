"""The controller: the loop every algorithm's run shares.

An algorithm's `build(config)` returns a `Job`: an object holding its
resources and initial train state, whose methods are one iteration, the
held-out evaluation and the switch from the SFT warm-up to the main phase.
`train(job)` then

1. writes the resolved config and the command line to `workdir/config.json`
   (`setup.write_config`: a resumed run with changed fields keeps the old
   one as config.<n>.json and prints the changes), then restores the newest
   intact checkpoint in `workdir`, if there is one;
2. evaluates once before training (`eval.every` > 0 and `eval.at_start`, a fresh run);
3. runs iterations `state, report = job.iterate(state, it)` up to
   `sft.steps` + the algorithm's own steps (`rl.steps`, `dpo.steps` or
   `rm.steps`), writing metrics every iteration, evaluating every
   `eval.every` and checkpointing every `checkpoint.every`;
4. stops with an error naming the cause after `max_nonfinite_steps`
   iterations with skipped updates, or `reward.max_unscored_steps`
   iterations left mostly unscored by a reward function (the report's
   `skipped` and `unscored` fields, `jrl.trainers.signals`);
5. on SIGTERM, agrees with the other processes on an iteration, saves a
   checkpoint there and returns; at the end writes the trace, the plot and
   (`export_hf`) a Hugging Face export.

All side effects of a run live here; the iteration functions return new
state and a `signals.Report` (metrics, skipped updates, unscored counts).
"""

import abc
import contextlib
import json
import os
import signal
import threading
from typing import Any

import jax

from jrl import checkpoint as ckpt_lib
from jrl import distributed
from jrl import metrics as metrics_lib
from jrl.trainers import checks, common, setup, signals


class Job(abc.ABC):
  """One algorithm's run, built and ready to start: what `train` calls.

  An algorithm's job is a subclass (`sft.SFT`, `grpo.GRPO`, ...) whose
  constructor sets the run up and sets `resources` and `state` (the initial
  train state, whose structure is kept all run long), and whose `iterate`
  is one iteration. The other methods have the defaults of an algorithm
  without them.
  """

  resources: setup.Resources
  state: common.TrainState
  topology: Any = None  # jrl.trainers.rollouts.topology strategy (online algorithms)
  memory_plan: Any = None  # memory_plan.Plan of the update (online algorithms)

  @abc.abstractmethod
  def iterate(self, state, iteration):
    """(state, signals.Report): one iteration (0-based)."""

  def evaluate(self, state):
    """Held-out metrics ({}: nothing to evaluate)."""
    del state
    return {}

  def start_rl(self, state):
    """The state the algorithm's own phase starts from once the SFT warm-up is done."""
    return state

  def reward_errors(self):
    """The reward service's latest errors."""
    return []

  def samples(self):
    """The latest batch's example completions (dicts)."""
    return []

  def close(self):  # noqa: B027 (a job without workers has nothing to stop)
    """Stops what the run started (reward workers, evaluation processes)."""


def close(job):
  """Waits for a background rollout and stops the job's reward workers."""
  if job.topology is not None:
    job.topology.close()
  job.close()


class _Progress:
  """What the loop counts, and checkpoints with the state."""

  def __init__(self):
    self.iteration = 0
    self.nonfinite_run = 0  # iterations in a row with a skipped update
    self.unscored_run = 0  # iterations in a row left mostly unscored
    self.stop_requested = False  # SIGTERM
    # `Job.start_rl` has run: False for a checkpoint an SFT-only run (algorithm
    # steps 0) saved at the end of its warm-up, which a longer run resumes.
    self.rl_started = False

  def on_sigterm(self, signum, frame):
    del signum, frame
    self.stop_requested = True


def _meta(job, progress):
  streams, behaviour = _streams_and_behaviour(job)
  return {
    'iteration': progress.iteration,
    'streams': streams,
    'nonfinite_run': progress.nonfinite_run,
    'unscored_run': progress.unscored_run,
    'rl_started': progress.rl_started,
    'pending_rollout': behaviour is not None,
    'rollouts_in_flight': job.topology.in_flight() if job.topology is not None else [],
    # The versions saved as `behaviour` ({'v<version>': params}), oldest first.
    'behaviour_versions': sorted(behaviour, key=lambda v: int(v[1:]))
    if isinstance(behaviour, dict)
    else None,
    'config': json.loads(job.resources.config.to_json_best_effort()),
  }


def _streams_and_behaviour(job):
  if job.topology is not None:
    return job.topology.checkpoint(job.resources.streams)
  return {name: s.state() for name, s in job.resources.streams.items()}, None


def save(job, checkpointer, state, progress, force=False):
  """A checkpoint of the state, the streams and the counters. One-step-off
  and async: the rollouts in flight are not saved; the parameters they read
  are, so that a resumed run regenerates exactly the same rollouts."""
  _, behaviour = _streams_and_behaviour(job)
  with job.resources.tracer.span('checkpoint', iteration=progress.iteration):
    checkpointer.save(
      progress.iteration, state, _meta(job, progress), force=force, behaviour=behaviour
    )
  setup.write_trace(job.resources)


def restore(job, checkpointer, state, progress):
  """The newest intact checkpoint's state (damaged newer ones are skipped
  with a warning), its counters and streams; `state` when there is none."""
  latest, restored, meta = checkpointer.restore_latest_intact(ckpt_lib.abstract_like(state))
  if latest is None:
    return state
  progress.iteration = int(meta['iteration'])
  for name, stream in job.resources.streams.items():
    stream.restore(meta['streams'][name])
  progress.nonfinite_run = int(meta.get('nonfinite_run', 0))
  progress.unscored_run = int(meta.get('unscored_run', 0))
  progress.rl_started = bool(meta.get('rl_started', True))  # older checkpoints: as before
  if job.topology is not None:
    job.topology.restore(checkpointer, latest, meta, restored.params)
  if job.resources.is_main:
    print(f'resumed from {checkpointer.directory}/{latest} (iteration {progress.iteration})')
  return restored


@contextlib.contextmanager
def profiling(config, workdir, iteration):
  """A `jax.profiler` trace of this iteration (1-based, as metrics' `step`) into
  workdir/profile/ when it is one of `log.profile_steps` (process 0 only)."""
  if iteration not in tuple(config.log.profile_steps) or not distributed.is_main():
    yield
    return
  jax.profiler.start_trace(os.path.join(workdir, 'profile'))
  try:
    yield
  finally:
    jax.profiler.stop_trace()


def train(job):
  """Runs (or resumes) `job` to `sft.steps` + the algorithm's steps
  iterations (`checks.iterations`), or until SIGTERM; returns the final TrainState."""
  resources, config = job.resources, job.resources.config
  tracer = resources.tracer
  total = checks.iterations(config)
  warmup = config.sft.steps if 'sft' in config else 0
  # Online runs stop when the rewards carry no signal (`reward.max_unscored_*`).
  reward = config.reward if 'reward' in config else None
  if resources.is_main:
    setup.write_config(config, resources.workdir)  # config.json; a resumed run's changes printed
  checkpointer = setup.checkpointer(config, resources.workdir)
  progress = _Progress()
  state = restore(job, checkpointer, job.state, progress)
  if resources.is_main and job.memory_plan is not None:
    print(f'memory plan of the update: {job.memory_plan.describe()}', flush=True)
  writer = setup.writer(config, resources.workdir, total, progress.iteration)
  previous_handler = None
  if threading.current_thread() is threading.main_thread():
    previous_handler = signal.signal(signal.SIGTERM, progress.on_sigterm)
  preempted = False

  def due(every, it):
    return every and (it % every == 0 or it == total or it == warmup)

  if 0 < progress.iteration == warmup < total and not progress.rl_started:
    # The warm-up of an SFT-only run, resumed with the algorithm's steps: RL
    # begins as in a run that had them from the start.
    state = job.start_rl(state)
    progress.rl_started = True
  if progress.iteration == 0 and config.eval.every and config.eval.at_start:
    writer.write(0, {**job.evaluate(state), 'phase': 0.0})
  try:
    while progress.iteration < total:
      it = progress.iteration
      in_sft = it < warmup
      t_start = tracer.now()
      with profiling(config, resources.workdir, it + 1), tracer.span('step', 'step', iteration=it):
        state, report = job.iterate(state, it)
      metrics = dict(report.metrics)
      if not in_sft and tracer.enabled:
        metrics.update(tracer.bubbles(t_start, tracer.now()))
      it = progress.iteration = it + 1
      if it == warmup and it < total:
        state = job.start_rl(state)
        progress.rl_started = True
      skipped = report.skipped
      progress.nonfinite_run = progress.nonfinite_run + 1 if skipped else 0
      if due(config.eval.every, it):
        metrics.update(job.evaluate(state))
      writer.write(it, metrics)
      every = config.log.samples_every
      if every and not in_sft and it % every == 0:
        samples = job.samples()
        if samples:
          writer.write_samples(it, samples)
      unscored = reward and signals.mostly_unscored(
        report.unscored, reward.max_unscored_frac, job.reward_errors()
      )
      progress.unscored_run = progress.unscored_run + 1 if unscored else 0
      if reward and progress.unscored_run >= reward.max_unscored_steps:
        checkpointer.wait()
        raise RuntimeError(
          f'stopping at iteration {it}: {unscored} for {progress.unscored_run} RL iterations '
          f'in a row (more than `reward.max_unscored_frac`='
          f'{reward.max_unscored_frac:g}); the updates had no reward signal. '
          f'{checkpointer.describe_latest()}'
        )
      if progress.nonfinite_run >= config.max_nonfinite_steps:
        checkpointer.wait()  # the last save on disk, with its checksums
        raise RuntimeError(
          f'stopping at iteration {it}: {progress.nonfinite_run} iterations in a row '
          f'had a non-finite loss or gradient (the last skipped the update of '
          f'{", ".join(map(str, skipped))}). '
          f'{checkpointer.describe_latest()}'
        )
      if distributed.any_process(progress.stop_requested) and it < total:
        save(job, checkpointer, state, progress, force=True)
        checkpointer.wait()  # complete and checksummed before it is reported
        preempted = True
        if resources.is_main:
          print(
            f'SIGTERM: saved iteration {it} to {checkpointer.directory}; '
            'run the same command to resume.',
            flush=True,
          )
        break
      if it % config.checkpoint.every == 0 or it == total:
        save(job, checkpointer, state, progress)
  finally:
    if previous_handler is not None:
      signal.signal(signal.SIGTERM, previous_handler)
    checkpointer.wait()
    writer.close()
    close(job)
  checkpointer.close()
  setup.write_trace(resources)
  if preempted:
    return state
  if config.log.plot and resources.is_main:
    metrics_lib.plot_curves(writer.path, os.path.join(resources.workdir, 'curves.png'))
  if config.export_hf:
    setup.export(resources, state.params, os.path.join(resources.workdir, 'hf_export'))
  return state
