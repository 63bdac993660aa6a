"""Where the writer puts a dataset: a local folder, a gs:// or an s3:// prefix, staged first, published last.

    from data_tools.folders import open_folder
    folder = open_folder("gs://bucket/cifar/train")    # checks the bucket (fast, clear errors)
    staging = folder.stage(generation)                 # write shards into this local folder
    folder.staged(path, name)                          # each finished shard
    folder.publish(staging, name); folder.write_manifest(body); folder.done(staging)

The bytes go through labkit.cloud's one store interface (labkit.cloud.protocol.ObjectStore: the same
LocalStore, GCSStore and S3Store that checkpoints use). Every shard is staged under
`<out>/.staging-<generation>/` and moved to its final name by `store.move`: a rename in a local folder
(ShardWriter writes straight into the staging folder there), a copy made by the server on gs:// and s3://
(no rename there; the copy moves no data through this host), where each shard is uploaded as soon as it is
closed, from a local temp folder.
Leftovers of killed writes (`.staging-<12 hex digits>`) are removed by the next write (one writer
per folder at a time); nothing else in the folder is touched unless a labkit manifest lists it
(see data_tools.writer).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from labkit.cloud import gcs, open_store

from .manifest import MANIFEST
from .urls import check_gs_url

# a staging folder of a labkit write: `.staging-` + the 12 hex digits of its generation. Only these are
# removed as leftovers of killed writes; any other `.staging-*` belongs to someone else and stays.
STAGING = re.compile(r"\.staging-[0-9a-f]{12}")
GCS_TIMEOUT = 30.0  # seconds per request while writing to gs://; retries stop after twice that
GCS_REACH_S = 10.0  # the first request (the bucket check) retries an unreachable endpoint this long


def _check_local(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"output {out} is a file, not a folder")
    try:  # fail before encoding anything, and say which folder
        os.makedirs(out, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-").close()
    except OSError as e:
        raise type(e)(f"cannot write to output folder {out}: {e.strerror or e}") from None


def _check_gcs(out: str) -> None:
    """The bucket, asked once with a short deadline: the client's default retry would stay silent for ~2 minutes
    on an unreachable endpoint."""
    from google.api_core import exceptions
    from google.cloud.storage.retry import DEFAULT_RETRY

    bucket = gcs.parse_url(check_gs_url(out).rstrip("/") + "/")[0]
    host = os.environ.get("STORAGE_EMULATOR_HOST", "storage.googleapis.com")
    retry = getattr(DEFAULT_RETRY, "with_timeout", DEFAULT_RETRY.with_deadline)(GCS_REACH_S)  # renamed in 2.17
    try:
        gcs.client().bucket(bucket).reload(timeout=GCS_REACH_S, retry=retry)
    except exceptions.NotFound:
        raise FileNotFoundError(f"GCS bucket {bucket!r} does not exist (from {out!r})") from None
    except (exceptions.RetryError, OSError) as e:
        cause = e.cause if isinstance(e, exceptions.RetryError) and e.cause else e
        raise ConnectionError(
            f"cannot reach GCS at {host} for bucket {bucket!r}: retried for {GCS_REACH_S:g} s ({type(cause).__name__})"
        ) from None


class Folder:
    """A dataset's folder in any labkit.cloud store: stage, publish, the manifest last."""

    def __init__(self, out: str, store):
        self.out, self.store = out, store
        self.gen = ""

    def url(self, name: str) -> str:
        return self.store.url(name)

    def head(self, name: str, n: int = 512) -> bytes:
        with self.store.open(name) as f:
            return f.read(n)

    def names(self) -> list[str]:
        """The names directly in the folder (a subfolder's first part once)."""
        return sorted({n.split("/", 1)[0] for n in self.store.list()})

    def _in_store(self) -> bool:
        return self.store.local_path(f".staging-{self.gen}") is not None  # a folder: ShardWriter writes there

    def stage(self, gen: str) -> str:
        """A local folder for the shards of this write (what killed labkit writes left is removed first)."""
        for name in self.store.list(".staging-"):  # one writer per folder at a time
            if STAGING.fullmatch(name.split("/", 1)[0]):
                self.store.delete(name)
        self.gen = gen
        if self._in_store():
            d = self.store.local_path(f".staging-{gen}")
            os.makedirs(d)
            return d
        return tempfile.mkdtemp(prefix="labkit-shards-")

    def staged(self, path: str, name: str) -> None:
        """A finished shard: uploaded now on gs:// and s3:// (overlapping the encoding of the next one)."""
        if not self._in_store():
            self.store.put(f".staging-{self.gen}/{name}", path, gcs.crc32c_b64(path))
            os.remove(path)

    def delete(self, name: str) -> None:
        self.store.delete(name)

    def publish(self, staging: str, name: str) -> None:
        self.store.move(f".staging-{self.gen}/{name}", name)

    def write_manifest(self, body: bytes) -> None:
        # a whole new object (a folder: a fresh temp file, never a planted link, then one rename): a reader sees
        # the old manifest or the new one, never half of one
        self.store.put(MANIFEST, body, gcs.crc32c_b64(body))

    def done(self, staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)
        for name in self.store.list(f".staging-{self.gen}/"):  # a failed write's uploads (none after publish)
            self.store.delete(name)

    def local_dir(self, staging: str) -> str:
        return self.out if self._in_store() else os.path.dirname(staging)  # the disk the shards are staged on


def open_folder(out: str) -> Folder:
    """The output folder for `out` (checked now: an existing file, no permission, a missing or
    unreachable bucket raise here, before any image is encoded)."""
    if gcs.is_gcs(out):
        _check_gcs(out)
    elif "://" not in str(out):
        _check_local(out)
    return Folder(out, open_store(str(out), retry_deadline_s=2 * GCS_TIMEOUT))
