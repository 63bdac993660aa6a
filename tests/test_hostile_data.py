"""Hostile or broken input never passes silently: manifests that point outside their folder, secrets in
URLs, folders holding someone else's files, a full disk, 16-bit images, cut http bodies, mirrored digits,
and broken tars. Real files, a real http server on 127.0.0.1, real subprocesses."""

from __future__ import annotations

import base64
import errno
import http.server
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import threading
import warnings
import zlib

import numpy as np
import pytest

from data_tools import ShardError, load_manifest, load_source, make_loader, verify_manifest, write_shards
from data_tools.transforms import decode_image
from data_tools.urls import open_url


def _small_set(tmp_path, name="a", n=40, per=20, source="custom", seed=1):
    x, y, names = load_source("synthetic", "train", num_synthetic=n, seed=seed)
    out = tmp_path / name
    m = write_shards(x, y, str(out), class_names=names, samples_per_shard=per, source=source)
    return out, m, x, y


# -- 1. shard names stay inside the manifest's folder ---------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    ["../b/train-000000.tar", "/etc/passwd", "..", ".", "", "sub\\train-000000.tar", "file:///etc/passwd", "C:x.tar"],
)
def test_manifest_shard_names_cannot_leave_the_folder(tmp_path, bad):
    a, _, _, _ = _small_set(tmp_path, "a")
    b, mb, _, _ = _small_set(tmp_path, "b", seed=2)
    man = json.loads((a / "manifest.json").read_text())
    # the entry matches the other dataset's shard byte for byte: only the name can tell
    man["shards"][0] = dict(mb["shards"][0], name=bad)
    (a / "manifest.json").write_text(json.dumps(man))
    path = str(a / "manifest.json")
    with pytest.raises(ShardError, match=r"manifest .*a/manifest.json: shard name") as e:
        load_manifest(path)
    assert repr(bad) in str(e.value)
    with pytest.raises(ShardError, match="shard name"):
        verify_manifest(path)
    with pytest.raises(ShardError, match="shard name"):
        make_loader(path, 10, train=False)


def test_verify_manifest_refuses_an_edited_dict(tmp_path):
    a, _, _, _ = _small_set(tmp_path, "a")
    m = load_manifest(str(a / "manifest.json"))
    m["shards"][0]["name"] = "../b/train-000000.tar"
    with pytest.raises(ShardError, match="shard name"):
        verify_manifest(m)


# -- an http server on 127.0.0.1 ------------------------------------------------------------------------
class _Server:
    """Serves `files` {path: bytes}; `short` {path: n}: send Content-Length of the whole body but only its
    first n bytes, then close (the first `short_times` requests of that path; -1: every request).
    Honours `Range: bytes=N-` and, with `auth`, asks for that Basic user:password."""

    def __init__(self):
        self.files, self.short, self.auth, self.seen = {}, {}, None, []
        self.short_times = -1
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                outer.seen.append((self.path, self.headers.get("Authorization"), self.headers.get("Host")))
                if (
                    outer.auth
                    and self.headers.get("Authorization") != "Basic " + base64.b64encode(outer.auth.encode()).decode()
                ):
                    self.send_response(401)
                    self.end_headers()
                    return
                if path not in outer.files:
                    self.send_response(404)
                    self.end_headers()
                    return
                body = outer.files[path]
                start = 0
                rng = self.headers.get("Range")
                if rng:
                    start = int(rng.split("=")[1].rstrip("-"))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                n = outer.short.get(path)
                if n is not None and outer.short_times != 0:
                    outer.short_times -= 1
                    self.wfile.write(body[start:n])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body[start:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def http_server():
    s = _Server()
    yield s
    s.close()


def _serve_folder(server, folder, prefix="/d"):
    for name in os.listdir(folder):
        if os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "rb") as f:
                server.files[f"{prefix}/{name}"] = f.read()


# -- 2. secrets in URLs ------------------------------------------------------------------------------------
def test_http_user_info_becomes_a_basic_header_and_never_reaches_dns(http_server):
    http_server.files["/x.bin"] = b"payload" * 100
    http_server.auth = "alice:s3cr3t-pw"
    with open_url(f"http://alice:s3cr3t-pw@127.0.0.1:{http_server.port}/x.bin", timeout=5) as f:
        assert f.read() == b"payload" * 100
    path, auth, host = http_server.seen[-1]
    assert auth == "Basic " + base64.b64encode(b"alice:s3cr3t-pw").decode()
    assert "s3cr3t" not in host and "alice" not in host


