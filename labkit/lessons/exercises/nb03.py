"""Checkers for notebook 03 (sharding on a mesh). Each one runs the learner's code on shapes and models that change
with every call, including shapes whose largest dimension is not the first, and compares plain numbers. The two FSDP
checkers take their truth from the device: torch_xla's own `SpmdFullyShardedDataParallel` lays out tensors of the
same shapes on the notebook's mesh, and the bytes and layouts it chose are read from their shardings.

    from labkit.lessons.exercises import check, nb03
    check("03.dp_bytes", lambda: nb03.check_dp_bytes(dp_bytes, probe))
    check("03.fsdp_shard", lambda: nb03.check_fsdp_shard(fsdp_shard, mesh))      # needs SPMD on XLA devices
    check("03.fsdp_bytes", lambda: nb03.check_fsdp_bytes(fsdp_bytes, mesh, probe, fsdp_run_bytes))
    check("03.megatron", lambda: nb03.check_megatron_bytes(megatron_bytes))
    check("03.comm_time", lambda: nb03.check_comm_time(allreduce_seconds, exposed_seconds))   # in nb03_comm
"""

from __future__ import annotations

import itertools
import math
import random

import torch

from labkit.lessons.exercises import Wrong, call, integer, mistake, refusing, require, todo, xla_metric
from labkit.lessons.exercises.nb03_comm import check_comm_time  # exercise 5's checker lives there
from labkit.spmd import sharding as S

__all__ = [
    "check_comm_time",
    "check_dp_bytes",
    "check_fsdp_bytes",
    "check_fsdp_shard",
    "check_megatron_bytes",
    "fsdpv2_layout",
]

_calls = itertools.count(1)


# -- 1. data parallel: the bytes of the gradients -------------------------------------------------------------------


def check_dp_bytes(dp_bytes, model, measured_all_reduce_bytes: int | None = None) -> str:
    """03.dp_bytes: dp_bytes(model) -> V, the bytes of the gradients one data-parallel step all-reduces (every
    gradient once, at its parameter's size and dtype; a ring all-reduce then sends about 2V(W-1)/W per device),
    checked on models of other sizes and dtypes, then on `model`."""
    todo(dp_bytes)
    rng = random.Random(next(_calls))
    w = rng.choice([24, 40, 56])
    others = [
        torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.Linear(2 * w, 3)),
        # mixed dtypes (a bfloat16 table, a float32 norm): 4 bytes for every parameter is then no multiple of the
        # right answer, so it cannot be mistaken for the all-reduce's 2V
        torch.nn.Sequential(torch.nn.Embedding(rng.choice([50, 70]), w).to(torch.bfloat16), torch.nn.LayerNorm(w)),
        model,
    ]
    for m in others:
        params = list(m.parameters())
        want = sum(p.numel() * p.element_size() for p in params)
        got = integer(call(dp_bytes, m), "dp_bytes(model)")
        count = sum(p.numel() for p in params)
        hint = mistake(
            got,
            want,
            {
                "that is the number of parameters; each gradient has its parameter's bytes (4 in float32)": count,
                "a bfloat16 gradient is 2 bytes: use each parameter's element_size()": 4 * count,
                "that is about what a ring all-reduce sends per device (2V(W-1)/W); the question is V, the bytes of "
                "the gradients it reduces": 2 * want,
                "optimizer state (Adam's two moments) never travels in data parallelism": 3 * want,
            },
        )
        require(
            got == want,
            f"a model of {len(params)} tensors: you say {got:,} bytes, its gradients are {want:,}"
            + (f": {hint}" if hint else ""),
        )
    note = f"{want:,} B for this GPT"
    if measured_all_reduce_bytes is not None:
        note += f"; XLA all-reduced {measured_all_reduce_bytes:,} B (section 7 explains the rest)"
    return note


# -- 2. FSDP on the device: torch_xla's own layout is the truth -----------------------------------------------------


class _Params(torch.nn.Module):
    """A module that only holds tensors of given shapes: SpmdFullyShardedDataParallel wraps modules, not tensors
    (and refuses one without a forward)."""

    def __init__(self, shapes, dtype=torch.float32):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes])

    def forward(self, x):
        return x


def fsdpv2_layout(shapes, mesh, dtype=torch.float32) -> list[tuple[str, int]]:
    """(sharding string, bytes one device holds) that torch_xla's FSDPv2 gives a parameter of each shape on `mesh`
    (a mesh with an "fsdp" axis): a module of those shapes is wrapped in SpmdFullyShardedDataParallel, which marks
    every parameter, and each sharding is read back. Costs one small host->device copy per shape, no compile."""
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    wrapped = SpmdFullyShardedDataParallel(_Params(shapes, dtype), mesh=mesh)
    return [(S.sharding_of(p), S.device_bytes([p])) for p in wrapped.module.ps]


