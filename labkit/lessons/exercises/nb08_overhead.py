"""Notebook 08's exercise 08.overhead: a step's time from its kernel count, the host's cost to launch one kernel and
the device's time to run one, eager and replayed as a CUDA graph. Judged against labkit.profiling.roofline's
launch_bound_s on host-bound, device-bound and tiny steps drawn anew on every call; launch_bound_s is refused while
the answer runs. Pure arithmetic: nothing is timed or launched.

    from labkit.lessons.exercises import check, nb08
    check("08.overhead", lambda: nb08.check_overhead(step_time_us))
"""

from __future__ import annotations

import itertools
import random

from labkit.lessons.exercises import Wrong, call, number, refusing, require, todo

__all__ = ["check_overhead"]

_calls = itertools.count(1)
REL = 0.02  # within 2 % passes: max(K L, K G) and the exact pipeline differ by at most 1 % on the eager cases


def _near(got: float, want: float) -> bool:
    return abs(got - want) <= REL * abs(want)


def _cases(rng: random.Random) -> list[tuple[str, int, float, float]]:
    """(kind, kernels, launch_us, kernel_us): a host-bound step (kernels shorter than their launch, as small models'
    are on a GPU), a device-bound one (large kernels) and a tiny one (a few kernels: one launch is a large share)."""
    return [
        ("host-bound", rng.randint(100, 600), float(rng.randint(6, 12)), rng.randint(5, 30) / 10),
        ("device-bound", rng.randint(100, 600), float(rng.randint(4, 8)), float(rng.randint(30, 90))),
        ("tiny", rng.randint(3, 6), float(rng.randint(8, 15)), rng.randint(5, 15) / 10),
    ]


def _hint(kind: str, graph: bool, got: float, k: int, launch: float, kernel: float) -> str:
    """What the answer `got` is, when it is a known wrong rule; '' when none fits."""
    if graph:
        if _near(got, k * (launch + kernel)) or _near(got, max(k * launch, k * kernel)):
            return "that is the eager step: a CUDA graph is launched once, not kernel by kernel"
        if _near(got, k * kernel):
            return "the replay still costs the host one launch before the first kernel can run"
        if _near(got, max(launch, k * kernel)):
            return "one step alone: the graph's one launch comes before its first kernel, they do not overlap"
        return ""
    if _near(got, k * (launch + kernel)):
        return "launches are queued while the device works: the two streams overlap, the slower one sets the time"
    if kind == "host-bound" and _near(got, k * kernel):
        return "host-bound: each kernel ends before the host has launched the next, so the device waits on the host"
    if kind == "device-bound" and _near(got, k * launch):
        return "device-bound: the host is ahead, and the queue waits on the device's kernels"
    return ""


def check_overhead(step_time_us) -> str:
    """08.overhead: step_time_us(kernels, launch_us, kernel_us, cuda_graph) -> microseconds for one step, timed alone
    from the first launch to the last kernel's end, whose `kernels` kernels each cost the host `launch_us` to launch
    and the device `kernel_us` to run: eager (cuda_graph False: one launch per kernel, queued ahead) or replayed as one
    CUDA graph (True). Within 2 %, on three steps and both ways, drawn anew each call."""
    from labkit.profiling.roofline import launch_bound_s

    todo(step_time_us)
    rng = random.Random(next(_calls))
    cases = _cases(rng)
    for kind, k, launch, kernel in cases:
        for graph in (False, True) if kind != "tiny" else (True,):
            what = f"step_time_us({k}, {launch:g}, {kernel:g}, cuda_graph={graph})"
            with refusing([launch_bound_s], "work it out: labkit.profiling.roofline.launch_bound_s is the answer"):
                got = number(call(step_time_us, k, launch, kernel, graph), what)
            want = launch_bound_s(k, launch * 1e-6, kernel * 1e-6, graph=graph) * 1e6
            if _near(got, want):
                continue
            hint = _hint(kind, graph, got, k, launch, kernel)
            if hint:
                raise Wrong(f"{what}, a {kind} step: you say {got:,.4g} µs; {hint}")
            require(False, f"{what}, a {kind} step: you say {got:,.4g} µs, the model says {want:,.4g} (2 % passes)")
    return "a host-bound, a device-bound and a tiny step, eager and as a CUDA graph (a model: no GPU timed here)"
