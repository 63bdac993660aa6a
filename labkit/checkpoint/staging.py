"""The CPU copy a sharded save writes from, kept by its manager and refilled at each save; the NaN check before it.

    mirror = CpuMirror()                   # one per CheckpointManager (its sharded format holds it)
    staged = mirror.stage(state)           # every tensor copied into the mirror's CPU tensors; DTensors stay DTensors
    bad = first_nonfinite(state)           # the path of the first tensor holding NaN/inf, or None

On a GPU a save copies every shard of the weights and the optimizer's state to the host before it writes. Three
costs that a copy per tensor pays, and what this module does instead:
- allocation: new host tensors at every save. The mirror allocates once, at the first save, and refills the same
  tensors after (a tensor whose shape, dtype or placement changed gets a new one).
- waiting: a blocking copy waits for the device once per tensor. The mirror's host tensors are pinned (page-locked,
  on CUDA only), so each copy is issued non_blocking, and one stream synchronize per device ends them all.
- the NaN check: `bool(t.isfinite().all())` per tensor is one device-to-host read per tensor. first_nonfinite stacks
  the per-tensor verdicts on each device and reads them in one transfer per device.
On the CPU (gloo, the tests) the same code runs: no pinning, copy_ is a memcpy, and there is nothing to synchronize.

torch's own stager (FileSystemWriter(cache_staged_state_dict=True), BlockingAsyncStager) also keeps a pinned mirror,
but copies each tensor blocking. bench/bench_stage.py times both on whatever device is there and prints the ratio.
The mirror may be refilled only once the previous save's writer is done with it: CheckpointManager waits for the
previous save before it stages the next (at most one in flight).

Its footprint: one host copy of this process's share of the state (its shards of the weights and of the optimizer's
state; `nbytes` says how much), from the first background save until the manager's close(), which frees it. A tensor
whose shape, dtype or placement changed gives its old host tensor up before the new one is made, so a save never holds
two copies of it. On the CPU, where the live state is host memory too, that is the state twice while the manager
lives: measured with tests/test_staging.py's state, nbytes equals the state's bytes after any number of saves.
"""

from __future__ import annotations

import copy

import torch

from labkit.checkpoint.state import _tensors


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return ()
    return DTensor


def _local(t):
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if isinstance(t, _dtensor_type()) else t


class CpuMirror:
    """CPU tensors that hold the last staged state, reused from one save to the next. `allocations` counts the
    host tensors made (the first save's, and any whose source changed shape, dtype or placement since)."""

    def __init__(self):
        self._bufs: dict = {}  # path -> (staged tensor or DTensor, its local CPU tensor)
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Host bytes the mirror holds now (its local CPU tensors)."""
        return sum(buf.numel() * buf.element_size() for _, buf in self._bufs.values())

    def stage(self, state):
        """A copy of `state` that later training steps cannot change: every tensor copied into this mirror's CPU
        tensors (a DTensor stays a DTensor: its local shard copied, its mesh and placements kept), dicts, lists and
        tuples rebuilt, ints, floats, strings and bytes shared, anything else deep-copied. Copies from a CUDA device
        are non_blocking into pinned memory, and one synchronize per device ends them before this returns."""
        devices: set = set()
        seen: dict = {}
        out = self._copy(state, (), devices, seen)
        self._bufs = seen  # a path not in this state any more frees its tensor
        for d in devices:
            torch.cuda.current_stream(d).synchronize()  # the one wait: every copy to this host is done
        return out

    def _copy(self, o, path, devices, seen):
        if isinstance(o, torch.Tensor):
            src = _local(o.detach())
            staged, buf = self._buffer(o, src, path)
            seen[path] = (staged, buf)
            cuda = src.device.type == "cuda"
            buf.copy_(src, non_blocking=cuda and buf.is_pinned())
            if cuda:
                devices.add(src.device)
            return staged
        if isinstance(o, dict):
            return {k: self._copy(v, path + (k,), devices, seen) for k, v in o.items()}
        if type(o) in (list, tuple):
            return type(o)(self._copy(v, path + (i,), devices, seen) for i, v in enumerate(o))
        if o is None or isinstance(o, (bool, int, float, str, bytes)):
            return o
        return copy.deepcopy(o)

    def _buffer(self, o, src, path):
        """The mirror's (staged, local CPU tensor) for `o` at `path`: the kept one if it still fits, else new."""
        kept = self._bufs.get(path)
        if kept is not None and _fits(kept, o, src):
            return kept
        self._bufs.pop(path, None)  # the old host tensor is freed before the new one is made
        del kept
        self.allocations += 1
        pin = src.device.type == "cuda" and torch.cuda.is_available()  # page-locked host memory: CUDA only
        buf = torch.empty_like(src, device="cpu", pin_memory=pin)
        if isinstance(o, _dtensor_type()):
            staged = o.detach().to("cpu")  # a DTensor of this mesh and placements (torch's own stager does the same)
            staged._local_tensor = buf  # whose local shard is the mirror's tensor
            return staged, buf
        return buf, buf


def _fits(kept, o, src) -> bool:
    staged, buf = kept
    if buf.shape != src.shape or buf.dtype != src.dtype or buf.stride() != src.stride():
        return False
    if isinstance(o, _dtensor_type()):
        return isinstance(staged, _dtensor_type()) and staged.placements == o.placements and staged.shape == o.shape
    return not isinstance(staged, _dtensor_type())


def first_nonfinite(state) -> str | None:
    """The path of the first floating-point tensor holding NaN/inf among this process's tensors (a DTensor's local
    shard: no collective), else None. One verdict per tensor, stacked on its device: one device-to-host read per
    device, not one per tensor."""
    found = [(p, _local(t.detach())) for p, t in _tensors(state)]
    found = [(p, t) for p, t in found if t.is_floating_point() and t.numel()]
    by_device: dict = {}
    for i, (_, t) in enumerate(found):
        by_device.setdefault(t.device, []).append(i)
    bad = []
    for where in by_device.values():
        ok = torch.stack([found[i][1].isfinite().all() for i in where]).cpu()  # the one read for this device
        bad += [i for i, fine in zip(where, ok.tolist()) if not fine]
    return (found[min(bad)][0] or "a tensor") if bad else None