def _fsdp_shapes(rng: random.Random, n: int) -> list[tuple[int, ...]]:
    """Shapes on which the wrong rules differ from FSDPv2's (largest dimension, the first on a tie): the largest
    last, in the middle, first, two dimensions tied, one dimension; sizes that do not divide over n devices."""
    # no size divides by n, so every wrong rule gives another number than the right one (and than each other)
    small = lambda: rng.choice([k for k in range(2, 2 * n) if k % n])  # noqa: E731
    big = lambda: n * rng.randint(3, 7) + rng.randint(1, n - 1)  # noqa: E731
    tie = big()
    shapes = [(small(), big()), (small(), big(), small()), (big(), small()), (tie, tie), (big(),)]
    rng.shuffle(shapes)
    return shapes


def _transfers() -> int:
    """Device->host copies torch_xla has made in this process (its TransferFromDeviceTime metric's count)."""
    return xla_metric("TransferFromDeviceTime")[0]


def _split_dims(shape, spec: str) -> list[int]:
    """The dimensions a sharding string splits (those whose shard is smaller than the tensor)."""
    return [d for d, (full, part) in enumerate(zip(shape, S.shard_shape(shape, spec))) if part != full]


def _fsdpv2_itself() -> list:
    """What computes FSDPv2's layout: its wrapper (which marks every parameter), the function inside it that picks
    the partition spec, and this module's reader of both. Refused while the learner's answer runs."""
    import torch_xla.experimental.spmd_fully_sharded_data_parallel as fsdpv2

    return [fsdpv2.SpmdFullyShardedDataParallel, fsdpv2._prepare_spmd_partition_spec, fsdpv2_layout]


def check_fsdp_shard(fsdp_shard, mesh) -> str:
    """03.fsdp_shard: fsdp_shard(t, mesh) lays an XLA tensor out over `mesh` (one axis, "fsdp") as FSDPv2 lays out
    a parameter, and returns it. For five shapes drawn anew on every call, the result must be an XLA tensor with
    the same values, its sharding string the very one torch_xla's SpmdFullyShardedDataParallel gives a parameter
    of that shape, and the call must make no device->host copy (torch_xla's TransferFromDeviceTime count)."""
    todo(fsdp_shard)
    import torch_xla

    rng = random.Random(next(_calls))
    n = int(mesh.size())
    shapes = _fsdp_shapes(rng, n)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for shape, (want, _) in zip(shapes, fsdpv2_layout(shapes, mesh)):
        host = torch.randn(shape, generator=gen)
        # a pending result on the device, not yet computed: marking it only annotates the graph, so a right answer
        # makes no transfer at all (marking data already computed may copy it through the host on some runtimes)
        t = host.to(torch_xla.device()) * 1
        before = _transfers()
        with refusing(_fsdpv2_itself(), "lay it out yourself: torch_xla's FSDPv2 computing the layout is the answer"):
            out = call(fsdp_shard, t, mesh)
        copies = _transfers() - before
        out = getattr(out, "global_tensor", out)  # xs.mark_sharding returns an XLAShardedTensor around t
        require(isinstance(out, torch.Tensor), f"fsdp_shard returned a {type(out).__name__}; return the tensor")
        require(out.device.type == "xla", f"the result lives on '{out.device.type}': keep it on the XLA device")
        require(copies == 0, f"your code copied from the device to the host {copies} time(s): mark it where it is")
        require(tuple(out.shape) == shape, f"a {shape} tensor came back as {tuple(out.shape)}: keep its shape")
        got = S.sharding_of(out)
        if not got or "replicated" in got:
            raise Wrong(f"shape {shape}: not split, every device holds all of it; use xs.mark_sharding")
        split, big = _split_dims(shape, got), shape.index(max(shape))
        if split == [0] and big != 0:
            raise Wrong(f"shape {shape}: you split dim 0; FSDPv2 splits the largest dimension (dim {big})")
        if split != [big] and shape.count(max(shape)) > 1 and [shape[d] for d in split] == [max(shape)]:
            raise Wrong(f"shape {shape}: dim {split[0]}; on a tie FSDPv2 splits the first of the largest (dim {big})")
        require(
            got == want,
            f"shape {shape} over {n} devices: you laid it out as {got} (one device holds "
            f"{S.shard_shape(shape, got)}), FSDPv2 gives {want} ({S.shard_shape(shape, want)})",
        )
        require(bool(torch.equal(out.cpu(), host)), f"shape {shape}: the values changed; lay out t itself")
    return f"{len(shapes)} shapes laid out as torch_xla's FSDPv2 does, no host copy"


# -- 3. FSDP: predict the bytes one device holds, measured on the device -------------------------------------------


def _fsdp_formula(shape, n: int, bytes_per: int) -> int:
    """The rule on paper, for device counts the notebook has no mesh of: the largest dimension (first on a tie)
    cut in n slices of ceil(size / n), the last ones padded to that size."""
    big = max(shape)
    return math.ceil(big / n) * math.prod(shape) // big * bytes_per


