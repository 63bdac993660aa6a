"""Notebook sources: every .ipynb equals the jupytext py:percent file beside it, and the set-up cell is the same
in every notebook. What the text may say: figures a run prints are read from its output; fast mode's quoted steps and
intervals follow from the parameters cell; each Time line gives the README table's figures; no exercise's answer
shows outside its hidden solution; timing comparisons print a spread; each warning a run prints is read or
silenced."""

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


def _params_of(stem: str):
    """The notebook's Params with its FAST overlay applied, read from its parameters cell (the dataclass only, not
    the environment): the figures fast mode runs with, as the notebook itself defines them."""
    import dataclasses

    src = (ROOT / "notebooks" / f"{stem}.py").read_text()
    cell = src.split('# %% tags=["parameters"]', 1)[1].split("\n# %%", 1)[0]
    namespace: dict = {"__name__": f"params_of_{stem}"}
    exec(cell.split("\ntry:", 1)[0], namespace)  # noqa: S102 - the repository's own notebook source
    params = namespace["Params"]
    return dataclasses.replace(params(), **getattr(params, "FAST", {})), src


def _prose(src: str) -> str:
    """A notebook source's comments and markdown as one line of text (a phrase may wrap across lines)."""
    lines = [ln.strip()[1:].strip() for ln in src.splitlines() if ln.strip().startswith("#")]
    return " ".join(" ".join(lines).split())


