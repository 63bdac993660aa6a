"""Which lines of your code make the host wait for the device, and which made XLA compile.

    finder = SyncFinder()
    with finder:                          # or Dashboard(find_syncs=True), on by default on XLA
        for step in range(20): ...        # your loop, unchanged
    finder.syncs                          # {Site('train.py', 41, 'if loss > 1:'): 20, ...}
    finder.compiles                       # [Site(...) of each sync / read that compiled a graph]

On a lazy XLA device nothing runs until something needs a value on the host: `.item()`,
`float(t)`, `if t:`, `print(t)`, `t.tolist()`, `t.cpu()`, `t.numpy()`. Each one executes the
pending graph (compiling it first if it is new) and copies the result back: a host sync that
stalls the pipeline. While a finder is active those Tensor methods and `torch_xla.sync` are
wrapped. A wrapped call on an XLA tensor reads two host-side counters before and after it
(`TransferFromDeviceTime` samples, `UncachedCompile`; ~2 us, no device access) and, only when one
moved, walks the Python stack to the first frame outside torch, torch_xla, labkit and the
standard library: that is the line to fix. Calls on CPU/CUDA tensors pay one attribute check
(~0.2 us). Nothing is added to the graph and no transfer is added: the finder only watches the
ones your code makes (tests/test_syncs.py counts them). Reads that labkit itself makes (the
loop's one batched read per log interval in a step closure) are not wrapped methods and are
not counted.

The wrapping is process-wide (torch.Tensor's methods) and undone when the last active finder
exits; nested and repeated use is fine. Python-level only: a transfer made inside C++ (a CPU
fallback of an aten op) is counted by labkit.dashboard.health, not here.
"""

from __future__ import annotations

import linecache
import os
import sys
import threading
from collections import Counter
from typing import NamedTuple

import torch

# Tensor methods that copy device -> host (each executes the pending graph first)
_READS = (
    "item",
    "to",  # .to("cpu"): counted only when it really copies from the device (see _wrap)
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__format__",
    "__repr__",
    "__array__",
)


class Site(NamedTuple):
    """A line of user code: file, line number, the source text, and the function it is in."""

    file: str
    line: int
    code: str
    func: str = ""

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line} {self.code}".rstrip()


def _roots() -> tuple[str, ...]:
    import sysconfig

    roots = [
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # all of labkit
        sysconfig.get_paths()["stdlib"],
    ]
    if "torch_xla" in sys.modules:
        roots.append(os.path.dirname(sys.modules["torch_xla"].__file__))
    return tuple(os.path.realpath(r) + os.sep for r in roots)


_internal_cache: dict[str, bool] = {}


def _is_internal(filename: str, roots: tuple[str, ...]) -> bool:
    hit = _internal_cache.get(filename)
    if hit is None:
        real = os.path.realpath(filename) if not filename.startswith("<") else filename
        hit = real.startswith(roots) or filename.startswith("<frozen")
        _internal_cache[filename] = hit
    return hit


def user_site(skip: int = 1, roots: tuple[str, ...] | None = None) -> Site | None:
    """The innermost frame of the caller's stack that is user code (not torch, torch_xla, labkit
    or the standard library), or None. Costs a few microseconds: call it only when needed."""
    roots = roots or _roots()
    f = sys._getframe(skip + 1)
    while f is not None:
        fn = f.f_code.co_filename
        if not _is_internal(fn, roots):
            return Site(fn, f.f_lineno, linecache.getline(fn, f.f_lineno).strip(), f.f_code.co_name)
        f = f.f_back
    return None


def _counters():
    import torch_xla.debug.metrics as met

    d = met.metric_data("TransferFromDeviceTime")
    return (d[0] if d else 0), (met.counter_value("UncachedCompile") or 0)


