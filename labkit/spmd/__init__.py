"""Every chip of the host in one process (SPMD): meshes, the batch plan, sharding specs, collectives read
from XLA's optimized HLO, and pictures of layouts. torch_xla-specific; the ideas map onto DTensor and JAX.

    rt = labkit.setup(spmd="auto")
    plan = labkit.spmd.batch_plan(rt, per_chip=32)
    mesh = labkit.spmd.make_mesh((2, 4), ("data", "model"))
    labkit.spmd.comm.step_comm("fsdp", params=1e9, devices=256, chip="v5e")  # bytes and seconds per step
"""

from labkit.spmd import comm, dtensor_plans, sharding
from labkit.spmd.mesh import (
    BatchPlan,
    addressable_devices,
    batch_plan,
    make_mesh,
    practice_choice,
    practice_devices,
    throughput,
    virtual_cpu_devices,
)
from labkit.spmd.view import draw_layouts

__all__ = [
    "BatchPlan",
    "addressable_devices",
    "batch_plan",
    "comm",
    "draw_layouts",
    "dtensor_plans",
    "make_mesh",
    "practice_choice",
    "practice_devices",
    "sharding",
    "throughput",
    "virtual_cpu_devices",
]