def test_errors_never_show_passwords_or_tokens(http_server, tmp_path):
    secret = "s3cr3t-pw"
    url = f"http://bob:{secret}@127.0.0.1:{http_server.port}/missing.tar?token=tok-123&X-Goog-Signature=sig-456"
    with pytest.raises(FileNotFoundError) as e:
        open_url(url, timeout=5)
    text = str(e.value)
    assert "127.0.0.1" in text and secret not in text and "tok-123" not in text and "sig-456" not in text
    # a stream over shards behind credentials: the shard is named, the password is not
    a, _, _, _ = _small_set(tmp_path, "a")
    _serve_folder(http_server, a)
    http_server.auth = f"bob:{secret}"
    http_server.files["/d/train-000001.tar"] = b"\0" * 10  # a broken shard: the error names it
    base = f"http://bob:{secret}@127.0.0.1:{http_server.port}/d"
    with pytest.raises(ShardError) as e:
        for _ in make_loader(base + "/manifest.json", 10, train=False, timeout=5):
            pass
    text = str(e.value)
    assert "train-000001.tar" in text and secret not in text, text


def test_pip_spec_secrets_are_redacted_in_what_envsetup_prints(monkeypatch):
    from labkit import envsetup as es

    spec = "labkit-xla @ git+https://alice:ghp_SECRET123@github.com/me/labkit?sig=abc"
    assert "ghp_SECRET123" not in es.redact(spec) and "abc" not in es.redact(spec)
    assert es.redact(spec).startswith("labkit-xla @ git+https://***@github.com/me/labkit?sig=***")
    assert es.redact("gs://bucket/a/b.tar") == "gs://bucket/a/b.tar"
    monkeypatch.setenv("LABKIT_PIP_SPEC", spec)
    f = es.Facts("jupyter", (3, 11), es.Tpu(chips=0, evidence=[]), {"torch": "2.9.0"}, "missing", frozenset())
    d = es.plan(f)
    line = es.decision_line(d)
    assert "github.com/me/labkit" in line and "ghp_SECRET123" not in line
    with pytest.raises(es.SetupError) as e:  # a failing install shows its command without the token
        es._pip(["install", "--no-deps", spec], shutil.which("false"))
    assert "github.com" in str(e.value) and "ghp_SECRET123" not in str(e.value)


