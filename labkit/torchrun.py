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
import socket

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


def _interface_address(name: str) -> str | None:
    """The IPv4 address of network interface `name` (Linux: ioctl SIOCGIFADDR), None when it has none."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def gloo_address(env=None) -> tuple[str | None, str]:
    """(the address gloo binds to, how it was picked): GLOO_SOCKET_IFNAME's interface where set (its first name),
    else the first address this host's name resolves to, IPv6 included (getaddrinfo with AF_UNSPEC), as gloo's own
    device resolves it (torch.distributed's gloo backend)."""
    env = os.environ if env is None else env
    ifname = (env.get("GLOO_SOCKET_IFNAME") or "").split(",")[0].strip()
    if ifname:
        return _interface_address(ifname), f"GLOO_SOCKET_IFNAME={ifname}"
    host = socket.gethostname()
    try:
        return socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][4][0], f"the host name {host!r}"
    except (OSError, IndexError):
        return None, f"the host name {host!r}"


def gloo_reach_warnings(env=None, timeout_s: float = 3.0) -> list[str]:
    """torchrun over several hosts (WORLD_SIZE > LOCAL_WORLD_SIZE): whether a TCP connection from the address gloo
    picks reaches MASTER_ADDR:MASTER_PORT (the rendezvous, which listens there while the job runs). A host whose name
    resolves to a loopback address (127.x, ::1), or a wrong interface, fails here, before a collective waits its
    timeout out. labkit.setup() runs it once per host (local rank 0) on such runs; labkit.doctor() too."""
    import ipaddress

    env = os.environ if env is None else env
    try:
        world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    except ValueError:
        return []
    if world <= local:
        return []
    addr, how = gloo_address(env)
    fix = (
        "set GLOO_SOCKET_IFNAME to the interface the hosts share (the one whose address the others reach, e.g. "
        f"eth0; this host has {', '.join(n for _, n in socket.if_nameindex())})"
    )
    if addr is None:
        kind = "IPv4 address" if how.startswith("GLOO_SOCKET_IFNAME") else "address"
        return [f"torchrun over {world // local} hosts: gloo finds no {kind} from {how}: {fix}"]
    master, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not master or not port:
        return []
    loop = ipaddress.ip_address(addr.split("%")[0]).is_loopback

    def local_name(name):
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return name == "localhost"

    if loop and not local_name(master):
        return [
            f"torchrun over {world // local} hosts: gloo would use {addr} (from {how}), a loopback address the "
            f"other hosts cannot reach: {fix}"
        ]
    try:
        with socket.create_connection((master, int(port)), timeout=timeout_s, source_address=(addr, 0)):
            pass
    except OSError as e:
        return [
            f"torchrun over {world // local} hosts: from {addr} (gloo's address, from {how}) the rendezvous "
            f"{master}:{port} does not answer ({type(e).__name__}: {e}): gloo's side groups (the step vote, the "
            f"lockstep evaluation, checkpoints) would wait their timeout out. {fix[0].upper() + fix[1:]}"
        ]
    return []


def _check_gloo_reach() -> None:
    """Once per run and host (labkit.setup(), local rank 0), on torchrun over several hosts: gloo_reach_warnings,
    printed. The cost: one TCP connection to the rendezvous (a network round trip; 3 s at most where nothing
    answers)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    for line in gloo_reach_warnings():
        print(f"[labkit] {line}", flush=True)


def setup_cpu() -> Runtime:
    """Plain PyTorch on the CPU; under torchrun one process per rank, joined over gloo (the CPU
    collective backend), over which DDP or FSDP2 (labkit.parallel) reduce gradients."""
    import torch.distributed as dist

    world = torchrun_world()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout())  # torchrun sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
        _check_gloo_reach()
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
        _check_gloo_reach()  # the side groups are gloo's, under NCCL too
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
