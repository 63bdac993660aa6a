"""Where checkpoints live: a local folder or gs://bucket/prefix, behind one small interface
(put a verified object, get, list, delete, read/write the `latest` pointer).

    store = GCSStore("gs://bucket/run", retry_deadline_s=60)   # or LocalStore("/tmp/run")
    store.put(tmp_path, "ckpt-00000100.pt", crc32c_b64)         # raises IOError naming the object

Used by labkit.checkpoint.CheckpointManager.
"""
from __future__ import annotations

import json
import os
import re
import tempfile

from . import gcs

NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


class LocalStore:
    """A folder: os.replace makes both the object and the pointer appear atomically."""

    def __init__(self, root):
        self.root = str(root)
        os.makedirs(self.root, exist_ok=True)
        self.generation = None
        for n in os.listdir(self.root):  # temp files of a writer killed mid-save (never visible as checkpoints)
            if n.startswith(".ckpt-") and n.endswith(".tmp"):
                try:
                    os.remove(os.path.join(self.root, n))
                except FileNotFoundError:
                    pass

    def url(self, name):
        return os.path.join(self.root, name)

    def put(self, tmp, name, crc):
        os.replace(tmp, self.url(name))  # same folder: atomic rename
        if gcs.crc32c_b64(self.url(name)) != crc:
            raise IOError(f"crc32c mismatch after writing {self.url(name)}")

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
            return json.loads(self.get("latest"))
        except FileNotFoundError:
            return None

    def write_pointer(self, data: dict):
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".latest-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.url("latest"))

    def tmpdir(self):
        return self.root


class GCSStore:
    """gs://bucket/prefix: verified uploads with bounded retries; the pointer is a conditional write."""

    def __init__(self, root, retry_deadline_s):
        gcs.ensure_bucket(root)  # missing bucket: FileNotFoundError now, not at the first save
        self.root = root.rstrip("/")
        self.bucket, self.prefix = gcs.parse_url(self.root + "/")
        self.retry_deadline_s = retry_deadline_s
        self.generation = None  # of `latest` as last read or written; 0: create only

    def url(self, name):
        return gcs.join(self.root, name)

    def _retry(self):
        from google.api_core.retry import Retry
        from google.cloud.storage.retry import DEFAULT_RETRY

        return Retry(predicate=DEFAULT_RETRY._predicate, initial=0.2, maximum=5.0, multiplier=2.0,
                     timeout=self.retry_deadline_s)

    def put(self, tmp, name, crc):
        try:
            b = gcs.upload_file(tmp, self.url(name), timeout=min(120, self.retry_deadline_s + 5), retry=self._retry())
        except Exception as e:  # connection errors are OSErrors too: name the object either way
            if "crc32c mismatch" in str(e):
                raise
            raise IOError(f"upload of checkpoint {self.url(name)} failed after retries "
                          f"(deadline {self.retry_deadline_s}s): {type(e).__name__}: {e}") from e
        if b.crc32c != crc:
            raise IOError(f"crc32c mismatch for {self.url(name)}: local {crc}, server {b.crc32c}")

    def get(self, name) -> bytes:
        return gcs.blob(self.url(name)).download_as_bytes(retry=self._retry())

    def names(self):
        blobs = gcs.client().list_blobs(self.bucket, prefix=self.prefix)
        out = [b.name[len(self.prefix):] for b in blobs]
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
        self.generation = b.generation
        return json.loads(data)

    def write_pointer(self, data: dict):
        from google.api_core import exceptions

        if self.generation is None:
            self.read_pointer()
        b = gcs.blob(self.url("latest"))
        try:
            # no retry: a retried conditional write could report a 412 for our own first success
            b.upload_from_string(json.dumps(data), content_type="application/json",
                                 if_generation_match=self.generation, retry=None)
        except exceptions.PreconditionFailed:
            raise RuntimeError(f"{self.url('latest')} was moved by another writer (expected generation "
                               f"{self.generation}); two runs are saving to the same prefix") from None
        self.generation = b.generation

    def tmpdir(self):
        return None
