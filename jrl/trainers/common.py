"""What every trainer shares: the train state, sequence batches (packing and
placement on the mesh), the minibatched forward, and the guarded optimiser
update that skips non-finite steps."""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jrl import distributed, models, parallel
from jrl.data import layouts, packing
from jrl.models import lora
from jrl.trainers import signals


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True)
class AlgorithmState:
  """What an algorithm keeps beside the policy, checkpointed with it; a
  field the algorithm does not use is None. As a pytree only the fields
  set are children, under their names: a checkpoint holds them as the dict
  {name: value} it always held, and restores into this type."""

  ref_params: Any = None  # the reference policy's parameters (KL, DPO)
  critic: Any = None  # PPO's critic: a TrainState of the value model
  kl_ctl: Any = None  # PPO's KL controller (losses.KLControllerState)
  reward_moments: Any = None  # `reward.normalize`'s running moments (rewards.shaping)

  def present(self):
    """The names of the fields set, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None)

  def replace(self, **fields):
    return dataclasses.replace(self, **fields)

  def tree_flatten_with_keys(self):
    names = self.present()
    return [(jax.tree_util.DictKey(n), getattr(self, n)) for n in names], names

  def tree_flatten(self):
    names = self.present()
    return [getattr(self, n) for n in names], names

  @classmethod
  def tree_unflatten(cls, names, children):
    return cls(**dict(zip(names, children, strict=True)))


class TrainState(NamedTuple):
  """Everything that changes during training and must be checkpointed."""

  step: jax.Array  # [] int32: optimiser updates applied (skipped ones not counted)
  params: Any  # model parameters (nnx.State)
  opt_state: Any  # optax state
  extra: AlgorithmState  # the algorithm's own state (reference, critic, KL controller, ...)


def init_state(params, tx, extra=None):
  extra = AlgorithmState() if extra is None else extra
  return TrainState(jnp.int32(0), params, tx.init(params), extra)


def place_on_mesh(tree, mesh):
  """Arrays already laid out on `mesh` stay; everything else (scalars such as
  step counters, single-device leaves) is replicated over it. A train state
  placed this way keeps one layout for its whole life: the jitted steps are
  compiled once and a restored checkpoint lands where the state was."""
  replicated = NamedSharding(mesh, PartitionSpec())

  def place(x):
    sharding = getattr(x, 'sharding', None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
      return x
    return jax.device_put(x, replicated)

  return jax.tree.map(place, tree)


class SequenceBatch(NamedTuple):
  """Prompt + response token rows, right-padded, [B, T]."""

  tokens: jax.Array  # [B, T] int32
  mask: jax.Array  # [B, T] bool: real tokens
  loss_mask: jax.Array  # [B, T] bool: response tokens (the ones trained on)
  packed: Any = None  # jrl.data.packing.PackedInputs of the rows (`train.packing`), else None


def pack_sequences(prompts, responses, length, pad_id=0):
  """Right-padded [B, T] rows of prompt + response token lists (T = `length`).

  Raises:
    ValueError naming the row if a sequence is longer than `length`.
  """
  b = len(prompts)
  tokens = np.full((b, length), pad_id, np.int32)
  mask = np.zeros((b, length), bool)
  loss_mask = np.zeros((b, length), bool)
  for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
    n, m = len(p), len(r)
    if n + m > length:
      raise ValueError(f'row {i}: prompt {n} + response {m} tokens exceed the length {length}.')
    tokens[i, :n] = p
    tokens[i, n : n + m] = r
    mask[i, : n + m] = True
    loss_mask[i, n : n + m] = True
  return SequenceBatch(tokens, mask, loss_mask)


def place(batch, sharding):
  """Host arrays that every process holds whole -> batch-sharded global arrays."""
  return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), batch)


def place_rows(batch, sharding, num_rows):
  """This process's rows of a batch -> global arrays of `num_rows` rows."""
  return jax.tree.map(lambda x: distributed.put_rows(x, sharding, num_rows), batch)


# Packed forward passes -------------------------------------------------------


