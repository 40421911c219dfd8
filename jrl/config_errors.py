"""`--config.x=y` overrides, checked before absl and ml_collections parse them.

On a locked config a misspelt override (`--config.rl.setps=5`) fails deep
inside ml_collections with a traceback, and a value of the wrong type
(`--config.rl.steps=abc`) with absl's generic message. The launch scripts
that take `--config` parse their flags with `parse_flags`, which says instead,
in one line, and exits with status 2 (a usage error):

    unknown config field 'rl.setps' in configs/grpo_arith.py; did you mean 'rl.steps'?
    config field 'rl.steps' in configs/grpo_arith.py expects int, got 'abc'

    app.run(main, flags_parser=config_errors.parse_flags)

Everything else (a config file that fails to load, flag order, tuples) is
left to absl and ml_collections, whose messages are unchanged. The config
file is loaded once more for the check, only when there are overrides.
"""

import difflib
import re
import sys

import ml_collections
from absl import app, flags
from ml_collections.config_flags import config_flags

# Fields that moved to another section: the message names the new place.
MOVED = {
  'rl.max_prompt_len': 'task.max_prompt_len',
  'rl.max_new_tokens': 'task.max_response_len',
  'rl.chunk_size': 'train.chunk_size',
  'rl.packing': 'train.packing',
  'rl.pack_row_len': 'train.pack_row_len',
  'rl.micro_batch_tokens': 'train.micro_batch_tokens',
  'rl.temperature': 'sampling.temperature',
  'rl.top_k': 'sampling.top_k',
  'rl.top_p': 'sampling.top_p',
}

# Field types whose values are checked here, with the parsers ml_collections uses for them.
_PARSERS = {int: flags.IntegerParser(), float: flags.FloatParser(), bool: flags.BooleanParser()}


def field_paths(config, prefix=''):
  """The dotted paths of every field of `config` that is not a section."""
  paths = []
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      paths += field_paths(value, f'{prefix}{key}.')
    else:
      paths.append(f'{prefix}{key}')
  return paths


def suggest(path, paths):
  """The fields of `paths` a misspelt `path` most likely meant (at most 3):
  a close name in the same section (`rl.setps` -> `rl.steps`), else a close
  path (`optm.lr` -> `optim.lr`), else a close name in any section (`rl.lr` ->
  `optim.lr`, `sft.lr`)."""
  section, _, name = path.rpartition('.')
  siblings = {p.rpartition('.')[2]: p for p in paths if p.rpartition('.')[0] == section}
  close = difflib.get_close_matches(name, list(siblings), n=3)
  if close:
    return [siblings[n] for n in close]
  close = difflib.get_close_matches(path, paths, n=3, cutoff=0.8)
  if close:
    return close
  by_name = {}
  for p in paths:
    by_name.setdefault(p.rpartition('.')[2], []).append(p)
  close = difflib.get_close_matches(name, list(by_name), n=3)
  return [p for n in close for p in by_name[n]][:3]


def _field_type(config, path):
  """The type of field `path` of `config`; None if there is no such field."""
  *sections, name = path.split('.')
  node = config
  for section in sections:
    if not isinstance(node, ml_collections.ConfigDict) or section not in node:
      return None
    node = node[section]
  if not isinstance(node, ml_collections.ConfigDict) or name not in node:
    return None
  return node.get_type(name)


def check(config, overrides, source):
  """A one-line message for the first bad override, or None.

  overrides: [(dotted path, value as typed or None)]; None is a bare
    `--config.x` (true for a bool) or a value this check leaves alone.
  source: the config file, for the message.
  """
  for path, value in overrides:
    if '[' in path:  # an item of a sequence: ml_collections checks it
      continue
    field_type = _field_type(config, path)
    if field_type is None:
      message = f'unknown config field {path!r} in {source}'
      section = path.partition('.')[0]
      close = suggest(path, field_paths(config))
      if MOVED.get(path) and _field_type(config, MOVED[path]) is not None:
        close = [MOVED[path]]
        message += ' (moved)'
      elif '.' in path and section not in config:
        message += (
          f' (algorithm {config.get("algorithm")!r} has no `{section}` section: '
          'configs/README.md lists what each reads)'
        )
      if close:
        message += '; did you mean ' + ' or '.join(repr(p) for p in close) + '?'
      return message
    if value is not None and field_type in _PARSERS:
      try:
        _PARSERS[field_type].parse(value)
      except (TypeError, ValueError):
        return f'config field {path!r} in {source} expects {field_type.__name__}, got {value!r}'
  return None


def overrides_in(argv, name='config'):
  """(the `--config` argument or None, [(path, value or None, written with '=')]) of a
  command line. A value without '=' is the next argument (None for `--noconfig.x`)."""
  config_arg, overrides = None, []
  override = re.compile(rf'^--?(no)?{re.escape(name)}\.(.+)$')
  for i, arg in enumerate(argv):
    if config_arg is None and re.match(rf'^--?{re.escape(name)}(=|$)', arg):
      config_arg = arg.partition('=')[2] if '=' in arg else (argv[i + 1 : i + 2] or [None])[0]
      continue
    match = override.match(arg)
    if not match:
      continue
    negated, rest = match.groups()
    path, eq, value = rest.partition('=')
    if negated:
      value = None
    elif not eq:
      value = argv[i + 1] if i + 1 < len(argv) else None
    overrides.append((path, value, bool(negated or eq)))
  return config_arg, overrides


def check_argv(argv, name='config'):
  """A one-line message for the first bad `--config.x=y` of a command line, or None
  (also when the config file does not load: ml_collections reports that)."""
  try:
    argv = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)  # --flagfile=...
  except flags.Error:
    return None
  config_arg, found = overrides_in(argv, name)
  if not config_arg or not found:
    return None
  try:
    config = config_flags.ConfigFileFlagParser(name, lock_config=True).parse(config_arg)
  except Exception:  # absl reports the config file's own error next
    return None
  if not isinstance(config, ml_collections.ConfigDict):
    return None
  overrides = []
  for path, value, explicit in found:
    # `--config.log.plot false`: absl does not read a bool's next argument
    if not explicit and _field_type(config, path) is bool:
      value = None
    overrides.append((path, value))
  return check(config, overrides, config_arg.partition(':')[0])


def parse_flags(argv):
  """absl's flag parsing (`app.run(main, flags_parser=parse_flags)`), the
  `--config.x=y` overrides checked first: a bad one exits with status 2."""
  message = check_argv(argv)
  if message:
    sys.stderr.write(message + '\n')
    sys.exit(2)
  return app.parse_flags_with_usage(argv)
