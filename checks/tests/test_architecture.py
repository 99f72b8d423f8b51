"""The import graph as a static reader sees it (grimp, the engine of import-linter; docs/architecture.md):
every internal import of the checkout resolves to a module (or a name a module defines) with no run-time
path rewriting, and no two modules import each other, even through imports inside functions."""
from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="grimp is a dev dependency: pip install -e '.[dev]'")

import dpep_parity  # noqa: E402

ROOT = Path(dpep_parity.__file__).parent


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("dpep_parity", include_external_packages=False, cache_dir=None)


def cycles(modules, imported_by) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), iteratively."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(imported_by(w)))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_planted_circle_and_passes_a_chain():
    """Negative and positive controls of the circle check itself."""
    assert cycles({"a", "b", "c"}, {"a": {"b"}, "b": {"c"}, "c": {"a"}}.__getitem__) == [["a", "b", "c"]]
    assert cycles({"a", "b", "c"}, {"a": {"b"}, "b": {"c"}, "c": set()}.__getitem__) == []


def test_the_static_graph_holds_every_module_of_the_checkout(graph):
    assert len(graph.modules) == len(_module_paths()) > 150
    assert {"dpep_parity.checks.harness.world", "dpep_parity.evals.gate", "dpep_parity.fixtures.build",
            "dpep_parity.property_tests.test_parity", "dpep_parity.registry"} <= graph.modules


def test_no_module_imports_itself_directly_or_through_others(graph):
    internal = lambda m: {n for n in graph.find_modules_directly_imported_by(m) if n.startswith("dpep_parity")}
    assert [m for m in sorted(graph.modules) if m in internal(m)] == []
    assert cycles(graph.modules, internal) == []


def _defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.For):
            names |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    if "__getattr__" in names:
        names.add("*")          # a module-level __getattr__ (the mutant catalogs) answers any name
    return names


def unresolved_imports(modules: dict[str, Path]) -> list[str]:
    """`file:line import` for every import of a dpep_parity module (absolute or relative, at the top or in a
    function) that names no module of `modules` nor a name such a module defines."""
    defined: dict[str, set[str]] = {}
    out = []
    for name, path in sorted(modules.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else node.module
                targets = [(base, a.name) for a in node.names]
            else:
                continue
            for mod, attr in targets:
                if not mod.startswith("dpep_parity"):
                    continue
                if mod not in modules:
                    out.append(f"{path.name}:{node.lineno} {mod}")
                elif attr is not None and f"{mod}.{attr}" not in modules:
                    names = defined.setdefault(mod, _defined_names(modules[mod]))
                    if attr not in names and "*" not in names:
                        out.append(f"{path.name}:{node.lineno} {mod}.{attr}")
    return out


def _module_paths() -> dict[str, Path]:
    """Every module under the import root, through its links to the top-level folders."""
    out = {}
    for d, _, files in os.walk(ROOT, followlinks=True):
        for f in files:
            if not f.endswith(".py"):
                continue
            p = Path(d) / f
            parts = p.relative_to(ROOT.parent).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def test_every_internal_import_resolves_statically(graph):
    modules = _module_paths()
    assert set(modules) == set(graph.modules)
    assert unresolved_imports(modules) == []


def test_the_resolver_flags_a_missing_module_and_a_missing_name(tmp_path):
    """Negative controls: an import of a module that does not exist, and of a name a module does not define;
    positive: a relative import of a defined name, and any name of a module with __getattr__."""
    pkg = tmp_path / "dpep_parity"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("X = 1\ndef f():\n    from dpep_parity import nope\n    from dpep_parity.b import Y\n")
    (pkg / "b.py").write_text("from .a import X\ndef __getattr__(n):\n    return n\n")
    (pkg / "c.py").write_text("from dpep_parity.a import Z\nfrom dpep_parity.b import anything\nimport dpep_parity.zz\n")
    mods = {"dpep_parity": pkg / "__init__.py", "dpep_parity.a": pkg / "a.py", "dpep_parity.b": pkg / "b.py",
            "dpep_parity.c": pkg / "c.py"}
    assert unresolved_imports(mods) == ["a.py:3 dpep_parity.nope", "c.py:1 dpep_parity.a.Z", "c.py:3 dpep_parity.zz"]
