"""torch_xla's persistent compile cache: compiled XLA programs kept on disk, so a second process
(a restarted Colab runtime, the next run of a script) loads them instead of compiling again.

    rt = labkit.setup()                        # TPU: on by default, in ~/.cache/labkit/xla-cache
    rt = labkit.setup(compile_cache="/data/xla-cache")   # a folder of your own (or True / False / "auto")
    rt.compile_cache                           # the folder in use, or None; rt.info["compile_cache"] says why

LABKIT_COMPILE_CACHE sets the same thing from the environment (1/0/yes/no/auto or a folder); an
argument to setup() wins over it. It wraps `torch_xla.runtime.initialize_cache(path, readonly)`, which
torch_xla 2.9 accepts only before the first computation of the process: creating the device is fine,
running a graph is not (the computation cache is built then, and reads XLA_PERSISTENT_CACHE_PATH once).

Where it helps (measured with torch_xla 2.9): on a TPU the PJRT client serialises executables, so the
second process's first step loads them (metric counter PersistentCacheHit). On XLA:CPU the first process
writes the files (PersistentCacheMiss), but the CPU client cannot deserialise them ("Deserializing
serialized executable not supported"): the second process counts PersistentCacheDeserializeFailure and
compiles again. That is why "auto" means on for TPU only; on XLA:CPU it is opt-in and only shows the
mechanism (files written, entries found by graph hash). CUDA and plain CPU do not run through XLA here:
the setting is ignored there (rt.info says so). A gs:// path is not supported: the cache is a local folder.

With several processes per host (xmp.spawn / torch_xla.launch) only local ordinal 0 writes; the others
read the cache (readonly), so two processes never write the same file at once.
"""

from __future__ import annotations

import os

from labkit import _xla
from labkit.config import FALSE, TRUE, parse_bool

ENV = "LABKIT_COMPILE_CACHE"
DEFAULT_DIR = os.path.join("~", ".cache", "labkit", "xla-cache")


def resolve(value, kind: str) -> tuple[str | None, str]:
    """The folder to use for backend `kind` (or None: off) and why, from setup()'s `compile_cache`
    argument; None there reads LABKIT_COMPILE_CACHE, then "auto" (on for TPU only).

    Accepts True/False, yes/no strings (labkit.config.parse_bool's words), "auto", or a folder
    (a path with a separator, or starting with ~ or .). Anything else is a ValueError naming the setting."""
    source = "compile_cache"
    if value is None:
        value = os.environ.get(ENV)
        source = ENV
        if value is None:
            value = "auto"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    path = None
    if isinstance(value, str):
        low = value.strip().lower()
        if low == "auto":
            if kind != "tpu":
                return None, f"off ({source}=auto: on for TPU only; {kind} does not load cached programs)"
            value = True
        elif low in TRUE or low in FALSE:
            value = parse_bool(low, source)
        elif low.startswith("gs://") or "://" in low:
            raise ValueError(f"{source}={value!r}: the compile cache must be a local folder (torch_xla reads files)")
        elif os.sep in value or "/" in value or value.startswith(("~", ".")):
            path = value
        else:
            raise ValueError(
                f"{source}={value!r} is neither yes/no, 'auto' nor a folder "
                f"(use one of {', '.join(TRUE)} / {', '.join(FALSE[:-1])}, auto, or a path such as {DEFAULT_DIR})"
            )
    elif not isinstance(value, bool):
        raise ValueError(f"{source}={value!r}: expected True, False, 'auto' or a folder path")
    if value is False:
        return None, f"off ({source})"
    if kind not in ("tpu", "xla-cpu"):
        return None, f"off: {kind} does not run through XLA, the XLA compile cache does not apply"
    folder = os.path.abspath(os.path.expanduser(path or DEFAULT_DIR))
    return folder, f"on ({source})"


def enable(folder: str, readonly: bool = False) -> tuple[str | None, str]:
    """Point torch_xla at `folder` (created if missing). Must run before the process's first XLA
    computation; afterwards it is too late unless the cache already uses this folder. Returns the folder
    in use (or None) and a note."""
    import torch_xla.runtime as xr

    current = os.environ.get("XLA_PERSISTENT_CACHE_PATH")
    if _xla.computation_cache_started():
        if current and os.path.abspath(current) == folder:
            return folder, "on"
        return None, (
            "off: XLA already ran a computation in this process before setup() could turn the compile cache "
            "on (call labkit.setup() first, or restart the runtime)"
            + (f"; the cache in use is {current}" if current else "")
        )
    os.makedirs(folder, exist_ok=True)
    xr.initialize_cache(folder, readonly=readonly)
    return folder, "on" + (" (read-only: another local process writes it)" if readonly else "")


def counters() -> dict:
    """torch_xla's persistent-cache counters of this process (PersistentCacheHit, ...Miss, ...Load,
    ...DeserializeFailure), zeros included: host-side, no device sync."""
    import torch_xla.debug.metrics as met

    names = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheLoad", "PersistentCacheDeserializeFailure")
    return {n: met.counter_value(n) or 0 for n in names}


def entries(folder: str | None) -> list[str]:
    """The cached programs in `folder` (one file per graph hash), sorted; [] if none or no folder."""
    if not folder or not os.path.isdir(folder):
        return []
    return sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f)))