# -- 3. the writer deletes only what it wrote -----------------------------------------------------------
def _foreign_folder(out):
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "my project", "files": ["train-000007.tar"]}')
    (out / "train-000007.tar").write_bytes(b"my own archive" * 100)
    (out / ".staging-mine").mkdir()
    (out / ".staging-mine" / "notes.txt").write_text("keep me")
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_cli_refuses_a_folder_with_a_foreign_manifest_and_deletes_nothing(tmp_path):
    out = tmp_path / "mine"
    before = _foreign_folder(out)
    r = subprocess.run(
        [sys.executable, "-m", "data_tools", "--source", "digits", "--split", "train", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0, r.stdout + r.stderr
    assert "manifest.json that labkit did not write" in r.stderr, r.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_writer_keeps_files_no_labkit_manifest_lists(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "train-000007.tar").write_bytes(b"not a labkit shard")
    x, y, names = load_source("synthetic", "train", num_synthetic=20, seed=1)
    with pytest.raises(ValueError, match="train-000007.tar, which no labkit manifest lists"):
        write_shards(x, y, str(out), class_names=names, samples_per_shard=10)
    assert sorted(os.listdir(out)) == ["train-000007.tar"]
    # a labkit folder with other people's files beside it: a rewrite replaces only its own shards
    (out / "train-000007.tar").unlink()
    write_shards(x, y, str(out), class_names=names, samples_per_shard=5)  # 4 shards
    (out / ".staging-mine").mkdir()
    (out / "notes.txt").write_text("keep")
    m = write_shards(x[:10], y[:10], str(out), class_names=names, samples_per_shard=5)
    assert sorted(os.listdir(out)) == sorted(
        [s["name"] for s in m["shards"]] + ["manifest.json", "notes.txt", ".staging-mine"]
    )


def test_a_split_name_that_would_make_bad_shard_names_is_refused(tmp_path):
    x, y, names = load_source("synthetic", "train", num_synthetic=5)
    for bad in ("a:b", "../x", ".hidden", "a\\b"):
        with pytest.raises(ValueError, match=f"split {re.escape(repr(bad))} must be a plain name"):
            write_shards(x, y, str(tmp_path / "o"), split=bad, class_names=names)
    assert not (tmp_path / "o").exists() or os.listdir(tmp_path / "o") == []


# -- 4. a full disk ---------------------------------------------------------------------------------------
def test_disk_full_while_writing_cleans_up_and_says_so(tmp_path, monkeypatch):
    import webdataset.writer

    out, m, x, y = _small_set(tmp_path, "d")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    class Full(io.FileIO):  # the disk fills after 4 KB: every later write fails, as on a real full disk
        def write(self, b):
            if self.tell() + len(b) > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(b)

    monkeypatch.setattr(webdataset.writer, "gopen", lambda path, mode="wb", **kw: Full(path, "wb"))
    x2, y2, names = load_source("synthetic", "train", num_synthetic=30, seed=5)
    with pytest.raises(OSError) as e:
        write_shards(x2, y2, str(out), class_names=names, samples_per_shard=20)
    assert {p.name: p.read_bytes() if p.is_file() else "dir" for p in out.iterdir()} == before  # no .staging-*
    assert e.value.errno == errno.ENOSPC
    assert re.search(r"no space left on .*d \(\d+ MB free\)", str(e.value)), e.value


# -- 5. 16-bit images -------------------------------------------------------------------------------------
def test_16_bit_png_is_scaled_not_binarised():
    from PIL import Image

    grey = (np.arange(64, dtype=np.uint32).reshape(8, 8) * 1000).astype(np.uint16)  # 0..63000
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, format="PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I")  # a real 16-bit PNG
    img = decode_image(buf.getvalue())
    assert img.dtype == np.uint8 and img.shape == (8, 8, 3)
    want = np.round(grey / 257).astype(np.uint8)
    assert np.array_equal(img[..., 0], want) and np.array_equal(img[..., 2], want)
    assert len(np.unique(img)) > 2


# -- 6. an http body cut short ------------------------------------------------------------------------------
def test_short_http_body_is_a_network_error_never_a_skipped_shard(http_server, tmp_path):
    a, m, _, _ = _small_set(tmp_path, "a", n=60, per=20)
    _serve_folder(http_server, a)
    http_server.short["/d/train-000001.tar"] = m["shards"][1]["bytes"] // 3  # every time
    url = f"http://127.0.0.1:{http_server.port}/d/manifest.json"
    with pytest.raises(ConnectionError, match=r"train-000001.tar.*closed the connection") as e:
        for _ in make_loader(url, 10, train=False, skip_corrupt=True, timeout=5):
            pass
    assert "corrupt" not in str(e.value).split("not a corrupt")[0]


def test_short_http_body_is_resumed_from_where_it_stopped(http_server):
    body = bytes(range(256)) * 400
    http_server.files["/x.bin"] = body
    http_server.short["/x.bin"] = 1000
    http_server.short_times = 1  # the first response is cut, the next one resumes
    with open_url(f"http://127.0.0.1:{http_server.port}/x.bin", timeout=5) as f:
        assert f.read() == body
    assert [p for p, _, _ in http_server.seen] == ["/x.bin", "/x.bin"]


# -- 7. no mirrored digits ------------------------------------------------------------------------------------
def _streamed_vs_source(out, x, **kw):
    """Every training image the loader yields, compared with its source image: (#equal, #mirrored)."""
    same = mirrored = 0
    loader = make_loader(
        str(out / "manifest.json"),
        10,
        train=True,
        crop_padding=0,
        mean=(0, 0, 0),
        std=(1 / 255,) * 3,
        return_keys=True,
        **kw,
    )
    for xb, _, keys in loader:
        for img, k in zip(xb, keys):
            src = x[int(k.rsplit("-", 1)[1])]
            got = img.permute(1, 2, 0).round().numpy().astype(np.uint8)
            if np.array_equal(got, src):
                same += 1
            elif np.array_equal(got, src[:, ::-1]):
                mirrored += 1
    return same, mirrored


def test_digits_are_never_mirrored_cifar_still_is(tmp_path):
    x, y, names = load_source("digits", "train")
    x, y = x[:60], y[:60]
    digits = tmp_path / "digits"
    m = write_shards(x, y, str(digits), class_names=names, samples_per_shard=30, source="digits")
    same, mirrored = _streamed_vs_source(digits, x)
    assert mirrored == 0 and same == 60
    assert m["hflip"] is False
    cifar = tmp_path / "cifar"  # CIFAR-10's manifest says mirrors keep labels: flips stay on
    assert write_shards(x, y, str(cifar), class_names=names, samples_per_shard=30, source="cifar10")["hflip"]
    same, mirrored = _streamed_vs_source(cifar, x)
    assert mirrored > 5 and same + mirrored == 60
    # a CIFAR-10 manifest written before manifests said so: its source decides (notebook 01 keeps its flips)
    man = json.loads((cifar / "manifest.json").read_text())
    del man["hflip"]
    (cifar / "manifest.json").write_text(json.dumps(man))
    assert make_loader(str(cifar / "manifest.json"), 10, train=True).stream.flip is True
    assert make_loader(str(digits / "manifest.json"), 10, train=True, flip=True).stream.flip is True


# -- weak spots: broken tars, duplicate keys, decompression bombs, odd gs:// paths, a dying GCS server --------
def _tar(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _png(n=32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((n, n, 3), np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_duplicate_key_in_a_shard_names_shard_and_key(tmp_path):
    p = tmp_path / "s-000000.tar"
    p.write_bytes(_tar([("k1.cls", b"1"), ("k1.png", _png()), ("k1.png", _png())]))
    with pytest.raises(ShardError, match=r"shard .*s-000000.tar: duplicate member .*k1.png"):
        for _ in make_loader(str(p), 1, train=False):
            pass


def test_absurd_tar_size_field_is_a_format_error(tmp_path):
    data = bytearray(_tar([("k1.cls", b"1"), ("k1.png", _png())]))
    h = data[:512]
    h[124:136] = b"\x80" + (2**80).to_bytes(11, "big")  # base-256 size: 2**80 bytes
    h[148:156] = b" " * 8
    h[148:156] = f"{sum(h):06o}\0 ".encode()
    data[:512] = h
    p = tmp_path / "s-000000.tar"
    p.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"s-000000.tar: corrupt .*claims \d+ bytes"):
        for _ in make_loader(str(p), 1, train=False):
            pass


def _bomb_png(w=13000, h=13000) -> bytes:
    """A PNG whose header claims w x h pixels with hardly any pixel data behind it."""

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b"")
    )


def test_png_claiming_gigapixels_is_refused_before_decoding(tmp_path):
    p = tmp_path / "s-000000.tar"
    p.write_bytes(_tar([("k1.cls", b"1"), ("k1.png", _bomb_png())]))
    with pytest.raises(ShardError, match=r"sample 'k1' cannot be decoded: image is 13000x13000, expected 32x32"):
        for _ in make_loader(str(p), 1, train=False):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's DecompressionBombWarning (over 89 M pixels) is not said first
        with pytest.raises(ValueError, match="13000x13000 pixels, more than MAX_PIXELS"):
            decode_image(_bomb_png())
        with pytest.raises(ValueError, match=r"more pixels than MAX_PIXELS \(16777216\).*400000000 pixels"):
            decode_image(_bomb_png(20000, 20000))  # over Pillow's error limit: the same kind of error


def test_gs_paths_with_empty_or_dot_segments_are_refused(gcs_bucket):
    x, y, names = load_source("synthetic", "train", num_synthetic=5)
    for bad in (f"gs://{gcs_bucket}/../x", f"gs://{gcs_bucket}//x", f"gs://{gcs_bucket}/a/./b"):
        with pytest.raises(ValueError, match=r"may not contain empty, '.' or '..' segments"):
            write_shards(x, y, bad, class_names=names)
        with pytest.raises(ValueError, match=r"may not contain empty"):
            open_url(bad + "/manifest.json")


def test_gcs_server_dying_mid_stream_is_a_connection_error_naming_the_object(tmp_path):
    from labkit.cloud import gcs
    from labkit.cloud.emulator import LocalGCSServer

    with LocalGCSServer(root=tmp_path / "gcs") as server:
        gcs.client().create_bucket("dying")
        body = os.urandom(9 << 20)  # more than one 8 MB chunk: the second fetch meets the dead server
        gcs.blob("gs://dying/big.bin").upload_from_string(body)
        f = open_url("gs://dying/big.bin", timeout=1)
        assert f.read(1 << 20) == body[: 1 << 20]
        server.stop()
        with pytest.raises(ConnectionError, match=r"gs://dying/big.bin: read failed after byte"):
            f.read()
