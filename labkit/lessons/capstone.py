"""Notebook 07's run to debug: the data, the model, a slow dataset, and one harness that measures a run.

    from labkit.lessons import capstone
    data = capstone.SlowDigits(delay_s=0.002)                      # sklearn's digits, ~20 % unlabelled (-100)
    model = capstone.make_model(rt, width=512)
    report = capstone.measure(rt, model, step_fn, loader, steps=12)
    report["compiles_after_warmup"], report["fallbacks"], report["reads"], report["wait_share"]

A run is judged by what XLA did (torch_xla's own counters, read before and after; labkit's SyncFinder for the
lines that read from the device, HealthMonitor for the inputs that changed shape) and by where its time went
(time blocked in the loader vs the whole step). The harness itself reads the device once, at the end: every
read it counts is the step's own.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

UNLABELLED = -100  # cross_entropy's ignore_index: rows the loss skips


def digits(seed: int = 0, unlabelled: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 handwritten digits (8x8, offline), as (x [N, 64] float32 in 0..1, y [N] int64), with a
    seeded `unlabelled` share of labels set to -100, as a semi-labelled or padded dataset has."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    y[torch.rand(len(y), generator=g) < unlabelled] = UNLABELLED
    return x, y


class SlowDigits(torch.utils.data.Dataset):
    """The digits, `delay_s` per sample to read and decode (a stand-in for a JPEG decode or a network read: a
    sleep, so it costs time but no CPU, on any machine). Each item is (x, y, index): the index lets a check
    prove that every sample is seen once."""

    def __init__(self, delay_s: float = 0.002, seed: int = 0, n: int | None = None):
        self.x, self.y = digits(seed)
        if n is not None:
            self.x, self.y = self.x[:n], self.y[:n]
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return self.x[i], self.y[i], i


def drop_unlabelled(items):
    """A collate function that throws away the unlabelled rows on the host. Looks tidy; every batch then has
    another number of rows, and on XLA each new shape is a new graph."""
    x, y, idx = torch.utils.data.default_collate(items)
    keep = y != UNLABELLED
    return x[keep], y[keep], idx[keep]


def make_model(rt, width: int = 512, seed: int = 0) -> torch.nn.Module:
    """An MLP 64 -> width -> width -> 10 on rt.device (rt None: on the host): wide enough that its matmuls, not
    Python, set the step time."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )
    return model.to(rt.device) if rt is not None else model


def weights(model) -> int:
    """Multiply-adds per sample of the forward pass: the elements of every weight matrix (biases are adds)."""
    return sum(p.numel() for p in model.parameters() if p.dim() == 2)


def reference_step(model, x, y, lr):
    """What a step must compute, written plainly: loss over the labelled rows, SGD with a device-side learning
    rate, accuracy over the labelled rows. Returns (loss, correct, labelled) as device tensors."""
    logits = model(x)
    loss = F.cross_entropy(logits, y, ignore_index=UNLABELLED)
    model.zero_grad(set_to_none=True)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    keep = y != UNLABELLED
    correct = ((logits.argmax(1) == y) & keep).sum()
    return loss.detach(), correct, keep.sum()


def _xla_counts(rt) -> dict | None:
    from labkit.dashboard.health import snapshot

    return snapshot(rt)


def measure(rt, model, step_fn, loader, steps: int, warmup: int = 2, lr0: float = 0.05, decay: float = 0.98) -> dict:
    """Run `steps` steps of `step_fn(model, x, y, lr) -> (loss, correct, labelled)` over `loader` (an iterable of
    (x, y, index) batches, on the host; it starts again when an epoch ends), on rt.device. The learning rate decays every step and reaches the step
    as a device tensor. Returns what happened after the first `warmup` steps: graphs compiled, CPU fallbacks,
    device->host reads (with the lines that made them), the share of step time spent waiting for a batch, the
    batch shapes, and the losses (read once, at the end)."""
    from labkit.dashboard.health import HealthMonitor
    from labkit.dashboard.syncs import SyncFinder

    finder = SyncFinder()
    health = HealthMonitor(rt, warmup_steps=warmup, finder=finder)
    losses, correct, labelled, shapes, seen = [], [], [], [], []
    wait = total = 0.0
    before = None
    it = iter(loader)
    with finder:
        for step in range(steps):
            t0 = time.perf_counter()
            try:
                x, y, idx = next(it)
            except StopIteration:  # the next epoch (its first batch waits for the workers to start again)
                it = iter(loader)
                x, y, idx = next(it)
            t1 = time.perf_counter()
            if step == warmup:
                before, _ = _xla_counts(rt), finder.take()
            lr = torch.tensor(lr0 * decay**step, device=rt.device)
            loss, c, n = step_fn(model, x.to(rt.device), y.to(rt.device), lr)
            rt.sync()
            health.on_step(step, {"x": x})
            if step >= warmup:
                wait, total = wait + (t1 - t0), total + (time.perf_counter() - t0)
            losses.append(loss)
            correct.append(c)
            labelled.append(n)
            shapes.append(tuple(x.shape))
            seen += [int(i) for i in idx]
        reads = finder.take()
    after = _xla_counts(rt)
    host = torch.stack([torch.stack(losses), torch.stack(correct).float(), torch.stack(labelled).float()]).cpu()
    out = {
        "steps": steps - warmup,
        "shapes": shapes,
        "seen": seen,
        "losses": host[0].tolist(),
        "accuracy": float(host[1].sum() / host[2].sum().clamp(min=1)),
        "wait_share": wait / total if total else 0.0,
        "wait_s": wait / max(steps - warmup, 1),
        "step_s": total / max(steps - warmup, 1),
        "reads": sum(reads.values()),
        "read_lines": {str(site): n for site, n in sorted(reads.items(), key=lambda kv: -kv[1])[:3]},
        "recompile_events": health.events,
    }
    if before is not None and after is not None:
        out["compiles_after_warmup"] = after["compiles"] - before["compiles"]
        out["fallbacks"] = {k: v - before["fallbacks"].get(k, 0) for k, v in after["fallbacks"].items()}
        out["fallbacks"] = {k: v for k, v in out["fallbacks"].items() if v}
    else:  # not on XLA: no graphs, no fallbacks to count
        out["compiles_after_warmup"], out["fallbacks"] = 0, {}
    return out


def describe(report: dict) -> str:
    """The report in one line per finding, as a person would say it."""
    n = report["steps"]
    return "\n".join(
        [
            f"after warm-up, {n} steps of {report['step_s'] * 1e3:.0f} ms: "
            f"{report['compiles_after_warmup']} graphs compiled, "
            f"{sum(report['fallbacks'].values())} CPU fallbacks {sorted(report['fallbacks']) or ''}, "
            f"{report['reads']} device->host reads",
            f"waiting for batches: {report['wait_s'] * 1e3:.0f} ms per step, {report['wait_share']:.0%} of step time",
            f"batch shapes seen: {sorted(set(report['shapes']))[:6]}{' ...' if len(set(report['shapes'])) > 6 else ''}",
        ]
        + [f"read {k} x {v}" for k, v in report["read_lines"].items()]
    )
