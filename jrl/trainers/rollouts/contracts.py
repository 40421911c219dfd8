"""The contracts between an online trainer and what it drives.

`Engine`: what generates. jrl's paged sampler (`jrl.sampler.Sampler`) is the
default (`sampler.engine='jrl'`); another engine is a class with these
members, made by a factory named in config by import path
(`sampler.engine='package.module:make_engine'`), called as
`make_engine(config, model, mesh, stop_tokens, group_sizes, **engine_overrides)`
exactly as `engines.build_sampler` is (`model`: setup's Model, with its
graphdef and config; `group_sizes`: the group sizes it will be asked for;
`engine_overrides`: jrl SamplerConfig fields a worker needs, such as room for
an environment's tokens, which another engine honours or refuses by name).

`RolloutWorker`: what turns the policy's parameters into one batch of scored,
trainable rows (`rollout.RolloutWorker` for prompt-answer tasks,
`episodes.EpisodeWorker` for multi-turn environments). The topologies
(`topology.py`) call `sample`, maybe in a background thread, holding nothing
but the worker; the controller reads `last_errors` and `last_samples`.
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Engine(Protocol):
  """Generates G samples per request, with the logprob of each sampled token.

  A worker calls `load_weights` with the policy's parameters (the pytree as
  the trainer holds it) and their version, and hands what it returns to
  `generate`, under its lock. jrl's sampler reads the trainer's arrays in
  place and returns them; an engine with weights of its own copies them in
  (once per version) and may return any handle. Around an update on the same
  devices the topology calls `release` and then `resume`: nothing of the
  rollout may stay in device memory in between, and `generate` is refused
  there. An engine with processes or memory of its own may also have
  `close()`, which the worker calls when the run ends.
  """

  stats: Any  # figures of the latest `generate` call (jrl: SamplerStats)
  tracer: Any  # spans of prefill / decode go here (jrl.trace.Tracer)
  version: int | None  # the policy version of the weights last loaded

  def load_weights(self, params: Any, version: int | None) -> Any:
    """Makes `params`, the policy's version `version` (the iteration whose
    update produced them; None: unversioned), the weights `generate` reads;
    returns what to pass to `generate` as its weights."""
    ...

  def release(self) -> None:
    """Frees what the engine holds in device memory for generating (its KV
    pool) before an update on the same devices; `generate` is refused until
    `resume`."""
    ...

  def resume(self) -> None:
    """Undoes `release`: `generate` may run again."""
    ...

  def generate(
    self,
    weights: Any,
    requests: Sequence[Any],
    *,
    group_size: int = 1,
    share_prompt: bool = True,
    on_turn_end: Callable | None = None,
  ) -> list:
    """[len(requests)][group_size] jrl.sampler.Completion, in request order:
    tokens, their logprobs under the distribution sampled from, the finish
    reason, and for multi-turn (`on_turn_end`) which tokens an environment
    appended. Each `jrl.sampler.Request` carries its own sampling controls
    and seed; an engine that cannot honour one raises ValueError naming it.

    An engine with `parks_turns = True` (jrl's sampler) also takes a
    `concurrent.futures.Future` of the answer from `on_turn_end`: it parks
    that sample and decodes the others until the answer arrives. Without it,
    `on_turn_end` answers directly."""
    ...


@runtime_checkable
class RolloutWorker(Protocol):
  """Produces one training batch per call, from the policy's parameters."""

  lock: threading.Lock  # held around the engine (held-out evaluation takes it too)
  last_errors: list  # the reward service's first errors of the latest batch
  last_samples: list  # the latest batch's first group as dicts, for the sample log

  def sample(self, params: Any, iteration: int, version: int | None = None, **options) -> Any:
    """One batch (`rollout.Rollout`: rows, behaviour logprobs, rewards, the
    policy version that produced it, metrics, and optionally `valid`, the
    rows that enter training), seeded by `iteration`;
    `options` go to the engine's `generate` (partial rollouts: `weights_at`,
    `kv_on_swap`)."""
    ...

  def evaluate(self, params: Any, step: int | None = None) -> dict:
    """Held-out metrics of `params` (empty when the task has none)."""
    ...

  def close(self) -> None:
    """Stops what the worker started (reward processes, writers)."""
    ...
