"""torchrun's world: one process per GPU (nccl) or per CPU rank (gloo), as labkit.setup() builds it.

    torchrun --nproc_per_node=2 -m labkit.train gpt --steps 20    # labkit.setup() picks cpu + gloo here

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every process it starts;
torch.distributed reads them in init_process_group. How the Trainer then lays the model out over the processes
(DDP, FSDP2) is the run's plan: labkit.parallel (TrainConfig.parallel).

Every wait on another process has a timeout that names what it waited for: the default group's and every side gloo
group's (side_group: the step vote, the evaluation's lockstep, a checkpoint's agreements) is LABKIT_DIST_TIMEOUT_S
(timeout()); a wait for another process's data preparation goes through the store (wait_for_all), an hour at most.
"""

from __future__ import annotations

import datetime
import os

import torch

from labkit.runtime import BackendError, Runtime


def torchrun_world() -> int:
    """WORLD_SIZE as torchrun (torch.distributed.run) sets it in every process it launches; 1 without it."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise BackendError(f"environment variable WORLD_SIZE={raw!r} is not an integer (torchrun sets it)") from None


def timeout(default_s: float = 600) -> datetime.timedelta:
    """How long a collective may wait for the other processes before it fails (naming itself) instead of hanging:
    LABKIT_DIST_TIMEOUT_S seconds, else `default_s` (600: NCCL's own default; gloo's is 30 minutes). The default group
    and every side group (side_group) get it; the checkpoint's group defaults to an hour (a slow upload is waited
    for there), and LABKIT_DIST_TIMEOUT_S, where set, is its timeout too."""
    raw = os.environ.get("LABKIT_DIST_TIMEOUT_S", "").strip() or str(default_s)
    try:
        seconds = float(raw)
        if seconds <= 0:
            raise ValueError
    except ValueError:
        raise BackendError(f"LABKIT_DIST_TIMEOUT_S={raw!r}: expected a number of seconds > 0") from None
    return datetime.timedelta(seconds=seconds)


def side_group(default_s: float = 600):
    """A new gloo group over every process, for small CPU agreements beside the training's collectives (the step
    vote, the evaluation's lockstep, a checkpoint's agreements), with timeout(default_s): without it gloo waits 30
    minutes. A collective itself: every process makes it at the same point."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timeout(default_s))


def wait_for_all(rt, tag: str, what: str, timeout_s: float = 3600) -> None:
    """A barrier through the store torch.distributed's processes share (the TCP store of torchrun's rendezvous), not
    a collective: while one process prepares data the others need (downloads, writes shards), an NCCL barrier would
    end the job after its 600 s watchdog. Every process calls it with the same tag, in the same order; TimeoutError
    naming `what` after timeout_s. One process, or XLA's replicas: rt.rendezvous(tag)."""
    import torch.distributed as dist

    if rt.world_size <= 1 or not rt.uses_ddp or not (dist.is_available() and dist.is_initialized()):
        rt.rendezvous(tag)
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"labkit/{tag}/{int(store.add(f'labkit/{tag}/round/{rt.ordinal}', 1))}"  # a tag used again: a new key
    if store.add(f"{key}/arrived", 1) == rt.world_size:
        store.set(f"{key}/all", b"1")
    try:
        store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # the store's timeout (or its host gone)
        arrived = int(store.add(f"{key}/arrived", 0))
        raise TimeoutError(
            f"{what}: process {rt.ordinal} of {rt.world_size} waited {timeout_s:g} s for the others ({arrived} of "
            f"{rt.world_size} arrived at {tag!r}; {type(e).__name__}: {e})"
        ) from e


def setup_cpu() -> Runtime:
    """Plain PyTorch on the CPU; under torchrun one process per rank, joined over gloo (the CPU
    collective backend), over which DDP or FSDP2 (labkit.parallel) reduce gradients."""
    import torch.distributed as dist

    world = torchrun_world()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout())  # torchrun sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return Runtime("cpu", torch.device("cpu"), world, rank, local, 1, False, {"dist": "gloo" if world > 1 else None})


def setup_cuda() -> Runtime:
    """CUDA (torch's own backend); under torchrun one process per GPU, joined over nccl."""
    import torch.distributed as dist

    world = torchrun_world()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    # the device first: NCCL's communicator is made for the current device, and device_id= binds the group to it
    # at once (without it, a first collective before set_device talks from GPU 0 on every process)
    torch.cuda.set_device(local)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl", timeout=timeout(), device_id=torch.device("cuda", local))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Runtime(
        "cuda",
        torch.device("cuda", local),
        world,
        rank,
        local,
        torch.cuda.device_count(),
        False,
        {"name": torch.cuda.get_device_name(local)},
    )
