"""The sharded checkpoint format: a DCP folder per step, committed by a COMMITTED marker.

`step-00001200/` holds torch.distributed.checkpoint's files (`__0_0.distcp`, `.metadata`, written with
torch_xla's SPMD planners, or DCP's default ones without torch_xla) and, written last and create-only,
`COMMITTED`: the step, the metrics, the best, the labkit that wrote it and the crc32c and size of every other
file. A folder without it is a save that did not finish. What each call does is the format interface of
labkit.checkpoint.formats; why the format is built this way is labkit.checkpoint.sharded's docstring.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import time
import warnings

from labkit.checkpoint import safe_load
from labkit.checkpoint.shards import _add_missing, _dtensor_split, _planner, _planner_kind, stage
from labkit.checkpoint.state import ReadFailed, _tensors
from labkit.checkpoint.state import read as read_checked
from labkit.checkpoint.writer import no_space
from labkit.cloud import gcs
from labkit.versions import __version__

MARKER = "COMMITTED"
_STEP = re.compile(r"^step-(\d{8,})$")
# one process and no process group is what this format means (no_dist=True); DCP warns on every call
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)


def agree(rt, error, what: str, value=None) -> list:
    """Every process tells the others how its part went (one all_gather_object): its own error is raised again, a
    failure elsewhere raises RuntimeError naming the process; else the list of every process's `value`."""
    import torch.distributed as dist

    mine = None if error is None else f"{type(error).__name__}: {error}"
    everyone = [None] * rt.world_size
    dist.all_gather_object(everyone, (mine, value))
    if error is not None:
        raise error
    failed = [(r, m) for r, (m, _) in enumerate(everyone) if m is not None]
    if failed:
        r, m = failed[0]
        raise RuntimeError(f"{what} failed on process {r} of {rt.world_size} ({m}); nothing was committed")
    return [v for _, v in everyone]


def _first_nonfinite(state) -> str | None:
    """The path of the first floating-point tensor holding NaN/inf among this process's shards (a DTensor's local
    part: no collective), else None."""
    for path, t in _tensors(state):
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and t.numel() and not bool(t.isfinite().all()):
            return path or "a tensor"
    return None


def folder_name(step: int) -> str:
    return f"step-{int(step):08d}"