def check_fsdp_bytes(fsdp_bytes, mesh=None, model=None, model_bytes: int | None = None) -> str:
    """03.fsdp_bytes: fsdp_bytes(shape, devices, bytes_per=4) -> bytes ONE device holds of a tensor that FSDPv2
    splits along its largest dimension (the first on a tie), padded when it does not divide.

    With a mesh: compared with the bytes torch_xla's FSDPv2 really gives one device (five float32 shapes and one
    bfloat16, drawn anew on every call, laid out on the mesh and read from their shardings); then, for device
    counts the notebook has no mesh of, with the rule on paper. With `model` and `model_bytes` (the FSDP run's
    bytes per device): the sum over the model's parameters must be that figure. All exact: whole bytes."""
    todo(fsdp_bytes)
    rng = random.Random(next(_calls))
    cases = []  # (shape, devices, bytes_per, want, source)
    if mesh is not None:
        n = int(mesh.size())
        shapes = _fsdp_shapes(rng, n)
        for shape, (_, nbytes) in zip(shapes, fsdpv2_layout(shapes, mesh)):
            cases.append((shape, n, 4, nbytes, "measured"))
        bf = _fsdp_shapes(rng, n)[0]
        cases.append((bf, n, 2, fsdpv2_layout([bf], mesh, torch.bfloat16)[0][1], "measured"))
    for n in (3, rng.choice([4, 6])):  # other device counts: the rule on paper
        for shape in _fsdp_shapes(rng, n)[:3]:
            cases.append((shape, n, 4, _fsdp_formula(shape, n, 4), "on paper"))
    for shape, n, bytes_per, want, _ in cases:
        got = integer(call(fsdp_bytes, shape, n, bytes_per), f"fsdp_bytes({shape}, {n}, {bytes_per})")
        if got == want:
            continue
        if got == math.ceil(shape[0] / n) * math.prod(shape) // shape[0] * bytes_per:
            raise Wrong(f"shape {shape} over {n}: split along dim 0; FSDPv2 splits the largest dimension")
        if got in (math.prod(shape) * bytes_per // n, math.prod(shape) * bytes_per / n):
            raise Wrong(f"shape {shape} over {n}: {got} is an exact 1/{n}; the last slices are padded")
        if bytes_per != 4 and got == _fsdp_formula(shape, n, 4):
            raise Wrong(f"shape {shape} in bfloat16: use bytes_per ({bytes_per}), not 4")
        require(
            got == want, f"shape {shape} over {n} devices, {bytes_per} B each: you say {got}, one device holds {want}"
        )
    note = f"{sum(c[4] == 'measured' for c in cases)} shapes measured on the mesh, {len(cases)} in all"
    if model is not None and model_bytes is not None:
        n = int(mesh.size()) if mesh is not None else None
        require(n is not None, "the model's total needs the mesh it was split over")
        total = sum(integer(call(fsdp_bytes, tuple(p.shape), n), "fsdp_bytes") for p in model.parameters())
        require(
            total == int(model_bytes),
            f"summed over the model: you say {total:,} bytes, the FSDP run holds {int(model_bytes):,} per device",
        )
        note += f"; the whole model: {total:,} B per device, as measured"
    return note


# -- 4. Megatron: the activations all-reduced ------------------------------------------------------------------------


def check_megatron_bytes(megatron_bytes) -> str:
    """03.megatron: megatron_bytes(B, T, C, L, data) -> activation bytes Megatron all-reduces per training step
    (float32), over the model groups of one data slice."""
    todo(megatron_bytes)
    rng = random.Random(next(_calls))
    # the random case first, where the likely mistakes give different numbers (L of 3 or more, data of 4 or 8)
    cases = [(8 * rng.randint(1, 8), rng.choice([24, 40]), rng.choice([48, 80]), rng.randint(3, 5), rng.choice([4, 8]))]
    cases += [(16, 16, 32, 1, 4), (64, 128, 256, 4, 4), (8, 8, 48, 2, 1), (32, 64, 64, 3, 8)]
    for B, T, C, L, data in cases:
        want = 4 * L * (B // data) * T * C * 4
        got = integer(call(megatron_bytes, B, T, C, L, data), f"megatron_bytes({B}, {T}, {C}, {L}, {data})")
        hint = mistake(
            got,
            want,
            {
                "that is the forward only: backward all-reduces the column-parallel input gradients too": want // 2,
                "each model group works on one data slice: B / data sequences, not B": want * data,
                "float32 activations: 4 bytes per value, not 2": want // 2,
                "every block all-reduces: times L": want // L,
            },
        )
        require(
            got == want,
            f"B={B}, T={T}, C={C}, L={L}, data={data}: you say {got}, Megatron moves {want}"
            + (f": {hint}" if hint else ""),
        )
    return "4 all-reduces per block of (B/data, T, C)"
