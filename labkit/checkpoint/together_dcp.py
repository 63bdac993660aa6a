"""The sharded format's save under torchrun, every process writing its own shards: begin_together on the
training thread, finish_together in the writer's thread. A part of labkit.checkpoint.dcp's Sharded, in a file of
its own so that each reads in one sitting.

    pending = fmt.begin_together(step, state, rt, group, replace, background=True)   # returns once staged
    info = fmt.finish_together(pending, rt, group)                                    # stored, seen by all
"""

from __future__ import annotations

import os
import shutil

from labkit.checkpoint.staging import CpuMirror, first_nonfinite
from labkit.checkpoint.together import _stager, agree
from labkit.checkpoint.writer import no_space
from labkit.cloud import gcs


def _first_nonfinite(state) -> str | None:
    """The path of the first floating-point tensor holding NaN/inf among this process's shards (a DTensor's local
    part: no collective), else None: one stacked read per device (labkit.checkpoint.staging)."""
    return first_nonfinite(state)


def _as_staged():
    """DCP's AsyncStager protocol for a state staged already (begin_together copies it before its agreement)."""
    from torch.distributed.checkpoint.staging import AsyncStager

    class Staged(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return state_dict

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return Staged()


def folder_name(step: int) -> str:
    return f"step-{int(step):08d}"


class ShardedTogether:
    """Sharded's methods for several processes (self is the format: its store, listing, _url and _remove)."""

    @property
    def mirror(self) -> CpuMirror:
        """The host tensors this format's background saves stage into: one per format, so one per manager, reused
        from save to save (the manager waits for the previous save before it stages the next)."""
        if getattr(self, "_mirror", None) is None:
            self._mirror = CpuMirror()
        return self._mirror

    def release_mirror(self) -> None:
        """Free the mirror's host tensors (the manager's close(): no save is in flight any more)."""
        self._mirror = None

    def begin_together(self, step, state, rt, group, replace, background: bool) -> dict:
        """Every process, on the training thread: the NaN check, the old step's removal (process 0, after the
        manager allowed it), one agreement; then DCP's save of this process's shards into a temp folder of its own
        (process 0 adds `.metadata`, which names every file), on `group`. background=True: the shards first copied
        to the CPU here (into the format's CpuMirror, labkit.checkpoint.staging: once each, into host tensors kept
        from the last save, DTensors kept DTensors), on every process before the agreement, so that a copy failing on
        one process fails the save on all at once; then DCP's async_save, which returns while a thread of DCP's
        writes them: the training's next steps cannot change what is saved.
        The cost on this thread: that copy; in host memory, this process's shards again until the save ends.
        finish_together ends it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner

        name, err = folder_name(step), None
        bad = _first_nonfinite(state)
        if bad is not None:
            err = FloatingPointError(
                f"not saving step {step} to {self._url(name)}: {bad} holds NaN or inf on process {rt.ordinal} (the "
                "weights went non-finite since the loss was last read); the last good checkpoint stays the newest"
            )
        if rt.is_master and err is None:
            try:
                old = self.listing().get(step)
                if old:  # our own earlier save of this step, or one a killed writer left (the manager decides)
                    replace()
                    self._remove(step, old)
            except BaseException as e:
                err = e
        staged = state
        if background and err is None:  # the copy first, on every process, and agreed below: a copy that fails on
            try:  # one process inside async_save would leave the others in DCP's plan gather until the timeout
                stager = _stager(self.mirror)
                staged = stager.stage(state)
                stager.synchronize_staging()
            except Exception as e:
                err = no_space(e, self.store) or e
        agree(rt, err, f"saving {self._url(name)}", group=group)
        folder = self.store.temp_dir(f"{name}-p{rt.ordinal}")
        writer = dcp.FileSystemWriter(folder)
        try:
            if background:
                future = dcp.async_save(
                    staged,
                    storage_writer=writer,
                    planner=DefaultSavePlanner(),
                    process_group=group,
                    async_stager=_as_staged(),
                )
            else:
                future = None
                dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(), process_group=group)
        except BaseException as e:  # DCP's CheckpointException is a BaseException; it failed on every process
            shutil.rmtree(folder, ignore_errors=True)
            raise (no_space(e, self.store) or e) from e
        return {"step": step, "folder": folder, "future": future}

    def finish_together(self, pending, rt, group) -> dict:
        """Every process, in the manager's writer thread (or the training thread, not in the background): the end of
        DCP's save, then each process stores its files create-only with their crc32c, then each lists the step's
        folder and says which files it sees. The processes agree after each part (agree): a failure or a NaN on any
        of them fails the save on all, before the commit; a file some process does not see means a root that is not
        shared (a local folder on each host), refused by name, as no host could restore from it. Returns (on every
        process) {"files": every process's files and crc32c, "planner": "default", "processes": n}."""
        step, folder = pending["step"], pending["folder"]
        name = folder_name(step)
        try:
            err = None
            try:
                if pending["future"] is not None:
                    pending["future"].result()  # DCP's own collectives ran on `group` in its thread
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                err = no_space(e, self.store) or e
            agree(rt, err, f"saving {self._url(name)}", group=group)
            files, err = {}, None
            try:
                for f in sorted(os.listdir(folder)):
                    p = os.path.join(folder, f)
                    crc = gcs.crc32c_b64(p)
                    files[f] = {"crc32c": crc, "size": os.path.getsize(p)}
                    self.store.put_if_absent(f"{name}/{f}", p, crc)
            except BaseException as e:
                err = e
            parts = agree(rt, err, f"saving {self._url(name)}", files, group=group)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        merged = {}
        for part in parts:
            merged.update(part)
        err = None
        try:  # one listing per process: the store's, not a file read
            missing = sorted(set(merged) - self.listing().get(step, set()))
            if missing:
                err = FileNotFoundError(
                    f"{self._url(name)} lacks {', '.join(missing)} here (written by other processes): the checkpoint "
                    "root must be one place every host sees (gs://, or a shared filesystem); a local folder on each "
                    "host holds only that host's shards, and no host could restore from it"
                )
        except BaseException as e:
            err = e
        agree(rt, err, f"saving {self._url(name)}", group=group)
        return {"files": merged, "planner": "default", "processes": rt.world_size}
