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
failure OSError (ConnectionError, TimeoutError): never mistaken for a corrupt sample. An http body
that ends before its Content-Length is resumed from where it stopped (bounded tries), then a
ConnectionError. `https://user:pass@host/...` sends the user info as an `Authorization: Basic`
header (never to DNS), and every message shows URLs through `redact` (no password, no token).
"""

from __future__ import annotations

import base64
import http.client
import importlib
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from urllib.parse import unquote

from labkit.cloud import gcs
from labkit.cloud.gcs import redact  # every URL this package shows goes through it: no password, no token

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


def _retrying(url: str, timeout: float, attempt: Callable[[], object], transient: tuple) -> object:
    """Call attempt() up to ATTEMPTS times, backing off 0.5 s, 1 s, ...; re-raise with what was tried."""
    errors = []
    start = time.monotonic()
    for i in range(ATTEMPTS):
        try:
            return attempt()
        except transient as e:
            errors.append(f"{type(e).__name__}: {redact(e)}")
            if i + 1 < ATTEMPTS:
                time.sleep(0.5 * 2**i)
    tried = "; ".join(f"try {i + 1}: {m}" for i, m in enumerate(errors))
    raise ConnectionError(
        f"cannot read {redact(url)}: {ATTEMPTS} attempts in {time.monotonic() - start:.1f} s "
        f"(timeout {timeout:g} s each) failed - {tried}"
    )


def http_request(url: str, start: int = 0) -> urllib.request.Request:
    """The request for `url`, its user info (`https://user:pass@host/...`) moved into an
    `Authorization: Basic` header: urllib would otherwise send it to DNS as part of the host name.
    The header is not repeated on a redirect (add_unredirected_header): credentials for one host
    never go to another one."""
    parts = urllib.parse.urlsplit(url)
    auth = None
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        auth = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
        url = urllib.parse.urlunsplit(parts._replace(netloc=host))
    req = urllib.request.Request(url)
    if auth:
        req.add_unredirected_header("Authorization", f"Basic {auth}")
    if start:
        req.add_header("Range", f"bytes={start}-")
    return req


class _HttpStream(Wrapper):
    """An http(s) body whose reads fail with TimeoutError once `timeout` seconds pass without a byte,
    and whose early end (fewer bytes than Content-Length: the server or a proxy closed the connection)
    is a network error: the read resumes from the byte where it stopped (a Range request, or the
    bytes before it skipped when the server ignores Range), ATTEMPTS tries in all, then ConnectionError
    naming the URL. Never a short body handed on as if it were the whole file (a "corrupt" shard)."""

    # a body that trickles (1 byte per second never trips the per-read timeout) is a failure too: after a grace
    # period the average rate must stay above MIN_RATE bytes/s, else TimeoutError naming the URL
    MIN_RATE = 16 << 10
    GRACE_S = 30.0

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout, self.pos = url, timeout, 0
        self.t0 = time.monotonic()
        self.raw = self._get(0)
        self.length = self.raw.length  # None when the server sent no Content-Length (chunked)

    def _get(self, start: int):
        def attempt():
            try:  # timeout: per socket wait, connect included
                r = urllib.request.urlopen(http_request(self.url, start), timeout=self.timeout)
            except urllib.error.HTTPError as e:
                if e.code in (404, 410):
                    raise FileNotFoundError(f"not found: {redact(self.url)} (HTTP {e.code})") from None
                if e.code < 500:
                    raise PermissionError(f"{redact(self.url)}: HTTP {e.code} {e.reason}") from None
                raise ConnectionError(f"HTTP {e.code} {e.reason}") from None
            if start and r.status != 206:  # Range ignored: the body starts at byte 0 again
                skip = start
                while skip:
                    got = r.read(min(skip, 1 << 20))
                    if not got:
                        raise ConnectionError(f"closed again before byte {start}")
                    skip -= len(got)
            return r

        return _retrying(self.url, self.timeout, attempt, (ConnectionError, TimeoutError, urllib.error.URLError))

    def _check_rate(self) -> None:
        elapsed = time.monotonic() - self.t0
        if elapsed > self.GRACE_S and self.pos < self.MIN_RATE * elapsed:
            raise TimeoutError(
                f"{redact(self.url)}: {self.pos:,} bytes in {elapsed:.0f} s, under {self.MIN_RATE:,} bytes/s: "
                "the server is too slow to feed training, or never ends"
            )

    def _read_once(self, n: int) -> bytes:
        try:
            return self.raw.read(n)
        except TimeoutError as e:
            raise TimeoutError(
                f"{redact(self.url)}: no data for {self.timeout:g} s after byte {self.pos} (read timed out; "
                "raise timeout= if the server is slow)"
            ) from e
        except http.client.IncompleteRead as e:  # a chunked body cut short
            return e.partial

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            chunks = []
            while chunk := self.read(1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        errors = []
        for i in range(ATTEMPTS):
            data = self._read_once(n)
            if data or n == 0 or self.length is None or self.pos >= self.length:
                self.pos += len(data)
                self._check_rate()
                return data
            errors.append(f"try {i + 1}: connection closed at byte {self.pos} of {self.length}")
            if i + 1 < ATTEMPTS:
                time.sleep(0.5 * 2**i)
                self.raw.close()
                self.raw = self._get(self.pos)
        raise ConnectionError(
            f"{redact(self.url)}: the server sent {self.pos} of {self.length} bytes (Content-Length) and "
            f"closed the connection, {ATTEMPTS} times ({'; '.join(errors)}): a network failure, not a corrupt file"
        )


def _open_http(url: str, timeout: float):
    return _HttpStream(url, timeout)


def check_gs_url(url: str) -> str:
    """Refuse a gs:// URL whose object path has empty, `.` or `..` segments (`gs://b//x`, `gs://b/../x`):
    GCS takes them literally, as other objects than the ones meant."""
    bucket, name = gcs.parse_url(url)
    segments = name.rstrip("/").split("/") if name else []
    if any(seg in ("", ".", "..") for seg in segments):
        raise ValueError(f"{redact(url)}: a gs:// path may not contain empty, '.' or '..' segments")
    return url


class _GCSReader(Wrapper):
    """A GCS object's BlobReader whose failures after the client's bounded retries (RetryError,
    5xx, a dropped connection) are ConnectionError naming the URL, like every other scheme."""

    def __init__(self, raw, url: str):
        self.raw, self.url, self.pos = raw, url, 0

    def read(self, n: int = -1) -> bytes:
        from google.api_core import exceptions

        try:
            data = self.raw.read(n)
        except exceptions.NotFound:
            raise FileNotFoundError(f"not found: {redact(self.url)}") from None
        except (exceptions.RetryError, exceptions.ServerError, exceptions.TooManyRequests) as e:
            cause = getattr(e, "cause", None) or e
            raise ConnectionError(
                f"{redact(self.url)}: read failed after byte {self.pos} ({type(cause).__name__}: "
                f"{str(cause).splitlines()[0][:200] if str(cause) else ''})"
            ) from None
        self.pos += len(data)
        return data


def _open_gs(url: str, timeout: float):
    from google.cloud.storage.retry import DEFAULT_RETRY

    check_gs_url(url)
    # the client's default retry gives up only after 120 s: bound it like the other schemes
    retry = getattr(DEFAULT_RETRY, "with_timeout", DEFAULT_RETRY.with_deadline)(timeout * ATTEMPTS)
    f = _GCSReader(gcs.blob(url).open("rb", chunk_size=8 << 20, timeout=timeout, retry=retry), url)
    f.read(0)  # BlobReader is lazy: fetch metadata now so that a missing object fails here
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
            raise FileNotFoundError(f"not found: {redact(url)}") from None
        except NoCredentialsError:
            raise PermissionError(
                f"{redact(url)}: no AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE / ~/.aws)"
            ) from None
        except PermissionError as e:
            raise PermissionError(
                f"{redact(url)}: access denied ({e}); the credentials need s3:GetObject on it"
            ) from None
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
            f"no opener for {redact(url)!r}; known schemes: {', '.join(sorted(SCHEMES))} (register_scheme adds one)"
        )
    return opener(url, timeout)


def read_bytes(url: str, timeout: float = DEFAULT_TIMEOUT, limit: int | None = None) -> bytes:
    """The whole object; with `limit`, a ValueError naming the URL once more than `limit` bytes arrive (a server
    sending an endless body cannot fill the memory)."""
    with open_url(url, timeout) as f:
        if limit is None:
            return f.read()
        parts, size = [], 0
        while chunk := f.read(min(1 << 20, limit + 1 - size)):
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise ValueError(f"{redact(url)}: more than {limit:,} bytes; refusing to read it whole")
        return b"".join(parts)


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
            raise ValueError(f"{scheme}:// handler only reads, asked for mode {mode!r} on {redact(url)}")
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
