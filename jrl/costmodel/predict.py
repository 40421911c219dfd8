"""Generation simulated slot by slot, and the stage and step times of one RL step."""

import dataclasses
import math

from jrl.costmodel.workload import tokens_run


def simulate_generation(workload, lengths=None, early_exit=True):
  """The sampler's schedule for one step: (prefills, [(steps, page bound,
  rows)] per dispatch).

  Mirrors `jrl.sampler.Sampler.generate`: groups admitted in order while G
  slots are free; each dispatch decodes the occupied slots, gathered into
  the power of two of rows that holds them (every slot when that is not
  fewer), for up to
  `steps_per_dispatch` steps, ending early once no slot is live or, with
  `early_exit` (the sampler's one-replica case), once at most half its rows
  are; slots that finished are freed at the dispatch
  boundary; the page bound is the most pages any slot can hold after the
  dispatch, rounded up to a power of two (at most the per-slot maximum), as
  `attend_pages`.
  """
  w = workload
  lengths = list(workload.response_lengths() if lengths is None else lengths)
  g, s, k, page = w.group_size, w.num_slots, w.steps_per_dispatch, w.page_size
  prompt = w.prompt_len
  max_pages = math.ceil(((w.max_prompt_len or prompt) + w.response_max) / page)
  pending = list(range(w.prompts_per_step))
  free, running = s, []  # running: [remaining tokens, tokens held]
  prefills, dispatches = 0, []
  while pending or running:
    while pending and free >= g:
      b = pending.pop(0)
      for j in range(g):
        # The first token comes from the prefill's logits: L - 1 decode steps.
        running.append([lengths[b * g + j] - 1, prompt])
      free -= g
      prefills += 1
    held = max(math.ceil(t / page) for _, t in running)
    bound = min(1 << max(0, math.ceil(math.log2(held + math.ceil(k / page) + 1))), max_pages)
    width = 1 << max(0, math.ceil(math.log2(len(running))))
    rows = s if width >= s else width
    until = rows // 2 if early_exit else 0
    # The loop runs while more than `until` slots have tokens left: until the
    # (until + 1)-th longest remainder is used up, k steps at most.
    left = sorted((r[0] for r in running), reverse=True)
    steps = min(k, max(left[until], 0)) if len(left) > until else 0
    dispatches.append((steps, bound, rows))
    for r in running:
      step = min(steps, r[0])
      r[0] -= step
      r[1] += step
    done = [r for r in running if r[0] <= 0]
    running = [r for r in running if r[0] > 0]
    free += len(done)
  return prefills, dispatches


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
  prefills, dispatches = simulate_generation(
    per_replica, all_lengths[: per_replica.rows], early_exit=replicas == 1
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
  stale = lay.topology == 'one_step_off'
  proximal = tokens * c.forward_token_s if stale else 0.0
  reshard = c.reshard_s if lay.separate or lay.decode_copy else 0.0
  rollout_side = generate + reward
  train_side = reference + proximal + update
  if lay.topology == 'one_step_off':
    if lay.separate:
      step = max(rollout_side, train_side) + reshard
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
