"""The host side of continuous batching: the queue, the slots of every
replica, page promises, refills, the slots each dispatch decodes and
finished samples.

Admission: a group is admitted when enough slots are idle and its
worst-case page count (prompt plus `max_new_tokens` per sample, prompt
pages counted once when shared) fits in the pages not already promised to
running groups. Pages are still allocated lazily, one at a time, as tokens
are written, so memory in use follows the real lengths; the promise only
guarantees that a running sequence never finds the pool empty. A request
whose worst case exceeds the whole pool is refused up front with an error;
any smaller pool works, with requests waiting for pages to be freed.

`Scheduler` holds only NumPy and Python state; `jrl.sampler.Sampler`
dispatches the device programs it asks for.
"""

import collections
import concurrent.futures
import dataclasses
import math
from typing import NamedTuple

import jax
import numpy as np

from jrl.sampler.pages import group_pages
from jrl.sampler.requests import Completion, Continuation
from jrl.sampler.state import FINISH_REASONS


@dataclasses.dataclass
class SamplerStats:
  """Figures of the last `generate` call."""

  prefills: int = 0
  dispatches: int = 0
  generated_tokens: int = 0
  peak_pages: int = 0  # most pages in use at once (scratch page excluded)
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0
  env_turns: int = 0  # environment turns appended (multi-turn)
  env_parked_peak: int = 0  # most samples waiting for an environment step at once
  env_wait_seconds: float = 0.0  # time no sample could decode: all waited for environments
  weight_swaps: int = 0  # partial rollouts: new weights taken between dispatches
  swap_seconds: float = 0.0  # ... and the time it took (recomputing the cache, if so)
  prefill_calls: int = 0  # batched prefill calls (`prefills` counts prompts)
  compactions: int = 0  # dispatches that decoded fewer rows than slots (`compaction`)
  decode_steps: int = 0  # decode steps run, summed over dispatches
  decode_rows: int = 0  # rows run through the model: the sum of rows x steps per dispatch
  # The pool when the call ended, summed over replicas: every page is back
  # on its free stack and no slot holds a sequence when nothing leaked.
  pages_free_at_end: int = 0  # pages on the free stacks (scratch pages excluded)
  pages_referenced_at_end: int = 0  # pages some slot still references
  slots_active_at_end: int = 0


def pow2_at_least(n):
  return 1 << max(0, math.ceil(math.log2(max(1, n))))


def row_width(n):
  """Rows a decode dispatch runs for `n` live slots: the smallest power of
  two or three quarters of one (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) that
  holds them, so that under a third of the rows idle while at most
  2 log2(S) widths compile."""
  p = pow2_at_least(n)
  return 3 * p // 4 if p >= 4 and 3 * p // 4 >= n else p


def narrower_width(width):
  """The largest `row_width` value below `width` (0 if none): a dispatch of
  `width` rows ends once at most that many are live, so that the next one
  runs on fewer rows."""
  best, p = 0, 1
  while p < width:
    best = p
    if p >= 2 and 3 * p // 2 < width:
      best = 3 * p // 2
    p *= 2
  return best


class PrefillRound(NamedTuple):
  """The arguments of one batched prefill call over R replicas."""

  tokens: np.ndarray  # [R, B, Pb] int32 prompts, padded on the right with 0
  lengths: np.ndarray  # [R, B] int32 (1 on padding rows)
  slots: np.ndarray  # [R, B, G] int32 local slot ids
  request: object  # SlotRequest with leading [R, B] axes
  valid: np.ndarray  # [R, B] bool: the row holds a prompt
  num_chunks: np.int32  # prefill chunks that cover the longest prompt


