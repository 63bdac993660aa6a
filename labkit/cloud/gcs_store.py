"""A gs:// prefix as a checkpoint store: verified uploads with bounded retries, create-only objects, a
writer lock object with a lease, and a conditional `latest` pointer. The interface and the local folder are
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
from labkit.cloud.store import LOCK, _holder, _pid_alive, _Staging, _sweep, parse_pointer

# A gs:// lock not renewed for this long is taken over: its writer is gone (a preempted VM has a new host name,
# so "is its pid alive" cannot be asked). The holder renews it at each save; a save that finds its lock
# taken fails loudly instead of overwriting the new writer's checkpoints.
LEASE_S = 15 * 60


class GCSStore(_Staging):
    """gs://bucket/prefix: verified uploads with bounded retries, create-only objects, a lock object,
    and a conditional pointer (if_generation_match: the generation last read, 0 to create)."""

    def __init__(self, root, retry_deadline_s):
        gcs.ensure_bucket(root)  # missing bucket: FileNotFoundError now, not at the first save
        self.root = root.rstrip("/")
        self.bucket, self.prefix = gcs.parse_url(self.root + "/")
        self.retry_deadline_s = retry_deadline_s
        self.generation = None  # of `latest` as last read or written; 0: create only
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
    def acquire_writer(self, takeover: bool = False) -> None:
        """Take the lock object (create-only) before the first byte, or renew ours. takeover=True (a run
        that resumed this root) replaces another holder's lock, with a warning: resuming says the old run
        is over. A lock older than LEASE_S, or left by a dead pid on this host, is taken over too."""
        from google.api_core import exceptions

        b = gcs.blob(self.url(LOCK))
        if self._lock is not None:
            self._renew(b)
            return
        me = _holder()
        for _ in range(3):
            try:  # create-only: a retry after our own lost success reads back our id below
                b.upload_from_string(json.dumps(me), if_generation_match=0, retry=self._retry())
                self._lock, self._lock_gen, self._renewed = me, b.generation, time.monotonic()
                return
            except exceptions.PreconditionFailed:
                pass
            try:
                b.reload(retry=self._retry())  # generation and the server's time of the last write
                held, age = json.loads(b.download_as_bytes(retry=self._retry())), time.time() - b.updated.timestamp()
            except exceptions.NotFound:
                continue  # released meanwhile: try again
            except (ValueError, AttributeError):
                held, age = {}, LEASE_S
            if held.get("id") == me["id"]:
                self._lock, self._lock_gen, self._renewed = me, b.generation, time.monotonic()
                return
            dead = held.get("host") == me["host"] and isinstance(held.get("pid"), int) and not _pid_alive(held["pid"])
            if dead or age >= LEASE_S or takeover:
                if not dead:
                    why = "this run resumed it" if takeover else f"not renewed for {age / 60:.0f} min"
                    warnings.warn(
                        f"{self.url(LOCK)}: taking over the writer lock of host {held.get('host')} pid "
                        f"{held.get('pid')} ({why})",
                        stacklevel=3,
                    )
                self.delete(LOCK)
                continue
            raise RuntimeError(
                f"{self.root} is being written by another checkpoint writer (host {held.get('host')} pid "
                f"{held.get('pid')}, lock renewed {age / 60:.0f} min ago); two runs saving to one prefix would "
                f"overwrite each other's checkpoints. Use another prefix, close() the other manager, or resume "
                f"this run (TrainConfig.resume=True) to take over; a lock not renewed for {LEASE_S // 60} min is "
                f"taken over by itself"
            )
        raise RuntimeError(f"could not take the writer lock {self.url(LOCK)}")

    def _renew(self, b) -> None:
        """Rewrite our lock (generation precondition) so its age says we are alive; at most once a minute."""
        from google.api_core import exceptions

        if time.monotonic() - self._renewed < 60:
            return
        try:
            b.upload_from_string(json.dumps(self._lock), if_generation_match=self._lock_gen, retry=self._retry())
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            self._lock = None
            raise RuntimeError(
                f"{self.url(LOCK)} was taken over by another writer (a resumed run, or this one was silent for "
                f"{LEASE_S // 60} min): this run stops saving here rather than overwrite its checkpoints"
            ) from None
        self._lock_gen, self._renewed = b.generation, time.monotonic()

    def release_writer(self) -> None:
        if self._lock is not None:
            self._lock = None
            self.delete(LOCK)

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
                f"upload of checkpoint {self.url(name)} failed after retries "
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

    def list(self, prefix: str = "") -> list[str]:
        blobs = gcs.client().list_blobs(self.bucket, prefix=self.prefix + prefix, retry=self._retry())
        return sorted(n for n in (b.name[len(self.prefix) :] for b in blobs) if n != LOCK)

    def delete(self, name):
        from google.api_core import exceptions

        try:
            gcs.blob(self.url(name)).delete(retry=self._retry())
        except exceptions.NotFound:
            pass

    # -- the pointer --------------------------------------------------------------------------------
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
