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

import importlib
import os
from collections.abc import Callable

from labkit.cloud import gcs
from labkit.redact import redact  # every URL this package shows goes through it: no password, no token

from .http_read import ATTEMPTS, HttpStream, ObjectChanged, Wrapper, http_opener, http_request, retrying  # noqa: F401

DEFAULT_TIMEOUT = 30.0  # seconds without a byte before a network read gives up


_HttpStream = HttpStream


def _open_http(url: str, timeout: float):
    return HttpStream(url, timeout)


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
        except exceptions.NotFound:  # the reader pins the generation it first read: 404 may mean "replaced"
            if self.pos and _gcs_exists(self.url):
                raise ObjectChanged(
                    f"{redact(self.url)} changed while it was read (a new generation replaced the one read) after "
                    f"{self.pos:,} bytes: read it again"
                ) from None
            raise FileNotFoundError(f"not found: {redact(self.url)}") from None
        except (exceptions.RetryError, exceptions.ServerError, exceptions.TooManyRequests) as e:
            cause = getattr(e, "cause", None) or e
            raise ConnectionError(
                f"{redact(self.url)}: read failed after byte {self.pos} ({type(cause).__name__}: "
                f"{str(cause).splitlines()[0][:200] if str(cause) else ''})"
            ) from None
        self.pos += len(data)
        return data


def _gcs_exists(url: str) -> bool:
    try:
        return gcs.blob(url).exists(timeout=DEFAULT_TIMEOUT)
    except Exception:  # noqa: BLE001 - cannot tell: "not found" stays what is said
        return False


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
        # one try per call: the retries (and their backoff) are retrying's, bounded like the other schemes
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
    gcs.check_bucket("s3", url[len("s3://") :].partition("/")[0], url)  # user info, a bad name: no retry
    fs = _s3_filesystem(timeout)
    try:
        from botocore.exceptions import BotoCoreError, NoCredentialsError, ParamValidationError
    except ImportError:  # pragma: no cover - s3fs always brings botocore
        BotoCoreError = NoCredentialsError = ParamValidationError = ()

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
                f"{redact(url)}: access denied ({redact(e)}); the credentials need s3:GetObject on it"
            ) from None
        except (ParamValidationError, ValueError) as e:  # a parameter error: the same on every try
            raise ValueError(f"{redact(url)}: {type(e).__name__}: {redact(e)}") from None
        except BotoCoreError as e:  # endpoint unreachable, read timeout after botocore's own retries
            raise ConnectionError(f"{type(e).__name__}: {redact(e)}") from None

    return retrying(url, timeout, attempt, (ConnectionError, TimeoutError))


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
