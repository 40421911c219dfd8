"""Requests and what comes back: `Request` (one prompt and how to sample
from it), its checks against the sampler's sizes, its per-slot settings, and
`Completion`.

Randomness: sample g of a request with seed s uses the key
fold_in(PRNGKey(s), g), advanced once per token, whatever slot it lands in
and whatever else is in flight; so a run is reproducible from its seeds and
continuous batching gives the same tokens as decoding each request alone.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import numpy as np

from jrl.sampler.pages import group_pages
from jrl.sampler.sampling import _NEG
from jrl.sampler.state import SlotRequest


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt and how to sample from it.

  `max_new_tokens`, `min_new_tokens`, `temperature` and `turn_max_tokens`
  take one value (every sample) or one per sample of the group (a GRPO
  group with its own budgets, or multi-turn episodes whose environments ask
  for their own sampling). `temperature` 0 is greedy, as the OpenAI API and
  vLLM read it. `turn_max_tokens` (multi-turn, 0: none) ends a turn after
  that many tokens as if the model had stopped it (the environment's
  answer may set the next turn's: `Continuation`). Until a
  sample has `min_new_tokens` tokens its stop tokens cannot be drawn (their
  logits are −inf, as Hugging Face's `min_new_tokens` does to EOS) and its
  stop sequences are not honoured. `banned_tokens` are never drawn and
  `logit_bias` ({token: bias} or (token, bias) pairs) is added to the logits
  before the temperature; logprobs are those of the distribution sampled
  from, so with a bias they differ from the trainer's recomputed ones (as
  with top-k). A stop sequence ends the sample right after its last token,
  which is kept, like a stop token.
  """

  prompt: Sequence[int]  # token ids
  max_new_tokens: int | Sequence[int]  # ≤ SamplerConfig.max_new_tokens; or one per sample
  temperature: float | Sequence[float] = 1.0  # 0: greedy; or one per sample
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  greedy: bool = False
  stop_tokens: Sequence[int] = ()  # ≤ SamplerConfig.max_stop_tokens ids
  seed: int = 0
  min_new_tokens: int | Sequence[int] = 0  # stop tokens forbidden before; or one per sample
  banned_tokens: Sequence[int] = ()  # never sampled
  logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()  # added to the logits
  stop_sequences: Sequence[Sequence[int]] = ()  # ≤ max_stop_sequences, each ≤ max_stop_len ids
  turn_max_tokens: int | Sequence[int] = 0  # multi-turn: a turn's token limit, 0: none

  def per_sample(self, field, group_size):
    """`max_new_tokens`, `min_new_tokens`, `turn_max_tokens` (ints) or
    `temperature` (floats) as a list of `group_size` values."""
    value = getattr(self, field)
    cast = float if field == 'temperature' else int
    if np.ndim(value) == 0:
      return [cast(value)] * group_size
    values = [cast(v) for v in value]
    if len(values) != group_size:
      raise ValueError(f'`{field}` has {len(values)} values for a group of {group_size} samples.')
    return values

  def bias_items(self):
    """[(token, bias)] of `logit_bias` then the banned tokens (bias −1e30)."""
    items = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
    pairs = [(int(t), float(b)) for t, b in items]
    return pairs + [(int(t), float(_NEG)) for t in self.banned_tokens]


class Continuation(NamedTuple):
  """A multi-turn answer (`Sampler.generate`'s `on_turn_end`) that continues
  the sample with the environment's `tokens` and sets its next turn's
  sampling: `max_tokens` (the turn's token limit; None: the request's
  `turn_max_tokens`, 0: none) and `temperature` (0: greedy; None: the
  sample's so far; a greedy request stays greedy). A plain list of tokens
  is a Continuation with neither."""

  tokens: Sequence[int]
  max_tokens: int | None = None
  temperature: float | None = None


class Completion(NamedTuple):
  """One sampled continuation."""

  tokens: np.ndarray  # [n] int32, the stop token included when it ended the sample
  logprobs: np.ndarray  # [n] float32 under the distribution sampled from (0 on env tokens)
  finish_reason: str  # 'stop' | 'length' | what `on_turn_end` reported
  env_mask: np.ndarray | None = None  # [n] bool: tokens the environment appended (multi-turn)
  # [n] int32: the policy version that produced each token (partial rollouts,
  # `generate(weights_at=...)`); None when one version produced them all.
  versions: np.ndarray | None = None


@jax.jit
def _sample_keys(seed, samples_G):
  """[G, 2] key data: fold_in(PRNGKey(seed), g) for each sample index g."""
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda g: jax.random.fold_in(base, g))(samples_G)


