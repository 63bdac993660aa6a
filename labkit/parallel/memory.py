"""The memory a plan is chosen for: what one process may use (device_memory), agreed by every process, and what a
float32 weight costs in training (STATE_BYTES_PER_WEIGHT).

    budget = device_memory(rt)     # bytes: LABKIT_MEMORY_MB, else the device's, else the host's RAM share; torchrun: the min
"""

from __future__ import annotations

import os

import torch

from labkit.parallel.plans import PlanError
from labkit.torchrun import active

STATE_BYTES_PER_WEIGHT = 16  # float32 weight 4 + gradient 4 + AdamW's two moments 8 (labkit.spmd.comm.fits)


def device_memory(rt) -> int | None:
    """Bytes one process may plan for: LABKIT_MEMORY_MB where set (a budget of your own: what "auto" plans for, e.g.
    to try on the CPU what a smaller device would force), else the accelerator's memory, or on the CPU the host's RAM
    shared by its processes. Under torchrun, the smallest of every process's figure (None where none knows its own):
    the plan and the accumulation mode are decisions every process must take alike, and two hosts can differ (their
    RAM, their LABKIT_MEMORY_MB, another job on one GPU). Every process calls it at the same point: one
    all_gather_object of an int on the default group, once per decision."""
    mine = own_memory(rt)
    import torch.distributed as dist

    if not active(rt):
        return mine
    every = [None] * rt.world_size
    dist.all_gather_object(every, mine)
    known = [m for m in every if m is not None]
    return min(known) if known else None


def own_memory(rt) -> int | None:
    """This process's own figure for device_memory, asked of no other process."""
    raw = os.environ.get("LABKIT_MEMORY_MB", "").strip()
    if raw:
        try:
            mb = float(raw)
            if not mb > 0:
                raise ValueError
        except ValueError:
            raise PlanError(f"LABKIT_MEMORY_MB={raw!r}: expected a number of megabytes > 0") from None
        return int(mb * 2**20)
    mem = rt.memory() or {}
    if mem.get("limit"):
        return int(mem["limit"])
    if rt.device.type == "cuda":
        return int(torch.cuda.get_device_properties(rt.device).total_memory)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return ram // max(1, local)
