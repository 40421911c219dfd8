"""Checkpoints with Orbax: asynchronous, atomic, checksummed, the last N kept.

A checkpoint holds the train state pytree (parameters, optimiser state,
step, algorithm state) and a JSON `meta` dict (data-stream position, phase,
the config, anything small). Orbax writes each checkpoint into a temporary
directory and renames it when complete, so a run killed at any moment,
during a save included, leaves only complete checkpoints behind; the next
start restores the newest intact one.

Integrity. Atomic renames do not protect a checkpoint that is damaged after
it was written (a bad disk, a partial copy, a stray edit), so each step
directory gets a manifest, `<step>/jrl_checksums.json`: the size and SHA-256
of every other file in it.

* When. Saves are asynchronous: `save` returns while Orbax still writes in a
  background thread, and the step directory appears, complete, only at the
  end. The manifest is therefore written once Orbax reports the save
  finished: at the start of the next `save` (which waits for the previous one
  anyway), in `wait` and in `close`; with `async_save=False` right after the
  save. The files are hashed as they are on disk, after Orbax wrote its last
  byte, so the manifest describes exactly what a restore will read. A run
  killed between the end of a save and its manifest leaves a step without
  one; it is refused like a step from before checksums (below), and the
  restart resumes from the step before.
* Who. Only process 0 hashes and writes manifests (the step directory is
  shared by all processes); it writes to a temporary name and renames, so a
  manifest is whole or absent. On restore every process verifies the whole
  step directory itself, so all processes reach the same verdict and fall
  back to the same step without talking to each other (moving damaged steps
  aside, below, ends with a barrier). The price: process 0 reads every
  checkpoint back once after it is written (on the training thread, at the
  next save), and every process reads the one it restores once more.
* Verify. `restore` checks the manifest before handing the files to Orbax.
  The manifest must list every file of its step, exactly: a listed file that
  is missing, of another size or with another hash, and a file of the step
  that is not listed, each raise `CheckpointError` naming the step directory
  and the file (so a manifest emptied, or rewritten to list fewer files,
  does not pass). Only the manifest itself and its temporary name
  (`.jrl_checksums.json.tmp`) are left out. No other file needs to be: the
  manifest is written once Orbax's save has finished (its commit markers,
  `_CHECKPOINT_METADATA` and the `commit_success.txt` files, written and the
  temporary directory renamed to `<step>`), Orbax keeps its temporary
  directories beside the step directory, not in it, and restores only read.
  A step without a manifest (saved before checksums, or killed before its
  manifest) cannot be verified, so it is refused (`UnverifiedCheckpointError`,
  naming the step directory and the switch) unless the Checkpointer was made
  with `allow_unverified=True` (config `checkpoint.allow_unverified`); then
  it restores with a printed note.
* Values. Every floating-point leaf of the restored state is checked for NaN
  and infinity (a jitted reduction over the global arrays, so the answer is
  the same on every process); a non-finite leaf raises `CheckpointError`
  naming its path (`opt_state/0/mu/w`) and the step. The trainer never
  saves a non-finite state (non-finite updates are skipped), so one found on
  restore means damage.
* Fallback. `restore_latest_intact` tries steps newest first, prints a
  warning naming each damaged step and why, and returns the newest intact
  one; the damaged newer steps are moved to `<directory>.damaged/` (kept for
  a post-mortem; Orbax would otherwise refuse to save those steps again).
  When none is intact it raises, naming the directory and every step's
  problem, and moves nothing. An empty directory gives `(None, None, None)`:
  start fresh. A step without a manifest counts as not intact unless
  `allow_unverified`; then it is checked by Orbax's own reads only, which on
  several hosts may fail on some processes and not on others (the manifest
  rules that out).
"""

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

MANIFEST = 'jrl_checksums.json'
_MANIFEST_TMP = f'.{MANIFEST}.tmp'  # written, then renamed to MANIFEST
_FORMAT = 1
_CHUNK = 1 << 20  # bytes read at a time while hashing


class CheckpointError(ValueError):
  """A checkpoint that cannot be restored as saved: damaged files, values or layout."""


class UnverifiedCheckpointError(CheckpointError):
  """A checkpoint without a checksum manifest, refused (`allow_unverified` is off)."""


def _sha256(path):
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()


def _files(step_dir):
  """Paths of the files under `step_dir`, relative to it, sorted; the manifest excluded."""
  found = []
  for root, dirs, names in os.walk(step_dir):
    dirs.sort()
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if rel not in (MANIFEST, _MANIFEST_TMP):  # the manifest, or a torn write of it
        found.append(rel)
  return sorted(found)


