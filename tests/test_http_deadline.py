"""An http body that trickles (a byte at a time, never long enough silent for the per-read timeout) fails by its
average rate, naming the URL; a shard that pads past its manifest size stops there instead of reading forever."""

import hashlib
import http.server
import io
import threading
import time

import pytest

from data_tools import urls
from data_tools.manifest import HashingReader, ShardError


def _serve(handler):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class Trickle(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(100000):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.01)
        except OSError:
            pass

    def log_message(self, *a):
        pass


@pytest.mark.timing
def test_a_trickling_body_fails_by_its_rate_naming_the_url(monkeypatch):
    monkeypatch.setattr(urls._HttpStream, "GRACE_S", 1.0)
    server, base = _serve(Trickle)
    try:
        t = time.monotonic()
        with pytest.raises(
            TimeoutError, match=r"http://127.0.0.1:\d+/shard.tar: .* bytes in \d+ s, under 16,384 bytes/s"
        ):
            with urls.open_url(base + "/shard.tar", 5) as f:
                while f.read(1):
                    pass
        assert time.monotonic() - t < 10
    finally:
        server.shutdown()


class Endless:
    """A shard body: the tar, then zeros without end (a server that pads forever)."""

    def __init__(self, body: bytes):
        self.body, self.pos = body, 0

    def read(self, n=-1):
        n = 1 << 20 if n is None or n < 0 else n
        out = self.body[self.pos : self.pos + n].ljust(n, b"\0")
        self.pos += n
        return out


def test_a_shard_that_pads_forever_stops_at_its_manifest_size():
    body = b"tar bytes" + b"\0" * 1015
    entry = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    r = HashingReader(Endless(body))
    r.read(9)
    with pytest.raises(ShardError, match="more than the 1,024 bytes the manifest lists"):
        r.finish("http://example.invalid/shard.tar", entry)
    ok = HashingReader(io.BytesIO(body))
    ok.read(9)
    ok.finish("x", entry)  # the exact size: fine
