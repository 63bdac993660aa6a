"""Long child-process tests run in the background while the rest of the suite runs.

The simulated images and the 3.13 unit suite are each one child process tree of several minutes that
uses about one core, while most of the suite leaves the second core idle (waiting on servers, child
processes, one XLA compile thread). A test module opts in with

    def background_job(item) -> Job | None     # the child command for this collected test

conftest.py submits the jobs of the selected tests when collection ends and moves those tests to the
end of the run; each test then calls `wait(job_id)` and asserts on what the job wrote. One background
worker runs the jobs one after another, longest first, so at most two heavy things share the cores.
Output goes to files (no pipe to fill up); jobs still running when the session ends are killed.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Job:
    id: str
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    expected_s: float = 0.0  # rough duration: the worker starts the longest first
    # filled in by the worker
    returncode: int | None = None
    seconds: float = 0.0
    log: str = ""
    started: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


_jobs: dict[str, Job] = {}
_procs: list[subprocess.Popen] = []
_lock = threading.Lock()
_dir = None


def _run(queue: list[Job]) -> None:
    for job in queue:
        job.started = time.perf_counter()
        try:
            with open(job.log, "w") as out:
                proc = subprocess.Popen(
                    job.argv, env=job.env, cwd=job.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
                with _lock:
                    _procs.append(proc)
                job.returncode = proc.wait()
        except OSError as e:
            with open(job.log, "a") as out:
                out.write(f"could not start {job.argv}: {e}\n")
            job.returncode = -1
        job.seconds = time.perf_counter() - job.started
        job.done.set()


def job_dir() -> str:
    """A folder for this session's job logs and results."""
    global _dir
    if _dir is None:
        _dir = tempfile.mkdtemp(prefix="labkit-bg-")
    return _dir


def submit(jobs: list[Job]) -> None:
    """Start one worker thread that runs `jobs`, longest first (call once, when collection ends)."""
    if not jobs:
        return
    queue = sorted(jobs, key=lambda j: -j.expected_s)
    for job in queue:
        job.log = os.path.join(job_dir(), f"{job.id}.log")
        _jobs[job.id] = job
    threading.Thread(target=_run, args=(queue,), name="background-tests", daemon=True).start()


def wait(job_id: str, fallback: Job | None = None) -> Job:
    """The finished job; runs `fallback` now if nothing was submitted under `job_id`."""
    job = _jobs.get(job_id)
    if job is None:
        if fallback is None:
            raise KeyError(f"no background job {job_id!r} was submitted")
        submit([fallback])
        job = _jobs[job_id]
    job.done.wait()
    return job


def jobs() -> list[Job]:
    """Every job submitted in this session."""
    return list(_jobs.values())


def output(job: Job) -> str:
    with open(job.log, errors="replace") as f:
        return f.read()


def stop_all() -> None:
    """Kill what is still running (the session ended early: -x, Ctrl-C, a failure elsewhere)."""
    with _lock:
        procs = list(_procs)
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, 9)
            except OSError:
                pass
