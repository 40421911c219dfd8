"""Generation simulated slot by slot, and the stage and step times of one RL step."""

import dataclasses
import functools

import numpy as np

from jrl.costmodel.workload import tokens_run
from jrl.sampler.pages import attend_pages, pool_pages
from jrl.sampler.requests import Request
from jrl.sampler.scheduler import Scheduler, narrower_width
from jrl.sampler.state import LENGTH, SamplerConfig


def simulate_generation(workload, lengths=None, early_exit=True):
  """The sampler's schedule for one step: (prefills, [(steps, page bound,
  rows)] per dispatch).

  The sampler's own bookkeeping decides: `jrl.sampler.Scheduler` admits the
  groups (in order, while a replica has G free slots and room in its page
  pool, sized as `sampler.num_pages` = 0 sizes it), picks the rows a
  dispatch decodes (`decode_index`: the occupied slots, gathered into a
  `row_width` of rows, or every slot) and retires finished samples;
  `attend_pages` gives the gather path's page bound. What runs on the device is played
  here: each occupied slot decodes until its completion of `lengths` tokens
  is done, for at most `steps_per_dispatch` steps, the dispatch ending early
  once no slot is live or, with `early_exit` (the sampler's one-replica
  case), once the next narrower row width holds the live rows.
  """
  w = workload
  lengths = list(workload.response_lengths() if lengths is None else lengths)
  g, k = w.group_size, w.steps_per_dispatch
  max_prompt = w.max_prompt_len or w.prompt_len
  cfg = SamplerConfig(
    num_slots=w.num_slots,
    num_pages=pool_pages(max_prompt, w.response_max, g, w.page_size, w.num_slots),
    page_size=w.page_size,
    max_prompt_len=max_prompt,
    max_new_tokens=w.response_max,
  )
  prompt = np.ones(w.prompt_len, np.int32)
  requests = [
    Request(prompt=prompt, max_new_tokens=w.response_max) for _ in range(w.prompts_per_step)
  ]
  sched = Scheduler(requests, g, True, cfg, 1, w.num_slots, w.num_slots)
  target = np.zeros(w.num_slots, np.int64)  # each occupied slot's completion length
  length_reason = np.full(w.num_slots, LENGTH)
  out = np.zeros((w.num_slots, w.response_max), np.int32)  # retire's (unread) tokens
  prefills, dispatches = 0, []
  while sched.busy:
    for rows in sched.admit(lambda request, samples: None):  # one replica: local = global
      prefills += len(rows)
      for _, _, local, _ in rows:
        for slot in local:
          i, sample = sched.slot_owner[slot][:2]
          target[slot] = lengths[i * g + sample]
    bound = attend_pages(sched.held_pages, k, cfg)
    index = sched.decode_index()
    rows = sched.num_slots if index is None else index.shape[1]
    until = narrower_width(rows) if early_exit else 0
    occupied = np.fromiter(sched.slot_owner, np.int64, len(sched.slot_owner))
    left = np.maximum(target[occupied] - sched.generated[occupied], 0)
    # The loop runs while more than `until` slots are live: until the
    # (until + 1)-th longest remainder is used up, k steps at most.
    cut = len(left) - 1 - until
    steps = int(min(k, np.partition(left, cut)[cut])) if cut >= 0 else 0
    generated = sched.generated.copy()
    generated[occupied] += np.minimum(left, steps)
    held = sched.held_pages.copy()
    held[occupied] = -(-(w.prompt_len + generated[occupied] - 1) // w.page_size)
    sched.decoded(held, generated)
    dispatches.append((steps, bound, rows))
    finished = occupied[generated[occupied] >= target[occupied]].tolist()
    if finished:
      n = len(finished)
      _, done, _ = sched.retire(
        finished, out[:n], out[:n], generated[finished], length_reason[:n], None
      )
      sched.release(done)
  return prefills, dispatches


@functools.lru_cache(maxsize=512)
def _schedule(workload, lengths, early_exit):
  """`simulate_generation` remembered: a planner predicts many layouts whose
  rollout replicas run the same schedule (the same workload per replica)."""
  prefills, dispatches = simulate_generation(workload, lengths, early_exit)
  return prefills, tuple(dispatches)


# Prediction -----------------------------------------------------------------------


def predict(model, workload, layout, coeffs, lengths=None):
  """Seconds per stage and per step, idle fractions, and the bound.

  The reference, proximal and update passes cost the tokens they run
  (`tokens_run` over the layout's batch shards): padded rows, or packed rows
  with `workload.packing`, so packing shortens them by the ratio of the
  packing efficiencies on long-tailed lengths.

  Returns:
    dict with 'generate', 'reward', 'reference', 'proximal', 'update',
    'reshard', 'step' (seconds), 'rollout_idle', 'train_idle' (fractions of
    the step), 'bound' ('rollout', 'train', 'communication' or 'balanced'),
    'dispatches', and of one pass over the step's batch 'tokens_real',
    'tokens_run' and 'packing_efficiency' (real / run).
  """
  del model
  w, lay, c = workload, layout, coeffs
  # Generation: prompts split evenly over rollout replicas.
  replicas = lay.rollout_replicas
  per_replica = dataclasses.replace(w, prompts_per_step=max(1, -(-w.prompts_per_step // replicas)))
  all_lengths = list(w.response_lengths() if lengths is None else lengths)
  prefills, dispatches = _schedule(
    per_replica, tuple(all_lengths[: per_replica.rows]), replicas == 1
  )
  # A step's compute and page reads scale with the rows it decodes; the
  # weights are read once whatever the rows.
  decode = sum(
    steps
    * (
      c.decode_fixed_s
      + max(
        c.decode_compute_s * rows / w.num_slots,
        c.decode_mem_s + c.decode_page_s * pages * rows / w.num_slots,
      )
    )
    for steps, pages, rows in dispatches
  )
  generate = prefills * (c.prefill_fixed_s + c.prefill_token_s * w.prompt_len) + decode
  reward = w.rows * c.reward_s
  tok = tokens_run(w, all_lengths, lay.batch_shards)
  tokens = tok.run
  reference = tokens * c.forward_token_s if w.reference else 0.0
  minibatch = w.minibatch_rows or w.rows
  optimiser_steps = w.epochs * max(1, w.rows // minibatch)
  compute = w.epochs * tokens * c.train_token_s
  comm = optimiser_steps * c.update_fixed_s
  update = max(compute, comm) + 0.1 * min(compute, comm)  # mostly overlapped
  ahead = {'one_step_off': 1, 'async': lay.staleness}.get(lay.topology, 0)
  proximal = tokens * c.forward_token_s if ahead else 0.0
  reshard = c.reshard_s if lay.separate or lay.decode_copy else 0.0
  rollout_side = generate + reward
  train_side = reference + proximal + update
  if ahead:
    if lay.separate:
      step = pipeline_step(rollout_side, train_side, ahead, w.generation_cv) + reshard
    else:
      # Shared chips: device work adds up; host time (dispatch, scoring) overlaps.
      device_gen = generate * (1 - c.host_frac)
      step = max(rollout_side, train_side, device_gen + train_side)
  else:
    step = rollout_side + train_side + reshard
  if lay.separate:
    rollout_idle = 1 - rollout_side / step
    train_idle = 1 - train_side / step
  else:
    rollout_idle = train_idle = 0.0
  if comm > compute:
    bound = 'communication'
  elif rollout_side > 1.5 * train_side:
    bound = 'rollout'
  elif train_side > 1.5 * rollout_side:
    bound = 'train'
  else:
    bound = 'balanced'
  return {
    'generate': generate,
    'reward': reward,
    'reference': reference,
    'proximal': proximal,
    'update': update,
    'reshard': reshard,
    'step': step,
    'rollout_idle': rollout_idle,
    'train_idle': train_idle,
    'bound': bound,
    'dispatches': len(dispatches),
    'tokens_real': tok.real,
    'tokens_run': tok.run,
    'packing_efficiency': tok.efficiency,
  }


def pipeline_step(rollout_s, train_s, ahead, cv, steps=400, seed=0):
  """Mean seconds per step of generation running up to `ahead` = k steps
  ahead of the updates on chips of its own.

  Step j's rollout starts once the previous rollout is done and the
  parameters it reads exist (those after update j - k - 1); update j starts
  once rollout j is in and update j - 1 is done. Generation times vary from
  step to step, rollout_s times a lognormal factor of mean 1 and
  coefficient of variation `cv` (the same draws for every k): with cv = 0
  every k >= 1 gives max(rollout_s, train_s); a deeper buffer absorbs slow
  steps, k = 0 is the synchronous rollout_s + train_s. The mean is taken
  over the second half of `steps` (the steady state).
  """
  rng = np.random.default_rng(seed)
  sigma = np.sqrt(np.log1p(cv * cv))
  gen = rollout_s * rng.lognormal(-sigma * sigma / 2, sigma, steps) if cv else [rollout_s] * steps
  gen_end = np.zeros(steps)
  upd_end = np.zeros(steps)
  for j in range(steps):
    ready = upd_end[j - ahead - 1] if j - ahead - 1 >= 0 else 0.0
    start = max(gen_end[j - 1] if j else 0.0, ready)
    gen_end[j] = start + gen[j]
    upd_end[j] = max(upd_end[j - 1] if j else 0.0, gen_end[j]) + train_s
  half = steps // 2
  return float((upd_end[-1] - upd_end[half - 1]) / (steps - half))
