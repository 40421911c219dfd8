"""A new algorithm is one module plus its config: this file is such a module.

`answer_nll` is an algorithm jrl does not have (the negative log-likelihood
of the task's answers, scaled by `nll.coef`, with its own optimiser
settings): its loss and step, its config section with its checks and
defaults, its job and its record are all below, and the test registers
it and runs it with nothing else in jrl or configs/ edited: the config gets
its section from the record, the checks name its fields, the controller
counts its steps, checkpoints it and writes its metrics.
"""

import functools
import time

import jax
import ml_collections
import optax
import pytest

from configs import common as config_common
from configs import grpo_arith
from jrl import distributed, trainers
from jrl import losses as L
from jrl.trainers import checks, common, controller, setup, sft, signals
from jrl.trainers.evaluation import held_out, standalone
from jrl.trainers.rollouts import engines
from tests.helpers import QUIET, records, set_fields

# The update: pure functions, jitted at the boundary ---------------------------------


def nll_loss(params, graphdef, batch, coef):
  """coef · mean over response tokens of −log p(token); batch: a SequenceBatch
  of [B, T] rows (prompt, answer, end of sequence)."""
  logp, _ = common.token_logprobs(graphdef, params, batch.tokens, batch.mask, None)
  nll = -L.token_mean(logp, batch.loss_mask)
  return coef * nll, nll


def train_step(state, batch, *, graphdef, tx, schedule, coef):
  """One optimiser step; returns (state, metrics) under the prefix 'nll/'."""
  (loss, nll), grads = jax.value_and_grad(nll_loss, has_aux=True)(
    state.params, graphdef, batch, coef
  )
  state, opt = common.apply_gradients(state, grads, loss, tx, schedule)
  return state, {'nll/loss': loss, 'nll/nll': nll, **{f'nll/{k}': v for k, v in opt.items()}}


# Its config section: fields, defaults, checks ---------------------------------------


def nll_section():
  s = ml_collections.ConfigDict()
  s.steps = 4  # iterations
  s.batch_size = 8  # examples per step
  s.lr = 3e-3  # Adam's learning rate
  s.coef = 1.0  # the loss's scale
  return s


def check(config, batch_shards):
  checks.batch_divides(config.nll.batch_size, 'nll.batch_size', batch_shards)


SECTION = checks.Section(
  'nll',
  {
    'nll.steps': checks.count(1),
    'nll.batch_size': checks.count(1),
    'nll.lr': checks.positive(),
    'nll.coef': checks.positive(),
  },
  check,
  defaults=nll_section,
)
SECTIONS = (SECTION, engines.SAMPLER)  # the sampler: the held-out evaluation's


# Its job: the run, set up; one iteration -------------------------------------------


class AnswerNLL(controller.Job):
  def __init__(self, config):
    self.config = config
    self.resources, _ = setup.start(config, SECTIONS)
    tx, schedule = optax.adam(config.nll.lr), optax.constant_schedule(config.nll.lr)
    self.state = setup.new_state(self.resources.params, tx, self.resources.mesh)
    model = self.resources.model.graphdef
    self.step = jax.jit(
      functools.partial(train_step, graphdef=model, tx=tx, schedule=schedule, coef=config.nll.coef),
      donate_argnums=(0,),
      out_shardings=setup.step_shardings(self.state, self.resources.mesh),
    )
    self.stream = self.resources.streams['rl_stream']
    self.rows = distributed.local_rows(self.resources.batch_sharding, config.nll.batch_size)
    self.evaluator = held_out.Evaluator(self.resources)

  def iterate(self, state, iteration):
    resources, size = self.resources, self.config.nll.batch_size
    examples = self.stream.next(size, self.rows)  # this process's rows
    batch = sft.response_batch(resources, examples, iteration)  # prompt, answer, eos
    start = time.perf_counter()
    state, metrics = self.step(state, common.place_rows(batch, resources.batch_sharding, size))
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    metrics['time/update'] = time.perf_counter() - start
    return state, signals.Report(metrics, signals.skipped(metrics, ('nll',)))

  def evaluate(self, state):
    return self.evaluator(state)

  def close(self):
    self.evaluator.close()


ALGORITHM = checks.Algorithm(
  'answer_nll', AnswerNLL, SECTIONS, steps_section='nll', standalone_eval=True
)


# The test -------------------------------------------------------------------------


def test_an_algorithm_of_its_own_is_one_module_and_its_config(tmp_path, monkeypatch):
  monkeypatch.setitem(checks.REGISTRY, ALGORITHM.name, ALGORITHM)
  # Its config: the shared sections and its own, at the defaults its module gives.
  config = config_common.base('answer_nll')
  assert {k for k, v in config.items() if hasattr(v, 'items')} == {*checks.SHARED, 'nll', 'sampler'}
  assert config.nll.to_dict() == nll_section().to_dict()
  # A config of it keeping the default job's model and task.
  config = config_common.derive(grpo_arith.get_config('smoke'), 'answer_nll')
  config = set_fields(config, {**QUIET, 'workdir': str(tmp_path), 'nll.steps': 6})
  config.nll.lr = 0.0
  with pytest.raises(ValueError, match=r'`nll\.lr`'):
    trainers.validate(config)
  config.nll.lr = 3e-3
  trainers.validate(config)
  assert checks.iterations(config) == 6
  assert standalone.supports(config)  # `jrl eval` scores its checkpoints
  # It runs: the controller counts its steps, writes its metrics, checkpoints it.
  state = trainers.run(config)
  logged = records(tmp_path)
  assert [r['step'] for r in logged] == list(range(1, 7)) and int(state.step) == 6
  assert all(r['nll/nonfinite'] == 0.0 for r in logged)
  assert logged[-1]['nll/nll'] < logged[0]['nll/nll']  # it learns the answers
  assert (tmp_path / 'checkpoints').is_dir()
