"""Seconds per unit of work of each stage (`Coefficients`): from the roofline
of a chip, or fitted to the spans of a measured run (`calibrate`)."""

import dataclasses

import numpy as np

from jrl.costmodel.model import flops_per_token, kv_bytes_per_token, matmul_params
from jrl.costmodel.workload import Workload, tokens_run
from jrl.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Coefficients:
  """Seconds per unit of work of each stage, on one rollout replica (generation)
  or on the training chips together (the rest).

  A decode step of all `num_slots` slots costs `decode_fixed_s +
  max(decode_compute_s, decode_mem_s + decode_page_s · pages)`, where
  `pages` is the page bound the sampler attends to; a step that decodes
  fewer rows (the occupied slots only) scales the compute and page terms by
  rows / num_slots (`predict`).
  """

  decode_fixed_s: float
  decode_compute_s: float
  decode_mem_s: float
  decode_page_s: float
  prefill_fixed_s: float
  prefill_token_s: float
  forward_token_s: float  # reference / proximal logprobs, per token run (tokens_run)
  train_token_s: float  # forward + backward, per token run
  update_fixed_s: float  # per optimiser step: dispatch, and collectives not hidden
  reward_s: float  # per completion
  reshard_s: float  # per policy version: to separate rollout chips, or the gathered decode copy
  host_frac: float = 0.0  # the part of generation that is host time (overlaps on shared chips)
  source: str = ''

  @classmethod
  def from_hardware(cls, model, hw, workload, layout):
    """Roofline coefficients with `hw`'s assumed utilisation."""
    w, lay = workload, layout
    tp_r = lay.rollout_tensor
    slots = w.num_slots
    page_bytes = w.page_size * kv_bytes_per_token(model, w.compute_bytes)
    weights = model.num_params() * w.compute_bytes
    bw = hw.mem_bw * hw.bw_eff * tp_r
    ctx = (w.max_prompt_len or w.prompt_len) + w.response_mean
    train_peak = hw.peak_flops * hw.train_mfu * lay.train_chips
    coll_bw = hw.link_bw if lay.train_chips <= hw.chips_per_node else hw.node_bw
    # FSDP: all-gather the weights for forward and backward, reduce-scatter gradients.
    n = lay.train_chips
    comm = 3 * model.num_params() * w.param_bytes * (n - 1) / n / coll_bw if n > 1 else 0.0
    cross_bw = hw.node_bw if lay.chips > hw.chips_per_node else hw.link_bw

    # Tensor parallelism: two activation all-reduces per layer (attention, MLP);
    # training moves them three times (forward, and two in the backward pass),
    # in large enough messages that their latency does not count.
    def tp_allreduce(t, rows, latency):
      if t == 1:
        return 0.0
      volume = rows * model.width * w.compute_bytes * 2 * (t - 1) / t
      return 2 * model.num_layers * (volume / hw.link_bw + latency)

    tp_train_token = 3 * tp_allreduce(lay.tensor, 1, 0.0) / max(1, n // lay.tensor)
    # Decoding from the trainer's fsdp-sharded weights: every matmul of every
    # step crosses the batch shards (XLA gathers the weights or reduces the
    # partial activations, whichever moves less); a gathered copy instead
    # costs one all-gather per policy version (`reshard_s`).
    b = lay.batch_shards
    matmuls = 7 * model.num_layers + 1
    activations = slots * model.width * w.compute_bytes * 2 * matmuls
    decode_fsdp = 0.0
    if lay.decode_fsdp:
      volume = min(weights / lay.tensor, activations) * (b - 1) / b
      decode_fsdp = matmuls * hw.collective_latency_s + volume / coll_bw
    if lay.separate:
      reshard = weights / max(cross_bw * min(lay.train_chips, lay.rollout_chips or 1), 1.0)
    elif lay.decode_copy:
      reshard = model.num_params() * w.param_bytes / lay.tensor * (b - 1) / b / coll_bw
    else:
      reshard = 0.0
    return cls(
      decode_fixed_s=hw.step_overhead_s
      + tp_allreduce(tp_r, slots, hw.collective_latency_s)
      + decode_fsdp,
      decode_compute_s=slots * flops_per_token(model, ctx) / (hw.peak_flops * hw.decode_mfu * tp_r),
      decode_mem_s=weights / bw,
      decode_page_s=slots * page_bytes / bw,
      prefill_fixed_s=hw.step_overhead_s,
      prefill_token_s=2 * matmul_params(model) / (hw.peak_flops * hw.prefill_mfu * tp_r),
      forward_token_s=flops_per_token(model, w.seq_len / 2) / train_peak + tp_train_token / 3,
      train_token_s=3 * flops_per_token(model, w.seq_len / 2) / train_peak + tp_train_token,
      update_fixed_s=comm,
      reward_s=w.reward_s,
      reshard_s=reshard,
      host_frac=0.0,
      source=f'roofline of {hw.name}',
    )

  def scaled(self, factor):
    """For a model with `factor` x the FLOPs per token on the same machine."""
    f = factor
    return dataclasses.replace(
      self,
      decode_compute_s=self.decode_compute_s * f,
      decode_mem_s=self.decode_mem_s * f,
      decode_page_s=self.decode_page_s * f,
      prefill_token_s=self.prefill_token_s * f,
      forward_token_s=self.forward_token_s * f,
      train_token_s=self.train_token_s * f,
      reshard_s=self.reshard_s * f,
    )


# Calibration from a trace ------------------------------------------------------------


def _events(trace, name):
  return [e for e in trace['traceEvents'] if e.get('ph') == 'X' and e['name'] == name]


def workload_from_config(config):
  """The Workload of a jrl run config (a dict, as in a trace's `otherData`)."""
  rl, sc = config['rl'], config['sampler']
  # Traces recorded before the lengths moved to `task` and the passes to `train`
  # have them in `rl` (and the oldest no packing fields).
  train = config.get('train', rl)
  task = config.get('task', {})
  prompt_len = task.get('max_prompt_len') or rl.get('max_prompt_len')
  response_len = task.get('max_response_len') or rl.get('max_new_tokens')
  packing = bool(train.get('packing', False))
  return Workload(
    prompts_per_step=rl['prompts_per_step'],
    group_size=rl['group_size'],
    prompt_len=prompt_len,
    response_mean=response_len,
    response_max=response_len,
    epochs=rl['epochs'],
    minibatch_rows=rl['minibatch_size'],
    reference=rl['kl_coef'] > 0,
    num_slots=sc['num_slots'],
    page_size=sc['page_size'],
    steps_per_dispatch=sc['steps_per_dispatch'],
    packing=packing,
    pack_row_len=int(train.get('pack_row_len', 0)) if packing else 0,
    micro_batch_tokens=int(train.get('micro_batch_tokens', 0)) if packing else 0,
  )


def trace_model(trace):
  """The ModelConfig a trace was recorded with (None if it does not say)."""
  fields = trace.get('otherData', {}).get('model')
  if not fields:
    return None
  # JSON has no tuples: the tuple-valued fields come back as lists.
  return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def calibrate(trace, workload=None, model=None, reference_model=None, lengths=None, shards=1):
  """Coefficients fitted to the spans of a measured run (`workdir/trace.json`).

  * decode: per-dispatch seconds regressed on the page bound
    (least squares, seconds = a + b · pages), divided by the steps;
  * prefill: per-call seconds regressed on the prompt tokens;
  * reference / update: seconds per token run (`tokens_run(workload,
    lengths, shards).run` per pass: padded rows, or packed rows when the run
    packed; `epochs` passes for the update), so coefficients of a packed run
    predict a padded one and the reverse;
  * reward: seconds per completion;
  * decode's fixed part also takes the host time of each 'generate' span
    outside its prefill and decode spans, per decode step;
  * host_frac: the fixed (row-independent) share of decode time.

  `workload` is the run's (default: read from the trace's config, its
  packing included; the config alone puts every response at max_new_tokens,
  so give the measured `lengths` or a workload with their mean); `shards`
  is the run's batch shards (fsdp x data), 1 on one device. With
  `model`, the coefficients are scaled by the ratio of its FLOPs per token
  to those of `reference_model` (default: the trace's model).
  """
  w = workload or workload_from_config(trace['otherData']['config'])
  reference_model = reference_model or trace_model(trace)
  decode = _events(trace, 'decode')
  if not decode:
    raise ValueError('the trace has no decode spans: record a run with `log.trace` on.')
  decode = [e for e in decode if e['args']['steps'] > 0]
  steps = np.asarray([e['args']['steps'] for e in decode], np.float64)
  # Page reads per step scale with the page bound and the rows decoded (a
  # trace recorded before dispatches had rows decoded every slot).
  rows = np.asarray([e['args'].get('rows', w.num_slots) for e in decode], np.float64)
  pages = np.asarray([e['args']['max_pages'] for e in decode], np.float64) * rows / w.num_slots
  secs = np.asarray([e['dur'] for e in decode], np.float64) / 1e6 / steps
  a, b = _fit(pages, secs)
  prefill = _events(trace, 'prefill')
  pa, pb = _fit(
    np.asarray([e['args']['tokens'] for e in prefill], np.float64),
    np.asarray([e['dur'] for e in prefill], np.float64) / 1e6,
  )
  tokens = tokens_run(w, lengths, shards).run
  median = lambda name: float(np.median([e['dur'] for e in _events(trace, name)]) / 1e6)
  update = median('update')
  reference = median('reference') if _events(trace, 'reference') else None
  reward = median('reward') / w.rows
  train_token = update / (w.epochs * tokens)
  forward_token = reference / tokens if reference is not None else train_token / 3
  decode_total = float(np.sum(secs * steps))
  fixed_total = float(np.sum(np.maximum(a, 0.0) * steps))
  # Host time inside a 'generate' span but outside its prefill and decode
  # spans (admission, reading finished slots back, freeing them), spread over
  # the decode steps of that span.
  extra = []
  for g in _events(trace, 'generate'):
    lo, hi = g['ts'], g['ts'] + g['dur']
    inner = [e for e in prefill + decode if lo <= e['ts'] and e['ts'] + e['dur'] <= hi]
    n_steps = sum(e['args']['steps'] for e in inner if e['name'] == 'decode')
    if n_steps:
      extra.append((g['dur'] - sum(e['dur'] for e in inner)) / 1e6 / n_steps)
  host_step = max(float(np.median(extra)), 0.0) if extra else 0.0
  coeffs = Coefficients(
    decode_fixed_s=max(a, 0.0) + host_step,
    decode_compute_s=0.0,
    decode_mem_s=0.0,
    decode_page_s=max(b, 0.0),
    prefill_fixed_s=max(pa, 0.0),
    prefill_token_s=max(pb, 0.0),
    forward_token_s=forward_token,
    train_token_s=train_token,
    update_fixed_s=0.0,
    reward_s=reward,
    reshard_s=median('reshard') if _events(trace, 'reshard') else 0.0,
    host_frac=fixed_total / decode_total if decode_total else 0.0,
    source='calibrated from a trace',
  )
  if model is not None and reference_model is not None:
    ctx = w.seq_len / 2
    coeffs = coeffs.scaled(flops_per_token(model, ctx) / flops_per_token(reference_model, ctx))
  return coeffs


def generation_cv(trace, skip=2):
  """The step-to-step spread of generation in a trace: the standard deviation
  of its 'generate' spans' durations over their mean (after the first
  `skip`, which compile), as `Workload.generation_cv`; 0 with fewer than 3."""
  secs = np.asarray([e['dur'] for e in _events(trace, 'generate')][skip:], np.float64)
  if len(secs) < 3 or secs.mean() <= 0:
    return 0.0
  return float(secs.std() / secs.mean())


def _fit(x, y):
  """Least-squares (intercept, slope); a constant when x does not vary."""
  if len(x) == 0:
    return 0.0, 0.0
  if np.ptp(x) == 0:
    return float(np.median(y)), 0.0
  slope, intercept = np.polyfit(x, y, 1)
  if intercept < 0:  # keep both parts physical
    return 0.0, float(np.sum(x * y) / np.sum(x * x))
  if slope < 0:
    return float(np.median(y)), 0.0
  return float(intercept), float(slope)
