"""The package map: jmoe's packages import downward only, in the order jmoe/__init__.py gives
(a package may import only those before it), counting imports inside functions; no source file
is longer than one sitting's reading."""

import ast
import pathlib

JMOE = pathlib.Path(__file__).resolve().parents[1] / "jmoe"


def package_order() -> list[str]:
  """The order jmoe/__init__.py gives, lowest first (the lines after "in this order" that chain
  names with "<-"); top-level modules count as packages."""
  doc = ast.get_docstring(ast.parse((JMOE / "__init__.py").read_text()))
  lines = doc.split("in this order", 1)[1].splitlines()[1:]
  chain = " ".join(line for line in lines[:next(i for i, line in enumerate(lines)
                                                 if "<-" not in line)])
  return [name.strip() for name in chain.split("<-")]


ORDER = package_order()


def imports() -> dict[str, set[str]]:
  """jmoe's package -> the jmoe packages its files import (a `__main__.py` is left out)."""
  edges: dict[str, set[str]] = {}
  for path in JMOE.rglob("*.py"):
    parts = path.relative_to(JMOE).parts
    if parts[-1] == "__main__.py" or parts == ("__init__.py",):
      continue
    me = parts[0].removesuffix(".py")
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [node.module]
      elif isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      else:
        continue
      for name in names:
        top = name.split(".")
        if top[0] == "jmoe" and len(top) > 1 and top[1] != me:
          edges.setdefault(me, set()).add(top[1])
  return edges


def test_packages_import_downward_only():
  edges = imports()
  assert set(edges) | {p for deps in edges.values() for p in deps} <= set(ORDER), \
      "a new package: give it its place in ORDER (and in jmoe/__init__.py)"
  upward = sorted(f"{me} imports {dep}" for me, deps in edges.items() for dep in deps
                  if ORDER.index(dep) > ORDER.index(me))
  assert not upward, upward


def test_ops_stand_on_nothing_of_jmoe_but_its_errors():
  assert imports().get("ops", set()) <= {"errors"}


def test_files_stay_short():
  long = {str(p.relative_to(JMOE)): n for p in JMOE.rglob("*.py")
          if (n := len(p.read_text().splitlines())) > 420}
  assert not long, long


def test_the_api_functions_stay_callable_once_their_commands_are_imported(monkeypatch):
  """`import jmoe.generate` (the command) binds the module on the package: `jmoe.generate(...)`
  and `jmoe.score(...)` still call the Python API's functions."""
  import importlib
  import jmoe
  from jmoe import api
  for name in ("generate", "score"):
    importlib.import_module(f"jmoe.{name}")
    monkeypatch.setattr(api, name, lambda *args, **kwargs: (args, kwargs))
    assert getattr(jmoe, name)(1, x=2) == ((1,), {"x": 2})
