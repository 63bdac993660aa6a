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

Each row has its wall minutes and its CPU minutes (user + system), and `cores`, the two's ratio: 1.0 kept one core
busy the whole time, 0.1 mostly waited. A test's CPU is this process's and its children's (resource.getrusage SELF +
CHILDREN) from its start to its teardown's end, less the background jobs reaped meanwhile; a child counts when it is
reaped, so a session-wide server's CPU lands in the test whose teardown stops it. A background job's CPU is its
process tree's (tests/background.py: os.wait4); its parts' CPU comes from its JSON ("cpu_s"), and what they leave
goes to the job's "the rest" row. The CPU no row holds (pytest's start-up and collection, mostly) is said on the last
line but one; the totals on the last line count from the pytest process's start, as /usr/bin/time does.
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
_rows: dict[str, list] = defaultdict(lambda: [0.0, 0, "fg", None])  # name -> [seconds, count, fg | bg, CPU seconds]
_phases: dict[str, float] = defaultdict(float)  # node id -> seconds so far (setup, call)
_cpu_at: dict[str, float] = {}  # node id -> the test's own CPU clock (_fg_cpu) at its start
_started = time.perf_counter()
_bg_end: float | None = None  # when the last background job ended (perf_counter), set by add_background
_waiting: set[str] = set()  # node ids of tests that wait for a background job


def _cpu_seconds() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _age() -> float:
    """Seconds since this process started (Linux: /proc), else 0: the table's wall time then counts from the
    session's start."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def _fg_cpu() -> float:
    """CPU seconds of this process and its reaped children, less the queued background jobs' (reaped by the
    background worker while some test ran: not that test's)."""
    from tests import background

    return _cpu_seconds() - background.queued_cpu()


def session_started() -> None:
    """The totals count from the pytest process's start, as /usr/bin/time does (getrusage's are since then too)."""
    global _started
    _started = time.perf_counter() - _age()


def waits_for_background(nodeid: str) -> None:
    _waiting.add(nodeid)


def _group(nodeid: str, seconds: float) -> str:
    path = nodeid.split("::", 1)[0]
    if path.endswith(".ipynb"):
        return f"notebook {Path(path).stem} (nbval, solutions on)"
    if seconds >= OWN_ROW_S:
        return nodeid
    return path


def start(nodeid: str) -> None:
    """pytest_runtest_logstart: the test's CPU clock at its start."""
    _cpu_at[nodeid] = _fg_cpu()


def record(report) -> None:
    """pytest_runtest_logreport: add one phase of one test."""
    if report.nodeid in _waiting:
        return
    _phases[report.nodeid] += report.duration
    if report.when == "teardown":
        seconds = _phases.pop(report.nodeid)
        cpu = _fg_cpu() - _cpu_at.pop(report.nodeid) if report.nodeid in _cpu_at else None
        add(_group(report.nodeid, seconds), seconds, "fg", cpu)


def add(name: str, seconds: float, where: str = "bg", cpu: float | None = None) -> None:
    row = _rows[name]
    row[0] += seconds
    row[1] += 1
    row[2] = where
    if cpu is not None:
        row[3] = (row[3] or 0.0) + cpu


