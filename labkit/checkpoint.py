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
surface on the next save(), wait() or close(). The folder/GCS specifics live in labkit.storage.
"""
from __future__ import annotations

import io
import os
import random
import tempfile
import threading
import time
import warnings

import numpy as np
import torch

from . import gcs
from .storage import NAME as _NAME, GCSStore, LocalStore

def object_name(step: int) -> str:
    return f"ckpt-{int(step):08d}.pt"


# -- state conversion ----------------------------------------------------------------------------
def to_cpu(state, rt=None):
    """Copy every tensor of a nested state to the CPU. On XLA all tensors go in one batched
    transfer (what xm.save does), so saving adds no compile and one device->host copy."""
    leaves: list = []

    def collect(o):
        if torch.is_tensor(o):
            leaves.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                collect(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v)

    collect(state)
    xla = [t for t in leaves if t.device.type == "xla"]
    moved = {}
    if xla:
        import torch_xla.core.xla_model as xm

        for t, c in zip(xla, xm._maybe_convert_to_cpu(xla)):
            moved[id(t)] = c
    for t in leaves:
        if id(t) not in moved:
            # clone: the trainer keeps updating its CPU tensors in place while the upload runs
            moved[id(t)] = t.detach().to("cpu", copy=True)

    def rebuild(o, path):
        if torch.is_tensor(o):
            return moved[id(o)]
        if isinstance(o, dict):
            return {k: rebuild(v, f"{path}[{k!r}]") for k, v in o.items()}
        if isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
            return [rebuild(v, f"{path}[{i}]") for i, v in enumerate(o)]  # tuples become lists: weights_only-safe
        if isinstance(o, np.generic):  # e.g. a scheduler's lr computed with np.cos: torch.load(weights_only) refuses it
            return o.item()
        if isinstance(o, np.ndarray):
            return torch.from_numpy(np.array(o))
        if o is None or isinstance(o, _PLAIN):
            return o
        raise TypeError(f"{path} is a {type(o).__module__}.{type(o).__qualname__}: a checkpoint holds only tensors, "
                        "numbers, strings, lists and dicts (what torch.load(weights_only=True) accepts); "
                        "convert it before saving")

    return rebuild(state, "state")


_PLAIN = (bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)


def rng_state(rt=None) -> dict:
    """Python, numpy, torch (+ XLA or CUDA) generator states as weights_only-safe values."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"python": [py[0], list(py[1]), py[2]],
           "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                     "has_gauss": int(has_gauss), "gauss": float(gauss)},
           "torch": torch.get_rng_state()}
    if rt is not None and rt.is_xla:
        import torch_xla.core.xla_model as xm

        out["xla"] = int(xm.get_rng_state())
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict, rt=None) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "xla" in state and rt is not None and rt.is_xla:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state["xla"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def versions() -> dict:
    from . import __version__

    out = {"labkit": __version__, "torch": str(torch.__version__)}
    try:
        import torch_xla

        out["torch_xla"] = str(torch_xla.__version__)
    except ImportError:
        pass
    return out


def check_compatible(model_state: dict, target_model) -> None:
    """Raise ValueError naming the first key whose presence or shape differs."""
    target = target_model.state_dict()
    for k, v in model_state.items():
        if k not in target:
            raise ValueError(f"checkpoint key {k!r} is not in the model ({type(target_model).__name__})")
        if tuple(v.shape) != tuple(target[k].shape):
            raise ValueError(f"shape mismatch at {k!r}: checkpoint {tuple(v.shape)}, model {tuple(target[k].shape)}")
    for k in target:
        if k not in model_state:
            raise ValueError(f"model key {k!r} is missing from the checkpoint")


# -- the manager ----------------------------------------------------------------------------------
class CheckpointManager:
    def __init__(self, root, keep: int = 3, best_metric: str | None = "val_acc", mode: str = "max",
                 async_save: bool = True, rt=None, save_every: int | None = None, retry_deadline_s: float = 60):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        self.root, self.keep, self.best_metric, self.mode = str(root), max(int(keep), 1), best_metric, mode
        self.async_save, self.save_every = async_save, save_every
        if rt is None:
            from .device import current_runtime

            rt = current_runtime()
        self.rt = rt
        self.store = GCSStore(self.root, retry_deadline_s) if gcs.is_gcs(self.root) else LocalStore(self.root)
        ptr = self.store.read_pointer()  # every replica: the same best value -> the same save decisions
        self.best = ptr.get("best") if ptr else None  # {"step", "name", "value"}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def _master(self) -> bool:
        return self.rt is None or self.rt.is_master

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
        if improved:
            self.best = {"step": int(step), "name": object_name(step), "value": value}
        cpu = to_cpu(state, self.rt)  # every replica: keeps XLA graphs identical across replicas
        if not self._master:
            return True
        self.wait()  # at most one pending upload
        meta = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, str))}
        if self.async_save:
            self._thread = threading.Thread(target=self._write_guarded, args=(step, cpu, meta, dict(self.best or {})),
                                            name=f"labkit-ckpt-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(step, cpu, meta, self.best)
        return True

    def _write_guarded(self, *args):
        try:
            # lower this thread's CPU priority: serializing and uploading should take idle cycles,
            # not the host threads that feed and run the training step (Linux: per-thread nice)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
            self._write(*args)
        except BaseException as e:  # surfaced on the next save()/wait()
            self._error = e

    def _write(self, step, cpu_state, metrics, best):
        name = object_name(step)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.store.tmpdir())
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(cpu_state, f)
            crc, size = gcs.crc32c_b64(tmp), os.path.getsize(tmp)
            if os.environ.get("LABKIT_CKPT_KILL_IN_UPLOAD") == str(step):  # tests: die mid-save
                os.kill(os.getpid(), 9)
            self.store.put(tmp, name, crc)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.store.write_pointer({"name": name, "step": int(step), "crc32c": crc, "size": size,
                                  "metrics": metrics, "best": best or None, "time": time.time()})
        self._prune(name, best)

    def _prune(self, newest, best):
        names = self.store.names()
        keep = set(names[-self.keep:]) | {newest}
        if best and best.get("name"):
            keep.add(best["name"])
        for n in names:
            if n not in keep:
                self.store.delete(n)

    def _raise_pending(self):
        err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"an earlier checkpoint save to {self.root} failed: {err}") from err

    def wait(self) -> None:
        """Block until the pending upload finished; re-raise its error."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        self._raise_pending()

    def close(self) -> None:
        self.wait()

    # -- reading -----------------------------------------------------------------------------------
    def _load(self, name, expect_crc=None):
        data = self.store.get(name)
        if expect_crc is not None and gcs.crc32c_b64(data) != expect_crc:
            raise IOError(f"crc32c of {self.store.url(name)} does not match the pointer")
        return data

    def restore(self, step: int | None = None, map_location="cpu"):
        """The state dict of `latest` (or of `step`), or None when nothing was saved. A corrupt
        newest object warns and falls back to the previous one."""
        self.wait()
        if step is not None:
            name = object_name(step)
            if name not in self.store.names():
                raise FileNotFoundError(f"no checkpoint {self.store.url(name)}")
            return torch.load(io.BytesIO(self._load(name)), map_location=map_location, weights_only=True)
        ptr = self.store.read_pointer()
        names = self.store.names()
        if ptr is None and not names:
            return None
        candidates = []
        if ptr is not None:
            candidates.append((ptr["name"], ptr.get("crc32c")))
        newest = _step_of(ptr["name"]) if ptr else None
        candidates += [(n, None) for n in reversed(names) if newest is None or _step_of(n) < newest]
        for name, crc in candidates:
            try:
                return torch.load(io.BytesIO(self._load(name, crc)), map_location=map_location, weights_only=True)
            except Exception as e:
                warnings.warn(f"checkpoint {self.store.url(name)} is unreadable ({type(e).__name__}: {e}); "
                              "falling back to the previous one")
        raise RuntimeError(f"no readable checkpoint under {self.root} (tried {[c[0] for c in candidates]})")

    def latest(self) -> dict | None:
        return self.store.read_pointer()


def _step_of(name: str) -> int:
    return int(_NAME.match(name).group(1))
