"""Sharding a model over a mesh, and measuring what it costs: bytes per device, collectives.

    mesh = labkit.spmd.mesh.make_mesh((4, 2), ("data", "model"))
    model = split_qkv(GPT(cfg)).to(device)
    shard_gpt_tensor_parallel(model, mesh)            # Megatron-style heads / MLP split on "model"
    per_device_bytes(model.parameters())              # {device: bytes} from each tensor's sharding
    count_collectives(open("...after_optimizations.txt").read())   # ops and bytes XLA inserted

Three strategies, one vocabulary (the same ideas as DTensor's Shard/Replicate placements):
- data parallel: every weight replicated, the batch split on "data"; gradients all-reduced.
- tensor parallel (Megatron): in each block the first matmul is split by output features (column
  parallel: attention heads, MLP hidden units), the second by input features (row parallel), so
  each block needs one all-reduce of activations forward and one backward per split pair.

The predict_* functions work the communication out from first principles; the optimized HLO says what
XLA actually did; extra_collectives() is the difference, which the notebook explains in words.
- FSDP (ZeRO-3): every weight split over all devices; gathered for use, gradients reduce-scattered.

The collective counts come from XLA's optimized HLO (XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text, files *after_optimizations.txt): the graph before partitioning has none.
"""

from __future__ import annotations

import glob
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

# the first-principles predictions live in labkit.spmd.predict; named here too, beside what they are compared with
from labkit.spmd.predict import (  # noqa: F401
    extra_collectives,
    gpt_param_shapes,
    predict_data_parallel,
    predict_fsdp,
    predict_tensor_parallel,
)

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\((.*)$")


def _shapes_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(n * _DTYPE_BYTES.get(dtype, 4))
    return out


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)  # iota form: [groups,size]<=[devices]
    return int(m.group(2)) if m else 1


def collective_ops(hlo_text: str) -> list[dict]:
    """One {"op", "result", "bytes", "group"} per collective in an optimized HLO module's text.

    bytes: the full buffer the collective works on, read from the result type (operands carry no
    types in XLA's text): an all-reduce's (combined ones: the tuple's sum), an all-gather's
    gathered result, a reduce-scatter's unreduced input (result x group size). An async pair
    counts once, at its -start (whose tuple holds the input too: the largest element is taken).
    result: the result type without layouts ("f32[1,512,32]"); group: devices per replica group."""
    out = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        result, op, start, _ = m.groups()
        sizes = _shapes_bytes(result)
        if op == "all-gather" and start:
            nbytes = max(sizes, default=0)
        elif op == "reduce-scatter":
            nbytes = sum(sizes) * _group_size(line)
        else:
            nbytes = sum(sizes)
        out.append({"op": op, "result": re.sub(r"\{[\d,]*\}", "", result), "bytes": nbytes, "group": _group_size(line)})
    return out


def count_collectives(hlo_text: str) -> dict:
    """{op: {"count": n, "bytes": b}} for each collective in an optimized HLO module's text (see
    collective_ops for what the bytes are)."""
    out = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
    for c in collective_ops(hlo_text):
        out[c["op"]]["count"] += 1
        out[c["op"]]["bytes"] += c["bytes"]
    return out


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\((.*)$")


def sliced_all_reduces(hlo_text: str) -> list[dict]:
    """All-reduces whose result each device then cuts down to its own 1/group slice: a reduce-scatter written
    as all-reduce + dynamic-slice. Found where an instruction reads the all-reduce together with
    `%partition-id` (a dynamic-slice, or a fusion that contains one) and its result is the all-reduce's shape
    with one dimension divided by the group size. One {"all-reduce", "result", "slice", "user", "group"} per
    all-reduce (its first such user).

    XLA's GPU compiler rewrites this pattern into a reduce-scatter (its ReduceScatterCreator pass); the CPU
    compiler of torch_xla 2.9 leaves it as it is, so on XLA:CPU an FSDP gradient shows up here."""
    shapes, reduces, out, seen = {}, {}, [], set()
    lines = hlo_text.splitlines()
    for line in lines:
        m = _INSTR.match(line)
        if not m:
            continue
        name, dtype, dims, opcode, _ = m.groups()
        shapes[name] = (dtype, tuple(int(d) for d in dims.split(",") if d))
        if opcode in ("all-reduce", "all-reduce-done"):
            reduces[name] = _group_size(line)
    for line in lines:
        m = _INSTR.match(line)
        if not m or "%partition-id" not in m.group(5):
            continue
        user, dtype, dims, opcode, operands = m.groups()
        got = tuple(int(d) for d in dims.split(",") if d)
        for ar in re.findall(r"%([\w.\-]+)", operands):
            if ar not in reduces or reduces[ar] < 2 or ar in seen:
                continue
            full, group = shapes[ar][1], reduces[ar]
            diff = [i for i, (a, b) in enumerate(zip(full, got)) if a != b]
            if len(full) == len(got) and len(diff) == 1 and full[diff[0]] == got[diff[0]] * group:
                seen.add(ar)
                fmt = f"{shapes[ar][0]}[{','.join(map(str, full))}]"
                out.append({"all-reduce": ar, "result": fmt, "slice": f"{dtype}[{','.join(map(str, got))}]",
                            "user": f"{user} ({opcode})", "group": group})  # fmt: skip
    return out


def newest_step_graph(dump_dir: str, since: set[str] | None = None) -> tuple[str, str]:
    """(path, text) of the largest *after_optimizations.txt dumped since `since` (a set of paths
    seen before): the training step, which is by far the largest graph a step compiles."""
    files = sorted(set(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))) - set(since or ()))
    if not files:
        raise FileNotFoundError(
            f"no new *after_optimizations.txt in {dump_dir}: was XLA_FLAGS=--xla_dump_to "
            "set before torch_xla started, and did a step compile?"
        )
    path = max(files, key=os.path.getsize)
    with open(path) as f:
        return path, f.read()


