"""Long child-process tests run in the background while the rest of the suite runs.

The simulated images, the 3.13 unit suite and the longest notebooks under nbval are each one child process tree
of several minutes that uses about one core, while the suite's own order leaves part of a core idle (waiting on
servers, child processes, sleeps). A test module opts in with

    def background_job(item) -> Job | None     # the child command for this collected test

conftest.py submits the jobs of the selected tests when collection ends and moves those tests to the
end of the run; each test then calls `wait(job_id)` and asserts on what the job wrote. WORKERS workers run the
jobs, longest first, from the start. Every process of a job runs at a lower priority (NICE, and on Linux its
autogroup's too, which is what decides between sessions: a Jupyter kernel or torchrun starts a session of its
own): the suite's own order runs at full speed, and the jobs take the CPU it leaves, the second core and the
idle moments of the first. Output goes to files (no pipe to fill up); jobs still running when the session ends
are killed.

Each job's CPU time is its whole process tree's, as /usr/bin/time counts it: os.wait4's resource usage of the child,
which holds every descendant it waited for (a kernel, pip, a pytest). tests/timing.py shows it per row.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKERS = 2  # at most this many jobs at once, beside the suite's own order
NICE = 10  # the jobs' priority: below the suite's own tests, which hold the session's wall time


@dataclass
class Job:
    id: str
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    expected_s: float = 0.0  # its CPU-seconds, measured: the workers start the longest first
    name: str = ""  # its row in the closing table (tests/timing.py), when the job writes no parts of its own
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
_check_s = 1.0  # how often a running job's new processes are put at the jobs' priority
_dir = None
_queued_cpu = 0.0  # CPU seconds of the queued jobs reaped so far (run_here's count in the calling test)


def _next() -> Job | None:
    global _running
    with _lock:
        if _queue:
            return _queue.pop(0)
        _running -= 1  # under the lock: submit() sees this worker gone and starts another
        return None


def _autogroup(pid: int | str) -> str | None:
    """The name of a process's Linux autogroup (the scheduler shares the CPU between these first), or None: not
    Linux, autogroups turned off, or the process is scheduled by a cgroup's CPU controller instead (a container:
    the file is then empty, and the inherited nice value is all that counts)."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            group, _, _nice = f.read().split()
        return group
    except (OSError, ValueError):
        return None


def _tree(root: int) -> list[int]:
    """root's living descendants (root included), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after the name: state, then the parent
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [root], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        tree += kids
        todo += kids
    return tree


def _lower(pid: int, ended: threading.Event) -> None:
    """Keep the job's processes at NICE while it runs: the nice value is inherited, but a process that starts a
    session (a Jupyter kernel, torchrun's workers) gets an autogroup of its own at nice 0, which would share the
    CPU equally with the suite's own order; this sets those groups to NICE too. Our own group is left alone."""
    own = _autogroup("self")
    if own is None:  # no autogroups here: the inherited nice value is enough
        return
    done: set[str] = {own}
    while not ended.wait(_check_s):
        for p in _tree(pid):
            group = _autogroup(p)
            if group is not None and group not in done:
                try:
                    with open(f"/proc/{p}/autogroup", "w") as f:
                        f.write(str(NICE))
                    done.add(group)
                except OSError:
                    pass


def _execute(job: Job, nice: bool = True) -> None:
    job.started = time.perf_counter()
    try:
        with open(job.log, "w") as out:
            # its own process group (killed whole at the end), not its own session: the session's autogroup would
            # make its nice value count for nothing against the suite's own tests
            lower = nice and shutil.which("nice") is not None
            argv = ["nice", "-n", str(NICE), *job.argv] if lower else job.argv  # nice execs it: the same process
            proc = subprocess.Popen(
                argv, env=job.env, cwd=job.cwd, stdout=out, stderr=subprocess.STDOUT, process_group=0
            )
            with _lock:
                _procs.append(proc)
            ended = threading.Event()
            if lower:
                threading.Thread(target=_lower, args=(proc.pid, ended), name=f"lower-{job.id}", daemon=True).start()
            try:  # proc.wait() with the tree's rusage (what /usr/bin/time reads)
                _, status, usage = os.wait4(proc.pid, 0)
            finally:
                ended.set()
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
    _execute(job, nice=False)
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
    """Queue `jobs`, longest first, and start workers up to WORKERS (call once, when collection ends)."""
    if not jobs:
        return
    for job in jobs:
        job.log = os.path.join(job_dir(), f"{job.id}.log")
        _jobs[job.id] = job
    with _lock:
        _queue.extend(jobs)
        _queue.sort(key=lambda j: -j.expected_s)
        while _running < min(WORKERS, len(_queue)):
            _start_worker()


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


def remove_dir() -> None:
    """Remove this session's folder of job logs and results (the GPU check's dry run alone leaves 145 MB of installed
    packages there). Called once the session passed and its closing table was printed; a failed session keeps it,
    since its failure messages name the logs inside."""
    global _dir
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)
        _dir = None


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