def token_logprobs(
  graphdef,
  params,
  tokens,
  mask,
  packed=None,
  *,
  temperature=1.0,
  chunk_size=1024,
  with_entropy=False,
  with_router_loss=False,
):
  """(logp, entropy), each [B, T] float32, of a right-padded batch, and the
  MoE router load-balancing loss [] over its real tokens as a third element
  with `with_router_loss` (0 for a dense model).

  With `packed` (`jrl.data.packing.PackedInputs` of this batch, on the
  device: padded, packed or shared-prompt rows, `jrl.data.layouts`) the
  model runs on its rows and the results come back to the [B, T] layout:
  the same values as the padded forward (to float summation order), so
  every loss and aggregation after it is unchanged. With its window
  (`layouts.with_window`) the vocabulary projection runs at the window's
  positions only, and logp and entropy are 0 elsewhere (prompts, padding).
  """
  if packed is None:
    return models.next_token_logprobs(
      graphdef,
      params,
      tokens,
      mask,
      temperature=temperature,
      chunk_size=chunk_size,
      with_entropy=with_entropy,
      with_router_loss=with_router_loss,
    )
  if packed.window_index is None:
    logp_RxL, ent_RxL, *aux = models.next_token_logprobs(
      graphdef,
      params,
      packed.tokens,
      positions=packed.positions,
      segment_ids=packed.segment_ids,
      temperature=temperature,
      chunk_size=chunk_size,
      with_entropy=with_entropy,
      with_router_loss=with_router_loss,
    )
    unpack = lambda x: packing.unpack_on_device(x, packed.index, packed.valid)
    return (unpack(logp_RxL), unpack(ent_RxL), *aux)
  hidden_RxLxD, aux = models.hidden_states(
    graphdef,
    params,
    packed.tokens,
    positions=packed.positions,
    segment_ids=packed.segment_ids,
    branches=packed.branches,
    with_router_loss=True,
  )
  t = tokens.shape[1]
  w = packed.window_index.shape[1]
  cols_BxW = packed.window_start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
  targets_BxW = jnp.take_along_axis(tokens, jnp.clip(cols_BxW, 0, t - 1), axis=1)
  logp_BxW, ent_BxW = models.logprobs_at(
    graphdef,
    params,
    hidden_RxLxD,
    packed.window_index,
    targets_BxW,
    temperature=temperature,
    chunk_size=chunk_size,
    with_entropy=with_entropy,
  )
  back = lambda x: from_window(x, packed.window_start, packed.window_valid, t)
  out = (back(logp_BxW), back(ent_BxW))
  return (*out, aux) if with_router_loss else out


def from_window(x_BxW, start_B, valid_BxW, length):
  """[B, W] values of each sequence's window (columns start_b + w) -> the
  [B, T] layout, 0 outside the valid window; differentiable (a gather)."""
  w = x_BxW.shape[1]
  x_BxW = jnp.where(valid_BxW, x_BxW, 0.0)
  col_BxT = jnp.arange(length, dtype=jnp.int32)[None, :] - start_B[:, None]
  inside = (col_BxT >= 0) & (col_BxT < w)
  picked = jnp.take_along_axis(x_BxW, jnp.clip(col_BxT, 0, w - 1), axis=1)
  return jnp.where(inside, picked, 0.0)


def predecessor_values(v_RxL, packed):
  """[B, T]: entry t is the per-token value of the rows at sequence b's token
  t − 1 (0 at t = 0 and off the sequence), through `packed.index`: the
  value of the prefix before token t (a critic's V_t) in any layout."""
  index = jnp.pad(packed.index[:, :-1], ((0, 0), (1, 0)))
  first = jnp.arange(packed.index.shape[1])[None, :] == 0
  ok = packed.valid & ~first
  return jnp.where(ok, v_RxL.reshape(-1)[index], 0.0)


def with_packed(batch, packer):
  """`batch` (placed on the mesh, with a `packed` field) laid out for the
  model by `packer` (a list of micro-batches when it has a token budget),
  with its logprob window when the batch has a `loss_mask`; unchanged when
  `packer` is None."""
  if packer is None:
    return batch
  loss_mask = getattr(batch, 'loss_mask', None)
  return batch._replace(
    packed=packer.for_step(
      distributed.fetch(batch.tokens),
      distributed.fetch(batch.mask),
      None if loss_mask is None else distributed.fetch(loss_mask),
    )
  )


def held_mask(loss_mask_BxT, packed):
  """(held, the loss mask of the tokens held): with a micro-batch's `packed`
  held is its [B, 1] `select` and the mask is cut to it; without packing (or
  one packed batch's rows) held is None and the mask is unchanged."""
  if packed is None:
    return None, loss_mask_BxT
  held = packed.select[:, None]
  return held, loss_mask_BxT & held


def only_held(x_BxT, held, fill=0.0):
  """`x` on the sequences held (`held_mask`), `fill` on the others."""
  return x_BxT if held is None else jnp.where(held, x_BxT, fill)