def check_requests(requests, group_size, cfg, vocab_size, slots_per_replica, replicas):
  """Raises a ValueError naming the request and field that does not fit
  `cfg` (an SamplerConfig), the vocabulary or one replica's slots."""
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f'`group_size` must be a positive int, got {group_size!r}.')
  if group_size > cfg.num_slots:
    raise ValueError(f'`group_size` {group_size} exceeds `num_slots` {cfg.num_slots}.')
  if group_size > slots_per_replica:
    raise ValueError(
      f'`group_size` {group_size} exceeds the {slots_per_replica} slots of a replica '
      f'(`num_slots` {cfg.num_slots} / `replicas` {replicas}).'
    )
  vocab = vocab_size
  for i, r in enumerate(requests):
    n = len(r.prompt)
    if n < 1 or n > cfg.max_prompt_len:
      raise ValueError(
        f'request {i}: prompt length {n} must be in [1, max_prompt_len={cfg.max_prompt_len}].'
      )
    ids = np.asarray(r.prompt)
    if ids.min() < 0 or ids.max() >= vocab:
      raise ValueError(f'request {i}: prompt token ids must be in [0, {vocab}).')
    max_new = r.per_sample('max_new_tokens', group_size)
    min_new = r.per_sample('min_new_tokens', group_size)
    for m in max_new:
      if not 1 <= m <= cfg.max_new_tokens:
        raise ValueError(
          f'request {i}: `max_new_tokens`={m} must be in '
          f'[1, {cfg.max_new_tokens}] (SamplerConfig.max_new_tokens).'
        )
    for lo, hi in zip(min_new, max_new, strict=True):
      if not 0 <= lo <= hi:
        raise ValueError(f'request {i}: `min_new_tokens`={lo} must be in [0, max_new_tokens].')
    for cap in r.per_sample('turn_max_tokens', group_size):
      if cap < 0:
        raise ValueError(f'request {i}: `turn_max_tokens`={cap} must be >= 0 (0: no limit).')
    if len(r.stop_tokens) > cfg.max_stop_tokens:
      raise ValueError(
        f'request {i}: {len(r.stop_tokens)} stop tokens, more than '
        f'`max_stop_tokens`={cfg.max_stop_tokens}.'
      )
    bias = r.bias_items()
    if len(bias) > cfg.max_bias_tokens:
      raise ValueError(
        f'request {i}: {len(bias)} logit_bias / banned_tokens entries, more than '
        f'`max_bias_tokens`={cfg.max_bias_tokens}.'
      )
    if any(not 0 <= t < vocab or not np.isfinite(b) for t, b in bias):
      raise ValueError(
        f'request {i}: logit_bias / banned_tokens ids must be in [0, {vocab}) with finite biases.'
      )
    if len(r.stop_sequences) > cfg.max_stop_sequences:
      raise ValueError(
        f'request {i}: {len(r.stop_sequences)} stop sequences, more than '
        f'`max_stop_sequences`={cfg.max_stop_sequences}.'
      )
    for seq in r.stop_sequences:
      if not 1 <= len(seq) <= cfg.max_stop_len or not all(0 <= t < vocab for t in seq):
        raise ValueError(
          f'request {i}: stop sequence {list(seq)} must have 1 to '
          f'`max_stop_len`={cfg.max_stop_len} ids in [0, {vocab}).'
        )
    if not 0 <= int(r.seed) < 2**32:
      raise ValueError(f'request {i}: `seed` must be in [0, 2**32), got {r.seed}.')
    for t in r.per_sample('temperature', group_size):
      if not (np.isfinite(t) and t >= 0):
        raise ValueError(f'request {i}: `temperature` must be >= 0 (0: greedy), got {t}.')
    if not 0 < r.top_p <= 1 or r.top_k < 0:
      raise ValueError(f'request {i}: need 0 < top_p <= 1 and top_k >= 0.')
    need = group_pages(n, max_new, cfg.page_size)
    if need > cfg.num_pages - 1:
      raise ValueError(
        f'request {i} needs up to {need} pages (prompt {n}, max_new_tokens '
        f'{r.max_new_tokens}, group {group_size}) but the pool has '
        f'{cfg.num_pages - 1} usable pages: raise `num_pages`.'
      )


def slot_request(request, samples, cfg):
  """Per-slot settings as host arrays (one jitted call for the keys; eager
  JAX ops here cost milliseconds per request). `samples`: the sample
  indices g within the request's group."""
  g = len(samples)
  rng = np.asarray(_sample_keys(np.uint32(request.seed), np.asarray(samples, np.uint32)))
  stop = np.full((g, cfg.max_stop_tokens), -1, np.int32)
  stop[:, : len(request.stop_tokens)] = np.asarray(request.stop_tokens, np.int32)
  bias = request.bias_items()
  bias_ids = np.full((g, cfg.max_bias_tokens), -1, np.int32)
  bias_values = np.zeros((g, cfg.max_bias_tokens), np.float32)
  bias_ids[:, : len(bias)] = [t for t, _ in bias]
  bias_values[:, : len(bias)] = [b for _, b in bias]
  seqs = np.full((g, cfg.max_stop_sequences, cfg.max_stop_len), -1, np.int32)
  for q, seq in enumerate(request.stop_sequences):
    seqs[:, q, cfg.max_stop_len - len(seq) :] = seq
  # One value for every sample, or one per sample g of the group.
  pick = lambda v, dtype=np.int32: np.asarray(
    [v] * g if np.ndim(v) == 0 else [v[k] for k in samples], dtype
  )
  max_new, min_new = pick(request.max_new_tokens), pick(request.min_new_tokens)
  cap = pick(request.turn_max_tokens)
  temperature = pick(request.temperature, np.float32)
  return SlotRequest(
    rng=rng.astype(np.uint32),
    temperature=np.where(temperature > 0, temperature, 1.0).astype(np.float32),
    top_k=np.full(g, request.top_k, np.int32),
    top_p=np.full(g, request.top_p, np.float32),
    greedy=request.greedy | (temperature == 0),
    stop_tokens=stop,
    max_new=np.where(cap > 0, np.minimum(max_new, cap), max_new).astype(np.int32),
    min_new=min_new,
    bias_ids=bias_ids,
    bias_values=bias_values,
    stop_seqs=seqs,
  )
