"""The layout as a rule: no import cycle anywhere, modules a learner can read in one sitting, notebooks that
use the public API. `make lint` checks the layers with import-linter (pyproject.toml); this adds what its
contracts cannot say."""

from __future__ import annotations

import re
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 360  # "about 350": one sitting
LONGER = {"labkit/envsetup.py"}  # the set-up cell loads it by path: it must stay one stdlib-only file
WINGS = ("checkpoint", "cloud", "dashboard", "lessons", "models", "profiling", "serve", "spmd")


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), over every import, a module's
    import of its own package's __init__ included."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycle_in_labkit_or_data_tools():
    graph = grimp.build_graph("labkit", "data_tools")  # type-only imports count too: a circle is a circle
    # a package's __init__ re-exports its children: that edge (parent -> child) is not a design cycle,
    # a child importing its parent back (to reach a sibling) is
    for m in list(graph.modules):
        for child in graph.find_children(m):
            if graph.direct_import_exists(importer=m, imported=child):
                graph.remove_import(importer=m, imported=child)
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_sees_a_cycle():
    g = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")]:
        g.add_import(importer=a, imported=b)
    assert _cycles(g) == [["p.a", "p.b", "p.c"]]


def test_every_module_is_readable_in_one_sitting():
    long = []
    for path in sorted([*ROOT.glob("labkit/**/*.py"), *ROOT.glob("data_tools/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in LONGER:
            long.append(f"{rel} ({n} lines)")
    assert not long, f"over {MAX_LINES} lines: split by concern: {', '.join(long)}"


def test_notebooks_use_the_public_api_only():
    """labkit.X or labkit.<wing>.X, never a module behind a wing's namespace."""
    import labkit

    bad = []
    deep = re.compile(r"\bfrom labkit\.(\w+)\.(\w+)(?:\.\w+)* import|\bimport labkit\.(\w+)\.(\w+)")
    attr = re.compile(r"\blabkit\.(\w+)\.(\w+)\.\w+")
    for src in sorted(ROOT.glob("notebooks/[0-9]*.py")):
        for i, line in enumerate(src.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue  # prose may name the file a learner opens (labkit/models/gpt.py)
            m = deep.search(line)
            if m:
                wing, name = m.group(1) or m.group(3), m.group(2) or m.group(4)
                if not (wing in WINGS and name in getattr(labkit, wing).__all__):  # a namespace the wing offers
                    bad.append(f"{src.name}:{i}: {line.strip()}")
                continue
            for m in attr.finditer(line):
                wing, name = m.group(1), m.group(2)
                if wing in WINGS and name not in getattr(labkit, wing).__all__:
                    bad.append(f"{src.name}:{i}: labkit.{wing}.{name} is not in labkit.{wing}.__all__")
    assert not bad, "\n".join(bad)


def test_the_public_api_is_small_and_every_wing_exports_what_it_names():
    import importlib

    import labkit

    names = [n for n in labkit.__all__ if n not in WINGS and n != "__version__"]
    assert len(names) <= 24, f"labkit exports {len(names)} names: keep the API a learner holds in their head"
    for n in labkit.__all__:
        assert getattr(labkit, n) is not None
    for wing in WINGS:
        mod = importlib.import_module(f"labkit.{wing}")
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert not missing, f"labkit.{wing}.__all__ names {missing} but does not define them"


def test_import_labkit_is_light():
    """`import labkit` loads no torch and at most a few labkit modules: the names and wings load on first use."""
    import subprocess
    import sys

    code = (
        "import sys, labkit; print(sum(m.startswith('labkit') for m in sys.modules), 'torch' in sys.modules); "
        "labkit.Trainer; print(sum(m.startswith('labkit') for m in sys.modules), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) <= 5 and out[1] == "False", f"import labkit loaded {out[0]} labkit modules, torch: {out[1]}"
    assert out[3] == "True" and int(out[2]) > int(out[0]), "labkit.Trainer did not load the training path"
