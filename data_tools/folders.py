"""Where the writer puts a dataset: a local folder or a gs:// prefix, staged first, published last.

    from data_tools.folders import open_folder
    folder = open_folder("gs://bucket/cifar/train")    # checks the bucket (fast, clear errors)
    staging = folder.stage(generation)                 # write shards into this local folder
    folder.staged(path, name)                          # each finished shard
    folder.publish(staging, name); folder.write_manifest(body); folder.done(staging)

Local: the staging folder is `<out>/.staging-<generation>/` (same file system: publishing is a
rename). gs://: shards are staged under `<out>/.staging-<generation>/` in the bucket and copied to
their final names (GCS has no rename; a copy inside a bucket moves no data through this host).
Leftovers of killed writes (`.staging-<12 hex digits>`) are removed by the next write (one writer
per folder at a time); nothing else in the folder is touched unless a labkit manifest lists it
(see data_tools.writer).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile

from labkit.cloud import gcs

from .manifest import MANIFEST
from .urls import check_gs_url

# a staging folder of a labkit write: `.staging-` + the 12 hex digits of its generation. Only these are
# removed as leftovers of killed writes; any other `.staging-*` belongs to someone else and stays.
STAGING = re.compile(r"\.staging-[0-9a-f]{12}")
GCS_TIMEOUT = 30.0  # seconds per request while writing to gs://; retries stop after twice that
GCS_REACH_S = 10.0  # the first request (the bucket check) retries an unreachable endpoint this long


class _Local:
    def __init__(self, out: str):
        if os.path.exists(out) and not os.path.isdir(out):
            raise NotADirectoryError(f"output {out} is a file, not a folder")
        try:  # fail before encoding anything, and say which folder
            os.makedirs(out, exist_ok=True)
            tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-").close()
        except OSError as e:
            raise type(e)(f"cannot write to output folder {out}: {e.strerror or e}") from None
        self.out = out

    def url(self, name: str) -> str:
        return os.path.join(self.out, name)

    def head(self, name: str, n: int = 512) -> bytes:
        with open(os.path.join(self.out, name), "rb") as f:
            return f.read(n)

    def stage(self, gen: str) -> str:
        for name in os.listdir(self.out):  # what killed labkit writes left (one writer per folder at a time)
            if STAGING.fullmatch(name):
                shutil.rmtree(os.path.join(self.out, name), ignore_errors=True)
        d = os.path.join(self.out, f".staging-{gen}")
        os.makedirs(d)
        return d

    def staged(self, path: str, name: str) -> None:
        pass  # already in the staging folder

    def names(self) -> list[str]:
        return os.listdir(self.out)

    def delete(self, name: str) -> None:
        try:
            os.remove(os.path.join(self.out, name))
        except FileNotFoundError:
            pass

    def publish(self, staging: str, name: str) -> None:
        os.replace(os.path.join(staging, name), os.path.join(self.out, name))  # atomic on one file system

    def write_manifest(self, body: bytes) -> None:
        # a fresh name opened with O_EXCL | O_NOFOLLOW: a `manifest.json.tmp` planted as a link to another
        # file is never opened, so never truncated; os.replace then swaps names and follows no link either
        tmp = os.path.join(self.out, f"{MANIFEST}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, os.path.join(self.out, MANIFEST))  # atomic: never a half-written manifest
        except BaseException:
            os.remove(tmp)  # a full disk or Ctrl-C leaves no temp file behind
            raise

    def done(self, staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def local_dir(self, staging: str) -> str:
        return self.out  # the disk the shards are staged on


class _GCS:
    def __init__(self, out: str):
        from google.api_core import exceptions
        from google.cloud.storage.retry import DEFAULT_RETRY

        def bounded(seconds):  # api_core >= 2.17 renamed with_deadline to with_timeout
            return getattr(DEFAULT_RETRY, "with_timeout", DEFAULT_RETRY.with_deadline)(seconds)

        self.retry = bounded(2 * GCS_TIMEOUT)
        self.out = check_gs_url(out).rstrip("/")
        bucket, self.prefix = gcs.parse_url(self.out)
        self.bucket = gcs.client().bucket(bucket)
        host = os.environ.get("STORAGE_EMULATOR_HOST", "storage.googleapis.com")
        try:  # the client's default retry would stay silent for ~2 minutes on an unreachable endpoint
            self.bucket.reload(timeout=GCS_REACH_S, retry=bounded(GCS_REACH_S))
        except exceptions.NotFound:
            raise FileNotFoundError(f"GCS bucket {bucket!r} does not exist (from {out!r})") from None
        except (exceptions.RetryError, OSError) as e:
            cause = e.cause if isinstance(e, exceptions.RetryError) and e.cause else e
            raise ConnectionError(
                f"cannot reach GCS at {host} for bucket {bucket!r}: retried for "
                f"{GCS_REACH_S:g} s ({type(cause).__name__})"
            ) from None

    def _blob(self, name: str):
        return self.bucket.blob(f"{self.prefix}/{name}" if self.prefix else name)

    def url(self, name: str) -> str:
        return gcs.join(self.out, name)

    def head(self, name: str, n: int = 512) -> bytes:
        return self._blob(name).download_as_bytes(start=0, end=n - 1, timeout=GCS_TIMEOUT, retry=self.retry)

    def stage(self, gen: str) -> str:
        pre = f"{self.prefix}/" if self.prefix else ""
        for b in gcs.client().list_blobs(self.bucket, prefix=pre + ".staging-"):  # what killed labkit writes left
            if STAGING.fullmatch(b.name[len(pre) :].split("/", 1)[0]):
                self.bucket.blob(b.name).delete(timeout=GCS_TIMEOUT, retry=self.retry)
        self.gen = gen
        return tempfile.mkdtemp(prefix="labkit-shards-")

    def staged(self, path: str, name: str) -> None:
        gcs.upload_file(path, gcs.join(self.out, f".staging-{self.gen}", name), timeout=GCS_TIMEOUT, retry=self.retry)
        os.remove(path)

    def names(self) -> list[str]:
        pre = f"{self.prefix}/" if self.prefix else ""
        return [b.name[len(pre) :] for b in gcs.client().list_blobs(self.bucket, prefix=pre, delimiter="/")]

    def delete(self, name: str) -> None:
        from google.api_core import exceptions

        try:
            self._blob(name).delete(timeout=GCS_TIMEOUT, retry=self.retry)
        except exceptions.NotFound:
            pass

    def publish(self, staging: str, name: str) -> None:
        src = self._blob(f".staging-{self.gen}/{name}")
        # GCS has no rename: a copy within the bucket (no data through this host), then a delete
        self.bucket.copy_blob(
            src, self.bucket, src.name.replace(f".staging-{self.gen}/", ""), timeout=GCS_TIMEOUT, retry=self.retry
        )
        src.delete(timeout=GCS_TIMEOUT, retry=self.retry)

    def write_manifest(self, body: bytes) -> None:
        self._blob(MANIFEST).upload_from_string(
            body, content_type="application/json", timeout=GCS_TIMEOUT, retry=self.retry
        )

    def done(self, staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def local_dir(self, staging: str) -> str:
        return os.path.dirname(staging)  # shards are staged in a local temp folder before upload


def open_folder(out: str):
    """The output folder for `out` (checked now: an existing file, no permission, a missing or
    unreachable bucket raise here, before any image is encoded)."""
    return _GCS(out) if gcs.is_gcs(out) else _Local(out)
