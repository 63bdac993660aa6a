"""Notebook 10's checkers: the notebook's hidden solutions and a right answer pass; wrong answers, placeholders, an
answer that raises and one that calls DTensor's own layout print "not yet" with a reason; the rules agree with
DTensor's own split (a fake process group, one rank at a time) and with torch's FlopCounterMode."""

import math
from pathlib import Path

import nbformat
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from labkit.lessons import exercises
from labkit.lessons.exercises import NotDone, Wrong, check, nb10

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "10_from_torch_xla_to_torchtpu.ipynb"


def right_placements(spec, axes):
    return [Shard(spec.index(a)) if a in spec else Replicate() for a in axes]


def right_local_shape(shape, mesh_shape, placements, coord):
    out = list(shape)
    for k, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Shard):
            rows = math.ceil(out[p.dim] / k)
            out[p.dim] = max(0, min(rows, out[p.dim] - c * rows))
    return tuple(out)


def right_flops(batch, sizes):
    return sum(2 * batch * i * o * (2 if n == 0 else 3) for n, (i, o) in enumerate(zip(sizes[:-1], sizes[1:])))


def boom(*args):
    raise ZeroDivisionError("the learner's bug")


CHECKERS = {
    "10.placements": (nb10.check_placements, right_placements),
    "10.local_shape": (nb10.check_local_shape, right_local_shape),
    "10.step_flops": (nb10.check_step_flops, right_flops),
}


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_right_answer_passes_and_placeholders_and_exceptions_are_not_yet(name, capsys, monkeypatch):
    checker, right = CHECKERS[name]
    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    for _ in range(3):  # the inputs are drawn anew on every call
        assert check(name, lambda: checker(right))
    for answer in (None, ..., lambda *a: None, lambda *a: ...):
        with pytest.raises(NotDone):
            checker(answer)
    assert not check(name, lambda: checker(boom))
    out = capsys.readouterr().out
    assert "✓ " + name in out and "your code raised ZeroDivisionError: the learner's bug" in out


def test_the_notebooks_hidden_solutions_pass(monkeypatch):
    """The solution cells of notebooks/10_from_torch_xla_to_torchtpu.ipynb, run as CI runs them (LABKIT_SOLUTIONS=1)."""
    monkeypatch.setenv("LABKIT_SOLUTIONS", "1")
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if "solution" in c.metadata.get("tags", [])]
    assert len(cells) == 3
    ns = {"exercises": exercises, "Shard": Shard, "Replicate": Replicate}
    for src in cells:
        exec(src, ns)  # noqa: S102 - the repository's own notebook
    nb10.check_placements(ns["placements"])
    nb10.check_local_shape(ns["local_shape"])
    nb10.check_step_flops(ns["step_flops"])


def test_each_mistake_is_named():
    with pytest.raises(Wrong, match="one placement per MESH axis"):
        nb10.check_placements(lambda spec, axes: [Shard(axes.index(s)) if s else Replicate() for s in spec])
    with pytest.raises(Wrong, match=r"Shard\(d\) or Replicate\(\)"):
        nb10.check_placements(lambda spec, axes: ["S0" for _ in axes])

    def padded(shape, mesh_shape, placements, coord):
        out = list(shape)
        for k, p in zip(mesh_shape, placements):
            if isinstance(p, Shard):
                out[p.dim] = math.ceil(out[p.dim] / k)
        return tuple(out)

    with pytest.raises(Wrong, match="torch_xla's padded shard"):
        nb10.check_local_shape(padded)
    with pytest.raises(Wrong, match="6 B N counts an input gradient for the first layer"):
        nb10.check_step_flops(lambda b, s: 6 * b * sum(i * o for i, o in zip(s[:-1], s[1:])))
    with pytest.raises(Wrong, match="the forward alone"):
        nb10.check_step_flops(lambda b, s: 2 * b * sum(i * o for i, o in zip(s[:-1], s[1:])))


def test_dtensors_own_layout_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    assert not check("10.placements", lambda: nb10.check_placements(nb10.placements_rule))
    assert not check("10.local_shape", lambda: nb10.check_local_shape(nb10.local_shape_rule))
    assert capsys.readouterr().out.count("DTensor's own layout is the answer here") == 2


def test_the_rules_are_torchs():
    """local_shape_rule is DTensor's split, rank by rank (torch's fake process group: shapes real, no data moved), and
    step_flops_rule is FlopCounterMode's count of an MLP's training step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for mesh_shape, placements, shape in [((4,), [Shard(0)], (10, 6)), ((2, 3), [Shard(1), Shard(0)], (7, 5))]:
        world = math.prod(mesh_shape)
        for rank in range(world):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                mesh = init_device_mesh("cpu", mesh_shape)
                got = tuple(distribute_tensor(torch.zeros(shape), mesh, placements).to_local().shape)
                assert got == nb10.local_shape_rule(shape, mesh_shape, placements, tuple(mesh.get_coordinate()))
            finally:
                dist.destroy_process_group()

    from torch.utils.flop_counter import FlopCounterMode

    sizes, batch = [20, 12, 7, 3], 5
    layers = [torch.nn.Linear(i, o) for i, o in zip(sizes[:-1], sizes[1:])]
    with FlopCounterMode(display=False) as fc:
        torch.nn.Sequential(*layers)(torch.randn(batch, sizes[0])).sum().backward()
    assert fc.get_total_flops() == nb10.step_flops_rule(batch, sizes)