class _Patch:
    """The process-wide wrapping, shared by every active finder (refcounted)."""

    def __init__(self):
        self.finders: list[SyncFinder] = []
        self.saved: dict[str, object] = {}
        self.local = threading.local()
        self.roots: tuple[str, ...] = ()

    def add(self, finder: SyncFinder) -> None:
        if not self.finders:
            self.roots = _roots()
            for name in _READS:
                self.saved[name] = torch.Tensor.__dict__.get(name)
                setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name), transfer=True))
            if "torch_xla" in sys.modules:
                import torch_xla
                import torch_xla.core.xla_model as xm

                self.saved["sync"], self.saved["mark_step"] = torch_xla.sync, xm.mark_step
                torch_xla.sync = self._wrap(torch_xla.sync, transfer=False)
                xm.mark_step = self._wrap(xm.mark_step, transfer=False)
        self.finders.append(finder)

    def remove(self, finder: SyncFinder) -> None:
        self.finders.remove(finder)
        if self.finders:
            return
        for name in _READS:
            if self.saved[name] is None:
                delattr(torch.Tensor, name)  # it was inherited from torch._C.TensorBase
            else:
                setattr(torch.Tensor, name, self.saved[name])
        if "sync" in self.saved:
            import torch_xla
            import torch_xla.core.xla_model as xm

            torch_xla.sync, xm.mark_step = self.saved.pop("sync"), self.saved.pop("mark_step")

    def _wrap(self, fn, transfer: bool):
        patch = self

        def wrapper(*args, **kwargs):
            # only the outermost wrapped call counts (print(t) -> __repr__ -> item ...)
            if getattr(patch.local, "busy", False) or (transfer and not args[0].is_xla):
                return fn(*args, **kwargs)
            patch.local.busy = True
            try:
                x0, c0 = _counters()
                out = fn(*args, **kwargs)
                x1, c1 = _counters()
            finally:
                patch.local.busy = False
            if (transfer and x1 > x0) or c1 > c0:
                site = user_site(1, patch.roots)
                for f in patch.finders:
                    f._record(site, transfer and x1 > x0, c1 - c0, fn.__name__)
            return out

        wrapper.__name__, wrapper.__doc__, wrapper.__wrapped__ = fn.__name__, fn.__doc__, fn
        return wrapper


_patch = _Patch()


class SyncFinder:
    """Counts device->host reads per user line and notes the line of each compile; see the module
    docstring. `take()` returns the counts since the last take (a window of steps) and starts a new one."""

    def __init__(self):
        self.syncs: Counter = Counter()  # Site -> reads since the last take()
        self.total: Counter = Counter()  # Site -> reads since the start
        self.compiles: list[dict] = []  # {"site", "graphs", "via"} for each triggering call
        self.step_reads: list[tuple] = []  # (Site, via) of each read since the last take_compiles()
        self.active = False

    def start(self) -> SyncFinder:
        if not self.active and "torch_xla" in sys.modules:
            _patch.add(self)
            self.active = True
        return self

    def stop(self) -> None:
        if self.active:
            _patch.remove(self)
            self.active = False

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()

    def _record(self, site: Site | None, transfer: bool, graphs: int, via: str) -> None:
        if transfer:
            self.syncs[site] += 1
            self.total[site] += 1
            self.step_reads.append((site, via))
        if graphs:
            self.compiles.append({"site": site, "graphs": graphs, "via": via})

    def take(self) -> dict:
        """{Site: reads} since the previous call (None as the key: no user frame on the stack)."""
        out, self.syncs = dict(self.syncs), Counter()
        return out

    def take_compiles(self) -> tuple[list[dict], list[tuple]]:
        """The compiles and the reads (Site, method) since the previous call: one step's worth."""
        out, reads = self.compiles, self.step_reads
        self.compiles, self.step_reads = [], []
        return out, reads

    def report(self, top: int = 10) -> str:
        if not self.total:
            return "no device->host reads from your code"
        return "\n".join(f"{n:6d}  {site}" for site, n in self.total.most_common(top))