def _more(rels):
  """' (and 2 more: a, b)' after the first of `rels`; '' for one."""
  if len(rels) == 1:
    return ''
  shown = ', '.join(rels[1:4]) + (', ...' if len(rels) > 4 else '')
  return f' (and {len(rels) - 1} more: {shown})'


def write_manifest(step_dir):
  """Writes `step_dir/jrl_checksums.json` (size and SHA-256 of every file), atomically."""
  files = {}
  for rel in _files(step_dir):
    path = os.path.join(step_dir, rel)
    files[rel] = {'size': os.path.getsize(path), 'sha256': _sha256(path)}
  manifest = {'format': _FORMAT, 'algorithm': 'sha256', 'files': files}
  tmp = os.path.join(step_dir, _MANIFEST_TMP)
  with open(tmp, 'w') as f:
    json.dump(manifest, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, MANIFEST))


def verify_manifest(step_dir):
  """Checks the files of `step_dir` against its manifest, which must list every one.

  Returns:
    True when the files of `step_dir` are exactly the listed ones and each
    matches; False when there is no manifest.
  Raises:
    CheckpointError naming `step_dir` and the first file that is missing,
    not listed, or does not match.
  """
  path = os.path.join(step_dir, MANIFEST)
  if not os.path.exists(path):
    return False
  try:
    with open(path) as f:
      manifest = json.load(f)
    files = manifest['files']
    if manifest.get('format') != _FORMAT or manifest.get('algorithm') != 'sha256':
      raise ValueError(f'unknown format {manifest.get("format")!r}')
    if not all(isinstance(v, dict) and {'size', 'sha256'} <= v.keys() for v in files.values()):
      raise ValueError('malformed file entries')
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f'{step_dir}: unreadable checksum manifest {MANIFEST} ({e}).') from e
  present = _files(step_dir)
  # Compared as sets of relative paths, so a listed path outside `step_dir`
  # is missing, never opened.
  missing = sorted(set(files) - set(present))
  if missing:
    raise CheckpointError(
      f'{step_dir}: file {missing[0]} is missing (listed in {MANIFEST}){_more(missing)}.'
    )
  unlisted = sorted(set(present) - set(files))
  if unlisted:
    raise CheckpointError(
      f'{step_dir}: file {unlisted[0]} is not listed in {MANIFEST}{_more(unlisted)}; the '
      'manifest must list every file of its step.'
    )
  for rel, expected in sorted(files.items()):
    file = os.path.join(step_dir, rel)
    size = os.path.getsize(file)
    if size != expected['size']:
      raise CheckpointError(
        f'{step_dir}: file {rel} has {size} bytes, {expected["size"]} were written.'
      )
    if _sha256(file) != expected['sha256']:
      raise CheckpointError(f'{step_dir}: file {rel} fails its SHA-256 checksum.')
  return True


def _leaf_name(path):
  """'opt_state/0/mu/w' for a key path."""
  parts = []
  for key in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return '/'.join(parts)


@jax.jit
def _finite_per_leaf(leaves):
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def check_finite(tree, where):
  """Raises CheckpointError naming the floating-point leaves of `tree` that hold NaN or inf."""
  named = [
    (_leaf_name(path), x)
    for path, x in jax.tree_util.tree_leaves_with_path(tree)
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  ]
  # One reduction per set of devices (a jitted call takes arrays on one set).
  groups = {}
  for name, x in named:
    devices = getattr(getattr(x, 'sharding', None), 'device_set', None)
    groups.setdefault(frozenset(devices or ()), []).append((name, x))
  bad = set()
  for group in groups.values():
    finite = np.asarray(_finite_per_leaf([x for _, x in group]))
    bad.update(name for (name, _), ok in zip(group, finite, strict=True) if not ok)
  if bad:
    names = ', '.join(name for name, _ in named if name in bad)
    raise CheckpointError(f'{where}: non-finite values (NaN or inf) in {names}.')


