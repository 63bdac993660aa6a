"""Checkers for notebook 00's exercises (lazy tensors by hand). Each runs the learner's function on the XLA
device and reads torch_xla's own counters: what is judged is what the code makes XLA do, never its text.

    from labkit.lessons.exercises import check, nb00
    check("00.bucket", lambda: nb00.check_pad_batch(pad_batch))
    check("00.mask", lambda: nb00.check_masked_mean(masked_mean))
    check("00.sync", lambda: nb00.check_quiet_epoch(quiet_epoch))

Each checker needs an XLA device (`labkit.setup("xla-cpu")` or a TPU) and costs a few small compiles (well
under a second each on XLA:CPU).
"""

from __future__ import annotations

import copy
import itertools
import math
import random

import torch
import torch.nn.functional as F

from labkit.lessons.exercises import Wrong, call, number, require, todo, xla_metric

# each call of a checker uses a feature width of its own: graphs compiled by an earlier attempt (XLA caches
# them) cannot make a later one look compile-free
_fresh = itertools.count()


def _xla():
    import torch_xla
    import torch_xla.debug.metrics as met

    return torch_xla, met


def compiles() -> int:
    """Graphs XLA has compiled in this process (samples of the CompileTime metric)."""
    return xla_metric("CompileTime")[0]


def fallbacks() -> dict[str, int]:
    """torch_xla's `aten::*` counters: ops that had no XLA lowering and ran on the host CPU instead."""
    _, met = _xla()
    return {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")}


def transfers() -> int:
    """Device->host copies torch_xla has made in this process (its TransferFromDeviceTime metric's count)."""
    return xla_metric("TransferFromDeviceTime")[0]


def _new_fallbacks(before: dict[str, int]) -> dict[str, int]:
    now = fallbacks()
    return {n: v - before.get(n, 0) for n, v in now.items() if v > before.get(n, 0)}


# -- 1. pad a batch to a bucket of 8 ------------------------------------------------------------------------


def check_pad_batch(pad_batch) -> str:
    """pad_batch(x, y) -> (x_padded, y_padded) on the host: rows up to the next multiple of 8, padding labels
    -100 (the loss ignores them). Judged by: shapes, a loss and gradients equal to the unpadded batch's, one compile per
    bucket over 8 batch sizes drawn anew on every call (at least one in each of the buckets 8, 16 and 24)."""
    torch_xla, _ = _xla()
    dev = torch_xla.device()
    k = next(_fresh)
    rng = random.Random(k)
    sizes = [rng.randint(1, 7), rng.randint(9, 15), rng.randint(17, 23)] + [rng.randint(1, 24) for _ in range(5)]
    rng.shuffle(sizes)
    torch.manual_seed(k)
    d = 4 + k
    lin = torch.nn.Linear(d, 3)
    lin_x = copy.deepcopy(lin).to(dev)
    torch_xla.sync()  # nothing of the caller's pending work is counted below
    buckets, c0 = set(), compiles()
    for n in sizes:
        x, y = torch.randn(n, d), torch.randint(0, 3, (n,))
        out = call(pad_batch, x, y)
        require(type(out) in (tuple, list) and len(out) == 2, "return the pair (x_padded, y_padded)")
        xp, yp = out
        todo(xp)
        todo(yp)
        require(torch.is_tensor(xp) and torch.is_tensor(yp), "return two tensors (x_padded, y_padded)")
        want = 8 * math.ceil(n / 8)
        require(
            tuple(xp.shape) == (want, d) and tuple(yp.shape) == (want,),
            f"a batch of {n} rows should become {want} rows (the next multiple of 8); got x {tuple(xp.shape)}, "
            f"y {tuple(yp.shape)}",
        )
        buckets.add(want)
        loss = F.cross_entropy(lin_x(xp.to(dev)), yp.to(dev), ignore_index=-100)
        grads = torch.autograd.grad(loss, list(lin_x.parameters()))  # no .grad accumulated: one graph per bucket
        torch_xla.sync()
        ref = F.cross_entropy(lin(x), y)
        ref_grads = torch.autograd.grad(ref, list(lin.parameters()))
        got = loss.cpu().item()
        require(
            abs(got - ref.item()) < 1e-5,
            f"batch of {n}: the loss of the padded batch is {got:.5f}, of the batch itself {ref.item():.5f}: padding "
            "rows must not count (label them -100, cross_entropy's ignore_index)",
        )
        for g, r in zip(grads, ref_grads):
            require(
                bool(torch.allclose(g.cpu(), r, atol=1e-5)),
                f"batch of {n}: the loss is right but the gradients are not those of the batch itself (NaN or inf "
                "in the padding rows? a zero label weight times NaN is NaN): pad with zeros",
            )
    extra = compiles() - c0
    require(
        extra <= len(buckets),
        f"{len(sizes)} batch sizes in {len(buckets)} buckets compiled {extra} graphs; each "
        "bucket should compile once (pad on the host: padding on the device is itself an op on the unpadded shape)",
    )
    return f"{len(sizes)} batch sizes, {len(buckets)} buckets {sorted(buckets)}, {extra} graph(s) compiled"


# -- 2. a masked mean without dynamic shapes ----------------------------------------------------------------


def check_masked_mean(masked_mean) -> str:
    """masked_mean(pred, y): the mean of pred over the positions where y >= 0. Judged by: the value, no CPU
    fallback (`aten::*` counter), and no new graph when the number of valid positions changes."""
    torch_xla, _ = _xla()
    dev = torch_xla.device()
    k = next(_fresh)
    n = 16 + k
    g = torch.Generator().manual_seed(k)
    pred = torch.randn(n, generator=g)
    masks = [[(-1 if (i + k) % (k + 2) == 0 else 1) for i in range(n)] for k in range(4)]  # 1/2 to 4/5 valid
    c0 = None
    for k, labels in enumerate(masks):
        y = torch.tensor(labels)
        px, yx = pred.to(dev), y.to(dev)
        torch_xla.sync()  # the inputs are on the device before anything is counted
        before, c_before, t_before = fallbacks(), compiles(), transfers()
        out = call(masked_mean, px, yx)
        require(torch.is_tensor(out), f"return a tensor (got {type(out).__name__})")
        require(out.device.type == "xla", f"the result is on {out.device}: compute it on the XLA device")
        torch_xla.sync()
        new = _new_fallbacks(before)
        require(
            not new,
            f"{new}: these ops ran on the host CPU (a CPU fallback); boolean indexing needs the number of "
            "selected rows, which only the data know: keep the shape fixed (torch.where, or multiply by the mask)",
        )
        require(
            transfers() == t_before,
            f"mask {k}: {transfers() - t_before} device->host transfer(s) while computing: work on the device",
        )
        if c0 is None:
            c0 = compiles()
        elif compiles() > c_before:
            raise Wrong(
                f"mask {k} ({int((y >= 0).sum())} valid of {n}) compiled a new graph: the graph still depends on "
                "how many values are valid"
            )
        want = pred[y >= 0].mean().item()
        got = out.cpu().item()
        require(abs(got - want) < 1e-5, f"mask {k}: got {got:.6f}, the mean over y >= 0 is {want:.6f}")
    return f"{len(masks)} masks with {[sum(v >= 0 for v in m) for m in masks]} valid values: one graph, no fallback"


# -- 3. an epoch that reads the device once -----------------------------------------------------------------


def _task(device, seed: int = 0, steps: int = 6):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(steps)]
    return model, opt, batches


