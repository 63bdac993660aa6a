"""Atomic, verified, asynchronous checkpoints to a local folder or gs://bucket/prefix.

    ckpt = CheckpointManager("gs://my-bucket/runs/a", keep=3, best_metric="val_acc", mode="max")
    trainer = Trainer(model, opt, rt, TrainConfig(checkpoint_every=500, resume=True), loader, checkpoint=ckpt)
    trainer.fit()          # restores from `latest`, saves every 500 steps, waits for the last upload

Layout under root: `ckpt-00001200.pt` (torch.save of a CPU-only state, loadable with
weights_only=True) and `latest`, a small JSON naming the newest verified object (name, step,
crc32c, size, metrics, best). The pointer moves only after the object is uploaded and the
server's crc32c matched ours, so a reader never sees half a checkpoint. Objects are written
create-only; on GCS the pointer is written with if_generation_match (the generation last read, 0 to
create). Old objects (beyond the last `keep`, except the best) are deleted after the pointer moved.
Saves run in one background thread (labkit.checkpoint.writer), at most one pending; their errors
surface on the next save(), wait() or close(). A full disk is an OSError(ENOSPC) naming the folder
and the MB free, and leaves nothing behind. The folder/GCS specifics live in labkit.cloud.store.

Every state restore() returns was verified, whichever object it came from (the pointer's, a
fallback, an explicit step): the whole object against the crc32c the pointer recorded when it
has one, and always every member of the torch zip against its own CRC-32 (torch.load alone
reads a flipped byte as a changed weight). Cost: one crc pass over the bytes (~1 GB/s).
One writer per root, refused before its first byte: a local folder takes an flock, a gs:// prefix a
lock object created create-only; both name the holder (host, pid). A writer proves it still holds the
lock before every commit point (an overwrite, the pointer, a prune), and never replaces a step another
run committed. keep >= 1. The best records its metric and mode (another one: said, and a new best). A
state holding NaN/inf is never saved; an unreadable (not damaged) checkpoint stops the restore.

format="auto" (the default): a state with any tensor split over devices (FSDP, tensor parallel
under SPMD) is saved in the sharded format instead (labkit.checkpoint.sharded: DCP folders
`step-00001200/` with a COMMITTED marker beside the files above; each host's shards written once,
never gathered). restore() reads whichever format is newest: restore(into=state_dict) fills live
tensors in place where the format allows (sharded: yes, keeping their sharding; one file: returns the
loaded CPU state) and returns the state to load; restore() returns full CPU tensors; both return None
when nothing was saved (ShardedCheckpointManager.restore speaks the same protocol). "file" forces
one file (the whole state gathered on the host), "sharded" forces the sharded format.
"""

from __future__ import annotations

import os
import time
import warnings

import torch

from labkit.checkpoint import runs, safe_load
from labkit.checkpoint.pointer import NAME as _NAME
from labkit.checkpoint.pointer import Pointer, object_name
from labkit.checkpoint.pointer import step_of as _step_of
from labkit.checkpoint.sharded import ShardedCheckpointManager, folder_name, is_sharded
from labkit.checkpoint.state import ReadFailed, check_compatible, refuse_nonfinite, to_cpu, verify  # noqa: F401  (also public here: labkit.checkpoint.to_cpu)
from labkit.checkpoint.state import read as read_checked
from labkit.checkpoint.writer import BackgroundWriter, no_space
from labkit.cloud import gcs, open_store

# "auto": one file, or DCP shards (labkit.checkpoint.sharded) when any tensor of the state is split over devices
FORMATS = ("auto", "file", "sharded")


