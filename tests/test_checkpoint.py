"""Tests for `jrl.checkpoint`: checksums, non-finite refusal and the fallback
to the newest intact step.

Small train states (a [64, 64] random matrix, a bias, an optax Adam state
after one update) are saved for steps 1, 2 and 3, then files of a step are
damaged on disk the way a bad disk or a partial copy would: 4 KiB of flipped
bytes, a truncated file, a deleted file; or their manifest is rewritten to
list fewer or other files, or a stray file is added. Steps without a
checksum manifest are refused unless allowed. The last test damages the latest checkpoint of a
shrunken real run (`configs/grpo_arith.py`, SFT only) and checks that the
restarted run resumes from the step before and ends where the uninterrupted
run ended.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

from jrl import checkpoint as ckpt_lib
from jrl import trainers
from jrl.trainers import common
from tests.helpers import QUIET, assert_trees_equal, shrunk_config

STEPS = (1, 2, 3)


def make_state(seed, nan_at=None):
  """A TrainState with params {'w': [64, 64], 'b': [64]} float32 and an Adam
  state after one update; `nan_at` ('mu' or 'nu') puts a NaN in that moment of 'w'."""
  key_w, key_g = jax.random.split(jax.random.key(seed))
  params = {'w': jax.random.normal(key_w, (64, 64)), 'b': jnp.full((64,), 0.1 * seed)}
  tx = optax.adam(1e-2)
  grads = jax.tree.map(lambda p: jax.random.normal(key_g, p.shape), params)
  updates, opt_state = tx.update(grads, tx.init(params), params)
  state = common.TrainState(
    jnp.int32(seed), optax.apply_updates(params, updates), opt_state, common.AlgorithmState()
  )
  if nan_at is not None:
    adam = state.opt_state[0]
    moment = getattr(adam, nan_at)
    moment = {**moment, 'w': moment['w'].at[3, 5].set(jnp.nan)}
    state = state._replace(opt_state=(adam._replace(**{nan_at: moment}), *state.opt_state[1:]))
  return state


def test_the_algorithm_state_is_saved_as_the_dict_it_was(tmp_path):
  """`AlgorithmState` keeps only its fields set, under their names: a
  checkpoint written when the train state's `extra` was a dict restores into
  it, and a new one reads back as that dict."""
  base = make_state(1)
  ref = {'w': jnp.full((3,), 2.0)}
  moments = (jnp.float32(4.0), jnp.float32(0.5), jnp.float32(1.5))
  as_dict = base._replace(extra={'ref_params': ref, 'reward_moments': moments})
  typed = base._replace(extra=common.AlgorithmState(ref_params=ref, reward_moments=moments))
  assert typed.extra.present() == ('ref_params', 'reward_moments')
  for step, written, target in ((1, as_dict, typed), (2, typed, as_dict)):
    checkpointer = ckpt_lib.Checkpointer(str(tmp_path), async_save=False)
    checkpointer.save(step, written, {'iteration': step})
    restored, _ = checkpointer.restore(step, ckpt_lib.abstract_like(target))
    checkpointer.close()
    assert type(restored.extra) is type(target.extra)
    assert_trees_equal(restored, target)


def save_steps(directory, states, *, async_save=True):
  checkpointer = ckpt_lib.Checkpointer(directory, async_save=async_save)
  for step, state in states.items():
    checkpointer.save(step, state, {'iteration': step})
  checkpointer.close()


@pytest.fixture
def saved(tmp_path):
  """(checkpoint directory, {step: state}) with steps 1, 2, 3 saved."""
  directory = str(tmp_path / 'checkpoints')
  states = {step: make_state(step) for step in STEPS}
  save_steps(directory, states)
  return directory, states


def data_file(directory, step):
  """Path (relative to the step directory) of the largest array data file of `step`."""
  step_dir = os.path.join(directory, str(step))
  files = [
    os.path.relpath(os.path.join(root, name), step_dir)
    for root, _, names in os.walk(os.path.join(step_dir, 'state'))
    for name in names
  ]
  rel = max(files, key=lambda f: os.path.getsize(os.path.join(step_dir, f)))
  assert os.path.getsize(os.path.join(step_dir, rel)) > 8192, 'expected a data file over 8 KiB'
  return rel


def damage(directory, step, how):
  """Damages the largest data file of `step`; returns its path relative to the step directory."""
  rel = data_file(directory, step)
  path = os.path.join(directory, str(step), rel)
  if how == 'flip':  # 4 KiB of flipped bytes, from 1 KiB in
    with open(path, 'r+b') as f:
      f.seek(1024)
      chunk = f.read(4096)
      f.seek(1024)
      f.write(bytes(b ^ 0xFF for b in chunk))
  elif how == 'truncate':
    os.truncate(path, os.path.getsize(path) // 2)
  elif how == 'delete':
    os.remove(path)
  else:
    raise ValueError(how)
  return rel


def restore_latest(directory, like, **kwargs):
  checkpointer = ckpt_lib.Checkpointer(directory, **kwargs)
  try:
    return checkpointer.restore_latest_intact(ckpt_lib.abstract_like(like))
  finally:
    checkpointer.close()


@pytest.mark.parametrize('async_save', [True, False])
def test_round_trip_is_bit_exact_and_every_step_is_checksummed(tmp_path, async_save):
  directory = str(tmp_path / 'checkpoints')
  states = {step: make_state(step) for step in STEPS}
  checkpointer = ckpt_lib.Checkpointer(directory, async_save=async_save)
  checkpointer.save(1, states[1], {'iteration': 1})
  checkpointer.save(2, states[2], {'iteration': 2})
  # Saving step 2 waited for step 1 and wrote its manifest.
  assert os.path.isfile(os.path.join(directory, '1', ckpt_lib.MANIFEST))
  checkpointer.save(3, states[3], {'iteration': 3})
  checkpointer.wait()
  for step in STEPS:
    assert checkpointer.verify(step) is True
    restored, meta = checkpointer.restore(step, ckpt_lib.abstract_like(states[step]))
    assert meta == {'iteration': step}
    assert_trees_equal(restored, states[step])
  checkpointer.close()
  assert sorted(os.listdir(directory), key=int) == ['1', '2', '3']
  # The manifest lists every file of its step: nothing was written after it,
  # by Orbax or by the restores.
  for step in STEPS:
    step_dir = os.path.join(directory, str(step))
    on_disk = {
      os.path.relpath(os.path.join(root, name), step_dir)
      for root, _, names in os.walk(step_dir)
      for name in names
    }
    assert set(read_manifest(directory, step)['files']) == on_disk - {ckpt_lib.MANIFEST}
    assert {'_CHECKPOINT_METADATA', 'commit_success.txt', 'state/commit_success.txt'} <= on_disk


def read_manifest(directory, step):
  with open(os.path.join(directory, str(step), ckpt_lib.MANIFEST)) as f:
    return json.load(f)


def rewrite_manifest(directory, step, edit):
  """Rewrites the manifest of `step` with `edit(files)` applied to its file entries."""
  manifest = read_manifest(directory, step)
  manifest['files'] = edit(manifest['files'])
  with open(os.path.join(directory, str(step), ckpt_lib.MANIFEST), 'w') as f:
    json.dump(manifest, f)


def empty_manifest(directory, step):
  rewrite_manifest(directory, step, lambda files: {})
  return '_CHECKPOINT_METADATA', 'is not listed in jrl_checksums.json (and '


def stray_file(directory, step):
  with open(os.path.join(directory, str(step), 'state', 'stray'), 'wb') as f:
    f.write(b'not written by Orbax')
  return 'state/stray', 'is not listed in jrl_checksums.json; the manifest must list'


def unlisted_data_file(directory, step):
  rel = data_file(directory, step)
  rewrite_manifest(directory, step, lambda files: {k: v for k, v in files.items() if k != rel})
  return rel, 'is not listed in jrl_checksums.json; the manifest must list'


def listed_missing_file(directory, step):
  entry = {'size': 4, 'sha256': '0' * 64}
  rewrite_manifest(directory, step, lambda files: {**files, 'state/d/ghost': entry})
  return 'state/d/ghost', 'is missing (listed in jrl_checksums.json).'


@pytest.mark.parametrize(
  'edit', [empty_manifest, stray_file, unlisted_data_file, listed_missing_file]
)
def test_a_manifest_must_list_exactly_the_files_of_its_step(saved, edit, capsys):
  """An emptied manifest, a file not listed (added to the step, or dropped from
  the manifest) and a listed file that is not there: the step is refused naming
  the step and the file, and the restore falls back to the step before."""
  directory, states = saved
  rel, problem = edit(directory, 3)
  checkpointer = ckpt_lib.Checkpointer(directory)
  with pytest.raises(ckpt_lib.CheckpointError) as info:
    checkpointer.verify(3)
  assert str(info.value).startswith(f'{directory}/3: file {rel} {problem}')
  assert checkpointer.verify(2) is True
  checkpointer.close()
  step, state, meta = restore_latest(directory, states[3])
  assert step == 2 and meta == {'iteration': 2}
  assert_trees_equal(state, states[2])
  out = capsys.readouterr().out
  assert f'checkpoint step 3 is damaged, skipping it: {directory}/3: file {rel} {problem}' in out
  assert sorted(os.listdir(directory), key=int) == ['1', '2']
  assert os.path.isdir(os.path.join(f'{directory}.damaged', '3'))


def test_a_torn_manifest_write_beside_the_manifest_is_not_a_stray_file(saved):
  """The temporary name the manifest is written under is jrl's own, not listed."""
  directory, states = saved
  step_dir = os.path.join(directory, '3')
  shutil.copy(
    os.path.join(step_dir, ckpt_lib.MANIFEST), os.path.join(step_dir, '.jrl_checksums.json.tmp')
  )
  assert restore_latest(directory, states[3])[0] == 3


