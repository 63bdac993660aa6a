"""Long child-process tests run in the background while the rest of the suite runs.

The simulated images and the 3.13 unit suite are each one child process tree of several minutes that
uses about one core, while most of the suite leaves the second core idle (waiting on servers, child
processes, one XLA compile thread). A test module opts in with

    def background_job(item) -> Job | None     # the child command for this collected test

conftest.py submits the jobs of the selected tests when collection ends and moves those tests to the
end of the run; each test then calls `wait(job_id)` and asserts on what the job wrote. One background
worker runs the jobs one after another, longest first, so at most two heavy things share the cores. When the
rest of the suite is done (the first of those tests calls `wait`), a second worker takes the jobs not yet
started, so the second core is not left idle while the last jobs run one by one.
Output goes to files (no pipe to fill up); jobs still running when the session ends are killed.

Each job's CPU time is its whole process tree's, as /usr/bin/time counts it: os.wait4's resource usage of the child,
which holds every descendant it waited for (a kernel, pip, a pytest). tests/timing.py shows it per row.
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
    cpu_s: float | None = None  # user + system CPU seconds of the job's process tree (None: not reaped here)
    done: threading.Event = field(default_factory=threading.Event)


_jobs: dict[str, Job] = {}
_queue: list[Job] = []  # submitted, not yet started (longest first)
_procs: list[subprocess.Popen] = []
_lock = threading.Lock()
_running = 0  # workers running (a worker stops when it finds the queue empty)
_dir = None
_queued_cpu = 0.0  # CPU seconds of the queued jobs reaped so far (run_here's count in the calling test)


def _next() -> Job | None:
    global _running
    with _lock:
        if _queue:
            return _queue.pop(0)
        _running -= 1  # under the lock: submit() sees this worker gone and starts another
        return None


def _execute(job: Job) -> None:
    job.started = time.perf_counter()
    try:
        with open(job.log, "w") as out:
            proc = subprocess.Popen(
                job.argv, env=job.env, cwd=job.cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            with _lock:
                _procs.append(proc)
            _, status, usage = os.wait4(proc.pid, 0)  # proc.wait() with the tree's rusage (what /usr/bin/time reads)
            proc.returncode = job.returncode = os.waitstatus_to_exitcode(status)
            job.cpu_s = usage.ru_utime + usage.ru_stime
    except OSError as e:
        with open(job.log, "a") as out:
            out.write(f"could not start {job.argv}: {e}\n")
        job.returncode = -1
    job.seconds = time.perf_counter() - job.started
    job.done.set()


def _run() -> None:
    global _queued_cpu
    while (job := _next()) is not None:
        _execute(job)
        with _lock:
            _queued_cpu += job.cpu_s or 0.0


def queued_cpu() -> float:
    """CPU seconds of the queued jobs' process trees reaped so far: this process's RUSAGE_CHILDREN grew by as much
    when each was reaped, while some other test was running (tests/timing.py takes it out of that test's row)."""
    with _lock:
        return _queued_cpu


def run_here(job: Job) -> Job:
    """Run `job` now, in the calling test, not in the queue: a child short enough to sit in the suite's own order
    (its minutes then count there, in the test's own row of the closing table)."""
    job.log = os.path.join(job_dir(), f"{job.id}.log")
    _execute(job)
    return job


def job_dir() -> str:
    """A folder for this session's job logs and results."""
    global _dir
    if _dir is None:
        _dir = tempfile.mkdtemp(prefix="labkit-bg-")
    return _dir


def _start_worker() -> None:
    """Call with _lock held."""
    global _running
    _running += 1
    threading.Thread(target=_run, name=f"background-tests-{_running}", daemon=True).start()


def submit(jobs: list[Job]) -> None:
    """Queue `jobs`, longest first, and start a worker if none runs (call once, when collection ends)."""
    if not jobs:
        return
    for job in jobs:
        job.log = os.path.join(job_dir(), f"{job.id}.log")
        _jobs[job.id] = job
    with _lock:
        _queue.extend(jobs)
        _queue.sort(key=lambda j: -j.expected_s)
        if _running == 0:
            _start_worker()


def second_worker() -> None:
    """The suite's own tests are done: a second worker takes the jobs not yet started."""
    with _lock:
        if _running == 1 and _queue:
            _start_worker()


def wait(job_id: str, fallback: Job | None = None) -> Job:
    """The finished job; runs `fallback` now if nothing was submitted under `job_id`."""
    job = _jobs.get(job_id)
    if job is None:
        if fallback is None:
            raise KeyError(f"no background job {job_id!r} was submitted")
        submit([fallback])
        job = _jobs[job_id]
    second_worker()
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