# -- the manager ----------------------------------------------------------------------------------
class CheckpointManager:
    def __init__(
        self,
        root,
        keep: int = 3,
        best_metric: str | None = "val_acc",
        mode: str = "max",
        async_save: bool = True,
        rt=None,  # optional: None is one process (no replicas to agree with); a run with replicas passes its own
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
        self.root, self.keep, self.best_metric, self.mode = runs.check_root(root), keep, best_metric, mode
        self.async_save, self.save_every, self.format = async_save, save_every, format
        self.rt = rt
        self.store = open_store(self.root, retry_deadline_s)
        self.pointer = Pointer(self.store)  # `latest`: which object is newest, the best, the kept crc32c
        # one background writer for both formats: one pending save, one place its error surfaces
        self.writer = BackgroundWriter("checkpoint", self.root, async_save)
        # where sharded states go: same root, same store (so the same writer lock), the decisions stay here
        self._sharded = ShardedCheckpointManager(self.root, keep=keep, store=self.store, writer=self.writer)
        self.restored: dict | None = None  # the pointer / commit record of what restore() last returned
        ptr = self.pointer.read()  # every replica: the same best value -> the same save decisions
        best = ptr.get("best") if ptr else None
        self.best = best if isinstance(best, dict) and "value" in best else None  # step, name, value, metric, mode
        self._objects = dict(ptr.get("objects") or {}) if ptr else {}  # name -> crc32c of kept objects
        if ptr and ptr.get("crc32c"):
            self._objects.setdefault(ptr["name"], ptr["crc32c"])
        rec = self._sharded.latest()  # a sharded run: its best lives in the commit record
        if rec and isinstance(rec.get("best"), dict) and (ptr is None or rec["step"] > ptr.get("step", -1)):
            self.best = rec["best"]
        self.best = self._same_best(self.best)
        self._mine: set[str] = set()  # objects this manager uploaded: its own to replace
        self._continues = False  # restored, or saved above the folder's newest step (labkit.checkpoint.runs)

    def _same_best(self, best):
        """The stored best, if it was measured with this manager's metric and mode; else None, saying so
        (a val_loss run compared against a val_acc best would keep the wrong step)."""
        if best is None or not self.best_metric:  # no metric: nothing is compared, the old best stays kept
            return best
        was = (best.get("metric"), best.get("mode"))
        if was == (self.best_metric, self.mode):
            return best
        old = "an unrecorded metric" if was[0] is None else f"{was[0]!r} (mode {was[1]!r})"
        warnings.warn(
            f"{self.root}: its best checkpoint (step {best.get('step')}) was chosen by {old}; this manager ranks "
            f"by {self.best_metric!r} (mode {self.mode!r}), so that best is not compared against: the first "
            "save with the new metric becomes the best (the old one is no longer kept for it)",
            stacklevel=3,
        )
        return None

    @property
    def _master(self) -> bool:
        return self.rt is None or self.rt.is_master

    @property
    def pending(self) -> int | None:
        """The step whose upload is still running, or None."""
        return self.writer.pending

    def _names(self) -> list[str]:
        return [n for n in self.store.list("ckpt-") if _NAME.match(n)]

    def _sharded_format(self, state) -> bool:
        if self.format != "auto":
            return self.format == "sharded"
        return is_sharded(state)

    def _ranking(self) -> dict:
        return {"metric": self.best_metric, "mode": self.mode}

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

    # -- saving ------------------------------------------------------------------------------------
    def save(self, step: int, state: dict, metrics: dict | None = None, force: bool = False) -> bool:
        """Save if periodic (save_every) or the best metric improved (or force). Returns whether it saved."""
        self.writer.raise_error()
        value = self._reduced(metrics or {})
        improved = self._improved(value)
        periodic = self.save_every is None or step % self.save_every == 0
        if not (force or periodic or improved):
            return False
        if not self._continues:  # a new run in an old run's folder: refused before it mixes the two
            newest = max([_step_of(n) for n in self._names()] + self._sharded.committed_steps(), default=None)
            runs.refuse_older_step(self.root, step, newest)
            self._continues = True
            self._sharded.continue_run()
        if self._master:
            self.store.acquire_writer(takeover=self.restored is not None)  # a second writer fails here, before any work
        if self._sharded_format(state):
            return self._save_sharded(step, state, metrics, improved, value)
        if improved:
            self.best = {"step": int(step), "name": object_name(step), "value": value, **self._ranking()}
        cpu = to_cpu(state, self.rt)  # every replica: keeps XLA graphs identical across replicas
        refuse_nonfinite(cpu, self.root, step)  # every replica holds the same weights: all refuse alike
        if not self._master:
            return True
        meta = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str))}
        self.writer.submit(step, self._write, step, cpu, meta, dict(self.best or {}))
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
        self.writer.wait()
        if improved:
            self.best = {"step": int(step), "name": folder_name(step), "value": value, **self._ranking()}
        self._sharded.pinned = {self.best["step"]} if self.best and self.best["name"].startswith("step-") else set()
        return self._sharded.save(step, state, metrics, best=dict(self.best) if self.best else None)

    def _write(self, step, cpu_state, metrics, best):
        name = object_name(step)
        tmp = self.store.temp_file(name)  # its name carries our pid: only a dead writer's is swept
        try:
            try:
                with open(tmp, "wb") as f:
                    torch.save(cpu_state, f)
            except Exception as e:
                if no_space(e, self.store) is None:
                    raise
                os.remove(tmp)  # the partial file first: the message then says what is really free
                raise no_space(e, self.store) from e
            crc, size = gcs.crc32c_b64(tmp), os.path.getsize(tmp)  # the one crc pass of this save
            self.writer.staged(step, tmp)
            try:  # create-only: one request, and no other writer's object is ever overwritten
                self.store.put_if_absent(name, tmp, crc)
            except FileExistsError:
                # this run's own earlier save of the step, or one a killed writer uploaded without moving
                # the pointer: replacing it is what is meant. A step another run committed is not
                self._refuse_committed(name, step)
                self.store.check_writer()  # the lock is still ours right before the overwrite
                self.store.put(name, tmp, crc)
            self._mine.add(name)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.writer.check_abandon(step)  # uploaded but not pointed at: invisible, pruned by the next save
        kept = self._retained(name, best)
        objects = {n: c for n, c in self._objects.items() if n in kept}
        objects[name] = crc
        self.store.check_writer()  # the commit point: only while the lock is still ours
        self.pointer.write(
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
        names = sorted(set(self._names()) | {newest})
        keep = set(names[-self.keep :]) | {newest}
        if best and best.get("name"):
            keep.add(best["name"])
        return keep

    def _prune(self, keep):
        doomed = [n for n in self._names() if n not in keep]
        if doomed:
            self.store.check_writer()  # a writer whose lock was taken deletes nothing
        for n in doomed:
            self.store.delete(n)

    def _refuse_committed(self, name, step):
        """RuntimeError when `name` is a checkpoint another run committed (the pointer names it or keeps
        it): two runs resumed from one step both save the next one, and the second would replace the
        first's. Ours (saved or restored by this manager) may be replaced."""
        if name in self._mine or (self.restored or {}).get("name") == name:
            return
        ptr = self.pointer.read(track=False) or {}
        if name == ptr.get("name") or name in (ptr.get("objects") or {}):
            raise RuntimeError(
                f"{self.store.url(name)} is a checkpoint another run committed (step {step}); this run does not "
                "overwrite it. Two runs are saving to one prefix: stop one, or resume from the newest step"
            )

    def wait(self) -> None:
        """Block until the pending save finished; re-raise its error."""
        self.writer.wait()

    def close(self) -> None:
        """Finish the pending upload, then give up the writer lock. An interrupt while waiting
        abandons the upload cleanly (the pointer does not move; temp files are removed) and is
        re-raised."""
        try:
            self.writer.close()
        finally:
            if self.writer.pending is None:  # an abandoned save that did not stop keeps the lock
                self.store.release_writer()

    # -- reading -----------------------------------------------------------------------------------
    def _load(self, name, expect_crc=None, map_location="cpu"):
        data = read_checked(self.store, name)  # a failed read raises ReadFailed: no fallback
        verify(data, self.store.url(name), expect_crc)
        return safe_load.torch_load(data, self.store.url(name), map_location)  # weights_only: runs no code

    def restore(self, step: int | None = None, map_location="cpu", into: dict | None = None):
        """The verified state dict of `latest` (or of `step`), or None when nothing was saved (the pointer
        or commit record of what was loaded: self.restored). A
        corrupt newest object warns and falls back to the previous verified one; a corrupt
        explicit `step` raises IOError.

        A checkpoint in the sharded format (newer than the newest single file, or the `step` asked
        for) is read through DCP: into `into`, in place (its tensors keep their device and sharding:
        any mesh, or none) and `into` is returned; without `into`, into new full CPU tensors."""
        self.wait()
        self._continues = True  # a run that restored may save any step
        self._sharded.continue_run()
        ptr, names = self.pointer.read(), self._names()
        sharded = self._sharded.steps()
        newest_file = max([_step_of(n) for n in names] + ([int(ptr["step"])] if ptr else []), default=-1)
        if sharded and (step in sharded or (step is None and sharded[-1] > newest_file)):
            got = self._sharded.restore(into=into, step=step)
            if got is not None:
                self.restored = self._sharded.restored
                return got
        recorded = dict(self._objects)
        if ptr is not None:
            recorded.update(ptr.get("objects") or {})
            if ptr.get("crc32c"):
                recorded[ptr["name"]] = ptr["crc32c"]
        if step is not None:
            name = object_name(step)
            if name not in names:
                raise FileNotFoundError(f"no checkpoint {self.store.url(name)}")
            self.restored = {"name": name, "step": int(step)}
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
                state = self._load(name, recorded.get(name), map_location)
            except ReadFailed:
                raise  # unreachable is not damaged: an older step would quietly undo progress
            except Exception as e:
                warnings.warn(
                    f"checkpoint {self.store.url(name)} is unreadable ({type(e).__name__}: {e}); "
                    "falling back to the previous one",
                    stacklevel=2,
                )
                continue
            self.restored = ptr if ptr is not None and ptr["name"] == name else {"name": name, "step": _step_of(name)}
            return state
        raise RuntimeError(f"no readable checkpoint under {self.root} (tried {candidates})")

    def latest(self) -> dict | None:
        """The pointer of the newest single-file checkpoint, or the commit record of the newest sharded
        one when that is newer (both carry step and metrics)."""
        ptr = self.pointer.read()
        rec = self._sharded.latest()
        if rec is not None and (ptr is None or rec["step"] > ptr["step"]):
            return rec
        return ptr
