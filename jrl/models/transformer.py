"""One decoder-only transformer for policy, reference, critic and reward model.

Llama 3, Qwen2 / Qwen2.5 / Qwen3, Qwen3-MoE, Mistral, Gemma 2 and Gemma 3
(text) share one set of layers (`jrl/models/layers.py`) whose variants are
fields of `ModelConfig`; this module assembles them (embedding, blocks,
final norm, tied or untied LM head with optional final logit soft-capping,
an optional scalar head `score` as in Hugging Face's
`*ForSequenceClassification` for critics and reward models).

The module tree is Flax NNX; everything outside `layers.py` and this file
uses the pure boundary `graphdef, params = create(config, key)` and functions
of `(graphdef, params, arrays)` (`hidden_states`, `logits`,
`next_token_logprobs`, `values`), which are safe to `jax.jit` with `graphdef`
static. Logits are float32; with float32 params and bfloat16 compute the
gradients are float32 (the cast's transpose). `hidden_states(...,
with_router_loss=True)` also returns the Switch-Transformer load-balancing
loss over all MoE layers (`router_load_balancing_loss`).

Training memory (fields of `ModelConfig`, used only by the full-sequence
forward, never by the sampler's cached calls): `remat` checkpoints each
block (`jax.checkpoint` with a policy from `REMAT_POLICY_FNS`), and
`scan_layers` runs the blocks in one `jax.lax.scan` over their parameters
stacked on the fly (the stored layout stays a list of layers; the price is
one stacked copy of the layer weights and of their gradients per step).

Shapes: B batch, T tokens, S keys, D width, H query heads, K kv heads,
d head width, V vocabulary, E experts, N = B·T token rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl import losses, precision
from jrl.models.attention import (
  causal_attention,
  positions_from_mask,
  positions_from_segments,
  segment_starts,
  shared_prompt_attention,
)
from jrl.models.config import ModelConfig
from jrl.models.layers import MLP, Attention, AttentionFn, Block, Dense, Embed, MoE, RMSNorm
from jrl.models.logical_axes import head_units, param_logical_axes
from jrl.models.moe import router_load_balancing_loss


class Transformer(nnx.Module):
  """Embedding, L blocks, final norm; an LM head unless tied or disabled, and
  an optional scalar head `score` [D, 1] for values and rewards."""

  def __init__(self, config: ModelConfig, *, rngs, lm_head=True, scalar_head=False):
    self.config = config
    self.embed = Embed(config, rngs=rngs)
    self.layers = nnx.List([Block(config, i, rngs=rngs) for i in range(config.num_layers)])
    self.final_norm = RMSNorm(config.width, config)
    untied = lm_head and not config.tie_embeddings
    self.lm_head = Dense(config.width, config.vocab_size, config, rngs=rngs) if untied else None
    self.score = Dense(config.width, 1, config, rngs=rngs) if scalar_head else None
    self.has_lm_head = lm_head

  def __call__(
    self, tokens_BxT, positions_BxT, attention, caches=None, *, return_router_logits=False
  ):
    """Final normed hidden states [B, T, D] (compute dtype) and the caches;
    with `return_router_logits` also the list of MoE router logits.

    Without caches (the training forward) the blocks run as `config.remat`
    and `config.scan_layers` say; with caches (the sampler) always one by one.
    """
    x = self.embed(tokens_BxT)
    cfg = self.config
    new_caches, router_logits = [], []
    if caches is None and cfg.scan_layers:
      x, router_logits = self._scan(x, positions_BxT, attention)
    elif caches is None and cfg.remat != 'none':
      for i, layer in enumerate(self.layers):
        graphdef, state = nnx.split(layer)
        x, r = _block_fn(graphdef, i, positions_BxT, attention, cfg.remat)(state, x)
        if r is not None:
          router_logits.append(r)
    else:
      for i, layer in enumerate(self.layers):
        x, c, r = layer(x, positions_BxT, attention, i, None if caches is None else caches[i])
        new_caches.append(c)
        if r is not None:
          router_logits.append(r)
    out = (self.final_norm(x), (None if caches is None else new_caches))
    return (*out, router_logits) if return_router_logits else out

  def _scan(self, x, positions_BxT, attention):
    """The blocks as one `jax.lax.scan` over their parameters stacked [L, ...].

    Every layer has the same structure and attention options (checked by
    ModelConfig), so layer 0's graph and index stand for all of them.
    """
    graphdef = nnx.graphdef(self.layers[0])
    states = []
    for i, layer in enumerate(self.layers):
      g, state = nnx.split(layer)
      if g != graphdef:
        raise ValueError(f'scan_layers: layer {i} differs in structure from layer 0.')
      states.append(state)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    block = _block_fn(graphdef, 0, positions_BxT, attention, self.config.remat, prevent_cse=False)
    x, routers = jax.lax.scan(lambda h, state: block(state, h), x, stacked)
    return x, ([] if routers is None else list(routers))

  def unembed(self):
    """[D, V] output projection in compute dtype (embedding transposed when tied)."""
    if not self.has_lm_head:
      raise ValueError('this model was built without an LM head (lm_head=False).')
    cd = self.config.compute_jnp_dtype
    if self.lm_head is None:
      return self.embed.embedding[...].T.astype(cd)
    return self.lm_head.kernel[...].astype(cd)

  def logits(self, hidden_NxD):
    """float32 logits [..., V] of final hidden states, soft-capped when the
    config says so (Gemma 2). The sampler and `logits` both use this."""
    # Logits in float32 (float32 accumulation of compute-dtype operands).
    z = precision.einsum_f32('...d,dv->...v', hidden_NxD, self.unembed())
    return softcap_logits(z.astype(jnp.float32), self.config.final_softcap)

  def scalar(self, hidden_BxTxD):
    """[B, T] float32 scalar head output."""
    if self.score is None:
      raise ValueError('this model was built without a scalar head (scalar_head=False).')
    # The head is tiny: float32 for values and rewards.
    kernel = self.score.kernel[...].astype(jnp.float32)
    return (hidden_BxTxD.astype(jnp.float32) @ kernel)[..., 0]


# What the backward pass may keep of a block (see config.REMAT_POLICIES).
REMAT_POLICY_FNS = {
  'full': jax.checkpoint_policies.nothing_saveable,
  'dots': jax.checkpoint_policies.checkpoint_dots,
  'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _block_fn(graphdef, layer, positions_BxT, attention, remat, prevent_cse=True):
  """`(block state, x) -> (x, router logits or None)` for one block of the
  training forward, wrapped in `jax.checkpoint` with the `remat` policy
  (unless 'none'): the backward pass then recomputes what the policy does
  not save, from the block's input."""

  def run(state, x_BxTxD):
    x_BxTxD, _, router_logits = nnx.merge(graphdef, state)(
      x_BxTxD, positions_BxT, attention, layer, None
    )
    return x_BxTxD, router_logits

  if remat == 'none':
    return run
  run = jax.checkpoint(run, policy=REMAT_POLICY_FNS[remat], prevent_cse=prevent_cse)
  if not prevent_cse:
    return run
  return _after_cotangent(run)


