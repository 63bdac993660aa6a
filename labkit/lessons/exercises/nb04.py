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
import re

import torch

from labkit.lessons.exercises import call, integer, mistake, predicting, refusing, require, todo, xla_metric

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


def _lengths(rng: random.Random, multiple: int) -> list[int]:
    """Lengths on which every likely wrong count differs from the right one: the batches themselves, the distinct
    raw lengths, and (padded) floor or round to the nearest multiple instead of the ceiling."""
    while True:
        lengths = [rng.randint(3, max(30, 5 * multiple)) for _ in range(rng.randint(6, 12))]
        right = len({multiple * math.ceil(n / multiple) for n in lengths})
        wrong = {len(lengths)}  # every batch its own graph
        if multiple > 1:  # the raw lengths, the floor, the nearest multiple
            wrong |= {
                len(set(lengths)),
                len({multiple * (n // multiple) for n in lengths}),
                len({multiple * round(n / multiple) for n in lengths}),
            }
        if right not in wrong:
            return lengths


def check_predict_graphs(predict_graphs, rt) -> str:
    """04.graphs: predict_graphs(lengths, multiple) -> how many graphs XLA compiles for batches of these lengths,
    each padded up to a multiple of `multiple` (1: no padding). Measured by running a small op on every padded
    batch, with a feature width of its own so no earlier graph is reused. Lengths are drawn so that counting the
    batches, the raw lengths, or padding with floor or round gives another number. On XLA the prediction must make
    the device do nothing (torch_xla's counts). Exact: a count of graphs."""
    todo(predict_graphs)
    rng = random.Random(next(_calls))
    notes = []
    for multiple in (1, rng.choice([4, 8]), 16):
        lengths = _lengths(rng, multiple)
        with predicting(rt, "a prediction of the graphs"):
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
        hint = mistake(
            got,
            want,
            {
                f"{len(lengths)} batches, but batches of a length XLA has seen reuse its graph": len(lengths),
                f"padded to multiples of {multiple}, several lengths share one padded shape": len(set(lengths)),
                "padding rounds up (a batch is never cut): the ceiling, not the floor": len(
                    {multiple * (n // multiple) for n in lengths}
                ),
                "padding rounds up (a batch is never cut): the ceiling, not the nearest multiple": len(
                    {multiple * round(n / multiple) for n in lengths}
                ),
            },
        )
        require(
            got == want,
            f"lengths {lengths}, multiple {multiple}: you say {got}, XLA compiled {want}"
            + (f": {hint}" if hint else ""),
        )
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
    log_every (so steps // log_every and its ceiling differ). guarded_loop itself refuses, and on XLA the prediction
    must make the device do nothing (torch_xla's counts), while the learner's code runs. Exact: a count."""
    import contextlib
    import io

    todo(predict_reads)
    rng = random.Random(next(_calls))
    notes = []
    for _ in range(3):
        log_every = rng.randint(2, 6)
        steps = log_every * rng.randint(2, 4) + rng.randint(1, log_every - 1)
        with refusing([guarded_loop], "predict from the loop's code: running it and counting is the check's part"):
            with predicting(rt, "a prediction of the reads"):
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
        logs = math.ceil(steps / log_every)
        hint = mistake(
            got,
            want,
            {
                # these two always agree when steps is no multiple of log_every: neither is named
                f"the log runs at step 0 too (step % {log_every} == 0)": steps // log_every + steps + 1,
                "the mean at the end is a read too (total.item())": steps + logs,
                "an `if` on a device tensor is a read too, every time it runs": logs + 1,
                "the log's loss.item() is a read of its own, besides the guard": steps + 1,
            },
        )
        require(
            got == want,
            f"{steps} steps, log every {log_every}: you say {got}, torch_xla counted {want} transfers"
            + (f": {hint}" if hint else ""),
        )
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


def _made_up(rng: random.Random) -> list[dict]:
    """Executions of XLA instructions where the answer is one instruction, and each wrong reading gives another:
    instances of one op summed by their base name (fusion.1 + fusion.2 + ... : separate instructions, each calling its
    own fused computation), the instruction run most often, the longest single run."""
    a, b, c, d = rng.sample(["dot", "fusion", "convolution", "add", "reduce", "copy", "transpose"], 4)
    n = rng.sample(range(1, 40), 8)
    slow = 150.0 + rng.randint(0, 20)
    events = [{"name": f"{a}.{n[0]}", "dur_us": slow / 3} for _ in range(3)]  # the slowest instruction
    events += [{"name": f"{b}.{n[1 + i]}", "dur_us": 40.0} for i in range(4) for _ in range(2)]  # 4 x 80: b wins summed
    events += [{"name": f"{c}.{n[5]}", "dur_us": 1.0} for _ in range(40)]  # the most runs: 40 us
    events += [{"name": f"{d}.{n[6]}", "dur_us": 120.0}]  # the longest single run
    rng.shuffle(events)
    for i, e in enumerate(events):
        e["ts"] = 10.0 * i
    return events


def _per_instruction(events) -> dict[str, float]:
    """Microseconds per instruction name (`fusion.3` and `fusion.7` apart), computed here, not by labkit."""
    total: dict[str, float] = {}
    for e in events:
        total[e["name"]] = total.get(e["name"], 0.0) + float(e["dur_us"])
    return total


def _judge_slowest(got, events, where: str) -> str:
    total = _per_instruction(events)
    want = max(total, key=total.get)
    by_base: dict[str, float] = {}
    runs: dict[str, int] = {}
    for e in events:
        base = re.sub(r"\.\d+$", "", e["name"])
        by_base[base] = by_base.get(base, 0.0) + float(e["dur_us"])
        runs[e["name"]] = runs.get(e["name"], 0) + 1
    require(isinstance(got, str), f"return the instruction's name (a str), not a {type(got).__name__}")
    got = str(got)
    hint = mistake(
        got,
        want,
        {
            "fusion.3 and fusion.7 are two instructions, each calling its own computation: add up each name's "
            "executions, do not merge them by base name": max(by_base, key=by_base.get),
            "the instruction run most often is not the one that took the most time": max(runs, key=runs.get),
            "add up every execution of an instruction, not its longest single run": max(
                events, key=lambda e: e["dur_us"]
            )["name"],
        },
    )
    require(
        got == want,
        f"{where}: you say {got!r} ({total.get(got, 0.0):.0f} us in all), {want!r} took {total[want]:.0f} us"
        + (f": {hint}" if hint else ""),
    )
    return want


def check_slowest_op(slowest_op, rt) -> str:
    """04.slowest: slowest_op(events) -> the name of the instruction that took the most time in a capture, from its
    executions ({"name", "ts", "dur_us"}: `Analysis.op_events`); XLA's numbered instructions (`fusion.3`,
    `fusion.7`) are distinct, each calling its own fused computation. Judged on made-up executions (where merging
    numbered names by their base, the most frequent instruction and the longest single run each give another
    answer), then on a fresh capture of an MLP whose width changes with every call; the expectation is the sum per
    name computed in the checker. labkit's ranking (analysis.rank_ops) refuses while the learner's code runs."""
    import tempfile

    from labkit.profiling import analysis

    todo(slowest_op)
    rng = random.Random(next(_calls))
    events = _made_up(rng)
    why = "rank the executions yourself: labkit's own ranking is what the check compares with"
    with refusing([analysis.rank_ops], why):
        got = call(slowest_op, [dict(e) for e in events])
    _judge_slowest(got, events, "on made-up executions")
    with tempfile.TemporaryDirectory() as d:
        prof = _capture(rt, rng.choice(range(96, 400, 8)), d)
        captured = [dict(e) for e in prof.op_events]
        require(bool(captured), f"the capture in {prof.folder} holds no ops to rank ({prof.backend})")
        with refusing([analysis.rank_ops], why):
            got = call(slowest_op, [dict(e) for e in captured])
    want = _judge_slowest(got, captured, "on a fresh capture")
    total = _per_instruction(captured)
    where = "device instructions (XLA)" if prof.backend in ("tpu", "xla-cpu") else f"ops ({prof.backend})"
    return f"{want!r}: {total[want] / 1e3:.2f} ms, of {len(total)} {where} in a fresh capture"