@pytest.mark.parametrize('how', ['flip', 'truncate', 'delete'])
def test_damaged_latest_step_falls_back_to_the_previous_one(saved, how, capsys):
  directory, states = saved
  rel = damage(directory, 3, how)
  step, state, meta = restore_latest(directory, states[3])
  assert step == 2 and meta == {'iteration': 2}
  assert_trees_equal(state, states[2])
  out = capsys.readouterr().out
  assert 'checkpoint step 3 is damaged' in out
  assert f'{directory}/3: file {rel}' in out
  # The damaged step is set aside, so that the resumed run can save step 3 again.
  assert sorted(os.listdir(directory), key=int) == ['1', '2']
  assert os.path.isfile(os.path.join(f'{directory}.damaged', '3', rel)) == (how != 'delete')
  checkpointer = ckpt_lib.Checkpointer(directory)
  checkpointer.save(3, states[3], {'iteration': 3})
  checkpointer.close()
  assert restore_latest(directory, states[3])[0] == 3


def test_restoring_a_damaged_step_names_the_step_directory_and_the_file(saved):
  directory, states = saved
  rel = damage(directory, 3, 'flip')
  checkpointer = ckpt_lib.Checkpointer(directory)
  with pytest.raises(ckpt_lib.CheckpointError, match='SHA-256') as info:
    checkpointer.restore(3, ckpt_lib.abstract_like(states[3]))
  assert f'{directory}/3: file {rel}' in str(info.value)
  assert 'is damaged' in checkpointer.describe_latest() and rel in checkpointer.describe_latest()
  checkpointer.close()


