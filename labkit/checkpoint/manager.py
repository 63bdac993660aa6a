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
and the MB free, and leaves nothing behind. The store (a folder, gs://, s3://) is labkit.cloud's.

One manager, two formats: this class owns every decision (when to save, the lock, the refuse-older-step
rule, which steps are kept over both formats: the newest `keep` and the best, the restore fallback);
a format (labkit.checkpoint.formats: OneFile; labkit.checkpoint.dcp: Sharded) owns only its bytes.

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
one file (the whole state gathered on the host), "sharded" forces the sharded format. Under torchrun with rt
(FSDP2: every process holds its own shards) a sharded save runs in the background on every process and restore is
one decision every process takes together: labkit.checkpoint.dcp's docstring says how and what it costs.

Collective under torchrun (rt given, several processes): the constructor (it makes the checkpoint's gloo group and
reads process 0's `latest`), latest(), restore(), save() and close(). Every process calls each at the same point, in
the same order: `if rt.is_master: CheckpointManager(root, rt=rt)` would wait for the others until the checkpoint
group's timeout (LABKIT_CKPT_TIMEOUT_S, an hour), then fail naming what it waited for. A one-file save is written by
process 0 alone; a prune that fails after its commit is a warning there, not its next save()'s error (which would
stop process 0 alone). A sharded background save stages into a CpuMirror kept until close(): one host copy of this
process's shards (labkit.checkpoint.staging).
"""

from __future__ import annotations

import warnings

import torch

from labkit.checkpoint import runs
from labkit.checkpoint.dcp import Sharded, folder_name  # noqa: F401  (folder_name: also public here)
from labkit.checkpoint.formats import OneFile
from labkit.checkpoint.pointer import object_name  # noqa: F401  (also public here: labkit.checkpoint.object_name)
from labkit.checkpoint.shards import is_sharded
from labkit.checkpoint.state import ReadFailed, check_compatible, recorded_entries, refuse_nonfinite, to_cpu, verify  # noqa: F401  (also public here: labkit.checkpoint.to_cpu)
from labkit.checkpoint.together_manager import Refused, Together
from labkit.checkpoint.writer import BackgroundWriter
from labkit.cloud import open_store

# "auto": one file, or DCP shards (labkit.checkpoint.dcp) when any tensor of the state is split over devices
FORMATS = ("auto", "file", "sharded")


def _as_refusal(check, what) -> None:
    """check(what); what it raises becomes Refused (a ValueError: never read as a damaged step to fall back past)."""
    try:
        check(what)
    except Refused:
        raise
    except Exception as e:
        raise Refused(str(e)) from e


class CheckpointManager(Together):
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
        """Under torchrun with rt: a collective (every process constructs it at the same point; see the module's
        docstring), as latest() and restore() are."""
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
        self.formats = {"file": OneFile(self.store), "sharded": Sharded(self.store)}
        what = "sharded checkpoint" if format == "sharded" else "checkpoint"
        self.writer = BackgroundWriter(what, self.root, async_save)  # one pending save, its error surfaces
        self.restored: dict | None = None  # the pointer / commit record of what restore() last returned
        self._pg = None  # under torchrun: the checkpoint's own gloo group, made at its first agreement
        rec = self.latest()  # every replica: process 0's best value -> the same save decisions (torchrun: collective)
        best = rec.get("best") if rec else None
        self.best = self._same_best(best if isinstance(best, dict) and "value" in best else None)
        self._mine: set[str] = set()  # steps this manager stored (names): its own to replace
        self._damaged: set[str] = set()  # steps restore found damaged and fell back past: a resumed run re-saves them
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

    def _entries(self) -> list[tuple[int, object, bool]]:
        """(step, format, committed) of every step in the store, both formats, oldest first."""
        return sorted((s, f, c) for f in self.formats.values() for s, c in f.steps().items())

    def _format_of(self, state):
        if self.format == "auto":
            return self.formats["sharded" if is_sharded(state) else "file"]
        return self.formats[self.format]

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
            newest = self._agreed(lambda: max((s for s, _, committed in self._entries() if committed), default=None))
            runs.refuse_older_step(self.root, step, newest)
            self._continues = True
        fmt = self._format_of(state)
        if fmt.kind == "sharded" and fmt.together(self.rt):  # FSDP2 under torchrun: every process writes its shards
            return self._save_together(fmt, int(step), state, metrics, value if improved else None)
        if self._master:
            self.store.acquire_writer(takeover=self.restored is not None)  # a second writer fails here, before any work
        cpu = fmt.stage(state, self.rt)  # the CPU copy, on this thread (every replica: identical XLA graphs)
        refuse_nonfinite(cpu, self.root, step)  # a NaN since the loss was last read is never saved
        if improved:
            self.best = {"step": int(step), "name": fmt.name(step), "value": value}
            self.best.update(metric=self.best_metric, mode=self.mode)
        if not self._master:
            return True
        meta = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str))}
        self.writer.submit(step, self._write, fmt, int(step), cpu, meta, dict(self.best or {}), recorded_entries(state))
        return True

    def _write(self, fmt, step, cpu_state, metrics, best, position=None):
        """In the writer's thread: store the bytes, prove the lock, commit, prune."""
        name = fmt.name(step)
        try:
            info = fmt.upload(step, cpu_state, self.writer.staged, lambda: self._may_replace(fmt, step))
            self._mine.add(name)
            self.writer.check_abandon(step)  # stored but not committed: invisible, pruned by the next save
            entries = self._entries()  # listed once: the lock keeps other writers out until the prune
            kept = self._retained(step, best, entries)
            self.store.check_writer()  # the commit point: only while the lock is still ours
            fmt.commit(step, info, {"metrics": metrics, "best": best or None, "position": position}, kept)
        except BaseException:
            fmt.abort(step)
            raise
        self._prune(step, kept, entries, warn=True)

    def _may_replace(self, fmt, step) -> None:
        """`step` exists already: this run's own earlier save, one a killed writer stored without committing, or one
        this run's restore found damaged and fell back past, may be replaced. A step another run committed is not
        (two runs resumed from one step both save the next one, and the second would replace the first's):
        RuntimeError."""
        name = fmt.name(step)
        ours = name in self._mine or name in self._damaged or (self.restored or {}).get("step") == step
        if not ours and fmt.committed(step):
            raise RuntimeError(
                f"{self.store.url(name)} is a checkpoint another run committed (step {step}); this run does not "
                "overwrite it. Two runs are saving to one prefix: stop one, or resume from the newest step"
            )
        self.store.check_writer()  # the lock is still ours right before the old bytes go

    def _retained(self, newest: int, best, entries) -> set:
        """Names kept after a save of `newest`: the newest `keep` committed steps of either format, `newest`
        itself and the best."""
        committed = sorted({s for s, _, c in entries if c} | {newest})
        steps = set(committed[-self.keep :]) | {newest}
        keep = {f.name(s) for f in self.formats.values() for s in steps}
        if best and best.get("name"):
            keep.add(best["name"])
        return keep

    def _prune(self, newest: int, keep: set, entries, warn: bool = False) -> None:
        """Drop every step not kept, but not an uncommitted one newer than `newest` (another save's, in flight
        or killed: its own next save replaces it). `entries` were listed before the commit of `newest`: only
        its own flag changed since, and `newest` is kept. warn=True (the one-file save, in the writer's thread): a
        removal that fails is a warning, since `newest` is committed; raised, it failed process 0's next save() alone
        under torchrun. A lock another writer took still raises."""
        doomed = [(s, f) for s, f, c in entries if f.name(s) not in keep and (c or s < newest)]
        if doomed:
            self.store.check_writer()  # a writer whose lock was taken deletes nothing
        for s, f in doomed:
            try:
                f.remove(s)
            except Exception as e:
                if not warn:
                    raise
                warnings.warn(
                    f"{self.store.url(f.name(newest))} is committed, but removing the steps it replaces failed "
                    f"({type(e).__name__}: {e}); they stay until the next save prunes them",
                    stacklevel=2,
                )
                return

    def wait(self) -> None:
        """Block until the pending save finished; re-raise its error."""
        self.writer.wait()

    def close(self) -> None:
        """Finish the pending upload, then give up the writer lock. An interrupt while waiting
        abandons the upload cleanly (nothing is committed; temp files are removed) and is re-raised."""
        try:
            self.writer.close()
        finally:
            if self.writer.pending is None:  # an abandoned save that did not stop keeps the lock
                self.store.release_writer()
                self.formats["sharded"].release_mirror()  # the host copy of the state the saves staged into

    # -- reading -----------------------------------------------------------------------------------
    def restore(self, step: int | None = None, map_location="cpu", into: dict | None = None, check=None):
        """The verified state of the newest committed step (or of `step`), or None when nothing was saved;
        the pointer or commit record of what was loaded is then self.restored. A damaged newest step warns
        and falls back to the previous committed one, whichever format; a damaged explicit `step` raises.
        A store that could not be read raises ReadFailed: an older step would quietly undo progress.

        A step in the sharded format is read through DCP into `into`, in place (its tensors keep their
        device and sharding: any mesh, or none), and `into` is returned; without `into`, into new full CPU
        tensors. A one-file step returns the loaded CPU state.

        check: a function that refuses a step by raising (labkit.resume's data and optimizer checks), given the
        step's recorded position (its commit record's `position`: the state's plain entries, such as step, epoch,
        the data position and the dataset's identity) before any tensor is read, so that a refused resume leaves
        `into` (the live model) as it was; given the loaded state instead for a step recorded without one (an older
        labkit's, a one-file step). Under torchrun every process runs it, and a refusal on any process is every
        process's (ValueError naming the process)."""
        self.wait()
        self._continues = True  # a run that restored may save any step
        if self.formats["sharded"].together(self.rt):  # torchrun: one decision for every process
            return self._restore_together(step, into, map_location, check)
        tried = []
        for s, kind, unfinished in self._candidates(step):  # the one listing a restore tries, either way
            fmt = self.formats[kind]
            if unfinished is not None:  # a save that did not finish (a crash, a kill -9)
                if unfinished:
                    warnings.warn(f"ignoring {self.store.url(fmt.name(s))}: {unfinished}", stacklevel=2)
                continue
            if step is not None:  # the step asked for: damaged raises, no fallback
                state, self.restored = self._read_checked(fmt, s, into, map_location, check)
                return state
            tried.append(fmt.name(s))
            try:
                state, record = self._read_checked(fmt, s, into, map_location, check)
            except (ReadFailed, Refused):
                raise  # unreachable is not damaged: an older step would quietly undo progress; refused is refused
            except Exception as e:
                if not fmt.damaged(e):
                    raise
                warnings.warn(fmt.fallback_message(s, e), stacklevel=2)
                self._damaged.add(fmt.name(s))
                continue
            self.restored = record
            return state
        if tried:
            raise RuntimeError(f"no readable checkpoint under {self.root} (tried {tried})")
        return None

    def _read_checked(self, fmt, step, into, map_location, check, rec=None, precheck=None):
        """fmt.read of `step`, refused by `check` first where its record holds the position (see restore); `rec`:
        the sharded step's commit record, read already; precheck(position) runs `check` itself (under torchrun: as
        one decision)."""
        if check is not None and fmt.kind == "sharded" and rec is None:
            rec = fmt.marker(step)
        saved = (rec or {}).get("position") if check is not None else None
        if saved is not None:
            _as_refusal(precheck or check, saved)  # before DCP fills `into` in place
        state, record = fmt.read(step, into, map_location, rec=rec) if rec else fmt.read(step, into, map_location)
        if check is not None and saved is None:
            # one process: refused here; under torchrun (precheck) the restore's verdict makes it every process's
            _as_refusal(check, state) if precheck is None else check(state)
        return state, record

    def latest(self) -> dict | None:
        """The record of the newest commit: the `latest` pointer (one file) or the COMMITTED record of the
        newest sharded step, whichever is newer (both carry step and metrics). Under torchrun (rt given) a
        collective: process 0 reads, every process gets its answer (a store listed twice can answer twice)."""
        return self._agreed(self._latest_here)

    def _latest_here(self) -> dict | None:
        ptr = self.formats["file"].record()
        rec = self.formats["sharded"].record()
        if rec is not None and (ptr is None or rec["step"] > ptr["step"]):
            return rec
        return ptr
