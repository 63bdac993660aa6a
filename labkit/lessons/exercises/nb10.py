"""Checkers for notebook 10 (from torch_xla to TorchTPU). Each asks for one translation the move needs: a torch_xla
partition spec written as DTensor placements, the shape one rank keeps under those placements (DTensor splits like
`torch.chunk`, torch_xla pads every shard to one size), and the FLOPs of one training step, which no engine changes.
The inputs are drawn anew on every call and chosen so that each known mistake gives another answer. While the
learner's function runs, DTensor's own layout functions and this module's rules are refused by their code objects.

    from labkit.lessons.exercises import check, nb10
    check("10.placements", lambda: nb10.check_placements(placements))
    check("10.local_shape", lambda: nb10.check_local_shape(local_shape))
    check("10.step_flops", lambda: nb10.check_step_flops(step_flops))
"""

from __future__ import annotations

import itertools
import math
import random

from labkit.lessons.exercises import Wrong, call, integer, mistake, refusing, require, todo

__all__ = [
    "check_local_shape",
    "check_placements",
    "check_step_flops",
    "local_shape_rule",
    "placements_rule",
    "step_flops_rule",
]

_calls = itertools.count(1)
AXES = ("data", "model", "fsdp", "seq")
WORK_IT_OUT = "work it out from the inputs: DTensor's own layout is the answer here"


def placements_rule(spec: tuple, axes: tuple) -> list:
    """DTensor placements for torch_xla's `partition_spec` (one entry per TENSOR dim: a mesh axis name or None) on a
    mesh whose axes are `axes`: one placement per MESH axis, Shard(d) where tensor dim d names that axis, else
    Replicate()."""
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(spec.index(a)) if a in spec else Replicate() for a in axes]


def local_shape_rule(shape: tuple, mesh_shape: tuple, placements: list, coord: tuple) -> tuple:
    """The shape the rank at mesh coordinate `coord` keeps: each Shard(d) splits dim d the way `torch.chunk` does,
    ceil(n / k) rows a rank, so the last ranks keep fewer rows, or none."""
    from torch.distributed.tensor import Shard

    out = list(shape)
    for k, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Shard):
            step = math.ceil(out[p.dim] / k)
            out[p.dim] = max(0, min(step, out[p.dim] - c * step))
    return tuple(out)


def step_flops_rule(batch: int, sizes: list) -> int:
    """FLOPs of one training step of an MLP of Linear layers sizes[0] -> sizes[1] -> ... (bias and activations
    left out, as torch's FlopCounterMode counts): each layer's forward matmul, 2 B in out; its weight gradient, as
    many; and its input gradient, as many again, for every layer but the first (its input needs no gradient)."""
    layers = list(zip(sizes[:-1], sizes[1:]))
    return sum(2 * batch * i * o * (2 + (n > 0)) for n, (i, o) in enumerate(layers))


def _rules():
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return [distribute_tensor, compute_local_shape_and_global_offset, placements_rule, local_shape_rule]


def _read_placements(got, what: str) -> list:
    """The learner's placements as ("S", dim) / ("R",) pairs, judged by type and a plain int, never by `__eq__`."""
    from torch.distributed.tensor import Replicate, Shard

    require(isinstance(got, (list, tuple)), f"{what}: return a list of placements, got {type(got).__name__}")
    out = []
    for p in got:
        if isinstance(p, Shard):
            out.append(("S", integer(p.dim, "Shard's dim")))
        elif isinstance(p, Replicate):
            out.append(("R",))
        else:
            raise Wrong(f"{what}: each placement is Shard(d) or Replicate(), got {type(p).__name__}")
    return out


def _show(ps) -> str:
    return "[" + ", ".join(f"Shard({p[1]})" if p[0] == "S" else "Replicate()" for p in ps) + "]"


def check_placements(placements) -> str:
    """10.placements: placements(partition_spec, mesh_axes) -> DTensor placements, one per mesh axis (see
    placements_rule). Judged on 5 specs over meshes of 2 and 3 axes, drawn anew."""
    todo(placements)
    rng = random.Random(next(_calls))
    cases = [(("data", None), ("data", "model"))]
    for _ in range(4):
        axes = tuple(rng.sample(AXES, rng.choice([2, 3])))
        ndim = rng.choice([2, 3])
        names = rng.sample(axes, min(len(axes), rng.choice([1, 2]))) + [None] * ndim
        spec = tuple(rng.sample(names, ndim))
        if all(s is None for s in spec) or spec.index(next(s for s in spec if s)) == 0:
            spec = spec[1:] + spec[:1]  # a shard off dim 0 somewhere, so that dims and axes differ
        cases.append((spec, axes))
    rng.shuffle(cases)
    for spec, axes in cases:
        what = f"partition_spec {spec} on mesh axes {axes}"
        with refusing(_rules(), WORK_IT_OUT):
            got = _read_placements(call(placements, spec, axes), what)
        want = _read_placements(placements_rule(spec, axes), what)
        if got == want:
            continue
        per_dim = [("S", axes.index(s)) if s else ("R",) for s in spec]
        hint = mistake(
            got,
            want,
            {
                "one placement per MESH axis, saying which tensor dim it splits; a partition spec has one entry per "
                "TENSOR dim, naming a mesh axis": per_dim,
                "Shard(d) names the tensor dim that the axis splits, not the axis's position": [
                    ("S", i) if p[0] == "S" else p for i, p in enumerate(want)
                ],
            },
        )
        raise Wrong(f"{what}: you say {_show(got)}, DTensor needs {_show(want)}" + (f": {hint}" if hint else ""))
    return f"{len(cases)} specs over meshes of 2 and 3 axes"


