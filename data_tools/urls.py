"""Open any shard URL for reading: local path, file://, gs://, s3://, http(s)://, with a time limit.

    from data_tools.urls import open_url, register_scheme
    with open_url("gs://bucket/cifar/train-000000.tar", timeout=60) as f: ...
    register_scheme("azure", my_opener)        # opener(url, timeout) -> binary file object

s3:// goes through fsspec's s3fs (`pip install "labkit-xla[s3]"`): credentials and the endpoint come
from the usual AWS settings (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws, AWS_ENDPOINT_URL_S3 or
AWS_ENDPOINT_URL for an S3-compatible store such as MinIO, Cloudflare R2 or a local server).

One registry (`SCHEMES`, scheme -> opener) serves the loader, the manifest reader and, through
`register_webdataset()`, webdataset's own `gopen` (its http handler shells out to curl with no
overall limit, its gs handler to gsutil, which Colab lacks).

Network reads never hang: `timeout` bounds every wait for bytes (a server that accepts and never
answers fails after `timeout` s per attempt), opening is retried a bounded number of times with
backoff, and the error says what was tried. A missing object raises FileNotFoundError, every other
failure OSError (ConnectionError, TimeoutError): never mistaken for a corrupt sample.
"""

from __future__ import annotations

import importlib
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from labkit.cloud import gcs

DEFAULT_TIMEOUT = 30.0  # seconds without a byte before a network read gives up
ATTEMPTS = 3  # opening a network URL: tries in all (connect errors, timeouts, HTTP 5xx)


class Wrapper:
    """A read-only file object around another one (`raw`): closing it closes `raw`; usable in `with`."""

    raw = None

    def close(self) -> None:
        self.raw.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Deadline(Wrapper):
    """A file object whose reads fail with TimeoutError once `timeout` seconds pass without a byte."""

    def __init__(self, raw, url: str, timeout: float, sock=None):
        self.raw, self.url, self.timeout, self.sock = raw, url, timeout, sock
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        try:
            data = self.raw.read(n)
        except TimeoutError as e:
            raise TimeoutError(
                f"{self.url}: no data for {self.timeout:g} s after byte {self.pos} (read timed out; "
                "raise timeout= if the server is slow)"
            ) from e
        self.pos += len(data)
        return data


def _retrying(url: str, timeout: float, attempt: Callable[[], object], transient: tuple) -> object:
    """Call attempt() up to ATTEMPTS times, backing off 0.5 s, 1 s, ...; re-raise with what was tried."""
    errors = []
    start = time.monotonic()
    for i in range(ATTEMPTS):
        try:
            return attempt()
        except transient as e:
            errors.append(f"{type(e).__name__}: {e}")
            if i + 1 < ATTEMPTS:
                time.sleep(0.5 * 2**i)
    tried = "; ".join(f"try {i + 1}: {m}" for i, m in enumerate(errors))
    raise ConnectionError(
        f"cannot read {url}: {ATTEMPTS} attempts in {time.monotonic() - start:.1f} s "
        f"(timeout {timeout:g} s each) failed - {tried}"
    )


def _open_http(url: str, timeout: float):
    def attempt():
        try:
            r = urllib.request.urlopen(url, timeout=timeout)  # timeout: per socket wait, connect included
        except urllib.error.HTTPError as e:
            if e.code in (404, 410):
                raise FileNotFoundError(f"not found: {url} (HTTP {e.code})") from None
            if e.code < 500:
                raise PermissionError(f"{url}: HTTP {e.code} {e.reason}") from None
            raise ConnectionError(f"HTTP {e.code} {e.reason}") from None
        return _Deadline(r, url, timeout)

    return _retrying(url, timeout, attempt, (ConnectionError, TimeoutError, urllib.error.URLError))


def _open_gs(url: str, timeout: float):
    from google.api_core import exceptions
    from google.cloud.storage.retry import DEFAULT_RETRY

    # the client's default retry gives up only after 120 s: bound it like the other schemes
    retry = getattr(DEFAULT_RETRY, "with_timeout", DEFAULT_RETRY.with_deadline)(timeout * ATTEMPTS)
    f = gcs.blob(url).open("rb", chunk_size=8 << 20, timeout=timeout, retry=retry)
    try:
        f.read(0)  # BlobReader is lazy: fetch metadata now so that a missing object fails here
    except exceptions.NotFound:
        raise FileNotFoundError(f"not found: {url}") from None
    return f


_S3 = {}  # (endpoint, timeout) -> s3fs.S3FileSystem: one connection pool per process and setting