def _after_cotangent(fn):
  """`fn` whose recomputation in the backward pass waits for its output cotangent.

  Nothing in the data flow stops XLA from scheduling the recomputation of
  every checkpointed block at the start of the backward pass, where all
  their activations are alive at once and nothing is saved (XLA:CPU does
  this, and drops the optimisation barrier meant to prevent it). Adding
  0 · (one element of the cotangent) to the saved activations (not to the
  weights, which would be copied) makes each recomputation depend on the
  cotangent; XLA does not fold x·0 for floats. A non-finite cotangent makes
  them NaN, but then this block's gradients were not finite anyway.
  """

  weights = []  # per residual: whether it is a parameter of the block (set by `fwd`)

  @jax.custom_vjp
  def wrapped(state, x):
    return fn(state, x)

  def fwd(state, x):
    out, vjp_fn = jax.vjp(fn, state, x)
    param_ids = {id(leaf) for leaf in jax.tree.leaves(state)}
    weights[:] = [id(r) in param_ids for r in jax.tree.leaves(vjp_fn)]
    return out, vjp_fn

  def bwd(vjp_fn, cotangent):
    zero = jax.tree.leaves(cotangent)[0].reshape(-1)[0] * 0
    leaves, treedef = jax.tree.flatten(vjp_fn)
    # Activations only: the weights need no tie, and tying them would copy them.
    tied = [
      r + zero.astype(r.dtype) if not w and jnp.issubdtype(r.dtype, jnp.floating) else r
      for r, w in zip(leaves, weights, strict=True)
    ]
    return jax.tree.unflatten(treedef, tied)(cotangent)

  wrapped.defvjp(fwd, bwd)
  return wrapped


def softcap_logits(logits, cap):
  """c·tanh(logits / c) (identity when `cap` is None)."""
  if cap is None:
    return logits
  return np.float32(cap) * jnp.tanh(logits / np.float32(cap))