def pack_admissions(admitted, max_batch, bucket, chunk):
  """The PrefillRound of the groups admitted this round.

  `admitted[r]`: [(request, prompt length, local slots, SlotRequest)] for
  replica r. Rows are padded to a power-of-two batch and one bucket length
  (`bucket(n)`: the padded length of a prompt of n tokens; `chunk`: the
  prefill chunk, or None).
  """
  r_count = len(admitted)
  # Power-of-two batch sizes: a refill of a few groups costs a few prefills
  # (not `max_batch`), and at most log2(max_batch) + 1 programs compile.
  b = min(max_batch, pow2_at_least(max(len(rows) for rows in admitted)))
  pb = bucket(max(n for rows in admitted for _, n, _, _ in rows))
  g = len(next(rows for rows in admitted if rows)[0][2])
  tokens = np.zeros((r_count, b, pb), np.int32)
  lengths = np.ones((r_count, b), np.int32)
  slots = np.tile(np.arange(g, dtype=np.int32), (r_count, b, 1))
  valid = np.zeros((r_count, b), bool)
  template = next(rows for rows in admitted if rows)[0][3]
  request = jax.tree.map(lambda x: np.broadcast_to(x, (r_count, b, *x.shape)).copy(), template)
  for r, rows in enumerate(admitted):
    for j, (req, n, local, slot_request) in enumerate(rows):
      tokens[r, j, :n] = req.prompt
      lengths[r, j] = n
      slots[r, j] = local
      valid[r, j] = True
      for field, value in zip(request, slot_request, strict=True):
        field[r, j] = value
  num_chunks = np.int32(-(-int(lengths.max()) // (chunk or pb)))
  return PrefillRound(tokens, lengths, slots, request, valid, num_chunks)


class Scheduler:
  """Bookkeeping of one `Sampler.generate` call.

  Slots are numbered globally r·sr + j (replica r, local slot j, sr slots
  per replica). Whole groups go to one replica
  each (their samples share the prompt's pages), the one with the most idle
  slots among those with room.
  """

  def __init__(self, requests, group_size, share_prompt, cfg, replicas, slots_per_replica, batch):
    self.requests = requests
    self.cfg = cfg
    self.capacity = cfg.num_pages - 1  # per replica
    self.num_r = replicas
    self.sr = sr = slots_per_replica  # slots per replica
    self.max_new = [r.per_sample('max_new_tokens', group_size) for r in requests]
    self.turn_caps = [r.per_sample('turn_max_tokens', group_size) for r in requests]
    # Each sample's temperature (0: greedy) until its environment sets another.
    self.temperatures = [
      [0.0 if r.greedy else t for t in r.per_sample('temperature', group_size)] for r in requests
    ]
    per_group = group_size if share_prompt else 1
    self.max_batch = min(batch, sr // per_group)  # groups per prefill call
    self.pending = collections.deque()
    for i in range(len(requests)):
      if share_prompt:
        self.pending.append((i, tuple(range(group_size))))
      else:
        self.pending.extend((i, (g,)) for g in range(group_size))
    self.results = [[None] * group_size for _ in requests]
    self.free_slots = [list(range(sr)) for _ in range(replicas)]  # local slot ids per replica
    self.reserved = [0] * replicas
    self.slot_owner = {}  # global slot r·sr + j -> (request, sample, group id, private pages)
    self.groups = {}  # group id -> [replica, shared pages, samples left]
    self.next_group = 0
    self.held_pages = np.zeros(replicas * sr, np.int32)  # host copy of state.num_pages
    self.env_spans = collections.defaultdict(list)  # slot -> [(start, end)] of env tokens
    # Slots continuing after a turn: (their token limit, counted from the
    # completion's start, and temperature) for `resume_args`.
    self.next_turn = {}  # global slot -> (max_new, temperature)
    self.generated = np.zeros(replicas * sr, np.int64)  # host copy of state.num_generated
    # Parked slots: a turn ended and the environment's answer is a Future
    # still running. The slot keeps its pages and is not decoded until then.
    self.parked = {}  # global slot -> concurrent.futures.Future
    # Partial rollouts: the version the weights in use have, and for each slot
    # [(first token index, version)] of the versions that produced its tokens.
    self.version = None
    self.version_marks = {}  # global slot -> [(token index, version)]
    self.track_versions = False

  @property
  def busy(self):
    return bool(self.pending or self.slot_owner)

  @property
  def decodable(self):
    """Some slot holds a sample that is neither finished nor parked (or
    will, once admitted)."""
    return len(self.slot_owner) > len(self.parked)

  def finished(self, done):
    """The slots whose samples stopped in the last dispatch (`done`: the
    [R·sr] host copy of state.done), parked ones left out."""
    return [s for s in self.slot_owner if done[s] and s not in self.parked]

  def wait_parked(self):
    """Blocks until some parked slot's answer has arrived (nothing else can
    move: no slot to decode, nothing admissible)."""
    futures = list(self.parked.values())
    concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)

  def unparked(self):
    """{slot: the environment's answer} of the parked slots whose answers
    arrived; they leave the parked set (`retire` takes them)."""
    ready = {s: f.result() for s, f in self.parked.items() if f.done()}
    for s in ready:
      del self.parked[s]
    return ready

  @property
  def num_slots(self):
    """R·sr: the slots of the current state."""
    return self.num_r * self.sr

  def admit(self, slot_request):
    """Admits what fits, in order, each group into the replica with most idle
    slots. Returns `admitted[r]`: [(request, prompt length, local slots,
    SlotRequest)]; `slot_request(request, samples)` makes the last."""
    cfg, num_r, sr = self.cfg, self.num_r, self.sr
    admitted = [[] for _ in range(num_r)]
    while self.pending:
      i, samples = self.pending[0]
      r = self.requests[i]
      n = len(r.prompt)
      news = [self.max_new[i][g] for g in samples]
      need = group_pages(n, news, cfg.page_size)
      fits = [
        k
        for k in range(num_r)
        if len(self.free_slots[k]) >= len(samples)
        and self.reserved[k] + need <= self.capacity
        and len(admitted[k]) < self.max_batch
      ]
      if not fits:
        break
      k = max(fits, key=lambda k: (len(self.free_slots[k]), -k))
      self.pending.popleft()
      local = [self.free_slots[k].pop(0) for _ in samples]
      admitted[k].append((r, n, local, slot_request(r, samples)))
      self.reserved[k] += need
      shared = n // cfg.page_size
      self.groups[self.next_group] = [k, shared, len(samples)]
      for j, g, m in zip(local, samples, news, strict=True):
        slot = k * sr + j
        private = -(-(n + m - 1) // cfg.page_size) - shared
        self.slot_owner[slot] = (i, g, self.next_group, private)
        self.held_pages[slot] = -(-n // cfg.page_size)
        self.generated[slot] = 1  # insert samples the first token
        self.version_marks[slot] = [(0, self.version)]
      self.next_group += 1
    return admitted

  def swap(self, version):
    """New weights, of `version`, from the next dispatch on: every sample in
    flight produces its next tokens with them."""
    self.version = version
    for slot in self.slot_owner:
      self.version_marks[slot].append((int(self.generated[slot]), version))

  def refresh_tokens(self, out_tokens, cap):
    """[R, sr, W] int32: each active slot's prompt then its generated tokens
    (`out_tokens`: the [R·sr, max_new] host copy of state.out_tokens), for
    `refresh.refresh_kv`; W the power of two that holds the longest (at
    most `cap`), so a few programs serve every swap."""
    longest = max(
      len(self.requests[i].prompt) + int(self.generated[slot])
      for slot, (i, _, _, _) in self.slot_owner.items()
    )
    width = min(pow2_at_least(longest), cap)
    tokens = np.zeros((self.num_r * self.sr, width), np.int32)
    for slot, (i, _, _, _) in self.slot_owner.items():
      seq = np.concatenate([self.requests[i].prompt, out_tokens[slot, : self.generated[slot]]])
      tokens[slot, : min(width, len(seq))] = seq[:width]
    return tokens.reshape(self.num_r, self.sr, width)

  def _versions(self, slot, n):
    """[n] int32: the version of each of the slot's tokens."""
    marks = self.version_marks.pop(slot)
    if not self.track_versions:
      return None
    out = np.empty(n, np.int32)
    for start, version in marks:
      out[start:] = -1 if version is None else version
    return out

  def decode_index(self):
    """The slots the next dispatch decodes: an [R, Sc] int32 array of local
    slot ids, each replica's live slots first (ascending) and idle ones
    after them, with Sc the `row_width` that holds the most live slots of
    any replica; None when that is every slot (Sc >= sr). So finished and
    idle slots cost little decode work, and at most 2 log2(sr) narrower
    programs compile."""
    num_r, sr = self.num_r, self.sr
    live = [[] for _ in range(num_r)]
    for s in sorted(self.slot_owner):
      if s not in self.parked:
        live[s // sr].append(s % sr)
    width = row_width(max(len(x) for x in live))
    if width >= sr:
      return None
    index = np.zeros((num_r, width), np.int32)
    for k, keep in enumerate(live):
      taken = set(keep)
      index[k] = keep + [j for j in range(sr) if j not in taken][: width - len(keep)]
    return index

  def decoded(self, held, gen):
    """Takes the [R·sr] pages held and tokens generated after a dispatch;
    returns the decode steps it ran (it stops when no slot is live)."""
    self.held_pages = np.array(held)
    gen = np.asarray(gen, np.int64)
    steps_run = int(max(0, (gen - self.generated).max()))
    self.generated = gen
    return steps_run

  def retire(self, finished, out_tokens, out_logp, num_gen, reasons, on_turn_end, answers=None):
    """Records the samples of the `finished` slots (row k of the [F, ...]
    arrays for slot finished[k]) or, in a multi-turn run, queues the
    environment's tokens for them.

    A turn's end (a stop token, or the turn's token limit reached before the
    sample's) asks `on_turn_end` for the environment's answer, or takes it
    from `answers` ({slot: answer} of unparked slots). An answer that is a
    Future still running parks the slot (`parked`): it keeps its pages and
    is neither continued nor freed until the answer arrives. Tokens (a list
    or a `Continuation`) continue the sample; a str ends it.

    Returns ({slot: environment tokens} to resume, the slots to free, the
    tokens of the completions recorded).
    """
    cfg = self.cfg
    answers = answers or {}
    continuing, parked = {}, []
    tokens = 0
    for row, slot in enumerate(finished):
      i, g, group, private = self.slot_owner[slot]
      n_out = int(num_gen[row])
      reason = FINISH_REASONS[int(reasons[row])]
      budget = self.max_new[i][g]
      turn_end = reason == 'stop' or (reason == 'length' and n_out < budget)
      if on_turn_end is not None and turn_end:
        if slot in answers:
          answer = answers[slot]
        else:
          answer = on_turn_end(i, g, out_tokens[row, :n_out].copy(), out_logp[row, :n_out].copy())
          if isinstance(answer, concurrent.futures.Future):
            if not answer.done():
              self.parked[slot] = answer
              parked.append(slot)
              continue
            answer = answer.result()
        if not isinstance(answer, str):
          turn = answer if isinstance(answer, Continuation) else Continuation(answer)
          env = [int(t) for t in turn.tokens]
          room = budget - n_out - 1  # one model token after them
          if len(env) > cfg.max_forced_tokens or len(env) > room:
            reason = 'length'
          else:
            continuing[slot] = env
            self.env_spans[slot].append((n_out, n_out + len(env)))
            cap = self.turn_caps[i][g] if turn.max_tokens is None else int(turn.max_tokens)
            if turn.temperature is not None and not self.requests[i].greedy:
              self.temperatures[i][g] = float(turn.temperature)
            limit = min(budget, n_out + len(env) + cap) if cap > 0 else budget
            self.next_turn[slot] = (limit, self.temperatures[i][g])
            continue
        else:
          reason = answer
      self.slot_owner.pop(slot)
      env_mask = None
      if on_turn_end is not None:
        env_mask = np.zeros(n_out, bool)
        for a, b in self.env_spans.pop(slot, []):
          env_mask[a:b] = True
      self.results[i][g] = Completion(
        tokens=out_tokens[row, :n_out].copy(),
        logprobs=out_logp[row, :n_out].copy(),
        finish_reason=reason,
        env_mask=env_mask,
        versions=self._versions(slot, n_out),
      )
      tokens += n_out
      k, shared, left = self.groups[group]
      self.reserved[k] -= private
      if left == 1:
        self.reserved[k] -= shared
        del self.groups[group]
      else:
        self.groups[group][2] = left - 1
    done = [s for s in finished if s not in continuing and s not in parked]
    return continuing, done, tokens

  def resume_args(self, continuing):
    """`paged.resume`'s slot mask [R, sr], forced tokens [R, sr, F], their
    counts [R, sr], and the next turn's token limit, temperature and greedy
    flag [R, sr] for {slot: environment tokens} (`retire`'s)."""
    num_r, sr = self.num_r, self.sr
    f = max(1, self.cfg.max_forced_tokens)
    forced = np.zeros((num_r * sr, f), np.int32)
    forced_len = np.zeros(num_r * sr, np.int32)
    resume_mask = np.zeros(num_r * sr, bool)
    max_new = np.zeros(num_r * sr, np.int32)
    temperature = np.ones(num_r * sr, np.float32)
    greedy = np.zeros(num_r * sr, bool)
    for slot, env in continuing.items():
      forced[slot, : len(env)] = env
      forced_len[slot] = len(env)
      resume_mask[slot] = True
      max_new[slot], t = self.next_turn.pop(slot)
      temperature[slot], greedy[slot] = (t, False) if t > 0 else (1.0, True)
    shaped = lambda a: a.reshape(num_r, sr, *a.shape[1:])
    return tuple(map(shaped, (resume_mask, forced, forced_len, max_new, temperature, greedy)))

  def release(self, finished):
    """The [R, sr] mask of `paged.free` for the `finished` slots, which
    become idle."""
    num_r, sr = self.num_r, self.sr
    mask = np.zeros(num_r * sr, bool)
    mask[finished] = True
    for slot in finished:
      self.free_slots[slot // sr].append(slot % sr)
    return mask.reshape(num_r, sr)
