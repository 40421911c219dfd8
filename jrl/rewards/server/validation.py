"""The JSON of POST /score, checked on the server's side: `parse_score_request`
names the field that is wrong (`BadRequest`, answered 400), and
`scored_to_json` writes the answer. See README.md beside this file."""

import json
import math

import numpy as np


class BadRequest(ValueError):
  """A request the server answers with `status` (400, or 413 for too many
  completions), naming the wrong field."""

  def __init__(self, field, message, status=400):
    super().__init__(f'{field!r} {message}')
    self.field = field
    self.status = status


def _finite_or_none(values):
  """A list of floats, None where a value is not finite (JSON has no NaN)."""
  return [float(v) if math.isfinite(v) else None for v in np.asarray(values, np.float64)]


def scored_to_json(scored):
  """The JSON answer to POST /score for a ScoredBatch."""
  return {
    'total': _finite_or_none(scored.total),
    'per_fn': {k: _finite_or_none(v) for k, v in scored.per_fn.items()},
    'unscored': {k: int(v) for k, v in scored.unscored.items()},
    'failures': {k: int(v) for k, v in scored.failures.items()},
    'timeouts': {k: int(v) for k, v in scored.timeouts.items()},
    'errors': [str(e) for e in scored.errors],
  }


def type_name(value):
  """The JSON-ish name of a value's type, for error messages."""
  return 'null' if value is None else type(value).__name__


def parse_score_request(body, max_completions=None):
  """(prompts, completions, metadata) from a POST /score body, or BadRequest
  (status 413 for more than `max_completions` completions; None: no cap)."""
  try:
    request = json.loads(body)
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise BadRequest('body', f'is not JSON: {e}') from None
  if not isinstance(request, dict):
    raise BadRequest('body', f'must be a JSON object, not {type_name(request)}')
  fields = {}
  for field, kind, kind_name in (
    ('prompts', str, 'string'),
    ('completions', str, 'string'),
    ('metadata', dict, 'object'),
  ):
    if field not in request:
      raise BadRequest(field, 'is missing')
    values = request[field]
    if not isinstance(values, list):
      raise BadRequest(field, f'must be a list of {kind_name}s, not {type_name(values)}')
    if field == 'completions' and max_completions is not None and len(values) > max_completions:
      raise BadRequest(
        field,
        f'has {len(values)} entries; this server scores at most {max_completions} completions '
        'per request (max_completions): send smaller batches',
        status=413,
      )
    for i, v in enumerate(values):
      if not isinstance(v, kind):
        raise BadRequest(field, f'must be a list of {kind_name}s; item {i} is {type_name(v)}')
    fields[field] = values
  n = len(fields['completions'])
  for field in ('prompts', 'metadata'):
    if len(fields[field]) != n:
      raise BadRequest(
        field, f'has {len(fields[field])} entries for {n} completions (lengths must match)'
      )
  return fields['prompts'], fields['completions'], fields['metadata']
