"""Reading one http(s) object: its user info as a Basic header, redirects to http(s) only, bounded retries, a
per-receive time limit and a minimum rate, and resumes that are checked to continue the same object.

    from data_tools.http_read import HttpStream
    with HttpStream("https://example.org/shards/train-000000.tar", timeout=30) as f: data = f.read()

data_tools.urls opens every http(s):// URL through it (open_url); messages show URLs through labkit.redact.
"""

from __future__ import annotations

import base64
import http.client
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from urllib.parse import unquote

from labkit.redact import redact

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


def retrying(url: str, timeout: float, attempt: Callable[[], object], transient: tuple) -> object:
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


class ObjectChanged(OSError):
    """The object behind a URL was replaced while it was being read (a resumed read found another ETag,
    Last-Modified, generation or length): its bytes so far and the rest are not one object. Never retried,
    never skipped as corrupt: read it again."""


class _OnlyHttpRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) only: urllib also follows ftp://, which a shard server has no reason to send."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise ValueError(
                f"{redact(req.full_url)}: the server redirects to {redact(newurl)} (HTTP {code}); only http(s) "
                "redirects are followed"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_OnlyHttpRedirects)


def http_opener() -> urllib.request.OpenerDirector:
    """urllib's opener with redirects limited to http(s) (every http read of data_tools goes through it)."""
    return _OPENER


class HttpStream(Wrapper):
    """An http(s) body whose reads fail with TimeoutError once `timeout` seconds pass without a byte,
    and whose early end (fewer bytes than Content-Length: the server or a proxy closed the connection)
    is a network error: the read resumes from the byte where it stopped, ATTEMPTS tries in all, then
    ConnectionError naming the URL. Never a short body handed on as if it were the whole file (a "corrupt" shard).

    A resumed read is the same object or an error: the Range request carries If-Range with the first reply's
    ETag (else its Last-Modified), a 206 must say Content-Range `bytes POS-.../LENGTH` with the byte it was asked
    for and the first length, and a 200 (the server ignored the Range, or If-Range found another object) is read
    from byte 0 again only when its ETag/Last-Modified and length equal the first reply's (the bytes before POS
    are skipped, never handed on twice); another object is ObjectChanged naming the URL, a server that ignores
    Range and names no version is refused by name. Bytes arrive one socket read at a time (`read1`): the per-read
    `timeout` and the minimum rate are checked after every receive, so a body trickling into a large read fails
    by its rate instead of filling the read for hours."""

    # a body that trickles (1 byte per second never trips the per-read timeout) is a failure too: after a grace
    # period the average rate must stay above MIN_RATE bytes/s, else TimeoutError naming the URL
    MIN_RATE = 16 << 10
    GRACE_S = 30.0

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout, self.pos = url, timeout, 0
        self.t0 = time.monotonic()
        self.version = None  # ("ETag", value) or ("Last-Modified", value) of the first reply
        self.raw = self._get(0)
        self.length = self.raw.length  # None when the server sent no Content-Length (chunked)
        etag, modified = self.raw.headers.get("ETag"), self.raw.headers.get("Last-Modified")
        if etag and not etag.startswith("W/"):  # a weak ETag may not be used in If-Range
            self.version = ("ETag", etag)
        elif modified:
            self.version = ("Last-Modified", modified)

    def _changed(self, why: str) -> ObjectChanged:
        return ObjectChanged(
            f"{redact(self.url)} changed while it was read ({why}) after {self.pos:,} bytes: the bytes so far and "
            "the rest would be two objects spliced; read it again"
        )

    def _check_resume(self, r, start: int) -> None:
        """The reply to a resumed read continues the object read so far, or an error names why not."""
        kind, value = self.version or (None, None)
        now = r.headers.get(kind) if kind else None
        if kind and now and now != value:
            raise self._changed(f"{kind} {value}, now {now}")
        if r.status == 206:
            m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", (r.headers.get("Content-Range") or "").strip())
            if not m or int(m.group(1)) != start:
                raise self._changed(f"asked for bytes {start}-, got Content-Range {r.headers.get('Content-Range')!r}")
            if self.length is not None and m.group(3) != "*" and int(m.group(3)) != self.length:
                raise self._changed(f"length {self.length}, now {m.group(3)}")
            return
        if not kind:  # a 200: the whole body again, nothing says it is the same object (no retry: it stays so)
            raise OSError(
                f"{redact(self.url)}: the server ignored the Range request (HTTP {r.status}) and names no version "
                "(no ETag, no Last-Modified): the rest cannot be checked to be the same object; refused"
            )
        if self.length is not None and r.length is not None and r.length != self.length:
            raise self._changed(f"length {self.length}, now {r.length}")
        skip = start  # the same object from byte 0: skip what was already read (never handed on twice)
        while skip:
            got = r.read1(min(skip, 1 << 20))
            if not got:
                raise ConnectionError(f"closed again before byte {start}")
            skip -= len(got)

    def _get(self, start: int):
        def attempt():
            req = http_request(self.url, start)
            if start and self.version:
                req.add_header("If-Range", self.version[1])
            try:  # timeout: per socket wait, connect included
                r = _OPENER.open(req, timeout=self.timeout)
            except urllib.error.HTTPError as e:
                if e.code in (404, 410):
                    raise FileNotFoundError(f"not found: {redact(self.url)} (HTTP {e.code})") from None
                if e.code == 416:  # the object is shorter than what was read: another object
                    raise self._changed("HTTP 416: the range asked for is past its end") from None
                if e.code < 500:
                    raise PermissionError(f"{redact(self.url)}: HTTP {e.code} {e.reason}") from None
                raise ConnectionError(f"HTTP {e.code} {e.reason}") from None
            if start:
                try:
                    self._check_resume(r, start)
                except BaseException:
                    r.close()
                    raise
            return r

        return retrying(self.url, self.timeout, attempt, (ConnectionError, TimeoutError, urllib.error.URLError))

    def _check_rate(self) -> None:
        elapsed = time.monotonic() - self.t0
        if elapsed > self.GRACE_S and self.pos < self.MIN_RATE * elapsed:
            raise TimeoutError(
                f"{redact(self.url)}: {self.pos:,} bytes in {elapsed:.0f} s, under {self.MIN_RATE:,} bytes/s: "
                "the server is too slow to feed training, or never ends"
            )

    def _read_once(self, n: int) -> bytes:
        """At most n bytes from one socket receive (read1: never waits for a whole block to fill)."""
        try:
            return self.raw.read1(n)
        except TimeoutError as e:
            raise TimeoutError(
                f"{redact(self.url)}: no data for {self.timeout:g} s after byte {self.pos} (read timed out; "
                "raise timeout= if the server is slow)"
            ) from e
        except http.client.IncompleteRead as e:  # a chunked body cut short
            return e.partial

    def _read_some(self, n: int) -> bytes:
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

    def read(self, n: int = -1) -> bytes:
        """n bytes (fewer only at the end), gathered one receive at a time; n < 0: the rest."""
        if n is None or n < 0:
            n = float("inf")
        chunks, size = [], 0
        while size < n:
            chunk = self._read_some(int(min(n - size, 1 << 20)))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
