"""Notebook 03's plans in plain PyTorch: DTensor placements on a DeviceMesh, one process per device.

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))    # under torchrun, 4 gloo processes
    apply_plan("fsdp", model, mesh)          # fully_shard (FSDP2) each block, then the root
    fsdp2_shard_shape((256, 32), 4)          # (64, 32): what one device stores of that weight (dim 0, padded)
    predict_collectives("fsdp", cfg, 4)      # {"all-gather": {"count", "bytes"}, "reduce-scatter": ...}

The same three layouts as labkit.lessons.parallel_gpt runs under GSPMD, written the way torch.distributed spells
them (and TorchTPU, which shards with DTensor):

- "data": FSDP2 on a 2-D (replicate=4, shard=1) mesh, i.e. HSDP with a shard group of one device: every weight whole
  on every device (placements (Replicate(), Shard(0)) over a shard axis of size 1), gradients all-reduced per unit.
- "fsdp": `fully_shard` (FSDP2) on each block, then on the root: every parameter a DTensor Shard(0) over all devices.
  FSDP2 splits dim 0 (unless `shard_placement_fn` says otherwise) and pads it to a multiple of the devices;
  torch_xla's FSDPv2 splits the largest dimension. `reshard_after_forward` is None by default in torch 2.9: True
  below the root (a block's weights are gathered again for its backward), False at the root.
- "tensor": Megatron's pairs with `parallelize_module` on the "model" axis of a (data, model) mesh: q, k, v and the
  MLP's fc ColwiseParallel (Shard(0) of the weight), the two projections RowwiseParallel (Shard(1)); the batch split
  over "data", whose gradients this code all-reduces itself (one per parameter, as predict_tensor_parallel counts).

The helpers that only do arithmetic (shapes, bytes, predictions) need no process group and are unit-tested;
apply_plan and the communication counters need torch.distributed initialised (see labkit.lessons.dtensor_mesh).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labkit.spmd.predict import gpt_param_shapes, predict_data_parallel, predict_fsdp, predict_tensor_parallel
from labkit.spmd.sharding import SplitQKVAttention, split_qkv

PLANS = ("data", "fsdp", "tensor")
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast")


# -- arithmetic: no process group ---------------------------------------------------------------------------------
def fsdp2_shard_shape(shape, devices: int) -> tuple[int, ...]:
    """What one device stores of a parameter under FSDP2's default Shard(0): dim 0 padded to a multiple of
    `devices`, then split (a 10-row weight on 4 devices: 3 rows each, 12 stored for 10 real). A 0-dim tensor is
    kept whole."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return shape
    return (math.ceil(shape[0] / devices),) + shape[1:]


def fsdp2_local_rows(rows: int, devices: int) -> list[int]:
    """Rows of dim 0 each rank's to_local() returns under FSDP2 (unpadded: the last ranks get fewer, even 0)."""
    each = math.ceil(rows / devices)
    return [max(0, min(each, rows - r * each)) for r in range(devices)]


