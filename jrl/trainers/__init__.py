"""Trainers: one module per algorithm, and the registry that picks it.

    from jrl import trainers
    state = trainers.run(config)      # config.algorithm names the algorithm

Each algorithm module has a pure, jitted update step and a `build(config)`
that composes the shared set-up (`setup`), for the online algorithms a
rollout worker (`rollout`, `episodes`) and a topology (`topology`), into a
`controller.Job`, and registers one `checks.Algorithm` record: its name,
`build`, the config sections it reads, the section that counts its steps,
whether it trains online. Everything else (`run`, the checks, the configs'
sections, the topologies) reads that record. Nothing in `jrl/trainers`
imports this package's `__init__`.
"""

from jrl.trainers import agent, checks, controller, dpo, grpo, ppo, reward_model, sft

# Algorithm name -> checks.Algorithm, filled by the imports above.
ALGORITHMS = checks.REGISTRY


def build(config):
  """The job of `config.algorithm`, set up (every config error raised) but not run."""
  return checks.algorithm(config).build(config)


def run(config):
  """Runs (or resumes) the job described by `config`; returns the final TrainState."""
  return controller.train(build(config))


def sections_read(config):
  """The `checks.Section`s a run of `config` reads besides the shared ones."""
  return checks.algorithm(config).sections_read(config)


def validate(config, batch_shards=1):
  """Every check of `config` that needs no model and no data: the shared
  sections and the algorithm's (`checks.validate`), for a mesh of
  `batch_shards` batch shards. Raises ValueError naming the field."""
  checks.validate(config, batch_shards, sections_read(config))


def numeric_fields():
  """Every numeric field any config may have, with its range: the shared
  `checks.FIELDS` and every algorithm's sections'."""
  fields = dict(checks.FIELDS)
  for record in ALGORITHMS.values():
    for section in record.sections:
      fields.update(section.fields)
  return fields
