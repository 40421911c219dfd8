"""Held-out evaluation figures from per-sample scores: mean@n and pass@k.

With n samples per problem of which c are correct,

    mean@n = c / n                 (averaged over problems)
    pass@k = 1 − C(n − c, k) / C(n, k)

is the unbiased estimator of the probability that at least one of k samples
drawn without replacement from the n is correct (Chen et al. 2021,
"Evaluating Large Language Models Trained on Code", eq. 1), averaged over
problems. It is computed as 1 − ∏_{i=n−c+1}^{n} (1 − k / i), which avoids
the huge binomials. pass@n is "any of the n correct"; pass@1 equals mean@n.

`summarize(scores, ks)` turns a [P, n] array of scores (1 correct, 0 wrong,
NaN unscored, counted as wrong) into these figures, and `per_example` into
rows for a JSONL file.
"""

import numpy as np


def pass_at_k(n, c, k):
  """Unbiased pass@k for one problem with `c` correct of `n` samples.

  Args:
    n: samples drawn (>= 1).
    c: correct samples, 0 <= c <= n.
    k: samples allowed, 1 <= k <= n.

  Returns:
    float in [0, 1].
  """
  n, c, k = int(n), int(c), int(k)
  if not 1 <= k <= n:
    raise ValueError(f'pass@k needs 1 <= k <= n, got k={k}, n={n}.')
  if not 0 <= c <= n:
    raise ValueError(f'pass@k needs 0 <= c <= n, got c={c}, n={n}.')
  if n - c < k:
    return 1.0  # every k-subset holds a correct sample
  i = np.arange(n - c + 1, n + 1, dtype=np.float64)
  return float(1.0 - np.prod(1.0 - k / i))


def summarize(scores, ks=(1,), prefix='eval'):
  """mean@n and pass@k over problems.

  Args:
    scores: [P, n] float, 1 for a correct sample (> 0.5 counts as correct),
      0 wrong, NaN unscored (wrong).
    ks: the k of each pass@k to report (each <= n).
    prefix: metric name prefix.

  Returns:
    {f'{prefix}/mean@{n}', f'{prefix}/pass@{k}' for k in ks (and n),
     f'{prefix}/unscored'}: floats.
  """
  scores = np.asarray(scores, np.float64)
  if scores.ndim != 2 or scores.shape[1] < 1:
    raise ValueError(f'scores must be [problems, samples], got shape {scores.shape}.')
  p, n = scores.shape
  correct = np.nan_to_num(scores, nan=0.0) > 0.5
  counts = correct.sum(axis=1)
  out = {f'{prefix}/mean@{n}': float(correct.mean()) if p else 0.0}
  for k in sorted(set(ks) | {n}):
    values = [pass_at_k(n, c, k) for c in counts]
    out[f'{prefix}/pass@{k}'] = float(np.mean(values)) if p else 0.0
  out[f'{prefix}/unscored'] = float(np.isnan(scores).mean()) if p else 0.0
  return out


def per_example(examples, completions, scores):
  """Rows for a JSONL file: each example with its completions and scores.

  Args:
    examples: P dicts (prompt, answer, ...).
    completions: P lists of n strings.
    scores: [P, n] floats (NaN unscored).
  """
  scores = np.asarray(scores, np.float64)
  rows = []
  for example, texts, row in zip(examples, completions, scores, strict=True):
    values = [None if np.isnan(v) else float(v) for v in row]
    rows.append({**example, 'completions': list(texts), 'scores': values})
  return rows
