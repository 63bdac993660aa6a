"""labkit.checkpoint.staging on the CPU: the mirror a manager's sharded saves stage into (refilled, not reallocated,
DTensors kept DTensors, nothing pinned without CUDA) and the stacked NaN check. The CUDA half (pinned host
tensors, non_blocking copies, one synchronize) runs in bench/bench_stage.py on a GPU."""

from __future__ import annotations

import socket

import pytest
import torch

from labkit.checkpoint.staging import CpuMirror, first_nonfinite
from labkit.checkpoint.together import _stager


def _state(scale=1.0):
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 3, generator=g) * scale, "b": torch.zeros(3)},
        "optimizer": {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(4, 3)}}, "lrs": [0.1, 0.2]},
        "step": 7,
        "name": "run",
        "rows": torch.arange(5),
    }


def test_the_mirror_is_refilled_not_reallocated_and_later_steps_cannot_change_it():
    state, mirror = _state(), CpuMirror()
    first = mirror.stage(state)
    assert mirror.allocations == 5 and first["step"] == 7 and first["optimizer"]["lrs"] == [0.1, 0.2]
    assert torch.equal(first["model"]["w"], state["model"]["w"]) and torch.equal(first["rows"], state["rows"])
    assert first["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()  # a copy, not the live tensor
    assert not first["model"]["w"].is_pinned()  # no CUDA: nothing to pin
    w_ptr = first["model"]["w"].data_ptr()
    state["model"]["w"].mul_(3)  # a training step after the save began: the staged copy keeps the old values
    assert not torch.equal(first["model"]["w"], state["model"]["w"])
    second = mirror.stage(state)  # the next save: the same host tensors, refilled
    assert mirror.allocations == 5 and second["model"]["w"].data_ptr() == w_ptr
    assert torch.equal(second["model"]["w"], state["model"]["w"])
    state["model"]["w"] = torch.zeros(2, 3)  # another shape: a new tensor for that one only
    assert torch.equal(mirror.stage(state)["model"]["w"], torch.zeros(2, 3)) and mirror.allocations == 6


def test_the_nan_check_names_the_first_nonfinite_tensor():
    state = _state()
    assert first_nonfinite(state) is None
    state["optimizer"]["state"][0]["exp_avg"][1, 2] = float("inf")
    state["model"]["b"][0] = float("nan")
    assert first_nonfinite(state) == "model.b"  # the first in the state's order
    state["model"]["b"][0] = 0.0
    assert first_nonfinite(state) == "optimizer.state.0.exp_avg"
    assert first_nonfinite({"ids": torch.arange(3), "empty": torch.empty(0)}) is None  # integers, nothing to read


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dtensor_stays_a_dtensor_through_the_stager(one_process_group):
    """DCP's stager (labkit.checkpoint.together._stager) around the mirror: a DTensor's local shard is copied into
    the mirror, its mesh and placements kept, and the second save refills the same host tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    w = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    mirror = CpuMirror()
    stager = _stager(mirror)
    staged = stager.stage({"w": w, "step": 1})
    assert type(staged["w"]).__name__ == "DTensor" and staged["w"].placements == (Shard(0),)
    assert torch.equal(staged["w"].to_local(), w.to_local()) and staged["w"].to_local().data_ptr() != (
        w.to_local().data_ptr()
    )
    ptr = staged["w"].to_local().data_ptr()
    w.to_local().add_(1)
    again = stager.stage({"w": w, "step": 2})
    assert again["w"].to_local().data_ptr() == ptr and torch.equal(again["w"].to_local(), w.to_local())
    assert mirror.allocations == 1 and first_nonfinite({"w": w}) is None


def test_the_mirror_holds_one_copy_of_the_state_and_close_frees_it(monkeypatch, tmp_path):
    """nbytes is the state's tensor bytes, once; a tensor whose shape changed gives its old host tensor up before
    the new one is made (never two copies of it at once); the manager's close() frees the mirror."""
    from labkit.checkpoint import CheckpointManager

    state, mirror = _state(), CpuMirror()
    size = 4 * (12 + 3 + 1 + 12) + 8 * 5  # float32 w, b, step, exp_avg; int64 rows
    mirror.stage(state)
    assert mirror.nbytes == size
    held_at_alloc, empty_like = [], torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: held_at_alloc.append(mirror.nbytes) or empty_like(*a, **k))
    state["model"]["w"] = torch.randn(8, 3)  # 96 bytes where there were 48
    mirror.stage(state)
    assert held_at_alloc == [size - 48] and mirror.nbytes == size + 48, held_at_alloc
    ck = CheckpointManager(str(tmp_path / "ck"), rt=None, format="sharded", async_save=False)
    fmt = ck.formats["sharded"]
    fmt.mirror.stage(state)
    ck.close()
    assert getattr(fmt, "_mirror", None) is None
