"""Routed experts: top-k routing, the experts' computation (dense einsum or
grouped `ragged_dot`), and the Switch-Transformer load-balancing loss. The
`MoE` layer that holds the weights is in `jrl/models/layers.py`.

Shapes: N token rows, D width, F expert MLP width, E experts, K experts per token.
"""

import jax
import jax.numpy as jnp


def mlp_activation(name, x):
  """The MLP activation: 'gelu_tanh' (Gemma) or SiLU."""
  if name == 'gelu_tanh':
    return jax.nn.gelu(x, approximate=True)
  return jax.nn.silu(x)


def route(router_logits_NxE, k, normalise):
  """Top-k routing: softmax over experts in float32, the k largest
  probabilities (renormalised to sum to 1 when `normalise`).

  Returns:
    (weights [N, k] float32, experts [N, k] int32).
  """
  # Router softmax in float32.
  probs_NxE = jax.nn.softmax(router_logits_NxE.astype(jnp.float32), axis=-1)
  weights_NxK, experts_NxK = jax.lax.top_k(probs_NxE, k)
  if normalise:
    weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
  return weights_NxK, experts_NxK.astype(jnp.int32)


def experts_dense(x_NxD, weights_NxK, experts_NxK, gate_ExDxF, up_ExDxF, down_ExFxD, activation):
  """Every expert on every token, combined with the routing weights (zero for
  the unselected ones). Exact; costs E/k times the routed FLOPs and an
  [E, N, F] activation, and shards over the expert axis as it stands (each
  device runs its experts on all tokens; one all-reduce combines them)."""
  e = gate_ExDxF.shape[0]
  n = x_NxD.shape[0]
  combine_NxE = jnp.zeros((n, e), weights_NxK.dtype)
  combine_NxE = combine_NxE.at[jnp.arange(n)[:, None], experts_NxK].add(weights_NxK)
  h_ExNxF = mlp_activation(activation, jnp.einsum('nd,edf->enf', x_NxD, gate_ExDxF))
  h_ExNxF = h_ExNxF * jnp.einsum('nd,edf->enf', x_NxD, up_ExDxF)
  y_ExNxD = jnp.einsum('enf,efd->end', h_ExNxF, down_ExFxD)
  return jnp.einsum('end,ne->nd', y_ExNxD, combine_NxE.astype(y_ExNxD.dtype))


def experts_ragged(x_NxD, weights_NxK, experts_NxK, gate_ExDxF, up_ExDxF, down_ExFxD, activation):
  """Dropless sorted dispatch: the N·k (token, expert) pairs are sorted by
  expert, each expert multiplies its contiguous rows (`jax.lax.ragged_dot`),
  and the weighted rows are added back to their tokens. Exact, and k/E of the
  dense FLOPs; memory is N·k rows of width F."""
  k = experts_NxK.shape[1]
  e = gate_ExDxF.shape[0]
  flat_M = experts_NxK.reshape(-1)  # M = N·k pairs, token-major
  order_M = jnp.argsort(flat_M, stable=True)
  token_M = order_M // k
  group_sizes_E = jnp.bincount(flat_M, length=e).astype(jnp.int32)
  x_MxD = jnp.take(x_NxD, token_M, axis=0)
  h_MxF = mlp_activation(activation, jax.lax.ragged_dot(x_MxD, gate_ExDxF, group_sizes_E))
  h_MxF = h_MxF * jax.lax.ragged_dot(x_MxD, up_ExDxF, group_sizes_E)
  y_MxD = jax.lax.ragged_dot(h_MxF, down_ExFxD, group_sizes_E)
  w_M = jnp.take(weights_NxK.reshape(-1), order_M).astype(y_MxD.dtype)
  return jnp.zeros_like(x_NxD).at[token_M].add(y_MxD * w_M[:, None])


def router_load_balancing_loss(router_logits, mask_BxT, num_experts, k):
  """Switch-Transformer auxiliary loss (Fedus et al., 2021, eqs. 4-6), over all
  MoE layers together:

      L_aux = E · Σ_e f_e · P_e,

  f_e the fraction of (token, top-k slot) assignments that go to expert e and
  P_e the mean router probability of e, both averaged over real tokens
  (mask) of every MoE layer at once. As Hugging Face's
  `load_balancing_loss_func` (Qwen3-MoE, Mixtral): f counts each token k
  times, so a perfectly balanced router gives k, not 1.

  Args:
    router_logits: list of [B·T, E] router logits, one per MoE layer.
    mask_BxT: real tokens.
    num_experts: E.
    k: experts per token.

  Returns:
    [] float32 (0 when there is no MoE layer).
  """
  if not router_logits:
    return jnp.zeros((), jnp.float32)
  m_N = mask_BxT.reshape(-1).astype(jnp.float32)
  counts_E = jnp.zeros(num_experts, jnp.float32)
  probs_E = jnp.zeros(num_experts, jnp.float32)
  for logits_NxE in router_logits:
    # Router softmax in float32.
    p_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    _, top_NxK = jax.lax.top_k(p_NxE, k)
    hits_NxE = jnp.sum(jax.nn.one_hot(top_NxK, num_experts, dtype=jnp.float32), axis=1)
    counts_E = counts_E + jnp.sum(hits_NxE * m_N[:, None], axis=0)
    probs_E = probs_E + jnp.sum(p_NxE * m_N[:, None], axis=0)
  rows = len(router_logits) * jnp.maximum(jnp.sum(m_N), 1.0)
  return num_experts * jnp.sum((counts_E / rows) * (probs_E / rows))
