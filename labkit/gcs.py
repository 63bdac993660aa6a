"""Google Cloud Storage access shared by data_tools and labkit.checkpoint.

    from labkit import gcs
    bucket, name = gcs.parse_url("gs://my-bucket/shards/train-000000.tar")
    gcs.upload_file("local.tar", "gs://my-bucket/shards/train-000000.tar")   # verified crc32c
    with gcs.open_read("gs://my-bucket/shards/train-000000.tar") as f: ...    # streaming

One `google.cloud.storage.Client` per process (created lazily, re-created after fork),
so connections are reused. With ``STORAGE_EMULATOR_HOST`` set (a loopback server, see
`labkit.gcs_emulator`) the client talks to it with anonymous credentials; otherwise it
uses Application Default Credentials (in Colab: `google.colab.auth.authenticate_user()`).
"""
from __future__ import annotations

import base64
import os
import threading

_lock = threading.Lock()
_client = None
_client_key = None


def is_gcs(url: str | os.PathLike) -> bool:
    return isinstance(url, str) and url.startswith("gs://")


def parse_url(url: str) -> tuple[str, str]:
    """'gs://bucket/a/b' -> ('bucket', 'a/b'). Raises ValueError naming the URL when malformed."""
    if not is_gcs(url):
        raise ValueError(f"not a gs:// URL: {url!r}")
    rest = url[len("gs://"):]
    bucket, _, name = rest.partition("/")
    if not bucket:
        raise ValueError(f"gs:// URL has no bucket: {url!r}")
    return bucket, name


def join(url: str, *parts: str) -> str:
    out = url.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


def client():
    """The process-wide storage client (one per pid and emulator setting)."""
    global _client, _client_key
    key = (os.getpid(), os.environ.get("STORAGE_EMULATOR_HOST"))
    with _lock:
        if _client is None or _client_key != key:
            from google.cloud import storage

            if key[1]:
                from google.auth.credentials import AnonymousCredentials

                _client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT", "labkit-local"),
                                         credentials=AnonymousCredentials())
            else:
                _client = storage.Client()
            _client_key = key
        return _client


def blob(url: str):
    bucket, name = parse_url(url)
    if not name:
        raise ValueError(f"gs:// URL names a bucket, not an object: {url!r}")
    return client().bucket(bucket).blob(name)


def crc32c_b64(path_or_bytes) -> str:
    """Base64 big-endian crc32c, the form GCS reports in `blob.crc32c`."""
    import google_crc32c

    c = google_crc32c.Checksum()
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        c.update(bytes(path_or_bytes))
    else:
        with open(path_or_bytes, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                c.update(chunk)
    return base64.b64encode(c.digest()).decode()


def upload_file(path: str | os.PathLike, url: str, *, if_generation_match=None, timeout: float = 120,
                retry=None) -> "object":
    """Upload a local file and check the server's crc32c against ours. Returns the blob.

    Raises IOError naming the object if the checksums differ (the object is then deleted)."""
    b = blob(url)
    kwargs = {"timeout": timeout, "checksum": "crc32c"}
    if if_generation_match is not None:
        kwargs["if_generation_match"] = if_generation_match
    if retry is not None:
        kwargs["retry"] = retry
    b.upload_from_filename(str(path), **kwargs)
    local = crc32c_b64(path)
    if b.crc32c != local:
        raise IOError(f"crc32c mismatch after upload of {path} to {url}: local {local}, server {b.crc32c}")
    return b


def open_read(url: str, chunk_size: int = 8 << 20):
    """A streaming binary file object for a gs:// object (no temp file, no subprocess)."""
    b = blob(url)
    return b.open("rb", chunk_size=chunk_size)


def exists(url: str) -> bool:
    return blob(url).exists()


def ensure_bucket(url_or_bucket: str):
    """Return the bucket, raising a clear error if it does not exist (it is never created silently)."""
    name = parse_url(url_or_bucket)[0] if is_gcs(url_or_bucket) else url_or_bucket
    from google.api_core import exceptions

    bucket = client().bucket(name)
    try:
        bucket.reload(timeout=30)
    except exceptions.NotFound:
        raise FileNotFoundError(f"GCS bucket {name!r} does not exist (from {url_or_bucket!r})") from None
    return bucket
