"""A gs:// prefix as a checkpoint store: verified uploads with bounded retries, create-only objects, a
writer lock object with a lease, and conditional replacement (the checkpoint `latest` pointer). The interface and the local folder are
labkit.cloud.store; labkit.cloud.open_store picks one.

    store = GCSStore("gs://bucket/run", retry_deadline_s=60)
"""

from __future__ import annotations

import os
import tempfile

from labkit.cloud import gcs
from labkit.cloud.lease import ObjectLock
from labkit.cloud.protocol import VersionConflict
from labkit.cloud.store import LOCK, _Staging, _sweep, check_root

# A gs:// lock not renewed for this long (on the server's clock) is taken over: its writer is gone (a preempted
# VM has a new host name, so "is its pid alive" cannot be asked). The holder renews it at most once a minute at
# its commit points; a save that finds its lock taken fails loudly before it commits anything.
LEASE_S = 15 * 60


class GCSStore(ObjectLock, _Staging):
    """gs://bucket/prefix: verified uploads with bounded retries, create-only objects, a lock object,
    and conditional replacement (if_generation_match: the generation last read, 0 to create)."""

    def __init__(self, root, retry_deadline_s):
        check_root(root)  # '//', '/./', '/../': refused as every store does, before the bucket is asked
        gcs.ensure_bucket(root)  # missing bucket: FileNotFoundError now, not at the first save
        self.root = root.rstrip("/")
        self.bucket, self.prefix = gcs.parse_url(self.root + "/")
        self.retry_deadline_s = retry_deadline_s
        self._rm_hint = "remove it with `gcloud storage rm"
        self._tmp = os.path.join(tempfile.gettempdir(), "labkit-ckpt")
        os.makedirs(self._tmp, exist_ok=True)
        _sweep(self._tmp)  # a killed run otherwise leaks one checkpoint-sized file per kill

    def url(self, name):
        return gcs.join(self.root, name)

    def local_path(self, name):
        return None

    def _retry(self):
        from google.api_core.retry import Retry
        from google.cloud.storage.retry import DEFAULT_RETRY

        return Retry(
            predicate=DEFAULT_RETRY._predicate, initial=0.2, maximum=5.0, multiplier=2.0, timeout=self.retry_deadline_s
        )

    # -- one writer: the rules are labkit.cloud.lease's; here, its five operations on the lock object -------------
    def acquire_writer(self, takeover: bool = False) -> None:
        """Take the lock object (create-only, if_generation_match=0) before the first byte; takeover=True (a run
        that resumed this root) replaces another holder's lock with a warning; one not renewed for LEASE_S on the
        server's clock, or left by a dead pid on this host, is taken over too (labkit.cloud.lease)."""
        self._acquire(takeover, LEASE_S)

    def check_writer(self) -> None:
        """Prove we still hold the lock, right before a commit point (an object replaced, a marker, the pointer,
        a prune): its generation must be the one we wrote, else RuntimeError and nothing is committed. No grace
        window. Cost: one metadata read per commit point; the lock is rewritten (renewed, generation
        precondition) at most once a minute, since GCS allows about one write per second to one object."""
        self._check(LEASE_S)

    def _lock_create(self, body):
        from google.api_core import exceptions

        b = gcs.blob(self.url(LOCK))
        try:
            b.upload_from_string(body, if_generation_match=0, retry=self._retry())
        except exceptions.PreconditionFailed:
            return None
        return b.generation

    def _lock_read(self):
        """Its age: the server's `updated` against the Date of the same server's reply (never this host's
        clock). Date has whole seconds, `updated` microseconds: a lock written this second reads as up to 1 s
        young."""
        from google.api_core import exceptions

        meta, now = gcs.stat_with_server_time(self.url(LOCK))
        if meta is None:
            return None
        gen = int(meta["generation"])
        try:  # exactly the generation just looked at (the emulator ignores this on reads; GCS honours it)
            data = gcs.blob(self.url(LOCK)).download_as_bytes(if_generation_match=gen, retry=self._retry())
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            return None  # replaced or released meanwhile: the caller looks again
        return data, gen, (now - gcs.parse_time(meta["updated"])).total_seconds()

    def _lock_version(self):
        from google.api_core import exceptions

        b = gcs.blob(self.url(LOCK))
        try:
            b.reload(retry=self._retry())
        except exceptions.NotFound:
            return None
        return b.generation

    def _lock_replace(self, body, generation):
        from google.api_core import exceptions

        b = gcs.blob(self.url(LOCK))
        try:  # no retry: a retried conditional write could read a 412 for its own first success
            b.upload_from_string(body, if_generation_match=generation, retry=None)
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            return None
        return b.generation

    def _lock_delete(self, generation):
        from google.api_core import exceptions

        try:
            gcs.blob(self.url(LOCK)).delete(if_generation_match=generation, retry=self._retry())
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            pass

    # -- objects ------------------------------------------------------------------------------------
    def _upload(self, name, src, crc, generation):
        from google.api_core import exceptions

        b = gcs.blob(self.url(name))
        try:
            # one local crc32c (the caller's): the server computes its own and we compare the two
            kw = dict(timeout=min(120, self.retry_deadline_s + 5), retry=self._retry(), checksum=None)
            if isinstance(src, bytes):
                b.upload_from_string(src, if_generation_match=generation, **kw)
            else:
                b.upload_from_filename(str(src), if_generation_match=generation, **kw)
        except exceptions.PreconditionFailed:
            b.reload(retry=self._retry())
            if crc is not None and b.crc32c == crc:  # our own upload, retried after a lost reply
                return
            raise FileExistsError(f"{self.url(name)} already exists: another writer saved this name") from None
        except Exception as e:  # connection errors are OSErrors too: name the object either way
            raise OSError(
                f"upload of {self.url(name)} failed after retries "
                f"(deadline {self.retry_deadline_s}s): {type(e).__name__}: {e}"
            ) from e
        if crc is not None and b.crc32c != crc:
            raise OSError(f"crc32c mismatch for {self.url(name)}: local {crc}, server {b.crc32c}")

    def put_if_absent(self, name, src, crc=None):
        self._upload(name, src, crc, 0)  # if_generation_match=0: create only

    def put(self, name, src, crc=None):
        self._upload(name, src, crc, None)

    def get(self, name) -> bytes:
        """The object's bytes; FileNotFoundError naming it when it is gone, as a missing local file gives
        (the client's NotFound is not an OSError: a restore did not fall back past a deleted object)."""
        from google.api_core import exceptions

        try:
            return gcs.blob(self.url(name)).download_as_bytes(retry=self._retry())
        except exceptions.NotFound:
            raise FileNotFoundError(f"{self.url(name)} does not exist (deleted from the bucket?)") from None

    def open(self, name):
        """A streaming read of the object (8 MiB ranges). One metadata read first (the reader itself would only
        find a missing object at the first read, as the client's NotFound): FileNotFoundError here instead."""
        from google.api_core import exceptions

        try:
            gcs.blob(self.url(name)).reload(retry=self._retry())
            return gcs.open_read(self.url(name))
        except exceptions.NotFound:
            raise FileNotFoundError(f"{self.url(name)} does not exist (deleted from the bucket?)") from None

    def list(self, prefix: str = "") -> list[str]:
        blobs = gcs.client().list_blobs(self.bucket, prefix=self.prefix + prefix, retry=self._retry())
        return sorted(n for n in (b.name[len(self.prefix) :] for b in blobs) if n != LOCK)

    def delete(self, name):
        from google.api_core import exceptions

        try:
            gcs.blob(self.url(name)).delete(retry=self._retry())
        except exceptions.NotFound:
            pass

    def move(self, src, dst):
        """GCS has no rename: a copy inside the bucket (made by the server), then the delete."""
        from google.api_core import exceptions

        b = gcs.blob(self.url(src))
        try:
            b.bucket.copy_blob(b, b.bucket, self.prefix + dst, retry=self._retry())
        except exceptions.NotFound:
            raise FileNotFoundError(f"{self.url(src)} does not exist (deleted from the bucket?)") from None
        self.delete(src)

    # -- a versioned object (the checkpoint pointer: labkit.checkpoint.pointer) --------------------------------
    def get_versioned(self, name):
        """(bytes or None, generation; 0 when there is none: the next put_if_version then creates only)."""
        from google.api_core import exceptions

        b = gcs.blob(self.url(name))
        try:
            data = b.download_as_bytes(retry=self._retry())
        except exceptions.NotFound:
            return None, 0
        return data, b.generation

    def put_if_version(self, name, data, version):
        from google.api_core import exceptions

        b = gcs.blob(self.url(name))
        try:
            # no retry: a retried conditional write could report a 412 for our own first success
            b.upload_from_string(data, content_type="application/json", if_generation_match=version, retry=None)
        except exceptions.PreconditionFailed:
            raise VersionConflict(f"{self.url(name)}: not at generation {version}") from None
        return b.generation
