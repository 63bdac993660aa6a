"""Reading a checkpoint runs no code and writes nowhere but its own temp folder.

    reader = SafeReader(folder)                     # a DCP FileSystemReader that only unpickles data
    _add_missing(state, reader.read_metadata())     # CheckpointRefused (an OSError) naming file and global
    load(state, reader, planner, "gs://b/run/step-00000100")   # DCP's errors as a RuntimeError naming the step
    check_names(rec["files"], "gs://b/run/step-00000100")      # file names of a commit record: plain names only

Why: a pickle runs whatever its globals name (`os.system`, ...). torch.distributed.checkpoint (DCP)
reads its `.metadata` with plain `pickle.load`, and with DCP's own ("default") planner every plain
value of the state (`load_bytes`) with `torch.load(weights_only=False)`: a planted file in a
checkpoint folder or bucket would run its code on restore. Here `.metadata` goes through an
unpickler that admits only the globals a DCP metadata file holds (listed below, found by writing
this project's states with both planners and recording every global the unpickler asked for), and
byte entries must pass `torch.load(weights_only=True)` before the planner sees them (cost: each
plain value is unpickled twice; they are small: param_groups, counters, RNG state).

A refused file is an OSError, like a file whose crc32c does not match: the manager warns and falls
back to the previous committed step.
"""

from __future__ import annotations

import inspect
import os
import pickle
import re

import torch
from torch.distributed.checkpoint import FileSystemReader

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

# (module, name) admitted besides the classes defined in DCP's metadata module, and why each is needed
ADMITTED = {
    # where each stored piece lies in the .distcp files (offset, length): DCP's file-system storage record
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),  # the global shape of each tensor and of each chunk
    ("torch.serialization", "_get_layout"),  # TensorProperties.layout (torch.strided), from its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the folder DCP wrote to
    # plain containers a metadata file may hold when pickled with an older protocol; they build no code
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class CheckpointRefused(OSError):
    """A checkpoint file that reading would let run code or write outside its folder; restore treats
    it like a damaged file (warns, falls back to the previous step)."""


def _admitted(module: str, name: str) -> bool:
    if (module, name) in ADMITTED:
        return True
    if module == "torch":  # dtypes (torch.float32, torch.bfloat16 ...): TensorProperties.dtype
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module == _DCP_METADATA:  # Metadata, TensorStorageMetadata, ChunkStorageMetadata, ...: classes DCP defines
        import torch.distributed.checkpoint.metadata as md

        obj = getattr(md, name, None)
        return inspect.isclass(obj) and obj.__module__ == _DCP_METADATA
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, where: str):
        super().__init__(f)
        self.where = where

    def find_class(self, module, name):
        if not _admitted(module, name):
            raise CheckpointRefused(
                f"{self.where} refers to {module}.{name}, which a DCP metadata file never holds: refusing to load it "
                "(unpickling it could run code)"
            )
        return super().find_class(module, name)


def read_metadata(path) -> object:
    """DCP's Metadata from a `.metadata` file, unpickled with only metadata classes admitted."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = str(path)
    with open(path, "rb") as f:
        try:
            md = _MetadataUnpickler(f, where).load()
        except CheckpointRefused:
            raise
        except Exception as e:  # truncated or garbage: UnpicklingError, EOFError, ValueError ...
            raise CheckpointRefused(f"{where} is not a readable DCP metadata file ({type(e).__name__}: {e})") from e
    if not isinstance(md, Metadata):
        raise CheckpointRefused(f"{where} holds a {type(md).__name__}, not DCP metadata")
    return md


class _WeightsOnlyBytes:
    """The load planner, except that a byte entry must pass torch.load(weights_only=True) before the
    planner's own load_bytes (DCP's default planner unpickles it with weights_only=False)."""

    def __init__(self, planner, where: str):
        self._planner, self._where = planner, where

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value):
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            m = re.search(r"GLOBAL (\S+)", str(e))
            why = f"it refers to {m.group(1)}" if m else f"{type(e).__name__}: {str(e).splitlines()[0]}"
            raise CheckpointRefused(
                f"{self._where}: the entry {read_item.dest_index.fqn!r} is not plain data ({why}); refusing to load it"
            ) from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader for one local folder: `.metadata` through the restricted unpickler,
    byte entries through torch.load(weights_only=True). Tensors DCP already reads with weights_only."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = read_metadata(os.path.join(str(self.path), ".metadata"))  # one process: no per-rank file
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does after its load
        return md

    def read_data(self, plan, planner):
        return super().read_data(plan, _WeightsOnlyBytes(planner, str(self.path)))


def load(state: dict, reader: SafeReader, planner, where: str) -> None:
    """dcp.load in one process. DCP reports any failure as a CheckpointException (a BaseException,
    with a traceback per rank in its text): raise it as a RuntimeError naming `where` and the first
    underlying error instead, chained; a refused entry stays a CheckpointRefused (restore falls back)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:
        first = next((exc for exc, _ in e.failures.values()), None)
        if isinstance(first, CheckpointRefused):
            raise first from e
        why = f"{type(first).__name__}: {first}" if first is not None else str(e).splitlines()[0]
        raise RuntimeError(f"loading {where} failed: {why}") from e


def check_names(names, where: str) -> None:
    """Each file named in a commit record must be a plain file name: restore writes it to
    os.path.join(temp folder, name), so `../x`, `/abs/x` or `a/b` would write outside it."""
    for n in names:
        plain = isinstance(n, str) and n not in ("", ".", "..") and "\0" not in n
        if not plain or "/" in n or "\\" in n or os.path.isabs(n) or os.path.basename(n) != n:
            raise CheckpointRefused(f"{where}: its commit record names the file {n!r}, which is not a plain file name")
