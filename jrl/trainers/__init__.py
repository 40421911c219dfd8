"""Trainers: one `run(config)` per algorithm, and the registry that picks it.

    from jrl import trainers
    state = trainers.run(config)      # config.algorithm names the algorithm

Each algorithm module has a pure, jitted update step and a `build(config)`
that composes the shared set-up (`setup`), for the online algorithms a
rollout worker (`rollout`, `episodes`) and a topology (`topology`), into a
`controller.Job`; `run(config)` is `controller.train(build(config))`.
Nothing in `jrl/trainers` imports this package's `__init__`.
"""

from jrl.trainers import agent, checks, dpo, grpo, ppo, reward_model, sft

# Algorithm name -> run(config) -> final TrainState.
ALGORITHMS = {
  'grpo': grpo.run,
  'ppo': ppo.run,
  'dpo': dpo.run,
  'sft': sft.run,
  'reward_model': reward_model.run,
  'agent': agent.run,
}
# Algorithm name -> build(config) -> controller.Job (set up, not yet run).
BUILDERS = {
  'grpo': grpo.build,
  'ppo': ppo.build,
  'dpo': dpo.build,
  'sft': sft.build,
  'reward_model': reward_model.build,
  'agent': agent.build,
}


# Algorithm name -> config -> the sections it reads besides the shared ones
# (`checks.Section`s, each declared by the module that reads it).
SECTIONS = {
  'grpo': lambda config: grpo.SECTIONS,
  'ppo': lambda config: ppo.SECTIONS,
  'dpo': lambda config: dpo.SECTIONS,
  'sft': lambda config: sft.SECTIONS,
  'reward_model': lambda config: reward_model.SECTIONS,
  'agent': agent.sections,
}


def _lookup(table, config):
  algorithm = config.algorithm
  if algorithm not in table:
    raise ValueError(f'`algorithm` must be one of {tuple(table)}, got {algorithm!r}.')
  return table[algorithm]


def build(config):
  """The job of `config.algorithm`, set up (every config error raised) but not run."""
  return _lookup(BUILDERS, config)(config)


def run(config):
  """Runs (or resumes) the job described by `config`; returns the final TrainState."""
  return _lookup(ALGORITHMS, config)(config)


def validate(config, batch_shards=1):
  """Every check of `config` that needs no model and no data: the shared
  sections and the algorithm's (`checks.validate`), for a mesh of
  `batch_shards` batch shards. Raises ValueError naming the field."""
  checks.validate(config, batch_shards, _lookup(SECTIONS, config)(config))


def numeric_fields():
  """Every numeric field any config may have, with its range: the shared
  `checks.FIELDS` and every algorithm's sections'."""
  fields = dict(checks.FIELDS)
  for module in (grpo, ppo, dpo, sft, reward_model, agent):
    for section in module.SECTIONS:
      fields.update(section.fields)
  return fields
