"""Mixed-precision matmuls: float32 results from low-precision operands, with
the backward matmuls in the operands' precision.

`einsum_f32(spec, a, b)` is `jnp.einsum(spec, a, b)` accumulated and returned
in float32 (`preferred_element_type=float32`), for products that feed a
softmax: attention scores and logits. Plain autodiff of that would multiply
the float32 cotangent by a bfloat16 operand, which XLA runs as a float32
matmul (and a float32 copy of the operand). Here the backward pass casts the
cotangent to the operands' dtype first, as flash attention does with its
dS, so that with bfloat16 compute every matmul of forward and backward reads
bfloat16 operands while the softmax sees float32 logits. With float32
operands it is exactly `jnp.einsum`.
"""

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_f32(spec, a, b):
  """float32 `jnp.einsum(spec, a, b)`; its gradients in a's and b's dtypes."""
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _fwd(spec, a, b):
  return einsum_f32(spec, a, b), (a, b)


def _bwd(spec, residuals, cotangent):
  a, b = residuals
  _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a, b)
  # The cotangent in the operands' precision: bfloat16 matmuls backwards too.
  return vjp(cotangent.astype(jnp.result_type(a, b)))


einsum_f32.defvjp(_fwd, _bwd)
