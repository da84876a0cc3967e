"""The house rules of docs/architecture.md, read off the source: imports point one way, the model stays the math,
functions stay short. Each rule reads every file of jaxseek/ with `ast` (nothing is imported or run)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxseek"
MODEL_LINES = 1600  # model/ as one sitting's read
FUNCTION_LINES = 60
POSITIONAL = 10  # parameters a caller may pass by position
FLAGS = 5  # positional parameters with defaults
# private names of other libraries, each with its reason in a comment at the import
PRIVATE_ALLOWED = {
    ("kernels/gpu.py", "tokamax._src.ops.attention"),  # tokamax 0.0.12 has no public key-range mask
    ("checkpoint.py", "orbax.checkpoint._src.metadata"),  # orbax has no public array-metadata store
}


def modules() -> dict[str, pathlib.Path]:
  """Dotted module name → file, for every module of jaxseek/."""
  found = {}
  for path in sorted(ROOT.rglob("*.py")):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return found


def imports(name: str, path: pathlib.Path, known: dict) -> set[str]:
  """The jaxseek modules `name` imports anywhere in its file (inside functions too: a circle through a deferred
  import is still a circle). `from package import module` counts as the module."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.split(".")[0] == "jaxseek"}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([node.module] if node.module else []))
      if base.split(".")[0] != "jaxseek":
        continue
      for alias in node.names:
        found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
  return found - {name}


def graph() -> dict[str, set[str]]:
  known = modules()
  return {name: imports(name, path, known) for name, path in known.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
  """One import circle (its modules in order), or None. A package's __init__ is left out as a target when it is
  the importer's own package (importing a submodule runs it, but it names no circle of the code's design)."""
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node], _ = 1, stack.append(node)
    for target in sorted(edges.get(node, ())):
      if state.get(target) == 1:
        return stack[stack.index(target):] + [target]
      if target not in state and (found := visit(target)):
        return found
    state[node], _ = 2, stack.pop()
    return None

  for node in sorted(edges):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_the_import_graph_has_no_circle():
  found = cycle(graph())
  assert found is None, "import circle: " + " → ".join(found)


def test_the_cycle_finder_finds_a_circle_through_a_deferred_import():
  """The rule above can fail: a circle of three, and jaxseek's own graph with one edge added back."""
  assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  edges = graph()
  edges["jaxseek.kernels.choice"] = edges["jaxseek.kernels.choice"] | {"jaxseek.sharding.experts"}
  assert cycle(edges) is not None


@pytest.mark.parametrize("room, never", [
    ("jaxseek.model", ("jaxseek.pipeline", "jaxseek.kernels.choice", "jaxseek.explore", "jaxseek.step",
                       "jaxseek.objective", "jaxseek.train", "jaxseek.checkpoint")),
    ("jaxseek.kernels", ("jaxseek.model", "jaxseek.pipeline", "jaxseek.explore", "jaxseek.step")),
    ("jaxseek.sharding", ("jaxseek.model", "jaxseek.pipeline", "jaxseek.explore", "jaxseek.step")),
    ("jaxseek.pipeline", ("jaxseek.explore", "jaxseek.step", "jaxseek.objective", "jaxseek.train")),
])
def test_imports_point_down(room, never):
  """docs/architecture.md's never-rules: the model uses kernels/ and sharding/, never the pipeline that runs it,
  the kernels' choice tables, the explorer or the trainer; kernels and sharding never reach back up."""
  wrong = sorted(f"{name} imports {target}" for name, targets in graph().items()
                 if name == room or name.startswith(room + ".")
                 for target in targets if any(target == n or target.startswith(n + ".") for n in never))
  assert not wrong, wrong


def test_the_model_reads_in_one_sitting():
  lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "model").glob("*.py"))
  assert lines <= MODEL_LINES, f"jaxseek/model/ is {lines} lines"


def functions():
  for path in sorted(ROOT.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield path.relative_to(ROOT), node


def test_no_function_is_over_sixty_lines():
  long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
          for path, node in functions() if node.end_lineno - node.lineno + 1 > FUNCTION_LINES]
  assert not long, long


def test_no_function_takes_a_wall_of_positional_flags():
  wall = [f"{path}:{node.lineno} {node.name}" for path, node in functions()
          if len(node.args.posonlyargs + node.args.args) > POSITIONAL or len(node.args.defaults) > FLAGS]
  assert not wall, wall


def test_no_private_name_is_imported_across_modules():
  """Neither another module's _name nor a library's private package, except the notes in PRIVATE_ALLOWED."""
  found = []
  for path in sorted(ROOT.rglob("*.py")):
    where = str(path.relative_to(ROOT))
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module != "__future__":
        module = node.module or ""
        private = any(part.startswith("_") for part in module.split(".")) or \
            any(a.name.startswith("_") for a in node.names)
        if private and not any(where == w and module.startswith(m) for w, m in PRIVATE_ALLOWED):
          found.append(f"{where}:{node.lineno} from {module} import {', '.join(a.name for a in node.names)}")
  assert not found, found
