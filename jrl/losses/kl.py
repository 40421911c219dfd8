"""KL estimators between the policy and a reference, and the adaptive KL controller.

With samples y ~ π (the policy) and the per-token log-ratio
x_t = logp_t − ref_logp_t (log π/π_ref), the estimators of KL(π ‖ π_ref)
from Schulman (2020), "Approximating KL divergence":

| estimator            | per-token value       | unbiased for | note                           |
|----------------------|-----------------------|--------------|--------------------------------|
| 'k1'                 | x                     | y ~ π        | can be negative                |
| 'abs'                | abs(x)                | no           | veRL 'abs'                     |
| 'k2'                 | x² / 2                | no           | veRL 'mse'; gradient = k1's    |
| 'k3'                 | exp(−x) − 1 + x       | y ~ π        | ≥ 0; veRL 'low_var_kl', GRPO   |
| 'k3_ratio_corrected' | ρ · (exp(−x) − 1 + x) | y ~ π_old    | ρ = π/π_old; TRL               |
|                      |                       |              | `use_bias_correction_kl=True`  |

The ratio-corrected k3 (DeepSeek-AI 2025, "DeepSeek-V3.2", the KL term of
its GRPO objective) is for tokens sampled from the behaviour policy π_old
rather than from π, the situation of every update after the first on a
rollout batch. It needs `old_logp`; ρ = exp(logp − sg[old_logp]) carries
gradient, as in TRL.

Gradients (per token, for the conditional distribution of that token; a
sum over the vocabulary is written Σ_y). With ∇ℓ ≡ ∇ log π(y):

  ∇ KL(π ‖ π_ref)  = Σ_y π(y) · x(y) · ∇ℓ(y)            (Σ_y π ∇ℓ = 0)
  ∇ k3             = (1 − e^(−x)) · ∇ℓ = (1 − π_ref/π) · ∇ℓ
  ∇ (ρ · k3)       = ρ · k3 · ∇ℓ + ρ · (1 − e^(−x)) · ∇ℓ = ρ · x · ∇ℓ

so, with y ~ π_old,

  E[∇ (ρ · k3)] = Σ_y π_old · (π/π_old) · x · ∇ℓ = ∇ KL(π ‖ π_ref)
      for every π_old: the corrected term is an unbiased estimate of the
      gradient, and E[ρ · k3] = E_π[k3] = KL(π ‖ π_ref) of the value;
  E[∇ k3]       = Σ_y π_old · (1 − π_ref/π) · ∇ℓ
      which at π_old = π (the first update on a batch) is
      −Σ_y π_ref ∇ℓ = ∇ KL(π_ref ‖ π): plain k3 as a loss follows the
      gradient of the *reverse* KL, not of KL(π ‖ π_ref), and for
      π_old ≠ π it is neither.
At ρ = 1 (logp = old_logp) the two values are equal but the gradients are
not: x · ∇ℓ against (1 − e^(−x)) · ∇ℓ, equal to first order in x only.
The value of plain k3 is unbiased for KL(π ‖ π_ref) only when y ~ π. For a
whole sequence both are per-token estimates: neither carries the effect of
a token on the distribution of the tokens after it. ρ is not clamped (TRL
does not): a log-ratio of +89 overflows float32; `input_clamp` applies to
x only, `output_clamp` to the product.

Clamps, as each framework applies them (`jrl.losses.presets` sets them):
* veRL `low_var_kl`: x clamped to [−20, 20] before exp, the k3 value to
  [−10, 10] after;
* OpenRLHF: the value of every estimator clamped to [−10, 10];
* NeMo-RL: optional input and output clamps (`kl_input_clamp_value`,
  `kl_output_clamp_value`);
* TRL: none (k3 only, `beta` > 0 turns it on; `use_bias_correction_kl`
  multiplies it by ρ).
`input_clamp` clamps x, `output_clamp` clamps the value, both symmetric.

The KL can be added to the loss (GRPO: β · aggregate(kl)) or subtracted from
the reward (PPO-style, `jrl.losses.advantages.token_level_rewards`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.losses._checks import as_f32, check_choice, check_positive, check_rank, check_same_shape

KL_ESTIMATORS = ('k1', 'abs', 'k2', 'k3', 'k3_ratio_corrected')


def kl_penalty(
  logp,
  ref_logp,
  *,
  estimator='k3',
  input_clamp=None,
  output_clamp=None,
  mask=None,
  old_logp=None,
):
  """Per-token KL(π ‖ π_ref) estimate from the sampled tokens' logprobs.

  Args:
    logp: [B, T] policy logprobs (differentiated when used in the loss).
    ref_logp: [B, T] reference logprobs.
    estimator: 'k1' | 'abs' | 'k2' | 'k3' | 'k3_ratio_corrected'.
    input_clamp: clamp the log-ratio x to [−c, c] before the estimator.
    output_clamp: clamp the estimate to [−c, c].
    mask: optional [B, T] 0/1; the output is zeroed where it is 0.
    old_logp: [B, T] behaviour-policy logprobs (constants); required by
      'k3_ratio_corrected', not used by the other estimators.

  Returns:
    [B, T] float32.
  """
  check_rank(logp, 2, 'logp', '[B, T]')
  check_same_shape('logp', logp, ref_logp=ref_logp, mask=mask, old_logp=old_logp)
  check_choice(estimator, 'estimator', KL_ESTIMATORS)
  if estimator == 'k3_ratio_corrected' and old_logp is None:
    raise ValueError("`old_logp` is required for estimator='k3_ratio_corrected'.")
  valid = None if mask is None else as_f32(mask) > 0
  # Select, not multiply: padding may hold −inf or huge log-ratios.
  clean = (lambda z: z) if valid is None else (lambda z: jnp.where(valid, z, 0.0))
  x = clean(as_f32(logp) - as_f32(ref_logp))
  if input_clamp is not None:
    check_positive(input_clamp, 'input_clamp')
    x = jnp.clip(x, -input_clamp, input_clamp)
  if estimator == 'k1':
    kl = x
  elif estimator == 'abs':
    kl = jnp.abs(x)
  elif estimator == 'k2':
    kl = 0.5 * x**2
  else:
    # expm1 keeps k3 ≥ 0 near x = 0, where exp(−x) − 1 cancels in float32.
    kl = jnp.expm1(-x) + x
  if estimator == 'k3_ratio_corrected':
    old = jax.lax.stop_gradient(as_f32(old_logp))
    ratio = jnp.exp(clean(as_f32(logp) - old))  # ρ = π/π_old, differentiated
    kl = ratio * kl
  if output_clamp is not None:
    check_positive(output_clamp, 'output_clamp')
    kl = jnp.clip(kl, -output_clamp, output_clamp)
  if mask is not None:
    kl = kl * as_f32(mask)
  return kl


class KLControllerState(NamedTuple):
  """State of a KL coefficient controller."""

  coef: jnp.ndarray  # [] float32, β used for the next step.


class KLController(NamedTuple):
  """An optax-style (init, update) pair for the KL coefficient β.

  `init() -> state`; `update(state, kl, n_steps) -> state`, where `kl` is the
  KL measured on the batch just trained on and `n_steps` the number of
  samples (or steps, consistently with `horizon`) it covered.
  """

  init: callable
  update: callable


def fixed_kl_controller(coef):
  """β stays at `coef` (veRL `kl_ctrl.type="fixed"`, TRL `beta`)."""
  check_positive(coef, 'coef', allow_zero=True)

  def init():
    return KLControllerState(coef=jnp.float32(coef))

  def update(state, kl, n_steps):
    del kl, n_steps
    return state

  return KLController(init, update)


def adaptive_kl_controller(init_coef, target, horizon, max_error=0.2):
  """Adaptive β (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    e = clip(KL / target − 1, −max_error, max_error)
    β ← β · (1 + e · n_steps / horizon)

  Proportional control that drives the measured KL toward `target`. Same
  rule as veRL's `AdaptiveKLController` and TRL's PPO adaptive KL.

  Args:
    init_coef: β₀ ≥ 0.  target: KL target > 0.  horizon: > 0, in the unit
      of n_steps.  max_error: bound on the proportional error.

  Returns:
    KLController.
  """
  check_positive(init_coef, 'init_coef', allow_zero=True)
  check_positive(target, 'target')
  check_positive(horizon, 'horizon')
  check_positive(max_error, 'max_error')

  def init():
    return KLControllerState(coef=jnp.float32(init_coef))

  def update(state, kl, n_steps):
    error = jnp.clip(as_f32(kl) / target - 1.0, -max_error, max_error)
    return KLControllerState(coef=state.coef * (1.0 + error * n_steps / horizon))

  return KLController(init, update)
