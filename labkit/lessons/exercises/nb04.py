"""Checkers for notebook 04 (graphs and compilation). Each one runs the learner's code on the XLA device and
measures what it does: CPU fallbacks, recompiles, host reads."""

from __future__ import annotations

import torch

from labkit.lessons.exercises import Wrong, require, todo

__all__ = ["check_bucket_recompiles", "check_masked_mean", "check_one_read"]


def _fallbacks() -> int:
    """aten:: ops that ran on the CPU so far (torch_xla's counters; one per fallback call)."""
    import torch_xla.debug.metrics as met

    return sum(met.counter_value(n) or 0 for n in met.counter_names() if n.startswith("aten::"))


def check_masked_mean(masked_mean, rt) -> str:
    """04.fallback: masked_mean(pred, y) -> mean of pred over the samples whose label y >= 0 (padded ones are -100),
    with no CPU fallback (a boolean index has a data-dependent size: aten::nonzero runs on the host)."""
    todo(masked_mean)
    if not rt.is_xla:
        return "not on XLA here: nothing falls back"
    pred = torch.arange(8, dtype=torch.float32)
    y = torch.tensor([3, 1, 0, 2, 5, -100, -100, -100])
    p, t = pred.to(rt.device), y.to(rt.device)
    rt.sync()
    before = _fallbacks()
    out = masked_mean(p, t)
    rt.sync()
    fell = _fallbacks() - before
    require(torch.is_tensor(out), "return a tensor (kept on the device)")
    got = out.cpu().item()
    require(abs(got - 2.0) < 1e-6, f"mean over the five real samples is 2.0, you computed {got}")
    if fell:
        raise Wrong(f"{fell} op(s) fell back to the CPU: multiply by the mask and divide by its sum instead")
    return "no fallback, right value"


def check_bucket_recompiles(pad_to, run, lengths) -> str:
    """04.bucket: the one length to pad every batch to so that run(lengths, pad_to) never recompiles, with as
    little padding as possible."""
    todo(pad_to)
    require(isinstance(pad_to, int), "give a length (an int)")
    require(pad_to >= max(lengths), f"{pad_to} is shorter than the longest batch ({max(lengths)}): it cannot hold it")
    mon = run(lengths, pad_to=pad_to)
    require(mon.events == [], f"still {len(mon.events)} recompile(s) after warm-up")
    require(pad_to == max(lengths), f"{pad_to - max(lengths)} columns of padding more than needed")
    return f"0 recompiles over {len(lengths)} steps"


def check_one_read(loop_mean, reference: float, steps: int) -> str:
    """04.syncs: loop_mean(steps) -> the mean loss over `steps` steps, as a Python float, reading the device once."""
    todo(loop_mean)
    from labkit.dashboard import SyncFinder

    with SyncFinder() as f:
        got = loop_mean(steps)
    reads = sum(f.take().values())
    require(isinstance(got, float), f"return a Python float (one .item() at the end), not {type(got).__name__}")
    require(abs(got - reference) < 1e-4 * max(1.0, abs(reference)), f"mean loss {got}, expected {reference}")
    require(reads <= 1, f"{reads} host reads for {steps} steps: keep the sum on the device, read once")
    return f"{reads} read for {steps} steps"
