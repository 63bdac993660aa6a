"""Checkers for notebook 01 (ResNet-50 on streamed shards). Each one tests what the learner's answer does."""

from __future__ import annotations

import torch

from labkit.lessons.exercises import Wrong, require, todo

__all__ = ["check_batches_per_epoch", "check_pad_labels", "check_resume_position"]


def check_batches_per_epoch(batches_per_epoch) -> str:
    """01.static_shapes: batches_per_epoch(samples, replicas, batch) -> full batches EVERY replica gets."""
    todo(batches_per_epoch)
    for samples, replicas, batch in ((1000, 1, 32), (1000, 4, 32), (50000, 8, 128), (127, 2, 64), (64, 1, 64)):
        want = samples // (replicas * batch)
        got = batches_per_epoch(samples, replicas, batch)
        if got == want:
            continue
        if got == -(-samples // (replicas * batch)):
            raise Wrong(f"{samples} samples, {replicas} x {batch}: a partial last batch is a new shape (a recompile)")
        if got == samples // batch:
            raise Wrong("that counts batches for all replicas together: each replica loads its own")
        raise Wrong(f"{samples} samples, {replicas} replicas, batch {batch}: you say {got}, every replica gets {want}")
    return "floor(samples / (replicas x batch)) on every replica"


def check_pad_labels(pad_labels) -> str:
    """01.pad_eval: pad_labels(y, batch) -> y padded to `batch` entries with -100 (cross_entropy's ignore index)."""
    todo(pad_labels)
    for n, batch in ((5, 8), (8, 8), (1, 32)):
        y = torch.arange(n) % 10
        got = pad_labels(y, batch)
        require(torch.is_tensor(got), "return a tensor")
        require(tuple(got.shape) == (batch,), f"{n} labels padded to batch {batch}: shape {tuple(got.shape)}")
        require(torch.equal(got[:n], y), "the real labels must stay first, unchanged")
        require(bool((got[n:] == -100).all()), "padding must be -100, which cross_entropy ignores")
        loss = torch.nn.functional.cross_entropy(torch.zeros(batch, 10), got, reduction="sum")
        require(abs(loss.item() - n * torch.log(torch.tensor(10.0)).item()) < 1e-4, "the padded rows changed the loss")
    return "padded rows add nothing to the loss"


def check_resume_position(resume_position) -> str:
    """01.resume: resume_position(step, batches_per_epoch) -> (epoch, batch index) where training continues,
    after `step` optimizer steps were done (and checkpointed). Resuming there skips and repeats nothing."""
    todo(resume_position)
    for per in (7, 25):
        seen = []
        for step in range(0, 3 * per + 1):
            epoch, idx = resume_position(step, per)
            require(0 <= idx < per, f"step {step}: batch index {idx} is outside 0..{per - 1}")
            seen.append(epoch * per + idx)
        if seen != list(range(3 * per + 1)):
            bad = next(s for s, v in enumerate(seen) if v != s)
            raise Wrong(
                f"with {per} batches per epoch, after {bad} steps you resume at batch #{seen[bad]} "
                f"(counting from 0 over all epochs): the next batch to train is #{bad}"
            )
    return "every batch trained exactly once"
