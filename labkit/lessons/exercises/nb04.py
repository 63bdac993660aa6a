"""Checkers for notebook 04 (graphs and compilation). Each runs the learner's code on inputs that change with every
call and measures what XLA did: graphs compiled (torch_xla's CompileTime), device->host transfers (torch_xla's
TransferFromDeviceTime), where the result lives. Off XLA there is nothing to count: the answer is still run and
compared with what XLA would do, and the note says it was not measured.

    from labkit.lessons.exercises import check, nb04
    check("04.graphs", lambda: nb04.check_predict_graphs(predict_graphs, rt))
    check("04.reads", lambda: nb04.check_predict_reads(predict_reads, rt))
    check("04.branch", lambda: nb04.check_branch_free(branch_free, rt))
    check("04.slowest", lambda: nb04.check_slowest_op(slowest_op, rt))
"""

from __future__ import annotations

import itertools
import math
import random

import torch

from labkit.lessons.exercises import Wrong, call, integer, refusing, require, todo, xla_metric

__all__ = [
    "check_branch_free",
    "check_predict_graphs",
    "check_predict_reads",
    "check_slowest_op",
    "guarded_loop",
    "reference_branchy",
]

_calls = itertools.count(1)
# every measurement uses a feature width no earlier one used: XLA caches graphs by shape, so a width seen before
# would be served from the cache and count no compile
_widths = itertools.count(50)


def compiles() -> int:
    """Graphs XLA has compiled in this process (samples of torch_xla's CompileTime metric)."""
    return xla_metric("CompileTime")[0]


def transfers() -> int:
    """Device->host copies torch_xla has made in this process (samples of its TransferFromDeviceTime metric)."""
    return xla_metric("TransferFromDeviceTime")[0]


# -- 1. predict the graphs a sequence of lengths compiles ---------------------------------------------------------


def check_predict_graphs(predict_graphs, rt) -> str:
    """04.graphs: predict_graphs(lengths, multiple) -> how many graphs XLA compiles for batches of these lengths,
    each padded up to a multiple of `multiple` (1: no padding). Measured by running a small op on every padded
    batch, with a feature width of its own so no earlier graph is reused. Exact: a count of graphs."""
    todo(predict_graphs)
    rng = random.Random(next(_calls))
    notes = []
    for multiple in (1, rng.choice([4, 8]), 16):
        lengths = [rng.randint(3, 30) for _ in range(rng.randint(6, 12))]
        got = integer(call(predict_graphs, list(lengths), multiple), f"predict_graphs({lengths}, {multiple})")
        padded = [multiple * math.ceil(n / multiple) for n in lengths]
        if rt.reads_metrics:
            w = torch.randn(next(_widths), 3, device=rt.device)
            rt.sync()
            c0 = compiles()
            for n in padded:
                out = (torch.ones(n, w.shape[0], device=rt.device) @ w).sum()  # alive at the sync: computed
                rt.sync()
            del out
            want = compiles() - c0
        else:
            want = len(set(padded))
        if got == len(lengths) and want != got:
            raise Wrong(f"{len(lengths)} batches, but batches of a length XLA has seen reuse its graph")
        if got == len(set(lengths)) and want != got:
            raise Wrong(f"padded to multiples of {multiple}, several lengths share one padded shape")
        require(got == want, f"lengths {lengths}, multiple {multiple}: you say {got}, XLA compiled {want}")
        notes.append(f"{want} for {len(lengths)} batches (x{multiple})")
    return ", ".join(notes) + ("" if rt.reads_metrics else " (not measured: no XLA here)")


# -- 2. predict the reads of a training loop ----------------------------------------------------------------------


def guarded_loop(w, steps: int, log_every: int, sync) -> float:
    """A loop as many are written: a NaN guard every step, a loss printed every `log_every` steps (from step 0),
    the mean loss returned at the end. `w` lives on the device; `sync` cuts the graph (torch_xla.sync)."""
    total = torch.zeros((), device=w.device)
    for step in range(steps):
        loss = (w @ w).tanh().mean()
        total = total + loss
        sync()
        if loss.isnan():  # the guard
            raise FloatingPointError(f"loss is NaN at step {step}")
        if step % log_every == 0:  # the log
            print(f"step {step}: loss {loss.item():.4f}")
    return total.item() / steps  # the mean loss


