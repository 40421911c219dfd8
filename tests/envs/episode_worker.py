"""The agent trainer's episode worker (`jrl.trainers.rollouts.episodes.EpisodeWorker`)
on a tiny random chat checkpoint (ChatML, a character-level tokenizer), for
tests that drive an environment adapter's episodes through the real
sampler: `worker.make_env` is replaced by the environment under test.

Sampling at temperature 1.5 makes the random model end its turns (with
<|im_end|>) every few dozen tokens, so episodes have several turns; each
sample's tokens depend only on its seed and the tokens before it, so two
environments that answer with the same tokens give the same trajectories
(each step is waited for, `worker.parking = False`, so that which samples
decode together, and so the rounding of their logits, never depends on
when an environment answered; tests/trainers/test_agent.py covers parked
samples). Steps still run on the environment pool, with its deadline.
`HandWritten` is the reference such tests compare an adapter with: a game
played on tokens by rendering the whole conversation each turn.
"""

from configs import agent_arith
from jrl import trainers
from jrl.envs import Environment, Step
from tests.helpers import set_fields, write_tiny_chat_model

END = '<|im_end|>'  # the ChatML turn end


def build(root, **overrides):
  """(job, worker) of an agent job on a tiny chat model written under `root`."""
  write_tiny_chat_model(str(root / 'model'), family='qwen2', max_positions=2048)
  fields = {
    'workdir': str(root / 'run'),
    'model.path': str(root / 'model'),
    'tokenizer': '',  # the checkpoint's, with its chat template
    'agent.env': 'jrl.envs.arith:make_chat_env',  # replaced per test (same turn end)
    'agent.max_turns': 4,
    'agent.max_env_tokens': 400,  # a textarena game's messages
    'agent.step_timeout_s': 1.0,
    'agent.env_workers': 4,
    'task.max_prompt_len': 1000,
    'task.max_response_len': 300,
    'task.eval_size': 4,
    'sampling.temperature': 1.5,
    'sft.steps': 0,
    'rl.steps': 1,
    'rl.prompts_per_step': 4,
    'rl.group_size': 2,
    'rl.minibatch_size': 8,
    'sampler.num_slots': 8,
    'eval.every': 0,
    'log.plot': False,
    'log.tensorboard': False,
    **overrides,
  }
  job = trainers.build(set_fields(agent_arith.get_config(), fields))
  worker = job.topology.worker
  worker.parking = False
  return job, worker


def run(job, worker, make_env, examples, *, group_size=2, iteration=1):
  """[len(examples)][group_size] (Completion, Episode) of `make_env`'s
  environments, sampled with the job's initial parameters."""
  worker.make_env = make_env
  _, results = worker.run_episodes(
    job.state.params,
    examples,
    group_size=group_size,
    greedy=False,
    iteration=iteration,
    version=0,
  )
  return results


class HandWritten(Environment):
  """A token-level environment written out by hand for a game with
  `start(seed) -> text` and `play(action) -> (text, reward, done)`: each
  environment turn's tokens are the full render of the conversation, minus
  the text the sequence already holds."""

  def __init__(self, tokenizer, game):
    self.tok, self.game = tokenizer, game
    self.turn_stop_tokens = (tokenizer.encode(END)[0],)

  def reset(self, example):
    self.messages = [{'role': 'user', 'content': self.game.start(example['seed'])}]
    self.text = self.tok.apply_chat_template(self.messages, add_generation_prompt=True)
    return self.tok.encode(self.text)

  def step(self, turn_tokens):
    turn = self.tok.decode(turn_tokens)
    self.text += turn
    action = turn.removesuffix(END)
    text, reward, done = self.game.play(action)
    if done:
      return Step([], done=True, reward=reward)
    self.messages += [{'role': 'assistant', 'content': action}, {'role': 'user', 'content': text}]
    full = self.tok.apply_chat_template(self.messages, add_generation_prompt=True)
    assert full.startswith(self.text)
    new, self.text = full[len(self.text) :], full
    return Step(self.tok.encode(new), reward=reward)
