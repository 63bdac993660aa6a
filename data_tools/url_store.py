"""A read-only store over any URL prefix that open_url reads (a folder, file://, gs://, s3://, http(s)://):
labkit.cloud.protocol.ReadStore, with open_url's time limits, bounded retries and redacted messages.

    from data_tools.url_store import URLStore
    store = URLStore("https://example.org/shards")
    with store.open("train-000000.tar") as f: ...
"""

from __future__ import annotations

from data_tools.urls import DEFAULT_TIMEOUT, open_url, read_bytes


class URLStore:
    """Reading `prefix/name` through data_tools.urls; listing and writing are not offered (http has neither)."""

    def __init__(self, prefix: str, timeout: float = DEFAULT_TIMEOUT):
        self.prefix, self.timeout = str(prefix).rstrip("/"), timeout

    def url(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def get(self, name: str) -> bytes:
        return read_bytes(self.url(name), self.timeout)

    def open(self, name: str):
        return open_url(self.url(name), self.timeout)