# The pure boundary -----------------------------------------------------------


def create(config, key, *, lm_head=True, scalar_head=False):
  """Randomly initialised model as `(graphdef, params)`.

  Args:
    config: ModelConfig.
    key: PRNG key.
    lm_head: build the LM head (policy and reference).
    scalar_head: build the scalar `score` head (critic, reward model).

  Returns:
    (graphdef, params) with params an `nnx.State` of arrays.
  """
  model = Transformer(config, rngs=_rngs(key), lm_head=lm_head, scalar_head=scalar_head)
  return nnx.split(model)


def _rngs(key):
  """Streams of `create`: `params` for the base weights, `lora` for adapters."""
  if isinstance(key, int):
    key = jax.random.key(key)
  return nnx.Rngs(params=key, lora=jax.random.fold_in(key, 0x10A))


def abstract(config, *, lm_head=True, scalar_head=False):
  """`(graphdef, params)` with `jax.ShapeDtypeStruct` leaves; allocates nothing."""
  model = nnx.eval_shape(
    lambda: Transformer(config, rngs=_rngs(0), lm_head=lm_head, scalar_head=scalar_head)
  )
  return nnx.split(model)


def _check_batch(tokens, mask, positions):
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f'`tokens` must be an int [B, T] array, got {tokens.dtype}{tokens.shape}.')
  if mask is not None and mask.shape != tokens.shape:
    raise ValueError(f'`mask` must have shape {tokens.shape}, got {mask.shape}.')
  if positions is not None and positions.shape != tokens.shape:
    raise ValueError(f'`positions` must have shape {tokens.shape}, got {positions.shape}.')


def hidden_states(
  graphdef,
  params,
  tokens,
  mask=None,
  positions=None,
  *,
  segment_ids=None,
  branches=None,
  with_router_loss=False,
):
  """Final normed hidden states for full sequences (training forward).

  Args:
    graphdef, params: from `create` / `abstract` / `jrl.models.hf.load`.
    tokens: [B, T] int.
    mask: [B, T] 1 on real tokens (None: all real, or `segment_ids` > 0).
      Left or right padding.
    positions: [B, T] int (None: `positions_from_mask(mask)`, or
      `positions_from_segments(segment_ids)`).
    segment_ids: [B, T] int, packed rows (`jrl.data.packing`): 1, 2, ... per
      sequence, 0 on padding; attention never crosses a segment.
    with_router_loss: also return `router_load_balancing_loss` over the
      MoE layers (0 for a dense model).

  Returns:
    [B, T, D] in compute dtype; with `with_router_loss` a pair
    (hidden, router_loss [] float32).
  """
  _check_batch(tokens, mask, positions)
  if segment_ids is not None and segment_ids.shape != tokens.shape:
    raise ValueError(f'`segment_ids` must have shape {tokens.shape}, got {segment_ids.shape}.')
  if branches is not None and positions is None:
    raise ValueError("`branches` (shared-prompt rows) needs the rows' `positions`.")
  if mask is None:
    mask = jnp.ones(tokens.shape, bool) if segment_ids is None else segment_ids > 0
  if positions is None:
    positions = (
      positions_from_mask(mask) if segment_ids is None else (positions_from_segments(segment_ids))
    )
  model = nnx.merge(graphdef, params)
  cfg = model.config
  if branches is None:
    attention = causal_attention(
      mask, positions, cfg, segment_ids, implementation=cfg.attention_impl
    )
  else:
    attention = shared_prompt_attention(
      mask, positions, branches, cfg, implementation=cfg.attention_impl
    )
  hidden, _, router_logits = model(tokens, positions, attention, return_router_logits=True)
  if not with_router_loss:
    return hidden
  aux = router_load_balancing_loss(router_logits, mask, cfg.num_experts, cfg.experts_per_token)
  return hidden, aux


def logits(graphdef, params, tokens, mask=None, positions=None):
  """[B, T, V] float32 logits (soft-capped when the config says so); position
  t scores token t + 1. Materialises the full logits: use
  `next_token_logprobs` for training."""
  hidden = hidden_states(graphdef, params, tokens, mask, positions)
  return nnx.merge(graphdef, params).logits(hidden)


