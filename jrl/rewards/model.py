"""Reward models: a jrl transformer with a scalar head scores (prompt, completion).

    rm = RewardModel.load('/models/my-reward-model', tokenizer)
    scores = rm(prompts, completions, metadata)          # list of floats

Texts are tokenised as prompt + completion, truncated from the left to
`max_len` tokens (the end of the completion is what is scored), right-padded
to a bucket length (a multiple of `bucket`, so few shapes compile) and
scored `batch_size` rows at a time by one jitted function: the scalar head
at each row's last real token. Run it in the reward service's inline mode
(it holds device arrays).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jrl import models, parallel
from jrl.models import hf


class RewardModel:
  """Batched, jitted scoring with a scalar-head transformer."""

  def __init__(
    self, graphdef, params, tokenizer, *, max_len=1024, batch_size=32, bucket=64, mesh=None
  ):
    if max_len < 2 or batch_size < 1 or bucket < 1:
      raise ValueError('`max_len` >= 2, `batch_size` >= 1 and `bucket` >= 1 are required.')
    self.graphdef, self.params, self.tokenizer = graphdef, params, tokenizer
    self.max_len, self.batch_size, self.bucket = max_len, batch_size, bucket
    self._score = jax.jit(functools.partial(models.sequence_scores, graphdef))
    if mesh is not None:  # the params' mesh: traced under it (attention kernels per shard)
      self._score = parallel.on_mesh(mesh, self._score)

  @classmethod
  def load(cls, path, tokenizer, *, mesh=None, **kwargs):
    """From a Hugging Face `*ForSequenceClassification` directory (needs `score.weight`)."""
    ck = hf.load(path, mesh=mesh, lm_head=False, scalar_head=True)
    return cls(ck.graphdef, ck.params, tokenizer, mesh=mesh, **kwargs)

  def encode(self, prompt, completion):
    ids = self.tokenizer.encode(prompt) + self.tokenizer.encode(completion)
    return ids[-self.max_len :] if ids else [self.tokenizer.pad_id]

  def __call__(self, prompts, completions, metadata=None):
    del metadata
    rows = [self.encode(p, c) for p, c in zip(prompts, completions, strict=True)]
    out = np.zeros(len(rows), np.float32)
    for start in range(0, len(rows), self.batch_size):
      chunk = rows[start : start + self.batch_size]
      width = min(self.max_len, -(-max(len(r) for r in chunk) // self.bucket) * self.bucket)
      tokens = np.full((self.batch_size, width), self.tokenizer.pad_id, np.int32)
      mask = np.zeros((self.batch_size, width), bool)
      mask[:, 0] = True  # padding rows score one pad token; their scores are dropped
      for i, r in enumerate(chunk):
        tokens[i, : len(r)] = r
        mask[i, : len(r)] = True
      scores = self._score(self.params, jnp.asarray(tokens), jnp.asarray(mask))
      out[start : start + len(chunk)] = np.asarray(scores)[: len(chunk)]
    return [float(s) for s in out]