class Sharded:
    kind = "sharded"
    restores_in_place = True  # restore(into=state) fills the live tensors, keeping their device and sharding

    def __init__(self, store):
        self.store = store

    def name(self, step: int) -> str:
        return folder_name(step)

    def _url(self, *parts) -> str:
        return self.store.url("/".join(parts))

    def listing(self) -> dict[int, set[str]]:
        """step -> the file names under its folder."""
        out: dict[int, set[str]] = {}
        for n in self.store.list("step-"):
            folder, _, name = n.partition("/")
            m = _STEP.match(folder)
            if m and name and "/" not in name:
                out.setdefault(int(m.group(1)), set()).add(name)
        return out

    def steps(self) -> dict[int, bool]:
        return {s: MARKER in names for s, names in self.listing().items()}

    def committed(self, step: int) -> bool:
        return MARKER in self.listing().get(step, ())

    def marker(self, step: int) -> dict:
        """The step's commit record; OSError naming it when it is unreadable (ReadFailed: the store was)."""
        try:
            rec = json.loads(read_checked(self.store, f"{folder_name(step)}/{MARKER}"))
            if isinstance(rec, dict) and rec.get("step") == step and isinstance(rec.get("files"), dict):
                return rec
            why = "not a commit record"
        except ReadFailed:
            raise  # unreachable is not uncommitted: an older step would quietly undo progress
        except Exception as e:  # deleted meanwhile, bad JSON
            why = f"{type(e).__name__}: {e}"
        raise OSError(
            f"{self._url(folder_name(step), MARKER)} is unreadable ({why}); treating step {step} as uncommitted"
        )

    def record(self) -> dict | None:
        """The commit record of the newest committed step whose marker reads."""
        for step in sorted((s for s, c in self.steps().items() if c), reverse=True):
            try:
                return self.marker(step)
            except ReadFailed:
                raise
            except OSError as e:
                warnings.warn(str(e), stacklevel=3)
        return None

    @staticmethod
    def together(rt) -> bool:
        """Several torch.distributed processes, each holding its own shards (FSDP2 under torchrun): every process
        writes its files (upload_together), not one host."""
        import torch.distributed as dist

        return rt is not None and rt.world_size > 1 and rt.uses_ddp and dist.is_available() and dist.is_initialized()

    def upload_together(self, step, state, rt, replace) -> dict:
        """Every process, on the caller's thread (DCP's collectives must not race the training's): DCP writes each
        process's shards into a folder of its own (process 0 adds `.metadata`, which names every file), each process
        stores its files create-only with their crc32c. The processes agree after each part (labkit.checkpoint.dcp
        .agree): a failure or a NaN on any of them fails the save on all, before the commit. Returns (on every
        process) {"files": every process's files and crc32c, "planner": "default", "processes": n}."""
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
        agree(rt, err, f"saving {self._url(name)}")
        folder = self.store.temp_dir(f"{name}-p{rt.ordinal}")
        try:
            try:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), planner=DefaultSavePlanner())
            except BaseException as e:  # DCP's CheckpointException is a BaseException; it failed on every process
                shutil.rmtree(folder, ignore_errors=True)
                raise (no_space(e, self.store) or e) from e
            files, err = {}, None
            try:
                for f in sorted(os.listdir(folder)):
                    p = os.path.join(folder, f)
                    crc = gcs.crc32c_b64(p)
                    files[f] = {"crc32c": crc, "size": os.path.getsize(p)}
                    self.store.put_if_absent(f"{name}/{f}", p, crc)
            except BaseException as e:
                err = e
            parts = agree(rt, err, f"saving {self._url(name)}", files)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        merged = {}
        for part in parts:
            merged.update(part)
        return {"files": merged, "planner": "default", "processes": rt.world_size}

    def stage(self, state, rt):
        import torch.distributed as dist

        split = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if rt is None and split and any(_dtensor_split(t) for _, t in _tensors(state)):
            raise ValueError(
                f"checkpoint to {self.store.url('')}: this state is split over {dist.get_world_size()} processes "
                "(DTensors: parallel='fsdp2') and the manager was built without rt: pass CheckpointManager(..., "
                "rt=rt) so that every process writes its own shards and process 0 alone commits"
            )
        if rt is not None and rt.world_size > 1:
            raise RuntimeError(
                f"checkpoint to {self.store.url('')}: the sharded format of XLA tensors is written by one process "
                f"(one host with all its devices, SPMD); this run has {rt.world_size} processes. Use format='file', "
                "or SPMD (labkit.setup(spmd='on')) instead of one process per device"
            )
        return stage(state)  # this host's shards, copied to the CPU in one batched transfer

    def upload(self, step, cpu_state, staged, replace) -> dict:
        import torch.distributed.checkpoint as dcp

        name = folder_name(step)
        old = self.listing().get(step)
        if old:  # our own earlier save of this step, or one a killed writer left (the manager decides)
            replace()
            self._remove(step, old)
        folder = self.store.temp_dir(name)  # DCP writes here; the store then uploads (gs://) or moves (local)
        try:
            kind = _planner_kind()
            planner = _planner(kind, False, self._url(name))
            try:
                dcp.save(cpu_state, storage_writer=dcp.FileSystemWriter(folder), planner=planner, no_dist=True)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                if no_space(e, self.store) is None:
                    raise
                shutil.rmtree(folder, ignore_errors=True)  # first: the message then says what is free
                raise no_space(e, self.store) from e
            files = {}
            for f in sorted(os.listdir(folder)):
                p = os.path.join(folder, f)
                crc = gcs.crc32c_b64(p)
                files[f] = {"crc32c": crc, "size": os.path.getsize(p)}
                self.store.put_if_absent(f"{name}/{f}", p, crc)  # gs://: the server's crc32c checked
            staged(step, folder)  # every file stored, no marker yet: the commit point is next
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return {"files": files, "planner": kind}

    def commit(self, step, info, record, kept) -> None:
        rec = {"step": int(step), **info, "metrics": record.get("metrics") or {}, "time": time.time()}
        rec["labkit"] = __version__  # a labkit too old to read it can then say so
        if record.get("best"):
            rec["best"] = record["best"]
        data = json.dumps(rec).encode()
        try:  # create-only: a second writer committing the same step fails instead of overwriting
            self.store.put_if_absent(f"{folder_name(step)}/{MARKER}", data, gcs.crc32c_b64(data))
        except FileExistsError:
            raise RuntimeError(
                f"{self._url(folder_name(step), MARKER)} already exists: another run committed this step"
            ) from None

    def abort(self, step) -> None:
        """An unfinished step holds space the next save needs: its stored files go (no marker)."""
        try:
            names = self.listing().get(step, set())
            if MARKER not in names:
                self._remove(step, names)
        except Exception:  # best effort (a server that is down): the next save of the step removes them
            pass

    def _remove(self, step: int, names) -> None:
        """Delete a step's files, the marker first: a half-deleted folder is uncommitted."""
        for n in sorted(names, key=lambda n: n != MARKER):
            self.store.delete(f"{folder_name(step)}/{n}")

    def remove(self, step) -> None:
        self._remove(step, self.listing().get(step, set()))

    # -- reading ------------------------------------------------------------------------------------
    def _fetch(self, step: int, rec: dict) -> str:
        """A local folder holding the step's files, each checked against its recorded crc32c."""
        name = folder_name(step)
        safe_load.check_names(rec["files"], self._url(name))  # each is joined to the temp folder below
        local = self.store.local_path(name)  # a local root is read in place; gs:// files are downloaded
        folder = local or tempfile.mkdtemp(prefix=f"labkit-dcp-read-{os.getpid()}-")
        try:
            for f, info in rec["files"].items():
                p = os.path.join(folder, f)
                if local is None:
                    data = read_checked(self.store, f"{name}/{f}")  # a failed read: ReadFailed, no fallback
                    try:
                        with open(p, "wb") as out:
                            out.write(data)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        shutil.rmtree(folder, ignore_errors=True)  # first: the message then says what is free
                        free = shutil.disk_usage(os.path.dirname(folder)).free >> 20
                        raise ReadFailed(
                            errno.ENOSPC,
                            f"no space left on {os.path.dirname(folder)} ({free} MB free) while downloading "
                            f"{self._url(name)} to restore it (the checkpoint is not damaged): free space there, "
                            "or point TMPDIR at a larger disk",
                        ) from e
                if not os.path.exists(p) or gcs.crc32c_b64(p) != info.get("crc32c"):
                    raise OSError(f"{self._url(name, f)} is missing or its crc32c does not match the commit record")
        except BaseException:
            if local is None:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        return folder

    def read(self, step, into=None, map_location="cpu"):
        """Load the step into `into` in place (tensors keep their device and sharding; plain values are
        replaced), or into new full CPU tensors; (state, commit record)."""
        state = {} if into is None else into
        rec = self.marker(step)
        folder = self._fetch(step, rec)
        try:
            planner = _planner(rec.get("planner", "spmd"), True, self._url(folder_name(step)))
            reader = safe_load.SafeReader(folder)  # unpickles data only: a planted file runs no code
            reader.listed = set(rec["files"])  # and reads only the files the commit record checked
            size = sum(os.path.getsize(os.path.join(folder, f)) for f in rec["files"])  # checked by _fetch
            _add_missing(state, reader.read_metadata(), size, self._url(folder_name(step)))
            safe_load.load(state, reader, planner, self._url(folder_name(step)))
        except safe_load.CheckpointRefused:
            raise
        except Exception as e:
            newer = safe_load.newer_labkit(rec.get("labkit"), self._url(folder_name(step)), e)
            if newer is None:
                raise
            raise newer from e
        finally:
            if folder != self.store.local_path(folder_name(step)):
                shutil.rmtree(folder, ignore_errors=True)
        return state, rec

    def unfinished(self, step) -> str | None:
        return f"no {MARKER} marker (a save that did not finish)"

    def damaged(self, exc) -> bool:
        """Files that fail their crc32c, a marker that does not read, a refused pickle: fall back. A state that
        does not fit the target (shapes, keys) is the caller's mistake: raised."""
        return isinstance(exc, (OSError, safe_load.CheckpointRefused))

    def fallback_message(self, step, exc) -> str:
        return f"{exc}; falling back to the previous committed checkpoint"