def dumped(dump_dir: str) -> set[str]:
    return set(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")))


# -- where each tensor lives ------------------------------------------------------------------------
_TILE = re.compile(r"devices=\[([\d,]+)\]")


def shard_shape(shape, spec: str) -> tuple[int, ...]:
    """Shape of one device's shard for an XLA sharding string ("{replicated}", "{devices=[8,1]0,...}",
    with last_tile_dim_replicate when the last tile dimension is replication)."""
    shape = tuple(int(s) for s in shape)
    m = _TILE.search(spec or "")
    if not m or "maximal" in spec:
        return shape
    tiles = [int(t) for t in m.group(1).split(",")]
    tiles = tiles[: len(shape)]  # extra trailing tile dims are replication (last_tile_dim_replicate)
    return tuple(math.ceil(d / t) for d, t in zip(shape, tiles)) + shape[len(tiles) :]


def tile_devices(ndim: int, spec: str) -> dict[tuple[int, ...], list[int]]:
    """{tile index: device ids holding that tile} for a tensor of `ndim` dims with an XLA sharding
    string: "{replicated}" or "" gives {(0,)*ndim: []} (every device); "{devices=[2,1,4]0,2,4,6,1,3,5,7
    last_tile_dim_replicate}" gives two row tiles, each held by four devices. The iota form
    ("devices=[2,4]<=[4,2]T(1,0)") is read too."""
    m = re.search(r"devices=\[([\d,]+)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,]+))", spec or "")
    if not m or "maximal" in spec:
        return {(0,) * ndim: []}
    dims = [int(d) for d in m.group(1).split(",")]
    if m.group(4):
        ids = [int(d) for d in m.group(4).split(",")]
    else:
        import numpy as np

        iota = np.arange(math.prod(dims)).reshape([int(d) for d in m.group(2).split(",")])
        if m.group(3):
            iota = iota.transpose([int(d) for d in m.group(3).split(",")])
        ids = [int(i) for i in iota.reshape(-1)]
    tiles, rep = dims[:ndim], math.prod(dims[ndim:])  # trailing tile dims: replication
    out = {}
    for k in range(math.prod(tiles)):
        idx, r = [], k
        for t in reversed(tiles):
            idx.append(r % t)
            r //= t
        out[tuple(reversed(idx))] = ids[k * rep : (k + 1) * rep]
    return out


def sharding_of(t: torch.Tensor) -> str:
    if t.device.type != "xla":
        return ""
    from labkit import _xla

    return _xla.sharding_spec(t)


def device_bytes(tensors) -> int:
    """Bytes ONE device holds for these tensors (the largest shard of each: padding included)."""
    total = 0
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        total += math.prod(shard_shape(t.shape, sharding_of(t))) * t.element_size()
    return total


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]


