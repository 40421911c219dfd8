"""Held-out evaluation: greedy accuracy, and mean@n / pass@k of n samples.

    held_out = HeldOut(config, encoder, tokenizer, stop_tokens, examples, sampler, lock, tracer)
    held_out.evaluate(params, step=120)   # -> {'eval/accuracy': ..., ...}

Every held-out problem is decoded greedily; its accuracy is the share that
`eval.reward` scores > 0.5, reported with its standard error
√(p(1 − p) / N) and, with `eval.group_key` set (e.g. 'difficulty'), per
value of that field of the rows. With `eval.samples` = n > 0 every problem
is also sampled n times at `eval.temperature`, and `scores.summarize`
turns the [P, n] scores into mean@n and pass@k for k in 1, 2, 4, ... n.

Each evaluation appends its rows (the problem, the greedy completion and
its score, the n samples and their scores, the parameter updates so far)
to workdir/eval_samples.jsonl on process 0, so a person can read what the
model answered before and after training.

Held-out answers are model output too: they are scored in a worker process
with the training rewards' deadline, never in the trainer's process (the
service starts at the first evaluation).
"""

import json
import math
import os
import threading

import jax
import numpy as np

from jrl import distributed, rewards, sampler
from jrl.trainers.evaluation import scores
from jrl.trainers.rollouts import engines
from jrl.trainers.setup import seed

EXAMPLES_FILE = 'eval_samples.jsonl'


def decode(tokenizer, tokens, stop_tokens):
  """A completion's text without its stop tokens."""
  return tokenizer.decode([t for t in tokens if t not in stop_tokens], skip_special_tokens=True)


def pass_ks(n):
  """The k of pass@k reported for n samples: 1, 2, 4, ... up to n, and n."""
  ks, k = [], 1
  while k < n:
    ks.append(k)
    k *= 2
  return tuple(ks) + (n,)


def grouped_accuracy(correct, examples, key):
  """{f'eval/accuracy/{key}_{value}': share correct} over the examples' `key` field.

  Args:
    correct: [P] bool.
    examples: P dicts; rows without `key` are grouped under 'none'.
    key: the field ('' = no grouping: {}).
  """
  if not key:
    return {}
  groups = {}
  for ok, ex in zip(correct, examples, strict=True):
    groups.setdefault(str(ex.get(key, 'none')), []).append(bool(ok))
  return {
    f'eval/accuracy/{key}_{value}': float(np.mean(oks)) for value, oks in sorted(groups.items())
  }