class Checkpointer:
  """Saves and restores (state pytree, meta dict) pairs by step."""

  def __init__(self, directory, *, keep=3, async_save=True, allow_unverified=False):
    """
    Args:
      directory: holds one directory per step.
      keep: checkpoints kept (`checkpoint.keep`).
      async_save: saves return while Orbax writes (`checkpoint.async_save`).
      allow_unverified: restore steps that have no checksum manifest, unverified
        (`checkpoint.allow_unverified`); refused otherwise.
    """
    if keep < 1:
      raise ValueError(f'`checkpoint.keep` must be >= 1, got {keep}.')
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save, create=True
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._async = async_save
    self.allow_unverified = bool(allow_unverified)
    self._unsealed = []  # steps saved by this process whose manifest is not written yet
    self._is_writer = jax.process_index() == 0

  def step_dir(self, step):
    return os.path.join(self.directory, str(int(step)))

  def latest_step(self):
    return self._manager.latest_step()

  def all_steps(self):
    return sorted(self._manager.all_steps())

  def save(self, step, state, meta, *, force=False, behaviour=None):
    """Starts saving; returns at once when asynchronous.

    `behaviour`: optional parameters of the rollouts in flight (one-step-off,
    async: {'v<version>': params}), saved beside the state so that a resumed
    run can regenerate them.
    """
    self._seal()  # the previous save is finished (Orbax would wait for it here too)
    items = {'state': ocp.args.StandardSave(state), 'meta': ocp.args.JsonSave(meta)}
    if behaviour is not None:
      items['behaviour'] = ocp.args.StandardSave(behaviour)
    if self._manager.save(int(step), args=ocp.args.Composite(**items), force=force):
      self._unsealed.append(int(step))
    if not self._async:
      self._seal()

  def _seal(self):
    """Waits for the save in flight, then writes the manifests still due (process 0)."""
    self._manager.wait_until_finished()
    steps, self._unsealed = self._unsealed, []
    if not self._is_writer:
      return
    for step in steps:
      step_dir = self.step_dir(step)
      # Skipped when Orbax has already deleted the step (`keep`) or found it failed.
      if os.path.isdir(step_dir) and not os.path.exists(os.path.join(step_dir, MANIFEST)):
        write_manifest(step_dir)

  def verify(self, step):
    """Checks the files of checkpoint `step` against their checksums.

    Returns:
      True if they match; False if the step has no manifest (saved before
      checksums, or the run stopped before writing it).
    Raises:
      CheckpointError naming the step directory and the file that does not match.
    """
    return verify_manifest(self.step_dir(step))

  def describe_latest(self):
    """One sentence on the newest checkpoint's files: verified, unverifiable or damaged.

    Call after `wait`, so that the last save has its manifest. The values are
    not read (that needs a restore); the trainer never saves non-finite ones.
    """
    step = self.latest_step()
    if step is None:
      return f'There is no checkpoint in {self.directory}.'
    path = self.step_dir(step)
    try:
      verified = self.verify(step)
    except CheckpointError as e:
      return f'The last checkpoint is damaged: {e} A restart resumes from the newest intact one.'
    if verified:
      return f'The last checkpoint, {path}, passes its checksums.'
    skipped = '' if self.allow_unverified else ' (a restart skips it: checkpoint.allow_unverified)'
    return f'The last checkpoint, {path}, has no checksums ({MANIFEST}) to verify{skipped}.'

  def _verify_or_refuse(self, step):
    """Verifies `step` before a restore; one without a manifest is refused
    unless `allow_unverified`."""
    path = self.step_dir(step)
    if self.verify(step):
      return
    if not self.allow_unverified:
      raise UnverifiedCheckpointError(
        f'{path}: no checksum manifest ({MANIFEST}), so its files cannot be verified (saved '
        'before checksums, or the run stopped before writing it); set '
        '`checkpoint.allow_unverified=True` (Checkpointer(allow_unverified=True)) to restore '
        'it unverified.'
      )
    if self._is_writer:
      print(
        f'note: {path} has no checksums ({MANIFEST}); restoring it unverified '
        '(checkpoint.allow_unverified).',
        flush=True,
      )

  def restore(self, step, abstract_state):
    """(state, meta) of checkpoint `step`, laid out like `abstract_state`.

    The files are verified against their checksums first (a step without
    them is refused unless `allow_unverified`) and the state's
    floating-point leaves must be finite (module docstring).

    Raises:
      FileNotFoundError naming the checkpoint directory when there is no such step;
      CheckpointError naming it (and the file or leaf) when it cannot be restored;
      UnverifiedCheckpointError naming it and the switch when it has no checksums.
    """
    path = self.step_dir(step)
    if step not in self._manager.all_steps():
      raise FileNotFoundError(f'{path}: no such checkpoint (have {self._manager.all_steps()}).')
    self._verify_or_refuse(step)
    try:
      restored = self._manager.restore(
        int(step),
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
        ),
      )
    except Exception as e:
      raise CheckpointError(f'{path}: cannot restore checkpoint ({type(e).__name__}: {e}).') from e
    check_finite(restored['state'], f'{path} (step {step}), state')
    return restored['state'], restored['meta']

  def restore_latest_intact(self, abstract_state):
    """(step, state, meta) of the newest checkpoint that restores intact.

    Damaged steps (and, unless `allow_unverified`, steps without checksums),
    newest first, are skipped with a printed warning naming the step and the
    cause, then moved to `<directory>.damaged/`.
    `(None, None, None)` when there is no checkpoint.

    Raises:
      CheckpointError naming the directory and each step's problem when no
      checkpoint is intact.
    """
    problems = []
    for step in reversed(self.all_steps()):
      try:
        state, meta = self.restore(step, abstract_state)
      except CheckpointError as e:
        problems.append((step, str(e)))
        if self._is_writer:
          why = 'has no checksums' if isinstance(e, UnverifiedCheckpointError) else 'is damaged'
          print(f'warning: checkpoint step {step} {why}, skipping it: {e}', flush=True)
        continue
      if problems:
        self._set_aside([s for s, _ in problems])
        if self._is_writer:
          skipped = ', '.join(str(s) for s, _ in problems)
          print(
            f'warning: falling back to checkpoint step {step}; the skipped steps {skipped} '
            f'were moved to {self.directory}.damaged/.',
            flush=True,
          )
      return step, state, meta
    if not problems:
      return None, None, None
    listing = '\n'.join(f'  step {step}: {problem}' for step, problem in problems)
    raise CheckpointError(f'{self.directory}: no intact checkpoint:\n{listing}')

  def _set_aside(self, steps):
    """Moves damaged step directories to `<directory>.damaged/` (kept for a
    post-mortem) so that the resumed run can save those steps again."""
    aside = f'{self.directory}.damaged'
    if self._is_writer:
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        target, n = os.path.join(aside, str(step)), 0
        while os.path.exists(target):
          n += 1
          target = os.path.join(aside, f'{step}.{n}')
        if os.path.isdir(self.step_dir(step)):
          os.rename(self.step_dir(step), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('jrl.checkpoint: damaged steps set aside')
    self._manager.reload()

  def restore_behaviour(self, step, abstract_params):
    """The `behaviour` parameters saved with checkpoint `step`, restored as
    `abstract_params` (a tree, or {'v<version>': tree})."""
    path = self.step_dir(step)
    try:
      restored = self._manager.restore(
        int(step), args=ocp.args.Composite(behaviour=ocp.args.StandardRestore(abstract_params))
      )
    except Exception as e:
      raise CheckpointError(
        f'{path}: cannot restore the in-flight rollout parameters ({type(e).__name__}: {e}).'
      ) from e
    check_finite(restored['behaviour'], f'{path} (step {step}), behaviour')
    return restored['behaviour']

  def restore_fields(self, step, abstract_fields):
    """Some fields of checkpoint `step`'s state, without the rest.

    Args:
      step: the checkpoint.
      abstract_fields: {field of the saved state (e.g. 'params', 'step'):
        its abstract tree (`abstract_like`), with the shardings to restore to}.
        The other fields (optimiser state, critic, ...) are not read.

    Returns:
      {field: restored tree}, verified like `restore` (checksums, finite values).

    Raises:
      FileNotFoundError naming the checkpoint directory when there is no such step;
      CheckpointError naming it when the fields cannot be restored as asked.
    """
    path = self.step_dir(step)
    if step not in self._manager.all_steps():
      raise FileNotFoundError(f'{path}: no such checkpoint (have {self._manager.all_steps()}).')
    self._verify_or_refuse(step)
    abstract = dict(abstract_fields)
    try:
      restored = self._manager.restore(
        int(step),
        args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(
            item=abstract,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True,
          )
        ),
      )
    except Exception as e:
      names = ', '.join(sorted(abstract))
      raise CheckpointError(
        f'{path}: cannot restore {names} of the state ({type(e).__name__}: {e}).'
      ) from e
    state = dict(restored['state'])
    check_finite(state, f'{path} (step {step}), state')
    return state

  def wait(self):
    """Blocks until pending saves are on disk with their checksums."""
    self._seal()

  def close(self):
    self._seal()
    self._manager.close()


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of a pytree of arrays."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, 'sharding', None)), tree
  )