def check_predict_reads(predict_reads, rt) -> str:
    """04.reads: predict_reads(steps, log_every) -> the device->host transfers guarded_loop makes. Measured by
    torch_xla's TransferFromDeviceTime count over three random (steps, log_every), where steps is no multiple of
    log_every (so steps // log_every and its ceiling differ). Exact: a count of transfers."""
    import contextlib
    import io

    todo(predict_reads)
    rng = random.Random(next(_calls))
    notes = []
    for _ in range(3):
        log_every = rng.randint(2, 6)
        steps = log_every * rng.randint(2, 4) + rng.randint(1, log_every - 1)
        got = integer(call(predict_reads, steps, log_every), f"predict_reads({steps}, {log_every})")
        if rt.reads_metrics:
            w = torch.randn(16, 16, device=rt.device)
            rt.sync()
            t0 = transfers()
            with contextlib.redirect_stdout(io.StringIO()):  # the loop's log lines, not the learner's concern
                guarded_loop(w, steps, log_every, rt.sync)
            want = transfers() - t0
        else:
            want = steps + math.ceil(steps / log_every) + 1  # the loop's reads as written: nothing counts them here
        if got == steps // log_every + steps + 1 and want != got:
            raise Wrong(f"{steps} steps, a log every {log_every}: the log runs at step 0 too (step % {log_every} == 0)")
        if got == math.ceil(steps / log_every) + 1 and want != got:
            raise Wrong(f"{steps} steps: an `if` on a device tensor is a read too, every time it runs")
        require(got == want, f"{steps} steps, log every {log_every}: you say {got}, torch_xla counted {want} transfers")
        notes.append(f"{want} for ({steps}, {log_every})")
    return ", ".join(notes) + ("" if rt.reads_metrics else " (not measured: no XLA transfer counter here)")


# -- 3. a branch without a branch ----------------------------------------------------------------------------------


def reference_branchy(h):
    """Section 2's branch: double when the activations sum above zero, else subtract one."""
    return h * 2 if h.sum() > 0 else h - 1


def check_branch_free(branch_free, rt, calls: int = 6) -> str:
    """04.branch: branch_free(h) -> the same values as reference_branchy(h) for inputs of both signs, with no read of
    the device (the `if` made one per call: torch_xla's transfer count and labkit's SyncFinder) and one graph for
    every input (counted after the first call)."""
    from labkit.dashboard.syncs import SyncFinder

    todo(branch_free)
    k = next(_calls)
    g = torch.Generator().manual_seed(k)
    width = next(_widths)  # a graph of its own: the first call compiles, the others must not
    inputs = [torch.randn(4, width, generator=g) + (2.0 if i % 2 else -2.0) for i in range(calls)]
    outs, c0, t0 = [], None, transfers() if rt.reads_metrics else 0
    with SyncFinder() as finder:
        for i, x in enumerate(inputs):
            h = rt.to_device(x)
            rt.sync()
            out = call(branch_free, h)
            require(torch.is_tensor(out), f"return a tensor, got {type(out).__name__}")
            require(out.device.type == rt.device.type, f"the result is on {out.device}: keep it on {rt.device}")
            rt.sync()
            if i == 0 and rt.reads_metrics:
                c0 = compiles()
            outs.append(out)
        reads = max(sum(finder.total.values()), transfers() - t0 if rt.reads_metrics else 0)
    extra = compiles() - c0 if c0 is not None else 0
    lines = "; ".join(f"{n}x {s}" for s, n in finder.total.most_common(2)) or "torch_xla's transfer count"
    require(reads == 0, f"{reads} device->host reads in {calls} calls ({lines}): the branch still reads the device")
    require(extra == 0, f"{extra} new graph(s) after the first call: the graph still depends on the values")
    for x, out in zip(inputs, outs):
        require(
            tuple(out.shape) == tuple(x.shape) and bool(torch.allclose(out.cpu(), reference_branchy(x), atol=1e-5)),
            "the values differ from the branch's on some input",
        )
    if not rt.reads_metrics:
        return f"{calls} inputs of both signs: the values are right (reads and graphs not measured: no XLA here)"
    return f"{calls} inputs of both signs: one graph, no read"


# -- 4. read a profile: the op that took the most time -------------------------------------------------------------


