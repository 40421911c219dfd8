"""Metric writers: JSONL, Weights & Biases in offline mode (no network), and
sample completions."""

import glob
import json
import os
import struct
import time

import pytest

from jrl import metrics


def _read_wandb_history(run_dir):
  """The history rows of an offline W&B run, read from its `.wandb` log.

  The file is W&B's record log: a 7-byte header, then 32 KiB blocks of
  records, each with a 7-byte header (crc32, length, type: 1 full, 2 first,
  3 middle, 4 last) and a protobuf `Record`."""
  from wandb.proto import wandb_internal_pb2 as pb

  (path,) = glob.glob(os.path.join(run_dir, 'run-*.wandb'))
  data = open(path, 'rb').read()
  block, pos, pieces, records = 32768, 7, b'', []
  while pos + 7 <= len(data):
    left = block - pos % block
    if left < 7:
      pos += left
      continue
    _, length, kind = struct.unpack('<IHB', data[pos : pos + 7])
    if kind == 0 and length == 0:
      pos += left
      continue
    chunk = data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind == 1:
      records.append(chunk)
    elif kind == 2:
      pieces = chunk
    elif kind == 3:
      pieces += chunk
    elif kind == 4:
      records.append(pieces + chunk)
  rows = []
  for raw in records:
    record = pb.Record()
    record.ParseFromString(raw)
    if record.WhichOneof('record_type') == 'history':
      item = {
        i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in record.history.item
      }
      rows.append({k: v for k, v in item.items() if not k.startswith('_')})
  return rows


def _wandb_history(run_dir, rows, timeout_s=30.0):
  """The run's history once it holds `rows` rows: W&B's writer process may
  still be flushing the file when `finish()` returns on a busy machine."""
  deadline = time.monotonic() + timeout_s
  while True:
    history = _read_wandb_history(run_dir)
    if len(history) >= rows or time.monotonic() > deadline:
      return history
    time.sleep(0.2)


def test_wandb_offline_gets_the_same_metrics_as_jsonl(tmp_path, monkeypatch):
  monkeypatch.setenv('WANDB_SILENT', 'true')
  workdir = str(tmp_path / 'run')
  writer = metrics.MetricsWriter(
    workdir, 3, tensorboard=False, wandb={'project': 'jrl-test', 'mode': 'offline'}
  )
  for step in (1, 2, 3):
    writer.write(
      step, {'reward/mean': 0.25 * step, 'actor/pg_loss': -step, 'eval/accuracy': float('nan')}
    )
  writer.close()
  jsonl = [{k: v for k, v in r.items() if v is not None} for r in metrics.read_jsonl(writer.path)]
  (run_dir,) = glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*'))
  assert _wandb_history(run_dir, len(jsonl)) == jsonl


def test_wandb_run_is_resumed_with_the_same_id(tmp_path, monkeypatch):
  monkeypatch.setenv('WANDB_SILENT', 'true')
  workdir = str(tmp_path / 'run')
  settings = {'project': 'jrl-test', 'mode': 'offline'}
  first = metrics.MetricsWriter(workdir, 4, tensorboard=False, wandb=settings)
  first.write(1, {'reward/mean': 1.0})
  first.close()
  run_id = open(os.path.join(workdir, 'wandb_id')).read()
  second = metrics.MetricsWriter(workdir, 4, resume_step=1, tensorboard=False, wandb=settings)
  second.write(2, {'reward/mean': 2.0})
  second.close()
  runs = sorted(glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*')))
  # Offline, the resumed run is a second directory of the same run id; each
  # holds the steps written in it.
  assert len(runs) == 2 and all(run_id in os.path.basename(r) for r in runs)
  histories = sorted((_wandb_history(r, 1) for r in runs), key=lambda h: h[0]['step'])
  assert histories == [[{'step': 1, 'reward/mean': 1.0}], [{'step': 2, 'reward/mean': 2.0}]]


def test_a_bad_wandb_mode_is_named(tmp_path):
  with pytest.raises(ValueError, match='wandb_mode'):
    metrics.MetricsWriter(str(tmp_path), 1, wandb={'project': 'p', 'mode': 'sometimes'})


def test_samples_go_to_console_jsonl_tensorboard_and_wandb(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv('WANDB_SILENT', 'true')
  workdir = str(tmp_path / 'run')
  writer = metrics.MetricsWriter(
    workdir, 2, tensorboard=True, wandb={'project': 'jrl-test', 'mode': 'offline'}
  )
  samples = [
    {'prompt': 'What is 2+2?', 'completion': 'It is | 4\nso 4', 'reward': 1.0, 'answer': '4'},
    {'prompt': 'What is 3+3?', 'completion': 'seven', 'reward': 0.0, 'answer': '6'},
    {'prompt': 'What is 1+1?', 'completion': 'two', 'reward': 0.0, 'answer': '2'},
  ]
  writer.write_samples(2, samples)
  writer.close()
  out = capsys.readouterr().out
  assert 'sample @ 2 (reward 1): It is | 4 so 4' in out and 'seven' in out
  assert 'two' not in out  # the first two only
  rows = metrics.read_jsonl(os.path.join(workdir, 'samples.jsonl'))
  assert rows == [{'step': 2, **x} for x in samples]
  events = glob.glob(os.path.join(workdir, 'tb', 'events.*'))
  assert events and b'samples' in open(events[0], 'rb').read()
  (run_dir,) = glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*'))
  (row,) = _wandb_history(run_dir, 1)
  assert row['step'] == 2 and row['samples/_type'] == 'table-file'
  assert (row['samples/nrows'], row['samples/ncols']) == (3, 4)


def test_the_null_writer_takes_what_the_writer_takes(tmp_path):
  """Processes other than 0 get a NullWriter: every call the controller makes
  on a MetricsWriter works on it and writes nothing."""
  public = {n for n in dir(metrics.MetricsWriter) if not n.startswith('_')}
  assert public <= set(dir(metrics.NullWriter))
  null = metrics.NullWriter()
  null.write(1, {'reward/mean': 1.0})
  null.write_samples(1, [{'prompt': 'p', 'completion': 'c', 'reward': 1.0}])
  null.close()
