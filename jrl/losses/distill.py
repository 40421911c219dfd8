"""On-policy distillation: a teacher's per-token signal on the student's own samples.

The student samples y ~ π_s; each teacher π_k scores the sampled tokens.
With weights w_k (Σ w_k = 1), the per-token reward is the negative
single-sample estimate of the reverse KL to the teachers' weighted
log-probabilities,

  r_t = Σ_k w_k · log π_k(y_t | y_<t) − log π_s(y_t | y_<t)
      = −(log π_s − log π̄)_t,          log π̄ = Σ_k w_k log π_k

so that E_{y~π_s}[Σ_t r_t] = −KL(π_s ‖ π̄) for one teacher (Gu et al.
2024, "MiniLLM"; Agarwal et al. 2024, "On-policy distillation of language
models"; Thinking Machines 2025, "On-policy distillation"). With several
teachers π̄ is their weighted geometric mean (normalisation left out: it
is constant per position and does not change which tokens are preferred).

The advantage of token t is r_t itself (`discount` = 0, the per-token form
those reports train with), or the discounted reward to go
Σ_{s ≥ t} γ^(k(s) − k(t)) r_s over the response tokens (`discount` = γ > 0,
`discounted_returns`: environment tokens and padding are not time steps).
`clip` > 0 bounds |r_t| first, so that one token the teacher finds
impossible cannot dominate a batch. A policy-gradient loss with these
advantages (any of `jrl.losses.POLICY_LOSSES`) then lowers the reverse KL.

`student_logp` is what the student sampled with (the behaviour policy's
logprobs, or the proximal ones in an asynchronous run): the advantage is a
fixed number per token, like a reward's.
"""

import jax.numpy as jnp

from jrl.losses._checks import as_f32, check_rank, check_same_shape
from jrl.losses.advantages import discounted_returns, valid_token_mask


def teacher_mixture(teacher_logp_KxBxT, weights_K):
  """Σ_k w_k · teacher_logp[k]: [K, B, T] and [K] (summing to 1) -> [B, T]."""
  check_rank(teacher_logp_KxBxT, 3, 'teacher_logp', '[K, B, T]')
  w = jnp.asarray(weights_K, jnp.float32)
  if w.shape != (teacher_logp_KxBxT.shape[0],):
    raise ValueError(
      f'`weights` must be [K={teacher_logp_KxBxT.shape[0]}], one per teacher, got {w.shape}.'
    )
  return jnp.einsum('k,kbt->bt', w, as_f32(teacher_logp_KxBxT))


def reverse_kl_rewards(student_logp, teacher_logp, mask, *, clip=0.0, valid=None):
  """Per-token rewards r_t = teacher_logp − student_logp on the response.

  Args:
    student_logp: [B, T] log π_s of the sampled tokens.
    teacher_logp: [B, T] log π̄ of the same tokens (`teacher_mixture`).
    mask: [B, T] 0/1, the student's tokens (response, not prompt, padding
      or environment tokens).
    clip: > 0 bounds r_t to [−clip, clip]; 0 leaves it as is.
    valid: [B] bool rows that count (None: all); the others get 0.

  Returns:
    [B, T] float32, zero outside `mask` and on left-out rows.
  """
  check_rank(student_logp, 2, 'student_logp', '[B, T]')
  check_same_shape('student_logp', student_logp, teacher_logp=teacher_logp, mask=mask)
  if clip < 0:
    raise ValueError(f'`clip` must be >= 0, got {clip!r}.')
  r = as_f32(teacher_logp) - as_f32(student_logp)
  if clip:
    r = jnp.clip(r, -clip, clip)
  m = valid_token_mask(mask, valid)
  return jnp.where(jnp.asarray(m, bool), r, 0.0)


def distillation_advantages(
  student_logp, teacher_logp_KxBxT, weights_K, mask, *, clip=0.0, discount=0.0, valid=None
):
  """The on-policy distillation advantage of every sampled token (see the module).

  Args:
    student_logp: [B, T] the student's logprobs of its sampled tokens.
    teacher_logp_KxBxT: [K, B, T] each teacher's logprobs of the same tokens.
    weights_K: [K] the teachers' weights (summing to 1).
    mask: [B, T] 0/1 response mask (the tokens the student wrote).
    clip: bound on |r_t| (0: none).
    discount: γ in [0, 1]: 0 is the per-token reward, > 0 the discounted
      reward to go over the response.
    valid: [B] bool rows that count (None: all).

  Returns:
    [B, T] float32 advantages, zero outside `mask` and on left-out rows.
  """
  if not 0.0 <= discount <= 1.0:
    raise ValueError(f'`discount` must be in [0, 1], got {discount!r}.')
  teacher = teacher_mixture(teacher_logp_KxBxT, weights_K)
  r = reverse_kl_rewards(student_logp, teacher, mask, clip=clip, valid=valid)
  if not discount:
    return r
  return discounted_returns(r, valid_token_mask(mask, valid), gamma=discount)


def distillation_metrics(student_logp, teacher_logp, mask):
  """{'distill/reverse_kl': mean of student − teacher logp over `mask` (the
  single-sample reverse KL per token), 'distill/teacher_prob': the teacher's
  mean probability of the sampled token}, as [] float32 arrays.

  Args: student_logp, teacher_logp: [B, T]; mask: [B, T] 0/1 (or bool).
  """
  m = as_f32(mask)
  n = jnp.maximum(m.sum(), 1.0)
  diff = as_f32(student_logp) - as_f32(teacher_logp)
  return {
    'distill/reverse_kl': (diff * m).sum() / n,
    'distill/teacher_prob': (jnp.exp(as_f32(teacher_logp)) * m).sum() / n,
  }