class _ProfileAt:
    def __init__(self, step: int, steps: int, out_dir: str):
        self.step, self.steps, self.out_dir = step, steps, out_dir

    def on_step_end(self, trainer, batch):
        if trainer.step == self.step:
            trainer.request_profile(steps=self.steps, out_dir=self.out_dir)


def _capture(rt, width: int, out_dir: str):
    """A fresh capture: a small MLP of this width trained for 8 steps, steps 3-6 profiled."""
    import labkit

    torch.manual_seed(width)
    xs, ys = torch.randn(128, 48), torch.randint(0, 10, (128,))
    model = torch.nn.Sequential(torch.nn.Linear(48, width), torch.nn.GELU(), torch.nn.Linear(width, 10))
    trainer = labkit.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        rt,
        labkit.TrainConfig(max_steps=8, log_every=0, eval_every=0),
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=16),
        callbacks=[_ProfileAt(step=2, steps=4, out_dir=out_dir)],
    )
    trainer.fit()
    return trainer.profiles[-1]


def _made_up(rng: random.Random) -> tuple[list[dict], str]:
    """Executions where the op called most often is not the slowest, nor the one with the longest single run, and
    XLA's numbered instructions (fusion.1, fusion.2) are ops of their own: (events, the slowest op's name)."""
    a, b, c = rng.sample(["dot", "fusion", "convolution", "add", "reduce", "copy"], 3)
    events = [{"name": f"{a}.1", "ts": 0.0, "dur_us": 30.0} for i in range(6)]  # 180 us in 6 short runs
    events += [{"name": f"{c}.{i}", "ts": 0.0, "dur_us": 40.0} for i in range(2, 4)]  # 160 us if summed by kind
    events += [{"name": b, "ts": 0.0, "dur_us": 1.0} for _ in range(40)]  # the most calls: 40 us
    events += [{"name": c, "ts": 0.0, "dur_us": 120.0}]  # the longest single run: 120 us
    rng.shuffle(events)
    for i, e in enumerate(events):
        e["ts"] = 10.0 * i
    return events, f"{a}.1"


def check_slowest_op(slowest_op, rt) -> str:
    """04.slowest: slowest_op(events) -> the name of the op that took the most time in a capture, from its executions
    ({"name", "ts", "dur_us"}: `Analysis.op_events`), each of XLA's numbered instructions (`fusion.3`) an op.
    Judged on made-up executions (the most frequent op and the longest single run are not the answer), then on a
    fresh capture of an MLP whose width changes with every call, against labkit's own ranking (`Analysis.ops`)
    of that capture; labkit's ranking refuses while the learner's code runs."""
    import tempfile

    from labkit.profiling import analysis

    todo(slowest_op)
    rng = random.Random(next(_calls))
    events, want = _made_up(rng)
    why = "rank the executions yourself: labkit's own ranking is what the check compares with"
    with refusing([(analysis, "rank_ops")], why):
        got = call(slowest_op, [dict(e) for e in events])
    require(isinstance(got, str), f"return the op's name (a str), not a {type(got).__name__}")
    total = {}
    for e in events:
        total[e["name"]] = total.get(e["name"], 0.0) + e["dur_us"]
    require(
        str(got) == want,
        f"you say {got!r}; on made-up executions {want!r} took {total[want]:.0f} us in all, {got!r} "
        f"{total.get(str(got), 0.0):.0f} us: add up every execution of an op (each numbered instruction, "
        "fusion.1 or fusion.2, is an op of its own), do not take the most frequent op or the longest single run",
    )
    with tempfile.TemporaryDirectory() as d:
        prof = _capture(rt, rng.choice(range(96, 400, 8)), d)
        ranked = prof.ops
        require(bool(ranked), f"the capture in {prof.folder} holds no ops to rank ({prof.backend})")
        with refusing([(analysis, "rank_ops")], why):
            got = call(slowest_op, [dict(e) for e in prof.op_events])
    want, seconds, count = ranked[0]
    require(
        isinstance(got, str) and str(got) == want,
        f"on a fresh capture you say {got!r}; the slowest op is {want!r} ({1e3 * seconds:.2f} ms in {count} runs)",
    )
    where = "device ops (XLA)" if prof.backend in ("tpu", "xla-cpu") else f"ops ({prof.backend})"
    return f"{want!r}: {1e3 * seconds:.2f} ms in {count} runs, of {len(ranked)} {where} in a fresh capture"
