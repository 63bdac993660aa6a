"""URL opening: a server that accepts and never answers, or stalls mid-shard, fails in bounded time."""

import socket
import threading
import time

import pytest

from data_tools import load_source, make_loader, write_shards
from data_tools.urls import open_url


@pytest.fixture
def silent_server():
    """A real TCP server on 127.0.0.1 that accepts every connection and never sends a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


def test_silent_server_fails_in_bounded_time_saying_what_was_tried(silent_server):
    t = time.monotonic()
    with pytest.raises(
        ConnectionError,
        match=r"cannot read http://127.0.0.1:\d+/manifest.json: 3 attempts .*"
        r"timeout 0.5 s each.*try 1: TimeoutError.*try 3: TimeoutError",
    ):
        make_loader(silent_server + "/manifest.json", 8, train=False, timeout=0.5)
    assert time.monotonic() - t < 15  # 3 x 0.5 s + 1.5 s of backoff, with room for a loaded machine
    with pytest.raises(ConnectionError, match=r"manifest.json: 3 attempts"):  # looked for beside the shards
        make_loader(silent_server + "/train-{000000..000001}.tar", 8, train=False, timeout=0.5)


def test_shard_server_that_never_answers_fails_naming_the_shard(tmp_path):
    """The manifest is served; the shard requests are accepted and never answered."""
    import http.server

    x, y, names = load_source("synthetic", "train", num_synthetic=40)
    write_shards(x, y, str(tmp_path), class_names=names, samples_per_shard=20)
    release = threading.Event()

    class Hang(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(tmp_path), **kw)

        def do_GET(self):
            if self.path.endswith(".tar"):
                release.wait(60)  # holds the connection, sends nothing
                return
            super().do_GET()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hang)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        ld = make_loader(base + "/manifest.json", 8, train=True, num_workers=2, timeout=0.5)
        t = time.monotonic()
        with pytest.raises(ConnectionError, match=r"cannot read http://.*/train-00000[01].tar: 3 attempts"):
            list(ld)
        assert time.monotonic() - t < 30
    finally:
        release.set()
        server.shutdown()


def test_server_stalling_mid_shard_raises_timeout_naming_it(tmp_path):
    x, y, names = load_source("synthetic", "train", num_synthetic=40)
    write_shards(x, y, str(tmp_path), class_names=names, samples_per_shard=40)
    body = (tmp_path / "train-000000.tar").read_bytes()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    conns = []

    def serve():  # answers the headers and half the body, then holds the connection open
        c, _ = srv.accept()
        conns.append(c)
        c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 2])

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}/train-000000.tar"
    try:
        t = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"{url}: no data for 0.5 s after byte \d+"):
            with open_url(url, timeout=0.5) as f:
                while f.read(1 << 16):
                    pass
        assert time.monotonic() - t < 10
    finally:
        for c in conns:
            c.close()
        srv.close()


def test_scheme_registry_takes_new_schemes(tmp_path):
    from data_tools import register_scheme
    from data_tools.urls import SCHEMES

    (tmp_path / "a.bin").write_bytes(b"abc")
    register_scheme("mem", lambda url, timeout: open(tmp_path / url[len("mem://") :], "rb"))
    try:
        with open_url("mem://a.bin") as f:
            assert f.read() == b"abc"
    finally:
        del SCHEMES["mem"]
    with pytest.raises(ValueError, match=r"no opener for 'mem://a.bin'; known schemes: file, gs, http, https"):
        open_url("mem://a.bin")
