"""What the processes of one torchrun job do together for a checkpoint: a process group of its own, agreements.

    group = checkpoint_group()                    # every process, at the same point: gloo, a long timeout
    agree(rt, err, "saving gs://b/run/step-00000100", value, group)   # raises on every process if any failed
    bad = verdict(rt, err, "restoring ...", group)                  # one restore outcome for every process
    staged = _stager(mirror).stage(state)         # into a labkit.checkpoint.staging.CpuMirror: what async_save
                                                  # writes, which later steps cannot change

Used by labkit.checkpoint.dcp (the sharded format's save under torchrun) and CheckpointManager (its restore). Each
agreement is one all_gather_object of a few hundred bytes on a gloo group: a loopback round trip on one host, a
network round trip between hosts.
"""

from __future__ import annotations

from labkit.checkpoint.state import ReadFailed


def checkpoint_group():
    """The checkpoint's own process group: gloo (the CPU, whatever the training's backend), a new group over every
    process (a collective: every process calls it at the same point, once per manager). Its own group, not the
    default one: a save finishing in the background thread issues collectives while the training thread issues the
    model's, and two threads must never interleave collectives on one group (each process would pair them
    differently). Its timeout is its own too, LABKIT_CKPT_TIMEOUT_S (an hour unless set:
    labkit.torchrun.checkpoint_timeout), long enough for the slowest process to upload its shards while the others
    wait in agree(); NCCL's default group would trip its 10-minute watchdog there."""
    from labkit.torchrun import checkpoint_timeout, side_group

    return side_group(wait=checkpoint_timeout())


def _stager(mirror):
    """DCP's AsyncStager protocol around `mirror` (labkit.checkpoint.staging.CpuMirror: the manager's host tensors,
    refilled at each save): the copy is done before async_save returns."""
    from torch.distributed.checkpoint.staging import AsyncStager

    class CopyToCPU(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return mirror.stage(state_dict)

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return CopyToCPU()


def agree(rt, error, what: str, value=None, group=None) -> list:
    """Every process tells the others how its part went (one all_gather_object on `group`): its own error is raised
    again, a failure elsewhere raises RuntimeError naming the process; else the list of every process's `value`.
    A process that never arrives (killed, hung) fails it after the group's timeout, naming `what`."""
    import torch.distributed as dist

    mine = None if error is None else f"{type(error).__name__}: {error}"
    everyone = [None] * rt.world_size
    try:
        dist.all_gather_object(everyone, (mine, value), group=group)
    except Exception as e:  # gloo's timeout or a peer that died: say what was waited for
        raise RuntimeError(
            f"{what}: waiting for the other {rt.world_size - 1} processes failed ({type(e).__name__}: {e})"
        ) from error or e
    if error is not None:
        raise error
    failed = [(r, m) for r, (m, _) in enumerate(everyone) if m is not None]
    if failed:
        r, m = failed[0]
        raise RuntimeError(f"{what} failed on process {r} of {rt.world_size} ({m}); nothing was committed")
    return [v for _, v in everyone]


def verdict(rt, error, what: str, group=None):
    """The ranks' outcomes of one restore attempt, made one decision (one all_gather_object): None when every
    process loaded; else the error every process raises alike: ReadFailed when any process could not reach the store
    (stop: an older step would undo progress), OSError when any found a file damaged (every process falls back to
    the same older step), else the first failure. Each names the process and its file."""
    import torch.distributed as dist

    from labkit.checkpoint.safe_load import CheckpointRefused

    kind = None
    if isinstance(error, ReadFailed):
        kind = "unreachable"
    elif isinstance(error, (OSError, CheckpointRefused)):
        kind = "damaged"
    elif error is not None:
        kind = "other"
    everyone = [None] * rt.world_size
    mine = None if error is None else (kind, f"{type(error).__name__}: {error}")
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except Exception as e:
        raise RuntimeError(f"{what}: waiting for the other processes failed ({type(e).__name__}: {e})") from e
    if kind == "other" and not any(v is not None and v[0] != "other" for v in everyone):
        return error  # this process's own (a state that does not fit: shapes, keys): its type and text, unchanged
    for want, cls in (("unreachable", ReadFailed), ("damaged", OSError), ("other", RuntimeError)):
        for r, v in enumerate(everyone):
            if v is not None and v[0] == want:  # the same message on every process: one warning, one decision
                return cls(f"{what}: on process {r} of {rt.world_size}: {v[1]}")
    return None