def check_local_shape(local_shape) -> str:
    """10.local_shape: local_shape(shape, mesh_shape, placements, coord) -> the shape that rank keeps (see
    local_shape_rule). Judged on uneven splits drawn anew, where torch_xla's padded shards differ."""
    from torch.distributed.tensor import Replicate, Shard

    todo(local_shape)
    rng = random.Random(next(_calls))
    cases = [((10, 6), (4,), [Shard(0)], (3,)), ((10, 6), (4,), [Shard(0)], (1,))]
    for _ in range(4):
        mesh = (rng.choice([2, 4]), rng.choice([3, 4]))
        dims = rng.sample([0, 1], 2)
        shape = tuple(rng.choice([k * 3 + 1, k * 2 + 1, k * 5 - 1]) for k in (mesh[dims.index(0)], mesh[dims.index(1)]))
        placements = [Shard(dims[0]), rng.choice([Shard(dims[1]), Replicate()])]
        coord = (rng.randrange(mesh[0]), mesh[1] - 1)
        cases.append((shape, mesh, placements, coord))
    rng.shuffle(cases)
    for shape, mesh, placements, coord in cases:
        what = f"shape {shape} on a mesh {mesh}, placements {placements}, the rank at {coord}"
        with refusing(_rules(), WORK_IT_OUT):
            got = call(local_shape, shape, mesh, list(placements), coord)
        require(isinstance(got, (tuple, list, __import__("torch").Size)), f"{what}: return a tuple of sizes")
        got = tuple(integer(v, "a size") for v in got)
        want = local_shape_rule(shape, mesh, placements, coord)
        if got == want:
            continue
        padded = list(shape)
        for k, p in zip(mesh, placements):
            if isinstance(p, Shard):
                padded[p.dim] = math.ceil(padded[p.dim] / k)
        floor = list(shape)
        for k, p in zip(mesh, placements):
            if isinstance(p, Shard):
                floor[p.dim] = floor[p.dim] // k
        hint = mistake(
            got,
            want,
            {
                "that is torch_xla's padded shard, the same size on every device; DTensor splits like torch.chunk: "
                "ceil(n / k) rows a rank until the rows run out": tuple(padded),
                "not n // k: torch.chunk gives the first ranks ceil(n / k) rows, and the last ones what is left": tuple(
                    floor
                ),
            },
        )
        raise Wrong(f"{what}: you say {got}, that rank keeps {want}" + (f": {hint}" if hint else ""))
    return f"{len(cases)} uneven splits, 1-D and 2-D meshes"


def check_step_flops(step_flops) -> str:
    """10.step_flops: step_flops(batch, sizes) -> FLOPs of one training step of an MLP (see step_flops_rule).
    Judged on the notebook's MLP and on MLPs of 2 to 4 layers drawn anew."""
    todo(step_flops)
    rng = random.Random(next(_calls))
    cases = [(32, [64, 32, 10])]
    for n in (2, 3, 4):
        cases.append((rng.choice([8, 16, 64, 256]), [rng.choice([16, 48, 64, 100, 784]) for _ in range(n + 1)]))
    for batch, sizes in cases:
        with refusing([step_flops_rule], "work it out from the sizes: this module's rule is the answer"):
            got = integer(call(step_flops, batch, list(sizes)), f"step_flops({batch}, {sizes})")
        want = step_flops_rule(batch, sizes)
        if got == want:
            continue
        macs = sum(i * o for i, o in zip(sizes[:-1], sizes[1:]))
        hint = mistake(
            got,
            want,
            {
                "6 B N counts an input gradient for the first layer too; its input (the data) needs none": 6
                * batch
                * macs,
                "that is the forward alone: the backward computes two matmuls a layer (one for the first)": 2
                * batch
                * macs,
                "a multiply-add is 2 FLOPs": want // 2,
            },
        )
        raise Wrong(
            f"batch {batch}, layers {sizes}: you say {got:,}, the step computes {want:,}"
            + (f": {hint}" if hint else "")
        )
    return f"{len(cases)} MLPs"