def add_background(jobs) -> None:
    """The background jobs' parts: each image's venv build and notebooks, the 3.13 suite (from the JSON each job
    wrote), or the job's whole time where it wrote none (it failed or was killed)."""
    global _bg_end
    for job in jobs:
        if job.started:
            end = job.started + job.seconds if job.done.is_set() else time.perf_counter()
            _bg_end = max(_bg_end or end, end)
        if not job.done.is_set():
            add(f"{job.id} (still running at the end: killed)", time.perf_counter() - job.started if job.started else 0)
            continue
        try:
            r = json.loads(Path(job.argv[-1]).read_text())
        except (OSError, ValueError, IndexError):
            r = None
        if not isinstance(r, dict) or not ({"built", "runs", "seconds"} & set(r)):
            add(
                getattr(job, "name", "") or job.id, job.seconds, cpu=job.cpu_s
            )  # a job whose result has no parts this table knows: its whole time
            continue
        name = job.id.removeprefix("image-")
        parts, parts_cpu = 0.0, 0.0

        def part(row: str, d: dict) -> None:
            nonlocal parts, parts_cpu
            cpu = float(d["cpu_s"]) if d.get("cpu_s") is not None else None
            parts += float(d["seconds"])
            parts_cpu += cpu or 0.0
            add(row, float(d["seconds"]), cpu=cpu)

        built = r.get("built", {})
        if "seconds" in built:
            part(
                f"{'image ' + name if job.id.startswith('image-') else name}: venv {built.get('action', 'built')}",
                built,
            )
        for stem, run in (r.get("runs") or {}).items():
            part(f"image {name}: {stem} (solutions off)", run)
        if "seconds" in r and not r.get("runs"):
            part(f"{name} unit tests (the Python-sensitive modules)", r)
        rest_cpu = job.cpu_s - parts_cpu if job.cpu_s is not None else None
        if job.seconds - parts > 5 or (rest_cpu or 0.0) > 5:
            add(f"{job.id}: the rest (start-up, pip freeze, clean-up)", max(job.seconds - parts, 0.0), cpu=rest_cpu)


def _min(seconds: float | None) -> str:
    return f"{seconds / 60:8.2f}" if seconds is not None else f"{'-':>8}"


def table(limit: int | None = 30) -> list[str]:
    wall = time.perf_counter() - _started
    cpu = _cpu_seconds()
    rows = sorted(_rows.items(), key=lambda kv: -kv[1][0])
    fg = sum(v[0] for v in _rows.values() if v[2] == "fg")
    bg = sum(v[0] for v in _rows.values() if v[2] == "bg")
    in_rows = sum(v[3] or 0.0 for v in _rows.values())
    lines = [
        f"{'wall min':>8} {'CPU min':>8} {'cores':>5} {'share':>6} {'tests':>5}  where   "
        "what (fg: in pytest's own order; bg: a background worker)"
    ]

    def line(seconds, cpu_s, count, where, name):
        share = seconds / (fg + bg) if fg + bg else 0.0
        cores = f"{cpu_s / seconds:5.2f}" if cpu_s is not None and seconds > 0 else f"{'-':>5}"
        return f"{_min(seconds)} {_min(cpu_s)} {cores} {share:6.1%} {count:5d}  {where}      {name}"

    for name, (seconds, count, where, cpu_s) in rows[:limit]:
        lines.append(line(seconds, cpu_s, count, where, name))
    rest = rows[limit:] if limit is not None else []
    if rest:
        rest_cpu = sum(v[3] or 0.0 for _, v in rest)
        lines.append(
            line(sum(v[0] for _, v in rest), rest_cpu, sum(v[1] for _, v in rest), "..", f"{len(rest)} more rows")
        )
    lines.append(
        f"CPU: {in_rows / 60:.2f} min in the rows above; {max(cpu - in_rows, 0.0) / 60:.2f} min in none (pytest's "
        "start-up and collection, jobs still running at the end)"
    )
    side = f"{bg / 60:.1f} min of background jobs beside them"
    if _bg_end is not None:
        side += f", the last ending {(_bg_end - _started) / 60:.1f} min in"
    lines.append(
        f"session {wall / 60:.1f} min wall: tests {fg / 60:.1f} min in this process's order, {side}; "
        f"{cpu / 60:.1f} CPU-min, {cpu / wall if wall else 0:.2f} of {os.cpu_count()} cores busy on average"
    )
    return lines


class Plugin:
    """The hooks, registered for the whole session by tests/conftest.py (pytest_configure)."""

    def pytest_sessionstart(self, session):
        session_started()

    def pytest_runtest_logstart(self, nodeid, location):
        start(nodeid)

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
        # every row, for a look past the 30 longest (the file is rewritten by each run)
        full = Path(str(terminalreporter.config.rootpath)) / "artifacts" / "test-times.txt"
        full.parent.mkdir(exist_ok=True)
        full.write_text("\n".join(table(limit=None)) + "\n")
        terminalreporter.write_line(f"every row: {full.relative_to(terminalreporter.config.rootpath)}")
