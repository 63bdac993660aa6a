"""Checkpoint names and the `latest` pointer, kept in any versioned store (labkit.cloud.protocol.VersionedStore).

    ptr = Pointer(store)
    ptr.read()                                    # {"name": "ckpt-00000100.pt", "step": 100, ...} or None
    ptr.write({"name": object_name(200), "step": 200})   # replaces exactly the pointer last read, else RuntimeError

The pointer is the one object a writer replaces: on gs:// the write is conditional on the generation last read
(two runs on one prefix: the second write fails, loudly); in a folder the writer's flock already excludes others.
"""

from __future__ import annotations

import json
import re
import warnings

from labkit.cloud.protocol import VersionConflict

NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
POINTER = "latest"
_UNREAD = object()


def object_name(step: int) -> str:
    return f"ckpt-{int(step):08d}.pt"


def step_of(name: str) -> int:
    return int(NAME.match(name).group(1))


def parse_pointer(data: bytes, where: str):
    """The `latest` JSON as a dict, or None (with a warning naming the file) when it is empty,
    garbage, or not a pointer: the manager then falls back to the newest verified object."""
    try:
        ptr = json.loads(data)
        if isinstance(ptr, dict) and NAME.match(str(ptr.get("name"))) and isinstance(ptr.get("step"), int):
            return ptr
        why = f"not a checkpoint pointer: {str(ptr)[:80]!r}"
    except (ValueError, UnicodeDecodeError) as e:
        why = f"{type(e).__name__}: {e}"
    warnings.warn(
        f"{where} is unreadable ({why}); ignoring it and falling back to the newest verified checkpoint", stacklevel=3
    )
    return None


class Pointer:
    """The `latest` object of one store, and the version of it this writer last saw."""

    def __init__(self, store):
        self.store = store
        self.version = _UNREAD  # of `latest` as last read or written (store-defined; gs://: 0 = create only)

    def read(self, track: bool = True):
        """The pointer, or None. track=True: its version becomes the one the next write must replace; False (a
        look only) leaves that alone, so a pointer moved meanwhile still fails the next write."""
        data, version = self.store.get_versioned(POINTER)
        if track:
            self.version = version  # even for a garbage pointer: our next write replaces exactly it
        return None if data is None else parse_pointer(data, self.store.url(POINTER))

    def write(self, data: dict) -> None:
        if self.version is _UNREAD:
            self.read()
        try:
            self.version = self.store.put_if_version(POINTER, json.dumps(data).encode(), self.version)
        except VersionConflict:
            raise RuntimeError(
                f"{self.store.url(POINTER)} was moved by another writer (expected version {self.version}); two runs "
                "are saving to the same prefix"
            ) from None
