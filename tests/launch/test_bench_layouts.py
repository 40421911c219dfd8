"""`launch/bench_layouts.py` runs every layout on a tiny model and writes its
figures as JSON, each layout's loss that of the plain padded forward."""

import json

from launch import bench_layouts


def test_every_layout_runs_and_gives_the_same_loss(tmp_path):
  out = tmp_path / 'layouts.json'
  names = 'full,padded,padded_micro,packed,shared_prompt,shared_prompt_micro'
  bench_layouts.main(
    ['--size', 'cpu-tiny', '--prompts', '2', '--group', '4', '--completion', '16']
    + ['--max_prompt_len', '100', '--micro_tokens', '256', '--repeats', '1']
    + ['--layouts', names, '--out', str(out)]
  )
  results = json.loads(out.read_text())['results']
  assert sorted(results) == sorted(names.split(','))
  for r in results.values():
    assert r['loss_diff'] < 1e-5 and r['seconds'] > 0
  assert results['padded_micro']['parts'] > 1
  # Micro-batches: each part's program needs less than the whole batch's.
  assert (
    0 < results['padded_micro']['temp_bytes_per_part'] < results['padded']['temp_bytes_per_part']
  )
  # The prompt once per group: fewer tokens than padded rows.
  assert results['shared_prompt']['tokens_run'] < results['padded']['tokens_run']
