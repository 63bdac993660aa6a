"""Checkers for notebook 04 (graphs and compilation). Each runs the learner's code on inputs that change with every
call and measures what XLA did: graphs compiled (torch_xla's CompileTime), recompiles after warm-up (labkit's
recompile detective), device->host reads (labkit's SyncFinder). Off XLA there is nothing to count: the answer is
still run and compared with what XLA would do, and the note says it was not measured."""

from __future__ import annotations

import itertools
import math
import random

import torch

from labkit.lessons.exercises import Wrong, call, integer, require, todo

__all__ = ["check_branch_free", "check_choose_pad", "check_predict_graphs", "require"]

_calls = itertools.count(1)


def _compiles() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def check_predict_graphs(predict_graphs, rt) -> str:
    """04.graphs: predict_graphs(lengths, multiple) -> how many graphs XLA compiles for batches of these lengths,
    each padded up to a multiple of `multiple` (1: no padding). Measured by running a small op on every padded
    batch, with a feature width of its own so no earlier graph is reused."""
    todo(predict_graphs)
    k = next(_calls)
    rng = random.Random(k)
    notes = []
    for multiple in (1, rng.choice([4, 8]), 16):
        lengths = [rng.randint(3, 30) for _ in range(rng.randint(6, 12))]
        got = integer(call(predict_graphs, list(lengths), multiple), f"predict_graphs({lengths}, {multiple})")
        padded = [multiple * math.ceil(n / multiple) for n in lengths]
        if rt.is_xla:
            w = torch.randn(50 + k * 7 + multiple, 3, device=rt.device)  # a width no other call used
            rt.sync()
            c0 = _compiles()
            for n in padded:
                out = (torch.ones(n, w.shape[0], device=rt.device) @ w).sum()  # alive at the sync: computed
                rt.sync()
            del out
            want = _compiles() - c0
        else:
            want = len(set(padded))
        if got == len(lengths) and want != got:
            raise Wrong(f"{len(lengths)} batches, but batches of a length XLA has seen reuse its graph")
        if got == len(set(lengths)) and want != got:
            raise Wrong(f"padded to multiples of {multiple}, several lengths share one padded shape")
        require(got == want, f"lengths {lengths}, multiple {multiple}: you say {got}, XLA compiled {want}")
        notes.append(f"{want} for {len(lengths)} batches (x{multiple})")
    return ", ".join(notes) + ("" if rt.is_xla else " (not measured: no XLA here)")


def check_choose_pad(choose_pad, run) -> str:
    """04.bucket: choose_pad(lengths) -> the one length to pad every batch to so that run(lengths, pad_to=...) never
    recompiles after warm-up, with as little padding as possible. Three random lists of lengths, measured by
    `run` (the recompile detective of section 3)."""
    todo(choose_pad)
    rng = random.Random(next(_calls))
    for _ in range(3):
        lengths = [rng.choice([5, 9, 12, 16, 20]) for _ in range(6)]
        pad_to = integer(call(choose_pad, list(lengths)), f"choose_pad({lengths})")
        require(
            pad_to >= max(lengths), f"{pad_to} is shorter than the longest batch ({max(lengths)}): it cannot hold it"
        )
        mon = run(lengths, pad_to=pad_to)
        require(mon.events == [], f"lengths {lengths}: still {len(mon.events)} recompile(s) after warm-up")
        require(
            pad_to == max(lengths), f"lengths {lengths}: {pad_to - max(lengths)} columns of padding more than needed"
        )
    return "3 lists of lengths, 0 recompiles after warm-up, no extra padding"


def reference_branchy(h):
    """Section 2's branch: double when the activations sum above zero, else subtract one."""
    return h * 2 if h.sum() > 0 else h - 1


def check_branch_free(branch_free, rt, calls: int = 6) -> str:
    """04.branch: branch_free(h) -> the same values as reference_branchy(h) for inputs of both signs, with no read of
    the device (the `if` made one per call) and one graph for every input (counted after the first call)."""
    from labkit.dashboard.syncs import SyncFinder

    todo(branch_free)
    k = next(_calls)
    g = torch.Generator().manual_seed(k)
    inputs = [torch.randn(4, 8 + k % 5, generator=g) + (2.0 if i % 2 else -2.0) for i in range(calls)]
    outs, c0 = [], None
    with SyncFinder() as finder:
        for i, x in enumerate(inputs):
            h = rt.to_device(x)
            rt.sync()
            out = call(branch_free, h)
            require(torch.is_tensor(out), f"return a tensor, got {type(out).__name__}")
            require(out.device.type == rt.device.type, f"the result is on {out.device}: keep it on {rt.device}")
            rt.sync()
            if i == 0 and rt.is_xla:
                c0 = _compiles()
            outs.append(out)
        reads = sum(finder.total.values())
    extra = _compiles() - c0 if c0 is not None else 0
    for x, out in zip(inputs, outs):
        want = reference_branchy(x)
        require(bool(torch.allclose(out.cpu(), want, atol=1e-5)), "the values differ from the branch's on some input")
    lines = "; ".join(f"{n}x {s}" for s, n in finder.total.most_common(2))
    require(reads == 0, f"{reads} device->host reads in {calls} calls ({lines}): the branch still reads the device")
    require(extra == 0, f"{extra} new graph(s) after the first call: the graph still depends on the values")
    return f"{calls} inputs of both signs: one graph, no read" + ("" if rt.is_xla else " (not measured: no XLA here)")
