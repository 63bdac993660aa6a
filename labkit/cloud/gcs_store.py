"""A gs:// prefix as a checkpoint store: verified uploads with bounded retries, create-only objects, a
writer lock object with a lease, and conditional replacement (the checkpoint `latest` pointer). The interface and the local folder are
labkit.cloud.store; labkit.cloud.open_store picks one.

    store = GCSStore("gs://bucket/run", retry_deadline_s=60)
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings

from labkit.cloud import gcs
from labkit.cloud.protocol import VersionConflict
from labkit.cloud.store import LOCK, _holder, _pid_alive, _Staging, _sweep

# A gs:// lock not renewed for this long (on the server's clock) is taken over: its writer is gone (a preempted
# VM has a new host name, so "is its pid alive" cannot be asked). The holder renews it at most once a minute at
# its commit points; a save that finds its lock taken fails loudly before it commits anything.
LEASE_S = 15 * 60


class GCSStore(_Staging):
    """gs://bucket/prefix: verified uploads with bounded retries, create-only objects, a lock object,
    and conditional replacement (if_generation_match: the generation last read, 0 to create)."""

    def __init__(self, root, retry_deadline_s):
        gcs.ensure_bucket(root)  # missing bucket: FileNotFoundError now, not at the first save
        self.root = root.rstrip("/")
        self.bucket, self.prefix = gcs.parse_url(self.root + "/")
        self.retry_deadline_s = retry_deadline_s
        self._lock: dict | None = None  # our lock object's body while we hold it
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

    # -- one writer ---------------------------------------------------------------------------------
    def _read_lock(self, b):
        """(body, generation, age in seconds on the server's clock) of the lock object, or None when
        there is none. A body that is not a JSON object is refused by name: it is no lock labkit wrote."""
        from google.api_core import exceptions

        meta, now = gcs.stat_with_server_time(self.url(LOCK))
        if meta is None:
            return None
        gen = int(meta["generation"])
        try:  # exactly the generation just looked at (the emulator ignores this on reads; GCS honours it)
            data = b.download_as_bytes(if_generation_match=gen, retry=self._retry())
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            return None  # replaced or released meanwhile: the caller looks again
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            raise RuntimeError(
                f"{self.url(LOCK)} is not a labkit writer lock (its body is {data[:80]!r}, not a JSON object): "
                f"remove it with `gcloud storage rm {self.url(LOCK)}` once no run writes to {self.root}"
            )
        # Date has whole seconds, `updated` microseconds: a lock written this second reads as up to 1 s young
        return body, gen, max(0.0, (now - gcs.parse_time(meta["updated"])).total_seconds())

    def acquire_writer(self, takeover: bool = False) -> None:
        """Take the lock object (create-only) before the first byte (held already: nothing to do). takeover=True
        (a run that resumed this root) replaces another holder's lock, with a warning: resuming says the old
        run is over. A lock older than LEASE_S (on the server's clock), or left by a dead pid on this host,
        is taken over too. A takeover is a conditional overwrite of the generation looked at: of two runs
        taking one lock over at once, one wins and the other looks again."""
        from google.api_core import exceptions

        b = gcs.blob(self.url(LOCK))
        if self._lock is not None:  # held: each commit point of the save proves it (check_writer)
            return
        me = _holder()
        for _ in range(5):
            try:  # create-only: a retry after our own lost success reads back our id below
                b.upload_from_string(json.dumps(me), if_generation_match=0, retry=self._retry())
                self._lock, self._lock_gen, self._renewed = me, b.generation, time.monotonic()
                return
            except exceptions.PreconditionFailed:
                pass
            found = self._read_lock(b)
            if found is None:
                continue  # released meanwhile: try again
            held, gen, age = found
            if held.get("id") == me["id"]:
                self._lock, self._lock_gen, self._renewed = me, gen, time.monotonic()
                return
            dead = held.get("host") == me["host"] and isinstance(held.get("pid"), int) and not _pid_alive(held["pid"])
            if not (dead or age >= LEASE_S or takeover):
                raise RuntimeError(
                    f"{self.root} is being written by another checkpoint writer (host {held.get('host')} pid "
                    f"{held.get('pid')}, lock renewed {age / 60:.0f} min ago); two runs saving to one prefix would "
                    f"overwrite each other's checkpoints. Use another prefix, close() the other manager, or resume "
                    f"this run (TrainConfig.resume=True) to take over; a lock not renewed for {LEASE_S // 60} min "
                    f"is taken over by itself"
                )
            try:  # replaces exactly the lock looked at; a 412 means another run changed it first
                b.upload_from_string(json.dumps(me), if_generation_match=gen, retry=None)
            except exceptions.PreconditionFailed:
                continue
            if not dead:
                why = "this run resumed it" if takeover else f"not renewed for {age / 60:.0f} min"
                warnings.warn(
                    f"{self.url(LOCK)}: taking over the writer lock of host {held.get('host')} pid "
                    f"{held.get('pid')} ({why})",
                    stacklevel=3,
                )
            self._lock, self._lock_gen, self._renewed = me, b.generation, time.monotonic()
            return
        raise RuntimeError(f"could not take the writer lock {self.url(LOCK)} (other writers kept changing it)")

    def check_writer(self) -> None:
        """Prove we still hold the lock, right before a commit point (an object replaced, a marker, the
        pointer, a prune): its generation must be the one we wrote, else RuntimeError and nothing is
        committed. No grace window: a writer whose lock was taken over a second ago stops here. Cost: one
        metadata read per commit point; the lock is rewritten (renewed, generation precondition) at most
        once a minute, since GCS allows about one write per second to one object."""
        from google.api_core import exceptions

        if self._lock is None:
            raise RuntimeError(f"{self.url(LOCK)}: this writer does not hold the lock (released, or taken over)")
        b = gcs.blob(self.url(LOCK))
        try:
            b.reload(retry=self._retry())
            ours = b.generation == self._lock_gen
        except exceptions.NotFound:
            ours = False
        if ours and time.monotonic() - self._renewed >= 60:
            try:  # the renewal: its age then says we are alive
                b.upload_from_string(json.dumps(self._lock), if_generation_match=self._lock_gen, retry=None)
                self._lock_gen, self._renewed = b.generation, time.monotonic()
            except (exceptions.PreconditionFailed, exceptions.NotFound):
                ours = False
        if not ours:
            self._lock = None
            raise RuntimeError(
                f"{self.url(LOCK)} was taken over by another writer (a resumed run, this one silent for "
                f"{LEASE_S // 60} min, or the lock deleted by hand): this run stops saving here rather than "
                "overwrite its checkpoints"
            )

    def release_writer(self) -> None:
        """Delete the lock only while it is still ours (generation precondition); a lock another run took
        over stays, with a warning."""
        from google.api_core import exceptions

        if self._lock is None:
            return
        try:
            self.check_writer()
        except RuntimeError as e:
            warnings.warn(f"{e} (left in place)", stacklevel=3)
            return
        self._lock = None
        try:
            gcs.blob(self.url(LOCK)).delete(if_generation_match=self._lock_gen, retry=self._retry())
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
