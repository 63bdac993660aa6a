"""Collectives counted as they run: by op, by bytes, and by the process group (the mesh dimension) they ran on.

with collective_counter() as c: ...; comm_by_dim(c, plan.mesh)   # {"shard": {"all-gather": [n, bytes]}, ...}
"""

from __future__ import annotations

import torch

from labkit.spmd.dtensor_plans import collective_bytes, op_name

# What counts as a collective: the data-moving kinds, by op_name. The c10d namespaces hold other ops too (wait, barrier,
# and, under torch 2.11 with torch-tpu loaded, one that op_name calls "wrap_autograd", which moves no data).
COLLECTIVES = frozenset(
    (
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "broadcast",
        "reduce",
        "scatter",
        "gather",
        "send",
        "recv",
    )
)


def collective_counter():
    """comm_mode() without CommDebugMode's module tracker (its hooks fail on a module entered before the mode, e.g.
    a DistributedDataParallel forward): every c10d / functional collective counted. Read comm_counts(mode) after."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        counts: dict[str, int]
        bytes_by_op: dict[str, int]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor runs first and turns the op into plain ones and collectives, seen here
            out = func(*args, **(kwargs or {}))
            name = op_name(func._overloadpacket) if func.namespace in ("c10d", "_c10d_functional") else None
            if name in COLLECTIVES:
                n = collective_bytes(args, out)
                self.counts[name] = self.counts.get(name, 0) + 1
                self.bytes_by_op[name] = self.bytes_by_op.get(name, 0) + n
                where = self.by_group.setdefault((name, _group_name(args, kwargs)), [0, 0])
                where[0], where[1] = where[0] + 1, where[1] + n
            return out

        def get_comm_counts(self) -> dict:
            return dict(self.counts)

    mode = _Count()
    mode.counts, mode.bytes_by_op, mode.by_group = {}, {}, {}
    return mode


def _group_name(args, kwargs) -> str | None:
    """The process group a c10d op ran on (its boxed ProcessGroup argument) or a functional one's group name."""
    import torch.distributed as dist

    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except Exception:  # another boxed object (a ReduceOp)
                continue
    strings = [a for a in args if isinstance(a, str)]
    return strings[-1] if strings else None


def comm_by_dim(mode, mesh) -> dict:
    """{mesh dimension: {op: [count, bytes]}} from a collective_counter: which collectives ran inside a host and
    which crossed hosts (an HSDP mesh's "shard" and "replicate"); ops on no dimension of `mesh` under "other"."""
    dims = {mesh.get_group(d).group_name: d for d in mesh.mesh_dim_names}
    out: dict = {}
    for (op, group), (count, nbytes) in mode.by_group.items():
        out.setdefault(dims.get(group, "other"), {})[op] = [count, nbytes]
    return out
