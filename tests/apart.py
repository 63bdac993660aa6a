"""The longest notebooks under nbval run in a child pytest beside the rest of the suite, not in its own order.

Under nbval a notebook is one kernel that runs its cells in turn, and notebook 01 alone is minutes of one core. In
a run of the whole suite (`make test`), conftest.py hands the notebooks named in APART to tests/background.py: one
child `python -m pytest <notebook> --nbval-lax -p tests.apart` each, at the background jobs' priority, started when
collection ends. Every cell stays an item of this session, in its place at the end of the run, and reports what
the same cell did in the child: passed, failed with the child's own report, skipped. So the summary line counts
the same cells, and a failing cell names itself as it would in-process.

A run of those notebooks alone (`pytest notebooks/01_resnet50_cifar10.ipynb --nbval-lax`) runs them in-process as
usual; so does any run with LABKIT_APART=0.

The child loads this module as a plugin (-p tests.apart): it writes each cell's outcome to the JSON file named by
$LABKIT_APART_REPORT when its session ends.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import background

APART = {  # notebook -> its CPU-minutes under nbval in the fast mode, measured (the workers start the longest first)
    "01_resnet50_cifar10": 3.0,
    "06_bring_your_own_webdataset": 0.7,
}
REPORT_ENV = "LABKIT_APART_REPORT"


class ChildFailed(Exception):
    """A cell failed in the child pytest; the message is the child's own report of it."""


def _job(config, path: Path) -> background.Job:
    stem = path.stem
    report = os.path.join(background.job_dir(), f"apart-{stem}.json")
    argv = [sys.executable, "-m", "pytest", str(path.relative_to(config.rootpath)), "-p", "tests.apart", "-q"]
    argv.append("--nbval-lax" if config.getoption("nbval_lax", False) else "--nbval")
    if config.getoption("nbval_current_env", False):
        argv.append("--nbval-current-env")
    timeout = config.getoption("nbval_cell_timeout", None)
    if timeout is not None:
        argv += ["--nbval-cell-timeout", str(timeout)]
    return background.Job(
        id=f"nbval-{stem}",
        name=f"notebook {stem} (nbval, solutions on)",
        argv=argv,
        env={**os.environ, REPORT_ENV: report},
        cwd=str(config.rootpath),
        expected_s=APART[stem] * 60,
    )


def plan(config, items) -> dict[str, background.Job]:
    """The nbval cells of this session that run apart: node id -> the job that runs their notebook. Empty when
    the session is those notebooks alone, when this is the child itself, or with LABKIT_APART=0."""
    if os.environ.get(REPORT_ENV) or os.environ.get("LABKIT_APART", "1") == "0" or config.option.collectonly:
        return {}
    cells = [i for i in items if Path(str(i.path)).suffix == ".ipynb" and Path(str(i.path)).stem in APART]
    if len(cells) == len(items):
        return {}
    jobs: dict[Path, background.Job] = {}
    planned = {}
    for item in cells:
        path = Path(str(item.path))
        job = jobs.setdefault(path, _job(config, path))
        planned[item.nodeid] = job
        _mirror(item, job.id)
    return planned


def _mirror(item, job_id: str) -> None:
    """Make `item` report its cell's outcome in the child instead of running it; its notebook starts no kernel."""
    item.parent.setup = lambda: None  # nbval's file collector starts the kernel there

    def runtest():
        job = background.wait(job_id)
        outcome = _outcomes(job).get(item.nodeid)
        if outcome is None:
            tail = background.output(job)[-4000:]
            raise ChildFailed(
                f"{item.nodeid}: the child pytest (exit {job.returncode}) reported nothing for this cell; "
                f"the end of its log ({job.log}):\n{tail}"
            )
        if outcome["outcome"] == "failed":
            raise ChildFailed(f"failed in the child pytest ({outcome['when']}):\n{outcome['text']}")
        if outcome["outcome"] == "skipped":
            pytest.skip(outcome["text"] or "skipped in the child pytest")

    original = item.repr_failure
    item.runtest = runtest
    item.repr_failure = lambda excinfo, *a, **kw: (
        str(excinfo.value) if isinstance(excinfo.value, ChildFailed) else original(excinfo, *a, **kw)
    )


_read: dict[str, dict] = {}


def _outcomes(job: background.Job) -> dict:
    if job.id not in _read:
        try:
            _read[job.id] = json.loads(Path(job.env[REPORT_ENV]).read_text())
        except (OSError, ValueError):
            _read[job.id] = {}
    return _read[job.id]


# --- in the child (-p tests.apart) ---

_results: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    if not os.environ.get(REPORT_ENV):
        return
    seen = _results.get(report.nodeid)
    if seen is not None and seen["outcome"] == "failed":
        return  # the first failure of a cell is its outcome (a teardown after a failed call adds nothing)
    if report.failed:
        _results[report.nodeid] = {"outcome": "failed", "when": report.when, "text": report.longreprtext}
    elif report.skipped and report.when != "teardown":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longreprtext
        _results[report.nodeid] = {"outcome": "skipped", "when": report.when, "text": str(reason)}
    elif report.when == "call":
        _results[report.nodeid] = {"outcome": "passed", "when": report.when, "text": ""}


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(_results))