def test_some_fields_restore_alone_verified(saved):
  directory, states = saved
  checkpointer = ckpt_lib.Checkpointer(directory)
  wanted = {'params': states[2].params, 'step': states[2].step}
  restored = checkpointer.restore_fields(2, ckpt_lib.abstract_like(wanted))
  assert set(restored) == {'params', 'step'}  # the optimiser state is not read
  assert_trees_equal(restored, wanted)
  with pytest.raises(FileNotFoundError, match=f'{directory}/7: no such checkpoint'):
    checkpointer.restore_fields(7, ckpt_lib.abstract_like(wanted))
  rel = damage(directory, 3, 'flip')
  with pytest.raises(ckpt_lib.CheckpointError, match='SHA-256') as info:
    checkpointer.restore_fields(3, ckpt_lib.abstract_like(wanted))
  assert f'{directory}/3: file {rel}' in str(info.value)
  checkpointer.close()


def test_a_saved_nan_is_refused_naming_the_leaf_and_the_step(tmp_path, capsys):
  directory = str(tmp_path / 'checkpoints')
  states = {1: make_state(1), 2: make_state(2), 3: make_state(3, nan_at='mu')}
  save_steps(directory, states)
  checkpointer = ckpt_lib.Checkpointer(directory)
  with pytest.raises(ValueError, match='non-finite') as info:
    checkpointer.restore(3, ckpt_lib.abstract_like(states[2]))
  assert isinstance(info.value, ckpt_lib.CheckpointError)
  assert checkpointer.verify(3)  # the files are as written: the values are the problem
  checkpointer.close()
  assert 'opt_state/0/mu/w' in str(info.value) and '(step 3)' in str(info.value)
  assert 'nu' not in str(info.value) and 'params' not in str(info.value)
  step, state, _ = restore_latest(directory, states[2])
  assert step == 2
  assert_trees_equal(state, states[2])
  assert 'opt_state/0/mu/w' in capsys.readouterr().out


def test_no_intact_step_raises_naming_the_directory_and_every_step(saved):
  directory, states = saved
  problems = {1: damage(directory, 1, 'delete'), 2: damage(directory, 2, 'flip')}
  problems[3] = damage(directory, 3, 'truncate')
  with pytest.raises(ckpt_lib.CheckpointError, match='no intact checkpoint') as info:
    restore_latest(directory, states[3])
  message = str(info.value)
  assert message.startswith(directory)
  for step, rel in problems.items():
    assert f'step {step}: {directory}/{step}: file {rel}' in message
  assert 'missing' in message and 'SHA-256' in message and 'bytes' in message
  # Nothing was moved: a person decides what to do with them.
  assert sorted(os.listdir(directory), key=int) == ['1', '2', '3']