def largest_dim_shard_shape(shape, devices: int) -> tuple[int, ...]:
    """torch_xla's FSDPv2 (and notebook 03's predict_fsdp): the largest dimension split, the first on a tie."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        return shape
    d = max(range(len(shape)), key=lambda i: (shape[i], -i))
    return shape[:d] + (math.ceil(shape[d] / devices),) + shape[d + 1 :]


def split_dims(shape, local_shape) -> tuple[int, ...]:
    """The dimensions a device holds only part of: where its local shape is smaller than the full one."""
    return tuple(d for d, (a, b) in enumerate(zip(shape, local_shape)) if int(b) < int(a))


def nbytes(shape, bytes_per: int = 4) -> int:
    return math.prod(int(s) for s in shape) * bytes_per


def gpt_units(cfg, split: bool = False) -> list[list[tuple[int, ...]]]:
    """Parameter shapes of labkit's GPT grouped as FSDP2 units: [root (wte, wpe, ln_f), block 0, block 1, ...].
    split=True: q, k, v as three (C, C) matrices (split_qkv) instead of one (3C, C)."""
    shapes = gpt_param_shapes(cfg)
    per = (len(shapes) - 4) // cfg.n_layer
    blocks = [shapes[2 + i * per : 2 + (i + 1) * per] for i in range(cfg.n_layer)]
    if split:
        C = cfg.n_embd
        blocks = [b[:2] + [(C, C), (C,)] * 3 + b[4:] for b in blocks]
    return [shapes[:2] + shapes[-2:]] + blocks


def predict_bytes(plan: str, cfg, devices: int, model_axis: int = 2, bytes_per: int = 4) -> int:
    """Parameter bytes on the fullest device under a DTensor plan (padding included): AdamW's state is twice this."""
    if plan == "data":
        return sum(nbytes(s, bytes_per) for s in gpt_param_shapes(cfg))
    if plan == "fsdp":
        return sum(nbytes(fsdp2_shard_shape(s, devices), bytes_per) for s in gpt_param_shapes(cfg))
    if plan == "tensor":
        C, m = cfg.n_embd, model_axis
        col = [(C, C), (C,)] * 3 + [(4 * C, C), (4 * C,)]  # Shard(0) of weight and bias
        row = [(C, C), (C, 4 * C)]  # Shard(1) of the weight; the bias stays whole
        split = sum(nbytes(s, bytes_per) for s in col + row) // m
        whole = sum(nbytes(s, bytes_per) for u in gpt_units(cfg, split=True) for s in u) - cfg.n_layer * sum(
            nbytes(s, bytes_per) for s in col + row
        )
        return whole + cfg.n_layer * split
    raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {plan!r}")


