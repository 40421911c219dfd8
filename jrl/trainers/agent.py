"""Agentic RL (`algorithm='agent'`): GRPO or PPO on multi-turn tool-use
episodes.

The update is GRPO's (`agent.trainer='grpo'`, the family of `rl.advantage`)
or PPO's (`'ppo'`: a critic and GAE, which carries values across the
environment's tokens, outside the loss mask). What differs from them is
composed in, not inherited: the rollout worker is the episode runner
(`jrl.trainers.episodes.EpisodeWorker`) and the SFT warm-up trains on
tool-use demonstrations (`episodes.demonstration_batch`).
"""

from jrl.trainers import controller, episodes, grpo, ppo

TRAINERS = {'grpo': grpo.build, 'ppo': ppo.build}


def demonstrations(res, examples, iteration):
  return episodes.demonstration_batch(
    res.config, res.tokenizer, res.stop_tokens, res.seq_len, examples, iteration
  )


def build(config):
  kind = config.agent.trainer
  if kind not in TRAINERS:
    raise ValueError(f"`agent.trainer` must be 'grpo' or 'ppo', got {kind!r}.")
  episodes.check(config)
  return TRAINERS[kind](config, make_worker=episodes.EpisodeWorker, sft_batch=demonstrations)


def run(config):
  return controller.train(build(config))