def test_an_empty_directory_starts_fresh(tmp_path):
  assert restore_latest(str(tmp_path / 'checkpoints'), make_state(1)) == (None, None, None)


def save_without_checksums(directory, states):
  """Steps written the way jrl wrote them before checksums (no manifest)."""
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True))
  for step, state in states.items():
    items = {'state': ocp.args.StandardSave(state), 'meta': ocp.args.JsonSave({'iteration': step})}
    manager.save(step, args=ocp.args.Composite(**items))
  manager.close()


def test_a_step_without_checksums_is_refused_naming_the_step_and_the_switch(tmp_path):
  directory = str(tmp_path / 'checkpoints')
  states = {step: make_state(step) for step in STEPS}
  save_without_checksums(directory, states)
  checkpointer = ckpt_lib.Checkpointer(directory)
  assert checkpointer.verify(3) is False
  assert 'has no checksums' in checkpointer.describe_latest()
  with pytest.raises(ckpt_lib.UnverifiedCheckpointError) as info:
    checkpointer.restore(3, ckpt_lib.abstract_like(states[3]))
  assert str(info.value).startswith(f'{directory}/3: no checksum manifest')
  assert 'checkpoint.allow_unverified=True' in str(info.value)
  wanted = {'params': states[3].params}
  with pytest.raises(ckpt_lib.UnverifiedCheckpointError, match='allow_unverified'):
    checkpointer.restore_fields(3, ckpt_lib.abstract_like(wanted))
  checkpointer.close()
  # No step can be verified: nothing is restored, nothing is moved.
  with pytest.raises(ckpt_lib.CheckpointError, match='no intact checkpoint') as info:
    restore_latest(directory, states[3])
  for step in STEPS:
    assert f'step {step}: {directory}/{step}: no checksum manifest' in str(info.value)
  assert sorted(os.listdir(directory), key=int) == ['1', '2', '3']


def test_a_step_without_checksums_restores_when_allowed(tmp_path, capsys):
  directory = str(tmp_path / 'checkpoints')
  states = {step: make_state(step) for step in STEPS}
  save_without_checksums(directory, states)
  step, state, meta = restore_latest(directory, states[3], allow_unverified=True)
  assert step == 3 and meta == {'iteration': 3}
  assert_trees_equal(state, states[3])
  assert f'{directory}/3 has no checksums' in capsys.readouterr().out
  checkpointer = ckpt_lib.Checkpointer(directory, allow_unverified=True)
  restored = checkpointer.restore_fields(2, ckpt_lib.abstract_like({'params': states[2].params}))
  assert_trees_equal(restored, {'params': states[2].params})
  checkpointer.close()


def test_a_latest_step_that_lost_its_manifest_falls_back_to_a_verified_one(saved, capsys):
  """A run killed between the end of a save and its manifest: the step is not
  restored unverified; the restart resumes from the step before."""
  directory, states = saved
  os.remove(os.path.join(directory, '3', ckpt_lib.MANIFEST))
  step, state, meta = restore_latest(directory, states[3])
  assert step == 2 and meta == {'iteration': 2}
  assert_trees_equal(state, states[2])
  out = capsys.readouterr().out
  assert 'checkpoint step 3 has no checksums' in out and 'allow_unverified' in out
  assert sorted(os.listdir(directory), key=int) == ['1', '2']
  assert os.path.isdir(os.path.join(f'{directory}.damaged', '3'))


def test_the_run_resumes_from_the_step_before_a_damaged_latest_checkpoint(tmp_path, capsys):
  """A shrunken real job (3 SFT iterations, a checkpoint after each): damage the
  last checkpoint; the restart redoes iteration 3 from checkpoint 2 and ends
  with the same state as the uninterrupted run."""
  overrides = {**QUIET, 'sft.steps': 3, 'rl.steps': 0, 'checkpoint.every': 1}
  straight = tmp_path / 'straight'
  state = trainers.run(shrunk_config(straight, overrides))
  resumed = tmp_path / 'resumed'
  shutil.copytree(straight, resumed)
  ckdir = str(resumed / 'checkpoints')
  rel = damage(ckdir, 3, 'flip')
  capsys.readouterr()
  resumed_state = trainers.run(shrunk_config(resumed, overrides))
  out = capsys.readouterr().out
  assert 'checkpoint step 3 is damaged' in out and rel in out
  assert f'resumed from {ckdir}/2 (iteration 2)' in out
  assert_trees_equal(resumed_state, state)
  # The redone step 3 was saved afresh, with its checksums.
  checkpointer = ckpt_lib.Checkpointer(ckdir)
  assert checkpointer.latest_step() == 3 and checkpointer.verify(3)
  checkpointer.close()
