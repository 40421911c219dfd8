"""Advantage estimators: group-relative (GRPO family), REINFORCE++ and GAE.

Layout: outcome rewards are one scalar per sampled response, `rewards: [B]`,
with the G samples of one prompt in consecutive rows (B = num_prompts · G).
Token-level quantities are `[B, T]` with a 0/1 `mask` over response tokens.
Outcome estimators return `[B]`; broadcast them over tokens with
`broadcast_to_tokens(adv, mask)`.

Shared behaviour, whatever the convention:
* A group whose rewards are all equal (zero variance) gets advantage exactly
  0. The frameworks compute (r − mean) / (std + ε) there, which is 0 only up
  to float rounding of the mean (for rewards of 0.1 the rounding error
  divided by ε = 1e-6 is ~0.01); jrl returns the exact value.
* Batch statistics (TRL's `scale_rewards="batch"`, REINFORCE++ whitening) are
  taken over the global batch when `axis_name` names the mapped data axis.
* `valid: [B] bool` (optional, default all rows) leaves rows out: their
  reward is never read (it may be NaN), their advantage is 0, and every
  statistic (group mean and std, leave-one-out baselines, batch std,
  whitening) is taken over the valid rows only, so the other rows get what
  they would get if the left-out rows were absent from the batch. A group
  left with one valid row has no baseline: 0 (as 'zero' does for a group of
  one). The trainer passes the completions whose reward could not be
  computed as invalid (`reward.unscored='drop'`); the frameworks have no
  such argument (they train on a substituted score).
"""

import jax
import jax.numpy as jnp

from jrl.losses._checks import (
  as_f32,
  check_choice,
  check_group_size,
  check_positive,
  check_rank,
  check_same_shape,
)

STD_MODES = ('unbiased', 'biased')
SCALE_MODES = ('group', 'batch', 'none')
SINGLETON_MODES = ('zero', 'raw', 'error')


def _psum(x, axis_name):
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def _safe_sqrt(x):
  """sqrt(x) for x ≥ 0 with a zero (not infinite) derivative at x = 0.

  A zero std is common (tied groups, empty masks) and is always selected
  away afterwards; the plain sqrt would still put 0 · inf = NaN into the
  gradient.
  """
  positive = x > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def _grouped(rewards, group_size, name='rewards'):
  check_rank(rewards, 1, name, '[B]')
  check_group_size(rewards.shape[0], group_size)
  return as_f32(rewards).reshape(-1, group_size)


