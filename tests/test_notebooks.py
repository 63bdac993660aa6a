"""Notebook sources: every .ipynb equals the jupytext py:percent file beside it, and the set-up cell is the same
in every notebook."""

import importlib.util
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent


def _sync():
    spec = importlib.util.spec_from_file_location("sync_notebooks", ROOT / "scripts" / "sync_notebooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_notebook_has_a_source_and_they_agree():
    sync = _sync()
    sources = sync.sources()
    ipynbs = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert {p.stem for p in ipynbs} == {p.stem for p in sources}, "an .ipynb without a .py source, or the reverse"
    stale = [s.name for s in sources if s.with_suffix(".ipynb").read_text() != sync.text(sync.build(s))]
    assert not stale, f"{stale}: .ipynb differs from its source; run python scripts/sync_notebooks.py"


def test_the_check_notices_an_edited_notebook(tmp_path):
    sync = _sync()
    src = sync.sources()[0]
    nb = nbformat.reads(src.with_suffix(".ipynb").read_text(), as_version=4)
    nb.cells[-1].source += "\n# edited in Colab"
    assert nbformat.writes(nb) + "\n" != sync.text(sync.build(src))


def test_set_up_cell_is_the_same_everywhere():
    cells = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        tagged = [c.source for c in nb.cells if "setup" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: expected one cell tagged 'setup', found {len(tagged)}"
        cells[path.name] = tagged[0]
    assert len(set(cells.values())) == 1, f"set-up cells differ between {sorted(cells)}"


def test_set_up_cell_is_envsetups():
    """The set-up cell's one home is labkit.envsetup.SETUP_CELL: every notebook carries exactly that text."""
    from labkit import envsetup

    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        (cell,) = [c.source for c in nb.cells if "setup" in c.metadata.get("tags", [])]
        assert cell == envsetup.SETUP_CELL, f"{path.name}: set-up cell differs from labkit.envsetup.SETUP_CELL"


def test_every_notebook_is_in_the_readme_and_runs_under_the_test_command():
    """The README lists each notebook (with its Colab link), and `pytest tests notebooks --nbval-lax` (the
    README's test command) collects every .ipynb in notebooks/: a new notebook is in CI once it is here."""
    readme = (ROOT / "README.md").read_text()
    names = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert "03_sharding_on_a_mesh" in names
    missing = [n for n in names if f"| `{n}`" not in readme or f"notebooks/{n}.ipynb)" not in readme]
    assert not missing, f"notebooks missing from README's notebook table: {missing}"


def test_every_notebook_has_three_self_checking_exercises():
    """Each exercise: a cell with `...` for the learner, a hidden solution cell, and a check cell that runs a
    checker of labkit.lessons.exercises.nbNN (the suite runs the solutions with LABKIT_SOLUTIONS=1)."""
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        n = int(path.name[:2])
        cells = nbformat.read(path, as_version=4).cells
        solutions = [i for i, c in enumerate(cells) if "solution" in c.metadata.get("tags", [])]
        assert len(solutions) >= 3, f"{path.name}: {len(solutions)} exercises"
        for i in solutions:
            assert cells[i].metadata.get("jupyter", {}).get("source_hidden") is True, f"{path.name} cell {i}"
            assert "solutions_on()" in cells[i].source
            assert "..." in cells[i - 1].source, f"{path.name} cell {i - 1}: the learner's cell"
            assert f"nb{n:02d}.check_" in cells[i + 1].source, f"{path.name} cell {i + 1}: the check"
        assert importlib.util.find_spec(f"labkit.lessons.exercises.nb{n:02d}") is not None


def test_one_course_order_in_the_readme_the_book_and_every_notebook():
    """scripts/build_book.py's COURSE is the order's one home: the README's course line gives the same sequence,
    the book lists the notebooks in it, and each notebook's "In the course" line names its neighbours in it."""
    import re

    spec = importlib.util.spec_from_file_location("build_book", ROOT / "scripts" / "build_book.py")
    book = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(book)
    main, appendix = [n for n in book.COURSE if n not in book.APPENDIX], list(book.APPENDIX)
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"Take the notebooks in this order, \*\*([\d →]+)\*\*, with \*\*(\d\d)\*\* as an appendix", readme)
    assert line, "README's course line ('Take the notebooks in this order, **00 → ...**, with **NN** as an appendix')"
    assert line.group(1).split(" → ") == main and [line.group(2)] == appendix, line.group(0)

    sources = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    entries = book.course(sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")), ROOT / "no-executed-copies")
    listed = [e["src"].name[:2] for e in entries]
    assert listed == [n for n in book.COURSE if n in listed] and set(listed) <= set(book.COURSE), listed

    said = re.compile(
        r"\*\*In the course\*\*: (?:the first notebook|(?:the appendix, )?after (\d\d)); next: (?:the appendix, )?(\d\d|none)"
    )
    wrong = []
    for path in sources:
        num = path.name[:2]
        m = said.search(path.read_text())
        i = book.COURSE.index(num) if num in book.COURSE else None
        want = (
            book.COURSE[i - 1] if i else None,
            book.COURSE[i + 1] if i is not None and i + 1 < len(book.COURSE) else "none",
        )
        got = (m.group(1), m.group(2)) if m else None
        if got != want:
            wrong.append(f"{path.name}: says {got}, the order gives (after, next) = {want}")
    assert not wrong, (
        "notebooks whose '**In the course**: after NN; next: NN.' line disagrees with COURSE:\n" + "\n".join(wrong)
    )


# Figures a run prints and the prose must read from the output above it, not state: how many graphs compiled and
# when, how long a compile or a step took, the dashboard's counters. Each was once written into the text of
# notebooks 01, 03 or 08 and contradicted by a learner's run on a loaded machine (STYLE.md rule 25). The executed
# outputs are not kept by the suite (nbval compares them loosely and lets them go), so this checks the text side.
RUN_FIGURES = [
    (r"compiles? at steps? \d", "the steps at which the graph compiled"),
    (r"(tens of seconds|\d+ (s|seconds|minutes)) to compile", "the compile time"),
    (r"first step (took )?\d+(\.\d+)? ?(s|ms)\b", "the first step's seconds"),
    (r"\d+(\.\d+)? ?ms (a|per) step", "a step's time"),
    (r"`compiles \d+ \(", "the dashboard's compile counter"),
    (r"`graphs \d+`", "the dashboard's graph counter"),
    (r"`rate \d", "the dashboard's rate"),
    (r"\d+ graphs compiled for \d+ executions", "explain's graph count"),
]


def test_the_prose_reads_run_figures_from_the_output():
    import re

    found = []
    for name in ("01_resnet50_cifar10", "03_sharding_on_a_mesh", "08_the_compiled_engine"):
        nb = nbformat.reads((ROOT / "notebooks" / f"{name}.ipynb").read_text(), as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "markdown":
                continue
            text = " ".join(cell.source.split())  # a phrase may wrap across lines
            for pattern, what in RUN_FIGURES:
                for m in re.finditer(pattern, text, flags=re.IGNORECASE):
                    found.append(f"{name} cell {i}: {what} stated as {m.group(0)!r}")
    assert not found, "read these from the cell's output instead:\n" + "\n".join(found)
