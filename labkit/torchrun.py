"""torchrun's world: one process per GPU (nccl) or per CPU rank (gloo), as labkit.setup() builds it.

    torchrun --nproc_per_node=2 -m labkit.train gpt --steps 20    # labkit.setup() picks cpu + gloo here

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in every process it starts;
torch.distributed reads them in init_process_group. How the Trainer then lays the model out over the processes
(DDP, FSDP2) is the run's plan: labkit.parallel (TrainConfig.parallel).

Every wait on another process has a timeout that names what it waited for, each by its purpose: the default group's
and the small side groups' (side_group: the step vote, the evaluation's lockstep) is LABKIT_DIST_TIMEOUT_S (timeout(),
600 s: short, to catch a hang); the checkpoint group's is LABKIT_CKPT_TIMEOUT_S (an hour: a slow process's upload is
waited for there, so shortening the first does not fail every slow save); a wait for another process's data
preparation goes through the store (wait_for_all), an hour at most.

`active(rt)` is the one test of "several torch.distributed processes run together" that every collective labkit
issues first asks.
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


def active(rt) -> bool:
    """Whether this process is one of several torch.distributed processes that run together (torchrun's, joined by
    labkit.setup()): what every collective labkit issues asks first. False with one process, and for XLA's replicas
    (their collectives are XLA's, not torch.distributed's)."""
    import torch.distributed as dist

    return bool(rt is not None and rt.world_size > 1 and rt.uses_ddp and dist.is_available() and dist.is_initialized())


def timeout(default_s: float = 600, env: str = "LABKIT_DIST_TIMEOUT_S") -> datetime.timedelta:
    """How long a collective may wait for the other processes before it fails (naming itself) instead of hanging:
    the variable `env` in seconds, else `default_s`. LABKIT_DIST_TIMEOUT_S (600: NCCL's own default; gloo's is 30
    minutes) for the default group and the small side groups; LABKIT_CKPT_TIMEOUT_S for the checkpoint's group
    (checkpoint_timeout)."""
    raw = os.environ.get(env, "").strip() or str(default_s)
    try:
        seconds = float(raw)
        if seconds <= 0:
            raise ValueError
    except ValueError:
        raise BackendError(f"{env}={raw!r}: expected a number of seconds > 0") from None
    return datetime.timedelta(seconds=seconds)


CHECKPOINT_TIMEOUT_S = 3600  # an hour: the slowest process's upload of its shards is waited for


def checkpoint_timeout() -> datetime.timedelta:
    """The checkpoint group's timeout: LABKIT_CKPT_TIMEOUT_S, else an hour. Its own setting, so that a short
    LABKIT_DIST_TIMEOUT_S (to catch a hang in training within a minute) does not fail every save slower than that."""
    return timeout(CHECKPOINT_TIMEOUT_S, "LABKIT_CKPT_TIMEOUT_S")


def side_group(default_s: float = 600, wait: datetime.timedelta | None = None):
    """A new gloo group over every process, for small CPU agreements beside the training's collectives (the step
    vote, the evaluation's lockstep, a checkpoint's agreements), with timeout(default_s), or `wait` where given
    (checkpoint_timeout()): without it gloo waits 30 minutes. A collective itself: every process makes it at the
    same point."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=wait if wait is not None else timeout(default_s))


def wait_for_all(rt, tag: str, what: str, timeout_s: float = 3600) -> None:
    """A barrier through the store torch.distributed's processes share (the TCP store of torchrun's rendezvous), not
    a collective: while one process prepares data the others need (downloads, writes shards), an NCCL barrier would
    end the job after its 600 s watchdog. Every process calls it with the same tag, in the same order; TimeoutError
    naming `what` after timeout_s. One process, or XLA's replicas: rt.rendezvous(tag)."""
    import torch.distributed as dist

    if not active(rt):
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