def next_token_logprobs(
  graphdef,
  params,
  tokens,
  mask=None,
  positions=None,
  *,
  temperature=1.0,
  chunk_size=1024,
  with_entropy=False,
  with_router_loss=False,
  segment_ids=None,
):
  """log p(token_t | tokens_<t), aligned with the tokens.

  Entry [b, t] is the log-probability of `tokens[b, t]` given the tokens
  before it (0 at t = 0, which has no prediction); with `with_entropy` also
  the entropy of that predictive distribution. Computed in chunks from the
  hidden states with `jrl.losses.token_logprobs_from_hidden` (final logit
  soft-capping included), so the [B, T, V] float32 logits never exist.
  With `segment_ids` (packed rows, see `hidden_states`) each segment is its
  own sequence: 0 at its first token, nothing seen across its boundary.

  Returns:
    (logp [B, T] float32, entropy [B, T] float32 (zeros unless with_entropy)),
    and the router load-balancing loss [] float32 as a third element with
    `with_router_loss`.
  """
  hidden, aux = hidden_states(
    graphdef, params, tokens, mask, positions, segment_ids=segment_ids, with_router_loss=True
  )
  model = nnx.merge(graphdef, params)
  logp, ent = losses.token_logprobs_from_hidden(
    hidden[:, :-1],
    model.unembed(),
    tokens[:, 1:],
    temperature=temperature,
    chunk_size=chunk_size,
    with_entropy=with_entropy,
    softcap=model.config.final_softcap,
  )
  pad = ((0, 0), (1, 0))
  out = (jnp.pad(logp, pad), jnp.pad(ent, pad))
  if segment_ids is not None:
    # A segment's first token is predicted from the previous segment: no prediction.
    first = segment_starts(segment_ids)
    out = tuple(jnp.where(first, 0.0, x) for x in out)
  return (*out, aux) if with_router_loss else out


def logprobs_at(
  graphdef,
  params,
  hidden_RxLxD,
  index_BxW,
  targets_BxW,
  *,
  temperature=1.0,
  chunk_size=1024,
  with_entropy=False,
):
  """Logprobs (and entropies) of `targets` predicted by the hidden states at
  `index` (flat into R·L): the output projection and the float32 softmax run
  at those W positions per sequence only, never at the others (prompts,
  padding). Gradients reach each hidden state once per use (a shared
  prompt's last state once per completion).

  Returns:
    (logp [B, W] float32, entropy [B, W] float32).
  """
  r, length, d = hidden_RxLxD.shape
  hidden_BxWxD = hidden_RxLxD.reshape(r * length, d)[index_BxW]
  model = nnx.merge(graphdef, params)
  return losses.token_logprobs_from_hidden(
    hidden_BxWxD,
    model.unembed(),
    targets_BxW,
    temperature=temperature,
    chunk_size=chunk_size,
    with_entropy=with_entropy,
    softcap=model.config.final_softcap,
  )


def values(graphdef, params, tokens, mask=None, positions=None, *, segment_ids=None, branches=None):
  """[B, T] float32 scalar-head outputs (critic values per token)."""
  hidden = hidden_states(
    graphdef, params, tokens, mask, positions, segment_ids=segment_ids, branches=branches
  )
  return nnx.merge(graphdef, params).scalar(hidden)


def sequence_scores(graphdef, params, tokens, mask):
  """[B] float32 reward-model scores: the scalar head at each row's last real token."""
  v_BxT = values(graphdef, params, tokens, mask)
  t = mask.shape[1]
  last_B = t - 1 - jnp.argmax(mask.astype(bool)[:, ::-1], axis=-1)
  return jnp.take_along_axis(v_BxT, last_B[:, None], axis=-1)[:, 0]


def create_sharded(config, key, mesh, *, lm_head=True, scalar_head=False, rules=None):
  """Random init with every parameter created directly in its sharding.

  Returns:
    (graphdef, params) with params laid out on `mesh` by the logical rules.
  """
  from jrl import parallel

  graphdef, abstract_params = abstract(config, lm_head=lm_head, scalar_head=scalar_head)
  shardings = parallel.param_shardings(
    mesh, abstract_params, param_logical_axes, rules, units=head_units(config)
  )

  def init(k):
    return create(config, k, lm_head=lm_head, scalar_head=scalar_head)[1]

  params = jax.jit(init, out_shardings=shardings)(key)
  return graphdef, params


__all__ = [
  'MLP',
  'REMAT_POLICY_FNS',
  'Attention',
  'AttentionFn',
  'Block',
  'Dense',
  'Embed',
  'MoE',
  'RMSNorm',
  'Transformer',
  'abstract',
  'create',
  'create_sharded',
  'hidden_states',
  'logits',
  'logprobs_at',
  'next_token_logprobs',
  'sequence_scores',
  'softcap_logits',
  'values',
]
