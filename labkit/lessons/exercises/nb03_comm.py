"""The checker of notebook 03's exercise 5 (03.comm_time): the time of an all-reduce along an axis with and without
wraparound links, and the communication a step leaves exposed after its backward. Both are judged against
labkit.spmd.comm (`ring_seconds`, `exposed_seconds`) on inputs drawn anew on every call, chosen so that each
plausible wrong rule gives other numbers than the right one; the library's own functions are refused while the
learner's code runs. Re-exported by labkit.lessons.exercises.nb03 with the notebook's other checkers.

    check("03.comm_time", lambda: nb03.check_comm_time(allreduce_seconds, exposed_seconds))
"""

from __future__ import annotations

import itertools
import random

from labkit.lessons.exercises import Wrong, call, number, refusing, todo
from labkit.spmd import comm

__all__ = ["check_comm_time"]

_calls = itertools.count(1)
_REL = 1e-6  # the learner's arithmetic may round in another order; any rule mistaken is off by far more


def _library() -> list:
    """What computes the answers: refused while the learner's code runs (writing them is the exercise)."""
    return [comm.ring_seconds, comm.exposed_seconds, comm.sent, comm.traffic, comm.step_comm, comm.Ici.seconds]


_WHY = "work it out yourself: labkit.spmd.comm computing the time is the answer"


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= _REL * max(abs(b), 1e-12)


def _ring(nbytes, n, s, wrap):
    return comm.ring_seconds("all-reduce", nbytes, n, s, wrap)


# plausible wrong rules for the all-reduce, each with what it misses
_RING_WRONG = {
    "the axis without wraparound is a line, not a ring: a ring's collective runs over it in about twice the time "
    "(wraparound=False doubles it)": lambda B, n, s, w: _ring(B, n, s, True),
    "the doubling belongs to the axis WITHOUT wraparound (a line); a ring (wraparound=True) takes the ring's time": (
        lambda B, n, s, w: _ring(B, n, s, not w)
    ),
    "an all-reduce is a reduce-scatter then an all-gather: each chip sends 2·B·(n−1)/n, not B·(n−1)/n": (
        lambda B, n, s, w: _ring(B, n, s, w) / 2
    ),
    "in each pass a chip sends (n−1)/n of the buffer, not all of it: 2·B·(n−1)/n": (
        lambda B, n, s, w: _ring(B, n, s, w) * n / (n - 1)
    ),
}


def _queue(b, r) -> float:
    return comm.exposed_seconds(b, r)


# plausible wrong rules for the exposed time
_EXPOSED_WRONG = {
    "not all of it hides: the last gradient computed (the first layer's) has no backward left to hide behind, and "
    "the optimizer step waits for its reduction": lambda b, r: 0.0,
    "not all of it is exposed: each reduction runs while the backward of the layers below it goes on": (
        lambda b, r: sum(r)
    ),
    "a reduction cannot hide behind the whole backward, only behind the part computed after its gradient exists: "
    "comparing the sums is not enough": lambda b, r: max(0.0, sum(r) - sum(b)),
    "the last reduction is not all: here the reductions do not keep up, and each waits for the previous one on the "
    "same links": lambda b, r: r[-1],
    "the reductions share the links: one that overruns the next layer's backward delays all that follow (a queue: "
    "each starts at the later of its gradient ready and the previous reduction done)": (
        lambda b, r: sum(max(0.0, x - y) for x, y in zip(r[:-1], b[1:])) + r[-1]
    ),
    "a reduction cannot start before the backward has made its gradient: it starts at the later of that moment "
    "and the previous reduction's end (a max, not one after the other from the first)": (
        lambda b, r: max(0.0, b[0] + sum(r) - sum(b))
    ),
    "index 0 is the layer the backward computes first (the last layer), not the first layer": (
        lambda b, r: _queue(b[::-1], r[::-1])
    ),
    "that is the whole backward plus what is exposed: return only the time the step waits after the backward": (
        lambda b, r: sum(b) + _queue(b, r)
    ),
}


def _ring_cases(rng: random.Random) -> list[tuple]:
    """(bytes, chips, bytes/s, wraparound): every axis length with and without wraparound, shuffled."""
    cases = [
        (rng.uniform(1e6, 4e9), n, rng.choice([50e9, 100e9, 200e9, 300e9]) * rng.uniform(0.9, 1.1), w)
        for n in (2, 4, 8, 16)
        for w in (True, False)
    ]
    rng.shuffle(cases)
    return cases


def _exposed_cases(rng: random.Random) -> list[tuple[list[float], list[float]]]:
    """Backward and reduction times (seconds) of a few layers: reductions that keep up (only the last one shows), one
    large early reduction that spills over several layers, reductions that never keep up, and one layer alone."""
    n = rng.randint(4, 7)
    back = [rng.uniform(1e-3, 2e-3) for _ in range(n)]
    keep_up = [rng.uniform(0.2, 0.6) * x for x in back[1:]] + [rng.uniform(0.5e-3, 1.5e-3)]
    spill = [rng.uniform(2.2, 2.8) * back[1]] + [rng.uniform(0.2, 0.4) * x for x in back[1:]]
    behind = [rng.uniform(1.3, 1.8) * x for x in back]
    one = ([rng.uniform(1e-3, 2e-3)], [rng.uniform(1e-4, 1e-3)])
    return [(back, keep_up), (back, spill), (back, behind), one]


def _judge(got: list[float], want: list[float], wrong: dict, args: list[tuple], what: str) -> None:
    """Wrong unless every answer is near the right one; the hint names the one wrong rule that explains every
    answer (none when two rules or none do)."""
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if not _near(g, w)]
    if not bad:
        return
    hits = [hint for hint, rule in wrong.items() if all(_near(g, float(rule(*a))) for g, a in zip(got, args))]
    i = bad[0]
    raise Wrong(
        f"{what(args[i])}: you say {got[i]:.6g} s, it is {want[i]:.6g} s" + (f": {hits[0]}" if len(hits) == 1 else "")
    )


def check_comm_time(allreduce_seconds, exposed_seconds) -> str:
    """03.comm_time: allreduce_seconds(nbytes, chips, send_bytes_per_s, wraparound) -> seconds of a ring all-reduce
    of `nbytes` along an axis of `chips` chips (twice a ring's time without wraparound); exposed_seconds(backward_s,
    reduce_s) -> seconds the step waits after its backward for gradient reductions that queue on the links."""
    todo(allreduce_seconds)
    rng = random.Random(next(_calls))
    ring_args = _ring_cases(rng)
    with refusing(_library(), _WHY):
        got = [number(call(allreduce_seconds, *a), f"allreduce_seconds{a}") for a in ring_args]
    _judge(
        got,
        [_ring(*a) for a in ring_args],
        _RING_WRONG,
        ring_args,
        lambda a: f"{a[0]:,.0f} B over {a[1]} chips at {a[2] / 1e9:.0f} GB/s, wraparound={a[3]}",
    )
    todo(exposed_seconds)
    exp_args = _exposed_cases(rng)
    with refusing(_library(), _WHY):
        got = [
            number(call(exposed_seconds, list(b), list(r)), f"exposed_seconds for {len(b)} layers") for b, r in exp_args
        ]
    _judge(
        got,
        [_queue(b, r) for b, r in exp_args],
        _EXPOSED_WRONG,
        exp_args,
        lambda a: f"backward {[round(x * 1e3, 3) for x in a[0]]} ms, reductions {[round(x * 1e3, 3) for x in a[1]]} ms",
    )
    return f"{len(ring_args)} all-reduces with and without wraparound, {len(exp_args)} backwards"
