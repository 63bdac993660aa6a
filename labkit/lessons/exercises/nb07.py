"""Checkers for notebook 07 (debug a run). Each runs the learner's fix and measures it with the harness the
notebook used to find the faults (labkit.lessons.capstone.measure): torch_xla's counters, labkit's SyncFinder,
time blocked on the loader. Inputs change on every call (seed, batch size, width), so no number can be copied in.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from labkit.lessons import capstone
from labkit.lessons.exercises import Wrong, call, close, number, refusing, require, todo, xla_metric
from labkit.lessons.exercises.nb07_plan import check_fixed_plan  # exercise 4's checker lives there

__all__ = ["check_fixed_loader", "check_fixed_plan", "check_fixed_step", "check_predict_step"]

_calls = itertools.count(1)


def _transfers() -> tuple[int, int]:
    """torch_xla's own counts of copies (device -> host, host -> device) in this process: the samples of its
    TransferFromDeviceTime and TransferToDeviceTime metrics. Every spelling of a read is counted here (`.item()`,
    `TensorBase.item`, `copy_` into a host buffer, `.cpu()`, `print`), where the SyncFinder names the line."""
    return xla_metric("TransferFromDeviceTime")[0], xla_metric("TransferToDeviceTime")[0]


def check_fixed_step(fixed_step, rt, steps: int = 8, warmup: int = 2) -> str:
    """07.fix_step: fixed_step(model, x, y, lr) -> (loss, correct, labelled), device tensors. Judged by: the same
    losses, accuracy and trained weights as the reference step on batches with unlabelled rows, the weights on the
    device; after warm-up, inside the learner's calls: no device->host copy and fewer host->device copies than
    one a step (torch_xla's TransferFromDeviceTime / TransferToDeviceTime counts, the SyncFinder naming the
    line), no new graph, no CPU fallback (its `aten::*` counters). Off XLA only the SyncFinder's reads and the
    values are checked, and the note says the rest was not measured."""
    todo(fixed_step)
    k = next(_calls)
    batch, width = 24 + 8 * (k % 3), 32 + 16 * (k % 2)
    x, y = capstone.digits(seed=k)
    g = torch.Generator().manual_seed(k)
    order = torch.randperm(len(y), generator=g)[: batch * steps].view(steps, batch)
    batches = [(x[i], y[i], i) for i in order]

    def run(step_fn):
        model = capstone.make_model(rt, width=width, seed=k)
        return capstone.measure(rt, model, step_fn, batches, steps=steps, warmup=warmup), model

    want, want_model = run(capstone.reference_step)
    calls, copies = [0], [0, 0]  # learner's calls; (device->host, host->device) copies inside them after warm-up

    def learners(model, x, y, lr):
        before = _transfers() if rt.reads_metrics else (0, 0)
        with refusing([capstone.reference_step], "write the step yourself: capstone.reference_step is the answer"):
            out = call(fixed_step, model, x, y, lr)
        if rt.reads_metrics and calls[0] >= warmup:
            after = _transfers()
            copies[0], copies[1] = copies[0] + after[0] - before[0], copies[1] + after[1] - before[1]
        calls[0] += 1
        require(isinstance(out, (tuple, list)) and len(out) == 3, "return (loss, correct, labelled)")
        for name, t in zip(("loss", "correct", "labelled"), out):
            require(torch.is_tensor(t), f"{name} must be a tensor, got {type(t).__name__}")
            require(t.device.type == rt.device.type, f"{name} is on {t.device}: keep it on {rt.device}")
            require(t.numel() == 1, f"{name} must be one number, got shape {tuple(t.shape)}")
        return tuple(out)

    got, model = run(learners)
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        require(
            abs(a - b) <= 1e-4 * max(1.0, abs(b)),
            f"step {i}: loss {a:.5f}, the step should give {b:.5f} (the loss over labelled rows, SGD at lr)",
        )
    require(
        abs(got["accuracy"] - want["accuracy"]) < 1e-6,
        f"accuracy {got['accuracy']:.4f}, want {want['accuracy']:.4f}: count correct labelled rows only",
    )
    if rt.reads_metrics:  # first: a fallback copies its inputs to the host too, and is named as what it is
        require(not got["fallbacks"], f"CPU fallbacks after warm-up: {got['fallbacks']} (a boolean index?)")
    lines = "; ".join(f"{v}x {s}" for s, v in got["read_lines"].items()) or "torch_xla's transfer count"
    reads = max(got["reads"], copies[0])
    require(
        reads == 0,
        f"{reads} device->host reads in {got['steps']} steps ({lines}): none needed",
    )
    if rt.reads_metrics:
        require(
            got["compiles_after_warmup"] == 0,
            f"{got['compiles_after_warmup']} graphs compiled after warm-up: the step still changes with the data",
        )
        require(
            copies[1] < got["steps"],
            f"{copies[1]} host->device copies inside your step in {got['steps']} steps: the step is computed on the "
            "host and sent back; compute it on the device, where the model is",
        )
    for (name, p), q in zip(model.named_parameters(), want_model.parameters()):
        require(p.device.type == rt.device.type, f"{name} is on {p.device}: the model must stay on {rt.device}")
        require(
            bool(torch.allclose(p.detach().cpu(), q.detach().cpu(), atol=1e-4)),
            f"{name} is not what the steps make of it: update the model's own weights, on the device",
        )
    if not rt.reads_metrics:
        return (
            f"{got['steps']} steps, the right numbers, no read the SyncFinder sees (no XLA: copies, graphs and "
            "fallbacks not measured)"
        )
    return f"{got['steps']} steps, no new graph, no fallback, no read (torch_xla's counts)"


LOADER_STEP_S = 0.1  # the step (seconds of device work, a sleep) exercise 2's loader must keep fed
LOADER_DELAY_S = 0.003  # seconds to read and decode one sample in exercise 2's dataset (a sleep)
# exercise 2's bar: under this share of each timed step waiting for the batch. Both figures are sleeps far above a
# loader's own CPU work (a batch's hand-over from a worker costs milliseconds on a busy machine), so the verdict
# holds at any speed. A loader still over the bar is timed again in turns with a right fix, both under the same load,
# and passes if its median wait per step is within LOADER_TOLERANCE of a step of the fix's. A loader decoding in the
# main process waits its whole decode (batch x 3 ms, at least 96 ms a step); one worker on a batch of 64 waits about
# 90 ms (192 ms of decode per 100 ms step): neither passes either way
LOADER_BAR, LOADER_TOLERANCE = 0.3, 0.25
TIMED_STEPS = (2, 12)  # the steps timed: the first two wait for the workers to start


def _in_turns(a, b, compute_s: float, steps: int = 24, skip: int = 4) -> tuple[float, float]:
    """Median seconds that loaders a and b wait for a batch, timed in turns (one's batch and half a step, then the
    other's; who goes first alternates), so that both meet the same load; each still gets a whole step (its half and
    the other's) between its batches. The first `skip` steps, the workers' start, are not timed."""
    its, waits = [iter(a), iter(b)], ([], [])
    for step in range(steps):
        for j in (0, 1) if step % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            next(its[j])
            if step >= skip:
                waits[j].append(time.perf_counter() - t0)
            time.sleep(compute_s / 2)
    return statistics.median(waits[0]), statistics.median(waits[1])


class _Decoded(capstone.SlowDigits):
    """The capstone's slow dataset whose items are "decoded" (x * 2 - 1): a loader that reads `dataset.x` directly,
    past __getitem__ and its cost, yields other values. `decoded` marks each item read, in shared memory, so that
    the loader's worker processes mark it too."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.decoded = torch.zeros(len(self.y), dtype=torch.bool).share_memory_()

    def __getitem__(self, i):
        x, y, i = super().__getitem__(i)
        self.decoded[i] = True
        return x * 2 - 1, y, i


def check_fixed_loader(fixed_loader, compute_s: float = LOADER_STEP_S, delay_s: float = LOADER_DELAY_S) -> str:
    """07.fix_loader: fixed_loader(dataset, batch_size) -> an iterable of (x, y, index) batches. Judged over one whole
    epoch, with `compute_s` of work per step (a sleep standing for the device): every batch has batch_size rows
    (one shape: the short last batch too, unlabelled rows kept), no sample twice, at most batch_size - 1 left out,
    each row the dataset's own item (read through __getitem__, labels belonging to their samples); after the first
    two batches, ten steps under LOADER_BAR of their time waiting, or, when over it, a median wait per step within
    LOADER_TOLERANCE of a step of a right fix's (4 workers), the two timed in turns (a busy machine slows both); and no more than
    half the epoch decoded by the time the first batch arrives (decoding everything up front is waiting too; counted
    in shared memory, workers included). The whole epoch's wall time from the call is reported beside the steps'."""
    todo(fixed_loader)
    k = next(_calls)
    batch = 32 + 16 * (k % 3)
    data = _Decoded(delay_s=delay_s, seed=k)
    n = len(data)
    require(n % batch != 0, "the epoch must end with a short batch")  # 1797 samples: no batch size here divides it
    t_start = time.perf_counter()
    loader = call(fixed_loader, data, batch)
    try:
        it = iter(loader)
    except TypeError:
        raise Wrong(f"fixed_loader returned a {type(loader).__name__}, not something to iterate over") from None
    seen, shapes, wait, total, steps = [], set(), 0.0, 0.0, 0
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        require(steps < 2 * n // batch + 2, "the loader does not end: one epoch, each sample once")
        require(isinstance(item, (tuple, list)) and len(item) == 3, "each batch must be (x, y, index)")
        x, y, idx = item
        require(all(torch.is_tensor(t) for t in item), "x, y and index must be tensors")
        shapes.add((tuple(x.shape), tuple(y.shape)))
        ids = [int(i) for i in idx]
        require(len(ids) == x.shape[0] == y.shape[0], f"batch {steps}: {len(ids)} indices for {x.shape[0]} rows")
        require(
            torch.equal(y.cpu(), data.y[torch.tensor(ids)]),
            "labels do not belong to their samples (or unlabelled rows were changed)",
        )
        require(
            bool(torch.allclose(x.cpu(), data.x[torch.tensor(ids)] * 2 - 1)),
            "the rows are not the dataset's items: read them through dataset[i] (its decoding is what costs time)",
        )
        seen += ids
        time.sleep(compute_s)  # the device's share of the step
        if steps == 0:
            early = int(data.decoded.sum())  # items decoded by the time the first batch arrived
        if TIMED_STEPS[0] <= steps < TIMED_STEPS[1]:  # the first batches wait for the workers to start
            wait, total = wait + (t1 - t0), total + (time.perf_counter() - t0)
        steps += 1
    wall = time.perf_counter() - t_start
    require(steps > 2, f"the loader ended after {steps} batches")
    require(len(shapes) == 1, f"batches of {len(shapes)} shapes {sorted(shapes)[:3]}: each is a new graph on XLA")
    ((xs, _),) = shapes
    require(xs[0] == batch, f"batches of {xs[0]} rows, asked for {batch}")
    require(len(seen) == len(set(seen)), "a sample came twice in one epoch")
    require(n - len(seen) < batch, f"{n - len(seen)} of {n} samples never came: one epoch is every full batch")
    share = wait / total
    side = f"{share:.0%} of each step waiting for the loader (the bar: {LOADER_BAR:.0%})"
    if share >= LOADER_BAR:  # over the bar: a busy machine, or a loader too slow? time it in turns with a right fix
        fix = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, num_workers=4)
        yours, ref = _in_turns(call(fixed_loader, data, batch), fix, compute_s)
        side = (
            f"{share:.0%} of each step waiting for the loader, over the {LOADER_BAR:.0%} bar; timed again in turns with "
            f"a right fix (4 workers): a median wait of {yours * 1e3:.1f} ms a step against its {ref * 1e3:.1f} ms "
            f"(the bar then: within {LOADER_TOLERANCE * compute_s * 1e3:.0f} ms of it)"
        )
        require(yours <= ref + LOADER_TOLERANCE * compute_s, f"{side}: the chip would starve (more workers?)")
    require(
        early <= n // 2,
        f"{early} of {n} samples were decoded before the first batch came: the chip waits for all that set-up; "
        "decode while the steps run (workers), not up front",
    )
    return (
        f"{steps} batches of {batch}, one shape; over ten steps once the workers had started, {side}. The whole "
        f"epoch took {wall:.2f} s from the call, {steps * compute_s:.2f} s of it the steps' own work: the rest is the "
        "workers' start-up and the waits"
    )


def check_predict_step(predict_step_s) -> str:
    """07.predict: predict_step_s(batch, model, machine) -> seconds of matmul work in one training step (forward
    and backward) at machine.flops. Judged on several batch sizes, widths and machines against 6 x batch x the
    weight matrices' elements / FLOP/s, within 5 %."""
    from labkit.profiling.roofline import Machine

    todo(predict_step_s)
    cases = [(64, 48, 2e11), (128, 96, 1e12), (8, 200, 5e10), (300, 16, 197e12)]
    k = next(_calls)
    cases = cases[k % 4 :] + cases[: k % 4]
    for batch, width, flops in cases:
        model = torch.nn.Sequential(
            torch.nn.Linear(64, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 2 * width),
            torch.nn.Linear(2 * width, 10),
        )
        machine = Machine("test", flops, 1e11)
        want = 6 * batch * capstone.weights(model) / flops
        why = "count the weights yourself from model.parameters(): capstone.weights is the checker's answer"
        with refusing([capstone.weights], why):  # the function object: a saved reference is refused too
            got = number(call(predict_step_s, batch, model, machine), f"predict_step_s({batch}, width {width})")
        if abs(got - want / 3) <= 0.05 * want / 3:
            raise Wrong("that is the forward pass only: the backward pass costs about twice the forward")
        if abs(got * flops - want * flops) > 0.05 * want * flops and abs(got - want * flops) <= 0.05 * want * flops:
            raise Wrong("that is a number of FLOPs: divide by the machine's FLOP/s for seconds")
        close(
            got,
            want,
            0.05,
            f"batch {batch}, width {width}, {flops:.0e} FLOP/s",
            hint="2 FLOPs per multiply-add, one multiply-add per weight per sample, backward = 2 x forward",
        )
    return "6 x batch x weights / FLOP/s, on four models and machines"
