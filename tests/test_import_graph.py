"""The import graph of hybridkv.*: no cycles (function-local imports included), no private names
imported across modules.

Every source file of the packages in pyproject's `package-dir` is parsed with `ast`; each
`import` / `from ... import` anywhere in it (module level or inside a function) is an edge to the
module it names: `from pkg import sub` to the submodule `pkg.sub`, `from mod import name` to `mod`.
Imports under `if TYPE_CHECKING:` count too: a cycle that only type checkers see is still two
modules that know each other. The implicit import of a package's `__init__` by one of its submodules is not an edge.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# issue 23: being removed. Imports that close a cycle today, in files other engineers are
# rewriting now: (importer, imported module) -> where. The graph without these edges must have no
# cycle; a cycle through any other import fails the test. Delete an entry once its import is gone.
KNOWN_CYCLES: dict[tuple[str, str], str] = {}

# Private names imported across modules: (importer, imported module, name). Any private import
# fails the test; an entry here would say why one is tolerated (none is now).
KNOWN_PRIVATE_IMPORTS: frozenset[tuple[str, str, str]] = frozenset()


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: set[str] = field(default_factory=set)  # internal modules it imports
    private: set[tuple[str, str]] = field(default_factory=set)  # (module, private name) it takes


def _package_dirs() -> dict[str, Path]:
    """pyproject's [tool.setuptools.package-dir]: package -> its folder (read without tomllib,
    which Python 3.10 lacks)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [tool.setuptools.package-dir]"
    pairs = re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section.group(1), re.M)
    return {pkg: ROOT / d for pkg, d in pairs}


def _module_files() -> dict[str, Module]:
    """Every module of hybridkv.*, by dotted name (a directory mapped to another package is
    that package's, not its parent's)."""
    dirs = _package_dirs()
    mapped = {d.resolve() for d in dirs.values()}
    mods: dict[str, Module] = {}
    for pkg, d in dirs.items():
        for path in sorted(d.rglob("*.py")):
            rel = path.relative_to(d)
            if any((d / p).resolve() in mapped for p in rel.parents if str(p) != "."):
                continue  # inside a directory of its own package
            parts = [pkg, *rel.with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            mods[".".join(parts)] = Module(".".join(parts), path, is_package)
    return mods


def _import_nodes(node: ast.AST):
    """Every Import / ImportFrom under `node`, at any depth."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        else:
            yield from _import_nodes(child)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _scan(mod: Module, mods: dict[str, Module]) -> None:
    tree = ast.parse(mod.path.read_text(), str(mod.path))
    package = mod.name if mod.is_package else mod.name.rpartition(".")[0]

    def known(name: str) -> str | None:  # the longest prefix of `name` that is one of ours
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    bound: dict[str, str] = {}  # a local name -> the module of ours it names (for `m._x` below)
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = known(alias.name)
                if target:
                    mod.imports.add(target)
                    local = alias.asname or alias.name.partition(".")[0]
                    bound[local] = alias.name if alias.asname else local
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if known(source) is None:
            continue
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in mods:
                mod.imports.add(sub)
                bound[alias.asname or alias.name] = sub
                # a private submodule is its package's business
                if _private(alias.name) and not mod.name.startswith(source + "."):
                    mod.private.add((source, alias.name))
                continue
            mod.imports.add(known(source))
            if _private(alias.name) and known(source) != mod.name:
                mod.private.add((known(source), alias.name))
    for node in ast.walk(tree):  # `module._name` where `module` is one of ours bound by an import
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                target = ".".join([bound[value.id], *reversed(chain)])
                if target in mods and target != mod.name:
                    mod.private.add((target, node.attr))


@lru_cache(maxsize=1)
def import_graph() -> dict[str, Module]:
    mods = _module_files()
    for mod in mods.values():
        _scan(mod, mods)
        mod.imports.discard(mod.name)
    return mods


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with a cycle (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.add(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
            elif w not in index:
                index[w] = low[w] = counter
                counter += 1
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return out


def _a_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """One shortest cycle through the first module of `comp` (for the message)."""
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def _edges() -> dict[str, set[str]]:
    return {name: set(m.imports) for name, m in import_graph().items()}


def test_the_graph_sees_every_package_and_local_imports():
    mods = import_graph()
    for pkg in _package_dirs():
        assert pkg in mods, f"{pkg}: no __init__.py found"
    # a function-local import is an edge (cli imports the server inside a function)
    assert "hybridkv.server.app" in mods["hybridkv.cli"].imports


def test_no_new_import_cycles():
    graph = _edges()
    for importer, imported in KNOWN_CYCLES:
        graph.get(importer, set()).discard(imported)
    bad = [f"{' -> '.join(_a_cycle(graph, comp))}\n    (the whole cycle: {', '.join(sorted(comp))})"
           for comp in _components(graph)]
    assert not bad, "import cycles (function-local imports count):\n  " + "\n  ".join(bad)


def test_no_private_names_imported_across_modules():
    bad = sorted((m.name, src, name) for m in import_graph().values() for src, name in m.private
                 if (m.name, src, name) not in KNOWN_PRIVATE_IMPORTS)
    assert not bad, "private names imported from another module:\n  " + "\n  ".join(
        f"{m}: from {src} import {name}" for m, src, name in bad)
