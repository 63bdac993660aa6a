"""Every chip of the host in one process: SPMD switch, meshes and the data-parallel batch plan.

    rt = labkit.setup(spmd="auto")          # SPMD when this host has more than one XLA device
    plan = labkit.spmd.mesh.batch_plan(rt, per_chip=32)
    loader = make_loader(..., plan.host_batch, ...)   # the host feeds its chips' share; the
    # DeviceLoader shards dim 0 over the mesh's "data" axis (input_sharding), the model stays replicated

Why SPMD and not one process per chip: on a TPU VM or a Kaggle v5e-8 a notebook has already
initialised the runtime in its own process ("Runtime is already initialized" if it then spawns),
torch_xla's FSDPv2 is SPMD-only, and `xmp.spawn` cannot be mixed with it. Under SPMD the program is
written for ONE big device: tensors are logically global, `mark_sharding` says how each is laid out
over a `Mesh` of devices, and XLA's partitioner inserts the collectives (all-reduce of gradients for
data parallelism). On a CPU, `CPU_NUM_DEVICES=N` gives N virtual XLA devices to practise on.

torch_xla-specific: `xr.use_spmd`, `xs.Mesh`, `xs.mark_sharding`. What carries over: the mesh and the
placement vocabulary (Shard(dim) / Replicate() over named axes) are the same ideas as plain PyTorch's
`torch.distributed.device_mesh.init_device_mesh` + DTensor, and JAX's `Mesh` + `PartitionSpec`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from labkit import envsetup
from labkit.config import check_number
from labkit.device import addressable_devices  # noqa: F401  (re-exported: labkit.spmd.addressable_devices)


def make_mesh(shape: tuple[int, ...] | None = None, axis_names: tuple[str, ...] = ("data",)):
    """A torch_xla Mesh over all global devices. shape=None: 1-D over every device; one entry may
    be -1 (the rest). Device ids are in order, so axis k's neighbours are adjacent ids (on a TPU the
    physical ring order comes from the runtime's device ids)."""
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = int(xr.global_runtime_device_count())
    shape = (n,) if shape is None else tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one -1")
    if -1 in shape:
        rest = int(np.prod([s for s in shape if s != -1]))
        if rest <= 0 or n % rest:
            raise ValueError(f"mesh shape {shape} does not divide {n} devices")
        shape = tuple(n // rest if s == -1 else s for s in shape)
    if int(np.prod(shape)) != n:
        raise ValueError(f"mesh shape {shape} holds {int(np.prod(shape))} devices, but there are {n}")
    if len(shape) != len(axis_names):
        raise ValueError(f"mesh shape {shape} and axis names {axis_names} differ in length")
    return xs.Mesh(np.arange(n), shape, axis_names)


@dataclass(frozen=True)
class BatchPlan:
    """How one step's batch is split. per_chip is the notebook's batch_size parameter."""

    per_chip: int
    chips: int  # devices this host's batch is sharded over (1 without SPMD)
    hosts: int  # processes feeding data (TPU pod hosts, torchrun ranks)
    spmd: bool

    @property
    def host_batch(self) -> int:
        """What this process's loader yields per step."""
        return self.per_chip * (self.chips if self.spmd else 1)

    @property
    def global_batch(self) -> int:
        """Samples in one optimizer step, over every chip of every host."""
        return self.host_batch * self.hosts

    @property
    def total_chips(self) -> int:
        return self.chips * self.hosts if self.spmd else self.hosts

    def describe(self) -> str:
        how = f"SPMD over {self.chips} device(s) per host" if self.spmd else "one device per process"
        return (
            f"batch {self.per_chip} per chip x {self.total_chips} chip(s) = {self.global_batch} per step "
            f"({how}, {self.hosts} host process(es), {self.host_batch} loaded per host)"
        )


def batch_plan(rt, per_chip: int) -> BatchPlan:
    """The batch plan for a Runtime: under SPMD one process feeds all of its addressable devices."""
    check_number("batch_plan: batch size per chip", per_chip, low=1, integer=True)
    chips = rt.devices_per_process()  # labkit.runtime: every addressable device under SPMD, else 1
    # rt.spmd is read as data here (the plan describes how it was made), not to choose what to run
    return BatchPlan(per_chip=per_chip, chips=chips, hosts=max(1, rt.world_size), spmd=bool(rt.spmd))


def throughput(rate_total: float, plan: BatchPlan) -> dict:
    """A measured rate (examples or tokens per second, all chips) as total and per chip."""
    return {"total": rate_total, "per_chip": rate_total / max(1, plan.total_chips)}


def virtual_cpu_devices(n: int, *, even_on_tpu: bool = False) -> bool:
    """Ask XLA:CPU for n virtual devices. Must run before torch_xla starts its runtime; returns False
    (and changes nothing) when CPU_NUM_DEVICES is already set, or on a TPU host unless even_on_tpu."""
    if (envsetup.detect_tpu() and not even_on_tpu) or "CPU_NUM_DEVICES" in os.environ:
        return False
    os.environ["CPU_NUM_DEVICES"] = str(int(n))
    return True


def practice_choice(need: int, tpu_chips: int, started_on_tpu: bool) -> str:
    """Where a lesson that needs `need` devices runs: "tpu" (the host's chips are enough), "cpu" (virtual
    XLA:CPU devices: no TPU, or fewer chips than the lesson needs, e.g. Colab's one-chip v5e-1), or
    "restart" (too few chips and torch_xla has already been imported for the TPU: a process cannot switch its
    PJRT device, so only a fresh kernel can practise on the CPU). Pure: the tests call it with a
    simulated host."""
    if tpu_chips >= need:
        return "tpu"
    if tpu_chips and started_on_tpu:
        return "restart"
    return "cpu"


def practice_devices(n: int = 8, dump_dir: str | None = None, need: int = 2) -> str:
    """Call before torch_xla starts. Where the host has at least `need` TPU chips: SPMD over them. Else
    (no TPU, a GPU host: torch_xla 2.9 has no GPU backend; or a TPU host with fewer chips than the lesson
    needs, like Colab's one-chip v5e-1) n virtual XLA:CPU devices (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=n).
    Anywhere: XLA's optimized HLO dumped as text to dump_dir (XLA_FLAGS), where the collectives the
    partitioner inserted can be read. Returns what it did, in words (print it: it is the lesson's record
    of where it ran)."""
    import sys

    tpu = envsetup.detect_tpu()
    started = "torch_xla" in sys.modules
    on_cpu = os.environ.get("PJRT_DEVICE", "").upper() == "CPU"
    choice = practice_choice(need, tpu.chips, started and not on_cpu)
    if choice == "restart":
        return (
            f"this TPU host has {tpu.chips} chip(s), fewer than the {need} this lesson needs, and torch_xla has "
            f"already started on the TPU: restart the runtime (kernel) and run the parameters cell first; it then "
            f"practises on {n} virtual XLA:CPU devices"
        )
    if started:
        return "torch_xla already imported: devices and XLA_FLAGS left as they are (restart the kernel to change them)"
    # torch_xla 2.9's XLA logs "GSPMD sharding propagation is going to be deprecated ... migrate to Shardy" (a C++ WARNING,
    # sharding_propagation.cc) once per partitioned compile: dozens of identical lines that bury the lesson's
    # output. Python's warnings filters cannot reach XLA's C++ log; its level can, and only before torch_xla
    # starts. Level 2 keeps XLA's errors and drops its warnings and info (torch_xla's default is 1). A value
    # the user set is kept. labkit's own messages are Python prints and are not affected.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    said = []
    if choice == "tpu":
        said.append(f"TPU host with {tpu.chips} chips: SPMD over its chips")
    else:
        os.environ["PJRT_DEVICE"] = "CPU"
        virtual_cpu_devices(n, even_on_tpu=True)
        why = (
            f"this TPU host has {tpu.chips} chip(s), fewer than the {need} this lesson needs, so it runs on the CPU"
            if tpu.chips
            else "no TPU"
        )
        said.append(f"{why}: {os.environ['CPU_NUM_DEVICES']} virtual XLA:CPU devices (PJRT_DEVICE=CPU)")
    said.append("XLA's C++ warnings hidden (TF_CPP_MIN_LOG_LEVEL=" + os.environ["TF_CPP_MIN_LOG_LEVEL"] + ")")
    if dump_dir:
        flags = f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
        if flags not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
        said.append(f"optimized HLO dumped to {dump_dir}")
    return "; ".join(said)
