"""Where checkpoints live: a local folder or gs://bucket/prefix, behind one small interface
(put a verified object, get, list, delete, read/write the `latest` pointer, one writer at a time).

    store = GCSStore("gs://bucket/run", retry_deadline_s=60)   # or LocalStore("/tmp/run")
    store.put(tmp_path, "ckpt-00000100.pt", crc32c_b64)         # raises IOError naming the object

Used by labkit.checkpoint.CheckpointManager. Temp files: a local store writes them beside the
target (same folder: the rename is atomic) and sweeps those of killed writers when opened; a GCS
store writes them to <tmp>/labkit-ckpt/, named with the writer's pid, and sweeps those whose
process is gone (a killed run otherwise leaks one checkpoint-sized file per kill).
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import warnings

from labkit.cloud import gcs

NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
LOCK = ".writer.lock"


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
        f"{where} is unreadable ({why}); ignoring it and falling back to the newest verified checkpoint", stacklevel=2
    )
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class LocalStore:
    """A folder: os.replace makes both the object and the pointer appear atomically. One writer at
    a time: the first save takes an exclusive lock on ROOT/.writer.lock (released by close(), or by
    the kernel when the process dies), so a second run saving to the same folder fails at once,
    naming the host and pid of the first, instead of pruning the other's checkpoints."""

    def __init__(self, root):
        self.root = str(root)
        os.makedirs(self.root, exist_ok=True)
        self.generation = None
        self._lock_fd = None
        for n in os.listdir(self.root):  # temp files of a writer killed mid-save (never visible as checkpoints)
            if (n.startswith(".ckpt-") and n.endswith(".tmp")) or n.startswith(".latest-"):
                try:
                    os.remove(os.path.join(self.root, n))
                except FileNotFoundError:
                    pass

    def url(self, name):
        return os.path.join(self.root, name)

    def acquire_writer(self) -> None:
        if self._lock_fd is not None:
            return
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks here; single-writer is then up to the user
            return
        fd = os.open(self.url(LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(
                f"{self.root} is being written by another checkpoint writer ({other}); two runs saving to one "
                "folder would delete each other's checkpoints. Use another folder, or close() the other manager"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}".encode(), 0)
        self._lock_fd = fd

    def release_writer(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock

    def put(self, tmp, name, crc):
        # same folder: atomic rename. The crc was computed from this very file by the caller; a
        # re-read here would checksum the page cache a second time, not the disk.
        os.replace(tmp, self.url(name))

    def get(self, name) -> bytes:
        with open(self.url(name), "rb") as f:
            return f.read()

    def names(self):
        return sorted(n for n in os.listdir(self.root) if NAME.match(n))

    def delete(self, name):
        try:
            os.remove(self.url(name))
        except FileNotFoundError:
            pass

    def read_pointer(self):
        try:
            data = self.get("latest")
        except FileNotFoundError:
            return None
        return parse_pointer(data, self.url("latest"))

    def write_pointer(self, data: dict):
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".latest-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.url("latest"))

    def tmpdir(self):
        return self.root


class GCSStore:
    """gs://bucket/prefix: verified uploads with bounded retries; the pointer is a conditional write
    (if_generation_match), which is what keeps two writers apart here."""

    def __init__(self, root, retry_deadline_s):
        gcs.ensure_bucket(root)  # missing bucket: FileNotFoundError now, not at the first save
        self.root = root.rstrip("/")
        self.bucket, self.prefix = gcs.parse_url(self.root + "/")
        self.retry_deadline_s = retry_deadline_s
        self.generation = None  # of `latest` as last read or written; 0: create only
        self._tmp = os.path.join(tempfile.gettempdir(), "labkit-ckpt")
        os.makedirs(self._tmp, exist_ok=True)
        for n in os.listdir(self._tmp):  # `.ckpt-00000009.pt.<pid>.<random>.tmp` of processes that died
            m = re.match(r"^\.ckpt-\d+\.pt\.(\d+)\.", n)
            if m and not _pid_alive(int(m.group(1))):
                try:
                    os.remove(os.path.join(self._tmp, n))
                except FileNotFoundError:
                    pass

    def url(self, name):
        return gcs.join(self.root, name)

    def acquire_writer(self) -> None:  # the generation precondition on `latest` does this job
        pass

    def release_writer(self) -> None:
        pass

    def _retry(self):
        from google.api_core.retry import Retry
        from google.cloud.storage.retry import DEFAULT_RETRY

        return Retry(
            predicate=DEFAULT_RETRY._predicate, initial=0.2, maximum=5.0, multiplier=2.0, timeout=self.retry_deadline_s
        )

    def put(self, tmp, name, crc):
        # One local crc32c (the caller's): the server computes its own and we compare the two. No
        # client-side checksum pass on top (gcs.upload_file would add two).
        try:
            b = gcs.blob(self.url(name))
            b.upload_from_filename(tmp, timeout=min(120, self.retry_deadline_s + 5), retry=self._retry(), checksum=None)
        except Exception as e:  # connection errors are OSErrors too: name the object either way
            raise OSError(
                f"upload of checkpoint {self.url(name)} failed after retries "
                f"(deadline {self.retry_deadline_s}s): {type(e).__name__}: {e}"
            ) from e
        if b.crc32c != crc:
            raise OSError(f"crc32c mismatch for {self.url(name)}: local {crc}, server {b.crc32c}")

    def get(self, name) -> bytes:
        return gcs.blob(self.url(name)).download_as_bytes(retry=self._retry())

    def names(self):
        blobs = gcs.client().list_blobs(self.bucket, prefix=self.prefix)
        out = [b.name[len(self.prefix) :] for b in blobs]
        return sorted(n for n in out if NAME.match(n))

    def delete(self, name):
        from google.api_core import exceptions

        try:
            gcs.blob(self.url(name)).delete(retry=self._retry())
        except exceptions.NotFound:
            pass

    def read_pointer(self):
        from google.api_core import exceptions

        b = gcs.blob(self.url("latest"))
        try:
            data = b.download_as_bytes(retry=self._retry())
        except exceptions.NotFound:
            self.generation = 0
            return None
        self.generation = b.generation  # even for a garbage pointer: our next write replaces exactly it
        return parse_pointer(data, self.url("latest"))

    def write_pointer(self, data: dict):
        from google.api_core import exceptions

        if self.generation is None:
            self.read_pointer()
        b = gcs.blob(self.url("latest"))
        try:
            # no retry: a retried conditional write could report a 412 for our own first success
            b.upload_from_string(
                json.dumps(data), content_type="application/json", if_generation_match=self.generation, retry=None
            )
        except exceptions.PreconditionFailed:
            raise RuntimeError(
                f"{self.url('latest')} was moved by another writer (expected generation "
                f"{self.generation}); two runs are saving to the same prefix"
            ) from None
        self.generation = b.generation

    def tmpdir(self):
        return self._tmp
