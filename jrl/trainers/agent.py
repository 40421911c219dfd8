"""Agentic RL (`algorithm='agent'`): GRPO or PPO on multi-turn tool-use
episodes.

The update is GRPO's (`agent.trainer='grpo'`, the family of `rl.advantage`)
or PPO's (`'ppo'`: a critic and GAE, which carries values across the
environment's tokens, outside the loss mask). What differs from them is
composed in, not inherited: the rollout worker is the episode runner
(`jrl.trainers.rollouts.episodes.EpisodeWorker`) and the SFT warm-up trains on
tool-use demonstrations (`episodes.demonstration_batch`).
"""

from jrl.trainers import checks, grpo, ppo
from jrl.trainers.rollouts import episodes

TRAINERS = {'grpo': grpo.GRPO, 'ppo': ppo.PPO}
# What an agent run reads besides the shared sections (with `agent.trainer='ppo'`
# also `ppo.SECTION`).
SECTIONS = (*grpo.SECTIONS, episodes.SECTION)


def demonstrations(resources, examples, iteration):
  return episodes.demonstration_batch(
    resources.config,
    resources.tokenizer,
    resources.stop_tokens,
    resources.seq_len,
    examples,
    iteration,
  )


def sections(config):
  """The sections an agent run of `config` reads (the `ppo` one for agent.trainer='ppo')."""
  return SECTIONS + ((ppo.SECTION,) if config.agent.trainer == 'ppo' else ())


def build(config):
  episodes.check(config)  # agent.trainer first: it picks the update
  return TRAINERS[config.agent.trainer](
    config,
    make_worker=episodes.EpisodeWorker,
    sft_batch=demonstrations,
    sections=sections(config),
  )


ALGORITHM = checks.register(
  checks.Algorithm('agent', build, SECTIONS, steps_section='rl', online=True, reads=sections)
)
