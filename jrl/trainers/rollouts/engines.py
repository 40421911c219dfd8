"""The rollout engine, made from config: `sampler.engine` 'jrl' (the paged
sampler, sized by `sampler.*` and `task.*`) or a `contracts.Engine` from a
factory named by import path; and the checks of the `sampling` and
`sampler` sections."""

from jrl import models, parallel, plugins, sampler
from jrl.trainers import checks
from jrl.trainers.rollouts import contracts


def eval_group_sizes(config):
  """The group sizes of the held-out evaluation: 1 (greedy) and `eval.samples`."""
  return (1, int(config.eval.samples)) if config.eval.samples else (1,)


def build_sampler(config, model, mesh, stop_tokens, group_sizes=None, **engine_overrides):
  """A paged sampler for `model` on `mesh`, sized by `sampler.*` and `task.*`
  (`engine_overrides`: SamplerConfig fields, e.g. room for forced tokens).

  With `sampler.num_pages` = 0 the page pool holds every slot's worst case
  for each of `group_sizes` (default: `rl.group_size`): groups share their
  prompt pages, so the greedy held-out evaluation (groups of 1) needs more
  pages per slot than GRPO's groups, and a pool sized for the latter would
  leave slots idle during it.

  With `sampler.replicas` R > 1 the slots are split into R data-parallel
  replicas over the mesh's batch axes, each with a pool of its own (sized
  for its S/R slots); whole groups go to one replica."""
  task_config, sampler_config = config.task, config.sampler
  sizes = group_sizes or (config.rl.group_size,)
  per_replica = sampler_config.num_slots // sampler_config.replicas
  num_pages = sampler_config.num_pages or max(
    sampler.pool_pages(
      task_config.max_prompt_len,
      task_config.max_response_len,
      g,
      sampler_config.page_size,
      per_replica,
    )
    for g in sizes
  )
  engine_config = sampler.SamplerConfig(
    num_slots=sampler_config.num_slots,
    num_pages=num_pages,
    page_size=sampler_config.page_size,
    max_prompt_len=task_config.max_prompt_len,
    max_new_tokens=task_config.max_response_len,
    max_stop_tokens=max(1, len(stop_tokens)),
    attention_impl=sampler_config.attention_impl,
  )._replace(**engine_overrides)
  try:
    return sampler.Sampler(
      model.graphdef,
      model.config,
      engine_config,
      steps_per_dispatch=sampler_config.steps_per_dispatch,
      mesh=mesh,
      replicas=sampler_config.replicas,
    )
  except ValueError as e:
    if 'replicas' not in str(e):
      raise
    raise ValueError(f'`sampler.replicas`: {e}') from None


def build_engine(config, model, mesh, stop_tokens, group_sizes=None, **engine_overrides):
  """The rollout engine `sampler.engine` names: jrl's paged sampler
  (`build_sampler`) for 'jrl', else the `contracts.Engine` that the factory
  at that import path makes from the same arguments. Raises ValueError
  naming the field when the path does not load or the object is no engine."""
  name = config.sampler.engine
  if name == 'jrl':
    return build_sampler(config, model, mesh, stop_tokens, group_sizes, **engine_overrides)
  name = NAMED_ENGINES.get(name, name)
  factory = plugins.load_object(name, '`sampler.engine`')
  if not callable(factory):
    raise ValueError(f'`sampler.engine` {name!r}: a {type(factory).__name__} is not a factory.')
  engine = factory(config, model, mesh, stop_tokens, group_sizes, **engine_overrides)
  if not isinstance(engine, contracts.Engine):
    raise ValueError(
      f'`sampler.engine` {name!r} made a {type(engine).__name__}, which is no engine: it needs '
      '`generate(params, requests, *, group_size, share_prompt, on_turn_end)`, `stats` and '
      '`tracer` (jrl.trainers.rollouts.contracts.Engine).'
    )
  return engine


DECODE_WEIGHTS = ('auto', 'gathered', 'sharded')
RECOMPUTE_LOGPROBS = ('auto', 'on', 'off')
# Outside engines by short name: adapters in third_party/, never imported by jrl/.
NAMED_ENGINES = {'vllm': 'third_party.vllm.engine:make_engine'}


