"""On-policy distillation's advantage (`jrl.losses.distill`), against values
computed by hand here: the per-token reverse KL to the teachers' weighted
log-probabilities, clipped, discounted to go over the response (skipping
environment tokens), zero on left-out rows; and errors naming the argument.
"""

import numpy as np
import pytest

import jrl.losses as L

STUDENT = np.array([[0.0, -1.0, -0.5, -2.0, 0.0], [0.0, -0.2, -3.0, -0.1, -0.7]], np.float32)
T1 = np.array([[0.0, -0.5, -1.5, -1.0, 0.0], [0.0, -0.2, -0.5, -2.1, -0.1]], np.float32)
T2 = np.array([[0.0, -2.0, -0.5, -0.2, 0.0], [0.0, -1.2, -1.0, -0.1, -0.4]], np.float32)
# Row 0: a prompt token, three response tokens, padding. Row 1: a prompt
# token, a model token, an environment token (masked), two model tokens.
MASK = np.array([[0, 1, 1, 1, 0], [0, 1, 0, 1, 1]], np.float32)


def hand_rewards(weights, clip=0.0):
  r = np.zeros_like(STUDENT)
  for b in range(2):
    for t in range(5):
      if MASK[b, t]:
        teacher = weights[0] * T1[b, t] + weights[1] * T2[b, t]
        r[b, t] = teacher - STUDENT[b, t]
        if clip:
          r[b, t] = min(max(r[b, t], -clip), clip)
  return r


def hand_to_go(r, gamma):
  out = np.zeros_like(r)
  for b in range(2):
    steps = [t for t in range(5) if MASK[b, t]]
    for i, t in enumerate(steps):
      out[b, t] = sum(gamma**j * r[b, s] for j, s in enumerate(steps[i:]))
  return out


@pytest.mark.parametrize('weights', [(1.0, 0.0), (0.25, 0.75), (0.5, 0.5)])
def test_per_token_advantage_is_the_weighted_reverse_kl(weights):
  adv = L.distillation_advantages(STUDENT, np.stack([T1, T2]), weights, MASK)
  np.testing.assert_allclose(adv, hand_rewards(weights), atol=1e-6)
  assert np.all(np.asarray(adv)[MASK == 0] == 0)


def test_clip_bounds_each_token_and_discount_sums_to_go_over_model_tokens():
  w = (0.25, 0.75)
  adv = L.distillation_advantages(STUDENT, np.stack([T1, T2]), w, MASK, clip=0.5, discount=0.9)
  np.testing.assert_allclose(adv, hand_to_go(hand_rewards(w, clip=0.5), 0.9), atol=1e-6)
  # γ = 1: the undiscounted reverse KL to go; its first token sums the row.
  adv = L.distillation_advantages(STUDENT, np.stack([T1, T2]), w, MASK, discount=1.0)
  np.testing.assert_allclose(np.asarray(adv)[:, 1], hand_rewards(w).sum(1), atol=1e-5)


def test_a_teacher_equal_to_the_student_gives_zero_and_left_out_rows_get_zero():
  adv = L.distillation_advantages(STUDENT, STUDENT[None], (1.0,), MASK, discount=0.5)
  np.testing.assert_array_equal(adv, np.zeros_like(STUDENT))
  adv = L.distillation_advantages(
    STUDENT, np.stack([T1, T2]), (0.5, 0.5), MASK, valid=np.array([True, False])
  )
  np.testing.assert_allclose(adv[0], hand_rewards((0.5, 0.5))[0], atol=1e-6)
  np.testing.assert_array_equal(adv[1], np.zeros(5))


def test_metrics_are_the_mean_reverse_kl_and_teacher_probability():
  got = L.distillation_metrics(STUDENT, T1, MASK)
  m = MASK > 0
  assert float(got['distill/reverse_kl']) == pytest.approx(float((STUDENT - T1)[m].mean()))
  assert float(got['distill/teacher_prob']) == pytest.approx(float(np.exp(T1)[m].mean()))


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match='`weights`'):
    L.distillation_advantages(STUDENT, np.stack([T1, T2]), (1.0,), MASK)
  with pytest.raises(ValueError, match='`teacher_logp`'):
    L.distillation_advantages(STUDENT, T1, (1.0,), MASK)
  with pytest.raises(ValueError, match='`discount`'):
    L.distillation_advantages(STUDENT, T1[None], (1.0,), MASK, discount=1.5)
  with pytest.raises(ValueError, match='`clip`'):
    L.distillation_advantages(STUDENT, T1[None], (1.0,), MASK, clip=-1.0)