LAYOUTS = ('padded', 'packed', 'shared_prompt')


class Packer:
  """Lays minibatches out for the model (`jrl.data.layouts`), placed with
  `sharding`, row counts a multiple of the batch shards:

  * 'padded': a row per sequence, cut to the minibatch's longest;
  * 'packed' (`train.packing`): sequences end to end in rows of `row_len`;
  * 'shared_prompt' (`train.shared_prompt`): a row per prompt, its
    completions as branches that each see the prompt once computed.

  With a token budget (`train.micro_batch_tokens` per batch shard, 0: none)
  `split` cuts a minibatch into micro-batches of at most that many tokens
  per shard. With a loss mask each part gets its logprob window
  (`layouts.with_window`). `last` keeps the padded and laid-out token
  efficiency of the last batch."""

  def __init__(self, row_len, sharding, budget=0, kind='packed'):
    if kind not in LAYOUTS:
      raise ValueError(f'layout must be one of {LAYOUTS}, got {kind!r}.')
    self.kind = kind
    self.row_len = int(row_len)
    self.sharding = sharding
    self.multiple = batch_shards(sharding)
    self.budget = int(budget)
    self.last = (1.0, 1.0)

  def _place(self, host):
    return jax.tree.map(lambda x: place_global(x, self.sharding), host)

  def parts(self, tokens_BxT, mask_BxT, loss_mask_BxT=None):
    """Host PackedInputs of a minibatch: its micro-batches (one without a budget)."""
    if self.kind == 'padded':
      hosts = layouts.padded(tokens_BxT, mask_BxT, self.budget, self.multiple)
    elif self.kind == 'shared_prompt':
      if loss_mask_BxT is None:
        raise ValueError('the shared-prompt layout needs the loss mask (where prompts end).')
      hosts = layouts.shared_prompt(tokens_BxT, mask_BxT, loss_mask_BxT, self.budget, self.multiple)
    elif self.budget:
      hosts = packing.micro_batches(tokens_BxT, mask_BxT, self.row_len, self.budget, self.multiple)
    else:
      hosts = [packing.pack_padded(tokens_BxT, mask_BxT, self.row_len, self.multiple)]
    if loss_mask_BxT is not None:
      hosts = [layouts.with_window(h, tokens_BxT, loss_mask_BxT) for h in hosts]
    self.last = packing.efficiency(mask_BxT, hosts)
    return hosts

  def __call__(self, tokens_BxT, mask_BxT, loss_mask_BxT=None):
    """PackedInputs on the device of every sequence (no budget: one part)."""
    hosts = self.parts(tokens_BxT, mask_BxT, loss_mask_BxT)
    if len(hosts) != 1:
      raise ValueError('a Packer with a token budget gives micro-batches: call `split`.')
    return self._place(hosts[0])

  def for_step(self, tokens_BxT, mask_BxT, loss_mask_BxT=None):
    """What a step takes: the micro-batches (`split`) with a token budget,
    else the whole batch's PackedInputs."""
    if self.budget:
      return self.split(tokens_BxT, mask_BxT, loss_mask_BxT)
    return self(tokens_BxT, mask_BxT, loss_mask_BxT)

  def split(self, tokens_BxT, mask_BxT, loss_mask_BxT=None):
    """A list of PackedInputs on the device: micro-batches of the token
    budget when there is one, else the whole batch as one."""
    return [self._place(h) for h in self.parts(tokens_BxT, mask_BxT, loss_mask_BxT)]


def batch_shards(sharding):
  """How many ways `sharding` splits an array's leading axis (1 if it does not)."""
  if not isinstance(sharding, NamedSharding) or not sharding.spec:
    return 1
  axes = sharding.spec[0]
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return int(np.prod([sharding.mesh.shape[a] for a in axes]))