def check_sampler(config, batch_shards):
  """The `sampler` section against the rollout's groups (a group's samples decode together)."""
  sampler_config, need = config.sampler, checks.need
  engine = sampler_config.engine
  need(
    engine == 'jrl' or engine in NAMED_ENGINES or plugins.is_import_path(engine),
    'sampler.engine',
    f"must be 'jrl' (the paged sampler), one of {tuple(NAMED_ENGINES)} or an import path "
    "'package.module:make_engine'.",
  )
  need(
    sampler_config.recompute_logprobs in RECOMPUTE_LOGPROBS,
    'sampler.recompute_logprobs',
    f'one of {RECOMPUTE_LOGPROBS}.',
  )
  need(
    sampler_config.decode_weights in DECODE_WEIGHTS,
    'sampler.decode_weights',
    f'one of {DECODE_WEIGHTS}.',
  )
  need(
    sampler_config.num_slots % sampler_config.replicas == 0,
    'sampler.replicas',
    'must divide sampler.num_slots.',
  )
  need(
    batch_shards % sampler_config.replicas == 0,
    'sampler.replicas',
    f'must be 1, mesh.data or mesh.data x mesh.fsdp (the batch shards: {batch_shards}).',
  )
  if 'rl' in config:
    need(
      sampler_config.num_slots // sampler_config.replicas >= config.rl.group_size,
      'sampler.num_slots',
      'divided by sampler.replicas must be >= rl.group_size (a group decodes on one replica).',
    )


SAMPLING = checks.Section(
  'sampling',
  {
    'sampling.temperature': checks.positive(),
    'sampling.top_k': checks.count(0),
    'sampling.top_p': checks.fraction(lo_open=True),
    'sampling.min_new_tokens': checks.count(0),
  },
  lambda config, batch_shards: checks.need(
    config.sampling.min_new_tokens <= config.task.max_response_len,
    'sampling.min_new_tokens',
    f'must be at most task.max_response_len = {config.task.max_response_len}.',
  ),
)
SAMPLER = checks.Section(
  'sampler',
  {
    'sampler.num_slots': checks.count(1),
    'sampler.page_size': checks.count(1),
    'sampler.num_pages': checks.count(2, also=(0,)),  # page 0 is scratch; 0: sized automatically
    'sampler.steps_per_dispatch': checks.count(1),
    'sampler.replicas': checks.count(1),
    'sampler.vllm.kv_space_gib': checks.count(1),
    'sampler.vllm.threads': checks.count(0),
  },
  check_sampler,
)


# The gathered decode copy may take at most this share of a device's memory
# (`sampler.decode_weights='auto'`); the KV pool and the training state need the rest.
DECODE_WEIGHTS_MEMORY_SHARE = 0.25


def decode_shardings(mode, mesh, model_config, params, memory_limit=None):
  """The layout a colocated sampler reads the policy in, or None for the
  trainer's own (`sampler.decode_weights`).

  With fsdp > 1 the trainer's weights are split over the batch shards, and
  every decode step of a sampler reading them runs collectives across the
  fsdp axis for every matmul. 'gathered' copies them once per policy version
  into `parallel.decode_shardings` (whole on each batch shard, still split
  over tensor and expert); 'auto' does so when that copy takes at most
  `DECODE_WEIGHTS_MEMORY_SHARE` of a device's memory (`memory_limit` bytes;
  None: the device's `bytes_limit`, unknown on the CPU, where it fits);
  'sharded' keeps the trainer's layout.
  """
  if mode == 'sharded' or mesh.shape['fsdp'] == 1:
    return None  # without fsdp the trainer's layout is the decode layout
  shardings = parallel.decode_shardings(
    mesh, params, models.param_logical_axes, units=models.head_units(model_config)
  )
  if mode == 'gathered':
    return shardings
  if memory_limit is None:
    stats = mesh.devices.flat[0].memory_stats() or {}
    memory_limit = stats.get('bytes_limit')
  if memory_limit is None:
    return shardings
  fits = parallel.bytes_per_device(params, shardings) <= DECODE_WEIGHTS_MEMORY_SHARE * memory_limit
  return shardings if fits else None
