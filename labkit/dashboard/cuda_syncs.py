"""Host syncs on CUDA, counted per line: torch's sync debug mode turns every call that makes the host wait for the GPU
(`.item()`, `float(t)`, `if t:`, `.cpu()`, a copy to pageable memory) into a warning; this counts them instead of
printing them, with the line of your code that made each one.

    counter = HostSyncCounter().start()      # the Dashboard starts one where the runtime's device is CUDA
    ...train...
    counter.take()                           # {Site('train.py', 41, 'if loss > 1:'): 20, None: 4}  (None: labkit's own)
    counter.stop()

torch.cuda.set_sync_debug_mode("warn") is process-wide; stop() puts back the mode that was set, warnings.showwarning and
the warnings filter it added (the Dashboard calls it when fit() returns or raises). Each counted sync
costs a Python warning and a stack walk (a few us) on top of the sync itself; a step without syncs costs nothing.
Not verified on a GPU here (this project's CI has none): the counting of the warnings is tested on the CPU by
issuing torch's own warning text; that CUDA raises it for each synchronising call is torch's documented behaviour.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

from labkit.codepaths import is_labkit_file, under
from labkit.dashboard.syncs import Site, user_site

SYNC_WARNING = "called a synchronizing CUDA operation"  # the text of torch's warning in sync debug mode "warn"


def applies(rt) -> bool:
    """Whether the runtime computes on a CUDA device (the one place that asks)."""
    dev = getattr(rt, "device", None)
    return getattr(dev, "type", None) == "cuda"


def _from_labkit() -> bool:
    """Whether the innermost frame outside torch and the standard library is labkit's (its own batched read)."""
    import sys
    import sysconfig

    import torch

    skip = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"])
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if not under(fn, *skip) and not fn.startswith("<frozen"):
            return is_labkit_file(fn) and os.path.realpath(fn) != os.path.realpath(__file__)
        f = f.f_back
    return False


class HostSyncCounter:
    """Counts torch's sync warnings per user line; labkit's own reads (the loop's batched read) are keyed None."""

    def __init__(self):
        self.syncs: Counter = Counter()  # Site (or None: labkit's own) -> syncs since the last take()
        self.total: Counter = Counter()
        self.active = False
        self._saved = None
        self._filter = None
        self._mode = None

    def start(self) -> HostSyncCounter:
        if self.active:
            return self
        import torch

        if torch.cuda.is_available():
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        self._saved = warnings.showwarning
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")  # every one, not once per line
        self._filter = warnings.filters[0]  # the entry just added: stop() removes it, and only it
        warnings.showwarning = self._show
        self.active = True
        return self

    def stop(self) -> None:
        if not self.active:
            return
        import torch

        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        if warnings.showwarning == self._show:  # replaced since by someone else: theirs stays
            warnings.showwarning = self._saved
        if self._filter in warnings.filters:
            # no cache to clear: under "always" Python records no warning as already shown
            warnings.filters.remove(self._filter)
        self.active = False

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return self._saved(message, category, filename, lineno, file, line)
        self.count(None if _from_labkit() else user_site(2))

    def count(self, site: Site | None) -> None:
        """One sync at `site` (None: labkit's own read)."""
        self.syncs[site] += 1
        self.total[site] += 1

    def take(self) -> dict:
        """{Site or None: syncs} since the previous call."""
        out, self.syncs = dict(self.syncs), Counter()
        return out
