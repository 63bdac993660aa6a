"""Which plan a run gets: TrainConfig.parallel checked, "auto" decided by what fits.

plan = choose(rt, "auto", precision, model, accumulate="auto", accum_steps=1)
"""

from __future__ import annotations

from labkit.config import PARALLEL as PLANS
from labkit.parallel.fsdp import FullyShard, hosts
from labkit.parallel.memory import STATE_BYTES_PER_WEIGHT, device_memory
from labkit.parallel.plans import PlanError, Replicate, Single
from labkit.spmd.comm import fits


def auto_plan(params: int, memory: int | None, devices: int, hosts: int = 1) -> str:
    """ "replicate" when a whole copy's weights, gradients and AdamW state fit half of `memory`; else, on several
    hosts, "hsdp" when a host's share (sharded over its processes only) fits; else "fsdp2"."""
    if memory is None or fits(params, memory / 2, devices, "data", STATE_BYTES_PER_WEIGHT):
        return "replicate"
    if hosts > 1 and params * STATE_BYTES_PER_WEIGHT / (devices // hosts) <= memory / 2:
        return "hsdp"
    return "fsdp2"


def check_setting(setting, name: str = "TrainConfig.parallel") -> str:
    """`setting` when it names a plan; else PlanError naming where it came from (`name`: a flag, a variable)."""
    if setting not in PLANS:
        raise PlanError(f"{name}={setting!r}: expected one of {', '.join(PLANS)}")
    return setting


def choose(rt, setting: str = "auto", precision=None, model=None, accumulate="auto", accum_steps=1) -> Single:
    """The plan for TrainConfig.parallel on this runtime. Several torch.distributed processes (rt.uses_ddp and
    world_size > 1): "replicate", "fsdp2", or "auto" by what fits (model: to count its parameters). One process,
    XLA and SPMD: Single ("auto"); asking them for replicate or fsdp2 is refused by name."""
    check_setting(setting)
    torchrun = rt.uses_ddp and rt.world_size > 1
    if not torchrun:
        if setting != "auto":
            where = f"world size {rt.world_size}" if rt.uses_ddp else f"the {rt.kind} runtime (spmd={rt.spmd})"
            raise PlanError(
                f"TrainConfig.parallel={setting!r} needs torchrun with 2 or more processes of torch.distributed "
                f"(cpu/gloo or cuda/nccl); this run has {where}. Use parallel='auto' here, or launch with "
                "`torchrun --nproc-per-node N -m labkit.train ...`"
            )
        return Single(rt)
    if setting == "auto":
        params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        setting = auto_plan(params, device_memory(rt), rt.world_size, hosts(rt))
    if setting in ("fsdp2", "hsdp"):
        if precision is not None and precision.needs_scaler:
            raise PlanError(
                f"parallel={setting!r} with fp16: the GradScaler of labkit.precision does not handle sharded "
                "gradients; use bf16 (MixedPrecisionPolicy) or fp32 under FSDP2, or parallel='replicate'"
            )
        return FullyShard(rt, precision, accumulate, accum_steps, hsdp=setting == "hsdp")
    return Replicate(rt)
