"""Checkers for notebook 03 (sharding on a mesh). Each one runs the learner's code on shapes and models that change
with every call, including shapes whose largest dimension is not the first, and compares plain numbers."""

from __future__ import annotations

import itertools
import math
import random

import torch

from labkit.lessons.exercises import Wrong, call, integer, require, todo

__all__ = ["check_dp_bytes", "check_fsdp_bytes", "check_megatron_bytes", "require"]

_calls = itertools.count(1)


def check_dp_bytes(dp_bytes, model, measured_all_reduce_bytes: int | None = None) -> str:
    """03.dp_bytes: dp_bytes(model) -> the bytes one data-parallel step must all-reduce (every gradient once, at its
    parameter's size and dtype), checked on models of other sizes and dtypes, then on `model`."""
    todo(dp_bytes)
    rng = random.Random(next(_calls))
    w = rng.choice([24, 40, 56])
    others = [
        torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.Linear(2 * w, 3)),
        torch.nn.Sequential(torch.nn.Embedding(rng.choice([50, 70]), w), torch.nn.LayerNorm(w)).to(torch.bfloat16),
        model,
    ]
    for m in others:
        params = list(m.parameters())
        want = sum(p.numel() * p.element_size() for p in params)
        got = integer(call(dp_bytes, m), "dp_bytes(model)")
        if got == sum(p.numel() for p in params):
            raise Wrong("that is the number of parameters; each gradient has its parameter's bytes (4 in float32)")
        if got == 4 * sum(p.numel() for p in params) and got != want:
            raise Wrong("a bfloat16 gradient is 2 bytes: use each parameter's element_size()")
        if got in (2 * want, 3 * want):
            raise Wrong("each gradient is summed once per step; optimizer state never travels in data parallelism")
        require(got == want, f"a model of {len(params)} tensors: you say {got:,} bytes, its gradients are {want:,}")
    note = f"{want:,} B for this GPT"
    if measured_all_reduce_bytes is not None:
        note += f"; XLA all-reduced {measured_all_reduce_bytes:,} B (section 6 explains the rest)"
    return note


def check_fsdp_bytes(fsdp_bytes) -> str:
    """03.fsdp_bytes: fsdp_bytes(shape, devices, bytes_per=4) -> bytes ONE device holds of a tensor split along
    its largest dimension (the first on a tie; torch_xla's FSDPv2 does `shape.index(max(shape))`), padded when it
    does not divide."""
    todo(fsdp_bytes)
    rng = random.Random(next(_calls))
    cases = [((256, 32), 8), ((32,), 8), ((6,), 8), ((18, 6), 4), ((10, 10), 3), ((6, 40), 8), ((3, 100, 5), 8)]
    cases.append(((rng.randint(2, 9), rng.randint(30, 90)), rng.choice([4, 8])))  # the largest dimension is the last
    for shape, n in cases:
        big = max(shape)
        want = math.ceil(big / n) * math.prod(shape) // big * 4
        got = integer(call(fsdp_bytes, shape, n), f"fsdp_bytes({shape}, {n})")
        dim0 = math.ceil(shape[0] / n) * math.prod(shape) // shape[0] * 4
        if got == dim0 and got != want:
            raise Wrong(f"shape {shape} over {n}: split along dim 0; FSDPv2 splits the largest dimension ({big})")
        if got == math.prod(shape) * 4 / n and want != got:
            raise Wrong(f"shape {shape} over {n}: {got} is an exact 1/{n}; a dimension that does not divide is padded")
        require(got == want, f"shape {shape} over {n} devices: you say {got}, one device holds {want} bytes")
    return f"{len(cases)} shapes"


def check_megatron_bytes(megatron_bytes) -> str:
    """03.megatron: megatron_bytes(B, T, C, L, data) -> activation bytes Megatron all-reduces per training step
    (float32), over the model groups of one data slice."""
    todo(megatron_bytes)
    rng = random.Random(next(_calls))
    cases = [(16, 16, 32, 1, 4), (64, 128, 256, 4, 4), (8, 8, 48, 2, 1), (32, 64, 64, 3, 8)]
    cases.append((8 * rng.randint(1, 8), rng.choice([24, 40]), rng.choice([48, 80]), rng.randint(1, 5), 8))
    for B, T, C, L, data in cases:
        want = 4 * L * (B // data) * T * C * 4
        got = integer(call(megatron_bytes, B, T, C, L, data), f"megatron_bytes({B}, {T}, {C}, {L}, {data})")
        if got == want:
            continue
        if got == 2 * L * (B // data) * T * C * 4:
            raise Wrong("that is the forward only: backward all-reduces the column-parallel input gradients too")
        if got == 4 * L * B * T * C * 4:
            raise Wrong("each model group works on one data slice: B / data sequences, not B")
        require(got == want, f"B={B}, T={T}, C={C}, L={L}, data={data}: you say {got}, Megatron moves {want}")
    return "4 all-reduces per block of (B/data, T, C)"
