"""Atomic, verified, asynchronous checkpoints to a local folder or gs://bucket/prefix.

    ckpt = CheckpointManager("gs://my-bucket/runs/a", keep=3, best_metric="val_acc", mode="max")
    trainer = Trainer(model, opt, rt, TrainConfig(checkpoint_every=500, resume=True), loader, checkpoint=ckpt)
    trainer.fit()          # restores from `latest`, saves every 500 steps, waits for the last upload

Layout under root: `ckpt-00001200.pt` (torch.save of a CPU-only state, loadable with
weights_only=True) and `latest`, a small JSON naming the newest verified object (name, step,
crc32c, size, metrics, best). The pointer moves only after the object is uploaded and the
server's crc32c matched ours, so a reader never sees half a checkpoint. On GCS the pointer is
written with if_generation_match (the generation last read, 0 to create): of two writers only one
wins, the other gets a clear error. Old objects (beyond the last `keep`, except the best) are deleted
after the pointer moved. Uploads run in one background thread, at most one pending; their errors
surface on the next save(), wait() or close(). The folder/GCS specifics live in labkit.cloud.store.

Every state restore() returns was verified, whichever object it came from (the pointer's, a
fallback, an explicit step): the whole object against the crc32c the pointer recorded when it
has one, and always every member of the torch zip against its own CRC-32 (torch.load alone
reads a flipped byte as a changed weight). Cost: one crc pass over the bytes (~1 GB/s).
One writer per root: local folders take a lock naming the holder (host, pid); on GCS the
conditional pointer write refuses the second writer. keep must be >= 1.

format="auto" (the default): a state with any tensor split over devices (FSDP, tensor parallel
under SPMD) is saved in the sharded format instead (labkit.checkpoint.sharded: DCP folders
`step-00001200/` with a COMMITTED marker beside the files above; each host's shards written once,
never gathered). restore() reads whichever format is newest; pass `into=state_dict` to fill live,
sharded tensors in place (the Trainer does), otherwise it returns full CPU tensors. "file" forces
one file (the whole state gathered on the host), "sharded" forces the sharded format.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
import time
import warnings

import torch

from labkit.checkpoint.state import check_compatible, hold_for_tests, to_cpu, verify  # noqa: F401  (also public here: labkit.checkpoint.to_cpu)
from labkit.cloud import gcs
from labkit.cloud.store import NAME as _NAME
from labkit.cloud.store import GCSStore, LocalStore

# "auto": one file, or DCP shards (labkit.checkpoint.sharded) when any tensor of the state is split over devices
FORMATS = ("auto", "file", "sharded")


class _Abandoned(Exception):
    """The pending save was abandoned (a second interrupt): nothing becomes visible."""


def object_name(step: int) -> str:
    return f"ckpt-{int(step):08d}.pt"


# -- the manager ----------------------------------------------------------------------------------
class CheckpointManager:
    KIND = "checkpoint"  # names the manager in errors of a save that failed in the background

    def __init__(
        self,
        root,
        keep: int = 3,
        best_metric: str | None = "val_acc",
        mode: str = "max",
        async_save: bool = True,
        rt=None,
        save_every: int | None = None,
        retry_deadline_s: float = 60,
        format: str = "auto",
    ):
        if format not in FORMATS:
            raise ValueError(f"format={format!r}: expected one of {', '.join(map(repr, FORMATS))}")
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint (the newest)")
        if save_every is not None and (not isinstance(save_every, int) or save_every < 1):
            raise ValueError(f"save_every={save_every!r}: expected None or an integer >= 1")
        self.root, self.keep, self.best_metric, self.mode = str(root), keep, best_metric, mode
        self.async_save, self.save_every, self.format = async_save, save_every, format
        self.rt = rt
        self.store = GCSStore(self.root, retry_deadline_s) if gcs.is_gcs(self.root) else LocalStore(self.root)
        from labkit.checkpoint.sharded import ShardedCheckpointManager  # (it imports this module)

        # where sharded states go: same root, same store (so the same writer lock), the decisions stay here
        self._sharded = ShardedCheckpointManager(
            self.root, keep=keep, async_save=async_save, retry_deadline_s=retry_deadline_s, store=self.store
        )
        ptr = self.store.read_pointer()  # every replica: the same best value -> the same save decisions
        best = ptr.get("best") if ptr else None
        self.best = best if isinstance(best, dict) and "value" in best else None  # {"step", "name", "value"}
        self._objects = dict(ptr.get("objects") or {}) if ptr else {}  # name -> crc32c of kept objects
        if ptr and ptr.get("crc32c"):
            self._objects.setdefault(ptr["name"], ptr["crc32c"])
        rec = self._sharded.latest()  # a sharded run: its best lives in the commit record
        if rec and isinstance(rec.get("best"), dict) and (ptr is None or rec["step"] > ptr.get("step", -1)):
            self.best = rec["best"]
        self._thread: threading.Thread | None = None
        # set by the upload thread when it ends. Waiting on it (not on Thread.join) keeps an interrupt safe:
        # on Python 3.11 a join interrupted by a signal handler's exception marks the still-running
        # thread as stopped (bpo-45274's fix), so a second join would return at once and lose the upload
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._abandon = threading.Event()
        self._pending_step: int | None = None

    @property
    def _master(self) -> bool:
        return self.rt is None or self.rt.is_master

    @property
    def pending(self) -> int | None:
        """The step whose upload is still running, or None."""
        t = self._thread
        if t is not None and not self._done.is_set():
            return self._pending_step
        return self._sharded.pending

    # -- the sharded format ------------------------------------------------------------------------
    def _sharded_format(self, state) -> bool:
        if self.format != "auto":
            return self.format == "sharded"
        from labkit.checkpoint.sharded import is_sharded

        return is_sharded(state)

    def _improved(self, value) -> bool:
        if value is None or value != value:
            return False
        if self.best is None:
            return True
        return value > self.best["value"] if self.mode == "max" else value < self.best["value"]

    def _reduced(self, metrics: dict):
        """The best metric averaged over replicas, so every replica takes the same decision."""
        if not self.best_metric or self.best_metric not in (metrics or {}):
            return None
        v = float(metrics[self.best_metric])
        if self.rt is not None and self.rt.world_size > 1:
            t = self.rt.all_reduce(torch.tensor(v, device=self.rt.device), "mean")
            v = float(t.cpu())
        return v

    def save(self, step: int, state: dict, metrics: dict | None = None, force: bool = False) -> bool:
        """Save if periodic (save_every) or the best metric improved (or force). Returns whether it saved."""
        self._raise_pending()
        value = self._reduced(metrics or {})
        improved = self._improved(value)
        periodic = self.save_every is None or step % self.save_every == 0
        if not (force or periodic or improved):
            return False
        if self._master:
            self.store.acquire_writer()  # a second writer on this root fails here, before any work
        if self._sharded_format(state):
            return self._save_sharded(step, state, metrics, improved, value)
        if improved:
            self.best = {"step": int(step), "name": object_name(step), "value": value}
        cpu = to_cpu(state, self.rt)  # every replica: keeps XLA graphs identical across replicas
        if not self._master:
            return True
        self.wait()  # at most one pending upload
        self._abandon.clear()
        meta = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str))}
        self._pending_step = int(step)
        if self.async_save:
            self._done = threading.Event()
            self._thread = threading.Thread(
                target=self._write_guarded,
                args=(self._done, step, cpu, meta, dict(self.best or {})),
                name=f"labkit-ckpt-{step}",
                daemon=True,
            )
            self._thread.start()
        else:
            self._write(step, cpu, meta, self.best)
        return True

    def _save_sharded(self, step, state, metrics, improved, value) -> bool:
        """State split over devices (SPMD): each host's shards go to `step-N/` through DCP, never
        gathered into one tensor (labkit.checkpoint.sharded); the best step is kept by its pruning."""
        if self.rt is not None and self.rt.world_size > 1:
            raise RuntimeError(
                f"checkpoint to {self.root}: the sharded format is written by one process (one host with all "
                f"its devices, SPMD); this run has {self.rt.world_size} processes. Use format='file', or SPMD "
                "(labkit.setup(spmd='on')) instead of one process per device"
            )
        from labkit.checkpoint.sharded import folder_name

        self.wait()
        if improved:
            self.best = {"step": int(step), "name": folder_name(step), "value": value}
        self._sharded.pinned = {self.best["step"]} if self.best and self.best["name"].startswith("step-") else set()
        return self._sharded.save(step, state, metrics, best=dict(self.best) if self.best else None)

    def _write_guarded(self, done: threading.Event, *args):
        try:
            # lower this thread's CPU priority: serializing and uploading should take idle cycles,
            # not the host threads that feed and run the training step (Linux: per-thread nice)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
            self._write(*args)
        except _Abandoned:
            pass
        except BaseException as e:  # surfaced on the next save()/wait()
            self._error = e
        finally:
            done.set()

    def _check_abandon(self, step):
        if self._abandon.is_set():
            raise _Abandoned(step)

    def _write(self, step, cpu_state, metrics, best):
        name = object_name(step)
        # the pid in the name lets a later run sweep the temp files of a killed one (GCS temp folder)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.{os.getpid()}.", suffix=".tmp", dir=self.store.tmpdir())
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(cpu_state, f)
            crc, size = gcs.crc32c_b64(tmp), os.path.getsize(tmp)  # the one crc pass of this save
            if os.environ.get("LABKIT_CKPT_KILL_IN_UPLOAD") == str(step):  # tests: die mid-save
                os.kill(os.getpid(), 9)
            hold_for_tests(step, tmp)
            self._check_abandon(step)
            self.store.put(tmp, name, crc)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self._check_abandon(step)  # uploaded but not pointed at: invisible, pruned by the next save
        kept = self._retained(name, best)
        objects = {n: c for n, c in self._objects.items() if n in kept}
        objects[name] = crc
        self.store.write_pointer(
            {
                "name": name,
                "step": int(step),
                "crc32c": crc,
                "size": size,
                "metrics": metrics,
                "best": best or None,
                "objects": objects,
                "time": time.time(),
            }
        )
        self._objects = objects
        self._prune(kept)

    def _retained(self, newest, best) -> set:
        names = sorted(set(self.store.names()) | {newest})
        keep = set(names[-self.keep :]) | {newest}
        if best and best.get("name"):
            keep.add(best["name"])
        return keep

    def _prune(self, keep):
        for n in self.store.names():
            if n not in keep:
                self.store.delete(n)

    def _raise_pending(self):
        err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"an earlier {self.KIND} save to {self.root} failed: {err}") from err

    def wait(self) -> None:
        """Block until the pending save finished; re-raise its error."""
        self._wait_thread()
        self._sharded.wait()

    def _wait_thread(self) -> None:
        t = self._thread
        if t is not None:
            self._done.wait()  # an interrupt here leaves the save pending: close() can still finish it
            t.join()  # ended: returns at once
            self._thread = None
        self._raise_pending()

    def close(self) -> None:
        """Finish the pending upload, then give up the writer lock. An interrupt while waiting
        abandons the upload cleanly (the pointer does not move; temp files are removed) and is
        re-raised."""
        step = self.pending
        try:
            try:
                self.wait()
            except KeyboardInterrupt:
                self._abandon.set()
                t = self._thread
                if t is not None and self._done.wait(timeout=30):  # it stops at its next check
                    t.join()
                    self._thread = None
                # a sharded-format save has no abandon point: without its COMMITTED marker it is never restored
                warnings.warn(f"checkpoint of step {step} to {self.root} abandoned (interrupted)", stacklevel=2)
                raise
        finally:
            if self._thread is None and self.pending is None:  # the lock is shared with the sharded format's saves
                self.store.release_writer()

    # -- reading -----------------------------------------------------------------------------------
    def _load(self, name, expect_crc=None, map_location="cpu"):
        data = self.store.get(name)
        verify(data, self.store.url(name), expect_crc)
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)

    def restore(self, step: int | None = None, map_location="cpu", into: dict | None = None):
        """The verified state dict of `latest` (or of `step`), or None when nothing was saved. A
        corrupt newest object warns and falls back to the previous verified one; a corrupt
        explicit `step` raises IOError.

        A checkpoint in the sharded format (newer than the newest single file, or the `step` asked
        for) is read through DCP: into `into`, in place (its tensors keep their device and sharding:
        any mesh, or none) and `into` is returned; without `into`, into new full CPU tensors."""
        self.wait()
        ptr, names = self.store.read_pointer(), self.store.names()
        sharded = sorted(self._sharded._listing())
        newest_file = max([_step_of(n) for n in names] + ([int(ptr["step"])] if ptr else []), default=-1)
        if sharded and (step in sharded or (step is None and sharded[-1] > newest_file)):
            target = into if into is not None else {}
            if self._sharded.restore(target, step) is not None:
                return target
        recorded = dict(self._objects)
        if ptr is not None:
            recorded.update(ptr.get("objects") or {})
            if ptr.get("crc32c"):
                recorded[ptr["name"]] = ptr["crc32c"]
        if step is not None:
            name = object_name(step)
            if name not in names:
                raise FileNotFoundError(f"no checkpoint {self.store.url(name)}")
            return self._load(name, recorded.get(name), map_location)
        if ptr is None and not names:
            return None
        candidates = []
        if ptr is not None:
            candidates.append(ptr["name"])
        newest = _step_of(ptr["name"]) if ptr else None
        candidates += [n for n in reversed(names) if newest is None or _step_of(n) < newest]
        for name in candidates:
            try:
                return self._load(name, recorded.get(name), map_location)
            except Exception as e:
                warnings.warn(
                    f"checkpoint {self.store.url(name)} is unreadable ({type(e).__name__}: {e}); "
                    "falling back to the previous one",
                    stacklevel=2,
                )
        raise RuntimeError(f"no readable checkpoint under {self.root} (tried {candidates})")

    def latest(self) -> dict | None:
        """The pointer of the newest single-file checkpoint, or the commit record of the newest sharded
        one when that is newer (both carry step and metrics)."""
        ptr = self.store.read_pointer()
        rec = self._sharded.latest()
        if rec is not None and (ptr is None or rec["step"] > ptr["step"]):
            return rec
        return ptr


def _step_of(name: str) -> int:
    return int(_NAME.match(name).group(1))
