"""The import graph of `jrl/`: no circles, and nothing under `jrl/trainers`
imports the trainers' registry (`jrl/trainers/__init__.py`).

Edges are read from the source (every `import` and `from ... import`, at
module level or inside functions), so a lazy import that would close a
circle counts too. `from a.b import c` is an edge to the module `a.b.c` when
that file exists, else to `a.b`.
"""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules():
  """{'jrl.x.y': path} for every Python file under jrl/."""
  out = {}
  for root, _, files in os.walk(os.path.join(REPO, 'jrl')):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(root, name)
        parts = os.path.relpath(path, REPO)[: -len('.py')].split(os.sep)
        if parts[-1] == '__init__':
          parts = parts[:-1]
        out['.'.join(parts)] = path
  return out


def _resolve(name, modules):
  """The longest prefix of a dotted name that is a module of jrl (or None)."""
  parts = name.split('.')
  while parts:
    candidate = '.'.join(parts)
    if candidate in modules:
      return candidate
    parts.pop()
  return None


def import_graph():
  """{module: set of jrl modules it imports}."""
  modules = _modules()
  graph = {}
  for module, path in modules.items():
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read(), path)
    package = module if path.endswith('__init__.py') else module.rpartition('.')[0]
    edges = set()
    for node in ast.walk(tree):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ''
        if node.level:
          anchor = package.split('.')
          anchor = anchor[: len(anchor) - (node.level - 1)]
          base = '.'.join(anchor + ([base] if base else []))
        # `from a import b`: the module a.b if it exists, else a.
        full = [f'{base}.{a.name}' for a in node.names]
        names = [n if _resolve(n, modules) == n else base for n in full]
      for name in names:
        target = _resolve(name, modules)
        if target is not None and target != module:
          edges.add(target)
    graph[module] = edges
  return graph


def find_cycle(graph):
  """One import circle as a list of modules (first == last), or None."""
  state = {}  # module -> 1 on the stack, 2 done
  stack = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return stack[stack.index(nxt) :] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    stack.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_find_cycle_finds_a_circle_and_passes_a_tree():
  assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': set()}) is None
  assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']


def test_import_graph_reads_from_imports_as_modules():
  graph = import_graph()
  assert 'jrl.trainers.common' in graph['jrl.trainers.grpo']
  assert 'jrl.trainers.grpo' in graph['jrl.trainers']


def test_jrl_has_no_import_circle():
  cycle = find_cycle(import_graph())
  assert cycle is None, 'import circle: ' + ' -> '.join(cycle)


def test_no_trainer_module_imports_the_registry():
  graph = import_graph()
  importers = [m for m, edges in graph.items() if 'jrl.trainers' in edges]
  assert importers == [], importers
