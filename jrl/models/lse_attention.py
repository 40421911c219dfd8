"""Softmax attention whose backward stores O(T) per row, not [heads, T, S].

`lse_attention` computes what `jrl.models.attention.dot_attention` computes
(grouped kv heads, a boolean visibility mask, float32 scores, scale and
soft-cap, a uniform average for a query with no visible key) under a
`jax.custom_vjp` whose residuals are the inputs, the output and each query's
float32 log-sum-exp of its scores: per layer, [B, T, H] floats beside the
q / k / v / out the layer stores anyway. The backward recomputes the
probabilities from q, k and the log-sum-exp (one q·k product) and derives
the gradients from them, as flash attention's backward does (Dao et al.,
2022):

    P  = exp(S − lse)                   S: the scaled, soft-capped, masked scores
    dV = Pᵀ·dO        dP = dO·Vᵀ        D = rowsum(dO ∘ O)
    dS = P ∘ (dP − D), 0 where masked   (soft-cap: ∘ (1 − tanh²(S₀ / c)))
    dQ = scale·dS·K   dK = scale·dSᵀ·Q

Plain autodiff of `dot_attention` keeps the float32 probabilities of every
layer, [B, H, T, S], until the backward reaches it: on the CPU the update
then either recomputes every layer's forward (remat) or holds those
matrices in memory. Here the [H, T, S] matrices exist for one layer at a
time, in the forward and again in the backward.

`block_q` splits the queries into blocks computed one after another (the
largest transient is then [B, H, block_q, S]); None: one block.

Shapes: B batch, T queries, S keys, H query heads, K kv heads (H = K·G),
d head width.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jrl import precision

NEG_INF = -0.7 * float(np.finfo(np.float32).max)  # the mask value of dot_attention


def _scaled(raw, d, scale, softcap):
  """(scores, tanh of the soft-cap or None) from float32 q·k `raw`."""
  s = raw * np.float32(1 / np.sqrt(d) if scale is None else scale)
  if softcap is None:
    return s, None
  t = jnp.tanh(s / np.float32(softcap))
  return np.float32(softcap) * t, t


def _scores(q_BxTxKxGxd, k_BxSxKxd, allowed_BxTxS, scale, softcap):
  """Masked float32 scores [B, K, G, T, S] and the soft-cap's tanh (or None)."""
  d = q_BxTxKxGxd.shape[-1]
  raw = precision.einsum_f32('btkgd,bskd->bkgts', q_BxTxKxGxd, k_BxSxKxd)
  s, t = _scaled(raw, d, scale, softcap)
  return jnp.where(allowed_BxTxS[:, None, None], s, NEG_INF), t


def _forward_block(q, k, v, allowed, scale, softcap):
  """(out [B, t, K, G, d], lse [B, K, G, t]) of one block of queries: `lse`
  is the log-sum-exp of the scores less their maximum (which the backward
  recomputes)."""
  s, _ = _scores(q, k, allowed, scale, softcap)
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.exp(s - m)
  total = jnp.sum(e, axis=-1, keepdims=True)
  probs = (e / total).astype(v.dtype)
  out = jnp.einsum('bkgts,bskd->btkgd', probs, v)
  return out, jnp.log(total)[..., 0]


def _backward_block(q, k, v, allowed, out, lse, dout, scale, softcap):
  """(dq, dk, dv) of one block of queries, dk and dv in float32."""
  s, t = _scores(q, k, allowed, scale, softcap)
  # The row's maximum again (cheap beside the exp), so that a query with no
  # visible key (every score NEG_INF) gets its uniform weights back exactly.
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m - lse[..., None])  # float32 [B, K, G, t, S]
  f32 = jnp.float32
  dv = jnp.einsum('bkgts,btkgd->bskd', p.astype(dout.dtype), dout, preferred_element_type=f32)
  dp = precision.einsum_f32('btkgd,bskd->bkgts', dout, v)
  delta = jnp.einsum('btkgd,btkgd->bkgt', dout.astype(jnp.float32), out.astype(jnp.float32))
  ds = jnp.where(allowed[:, None, None], p * (dp - delta[..., None]), 0.0)
  if t is not None:
    ds = ds * (1 - t * t)
  ds = ds * np.float32(1 / np.sqrt(q.shape[-1]) if scale is None else scale)
  ds_c = ds.astype(q.dtype)
  dq = jnp.einsum('bkgts,bskd->btkgd', ds_c, k, preferred_element_type=jnp.float32)
  dk = jnp.einsum('bkgts,btkgd->bskd', ds_c, q, preferred_element_type=jnp.float32)
  return dq, dk, dv


