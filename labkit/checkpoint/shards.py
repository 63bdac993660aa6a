"""What the sharded checkpoint format reads and writes: which state is sharded, its CPU copy, DCP's planners.

    is_sharded(state)     # any tensor split over devices? (then labkit.checkpoint saves it with DCP)
    cpu = stage(state)    # this host's shards on the CPU, with their offsets; never the global tensor

Used by labkit.checkpoint.dcp (the sharded format: folders, commit marker, background writes) and the manager
(is_sharded: which format a state takes). Under torchrun a background save stages into labkit.checkpoint.staging's
CpuMirror instead of stage().
"""

from __future__ import annotations

import importlib.util
import sys

import torch

from labkit import _xla


# -- sharded state ---------------------------------------------------------------------------------
def _xla_loaded() -> bool:
    return "torch_xla" in sys.modules


def _sharded(t) -> bool:
    """True for an XLA tensor split over several devices (not replicated, not single-device)."""
    if not (torch.is_tensor(t) and t.device.type == "xla"):
        return False
    return _xla.split_over_devices(t)


def _dtensor_split(t) -> bool:
    """True for a DTensor split over processes (FSDP2's Shard(0), tensor parallelism): each holds a part."""
    placements = getattr(t, "placements", None) if torch.is_tensor(t) else None
    return bool(placements) and any(p.is_shard() for p in placements)


def is_sharded(state) -> bool:
    """Whether any tensor of a nested state is split over devices (XLA SPMD) or over processes (DTensor, FSDP2):
    then save it with this module."""
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves(state)
    return any(_dtensor_split(t) for t in leaves) or (_xla_loaded() and any(_sharded(t) for t in leaves))


def stage(state):
    """A copy of `state` on the CPU: sharded XLA tensors become torch_xla's CPU shards (this host's
    pieces with their offsets, never the global tensor), other XLA tensors come over in one batched
    transfer, CPU tensors are cloned (training keeps updating them while the write runs). The shard
    copy is torch_xla 2.9's `_cpu_shards_from_tensors`, what its own CheckpointManager.save_async uses."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat, spec = tree_flatten(state)
    sharded = [i for i, x in enumerate(flat) if _sharded(x)]
    split = set(sharded)
    on_xla = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.device.type == "xla" and i not in split]
    out = [x.detach().clone() if torch.is_tensor(x) and x.device.type == "cpu" else x for x in flat]
    if sharded or on_xla:
        if sharded:
            for i, s in zip(sharded, _xla.cpu_shards([flat[i] for i in sharded])):
                # a tile held by several devices (a 2-D mesh, replicated over one axis) is written once:
                # with its copies in the plan the checkpoint does not load ("Missing key in checkpoint")
                s.shards = [x for x in s.shards if x.replica_id == 0]
                out[i] = s
        if on_xla:
            for i, c in zip(on_xla, _xla.cpu_tensors([flat[i] for i in on_xla])):
                out[i] = c
    for i, x in enumerate(out):
        if torch.is_tensor(x) and x.device.type not in ("cpu", "xla"):
            out[i] = x.detach().cpu()
    return tree_unflatten(out, spec)


def _planner_kind() -> str:
    """Which DCP planners write: torch_xla's ("spmd") wherever it is installed, else DCP's ("default").
    The two flatten plain values differently (the optimizer's param_groups: one item or one per
    field), so a checkpoint must be read with the kind that wrote it: the commit record names it."""
    return "spmd" if _xla_loaded() or importlib.util.find_spec("torch_xla") is not None else "default"


def _planner(kind: str, load: bool, where: str):
    if kind == "spmd":
        try:
            from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner
        except ImportError as e:
            raise ImportError(f"{where} was written with torch_xla's SPMD planners; reading it needs torch_xla") from e
        return SPMDLoadPlanner() if load else SPMDSavePlanner()
    if kind != "default":
        raise ValueError(f"{where}: unknown planner {kind!r} in the commit record")
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    return DefaultLoadPlanner() if load else DefaultSavePlanner()


_MISSING = object()


def _key(container, k):
    """The key of `container` that path element `k` names: DCP's paths keep keys as strings, an
    optimizer's state is keyed by parameter index (int)."""
    if isinstance(container, dict):
        if k in container:
            return k
        alt = int(k) if isinstance(k, str) and k.isdigit() else k
        return alt if alt in container else _MISSING
    if isinstance(container, list) and str(k).isdigit() and int(k) < len(container):
        return int(k)
    return _MISSING


def _add_missing(state: dict, metadata, limit: int | None = None, where: str = "") -> None:
    """DCP loads only into entries the template has. An optimizer whose state is created at its first
    step (SGD's momentum, AdamW's moments) has none yet: add a CPU tensor of the saved shape for each
    such entry (None for a plain value; a key of digits becomes an int), so the checkpoint's structure
    loads whole. The optimizer's load_state_dict then moves those tensors to their parameter's
    device, unsharded: create the state first (as parallel_gpt does for AdamW) to restore it sharded.
    `limit`: the bytes of the checkpoint's files; an entry declaring more is refused as damaged before anything
    is allocated (a metadata file edited to claim terabytes would otherwise ask the allocator for them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = metadata.planner_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = paths.get(fqn)
        if not path:
            continue
        cur, depth = state, 0
        while depth < len(path) and (key := _key(cur, path[depth])) is not _MISSING:
            cur, depth = cur[key], depth + 1
        if depth == len(path):
            continue  # the template has it: DCP loads into it
        if not isinstance(cur, dict):
            continue  # a list too short or a value where a container was saved: DCP names the key
        for k in path[depth:-1]:
            cur = cur.setdefault(int(k) if isinstance(k, str) and k.isdigit() else k, {})
        last = path[-1]
        last = int(last) if isinstance(last, str) and last.isdigit() else last
        if isinstance(md, TensorStorageMetadata) and limit is not None:
            n = md.properties.dtype.itemsize
            for d in md.size:
                n *= d
            if n > limit:
                from labkit.checkpoint.safe_load import CheckpointRefused

                raise CheckpointRefused(
                    f"{where}: {fqn} declares {tuple(md.size)} {md.properties.dtype} ({n:,} bytes), more than the "
                    f"{limit:,} bytes of the checkpoint's files: the metadata is damaged"
                )
        cur[last] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