class HeldOut:
  """Greedy (and optionally sampled) accuracy on the held-out examples."""

  def __init__(self, config, encoder, tokenizer, stop_tokens, examples, engine, lock, tracer):
    self.config = config
    self.encoder = encoder
    self.tokenizer = tokenizer
    self.stop_tokens = stop_tokens
    self.examples = examples
    self.engine = engine
    self.lock = lock
    self.tracer = tracer
    self.path = os.path.join(os.path.abspath(config.workdir), EXAMPLES_FILE)
    self._scorer = None
    self._calls = 0
    self._prompts = None  # (token ids, rendered texts), encoded at the first evaluation

  @classmethod
  def of_run(cls, resources, engine, lock):
    """The held-out evaluation of a run's `resources` (its task's held-out
    examples) on `engine`, whose calls `lock` serialises."""
    return cls(
      resources.config,
      resources.encoder,
      resources.tokenizer,
      resources.stop_tokens,
      resources.task.held_out,
      engine,
      lock,
      resources.tracer,
    )

  def _encoded(self):
    if self._prompts is None:
      texts = [self.encoder.prompt_text(ex['prompt']) for ex in self.examples]
      ids = [self.encoder.prompt_ids(ex['prompt']) for ex in self.examples]
      self._prompts = (ids, texts)
    return self._prompts

  def _requests(self, greedy):
    ec = self.config.eval
    return [
      sampler.Request(
        prompt=ids,
        max_new_tokens=self.config.task.max_response_len,
        temperature=1.0 if greedy else float(ec.temperature),
        greedy=greedy,
        stop_tokens=self.stop_tokens,
        seed=seed(self.config.seed, 'eval', self._calls, i),
      )
      for i, ids in enumerate(self._encoded()[0])
    ]

  def _score(self, texts, repeat):
    """[P, repeat] eval-reward scores of texts laid out problem-major."""
    if self._scorer is None:
      if 'reward' in self.config and rewards.uses_sandbox(self.config.eval.reward):
        reward_config = self.config.reward  # the sandbox's settings, for the scorer's worker
        rewards.code.configure_sandbox(
          reward_config.sandbox_unsafe, rewards.code.Settings.of(reward_config)
        )
      self._scorer = rewards.RewardService(
        (self.config.eval.reward,),
        mode='process',
        workers=1,
        timeout_s=self.config.reward.timeout_s if 'reward' in self.config else 30.0,
      )
    prompts = self._encoded()[1]
    scored = self._scorer(
      [p for p in prompts for _ in range(repeat)],
      texts,
      [ex for ex in self.examples for _ in range(repeat)],
    )
    return np.asarray(scored.total, np.float64).reshape(len(self.examples), repeat)

  def evaluate(self, params, step=None):
    """Held-out metrics of `params`; `step` (parameter updates so far) labels
    the rows written to eval_samples.jsonl."""
    if not self.examples:
      return {}
    n = int(self.config.eval.samples)
    with self.lock, self.tracer.span('eval'):
      weights = self.engine.load_weights(params, step)
      greedy = self.engine.generate(weights, self._requests(True), group_size=1)
      sampled = self.engine.generate(weights, self._requests(False), group_size=n) if n else None
    self._calls += 1
    greedy_texts = [decode(self.tokenizer, g[0].tokens, self.stop_tokens) for g in greedy]
    greedy_scores = self._score(greedy_texts, 1)[:, 0]
    correct = greedy_scores > 0.5
    p = float(np.mean(correct))
    out = {
      'eval/accuracy': p,
      'eval/accuracy_se': math.sqrt(p * (1.0 - p) / len(correct)),
      **grouped_accuracy(correct, self.examples, self.config.eval.group_key),
    }
    sampled_texts, sampled_scores = [[] for _ in self.examples], None
    if n:
      sampled_texts = [
        [decode(self.tokenizer, c.tokens, self.stop_tokens) for c in g] for g in sampled
      ]
      sampled_scores = self._score([t for ts in sampled_texts for t in ts], n)
      out.update(scores.summarize(sampled_scores, pass_ks(n), prefix='eval/sampled'))
    if distributed.is_main():
      self._write(step, greedy_texts, greedy_scores, sampled_texts, sampled_scores)
    return out

  def _write(self, step, greedy_texts, greedy_scores, sampled_texts, sampled_scores):
    if sampled_scores is None:
      sampled_scores = np.zeros((len(self.examples), 0))
    rows = scores.per_example(self.examples, sampled_texts, sampled_scores)
    with open(self.path, 'a', encoding='utf-8') as f:
      for row, text, score in zip(rows, greedy_texts, greedy_scores, strict=True):
        row = {'updates': step, 'greedy': text, 'greedy_score': float(score), **row}
        f.write(json.dumps(row, default=str) + '\n')

  def close(self):
    if self._scorer is not None:
      self._scorer.close()
      self._scorer = None


class Evaluator:
  """`evaluate(state)` for the algorithms without a rollout worker: held-out
  accuracy with a greedy sampler of its own, built at the first evaluation
  (never, with `eval.every` = 0 or no held-out examples). Under fsdp it
  reads a copy of the parameters in the decode layout, made per evaluation,
  where `sampler.decode_weights` says so (as a colocated rollout does,
  `engines.decode_shardings`)."""

  def __init__(self, resources):
    self.resources = resources
    self.held_out = None  # HeldOut, once built
    self.layout = None  # the decode layout of the parameters (None: as trained)

  def __call__(self, state):
    resources = self.resources
    if not resources.task.held_out:
      return {}
    if self.held_out is None:
      config = resources.config
      self.layout = engines.decode_shardings(
        config.sampler.decode_weights, resources.mesh, resources.model.config, state.params
      )
      engine = engines.build_engine(
        config,
        resources.model,
        resources.mesh,
        resources.stop_tokens,
        engines.eval_group_sizes(config),
      )
      engine.tracer = resources.tracer
      self.held_out = HeldOut.of_run(resources, engine, threading.Lock())
    params = state.params
    if self.layout is not None:
      with resources.tracer.span('reshard'):
        params = jax.block_until_ready(jax.device_put(params, self.layout))
    return self.held_out.evaluate(params, step=int(state.step))

  def close(self):
    if self.held_out is not None:
      self.held_out.close()
