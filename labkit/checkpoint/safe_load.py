"""Reading a checkpoint runs no code and writes nowhere but its own temp folder.

    reader = SafeReader(folder)                     # a DCP FileSystemReader that only unpickles data
    _add_missing(state, reader.read_metadata())     # CheckpointRefused (an OSError) naming file and global
    load(state, reader, planner, "gs://b/run/step-00000100")   # DCP's errors as a RuntimeError naming the step
    check_names(rec["files"], "gs://b/run/step-00000100")      # file names of a commit record: plain names only
    torch_load(data, "gs://b/run/ckpt-00000100.pt")            # weights_only; names a newer labkit if it fails

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
import io
import os
import pickle
import pickletools
import re
import zipfile

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
    ("pathlib._local", "PosixPath"),  # the same class as Python 3.13 pickles it (pathlib became a package)
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


def _why(e: Exception) -> str:
    """The line that matters of a torch.load(weights_only=True) error (its text is ~10 lines of advice)."""
    m = re.search(r"GLOBAL (\S+)", str(e))
    lines = str(e).strip().splitlines()
    return f"it refers to {m.group(1)}" if m else f"{type(e).__name__}: {lines[0] if lines else ''}"


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
            raise CheckpointRefused(
                f"{self._where}: the entry {read_item.dest_index.fqn!r} is not plain data ({_why(e)}); "
                "refusing to load it"
            ) from None
        value.seek(0)
        self._planner.load_bytes(read_item, value)


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader for one local folder: `.metadata` through the restricted unpickler,
    byte entries through torch.load(weights_only=True). Tensors DCP already reads with weights_only."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self.ensure is not None:
            self.ensure(".metadata")
        md = read_metadata(os.path.join(str(self.path), ".metadata"))  # one process: no per-rank file
        self._check_storage(md)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does after its load
        return md

    listed: set | None = None  # the file names the commit record lists; None: not checked
    # ensure(name): called before a file is first read (downloads it, checks its crc32c; labkit.checkpoint.dcp):
    # a process checks only the files its own shards read, not every process's
    ensure = None

    def _check_storage(self, md) -> None:
        """Every piece must come from a plain file name the commit record lists: DCP joins the
        `relative_path` of `.metadata` to the folder, so an absolute or `../` one reads a file outside it
        (whose crc the record never covered)."""
        where = os.path.join(str(self.path), ".metadata")
        for info in (getattr(md, "storage_data", None) or {}).values():
            rel = getattr(info, "relative_path", None)
            try:
                check_names([rel], where)
            except CheckpointRefused:
                raise CheckpointRefused(
                    f"{where} reads a tensor from {rel!r}, which is not a plain file name in the step's folder: "
                    "refusing to load it"
                ) from None
            if self.listed is not None and rel not in self.listed:
                raise CheckpointRefused(f"{where} reads a tensor from {rel!r}, a file its commit record does not list")

    def read_data(self, plan, planner):
        if self.ensure is not None:
            for name in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
                self.ensure(name)
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
        if isinstance(first, KeyboardInterrupt):  # Ctrl-C (or SIGTERM) while reading: an interrupt, not a failure
            raise first from None
        if isinstance(first, (CheckpointRefused, OSError)):  # refused, damaged (a crc32c), unreachable (ReadFailed)
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


# -- a checkpoint from a newer labkit ---------------------------------------------------------------------
def saved_labkit(data: bytes) -> str | None:
    """The labkit version a one-file checkpoint records (state["versions"]["labkit"], what the Trainer
    saves), read from the pickle's opcodes without unpickling anything; None when it records none."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            pkl = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            ops = pickletools.genops(z.read(pkl)) if pkl else ()
            prev = None
            for op, arg, _ in ops:
                if op.name in ("BINPUT", "LONG_BINPUT", "MEMOIZE", "PUT"):
                    continue  # the memo entry between a key and its value
                if prev == "labkit" and isinstance(arg, str) and re.match(r"\d+\.\d+", arg):
                    return arg
                prev = arg if isinstance(arg, str) else None
    except Exception:  # not a zip, a broken pickle: no version to tell
        return None
    return None


def _release(v: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def newer_labkit(saved: str | None, where: str, error: BaseException) -> RuntimeError | None:
    """When a checkpoint that failed to load was saved by a newer labkit than this one: the error that says
    so (the likely cause: update labkit), to raise from `error`. None otherwise (raise `error` itself)."""
    from labkit.versions import __version__

    if not isinstance(saved, str) or not re.match(r"\d+\.\d+", saved) or _release(saved) <= _release(__version__):
        return None
    return RuntimeError(
        f"{where} was saved by labkit {saved}, newer than this labkit {__version__}, and does not load here "
        f"({_why(error)}). Update labkit to {saved} or newer"
    )


def torch_load(data: bytes, where: str, map_location="cpu"):
    """torch.load(weights_only=True) of a one-file checkpoint. When it fails and the checkpoint was
    saved by a newer labkit than this one, the error says so (the likely cause: update labkit)."""
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:
        newer = newer_labkit(saved_labkit(data), where, e)
        if newer is None:
            raise
        raise newer from e