def predict_collectives(
    plan: str, cfg, devices: int, global_batch: int = 16, model_axis: int = 2, last_kept: bool = False
) -> dict:
    """{op: {"count": n, "bytes": b}} one training step issues under a plan (float32), from how FSDP2 and DTensor
    work; bytes as labkit.spmd.sharding.count_collectives counts them (an all-gather's gathered result, a
    reduce-scatter's unreduced input, an all-reduce's buffer).

    fsdp: units = the root (embeddings, final LayerNorm) + one per block. Forward all-gathers every unit once;
    backward all-gathers again each block (resharded after forward), not the root (kept whole: torch 2.9's
    default); each unit's gradients are reduce-scattered once. No all-reduce. last_kept=True: the last block is
    not resharded after its forward (labkit.parallel.FullyShard's policy, torchtitan's), so backward does not gather
    it again: one all-gather fewer.
    data: the same units on a shard group of one device: nothing to gather, one all-reduce of each unit's gradients
    over the replicas, and FSDP2's reduce-scatter of each unit's gradients still issued, over a group of one device
    (it moves nothing: counted, with the bytes it is handed) by torch 2.9; torch 2.11 skips it (both measured: the
    Colab GPU image's torch; 2.10 not checked, assumed to issue it).
    tensor: Megatron: per block two all-reduces of activations forward (after each RowwiseParallel) and two
    backward (once at the attention's input, where q, k, v's partial input gradients meet; once at the MLP's), plus
    one all-reduce per parameter over the data axis: predict_tensor_parallel, unchanged."""
    units = gpt_units(cfg, split=plan == "tensor")
    unit_bytes = [sum(nbytes(fsdp2_shard_shape(s, devices)) * devices for s in u) for u in units]
    L = cfg.n_layer
    if plan == "fsdp":
        again = unit_bytes[1:-1] if last_kept else unit_bytes[1:]  # the blocks gathered again for backward
        return {
            "all-gather": {"count": 1 + L + len(again), "bytes": sum(unit_bytes) + sum(again)},
            "reduce-scatter": {"count": L + 1, "bytes": sum(unit_bytes)},
        }
    if plan == "data":
        full = [sum(nbytes(s) for s in u) for u in units]
        out = {"all-reduce": {"count": L + 1, "bytes": sum(full)}}
        if _issues_reduce_scatter_over_one():
            out["reduce-scatter"] = {"count": L + 1, "bytes": sum(full)}
        return out
    if plan == "tensor":
        return predict_tensor_parallel(cfg, global_batch, devices // model_axis, model_axis)
    raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {plan!r}")


def textbook_collectives(plan: str, cfg, devices: int, global_batch: int = 16, model_axis: int = 2) -> dict:
    """Notebook 03's first-principles prediction for the same plan (labkit.spmd.predict), one message per
    parameter: FSDP2 sends the same bytes for "data" and "tensor", bucketed per unit for "data" and "fsdp" (fewer,
    larger messages), and for "fsdp" gathers the root only once (its reshard_after_forward is False)."""
    if plan == "data":
        return predict_data_parallel(cfg, global_batch)
    if plan == "fsdp":
        return predict_fsdp(cfg, devices)["textbook"]
    if plan == "tensor":
        return predict_tensor_parallel(cfg, global_batch, devices // model_axis, model_axis)
    raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {plan!r}")


def op_name(op) -> str:
    """ "all-reduce" for c10d.allreduce_ / _c10d_functional.all_reduce and the like: one name per collective kind."""
    s = str(op).split(".")[-1].strip("_").replace("_base", "").replace("_into_tensor", "").replace("_coalesced", "")
    s = s.replace("_tensor", "").replace("_single", "")
    return {
        "allreduce": "all-reduce",
        "all_reduce": "all-reduce",
        "allgather": "all-gather",
        "all_gather": "all-gather",
        "all_gather_out": "all-gather",  # _c10d_functional.all_gather_into_tensor_out
        "recv_any_source": "recv",
        "reduce_scatter": "reduce-scatter",
        "alltoall": "all-to-all",
        "all_to_all": "all-to-all",
    }.get(s, s)


# -- needs torch.distributed --------------------------------------------------------------------------------------
class LocalHeadsAttention(SplitQKVAttention):
    """SplitQKVAttention whose q, k, v may come back as one device's columns (ColwiseParallel's local output):
    the head count is read from the tensor (-1), the head size from the config, so a device attends with its own
    whole heads. Same maths on one device."""

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = (lin(x).view(B, T, -1, hd).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(B, T, -1)))


def tensor_parallel_model(model):
    """split_qkv, with attention that works on local heads (in place; returns the model)."""
    split_qkv(model)
    for block in model.blocks:
        block.attn.__class__ = LocalHeadsAttention
    return model


def make_mesh(plan: str, devices: int, model_axis: int = 2):
    """The DeviceMesh a plan runs on (cpu: gloo processes): data (devices, 1), fsdp (devices,), tensor
    (devices / model_axis, model_axis)."""
    from torch.distributed.device_mesh import init_device_mesh

    if plan == "data":
        return init_device_mesh("cpu", (devices, 1), mesh_dim_names=("replicate", "shard"))
    if plan == "fsdp":
        return init_device_mesh("cpu", (devices,), mesh_dim_names=("fsdp",))
    if plan == "tensor":
        return init_device_mesh("cpu", (devices // model_axis, model_axis), mesh_dim_names=("data", "model"))
    raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {plan!r}")


def apply_plan(plan: str, model, mesh):
    """Lay a GPT out under `plan` on `mesh` (make_mesh's), in place. For "tensor" the model must be
    tensor_parallel_model(GPT(cfg)) already. Returns the model."""
    if plan in ("data", "fsdp"):
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh)  # one unit per block: gathered, used, freed in turn
        return fully_shard(model, mesh=mesh)  # the root: embeddings and the final LayerNorm
    if plan == "tensor":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            parallelize_module,
        )

        layout = {}
        for i in range(len(model.blocks)):
            # the attention's input as a DTensor: q, k and v's partial input gradients add up as DTensors and are
            # all-reduced once (without it, each of the three Linears would all-reduce its own)
            layout[f"blocks.{i}.attn"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
            for name in ("q", "k", "v"):
                layout[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
            layout[f"blocks.{i}.attn.proj"] = RowwiseParallel()
            layout[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
            layout[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
        return parallelize_module(model, mesh["model"], layout)
    raise ValueError(f"plan must be one of {', '.join(PLANS)}, got {plan!r}")


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this process (to_local()); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def placement(t: torch.Tensor) -> str:
    """ "Shard(dim=0)", "(Replicate(), Shard(dim=0))", or "plain tensor" for a parameter no plan touched."""
    p = getattr(t, "placements", None)
    if p is None:
        return "plain tensor"
    return str(p[0]) if len(p) == 1 else "(" + ", ".join(str(x) for x in p) + ")"


def padded_bytes(model) -> int | None:
    """Bytes of the padded shards FSDP2 stores on this process (its own record, a private attribute), or None
    when the model is not fully_shard'ed or this torch keeps it elsewhere."""
    total, seen = 0, False
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        for fp in getattr(group, "fsdp_params", None) or ():
            data = getattr(fp, "_sharded_param_data", None)
            if data is None:
                return None
            total += data.numel() * data.element_size()
            seen = True
    return total if seen else None


def padding_probe(devices: int, rows: int = 10, cols: int = 3) -> dict:
    """A (rows, cols) weight fully_shard'ed over `devices` processes: the rows each process's to_local() holds and
    the rows FSDP2 stores on each (padded to a multiple of the devices). Call it on every process."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    lin = torch.nn.Linear(cols, rows, bias=False)
    fully_shard(lin, mesh=make_mesh("fsdp", devices))
    held = [None] * devices
    dist.all_gather_object(held, local(lin.weight).shape[0])
    stored = padded_bytes(lin)
    return {
        "shape": [rows, cols],
        "rows_by_rank": held,
        "padded_rows": None if stored is None else stored // (cols * lin.weight.element_size()),
    }


def comm_mode():
    """A CommDebugMode that also adds up the bytes of each collective (read comm_counts(mode) after the step)."""
    from torch.distributed.tensor.debug import CommDebugMode

    class _CommBytes(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.bytes_by_op: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = sum(self.comm_counts.values())
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented and sum(self.comm_counts.values()) > before:  # a collective was counted
                name = op_name(func._overloadpacket)
                self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + collective_bytes(args, out)
            return out

    return _CommBytes()


def collective_bytes(args, out=None) -> int:
    """The buffer a collective works on, as labkit.spmd.sharding.count_collectives counts it: a list of tensors
    (c10d's allreduce_) adds up; otherwise the largest tensor among its arguments and result (an all-gather's
    gathered output, a reduce-scatter's unreduced input, an all-reduce's buffer)."""

    def size(t):
        return t.numel() * t.element_size() if torch.is_tensor(t) else 0

    if args and isinstance(args[0], (list, tuple)) and args[0] and all(torch.is_tensor(t) for t in args[0]):
        return sum(size(t) for t in args[0])
    found = [a for a in args if torch.is_tensor(a)]
    found += [t for a in args if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)]
    found += [out] if torch.is_tensor(out) else [t for t in (out or ()) if torch.is_tensor(t)]
    return max((size(t) for t in found), default=0)


def comm_counts(mode) -> dict:
    """{op name: {"count", "bytes"}} from comm_mode() (a plain CommDebugMode: bytes 0), kinds merged (c10d's and
    the functional collectives'): the format of predict_collectives."""
    out: dict[str, dict] = {}
    for op, n in mode.get_comm_counts().items():
        if n:
            name = op_name(op)
            out.setdefault(name, {"count": 0, "bytes": 0})["count"] += int(n)
    for name, b in getattr(mode, "bytes_by_op", {}).items():
        out.setdefault(name, {"count": 0, "bytes": 0})["bytes"] += b
    return out


def _issues_reduce_scatter_over_one() -> bool:
    """Whether this torch's FSDP2 issues a gradient reduce-scatter over a shard group of one device (2.9: yes;
    2.11: no, measured; 2.10: not checked, taken as yes)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) < (2, 11)
