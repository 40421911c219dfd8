"""Checkpoints with Orbax: asynchronous, atomic, the last N kept.

A checkpoint holds the train state pytree (parameters, optimiser state,
step, algorithm state) and a JSON `meta` dict (data-stream position, phase,
the config, anything small). Orbax writes each checkpoint into a temporary
directory and renames it when complete, so a run killed at any moment,
during a save included, leaves only complete checkpoints behind; the next
start restores the latest one.
"""

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores (state pytree, meta dict) pairs by step."""

  def __init__(self, directory, *, keep=3, async_save=True):
    if keep < 1:
      raise ValueError(f'`checkpoint.keep` must be >= 1, got {keep}.')
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save, create=True
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self):
    return self._manager.latest_step()

  def save(self, step, state, meta, *, force=False, behaviour=None):
    """Starts saving; returns at once when asynchronous.

    `behaviour`: optional parameters of a rollout in flight (one-step-off),
    saved beside the state so that a resumed run can regenerate it.
    """
    items = {'state': ocp.args.StandardSave(state), 'meta': ocp.args.JsonSave(meta)}
    if behaviour is not None:
      items['behaviour'] = ocp.args.StandardSave(behaviour)
    self._manager.save(int(step), args=ocp.args.Composite(**items), force=force)

  def restore(self, step, abstract_state):
    """(state, meta) of checkpoint `step`, laid out like `abstract_state`.

    Raises:
      FileNotFoundError / ValueError naming the checkpoint directory.
    """
    path = os.path.join(self.directory, str(step))
    if step not in self._manager.all_steps():
      raise FileNotFoundError(f'{path}: no such checkpoint (have {self._manager.all_steps()}).')
    try:
      restored = self._manager.restore(
        int(step),
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
        ),
      )
    except Exception as e:
      raise ValueError(f'{path}: cannot restore checkpoint ({type(e).__name__}: {e}).') from e
    return restored['state'], restored['meta']

  def restore_behaviour(self, step, abstract_params):
    """The `behaviour` parameters saved with checkpoint `step`."""
    path = os.path.join(self.directory, str(step))
    try:
      restored = self._manager.restore(
        int(step), args=ocp.args.Composite(behaviour=ocp.args.StandardRestore(abstract_params))
      )
    except Exception as e:
      raise ValueError(
        f'{path}: cannot restore the in-flight rollout parameters ({type(e).__name__}: {e}).'
      ) from e
    return restored['behaviour']

  def wait(self):
    self._manager.wait_until_finished()

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of a pytree of arrays."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, 'sharding', None)), tree
  )
