"""How far each sampled token was from being another one: the margins that
float rounding would have to cross to flip a draw.

Two sampler programs of different shapes (prompt sharing on and off, one slot
against four, paged against dense, sharded against one device, a kernel
against the gather path) compute the same logits to float rounding, not
bitwise: the difference depends on the CPU's vector width and the XLA
build. A draw whose decision quantity lies closer to its threshold than that
rounding can go either way, on one CPU and not another. Tests that compare
samples across such programs therefore compare tokens up to the first draw
that is *fragile* (its margin below `DELTA`) and nothing after it: up to
there, any difference is a real fault; beyond it the runs are allowed to
part.

The margins are computed here, in float64, from the definitions of
`jrl.sampler.sampling` (controls, temperature, top-k, top-p, the two-level
inverse-CDF draw) on full-recompute logits of the reference run, with the
uniforms of the sampler's own key chain (request seed s, sample g:
fold_in(PRNGKey(s), g), split once per generated or forced token). Every
draw that is not fragile must reproduce the reference run's token exactly:
that check keeps the reconstruction honest, so a wrong key chain or a wrong
transcription fails loudly instead of marking everything fragile.

Units: greedy and top-k margins are gaps between (temperature-scaled)
logits; top-p margins are probability mass; the draw's margins are the
distance of u x total from the nearest cumulative boundary, over the total.
A logit error e changes each of these by about e (relative), so DELTA =
1e-4 stands 100x above the 1e-6 logprob agreement the sampler tests assert
across programs and 10x above the 1e-5 of the sharded ones.
"""

import functools

import jax
import numpy as np

import jrl.models as M
from jrl.sampler.sampling import _NEG, BLOCK

DELTA = 1e-4


@functools.cache
def _uniforms(seed, g, n):
  """[n, 2] float64: the uniform pair each of sample g's first n steps draws with."""
  key = jax.random.fold_in(jax.random.PRNGKey(np.uint32(seed)), np.uint32(g))
  out = []
  for _ in range(n):
    pair = jax.random.split(key)
    key = pair[0]
    out.append(np.asarray(jax.random.uniform(pair[1], (2,)), np.float64))
  return np.stack(out) if out else np.zeros((0, 2))


def _pick_margin(mass_N, u):
  """(index picked, distance of u x total from the nearest boundary / total)."""
  c = np.cumsum(mass_N)
  total = c[-1]
  t = u * total
  at = int(np.sum(c <= t))
  last = int(np.flatnonzero(mass_N > 0)[-1])
  edges = np.concatenate([[0.0], c])
  return min(at, last), float(np.min(np.abs(edges - t)) / total)


def _controlled(logits_V, request, n_generated, min_new):
  """The logits a slot samples from (jrl.sampler.controls.controlled_logits)."""
  z = np.asarray(logits_V, np.float64).copy()
  for tok, bias in request.bias_items():
    z[tok] += bias
  if n_generated < min_new:
    z[list(request.stop_tokens)] = _NEG
  return z


def draw(logits_V, u_2, request, n_generated=0, min_new=0):
  """(token, margin) of one draw, transcribed in float64 from the sampler."""
  z = _controlled(logits_V, request, n_generated, min_new)
  if request.greedy:
    top2 = np.sort(z)[-2:]
    return int(np.argmax(z)), float(top2[1] - top2[0])
  z = z / max(request.temperature, 1e-6)
  margin = np.inf
  s = np.sort(z)[::-1]
  threshold = -np.inf
  if 0 < request.top_k < len(z):
    margin = min(margin, s[request.top_k - 1] - s[request.top_k])
    threshold = s[request.top_k - 1]
  if request.top_p < 1.0:
    kept = np.where(s >= threshold, s, -np.inf)
    probs = np.exp(kept - kept[0])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    margin = min(margin, float(np.min(np.abs(before[1:] - request.top_p))))
    last = max(int(np.sum(before < request.top_p)) - 1, 0)
    threshold = max(threshold, s[last])
  z = np.where(z >= threshold, z, -np.inf)
  nb = -(-len(z) // BLOCK)
  p = np.zeros(nb * BLOCK)
  p[: len(z)] = np.exp(z - z.max())
  p = p.reshape(nb, BLOCK)
  block, m_block = _pick_margin(p.sum(-1), u_2[0])
  inside, m_inside = _pick_margin(p[block], u_2[1])
  return block * BLOCK + inside, float(min(margin, m_block, m_inside))


def first_fragile(logits_nxV, tokens, request, g, forced=None, delta=DELTA):
  """Index of the first draw of this completion whose margin is below
  `delta` (len(tokens) if none). Asserts that every draw before it
  reproduces the sampled token.

  Args:
    logits_nxV: full-recompute logits that scored each of the n tokens.
    tokens: [n] the reference run's tokens.
    request: its `jrl.sampler.Request`.
    g: the sample's index in its group.
    forced: [n] bool, tokens an environment appended (no draw), or None.
  """
  n = len(tokens)
  u = _uniforms(int(request.seed), int(g), n)
  min_new = request.min_new_tokens
  min_new = min_new if isinstance(min_new, (int, np.integer)) else min_new[g]
  for t in range(n):
    if forced is not None and forced[t]:
      continue
    tok, margin = draw(logits_nxV[t], u[t], request, t, min_new)
    if margin < delta:
      return t
    assert tok == int(tokens[t]), (
      f'seed {request.seed} sample {g} token {t}: the sampler drew {int(tokens[t])} where '
      f'the full-recompute logits draw {tok} (margin {margin:.2e})'
    )
  return n


def fragile_points(graphdef, params, requests, groups, delta=DELTA):
  """[B][G] index of each completion's first fragile draw (its length if
  none), from `jrl.models.logits` of prompt + completion in one padded batch;
  tokens an environment appended (`env_mask`) are not draws."""
  pairs = [(r, c) for r, group in zip(requests, groups, strict=True) for c in group]
  rows = [list(r.prompt) + c.tokens.tolist() for r, c in pairs]
  width = 8 * -(-max(map(len, rows)) // 8)
  tokens = np.zeros((8 * -(-len(rows) // 8), width), np.int32)
  mask = np.zeros_like(tokens)
  for i, row in enumerate(rows):
    tokens[i, : len(row)], mask[i, : len(row)] = row, 1
  logits = np.asarray(M.logits(graphdef, params, tokens, mask), np.float64)
  out, i = [], 0
  for r, group in zip(requests, groups, strict=True):
    out.append([])
    for g, c in enumerate(group):
      start = len(r.prompt) - 1
      scores = logits[i, start : start + len(c.tokens)]
      out[-1].append(first_fragile(scores, c.tokens, r, g, c.env_mask, delta))
      i += 1
  return out