def place_global(x, sharding):
  """A host array that every process holds whole, laid out with `sharding`
  (one process or several)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def layout_kind(train):
  """The layout a `train` section asks for: 'packed' (`packing`),
  'shared_prompt' (`shared_prompt`, where the section has it), else 'padded'."""
  if train.packing:
    return 'packed'
  return 'shared_prompt' if train.get('shared_prompt', False) else 'padded'


def make_packer(train, seq_len, sharding, kind=None):
  """The Packer of a `train` section: the layout of `layout_kind(train)`
  (or `kind`), rows of `train.pack_row_len` tokens when packed (0:
  `seq_len`), micro-batches of `train.micro_batch_tokens`."""
  kind = layout_kind(train) if kind is None else kind
  row_len = int(train.pack_row_len) or int(seq_len)
  if kind == 'packed' and row_len < seq_len:
    raise ValueError(
      f'`train.pack_row_len` ({row_len}) must be at least the longest sequence, '
      f'max_prompt_len + max_response_len = {seq_len}.'
    )
  budget = int(train.micro_batch_tokens)
  if kind == 'packed' and budget and budget < row_len:
    raise ValueError(
      f'`train.micro_batch_tokens` ({budget}) must be 0 or at least a packed row, {row_len} tokens.'
    )
  return Packer(row_len, sharding, budget, kind)


def with_packer(fn, packer):
  """`fn(params, tokens, mask, packed)` as (params, tokens, mask, loss_mask=None)
  -> result, on the rows of `packer` (`make_packer`; with a loss mask, logprobs
  at its window only), or on the padded rows when `packer` is None. With a
  token budget the result is the sum over micro-batches: `fn` gives 0 at the
  positions of sequences a micro-batch does not hold (as `token_logprobs`
  does), so the sum is the whole batch's result."""
  if packer is None:
    return lambda params, tokens, mask, loss_mask=None: fn(params, tokens, mask)

  def run(params, tokens, mask, loss_mask=None):
    host_loss = None if loss_mask is None else distributed.fetch(loss_mask)
    parts = packer.split(distributed.fetch(tokens), distributed.fetch(mask), host_loss)
    out = fn(params, tokens, mask, parts[0])
    for p in parts[1:]:
      out = out + fn(params, tokens, mask, p)
    return out

  return run


class MicroBatchedStep:
  """One optimiser step over the micro-batches of a minibatch (`batch.packed`
  a list of PackedInputs, from `Packer.split`): the losses and gradients of
  the micro-batches are summed (each is its share of the minibatch's, see
  `policy_step.policy_loss`), then one update is applied, so the result is
  that of the whole minibatch at once (to float summation order).

  Args:
    loss_and_grads: jitted (state, batch) -> (loss, metrics, grads); loss
      and grads may be pytrees (several models).
    apply_update: jitted (state, grads, loss, metrics) -> (state, metrics).
    additive: metric keys that add up over micro-batches; `share_key` (a
      metric of each micro-batch, its share of the minibatch's tokens)
      weighs the others, and keys with '_max' take the largest.
  """

  def __init__(self, loss_and_grads, apply_update, additive, share_key):
    self.loss_and_grads = loss_and_grads
    self.apply_update = apply_update
    self.additive = tuple(additive)
    self.share_key = share_key
    self.add = jax.jit(lambda acc, g: jax.tree.map(jnp.add, acc, g), donate_argnums=(0,))

  def __call__(self, state, batch):
    grads, losses, parts = None, [], []
    for packed in batch.packed:
      loss, metrics, g = self.loss_and_grads(state, batch._replace(packed=packed))
      grads = g if grads is None else self.add(grads, g)
      losses.append(loss)
      parts.append(metrics)
    loss = losses[0]
    for x in losses[1:]:
      loss = jax.tree.map(jnp.add, loss, x)
    state, metrics = self.apply_update(state, grads, loss, {})
    return state, {**self.combine(jax.device_get(parts)), **metrics}

  def combine(self, parts):
    """One metrics dict from the micro-batches' (host values)."""
    share = [float(p[self.share_key]) for p in parts]
    out = {}
    for k in parts[0]:
      if k == self.share_key:
        continue
      v = [float(p[k]) for p in parts]
      if k in self.additive:
        out[k] = float(np.sum(v))
      elif '_max' in k:
        out[k] = float(np.max(v))
      else:
        out[k] = float(np.dot(share, v))
    return out


def minibatched(fn, params, batch, rows, sharding):
  """`fn(params, tokens, mask, loss_mask)` over consecutive slices of `rows`
  rows of a [B, T] batch, concatenated and laid out with `sharding` (the
  forward passes of reference logprobs, proximal logprobs and critic values)."""
  out = []
  fields = (batch.tokens, batch.mask, batch.loss_mask)
  for k in range(0, batch.tokens.shape[0], rows):
    part = [distributed.settle(x[k : k + rows]) for x in fields]
    out.append(distributed.settle(fn(params, *part)))
  return distributed.settle(jax.device_put(jnp.concatenate(out), sharding))


