"""tests/background.py, the suite's background workers: two jobs at once, longest first, below the suite's own
priority, and a new worker for a job submitted after the others stopped.

A fresh copy of the module is loaded for each test, so the session's own jobs (the images) are not touched."""

from __future__ import annotations

import importlib.util
import os
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
def test_two_workers_run_the_longest_first_and_never_three_at_once(tmp_path):
    bg, out = fresh(), tmp_path / "spans"
    jobs = [sleeper(bg, "short", 0.2, out), sleeper(bg, "long", 1.0, out), sleeper(bg, "mid", 0.6, out)]
    bg.submit(jobs)
    for job in jobs:
        assert bg.wait(job.id).returncode == 0
    s = spans(out)
    assert s["mid"][0] < s["long"][1], f"the two longest at once, from the start: {s}"
    assert min(s["long"][1], s["mid"][1]) <= s["short"][0], f"short waited for a free worker (never three): {s}"
    # both workers have stopped (queue empty): a job submitted now still runs
    late = sleeper(bg, "late", 0.1, out)
    assert bg.wait("late", late).returncode == 0 and "late" in spans(out)


_NICE_CHILD = """
import os, subprocess, sys, time
print("nice", os.getpriority(os.PRIO_PROCESS, 0), flush=True)
grandchild = "import time; time.sleep(float(__import__('sys').argv[1])); print(open('/proc/self/autogroup').read())"
if os.path.exists("/proc/self/autogroup"):  # a session of its own, as a Jupyter kernel or torchrun starts
    subprocess.run([sys.executable, "-c", grandchild, "4"], start_new_session=True, check=True)
"""


@pytest.mark.timing
def test_a_jobs_processes_run_below_the_suites_own_tests():
    """A job's processes run at NICE, and so does a process of it that starts a session of its own (it would
    otherwise get an autogroup at nice 0 on Linux and take half the CPU from the suite's own tests)."""
    bg = fresh()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    groups = bg._autogroup("self") is not None  # None in a container whose cgroup schedules the CPU: nice alone counts
    own_before = open("/proc/self/autogroup").read().split() if groups else None
    job = bg.Job("nice", [sys.executable, "-c", _NICE_CHILD])
    bg.submit([job])
    assert bg.wait("nice").returncode == 0, bg.output(job)
    out = bg.output(job)
    assert f"nice {min(mine + bg.NICE, 19)}" in out, out  # `nice -n NICE`: NICE below whatever the suite runs at
    if groups:
        group = [ln.split() for ln in out.splitlines() if ln.startswith("/autogroup-")]
        assert group and group[0][0] != own_before[0] and group[0][2] == str(bg.NICE), (out, own_before)
        assert open("/proc/self/autogroup").read().split() == own_before, "the suite's own group is left alone"


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
    ended = 201.0 - timing._started  # started=1.0 + 200 s: when the background side ended, after the session began
    assert f"the last ending {ended / 60:.1f} min in;" in lines[-1], lines[-1]
    assert "    2.00     2.50  1.25  " in lines[1] and lines[1].endswith("image img: 01_x (solutions off)"), lines
