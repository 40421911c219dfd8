"""Offline preference objectives from per-sequence logprobs.

Inputs are one number per (prompt, response) pair, `[B]`: the summed (or,
where stated, length-averaged) log-probability of the chosen and of the
rejected response under the policy, and for the reference-based losses
under the reference model. The caller computes them (sum the masked token
logprobs of `jrl.losses.token_logprobs`). Each function returns
`(loss [B] float32, metrics)`; take the mean over pairs.

With h = (logp_c − logp_r) − (ref_c − ref_r), the log-ratio margin:

| loss      | ℓ                                                      | paper                     |
|-----------|--------------------------------------------------------|---------------------------|
| `dpo`     | −(1−ε) log σ(β h) − ε log σ(−β h)                      | Rafailov et al. 2023      |
| `ipo`     | (h − 1/(2β))²                                          | Azar et al. 2023          |
| `hinge`   | max(0, 1 − β h)                                        | SLiC, Zhao et al. 2023    |
| `simpo`   | −log σ(β (ā_c − ā_r) − γ), ā = length-averaged logp    | Meng et al. 2024          |
| `orpo`    | −ā_c − λ log σ(log odds_c − log odds_r)                | Hong et al. 2024          |

These match TRL's `DPOTrainer` (`loss_type` "sigmoid" with
`label_smoothing`, "ipo", "hinge"), `CPOTrainer` with `loss_type="simpo"`
and `ORPOTrainer`. TRL's IPO averages logprobs over tokens before forming
h; pass averaged logprobs to reproduce it. The label smoothing ε of `dpo`
is conservative DPO (Mitchell 2023). TRL's CPOTrainer adds `cpo_alpha`
times the chosen NLL to SimPO; add it yourself if you want it. TRL's ORPO
NLL is a token mean over all chosen tokens of the batch, jrl's the mean of
per-pair averages (equal when responses have equal lengths).

Metrics (means over the batch): `rewards_chosen` = β(logp_c − ref_c),
`rewards_rejected`, `reward_margin`, `reward_accuracy` (share of pairs
with chosen reward > rejected reward).
"""

import jax
import jax.numpy as jnp

from jrl.losses._checks import as_f32, check_positive, check_rank, check_same_shape


def _check(chosen_name, chosen, **others):
  check_rank(chosen, 1, chosen_name, '[B]')
  for name, x in others.items():
    check_rank(x, 1, name, '[B]')
  check_same_shape(chosen_name, chosen, **others)


def _reward_metrics(r_c, r_r):
  r_c, r_r = jax.lax.stop_gradient(r_c), jax.lax.stop_gradient(r_r)
  return {
    'rewards_chosen': jnp.mean(r_c),
    'rewards_rejected': jnp.mean(r_r),
    'reward_margin': jnp.mean(r_c - r_r),
    'reward_accuracy': jnp.mean((r_c > r_r).astype(jnp.float32)),
  }


def _margin(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp):
  _check(
    'chosen_logp',
    chosen_logp,
    rejected_logp=rejected_logp,
    ref_chosen_logp=ref_chosen_logp,
    ref_rejected_logp=ref_rejected_logp,
  )
  c, r = as_f32(chosen_logp), as_f32(rejected_logp)
  rc = jax.lax.stop_gradient(as_f32(ref_chosen_logp))
  rr = jax.lax.stop_gradient(as_f32(ref_rejected_logp))
  return c - rc, r - rr


def dpo_loss(
  chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, beta=0.1, label_smoothing=0.0
):
  """DPO with the sigmoid loss; `label_smoothing` ε > 0 is conservative DPO.

  Args:
    chosen_logp, rejected_logp: [B] policy sequence logprobs.
    ref_chosen_logp, ref_rejected_logp: [B] reference sequence logprobs.
    beta: β > 0.  label_smoothing: ε in [0, 0.5].

  Returns:
    (loss [B], metrics).
  """
  check_positive(beta, 'beta')
  if not 0.0 <= label_smoothing <= 0.5:
    raise ValueError(f'`label_smoothing` must be in [0, 0.5], got {label_smoothing!r}.')
  dc, dr = _margin(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp)
  z = beta * (dc - dr)
  loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)
  return loss, _reward_metrics(beta * dc, beta * dr)


def ipo_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, beta=0.1):
  """IPO: squared distance of the margin h to 1/(2β).

  Args:
    as `dpo_loss` (TRL passes length-averaged logprobs); beta: β > 0.

  Returns:
    (loss [B], metrics).
  """
  check_positive(beta, 'beta')
  dc, dr = _margin(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp)
  loss = (dc - dr - 1.0 / (2.0 * beta)) ** 2
  return loss, _reward_metrics(beta * dc, beta * dr)


def hinge_loss(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, *, beta=0.1):
  """SLiC hinge loss on the scaled margin: max(0, 1 − β h).

  Args:
    as `dpo_loss`; beta: β > 0.

  Returns:
    (loss [B], metrics).
  """
  check_positive(beta, 'beta')
  dc, dr = _margin(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp)
  loss = jax.nn.relu(1.0 - beta * (dc - dr))
  return loss, _reward_metrics(beta * dc, beta * dr)