def trained_grads(grads):
  """The gradients an update applies, as a list: with LoRA adapters in the
  tree only theirs (`setup.optimizer` freezes the base), else all."""
  leaves = jax.tree_util.tree_leaves_with_path(grads)
  adapters = [g for path, g in leaves if lora.is_adapter(path)]
  return adapters or [g for _, g in leaves]


def apply_gradients(
  state, grads, loss, tx, schedule, params_key='params', opt_key='opt_state', accum=1
):
  """The optimiser update, skipped when the loss or the gradient is not finite.

  `accum` is the gradient-accumulation factor (the schedule counts updates,
  `state.step` counts train steps).

  Returns:
    (new_state, metrics) with `grad_norm`, `lr`, `nonfinite_loss` (1.0 when
    the loss was not finite) and `nonfinite` (1.0 when the
    update was skipped: parameters and optimiser state are left unchanged).
    With LoRA adapters in the tree, `grad_norm` (and the finiteness check) is
    over the adapters' gradients, the only ones the optimiser applies.
  """
  params, opt_state = getattr(state, params_key), getattr(state, opt_key)
  grad_norm = optax.tree.norm(trained_grads(grads))
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  # Zero non-finite gradients so the (discarded) update is computed on finite values.
  grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
  updates, new_opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  state = state._replace(
    **{params_key: keep(new_params, params), opt_key: keep(new_opt_state, opt_state)}
  )
  metrics = {
    'grad_norm': grad_norm,
    'lr': schedule(state.step // accum),
    signals.NONFINITE: 1.0 - finite.astype(jnp.float32),
    signals.NONFINITE_LOSS: 1.0 - jnp.isfinite(loss).astype(jnp.float32),
  }
  return state._replace(step=state.step + finite.astype(jnp.int32)), metrics


def with_remat(graphdef, params, remat):
  """The graph of the same model with the training forward's remat policy
  `remat` (the model config is static in the graph)."""
  model = nnx.merge(graphdef, params)
  if model.config.remat == remat:
    return graphdef
  model.config = model.config.replace(remat=remat)
  return nnx.graphdef(model)


class Update(NamedTuple):
  """An algorithm's update step before it is jitted: its pure functions and
  what they are bound to. `jit` makes the step; the memory plan compiles
  candidates of it (`memory_plan.plan_update`) before the run's is made.

  The step takes (state, minibatch) and returns (state, metrics): one
  program `train_step(state, batch, **model, **optim)`, or with a token
  budget a MicroBatchedStep of `loss_and_grads(state, batch, **model)` per
  micro-batch and `apply_update(state, grads, losses, metrics, **optim)`
  once. The state is donated and the new one laid out as `shardings`; the
  step is traced under `mesh` (`parallel.on_mesh`).
  """

  fns: tuple  # (train_step, loss_and_grads, apply_update)
  model: dict  # the forward's keyword arguments (graphdefs, the step's config)
  optim: dict  # the optimiser's keyword arguments (tx, schedule, ...)
  shardings: Any  # the new state's layout (setup.step_shardings)
  mesh: Any  # the training mesh
  models: dict  # {keyword of a graphdef in `model`: its params}: the models `remat` applies to
  additive: tuple  # metrics that add up over micro-batches (MicroBatchedStep)
  token_share: str  # the micro-batch's share of the minibatch's tokens (a metric)
  compiler_options: Any = None  # XLA options of its programs (`train.xla_flags`)

  def jit(self, budget=0, remat=None):
    """The jitted step, over micro-batches of `budget` tokens (0: the whole
    minibatch), its forwards with the remat policy `remat` (None: the models' own)."""
    train_step, loss_and_grads, apply_update = self.fns
    model = dict(self.model)
    if remat is not None:
      for key, params in self.models.items():
        model[key] = with_remat(model[key], params, remat)
    if budget:
      step = MicroBatchedStep(
        jax.jit(functools.partial(loss_and_grads, **model), compiler_options=self.compiler_options),
        jax.jit(
          functools.partial(apply_update, **self.optim),
          donate_argnums=(0,),
          out_shardings=self.shardings,
          compiler_options=self.compiler_options,
        ),
        self.additive,
        self.token_share,
      )
    else:
      step = jax.jit(
        functools.partial(train_step, **model, **self.optim),
        donate_argnums=(0,),
        out_shardings=self.shardings,
        compiler_options=self.compiler_options,
      )
    return parallel.on_mesh(self.mesh, step)  # attention kernels per shard