def noisy_epoch(model, opt, batches) -> float:
    """The reference: right answer, one host sync per step (`.item()`)."""
    import torch_xla

    dev = next(model.parameters()).device
    total = 0.0
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        total += loss.item()
        torch_xla.sync()
    return total / len(batches)


def check_quiet_epoch(quiet_epoch, steps: int = 6) -> str:
    """quiet_epoch(model, opt, batches) -> float: the mean training loss of the epoch, reading the device at
    most once. Judged by: the value (same as the per-step `.item()` version) and the reads that labkit's
    SyncFinder counts while it runs."""
    from labkit.dashboard.syncs import SyncFinder

    torch_xla, _ = _xla()
    dev = torch_xla.device()
    seed = next(_fresh)  # new weights and batches on every call: a remembered number does not pass twice
    trained, topt, tbatches = _task(dev, seed, steps)
    want = noisy_epoch(trained, topt, tbatches)  # the reference run: its losses and its trained weights
    model, opt, batches = _task(dev, seed, steps)
    finder = SyncFinder()
    t0 = transfers()
    with finder:
        got = call(quiet_epoch, model, opt, batches)
    reads = max(sum(finder.total.values()), transfers() - t0)  # torch_xla's own count: no spelling escapes it
    if torch.is_tensor(got):
        raise Wrong("return a Python float (read the device once, at the end), not a tensor")
    got = number(got, "the mean loss you return")
    require(
        abs(got - want) < 1e-5,
        f"mean loss {got:.6f}, but the epoch's mean loss is {want:.6f} (sum the per-step losses on the device)",
    )
    lines = "; ".join(f"{n}× {s}" for s, n in finder.total.most_common(3)) or "torch_xla's transfer count"
    require(reads <= 1, f"{reads} device->host reads in {steps} steps ({lines}): read once, after the loop")
    for p, q in zip(model.parameters(), trained.parameters()):
        require(p.device.type == "xla", "the model left the device: train it where it is")
        require(
            bool(torch.allclose(p.detach().cpu(), q.detach().cpu(), atol=1e-5)),
            "the model's weights are not those of an epoch of training: train `model` itself with `opt`, on the device",
        )
    return f"{steps} steps, {reads} read, mean loss {got:.4f}"
