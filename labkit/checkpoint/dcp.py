"""The sharded checkpoint format: a DCP folder per step, committed by a COMMITTED marker.

`step-00001200/` holds torch.distributed.checkpoint's files (`__0_0.distcp`, `.metadata`, written with
torch_xla's SPMD planners, or DCP's default ones without torch_xla) and, written last and create-only,
`COMMITTED`: the step, the metrics, the best, the labkit that wrote it and the crc32c and size of every other
file. A folder without it is a save that did not finish. What each call does is the format interface of
labkit.checkpoint.formats; why the format is built this way is labkit.checkpoint.sharded's docstring.

Under torchrun (FSDP2: several processes, each holding its own shards; CheckpointManager(..., rt=rt)):

- Save, without stopping the training. On the training thread: this process's shards copied to new CPU tensors,
  then one agreement (the NaN check, the copy, process 0's lock and removal of an old copy of the step: a failure
  on any process fails the save on all, at once), then DCP's async_save of the copy on a gloo group of the
  checkpoint's own (labkit.checkpoint.together: a long timeout, and never the training's collectives), which
  returns once its plan is sent. In the manager's writer thread: DCP writes them into a local temp folder,
  each process stores its files with their crc32c, every process lists the step's folder and says which files it
  sees, process 0 commits once every part has landed, then prunes (a prune that fails is a warning on every
  process: the step is committed). At most one save is in flight (the next save() waits for
  it); wait() and close() finish it, and so does the SIGTERM path (labkit.interrupts.finish_pending_save).
  The training thread's stall per save, measured on this 2-core machine (2 gloo processes, tests/children/
  dcp_agreement.py, local folder, 3 saves 3 steps apart, load average 10-14 from other work: ranges, noisy): a tiny
  GPT (~0.2 MB of state) 0.11-0.53 s before (the whole save on the training thread), 0.05-0.09 s after; a 2-block
  GPT of width 1024 (292 MB per checkpoint with AdamW) 0.66-1.85 s before, 0.29-0.56 s after: the NaN check and the
  copy to the CPU (into the format's CpuMirror, labkit.checkpoint.staging; 0.47-0.91 s with torch's own stager, which copies each shard twice). A local
  root only renames the files; to gs:// the upload, which "before" also waited for, runs in the background too. The
  cost: host memory for a second copy of this process's shards until its save ends.
- A root some process cannot see (a local folder on each host) fails the save by name before the commit: a file
  another process wrote that this one does not list means no host could restore the step.
- Restore is one decision: process 0 lists the steps and reads each commit record, the plan is broadcast; each
  process reads and checks (crc32c, streamed to disk from gs://) only the files its own shards read; the verdicts are
  all-gathered, so a damaged file anywhere makes every process fall back to the same older step, the warning naming
  the file and the process (labkit.checkpoint.together.verdict). Cost: a listing and the records read once (process
  0), the bytes each process needs read once (not every file on every process), 2 small collectives per step tried.
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
from labkit.checkpoint.state import READ_TRIES, ReadFailed, _tensors
from labkit.checkpoint.state import read as read_checked
from labkit.checkpoint.together_dcp import ShardedTogether, folder_name
from labkit.checkpoint.writer import no_space
from labkit.cloud import gcs
from labkit.versions import __version__

MARKER = "COMMITTED"
_STEP = re.compile(r"^step-(\d{8,})$")
# one process and no process group is what this format means (no_dist=True); DCP warns on every call
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled", category=UserWarning)


class Sharded(ShardedTogether):
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
        writes its files (begin_together, finish_together), not one host, and restore is one decision
        (CheckpointManager's _restore_together)."""
        from labkit.torchrun import active

        return active(rt)

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
        if record.get("position"):  # what restore(check=...) refuses a resume by, before any tensor is read
            rec["position"] = record["position"]
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
    def _ensure(self, step: int, rec: dict, folder: str, download: bool, f: str) -> None:
        """The file `f` of the step, in `folder` and checked against the commit record's crc32c: downloaded there
        first (gs://, streamed to disk: never whole in memory), or read in place (a local root). Called by DCP's
        reader before it first reads `f`, so each process checks only the files its own shards read."""
        name, p = folder_name(step), os.path.join(folder, f)
        if f not in rec["files"]:
            raise OSError(f"{self._url(name, f)} is not listed in its commit record")
        if download:
            for i in range(READ_TRIES):
                try:
                    with self.store.open(f"{name}/{f}") as src, open(p, "wb") as out:
                        shutil.copyfileobj(src, out, 8 << 20)
                    break
                except FileNotFoundError:  # deleted since the commit: damaged (the store's message names it)
                    raise
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        free = shutil.disk_usage(folder).free >> 20
                        raise ReadFailed(
                            errno.ENOSPC,
                            f"no space left on {folder} ({free} MB free) while downloading {self._url(name)} to "
                            "restore it (the checkpoint is not damaged): free space there, or point TMPDIR at a "
                            "larger disk",
                        ) from e
                    last = e
                except Exception as e:  # requests' ConnectionError, the client's ServiceUnavailable ...
                    last = e
                if i + 1 == READ_TRIES:
                    raise ReadFailed(
                        f"reading checkpoint {self._url(name, f)} failed {READ_TRIES} times ({type(last).__name__}: "
                        f"{last}); it is not known to be damaged, so restore stops here instead of falling back"
                    ) from last
                time.sleep(0.5 * 2**i)
        if not os.path.exists(p) or gcs.crc32c_b64(p) != rec["files"][f].get("crc32c"):
            raise OSError(f"{self._url(name, f)} is missing or its crc32c does not match the commit record")

    def read(self, step, into=None, map_location="cpu", rec=None):
        """Load the step into `into` in place (tensors keep their device and sharding; plain values are
        replaced), or into new full CPU tensors; (state, commit record). `rec`: the commit record, when process 0
        read it for everyone (CheckpointManager's restore under torchrun); else read here. No collective: under
        torchrun each process loads its own shards, and the manager agrees on the outcome."""
        state = {} if into is None else into
        rec = self.marker(step) if rec is None else rec
        name = folder_name(step)
        safe_load.check_names(rec["files"], self._url(name))  # each is joined to the folder below
        local = self.store.local_path(name)  # a local root is read in place; gs:// files are downloaded
        folder = local or tempfile.mkdtemp(prefix=f"labkit-dcp-read-{os.getpid()}-")
        checked: set[str] = set()

        def ensure(f):
            if f not in checked:
                self._ensure(step, rec, folder, local is None, f)
                checked.add(f)

        try:
            planner = _planner(rec.get("planner", "spmd"), True, self._url(name))
            reader = safe_load.SafeReader(folder)  # unpickles data only: a planted file runs no code
            reader.listed = set(rec["files"])  # and reads only the files the commit record lists,
            reader.ensure = ensure  # each checked against its crc32c before its first read
            size = sum(int(info.get("size", 0)) for info in rec["files"].values())
            _add_missing(state, reader.read_metadata(), size, self._url(name))
            safe_load.load(state, reader, planner, self._url(name))
        except (safe_load.CheckpointRefused, OSError):
            raise
        except Exception as e:
            newer = safe_load.newer_labkit(rec.get("labkit"), self._url(name), e)
            if newer is None:
                raise
            raise newer from e
        finally:
            if local is None:
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
