"""Checkers for notebook 01 (ResNet-50 on streamed shards). Each one runs the learner's code on inputs that change
with every call and judges what it does; 01.feed_bytes reads torch_xla's own count of bytes sent to the device."""

from __future__ import annotations

import itertools
import random

import torch

from labkit.lessons.exercises import Wrong, call, integer, require, todo

__all__ = ["check_feed_bytes", "check_pad_labels", "check_resume_position", "require"]

_calls = itertools.count(1)


def _outbound_bytes() -> int | None:
    """Bytes torch_xla has copied host -> device in this process (its OutboundData metric); None off XLA."""
    import sys

    if "torch_xla" not in sys.modules:
        return None
    import torch_xla.debug.metrics as met

    data = met.metric_data("OutboundData")
    return int(data[1]) if data else 0


def check_feed_bytes(step_bytes, rt) -> str:
    """01.feed_bytes: step_bytes(batch, channels, height, width) -> bytes one training step copies from the host to
    the device: a float32 image batch (N, C, H, W) and its int64 labels. Predicted, then measured: on XLA by
    torch_xla's OutboundData metric around a real copy of such a batch, elsewhere by the tensors' own sizes."""
    todo(step_bytes)
    rng = random.Random(next(_calls))
    shapes = [(rng.choice([8, 16, 24, 32, 64]), rng.choice([1, 3]), rng.choice([28, 32, 48, 64]), 0) for _ in range(4)]
    shapes = [(b, c, h, rng.choice([h, h + 8])) for b, c, h, _ in shapes] + [(8, 3, 32, 40)]
    for b, c, h, w in shapes:
        got = integer(call(step_bytes, b, c, h, w), f"step_bytes({b}, {c}, {h}, {w})")
        x, y = torch.randn(b, c, h, w), torch.randint(0, 10, (b,))
        rt.sync()
        before = _outbound_bytes() if rt.is_xla else None
        on_device = rt.to_device((x, y))
        rt.sync()
        if before is not None:
            want = _outbound_bytes() - before
            how = "torch_xla's OutboundData"
        else:
            want = sum(t.numel() * t.element_size() for t in on_device)
            how = "the tensors' sizes"
        if got == b * c * h * w * 4:
            raise Wrong(f"batch {b}x{c}x{h}x{w}: that is the images only; the labels travel too (int64: 8 bytes each)")
        if got in (b * c * h * w + 8 * b, b * c * h * w):
            raise Wrong("images arrive as float32 (4 bytes per value) after normalising, not as uint8 pixels")
        require(got == want, f"batch {b}x{c}x{h}x{w}: you say {got:,} bytes, {how} counted {want:,}")
    return f"{len(shapes)} batch shapes, every byte accounted for"


def check_pad_labels(pad_labels) -> str:
    """01.pad_eval: pad_labels(y, batch) -> y padded to `batch` entries with -100 (cross_entropy's ignore index)."""
    todo(pad_labels)
    rng = random.Random(next(_calls))
    for n, batch in [(rng.randint(1, 7), 8), (8, 8), (rng.randint(1, 31), 32)]:
        y = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(n))
        got = call(pad_labels, y.clone(), batch)
        require(torch.is_tensor(got), f"return a tensor, got {type(got).__name__}")
        require(tuple(got.shape) == (batch,), f"{n} labels padded to batch {batch}: shape {tuple(got.shape)}")
        require(got.dtype == y.dtype, f"labels must stay {y.dtype}, got {got.dtype}")
        require(bool(torch.equal(got[:n], y)), "the real labels must stay first, unchanged")
        require(bool((got[n:] == -100).all()), "padding must be -100, which cross_entropy ignores")
        logits = torch.randn(batch, 10, generator=torch.Generator().manual_seed(batch))
        loss = torch.nn.functional.cross_entropy(logits, got, reduction="sum")
        want = torch.nn.functional.cross_entropy(logits[:n], y, reduction="sum")
        require(abs(loss.item() - want.item()) < 1e-4, "the padded rows changed the loss")
    return "padded rows add nothing to the loss"


def check_resume_position(resume_position) -> str:
    """01.resume: resume_position(step, batches_per_epoch) -> (epoch, batch index) where training continues,
    after `step` optimizer steps were done (and checkpointed). Resuming there skips and repeats nothing."""
    todo(resume_position)
    rng = random.Random(next(_calls))
    for per in (rng.randint(3, 9), rng.randint(20, 40)):
        seen = []
        for step in range(0, 3 * per + 1):
            out = call(resume_position, step, per)
            require(
                isinstance(out, (tuple, list)) and len(out) == 2,
                f"resume_position({step}, {per}) = {out!r}: return the pair (epoch, batch index)",
            )
            epoch = integer(out[0], f"the epoch of resume_position({step}, {per})")
            idx = integer(out[1], f"the batch index of resume_position({step}, {per})")
            require(0 <= idx < per, f"step {step}: batch index {idx} is outside 0..{per - 1}")
            seen.append(epoch * per + idx)
        if seen != list(range(3 * per + 1)):
            bad = next(s for s, v in enumerate(seen) if v != s)
            raise Wrong(
                f"with {per} batches per epoch, after {bad} steps you resume at batch #{seen[bad]} "
                f"(counting from 0 over all epochs): the next batch to train is #{bad}"
            )
    return "every batch trained exactly once"
