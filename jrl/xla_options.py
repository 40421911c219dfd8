"""XLA options of one phase's programs, written as XLA_FLAGS are.

`XLA_FLAGS` sets the options of every program a process compiles. A colocated
run samples and trains in one process, and the fastest settings of the two
phases differ (on a 2-core AMD EPYC, XLA's own dot emitter made the update 7%
faster with half the temporaries while YNNPACK's dots decoded 8-12% faster;
docs/benchmarks.md). `train.xla_flags` gives the training programs options of
their own through `jax.jit(..., compiler_options=...)`; the process's
`XLA_FLAGS` still apply to everything else.

    parse('--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_xnnpack=true')
    -> {'xla_cpu_experimental_ynn_fusion_type': '', 'xla_cpu_use_xnnpack': True}
"""

import jax
import jax.numpy as jnp


def _value(text):
  """An option's value as XLA's option setter takes it: a bool for
  true / false, an int for digits, else the string."""
  low = text.lower()
  if low in ('true', 'false'):
    return low == 'true'
  try:
    return int(text)
  except ValueError:
    return text


def parse(flags, field='train.xla_flags'):
  """{option: value} of `flags` ('--name=value' words, spaces between; a bare
  '--name' is true); None when `flags` is empty. Raises ValueError naming
  `field` for a word that is not an XLA option."""
  options = {}
  for word in str(flags).split():
    name, eq, value = word.partition('=')
    if not name.startswith('--xla_') or len(name) <= len('--xla_'):
      raise ValueError(
        f'`{field}`: {word!r} is not an XLA option (options are written '
        "'--xla_<name>=<value>', as in XLA_FLAGS)."
      )
    options[name[2:]] = _value(value) if eq else True
  return options or None


def check(flags, field='train.xla_flags'):
  """`parse(flags)`, with each option set on a program compiled here, so that
  an option this jaxlib lacks or a value of the wrong kind is named before a
  run starts. Raises ValueError naming `field`."""
  options = parse(flags, field)
  if options:
    try:
      jax.jit(jnp.negative, compiler_options=options).lower(jnp.float32(1)).compile()
    except Exception as e:  # XLA's own message names the option
      raise ValueError(f'`{field}`: XLA refuses {flags!r}: {e}') from None
  return options
