"""tests/apart.py: a notebook in APART runs in a child pytest beside the rest, and each of its cells reports, in the
session's own summary, what it did there: passed, failed with the child's traceback, skipped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent


def _notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import os\nopen('ran-in', 'a').write(f'{os.getpid()}\\n')\nx = 1"),
        nbformat.v4.new_code_cell("assert x == 2, 'x is ' + str(x)"),
        nbformat.v4.new_code_cell("x = 3", metadata={"tags": ["nbval-skip"]}),
        nbformat.v4.new_code_cell("print(x)"),
    ]
    nbformat.write(nb, path)


def _session(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LABKIT_APART_REPORT", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_notebook_apart_reports_each_cell_as_the_child_ran_it(tmp_path):
    """A name in APART (01_resnet50_cifar10) beside another test: the cells run in a child pytest, and this session
    reports 2 passed cells, the failed one with the child's own message, the skipped one; the test beside them too."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_beside.py").write_text("def test_beside():\n    pass\n")
    _notebook(tmp_path / "01_resnet50_cifar10.ipynb")

    done = _session(tmp_path, "01_resnet50_cifar10.ipynb", "test_beside.py", "-rA")
    out = done.stdout + done.stderr
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\b1 failed\b", summary) and re.search(r"\b3 passed\b", summary), out[-3000:]
    assert re.search(r"\b1 skipped\b", summary), out[-3000:]
    assert "failed in the child pytest" in out and "x is 1" in out, out[-3000:]
    assert "FAILED 01_resnet50_cifar10.ipynb::Cell 1" in out, out[-3000:]
    assert "notebook 01_resnet50_cifar10 (nbval, solutions on)" in out, "its row in the closing table"
    assert len((tmp_path / "ran-in").read_text().split()) == 1, "the cells ran once: in the child, not here too"

    alone = _session(tmp_path, "01_resnet50_cifar10.ipynb")  # the notebook alone: in-process, as nbval does
    out = alone.stdout + alone.stderr
    assert "failed in the child pytest" not in out and "x is 1" in out, out[-3000:]
    assert re.search(r"\b1 failed, 2 passed, 1 skipped\b", out.strip().splitlines()[-1]), out[-3000:]


def test_a_child_that_reports_nothing_fails_every_cell_with_its_log(tmp_path):
    """The child pytest dies before it writes its report (here a cell kills it): each cell fails, naming the
    child's exit and the end of its log, rather than passing on an empty report."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_beside.py").write_text("def test_beside():\n    pass\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)  # the child pytest"),
    ]
    nbformat.write(nb, tmp_path / "01_resnet50_cifar10.ipynb")
    done = _session(tmp_path, "01_resnet50_cifar10.ipynb", "test_beside.py")
    out = done.stdout + done.stderr
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\b2 failed, 1 passed\b", summary), out[-3000:]
    # each cell's own failure (the short summary may repeat it, cut to the terminal's width)
    told = re.findall(r"Cell (\d+): the child pytest \(exit -9\) reported nothing for this cell", out)
    assert set(told) == {"0", "1"}, out[-3000:]