def _blocks(x_BxTx, block_q):
  """[n, B, block_q, ...] of x split along its second axis."""
  b, t = x_BxTx.shape[:2]
  return jnp.moveaxis(x_BxTx.reshape(b, t // block_q, block_q, *x_BxTx.shape[2:]), 1, 0)


def _unblocks(x_nxBxbx):
  n, b, bq = x_nxBxbx.shape[:3]
  return jnp.moveaxis(x_nxBxbx, 0, 1).reshape(b, n * bq, *x_nxBxbx.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, allowed, scale, softcap, block_q):
  return _forward(q, k, v, allowed, scale, softcap, block_q)[0]


def _forward(q, k, v, allowed, scale, softcap, block_q):
  if block_q is None:
    return _forward_block(q, k, v, allowed, scale, softcap)

  def one(xs):
    return _forward_block(xs[0], k, v, xs[1], scale, softcap)

  out, lse = jax.lax.map(one, (_blocks(q, block_q), _blocks(allowed, block_q)))
  # lse blocks are [n, B, K, G, bq]: queries last.
  lse = jnp.moveaxis(lse, 0, 3).reshape(*lse.shape[1:4], -1)
  return _unblocks(out), lse


def _fwd(q, k, v, allowed, scale, softcap, block_q):
  out, lse = _forward(q, k, v, allowed, scale, softcap, block_q)
  return out, (q, k, v, allowed, out, lse)


def _bwd(scale, softcap, block_q, residuals, dout):
  q, k, v, allowed, out, lse = residuals
  if block_q is None:
    dq, dk, dv = _backward_block(q, k, v, allowed, out, lse, dout, scale, softcap)
  else:
    n = q.shape[1] // block_q
    lse_blocks = jnp.moveaxis(lse.reshape(*lse.shape[:3], n, block_q), 3, 0)

    def one(carry, xs):
      qb, ab, ob, lb, db = xs
      dq_b, dk_b, dv_b = _backward_block(qb, k, v, ab, ob, lb, db, scale, softcap)
      return (carry[0] + dk_b, carry[1] + dv_b), dq_b

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    xs = (_blocks(q, block_q), _blocks(allowed, block_q), _blocks(out, block_q), lse_blocks)
    (dk, dv), dq = jax.lax.scan(one, zeros, (*xs, _blocks(dout, block_q)))
    dq = _unblocks(dq)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_fwd, _bwd)


def lse_attention(
  q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, allowed_BxTxS, *, scale=None, softcap=None, block_q=None
):
  """`dot_attention`'s result, with the backward of the module docstring.

  Args:
    q_BxTxHxd, k_BxSxKxd, v_BxSxKxd: queries, keys, values (K divides H).
    allowed_BxTxS: bool, key s visible to query t.
    scale: score scale (None: 1 / sqrt(d)); softcap: c·tanh(s / c) (None: off).
    block_q: queries per block (must divide T; None: all at once).

  Returns:
    [B, T, H, d] in v's dtype.
  """
  b, t, h, d = q_BxTxHxd.shape
  kv = k_BxSxKxd.shape[2]
  if block_q is not None and (block_q < 1 or t % block_q):
    raise ValueError(f'block_q = {block_q} must divide the {t} queries.')
  if block_q == t:
    block_q = None
  q = q_BxTxHxd.reshape(b, t, kv, h // kv, d)
  out = _attention(q, k_BxSxKxd, v_BxSxKxd, allowed_BxTxS.astype(bool), scale, softcap, block_q)
  return out.reshape(b, t, h, d)