def layout_table(model: nn.Module, limit: int | None = None) -> list[tuple[str, tuple, tuple, str]]:
    """(name, full shape, per-device shape, sharding) for each parameter: the text picture."""
    rows = []
    for name, p in model.named_parameters():
        spec = sharding_of(p)
        rows.append((name, tuple(p.shape), shard_shape(p.shape, spec), spec or "{replicated}"))
    return rows[:limit] if limit else rows


# -- the GPT, Megatron style ------------------------------------------------------------------------
class SplitQKVAttention(nn.Module):
    """labkit.models.gpt's attention with q, k and v as three Linears (same values, same maths).

    Why: the packed (3C, C) qkv matrix split in halves by rows puts all of q and half of k on the
    first half of the devices, so the heads would not line up; three (C, C) matrices split by rows
    give each device whole heads of q, k and v (head h is rows h*hd:(h+1)*hd of each)."""

    def __init__(self, attn):
        super().__init__()
        C = attn.proj.in_features
        self.n_head, self.dropout = attn.n_head, attn.dropout
        bias = attn.qkv.bias is not None
        self.q, self.k, self.v = (nn.Linear(C, C, bias=bias) for _ in range(3))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(attn.qkv.weight[i * C : (i + 1) * C])
                if bias:
                    lin.bias.copy_(attn.qkv.bias[i * C : (i + 1) * C])
        self.proj, self.drop = attn.proj, attn.drop

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (lin(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


def split_qkv(model: nn.Module) -> nn.Module:
    """Replace every block's packed attention by SplitQKVAttention (in place; returns the model)."""
    for block in model.blocks:
        block.attn = SplitQKVAttention(block.attn)
    return model


def gpt_tensor_parallel_specs(model: nn.Module, axis: str = "model") -> dict[str, tuple]:
    """{parameter name: partition spec} for a split_qkv GPT: Megatron's column/row pairs.
    Everything not named (embeddings, LayerNorms, the row-parallel biases) stays replicated."""
    specs = {}
    for i, block in enumerate(model.blocks):
        if not isinstance(block.attn, SplitQKVAttention):
            raise TypeError(
                "tensor parallelism needs labkit.spmd.sharding.split_qkv(model) first (whole heads per device)"
            )
        for name in ("q", "k", "v"):
            specs[f"blocks.{i}.attn.{name}.weight"] = (axis, None)  # column parallel: heads split
            specs[f"blocks.{i}.attn.{name}.bias"] = (axis,)
        specs[f"blocks.{i}.attn.proj.weight"] = (None, axis)  # row parallel: partial sums
        specs[f"blocks.{i}.mlp.fc.weight"] = (axis, None)
        specs[f"blocks.{i}.mlp.fc.bias"] = (axis,)
        specs[f"blocks.{i}.mlp.proj.weight"] = (None, axis)
    return specs


def apply_specs(model: nn.Module, mesh, specs: dict[str, tuple]) -> int:
    """mark_sharding each named parameter (already on the XLA device); returns how many were marked."""
    import torch_xla.distributed.spmd as xs

    params = dict(model.named_parameters())
    for spec in specs.values():
        check_axes(mesh, spec)
    missing = sorted(set(specs) - set(params))
    if missing:
        raise KeyError(f"sharding specs name parameters the model lacks: {missing[:5]}")
    for name, spec in specs.items():
        p = params[name]
        if any(a is not None and p.shape[d] % mesh.shape()[a] for d, a in enumerate(spec)):
            raise ValueError(f"{name} {tuple(p.shape)} does not divide evenly by spec {spec} on mesh {mesh.shape()}")
        xs.mark_sharding(p, mesh, spec)
    return len(specs)


def check_axes(mesh, spec) -> None:
    """ValueError naming an axis of `spec` that `mesh` lacks, and the axes it has (instead of a bare KeyError)."""
    names = tuple(getattr(mesh, "axis_names", None) or ())
    for a in spec:
        if isinstance(a, str) and a not in names:
            raise ValueError(f"mesh axis {a!r} (in spec {tuple(spec)}) is not on the mesh; its axes: {names}")


def shard_batch(batch, mesh, axis: str = "data"):
    """Mark dim 0 of every tensor in (x, y) as split over `axis`; other dims replicated."""
    import torch_xla.distributed.spmd as xs

    check_axes(mesh, (axis,))
    for t in batch:
        xs.mark_sharding(t, mesh, (axis,) + (None,) * (t.dim() - 1))
    return batch
