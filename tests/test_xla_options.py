"""`train.xla_flags`: XLA options of the training programs only."""

import jax
import jax.numpy as jnp
import pytest

from jrl import xla_options
from tests.helpers import QUIET, shrunk_config


def test_flags_parse_as_xla_flags_are_written():
  got = xla_options.parse(
    '--xla_cpu_experimental_ynn_fusion_type=  --xla_cpu_use_xnnpack=TRUE '
    '--xla_cpu_parallel_codegen_split_count=4 --xla_dump_to=/tmp/x --xla_cpu_enable_fast_math'
  )
  assert got == {
    'xla_cpu_experimental_ynn_fusion_type': '',
    'xla_cpu_use_xnnpack': True,
    'xla_cpu_parallel_codegen_split_count': 4,
    'xla_dump_to': '/tmp/x',
    'xla_cpu_enable_fast_math': True,
  }
  assert xla_options.parse('') is None and xla_options.parse('  ') is None


@pytest.mark.parametrize('flags', ['xla_cpu_use_xnnpack=true', '--use_xnnpack=true', '--xla_'])
def test_a_word_that_is_no_xla_option_is_named(flags):
  with pytest.raises(ValueError, match=r'`train.xla_flags`: .* is not an XLA option'):
    xla_options.parse(flags)


@pytest.mark.parametrize('flags', ['--xla_no_such_option_here=1', '--xla_cpu_use_xnnpack=maybe'])
def test_an_option_xla_refuses_is_named_before_a_run_starts(flags, tmp_path):
  with pytest.raises(ValueError, match=r'`train\.xla_flags`: XLA refuses'):
    xla_options.check(flags)
  from jrl import trainers

  config = shrunk_config(tmp_path, {**QUIET, 'train.xla_flags': flags})
  with pytest.raises(ValueError, match=r'train\.xla_flags'):
    trainers.build(config)


def test_the_options_reach_the_training_programs_only():
  """XLA:CPU emits dots as YNNPACK fusions by default; the option that turns
  that off applies to the program jitted with it and to no other."""
  if jax.default_backend() != 'cpu':
    pytest.skip('an XLA:CPU option')
  options = xla_options.check('--xla_cpu_experimental_ynn_fusion_type=')
  f = lambda a, b: jnp.tanh(a @ b) @ b
  a, b = jnp.ones((64, 128)), jnp.ones((128, 128))
  plain = jax.jit(f).lower(a, b).compile().as_text()
  with_options = jax.jit(f, compiler_options=options).lower(a, b).compile().as_text()
  assert '__ynn_fusion' in plain and '__ynn_fusion' not in with_options
  assert float(jax.jit(f, compiler_options=options)(a, b)[0, 0]) == pytest.approx(
    float(jax.jit(f)(a, b)[0, 0]), rel=1e-6
  )


def test_a_run_compiles_its_training_programs_with_them_and_its_sampler_without(tmp_path):
  """`--xla_dump_to` in `train.xla_flags`: the programs of the update (the
  SFT warm-up's and the RL step's) and of the reference pass are written
  there, the sampler's are not, and the run trains on."""
  from jrl import trainers
  from jrl.trainers import controller

  dump = tmp_path / 'dump'
  config = shrunk_config(
    tmp_path / 'run', {**QUIET, 'rl.kl_coef': 0.1, 'train.xla_flags': f'--xla_dump_to={dump}'}
  )
  job = trainers.build(config)
  try:
    state = job.state
    for it in range(config.sft.steps + 1):
      if it == config.sft.steps:
        state = job.start_rl(state)
      state, report = job.iterate(state, it)
  finally:
    controller.close(job)
  assert all(jnp.isfinite(v) for v in report.metrics.values() if isinstance(v, float))
  names = {p.name.split('.')[1] for p in dump.iterdir() if p.name.startswith('module_')}
  assert {'jit_train_step', 'jit_token_logprobs'} <= names, names
  assert not names & {'jit_generate', 'jit_admit', 'jit_stage'}, names  # the sampler's