def _fast_figures(stem: str) -> dict:
    """What fast mode runs, computed from the parameters cell and the notebook's own code: never retyped here."""
    import math
    import re

    p, src = _params_of(stem)
    if stem.startswith("01_"):  # one process: the digits' train split in batches (the loader drops the short one)
        from data_tools.sources import load_digits

        return {"steps": len(load_digits("train")[1]) // p.batch_size * p.epochs}
    if stem.startswith("06_"):  # each feed-meter run: P.steps, capped at one epoch of the photos
        steps = min(p.steps, p.photos // p.batch)
        log_every = int(re.search(r"def fit\(.*?log_every=(\d+)", src, re.S).group(1))
        return {"steps": steps, "log intervals": math.ceil(steps / log_every)}
    return {}


def test_quoted_fast_mode_figures_are_read_from_the_parameters():
    """A figure the prose gives for fast mode ("fast mode's 44 steps", "(one epoch, 44 steps)", "15 steps, 4 log
    intervals") equals what the parameters cell makes fast mode run, computed here from that cell: when FAST
    changes (one epoch instead of two), the text must change with it. A bare "(N log intervals)" is refused: it
    is the retyped kind of figure that went stale (notebook 06 said 5 where fast mode ran 4)."""
    import re

    said = re.compile(
        r"fast mode's (?P<steps>\d+) (?:SGD )?steps(?:, (?P<intervals>\d+) log intervals)?"
        r"|fast mode \((?:one epoch, )?(?P<steps2>\d+) steps\)"
    )
    wrong, checked = [], 0
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py")):
        text = _prose(path.read_text())
        spans = []
        for m in said.finditer(text):
            spans.append(m.span())
            want = _fast_figures(path.stem)
            for key, got in (("steps", m["steps"] or m["steps2"]), ("log intervals", m["intervals"])):
                if got is None:
                    continue
                checked += 1
                if key not in want:
                    wrong.append(f"{path.name}: {m.group(0)!r}: add how fast mode's {key} follow from Params")
                elif int(got) != want[key]:
                    wrong.append(f"{path.name}: {m.group(0)!r}, but its parameters give {want[key]} {key}")
        for m in re.finditer(r"\d+ log intervals", text):
            if not any(a <= m.start() < b for a, b in spans):
                wrong.append(f"{path.name}: {m.group(0)!r} outside a 'fast mode's N steps, M log intervals' phrase")
    assert checked >= 3, "the notebooks quote fast mode's steps in 01 and 06"
    assert not wrong, "\n".join(wrong)


def test_each_notebooks_time_line_gives_the_readmes_figures():
    """The README's table of run times is the one home of each notebook's fast-mode minutes; the notebook's
    **Time** cell quotes every figure of its row (01 once said 2.5 minutes beside its measured 89 s)."""
    import re

    readme = (ROOT / "README.md").read_text()
    table = readme.split("| notebook | fast mode, 2-core CPU", 1)[1].split("\n\n", 1)[0]
    wrong = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        row = re.search(rf"^\| {path.name[:2]} \| ([^|]+) \|", table, re.M)
        assert row, f"{path.name}: no row in the README's run-time table"
        figures = re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", re.sub(r"`[^`]*`", "", row.group(1)))
        cells = nbformat.read(path, as_version=4).cells
        time_cell = next((c.source for c in cells if c.cell_type == "markdown" and "**Time**" in c.source), "")
        text = " ".join(time_cell.split())
        missing = [f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d.])", text)]
        if not time_cell or missing:
            wrong.append(f"{path.name}: the README gives {row.group(1).strip()!r}; its **Time** cell lacks {missing}")
    assert not wrong, "\n".join(wrong)


def _tokens(text: str, code: bool) -> list[str]:
    """Python's tokens of a code cell, or the words and symbols of a markdown cell; a name's trailing underscores
    dropped, so that `V_ * d_` reads as `V * d`."""
    import io
    import re
    import tokenize

    if code:
        try:
            kinds = (tokenize.NAME, tokenize.OP, tokenize.NUMBER, tokenize.STRING)
            found = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type in kinds]
            return [t.string.rstrip("_") if t.type == tokenize.NAME else t.string for t in found]
        except (tokenize.TokenError, SyntaxError):
            pass
    return [w.rstrip("_") if w[0].isalpha() else w for w in re.findall(r"\w+|[^\s\w]", text)]


def test_no_exercise_answer_appears_outside_its_hidden_solution():
    """A learner reads ahead: no other cell, text or code, before or after the check, may show a solution's
    arithmetic. Compared as runs of 8 tokens of each solution line that hold at least two arithmetic operators (the
    part that is the answer, not `for p in model.parameters()`); notebook 02 once printed gpt_params' whole formula
    in the cell after its check (`V_ * d_ + T_ * d_ + L_ * (...)`)."""
    n, arithmetic = 8, {"+", "-", "*", "/", "//", "**", "%"}
    found = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        for i, cell in enumerate(cells):
            if "solution" not in cell.metadata.get("tags", []):
                continue
            answer = set()
            for line in cell.source.splitlines():
                line = line.split("  #")[0].strip()
                if not line or line.startswith(("#", "def ", "@", "if ex")) or "solutions_on" in line:
                    continue
                t = _tokens(line, code=True)
                runs = (tuple(t[k : k + n]) for k in range(len(t) - n + 1))
                answer |= {r for r in runs if sum(x in arithmetic for x in r) >= 2}
            for j, other in enumerate(cells):
                if j == i or not answer:
                    continue
                t = _tokens(other.source, code=other.cell_type == "code")
                shown = answer & {tuple(t[k : k + n]) for k in range(len(t) - n + 1)}
                if shown:
                    found.append(f"{path.name} cell {j} shows solution cell {i}'s {' '.join(sorted(shown)[0])!r}")
    assert not found, "compute these another way (a meta-device build, a labkit helper):\n" + "\n".join(found)


def test_the_answer_check_sees_a_leaked_formula():
    leaked = "n = V_ * d_ + T_ * d_ + L_ * (12 * d_ * d_ + 13 * d_) + 2 * d_"
    answer = "return V * d + T * d + L * block + 2 * d"
    a, b = _tokens(leaked, code=True), _tokens(answer, code=True)
    runs = lambda t: {tuple(t[k : k + 8]) for k in range(len(t) - 7)}  # noqa: E731
    assert runs(a) & runs(b), "the check compares names without their trailing underscores"


# The cells that compare two timings, by a line each holds: each repeats the measurement and prints a spread (a
# median and a range, or a min, median and max), never one best-of figure. A best-of-2 ratio on a shared machine once
# read 4.93x where repeated runs gave 1.0x at the best and 5-10x between medians.
TIMED_COMPARISONS = [
    ("02_transformer_lm", "seconds[rc].append(fwd_bwd_s(models[rc], xb))"),
    ("04_graphs_and_compilation", "loops[name](P.steps)"),
    ("05_export_and_int8", "runs[name].append(N_GEN / (time.perf_counter() - t0))"),
    ("05_export_and_int8", "quantize.throughput_spread(fn, xb[b], seconds=P.time_s)"),
    ("08_the_compiled_engine", "eager_s = sorted(timed(eager_step, x, y)[0] for x, y in batches[1:])"),
]


def test_timing_comparisons_print_a_spread():
    import re

    wrong = []
    for stem, marker in TIMED_COMPARISONS:
        cells = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4).cells
        (cell,) = [c.source for c in cells if c.cell_type == "code" and marker in c.source] or [""]
        printed = " ".join(re.findall(r"print\((.*?)\)\s*$", cell, re.M | re.S))
        if not cell:
            wrong.append(f"{stem}: no code cell holds {marker!r}")
        elif "median" not in cell or not ("range" in printed or "max" in printed):
            wrong.append(f"{stem}: the timing cell must print a median and a range (or min and max)")
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py")):
        for m in re.finditer(r"best = min\(best|best of (two|three|\d)", path.read_text()):
            wrong.append(f"{path.name}: {m.group(0)!r}: repeat and print a spread instead")
    assert not wrong, "\n".join(wrong)


# Every warning a notebook's run prints, seen in a fast-mode run, with the words the notebook uses to read it for the
# learner (markdown) or to silence it (code). A warning left bare costs a learner more than the lesson it interrupts.
PRINTED_WARNINGS = [
    ("05_export_and_int8", "The given buffer is not writable", "code"),
    ("05_export_and_int8", "`torch.export.export_for_training` is deprecated", "code"),
    ("05_export_and_int8", "To copy construct from a tensor, it is recommended", "code"),
    ("05_export_and_int8", "No CUDA runtime is found", "markdown"),
    ("06_bring_your_own_webdataset", "This DataLoader will create 8 worker", "markdown"),
    ("08_the_compiled_engine", "Profiler function <class 'torch.autograd.profiler.record_function'> will", "markdown"),
    ("08_the_compiled_engine", "No CUDA runtime is found", "markdown"),
    ("08_the_compiled_engine", "capture_scalar_outputs = True", "markdown"),
]


def test_every_printed_warning_is_read_or_silenced():
    wrong = []
    for stem, text, where in PRINTED_WARNINGS:
        cells = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4).cells
        body = " ".join(" ".join(c.source.split()) for c in cells if c.cell_type == where)
        if " ".join(text.split()) not in body:
            wrong.append(f"{stem}: {text!r} is printed but no {where} cell reads or silences it")
    assert not wrong, "\n".join(wrong)


def test_notebook_04_shows_the_loop_its_reads_exercise_asks_about():
    """04.reads says "read the loop, do not run it": the loop's source is in the text, as the code has it, so a
    learner sees it before any cell runs (it once showed only in the output of the exercise's own cell)."""
    import inspect

    from labkit.lessons.exercises import nb04

    cells = nbformat.read(ROOT / "notebooks" / "04_graphs_and_compilation.ipynb", as_version=4).cells
    text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    assert inspect.getsource(nb04.guarded_loop).strip() in text, "copy nb04.guarded_loop's source into the text again"
