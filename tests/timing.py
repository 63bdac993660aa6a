"""Where the suite's minutes go, printed at the end of every run (just above pytest's summary line).

Every test's own time (setup + call + teardown) is added to a row named after what it runs:

    notebook 01_resnet50_cifar10 (nbval, solutions on)     the cells of one notebook under nbval
    tests/test_spmd.py::test_notebook_trains...[01...]      any single test of 30 s or more: a row of its own
    tests/test_gcs.py                                       the rest of a module's tests together
    image colab-tpu: 01_resnet50_cifar10 (solutions off)    a background job's parts, as its JSON reports them
    py3.13 unit suite                                       (tests/background.py runs those beside the rest)

A test that only waits for its background job (test_images.py, test_py313.py) is not counted: the job's own parts
are. The last lines give the session's wall time and how many of the machine's cores it kept busy on average (CPU
seconds of this process and all its children ÷ wall seconds), so a change that costs minutes, or leaves a core idle,
shows in its own run.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest

OWN_ROW_S = 30.0  # a test this long is a row of its own
_rows: dict[str, list] = defaultdict(lambda: [0.0, 0, "fg"])  # name -> [seconds, count, fg | bg]
_phases: dict[str, float] = defaultdict(float)  # node id -> seconds so far (setup, call)
_started = time.perf_counter()
_waiting: set[str] = set()  # node ids of tests that wait for a background job


def _cpu_seconds() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


_cpu0 = _cpu_seconds()


def session_started() -> None:
    global _started, _cpu0
    _started, _cpu0 = time.perf_counter(), _cpu_seconds()


def waits_for_background(nodeid: str) -> None:
    _waiting.add(nodeid)


def _group(nodeid: str, seconds: float) -> str:
    path = nodeid.split("::", 1)[0]
    if path.endswith(".ipynb"):
        return f"notebook {Path(path).stem} (nbval, solutions on)"
    if seconds >= OWN_ROW_S:
        return nodeid
    return path


def record(report) -> None:
    """pytest_runtest_logreport: add one phase of one test."""
    if report.nodeid in _waiting:
        return
    _phases[report.nodeid] += report.duration
    if report.when == "teardown":
        seconds = _phases.pop(report.nodeid)
        row = _rows[_group(report.nodeid, seconds)]
        row[0] += seconds
        row[1] += 1


def add(name: str, seconds: float, where: str = "bg") -> None:
    row = _rows[name]
    row[0] += seconds
    row[1] += 1
    row[2] = where


def add_background(jobs) -> None:
    """The background jobs' parts: each image's venv build and notebooks, the 3.13 suite (from the JSON each job
    wrote), or the job's whole time where it wrote none (it failed or was killed)."""
    for job in jobs:
        if not job.done.is_set():
            add(f"{job.id} (still running at the end: killed)", time.perf_counter() - job.started if job.started else 0)
            continue
        try:
            r = json.loads(Path(job.argv[-1]).read_text())
        except (OSError, ValueError, IndexError):
            r = None
        if not isinstance(r, dict) or not ({"built", "runs", "seconds"} & set(r)):
            add(job.id, job.seconds)  # a job whose result has no parts this table knows: its whole time
            continue
        name = job.id.removeprefix("image-")
        parts = 0.0
        built = r.get("built", {})
        if "seconds" in built:
            parts += float(built["seconds"])
            add(
                f"{'image ' + name if job.id.startswith('image-') else name}: venv {built.get('action', 'built')}",
                float(built["seconds"]),
            )
        for stem, run in (r.get("runs") or {}).items():
            parts += run["seconds"]
            add(f"image {name}: {stem} (solutions off)", run["seconds"])
        if "seconds" in r and not r.get("runs"):
            parts += r["seconds"]
            add(f"{name} unit tests (the Python-sensitive modules)", r["seconds"])
        if job.seconds - parts > 5:
            add(f"{job.id}: the rest (start-up, pip freeze, clean-up)", job.seconds - parts)


def table(limit: int = 30) -> list[str]:
    wall = time.perf_counter() - _started
    cpu = _cpu_seconds() - _cpu0
    rows = sorted(_rows.items(), key=lambda kv: -kv[1][0])
    fg = sum(v[0] for v in _rows.values() if v[2] == "fg")
    bg = sum(v[0] for v in _rows.values() if v[2] == "bg")
    lines = [
        f"{'seconds':>8} {'share':>6} {'tests':>5}  where   what (fg: in pytest's own order; bg: the background worker)"
    ]
    for name, (seconds, count, where) in rows[:limit]:
        share = seconds / (fg + bg) if fg + bg else 0.0
        lines.append(f"{seconds:8.1f} {share:6.1%} {count:5d}  {where}      {name}")
    if len(rows) > limit:
        rest = rows[limit:]
        lines.append(
            f"{sum(v[0] for _, v in rest):8.1f} {'':6} {sum(v[1] for _, v in rest):5d}  ..      "
            f"{len(rest)} more rows (tests/timing.py)"
        )
    lines.append(
        f"session {wall / 60:.1f} min wall: tests {fg / 60:.1f} min in this process's order, background jobs "
        f"{bg / 60:.1f} min beside them; {cpu / 60:.1f} CPU-min, {cpu / wall if wall else 0:.2f} of "
        f"{os.cpu_count()} cores busy on average"
    )
    return lines


class Plugin:
    """The hooks, registered for the whole session by tests/conftest.py (pytest_configure)."""

    def pytest_sessionstart(self, session):
        session_started()

    def pytest_runtest_logreport(self, report):
        record(report)

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter):
        """The table, just above pytest's own summary line."""
        from tests import background

        add_background(background.jobs())
        terminalreporter.write_sep("=", "where the time went (tests/timing.py)")
        for line in table():
            terminalreporter.write_line(line)