def _grouped_valid(valid, rewards, group_size):
  """[N, G] bool: `valid` [B] (None: every row) in the groups of `_grouped`."""
  if valid is None:
    return jnp.ones((rewards.shape[0] // group_size, group_size), bool)
  check_rank(valid, 1, 'valid', '[B]')
  check_same_shape('rewards', rewards, valid=valid)
  return jnp.asarray(valid, bool).reshape(-1, group_size)


def _equal_in_group(r_NxG, valid_NxG):
  """[N] bool: every valid reward of the group is the same value (also true
  for a group of at most one valid reward: it has no spread)."""
  most = jnp.max(jnp.where(valid_NxG, r_NxG, -jnp.inf), axis=-1)
  least = jnp.min(jnp.where(valid_NxG, r_NxG, jnp.inf), axis=-1)
  return (most == least) | (jnp.sum(valid_NxG, axis=-1) <= 1)


def broadcast_to_tokens(adv, mask):
  """Gives every valid token of a response its sequence's advantage.

  Args:
    adv: [B] per-sequence advantages.
    mask: [B, T] 0/1 response mask.

  Returns:
    [B, T] float32, zero where `mask` is 0.
  """
  check_rank(adv, 1, 'adv', '[B]')
  check_rank(mask, 2, 'mask', '[B, T]')
  if mask.shape[0] != adv.shape[0]:
    raise ValueError(f'`mask` must have B={adv.shape[0]} rows to match `adv`, got {mask.shape}.')
  return as_f32(adv)[:, None] * as_f32(mask)


def valid_token_mask(mask, valid):
  """`mask` with the rows that `valid` leaves out zeroed.

  Args:
    mask: [B, T] 0/1 response mask.
    valid: [B] bool rows that count, or None (every row).

  Returns:
    [B, T] bool (`mask` itself when `valid` is None).
  """
  if valid is None:
    return mask
  check_rank(mask, 2, 'mask', '[B, T]')
  check_rank(valid, 1, 'valid', '[B]')
  if mask.shape[0] != valid.shape[0]:
    raise ValueError(
      f'`mask` must have B={valid.shape[0]} rows to match `valid`, got {mask.shape}.'
    )
  return jnp.asarray(mask, bool) & jnp.asarray(valid, bool)[:, None]


def grpo_advantages(
  rewards,
  group_size,
  *,
  scale='group',
  std='unbiased',
  eps=1e-6,
  singleton='zero',
  valid=None,
  axis_name=None,
):
  """Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath").

    A_i = (r_i − mean_g(r)) / (σ + ε)

  where mean_g is the mean over the G samples of prompt g and σ is

  * scale='group': the std of the group (the GRPO paper; veRL; TRL
    `scale_rewards="group"`; OpenRLHF `group_norm`);
  * scale='batch': the std of all B rewards (TRL `scale_rewards="batch"`,
    a remedy for the question-difficulty bias noted by Dr. GRPO);
  * scale='none': no division, A_i = r_i − mean_g (Dr. GRPO, Liu et al.
    2025; veRL `norm_adv_by_std_in_grpo=False`; TRL `scale_rewards="none"`;
    OpenRLHF `dr_grpo`).

  `std='unbiased'` divides the squared deviations by G − 1 (what
  `torch.std` does by default, hence veRL, TRL and OpenRLHF), `'biased'` by G.
  ε is added to σ, not to the variance. Framework values: veRL 1e-6, TRL 1e-4,
  OpenRLHF 1e-9 (see `jrl.losses.presets`).

  With `valid`, mean_g, σ and G are over the group's valid rows (the batch
  std over the batch's valid rows); invalid rows get 0.

  Zero-variance groups get exactly 0. A group of one sample (group_size=1)
  has no group baseline; `singleton` picks the convention:
  * 'zero': advantage 0, the sample is its own baseline (TRL, which sets
    σ := 0 there, and NeMo-RL);
  * 'raw': veRL's rule, mean := 0 and σ := 1, so A = r / (1 + ε) (or r when
    scale='none');
  * 'error': refuse, as OpenRLHF does (it asserts G > 1).

  Args:
    rewards: [B] outcome rewards, groups of `group_size` consecutive rows.
    group_size: G, a Python int dividing B.
    scale: 'group' | 'batch' | 'none'.
    std: 'unbiased' | 'biased'.
    eps: ε ≥ 0 added to the std.
    singleton: 'zero' | 'raw' | 'error', used only when group_size == 1
      (a larger group left with one valid row gets 0 whatever `singleton`).
    valid: optional [B] bool, the rows that count (default: all).
    axis_name: mapped axis for the batch std of scale='batch'.

  Returns:
    [B] float32 advantages, 0 on invalid rows.
  """
  check_choice(scale, 'scale', SCALE_MODES)
  check_choice(std, 'std', STD_MODES)
  check_choice(singleton, 'singleton', SINGLETON_MODES)
  check_positive(eps, 'eps', allow_zero=True)
  r_NxG = _grouped(rewards, group_size)
  valid_NxG = _grouped_valid(valid, rewards, group_size)
  r_NxG = jnp.where(valid_NxG, r_NxG, 0.0)  # an invalid row's reward is never read

  if group_size == 1:
    if singleton == 'error':
      raise ValueError(
        '`group_size` must be >= 2 for a group-relative advantage when '
        "`singleton` is 'error' (set singleton='zero' or 'raw' to allow it)."
      )
    if singleton == 'zero':
      return jnp.zeros_like(r_NxG[:, 0])
    r_B = r_NxG[:, 0]
    r_B = r_B if scale == 'none' else r_B / (1.0 + eps)
    return jnp.where(valid_NxG[:, 0], r_B, 0.0)

  ddof = 1 if std == 'unbiased' else 0
  tied_Nx1 = _equal_in_group(r_NxG, valid_NxG)[:, None]
  n_Nx1 = jnp.sum(valid_NxG, axis=-1, keepdims=True).astype(jnp.float32)
  mean_Nx1 = jnp.sum(r_NxG, axis=-1, keepdims=True) / jnp.maximum(n_Nx1, 1.0)
  centred_NxG = jnp.where(valid_NxG, r_NxG - mean_Nx1, 0.0)
  if scale == 'group':
    var_Nx1 = jnp.sum(centred_NxG**2, axis=-1, keepdims=True) / jnp.maximum(n_Nx1 - ddof, 1.0)
    denom_Nx1 = _safe_sqrt(var_Nx1) + eps
  elif scale == 'batch':
    flat_valid = valid_NxG.reshape(-1)
    denom_Nx1 = batch_std(r_NxG.reshape(-1), ddof=ddof, mask=flat_valid, axis_name=axis_name) + eps
  else:
    denom_Nx1 = jnp.float32(1.0)
  # Tied groups (and invalid rows) select 0; their denominator is set to 1 so
  # that neither the value nor the gradient of the unselected branch is 0/0.
  zero_NxG = tied_Nx1 | ~valid_NxG
  denom_NxG = jnp.where(zero_NxG | (denom_Nx1 == 0), 1.0, denom_Nx1)
  adv_NxG = jnp.where(zero_NxG, 0.0, centred_NxG / denom_NxG)
  return adv_NxG.reshape(-1)


def dr_grpo_advantages(rewards, group_size, *, valid=None):
  """Dr. GRPO advantages (Liu et al. 2025): A_i = r_i − mean_g(r), no std.

  Same as `grpo_advantages(rewards, group_size, scale='none')`; pair it
  with the 'seq-mean-token-sum-norm' aggregation to remove both of the
  biases the paper identifies (response length and question difficulty).

  Args:
    rewards: [B]; group_size: G dividing B.
    valid: optional [B] bool, the rows that count (see the module docstring).

  Returns:
    [B] float32, 0 on invalid rows.
  """
  return grpo_advantages(rewards, group_size, scale='none', valid=valid)


def rloo_advantages(rewards, group_size, *, valid=None):
  """REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = r_i − 1/(G−1) Σ_{j≠i} r_j  =  G/(G−1) · (r_i − mean_g(r))

  No std scaling. This is OpenRLHF's `rloo` and TRL's RLOOTrainer baseline.
  With `valid`, G and the j ≠ i are the group's valid rows.

  Args:
    rewards: [B]; group_size: G ≥ 2 dividing B.
    valid: optional [B] bool, the rows that count (see the module docstring).

  Returns:
    [B] float32, 0 on invalid rows.
  """
  r_NxG = _grouped(rewards, group_size)
  valid_NxG = _grouped_valid(valid, rewards, group_size)
  r_NxG = jnp.where(valid_NxG, r_NxG, 0.0)  # an invalid row's reward is never read
  if group_size < 2:
    raise ValueError(f'`group_size` must be >= 2 for a leave-one-out baseline, got {group_size}.')
  n_Nx1 = jnp.sum(valid_NxG, axis=-1, keepdims=True).astype(jnp.float32)
  total_Nx1 = jnp.sum(r_NxG, axis=-1, keepdims=True)
  loo_NxG = (total_Nx1 - r_NxG) / jnp.maximum(n_Nx1 - 1.0, 1.0)
  zero_NxG = _equal_in_group(r_NxG, valid_NxG)[:, None] | ~valid_NxG
  adv_NxG = jnp.where(zero_NxG, 0.0, r_NxG - loo_NxG)
  return adv_NxG.reshape(-1)


def loo_advantages(rewards, group_size, *, normalize=True, eps=1e-6, valid=None):
  """Leave-one-out baseline with an optional leave-one-out std (NeMo-RL's GRPO).

    b_i = 1/(G−1) Σ_{j≠i} r_j,    A_i = r_i − b_i
    σ_i = sqrt( 1/(G−2) Σ_{j≠i} (r_j − b_i)² )   (unbiased std of the siblings)
    A_i ← A_i / (σ_i + ε) where σ_i > 0; left unscaled where σ_i = 0

  NeMo-RL's defaults (`use_leave_one_out_baseline=True`,
  `normalize_rewards=True`, ε = 1e-6): each sample is judged against the
  mean and the spread of its G − 1 siblings. With G = 2 a single sibling
  has no std, so no sample is rescaled; samples whose siblings all agree
  are not rescaled either (their A_i = r_i − b_i). jrl computes the sibling
  statistics in two passes and tests "the siblings agree" exactly; a
  one-pass variance (E[r²] − b², NeMo-RL's form) can turn a zero spread
  into float noise and divide by it. A group of one sample gets 0
  (NeMo-RL sets the baseline to the reward itself). With `valid` the
  siblings are the valid j ≠ i (G − 1 becomes their count; the std needs
  two of them).

  Args:
    rewards: [B]; group_size: G dividing B.
    normalize: divide by the leave-one-out std.
    eps: ε ≥ 0 added to σ_i.
    valid: optional [B] bool, the rows that count (see the module docstring).

  Returns:
    [B] float32, 0 on invalid rows.
  """
  r_NxG = _grouped(rewards, group_size)
  valid_NxG = _grouped_valid(valid, rewards, group_size)
  r_NxG = jnp.where(valid_NxG, r_NxG, 0.0)  # an invalid row's reward is never read
  check_positive(eps, 'eps', allow_zero=True)
  if not isinstance(normalize, bool):
    raise ValueError(f'`normalize` must be True or False, got {normalize!r}.')
  g = group_size
  if g == 1:
    return jnp.zeros_like(r_NxG[:, 0])
  # Siblings of i are the valid j ≠ i: an explicit [N, G, G] layout (G is
  # small) so that every statistic is a two-pass sum over the siblings themselves.
  sib_NxGxG = ~jnp.eye(g, dtype=bool) & valid_NxG[:, None, :]
  n_sib_NxG = jnp.sum(sib_NxGxG, axis=-1).astype(jnp.float32)
  r_NxGxG = jnp.broadcast_to(r_NxG[:, None, :], (r_NxG.shape[0], g, g))
  sib_max_NxG = jnp.max(jnp.where(sib_NxGxG, r_NxGxG, -jnp.inf), axis=-1)
  sib_min_NxG = jnp.min(jnp.where(sib_NxGxG, r_NxGxG, jnp.inf), axis=-1)
  agree_NxG = sib_max_NxG == sib_min_NxG
  sib_sum_NxG = jnp.sum(jnp.where(sib_NxGxG, r_NxGxG, 0.0), axis=-1)
  sib_mean_NxG = sib_sum_NxG / jnp.maximum(n_sib_NxG, 1.0)
  # When the siblings agree their mean is their common value, exactly.
  loo_mean_NxG = jnp.where(agree_NxG, sib_max_NxG, sib_mean_NxG)
  adv_NxG = r_NxG - loo_mean_NxG
  if normalize and g > 2:
    dev_NxGxG = jnp.where(sib_NxGxG, r_NxGxG - loo_mean_NxG[..., None], 0.0)
    sigma_NxG = _safe_sqrt(jnp.sum(dev_NxGxG**2, axis=-1) / jnp.maximum(n_sib_NxG - 1.0, 1.0))
    scaled_NxG = ~agree_NxG & (sigma_NxG > 0) & (n_sib_NxG >= 2)
    adv_NxG = jnp.where(scaled_NxG, adv_NxG / jnp.where(scaled_NxG, sigma_NxG + eps, 1.0), adv_NxG)
  zero_NxG = _equal_in_group(r_NxG, valid_NxG)[:, None] | ~valid_NxG
  adv_NxG = jnp.where(zero_NxG, 0.0, adv_NxG)
  return adv_NxG.reshape(-1)


def batch_std(x, *, ddof=1, mask=None, axis_name=None):
  """Std of all (valid) entries of `x`, over devices when `axis_name` is set.

  Args:
    x: any shape.
    ddof: 1 for the unbiased (Bessel) std, 0 for the population std.
    mask: optional 0/1 array of x's shape; only entries with mask 1 count.
    axis_name: optional mapped axis.

  Returns:
    [] float32 (0 when fewer than ddof + 1 entries are valid).
  """
  x = as_f32(x)
  m = jnp.ones_like(x) if mask is None else as_f32(mask)
  n = _psum(jnp.sum(m), axis_name)
  mean = _psum(jnp.sum(x * m), axis_name) / jnp.maximum(n, 1.0)
  ss = _psum(jnp.sum(m * (x - mean) ** 2), axis_name)
  return _safe_sqrt(ss / jnp.maximum(n - ddof, 1.0))


WHITEN_EPS_MODES = ('var', 'std', 'clamp')


def whiten(x, mask, *, shift_mean=True, ddof=1, eps=1e-8, eps_mode='var', axis_name=None):
  """(x − mean) / scale over every valid token of the batch.

  The batch normalisation of advantages used by PPO and by REINFORCE++.
  Where ε goes differs between frameworks, so it is selectable:

  * eps_mode='var': scale = sqrt(var + ε) (veRL `masked_whiten`, ddof=1);
  * eps_mode='clamp': scale = sqrt(max(var, ε)) (OpenRLHF and NeMo-RL,
    ddof=0);
  * eps_mode='std': scale = std + ε.

  `shift_mean=False` divides by the scale but keeps the mean (OpenRLHF's
  `--no_advantage_std_norm` is the opposite: it keeps only the centring,
  i.e. skip this function and subtract the mean).

  Args:
    x: [B, T]; mask: [B, T] 0/1.
    shift_mean: subtract the mean.
    ddof: 1 (unbiased) or 0 (population) variance.
    eps: ε ≥ 0.  eps_mode: 'var' | 'std' | 'clamp'.
    axis_name: optional mapped axis for global statistics.

  Returns:
    [B, T] float32, zero where `mask` is 0.
  """
  check_rank(x, 2, 'x', '[B, T]')
  check_same_shape('x', x, mask=mask)
  check_positive(eps, 'eps', allow_zero=True)
  check_choice(eps_mode, 'eps_mode', WHITEN_EPS_MODES)
  x, m = as_f32(x), as_f32(mask)
  n = _psum(jnp.sum(m), axis_name)
  mean = _psum(jnp.sum(x * m), axis_name) / jnp.maximum(n, 1.0)
  ss = _psum(jnp.sum(m * (x - mean) ** 2), axis_name)
  var = ss / jnp.maximum(n - ddof, 1.0)
  if eps_mode == 'var':
    scale = _safe_sqrt(var + eps)
  elif eps_mode == 'clamp':
    scale = _safe_sqrt(jnp.maximum(var, eps))
  else:
    scale = _safe_sqrt(var) + eps
  out = (x - mean) if shift_mean else x
  return out / jnp.where(scale > 0, scale, 1.0) * m


def token_level_rewards(rewards, mask, *, kl=None, kl_coef=0.0):
  """Per-token rewards: the outcome reward on the last valid token, −β·KL on all.

    r_t = −β · KL_t + [t = last valid token] · R

  The form used by PPO with a KL penalty in the reward (Ziegler et al. 2019;
  veRL `apply_kl_penalty`, OpenRLHF `compute_reward`) and by REINFORCE++.

  Args:
    rewards: [B] outcome rewards.
    mask: [B, T] 0/1 response mask (any layout; "last" is the highest index
      with mask 1).
    kl: optional [B, T] per-token KL estimate (e.g. `jrl.losses.kl_penalty`).
    kl_coef: β ≥ 0.

  Returns:
    [B, T] float32, zero where `mask` is 0. Rows with no valid token get 0.
  """
  check_rank(rewards, 1, 'rewards', '[B]')
  check_rank(mask, 2, 'mask', '[B, T]')
  if mask.shape[0] != rewards.shape[0]:
    raise ValueError(f'`mask` must have B={rewards.shape[0]} rows, got {mask.shape}.')
  check_same_shape('mask', mask, kl=kl)
  check_positive(kl_coef, 'kl_coef', allow_zero=True)
  m = as_f32(mask)
  t = m.shape[1]
  last_B = t - 1 - jnp.argmax(m[:, ::-1], axis=-1)
  is_last_BxT = (jnp.arange(t)[None, :] == last_B[:, None]) * m
  out = is_last_BxT * as_f32(rewards)[:, None]
  if kl is not None:
    out = out - kl_coef * as_f32(kl) * m
  return out


def discounted_returns(token_rewards, mask, *, gamma=1.0):
  """G_t = Σ_{s ≥ t, mask_s = 1} γ^(k(s) − k(t)) r_s over valid tokens.

  k(t) counts valid tokens, so masked positions (environment tokens in a
  multi-turn trajectory, padding) are not time steps: they neither discount
  nor contribute; the return flows through them unchanged.

  Args:
    token_rewards: [B, T]; mask: [B, T] 0/1; gamma: γ in [0, 1].

  Returns:
    [B, T] float32 returns, zero where `mask` is 0.
  """
  check_rank(token_rewards, 2, 'token_rewards', '[B, T]')
  check_same_shape('token_rewards', token_rewards, mask=mask)
  if not 0.0 <= gamma <= 1.0:
    raise ValueError(f'`gamma` must be in [0, 1], got {gamma!r}.')
  r, m = as_f32(token_rewards), as_f32(mask)

  def step(carry_B, xs):
    r_B, m_B = xs
    ret_B = r_B + gamma * carry_B
    return jnp.where(m_B > 0, ret_B, carry_B), ret_B * m_B

  # zeros_like(r[:, 0]) (not zeros(B)) so the carry varies over a shard_map axis like r.
  _, ret_TxB = jax.lax.scan(step, jnp.zeros_like(r[:, 0]), (r.T, m.T), reverse=True)
  return ret_TxB.T


def reinforce_pp_advantages(
  token_rewards, mask, *, gamma=1.0, ddof=1, eps=1e-8, eps_mode='var', axis_name=None
):
  """REINFORCE++ (Hu 2025): discounted returns, whitened over the batch.

    A_t = whiten(G_t) = (G_t − mean) / (std + ε), over all valid tokens

  with G_t from `discounted_returns` and per-token rewards from
  `token_level_rewards` (outcome reward minus β·KL). No critic, no group.
  veRL (`reinforce_plus_plus`): ddof=1, eps_mode='var'; OpenRLHF
  (`reinforce`): ddof=0, eps_mode='clamp'.

  Args:
    token_rewards: [B, T]; mask: [B, T] 0/1; gamma: γ.
    ddof, eps, eps_mode: the whitening statistics (see `whiten`).
    axis_name: for global statistics.

  Returns:
    [B, T] float32.
  """
  returns = discounted_returns(token_rewards, mask, gamma=gamma)
  return whiten(returns, mask, ddof=ddof, eps=eps, eps_mode=eps_mode, axis_name=axis_name)


def reinforce_pp_baseline_advantages(
  rewards,
  mask,
  group_size,
  *,
  kl=None,
  kl_coef=0.0,
  gamma=1.0,
  ddof=1,
  eps=1e-8,
  eps_mode='var',
  valid=None,
  axis_name=None,
):
  """REINFORCE++-baseline: group-mean baseline, then batch whitening.

    R'_i = r_i − mean_g(r);  r_t = −β·KL_t + [t last]·R'_i;
    A_t = whiten(G_t) over all valid tokens of the batch

  OpenRLHF's `advantage_estimator="reinforce_baseline"`: the group mean
  removes the prompt's difficulty, the batch std (not the group std) keeps
  the scale stable without GRPO's per-group reweighting.

  Args:
    rewards: [B] outcome rewards; mask: [B, T] 0/1; group_size: G dividing B.
    kl: optional [B, T] per-token KL; kl_coef: β.
    gamma: γ. ddof, eps, eps_mode: see `whiten`.
    valid: optional [B] bool, the rows that count: the group means and the
      whitening are over the valid rows (see the module docstring).
    axis_name: for the global whitening statistics.

  Returns:
    [B, T] float32, 0 on invalid rows.
  """
  centred = grpo_advantages(rewards, group_size, scale='none', singleton='zero', valid=valid)
  mask = valid_token_mask(mask, valid)
  token_rewards = token_level_rewards(centred, mask, kl=kl, kl_coef=kl_coef)
  return reinforce_pp_advantages(
    token_rewards, mask, gamma=gamma, ddof=ddof, eps=eps, eps_mode=eps_mode, axis_name=axis_name
  )


def gae(token_rewards, values, mask, *, gamma=1.0, lam=1.0):
  """Generalised Advantage Estimation (Schulman et al. 2016) over valid tokens.

    δ_t = r_t + γ·V(next) − V(t),   A_t = δ_t + γλ·A(next),   R_t = A_t + V(t)

  where "next" is the next *valid* token of the same row, and V = 0, A = 0
  after the last one (the episode ends with the response). Masked positions
  (environment or tool tokens between model turns, padding) are skipped: the
  next value and the running advantage are carried through them unchanged,
  so a model turn bootstraps from the value of the model's next turn. This
  is veRL's multi-turn GAE; for a response with no inner masked positions it
  is ordinary GAE.

  Args:
    token_rewards: [B, T] per-token rewards (see `token_level_rewards`).
    values: [B, T] critic values V(t) (treated as constants).
    mask: [B, T] 0/1, 1 on model tokens.
    gamma: γ in [0, 1]; lam: λ in [0, 1].

  Returns:
    (advantages [B, T], returns [B, T]) float32, zero where `mask` is 0.
  """
  check_rank(token_rewards, 2, 'token_rewards', '[B, T]')
  check_same_shape('token_rewards', token_rewards, values=values, mask=mask)
  for name, v in (('gamma', gamma), ('lam', lam)):
    if not 0.0 <= v <= 1.0:
      raise ValueError(f'`{name}` must be in [0, 1], got {v!r}.')
  r, m = as_f32(token_rewards), as_f32(mask)
  v = jax.lax.stop_gradient(as_f32(values))

  def step(carry, xs):
    next_value_B, next_adv_B = carry
    r_B, v_B, m_B = xs
    delta_B = r_B + gamma * next_value_B - v_B
    adv_B = delta_B + gamma * lam * next_adv_B
    valid_B = m_B > 0
    carry = (jnp.where(valid_B, v_B, next_value_B), jnp.where(valid_B, adv_B, next_adv_B))
    return carry, adv_B * m_B

  zeros_B = jnp.zeros_like(r[:, 0])  # varies over a shard_map axis like r
  _, adv_TxB = jax.lax.scan(step, (zeros_B, zeros_B), (r.T, v.T, m.T), reverse=True)
  adv = adv_TxB.T
  return adv, (adv + v) * m