def _s3_filesystem(timeout: float):
    try:
        import s3fs
    except ImportError:
        raise ImportError('reading s3:// needs s3fs: pip install "labkit-xla[s3]" (or pip install s3fs)') from None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    key = (endpoint, timeout, os.getpid())  # aiohttp sessions do not survive fork: one per DataLoader worker
    if key not in _S3:
        # one try per call: the retries (and their backoff) are _retrying's, bounded like the other schemes
        config = {
            "connect_timeout": timeout,
            "read_timeout": timeout,
            "retries": {"max_attempts": 1, "mode": "standard"},
        }
        _S3[key] = s3fs.S3FileSystem(
            endpoint_url=endpoint, config_kwargs=config, skip_instance_cache=True, default_block_size=8 << 20
        )
    return _S3[key]


def _open_s3(url: str, timeout: float):
    fs = _s3_filesystem(timeout)
    try:
        from botocore.exceptions import BotoCoreError, NoCredentialsError
    except ImportError:  # pragma: no cover - s3fs always brings botocore
        BotoCoreError = NoCredentialsError = ()

    def attempt():
        try:
            return fs.open(url, "rb")  # reads the object's size now: a missing object fails here
        except FileNotFoundError:
            raise FileNotFoundError(f"not found: {url}") from None
        except NoCredentialsError:
            raise PermissionError(
                f"{url}: no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / ~/.aws)"
            ) from None
        except PermissionError as e:
            raise PermissionError(f"{url}: access denied ({e}); the credentials need s3:GetObject on it") from None
        except BotoCoreError as e:  # endpoint unreachable, read timeout after botocore's own retries
            raise ConnectionError(f"{type(e).__name__}: {e}") from None

    return _retrying(url, timeout, attempt, (ConnectionError, TimeoutError))


def _open_file(url: str, timeout: float):
    return open(url[len("file://") :] if url.startswith("file://") else url, "rb")


SCHEMES: dict[str, Callable] = {
    "file": _open_file,
    "gs": _open_gs,
    "s3": _open_s3,
    "http": _open_http,
    "https": _open_http,
}


def register_scheme(scheme: str, opener: Callable) -> None:
    """Add or replace the opener for `scheme://` URLs: opener(url, timeout) -> binary file object that
    raises FileNotFoundError for a missing object and OSError for I/O failures."""
    SCHEMES[scheme] = opener


def scheme_of(url: str) -> str:
    head, sep, _ = str(url).partition("://")
    return head.lower() if sep and head.isalnum() else "file"


def open_url(url: str, timeout: float = DEFAULT_TIMEOUT):
    """Binary read stream for `url` (see the module docstring for the guarantees)."""
    url = os.fspath(url)
    opener = SCHEMES.get(scheme_of(url))
    if opener is None:
        raise ValueError(
            f"no opener for {url!r}; known schemes: {', '.join(sorted(SCHEMES))} (register_scheme adds one)"
        )
    return opener(url, timeout)


def read_bytes(url: str, timeout: float = DEFAULT_TIMEOUT) -> bytes:
    with open_url(url, timeout) as f:
        return f.read()


def is_not_found(e: BaseException) -> bool:
    """FileNotFoundError, or google-cloud-storage's NotFound (raised on the first read of a missing object)."""
    if isinstance(e, FileNotFoundError):
        return True
    try:
        from google.api_core.exceptions import NotFound
    except ImportError:
        return False
    return isinstance(e, NotFound)


def sibling(url: str, name: str) -> str:
    """The URL of `name` in the same folder as `url` (works for paths and URLs)."""
    head = url.rsplit("/", 1)[0] if "/" in url else "."
    return f"{head}/{name}"


def _wds_opener(scheme: str) -> Callable:
    def gopen(url, mode="rb", bufsize=8192, **kw):
        if mode != "rb":
            raise ValueError(f"{scheme}:// handler only reads, asked for mode {mode!r} on {url}")
        return SCHEMES[scheme](url, kw.get("timeout", DEFAULT_TIMEOUT))

    gopen.__qualname__ = gopen.__name__ = f"gopen_{scheme}"
    return gopen


def register_webdataset() -> None:
    """Route webdataset's gs://, s3:// and http(s):// openers through this registry."""
    # importlib, not `import webdataset.gopen`: the package re-exports a function named gopen
    # that shadows the module of the same name
    schemes = importlib.import_module("webdataset.gopen").gopen_schemes
    for s in ("gs", "s3", "http", "https"):
        schemes[s] = _wds_opener(s)
