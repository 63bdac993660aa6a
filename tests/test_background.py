"""tests/background.py, the suite's background worker: jobs longest first, one at a time while the suite runs, a
second worker once the suite's own tests are done, and a new worker for a job submitted after the others stopped.

A fresh copy of the module is loaded for each test, so the session's own jobs (the images) are not touched."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# each child writes "id start end" (time.time()) to the file it is given, after sleeping
_CHILD = "import sys, time; t = time.time(); time.sleep(float(sys.argv[2])); open(sys.argv[3], 'a').write(f'{sys.argv[1]} {t} {time.time()}\\n')"


_loaded = {}


def fresh(module="background"):
    name = f"{module}_under_test_{len(_loaded)}"
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{module}.py"))
    mod = _loaded[name] = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(mod)
    return mod


def sleeper(bg, name, seconds, out):
    return bg.Job(name, [sys.executable, "-c", _CHILD, name, str(seconds), str(out)], expected_s=seconds)


def spans(out):
    rows = [ln.split() for ln in out.read_text().splitlines()]
    return {name: (float(a), float(b)) for name, a, b in rows}


@pytest.mark.timing
def test_one_worker_runs_the_longest_first_then_the_rest_one_at_a_time(tmp_path):
    bg, out = fresh(), tmp_path / "spans"
    jobs = [sleeper(bg, "short", 0.2, out), sleeper(bg, "long", 0.6, out)]
    bg.submit(jobs)
    for job in jobs:  # not bg.wait(): that is the suite's end, which brings in the second worker
        assert job.done.wait(60) and job.returncode == 0
    s = spans(out)
    assert s["long"][1] <= s["short"][0], f"the long job first, the short one after it ended: {s}"


@pytest.mark.timing
def test_a_second_worker_takes_the_queued_jobs_when_the_suite_is_done(tmp_path):
    bg, out = fresh(), tmp_path / "spans"
    bg.submit([sleeper(bg, name, 1.0, out) for name in ("a", "b", "c")])
    bg.wait("a")  # wait() is what the suite's last tests call: it starts the second worker
    bg.wait("b")
    bg.wait("c")
    s = spans(out)
    assert s["b"][0] < s["a"][1], f"b started while a ran (two workers): {s}"
    assert min(s["a"][1], s["b"][1]) <= s["c"][0], f"c waited for a free worker (never three at once): {s}"
    # both workers have stopped (queue empty): a job submitted now still runs
    late = sleeper(bg, "late", 0.1, out)
    assert bg.wait("late", late).returncode == 0 and "late" in spans(out)


def test_run_here_runs_the_job_now_outside_the_queue(tmp_path):
    bg = fresh()
    out = tmp_path / "log.txt"
    queued = sleeper(bg, "queued", 0.3, out)
    bg.submit([queued])
    job = bg.run_here(sleeper(bg, "here", 0.1, out))
    assert job.done.is_set() and job.returncode == 0 and job.seconds >= 0.1
    assert [j.id for j in bg.jobs()] == ["queued"]  # not counted again as a background job in the closing table
    bg.wait("queued")
    assert sorted(line.split()[0] for line in out.read_text().splitlines()) == ["here", "queued"]


def test_a_jobs_cpu_is_its_whole_process_tree(tmp_path):
    """A job's CPU seconds (the closing table's) include a grandchild's, as /usr/bin/time counts them; the queued
    jobs' sum is what tests/timing.py takes out of the test that was running when they were reaped."""
    bg = fresh()
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass"
    burn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}], check=True)"
    job = bg.Job("burn", [sys.executable, "-c", burn])
    bg.submit([job])
    assert job.done.wait(60) and job.returncode == 0, bg.output(job)
    assert job.cpu_s >= 0.3 and bg.queued_cpu() == job.cpu_s, job.cpu_s
    here = bg.run_here(bg.Job("here", [sys.executable, "-c", "pass"]))
    assert here.cpu_s is not None and bg.queued_cpu() == job.cpu_s  # counted in the calling test's own row


def test_the_closing_table_gives_each_part_of_a_job_its_cpu(tmp_path):
    """A job's parts get the CPU its JSON gives them; what they leave of the tree's CPU goes to "the rest"."""
    import json
    import threading
    from types import SimpleNamespace

    timing = fresh("timing")
    result = tmp_path / "r.json"
    built = {"seconds": 60.0, "cpu_s": 90.0, "action": "built"}
    result.write_text(json.dumps({"built": built, "runs": {"01_x": {"seconds": 120.0, "cpu_s": 150.0}}}))
    done = threading.Event()
    done.set()
    job = SimpleNamespace(id="image-img", argv=["x", str(result)], done=done, seconds=200.0, cpu_s=300.0, started=1.0)
    timing.add_background([job])
    rows = {name: (round(v[0]), round(v[3])) for name, v in timing._rows.items()}
    assert rows == {
        "image img: venv built": (60, 90),
        "image img: 01_x (solutions off)": (120, 150),
        "image-img: the rest (start-up, pip freeze, clean-up)": (20, 60),
    }, rows
    lines = timing.table()
    assert lines[0].split()[:3] == ["wall", "min", "CPU"]
    assert "    2.00     2.50  1.25  " in lines[1] and lines[1].endswith("image img: 01_x (solutions off)"), lines