def simpo_loss(chosen_avg_logp, rejected_avg_logp, *, beta=2.0, gamma=0.5, label_smoothing=0.0):
  """SimPO: reference-free, length-normalised, with a target margin γ.

    ℓ = −(1−ε) log σ(β(ā_c − ā_r) − γ) − ε log σ(−(β(ā_c − ā_r) − γ))

  TRL's CPOTrainer (`loss_type="simpo"`) takes γ as `simpo_gamma` and
  subtracts γ/β inside β(·), which is the same quantity.

  Args:
    chosen_avg_logp, rejected_avg_logp: [B] logprobs averaged over each
      response's tokens.
    beta: β > 0.  gamma: target reward margin γ ≥ 0.  label_smoothing: ε.

  Returns:
    (loss [B], metrics) with rewards β·ā.
  """
  _check('chosen_avg_logp', chosen_avg_logp, rejected_avg_logp=rejected_avg_logp)
  check_positive(beta, 'beta')
  check_positive(gamma, 'gamma', allow_zero=True)
  if not 0.0 <= label_smoothing <= 0.5:
    raise ValueError(f'`label_smoothing` must be in [0, 0.5], got {label_smoothing!r}.')
  c, r = as_f32(chosen_avg_logp), as_f32(rejected_avg_logp)
  z = beta * (c - r) - gamma
  loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)
  return loss, _reward_metrics(beta * c, beta * r)


def _log1mexp(a):
  """log(1 − exp(a)) for a < 0, accurate near 0 and for large |a|."""
  return jnp.where(a > -0.6931472, jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(a)))


def orpo_loss(chosen_avg_logp, rejected_avg_logp, *, lam=0.1):
  """ORPO: SFT on the chosen response plus an odds-ratio penalty.

    log odds(y) = ā − log(1 − exp(ā))
    ℓ = −ā_c − λ · log σ(log odds_c − log odds_r)

  ā must be < 0 (a probability below 1); it is clipped to ≤ −1e-6.

  Args:
    chosen_avg_logp, rejected_avg_logp: [B] length-averaged logprobs.
    lam: λ ≥ 0, weight of the odds-ratio term (TRL's `beta`).

  Returns:
    (loss [B], metrics) with `log_odds_ratio` and `nll_chosen`; rewards are
    λ·ā as in TRL.
  """
  _check('chosen_avg_logp', chosen_avg_logp, rejected_avg_logp=rejected_avg_logp)
  check_positive(lam, 'lam', allow_zero=True)
  c = jnp.minimum(as_f32(chosen_avg_logp), -1e-6)
  r = jnp.minimum(as_f32(rejected_avg_logp), -1e-6)
  log_odds = (c - _log1mexp(c)) - (r - _log1mexp(r))
  ratio_term = jax.nn.log_sigmoid(log_odds)
  loss = -c - lam * ratio_term
  metrics = _reward_metrics(lam * c, lam * r)
  metrics['log_odds_ratio'] = jnp.mean(jax.lax.stop_gradient(log_odds))
  metrics['nll_chosen'] = jnp.mean(jax.lax.stop_gradient(-c))
  return loss, metrics


def bradley_terry_loss(chosen_reward, rejected_reward, *, margin=None, center_coef=0.0):
  """Pairwise logistic (Bradley-Terry) loss for training a reward model.

    ℓ = −log σ(r_c − r_r − m) + c · (r_c + r_r)²

  The margin m (Llama 2, Touvron et al. 2023) asks for a larger gap on
  pairs labelled as clearly different; the centring term c (Eisenstein et
  al. 2023) keeps rewards near zero, since the logistic loss only sees
  their difference. TRL's `RewardTrainer` is this loss with its `margin`
  column and `center_rewards_coefficient`; OpenRLHF's `LogSigLoss` is the
  loss with m = 0 and c = 0.

  Args:
    chosen_reward, rejected_reward: [B] scalar rewards of each pair.
    margin: None, a float, or [B] per-pair margins m ≥ 0.
    center_coef: c ≥ 0.

  Returns:
    (loss [B], metrics): `rewards_chosen`, `rewards_rejected`,
    `reward_margin` (mean r_c − r_r), `reward_accuracy` (share with
    r_c > r_r).
  """
  _check('chosen_reward', chosen_reward, rejected_reward=rejected_reward)
  if center_coef < 0:
    raise ValueError(f'`center_coef` must be >= 0, got {center_coef!r}.')
  c, r = as_f32(chosen_reward), as_f32(rejected_reward)
  m = 0.0
  if margin is not None:
    m = as_f32(margin)
    if jnp.ndim(m) == 1:
      check_same_shape('chosen_reward', c, margin=m)
    elif jnp.ndim(m) != 0:
      raise ValueError(f'`margin` must be a scalar or [B], got shape {jnp.shape(m)}.')
  loss = -jax.nn.log_sigmoid(c - r - m)
  if center_coef:
    loss = loss + center_coef * (c + r) ** 2
  return loss, _reward_metrics(c, r)
