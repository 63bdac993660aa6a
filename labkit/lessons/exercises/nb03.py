"""Checkers for notebook 03 (sharding on a mesh). Each one tests what the learner's answer does."""

from __future__ import annotations

import math

from labkit.lessons.exercises import Wrong, require, todo

__all__ = ["check_dp_bytes", "check_fsdp_bytes", "check_megatron_bytes", "require"]


def check_dp_bytes(answer, model, measured_all_reduce_bytes: int | None = None) -> str:
    """03.dp_bytes: the bytes a data-parallel step must all-reduce, predicted before looking at the HLO."""
    todo(answer)
    params = list(model.parameters())
    want = sum(p.numel() * p.element_size() for p in params)
    require(isinstance(answer, (int, float)), f"give a number of bytes, not {type(answer).__name__}")
    if answer == sum(p.numel() for p in params):
        raise Wrong("that is the number of parameters; each float32 gradient is 4 bytes")
    if answer in (2 * want, 3 * want):
        raise Wrong("each gradient is summed once per step; optimizer state never travels in data parallelism")
    require(answer == want, f"{answer:,} bytes: every gradient is all-reduced once, at its parameter's size")
    note = f"{want:,} B"
    if measured_all_reduce_bytes is not None:
        note += f"; XLA all-reduced {measured_all_reduce_bytes:,} B (section 6 explains the rest)"
    return note


def check_fsdp_bytes(fsdp_bytes) -> str:
    """03.fsdp_bytes: fsdp_bytes(shape, devices, bytes_per=4) -> bytes ONE device holds of a tensor split along
    its largest dimension (the first on a tie), padded when it does not divide."""
    todo(fsdp_bytes)
    cases = [((256, 32), 8), ((32,), 8), ((128, 32), 8), ((6,), 8), ((18, 6), 4), ((96, 32), 8), ((10, 10), 3)]
    for shape, n in cases:
        big = max(shape)
        want = math.ceil(big / n) * math.prod(shape) // big * 4
        got = fsdp_bytes(shape, n)
        if got == math.prod(shape) * 4 / n and want != got:
            raise Wrong(f"shape {shape} over {n}: {got} is an exact 1/{n}; a dimension that does not divide is padded")
        require(got == want, f"shape {shape} over {n} devices: you say {got}, one device holds {want} bytes")
    return f"{len(cases)} shapes"


def check_megatron_bytes(megatron_bytes) -> str:
    """03.megatron: megatron_bytes(B, T, C, L, data) -> activation bytes Megatron all-reduces per training step
    (float32), over the model groups of one data slice."""
    todo(megatron_bytes)
    for B, T, C, L, data in [(16, 16, 32, 1, 4), (64, 128, 256, 4, 4), (8, 8, 48, 2, 1), (32, 64, 64, 3, 8)]:
        want = 4 * L * (B // data) * T * C * 4
        got = megatron_bytes(B, T, C, L, data)
        if got == want:
            continue
        if got == 2 * L * (B // data) * T * C * 4:
            raise Wrong("that is the forward only: backward all-reduces the column-parallel input gradients too")
        if got == 4 * L * B * T * C * 4:
            raise Wrong("each model group works on one data slice: B / data sequences, not B")
        require(got == want, f"B={B}, T={T}, C={C}, L={L}, data={data}: you say {got}, Megatron moves {want}")
    return "4 all-reduces per block of (B/data, T, C)"
