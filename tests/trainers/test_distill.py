"""On-policy distillation in a GRPO run (`jrl.trainers.distill`), on tiny
Hugging Face checkpoints sharing one tokenizer: a Qwen2-layout student and
a Llama-layout teacher.

A teacher equal to the student gives advantages of (numerically) zero; the
teacher pass gives the same advantages on padded, packed and shared-prompt
layouts; with a different teacher (its own weights, sharper), the
student's reverse KL to it (over the whole vocabulary, on the first step's
samples) falls over a few steps;
bad `distill` fields are refused by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import grpo_qwen
from jrl import models, trainers
from jrl.models import hf
from jrl.trainers import controller, distill
from tests import helpers
from tests.trainers.test_algorithms import QUESTIONS, rl_records, shrink, write_jsonl


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp('distill')
  helpers.write_tiny_chat_model(str(root / 'student'))
  helpers.write_tiny_chat_model(str(root / 'teacher'), family='llama')
  sharpen(root / 'teacher' / 'model.safetensors', 5.0)
  # The student's own weights, its logits x 10: a teacher it can reach.
  helpers.write_tiny_chat_model(str(root / 'sharp'))
  sharpen(root / 'sharp' / 'model.safetensors', 10.0)
  rows = [{'prompt': f'What is {a}+{b}?', 'answer': str(a + b)} for a, b in QUESTIONS]
  return root, write_jsonl(root / 'train.jsonl', rows)


def sharpen(path, scale):
  """Scales the final norm of a checkpoint: its logits x `scale`, a peaked
  teacher (a random tiny model is near uniform, as is the student)."""
  from safetensors.numpy import load_file, save_file

  tensors = load_file(str(path))
  tensors['model.norm.weight'] = tensors['model.norm.weight'] * scale
  save_file(tensors, str(path), metadata={'format': 'pt'})


def distill_config(dirs, workdir, overrides=None):
  root, train = dirs
  fields = {
    'model.path': str(root / 'student'),
    'model.compute_dtype': 'float32',
    'task.train_path': train,
    'task.eval_path': '',
    'task.max_prompt_len': 48,
    'task.max_response_len': 8,
    'sft.steps': 0,
    'rl.steps': 1,
    'eval.every': 0,
    'optim.warmup_steps': 0,
    'distill.teachers': (str(root / 'teacher'),),
    **(overrides or {}),
  }
  return shrink(grpo_qwen, workdir, fields)


def run_capturing(config, monkeypatch, batches=None):
  """Trains `config`; returns (the advantages of each iteration, its RL
  records); each iteration's placed rollout batch goes to `batches`."""
  seen = []
  original = distill.advantages

  def recording(teachers, d, rows, generated, *args, **kwargs):
    adv = original(teachers, d, rows, generated, *args, **kwargs)
    seen.append(np.asarray(jax.device_get(adv)))
    if batches is not None:
      batches.append(jax.device_get(generated.batch))
    return adv

  monkeypatch.setattr(distill, 'advantages', recording)
  state = controller.train(trainers.build(config))
  if batches is not None:
    batches.append(jax.device_get(state.params))
  return seen, rl_records(config.workdir)


def exact_reverse_kl(student, teacher, batch):
  """KL(π_s ‖ π_t) over the whole vocabulary, averaged over the response
  positions of `batch` (each a (graphdef, params) pair)."""
  tokens, mask = np.asarray(batch.tokens), np.asarray(batch.mask)
  log_s = jax.nn.log_softmax(models.logits(*student, tokens, mask)[:, :-1], -1)
  log_t = jax.nn.log_softmax(models.logits(*teacher, tokens, mask)[:, :-1], -1)
  kl = (jnp.exp(log_s) * (log_s - log_t)).sum(-1)
  at = np.asarray(batch.loss_mask)[:, 1:] > 0
  return float(np.asarray(kl)[at].mean())


def test_a_teacher_equal_to_the_student_gives_zero_advantage(dirs, tmp_path, monkeypatch):
  root, _ = dirs
  config = distill_config(dirs, tmp_path, {'distill.teachers': (str(root / 'student'),)})
  (adv,), (rec,) = run_capturing(config, monkeypatch)
  assert np.abs(adv).max() < 1e-4  # the sampler's and the trainer's logprobs of one model
  assert abs(rec['distill/reverse_kl']) < 1e-5
  assert 0 < rec['distill/teacher_prob'] <= 1


def test_packed_and_shared_prompt_layouts_give_the_padded_advantages(dirs, tmp_path, monkeypatch):
  advantages = []
  for k, layout in enumerate([{}, {'train.packing': True}, {'train.shared_prompt': True}]):
    fields = {'rl.minibatch_size': 16, **layout}  # whole groups (shared prompts)
    (adv,), _ = run_capturing(distill_config(dirs, tmp_path / str(k), fields), monkeypatch)
    advantages.append(adv)
  padded, *others = advantages
  assert np.abs(padded).max() > 0.1  # a teacher that differs
  for got in others:
    np.testing.assert_allclose(got, padded, atol=2e-5)


def test_the_student_moves_towards_a_different_teacher(dirs, tmp_path, monkeypatch):
  root, _ = dirs
  sharp = str(root / 'sharp')
  fields = {
    'rl.steps': 8,
    'optim.lr': 5e-3,
    'sampling.temperature': 1.0,
    # ~1,000 sampled tokens a step, one on-policy update each: the
    # single-sample estimate's noise averages out.
    'rl.prompts_per_step': 8,
    'rl.group_size': 8,
    'rl.minibatch_size': 64,
    'sampler.num_slots': 64,
    'task.max_response_len': 16,
  }
  config = distill_config(dirs, tmp_path, {**fields, 'distill.teachers': (sharp,)})
  seen = []
  _, recs = run_capturing(config, monkeypatch, seen)
  assert all(np.isfinite(r['distill/reverse_kl']) for r in recs)
  first, trained = seen[0], seen[-1]
  student = hf.load(str(root / 'student'), compute_dtype='float32')
  teacher = hf.load(sharp, compute_dtype='float32')
  before = exact_reverse_kl(student[1:3], teacher[1:3], first)
  after = exact_reverse_kl((student.graphdef, trained), teacher[1:3], first)
  assert after < 0.95 * before, (before, after)  # measured here: 1.507 -> 1.363


def test_bad_distill_fields_are_named(dirs, tmp_path):
  root, _ = dirs
  for overrides, field in [
    ({'distill.teacher_weights': (1.0, 2.0)}, 'distill.teacher_weights'),
    ({'distill.teacher_weights': (-1.0,)}, 'distill.teacher_weights'),
    ({'distill.discount': 1.5}, 'distill.discount'),
    ({'distill.coef': 0.0}, 'distill.coef'),
    ({'distill.teachers': (str(root / 'missing'),)}, 'distill.teachers'),
  ]:
    with pytest.raises(ValueError, match=field.replace('.', r'\.')):
      trainers.build(distill_config(dirs, tmp_path, overrides))
