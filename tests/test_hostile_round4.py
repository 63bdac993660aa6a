"""Hostile input, round 4: untrusted bytes start no program (a field is read only by the decoder its extension
names), resumed http reads are the same object, and settings, labels and stray files that used to crash unnamed
are named. Real files, a real http server on 127.0.0.1, Pillow's real plugins."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest

from data_tools import ShardError, make_loader

EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\n%%EndComments\n"
    b"newpath 0 0 moveto 32 32 lineto stroke\nshowpage\n%%EOF\n"
)


def _tar(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _image(fmt="PNG", size=(32, 32), **save) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((size[1], size[0], 3), np.uint8)).save(buf, format=fmt, **save)
    return buf.getvalue()


def _read_all(path, **kw):
    for _ in make_loader(str(path), 1, train=False, **kw):
        pass


# -- 1. image decoders allow-listed per field ---------------------------------------------------------
@pytest.fixture
def fake_ghostscript(tmp_path, monkeypatch):
    """A `gs` first on PATH that leaves a mark when run; Pillow looks it up afresh."""
    from PIL import EpsImagePlugin

    bin_dir, mark = tmp_path / "bin", tmp_path / "gs-ran"
    bin_dir.mkdir()
    (bin_dir / "gs").write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    (bin_dir / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)
    return mark


@pytest.mark.parametrize("field", ["jpg", "png"])
def test_eps_bytes_in_an_image_field_never_start_ghostscript(tmp_path, fake_ghostscript, field):
    p = tmp_path / "s-000000.tar"
    p.write_bytes(_tar([("k1.cls", b"1"), (f"k1.{field}", EPS)]))
    for kw in ({}, {"image_size": 16}):  # the fixed-size path and the photo path
        with pytest.raises(ShardError) as e:
            _read_all(p, **kw)
        text = str(e.value)
        assert "s-000000.tar" in text and "'k1'" in text and f"'{field}'" in text, text
        assert "holds EPS data" in text, text
    assert not fake_ghostscript.exists(), "Ghostscript was started on a shard's bytes"


def test_a_field_is_read_only_by_its_own_decoder(tmp_path):
    p = tmp_path / "s-000000.tar"
    p.write_bytes(_tar([("k1.cls", b"1"), ("k1.jpg", _image("PNG"))]))  # a PNG under .jpg: refused by name
    with pytest.raises(ShardError, match=r"'jpg' field holds PNG data, not JPEG"):
        _read_all(p)
    p.write_bytes(_tar([("k1.cls", b"1"), ("k1.png", _image("TIFF"))]))
    with pytest.raises(ShardError, match=r"'png' field holds TIFF data, not PNG"):
        _read_all(p, image_size=8)


def test_exif_orientation_is_applied(tmp_path):
    from PIL import Image

    from data_tools.transforms import decode_image

    im = Image.fromarray(np.zeros((16, 32, 3), np.uint8))  # stored 32 wide, 16 high
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: the camera meant 16 wide, 32 high
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif)
    assert decode_image(buf.getvalue(), field="jpg").shape == (32, 16, 3)
    p = tmp_path / "s-000000.tar"
    p.write_bytes(_tar([("k1.cls", b"1"), ("k1.jpg", buf.getvalue())]))
    _read_all(p, image_size=(32, 16))  # eval: the upright photo, as it is


def test_an_animated_png_gives_its_first_frame():
    from PIL import Image

    from data_tools.transforms import decode_image

    frames = [Image.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in (10, 200)]
    buf = io.BytesIO()
    frames[0].save(buf, format="PNG", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(buf.getvalue())).n_frames == 2
    assert (decode_image(buf.getvalue(), field="png") == 10).all()


# -- 3. a resumed http read is the same object ------------------------------------------------------------
class _Versioned:
    """An http server on 127.0.0.1 whose object can be replaced between requests. The first GET sends `cut`
    bytes and closes; `mode` says how later requests answer: "if-range" (RFC 9110: If-Range that no longer
    matches gives the whole new object, 200), "ignore-if-range" (206 from the new object), "no-range" (always
    200, from byte 0), "bad-start" (206 whose Content-Range starts elsewhere); etag=False sends no validator."""

    def __init__(self, body, mode="if-range", etag=True, cut=1000):
        import http.server
        import threading

        self.body, self.version, self.mode, self.requests = body, 1, mode, 0
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.requests += 1
                first = outer.requests == 1
                if self.path.startswith("/redirect"):
                    self.send_response(302)
                    self.send_header("Location", "ftp://127.0.0.1/x.tar")
                    self.end_headers()
                    return
                body, tag = outer.body, f'"v{outer.version}"'
                rng, cond = self.headers.get("Range"), self.headers.get("If-Range")
                start = int(rng.split("=")[1].rstrip("-")) if rng else 0
                if outer.mode == "no-range" or (outer.mode == "if-range" and cond and cond != tag):
                    start = 0
                if start:
                    self.send_response(206)
                    first_byte = start + 7 if outer.mode == "bad-start" else start
                    self.send_header("Content-Range", f"bytes {first_byte}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                if etag:
                    self.send_header("ETag", tag)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                self.wfile.write(body[start : outer.cut_at if first else None] if first else body[start:])
                self.wfile.flush()
                self.close_connection = True

        self.cut_at = cut
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://u:PA55@127.0.0.1:{self.httpd.server_address[1]}/x.tar?token=TOKEN123"

    def replace(self, body):
        self.body, self.version = body, self.version + 1

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _read_resumed(server, replace=None):
    from data_tools.urls import open_url

    with open_url(server.url, timeout=5) as f:
        head = f.read(1000)
        if replace is not None:
            server.replace(replace)
        return head + f.read()


@pytest.mark.parametrize("mode", ["if-range", "ignore-if-range", "no-range"])
def test_an_object_replaced_between_resumes_is_named_never_spliced(mode):
    from data_tools.urls import ObjectChanged

    old, new = bytes(range(256)) * 20, bytes(reversed(range(256))) * 20
    s = _Versioned(old, mode)
    try:
        with pytest.raises(ObjectChanged, match=r"http://\*\*\*@127.0.0.1:\d+/x.tar\?token=\*\*\* changed") as e:
            _read_resumed(s, replace=new)
        assert "PA55" not in str(e.value) and "TOKEN123" not in str(e.value)
    finally:
        s.close()


def test_a_server_ignoring_range_is_read_once_from_the_start_or_refused():
    body = bytes(range(256)) * 20
    s = _Versioned(body, "no-range")
    try:
        assert _read_resumed(s) == body  # the same ETag: the first 1000 bytes skipped, never handed on twice
    finally:
        s.close()
    s = _Versioned(body, "no-range", etag=False)
    try:
        with pytest.raises(OSError, match=r"ignored the Range request .* names no version") as e:
            _read_resumed(s)
        assert not isinstance(e.value, ConnectionError)  # refused, not retried as a network failure
    finally:
        s.close()


def test_a_206_starting_elsewhere_is_refused():
    from data_tools.urls import ObjectChanged

    s = _Versioned(bytes(range(256)) * 20, "bad-start")
    try:
        with pytest.raises(ObjectChanged, match=r"asked for bytes 1000-, got Content-Range 'bytes 1007-"):
            _read_resumed(s)
    finally:
        s.close()


def test_a_redirect_to_ftp_is_refused_by_name():
    from data_tools.urls import open_url

    s = _Versioned(b"x")
    try:
        url = s.url.replace("/x.tar", "/redirect")
        with pytest.raises(ValueError, match=r"redirects to ftp://127.0.0.1/x.tar .*only http\(s\)"):
            open_url(url, timeout=5)
    finally:
        s.close()


@pytest.mark.timing
def test_a_trickle_into_a_large_read_fails_by_its_rate(monkeypatch):
    import http.server
    import threading
    import time

    from data_tools import urls

    class Trickle(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            end = time.monotonic() + 8  # then silence: the old buffered read would wait for a full block
            try:
                while time.monotonic() < end:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.01)
            except OSError:
                pass

    monkeypatch.setattr(urls._HttpStream, "GRACE_S", 1.0)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t = time.monotonic()
        with pytest.raises(TimeoutError, match=r"bytes in \d+ s, under 16,384 bytes/s"):
            with urls.open_url(f"http://127.0.0.1:{server.server_address[1]}/s.tar", 30) as f:
                f.read(1 << 20)  # one large read: the rate is checked after every receive inside it
        assert time.monotonic() - t < 5
    finally:
        server.shutdown()
        server.server_close()


# -- 4. checkpoint roots with dot segments or doubled slashes: refused alike by every store ----------------
@pytest.mark.parametrize("tail", ["runs/../exp", "a//b", "c/./d"])
def test_every_store_refuses_dot_segments_and_doubled_slashes(tmp_path, tail):
    from labkit.cloud import open_store

    for root in (f"{tmp_path}/{tail}", f"gs://bucket/{tail}", f"s3://bucket/{tail}"):
        with pytest.raises(ValueError, match=r"checkpoint root .* holds (an empty|a '\.\.'|a '\.') path segment"):
            open_store(root)
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()  # refused before anything is made
    assert open_store(f"{tmp_path}/ok/").root.endswith("ok/")  # a trailing / is no segment


# -- 5. crashes that named nothing ---------------------------------------------------------------------------
def test_a_stray_temp_file_or_lock_with_a_huge_pid_is_left_alone(tmp_path):
    from labkit.cloud import LocalStore
    from labkit.cloud.store import _pid_alive

    (tmp_path / ".x.99999999999999999999.abc.tmp").write_bytes(b"")
    LocalStore(tmp_path)  # sweeps temp files of dead writers: this name is no pid, so it stays
    assert (tmp_path / ".x.99999999999999999999.abc.tmp").exists()
    assert _pid_alive(1234567890123) and _pid_alive(0)  # a lock body's 13-digit pid: never "dead", no OverflowError


@pytest.mark.parametrize(
    "members, kw, match",
    [
        ([("k1.json", b"[" * 100000 + b"]" * 100000)], {"label": "json:cls"}, r"'k1': json is JSON nested too deep"),
        ([("k1.cls", b"12345678901234567890")], {}, r"'k1': label 12345678901234567890 .* too large"),
        ([("k1.cls", b"1_0")], {}, r"'k1': label '1_0' in 'cls' is no class index"),
    ],
)
def test_labels_that_crashed_unnamed_are_named_and_skippable(tmp_path, members, kw, match):
    p = tmp_path / "s-000000.tar"
    png = _image("PNG")
    good = ("k2.json", b'{"cls": 1}') if kw else ("k2.cls", b"1")
    p.write_bytes(_tar([*members, ("k1.png", png), good, ("k2.png", png)]))
    with pytest.raises(ShardError, match=match):
        _read_all(p, **kw)
    loader = make_loader(str(p), 1, train=False, skip_corrupt=True, **kw)
    assert [len(y) for _, y in loader] == [1] and loader.skipped == 1  # k1 skipped, k2 read


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"image_size": 0}, "image_size=0"),
        ({"image_size": -3}, "image_size=-3"),
        ({"image_size": True}, "image_size=True"),
        ({"image_size": "224"}, "image_size='224'"),
        ({"image_size": (224,)}, r"image_size=\(224,\)"),
        ({"image_size": (22.5, 22.5)}, r"image_size=\(22.5, 22.5\)"),
        ({"image_size": 8, "crop_scale": (2, 3)}, r"crop_scale=\(2, 3\)"),
        ({"image_size": 8, "crop_scale": (0.5,)}, r"crop_scale=\(0.5,\)"),
        ({"classes": ["cat", "dog", "cat"]}, r"classes: names given twice: \['cat'\]"),
        ({"classes": {"cat": True, "dog": 1}}, r"classes: indices must be ints >= 0"),
        ({"classes": {"cat": "0", "dog": "1"}}, r"classes: indices must be ints >= 0"),
    ],
)
def test_settings_are_checked_where_given_naming_the_setting(tmp_path, kw, match):
    p = tmp_path / "s-000000.tar"
    p.write_bytes(_tar([("k1.cls", b"1"), ("k1.png", _image("PNG"))]))
    with pytest.raises(ValueError, match=match):
        make_loader(str(p), 1, train=False, **kw)


def test_a_wrong_mesh_axis_is_named_with_the_axes_there():
    import torch
    import torch_xla.distributed.spmd as xs

    from labkit.spmd.sharding import apply_specs, shard_batch

    mesh = xs.Mesh(np.arange(1), (1,), ("data",))
    with pytest.raises(ValueError, match=r"mesh axis 'dta' .* its axes: \('data',\)"):
        shard_batch((torch.zeros(2),), mesh, "dta")
    with pytest.raises(ValueError, match=r"mesh axis 'model' .* its axes: \('data',\)"):
        apply_specs(torch.nn.Linear(2, 2), mesh, {"weight": ("model", None)})


class _Expired(OSError):
    """Like s3fs's FileExpired: an OSError whose constructor takes other arguments than a message."""

    def __init__(self, filename, e_tag):
        super().__init__(5, f"the remote file {filename} with ETag {e_tag} no longer exists")


def test_a_read_error_keeps_its_own_message(tmp_path, monkeypatch):
    from data_tools import urls

    data = _tar([("k1.cls", b"1"), ("k1.png", _image("PNG")), ("k2.cls", b"1"), ("k2.png", _image("PNG"))])

    class Dying(io.BytesIO):
        def read(self, n=-1):
            if self.tell() > 600:
                raise _Expired("x.tar", '"abc"')
            return super().read(n)

    def opener(url, timeout):
        if url.endswith("manifest.json"):
            raise FileNotFoundError(url)  # no manifest: the shard alone
        return Dying(data)

    monkeypatch.setitem(urls.SCHEMES, "dying", opener)
    with pytest.raises(OSError, match=r"dying://h/s-000000.tar: read failed .*_Expired: .*ETag \"abc\" no longer") as e:
        _read_all("dying://h/s-000000.tar")
    assert isinstance(e.value.__cause__, _Expired)


# -- 6. silent no more ---------------------------------------------------------------------------------------
def test_a_key_appended_later_is_refused_or_counted(tmp_path):
    p = tmp_path / "s-000000.tar"
    png = _image("PNG")
    p.write_bytes(_tar([("k1.cls", b"1"), ("k1.png", png), ("k2.cls", b"2"), ("k2.png", png), ("k1.cls", b"3")]))
    with pytest.raises(ShardError, match=r"s-000000.tar: key 'k1' appears again after 2 sample"):
        _read_all(p)
    loader = make_loader(str(p), 1, train=False, skip_corrupt=True)
    assert [int(y[0]) for _, y in loader] == [1, 2] and loader.skipped == 1


def test_a_compressed_shard_is_said_to_be_compressed(tmp_path):
    import gzip

    p = tmp_path / "s-000000.tar.gz"
    p.write_bytes(gzip.compress(_tar([("k1.cls", b"1"), ("k1.png", _image("PNG"))])))
    for kw in ({}, {"skip_corrupt": True}):  # never skipped as corrupt: every sample would be lost
        with pytest.raises(ShardError, match=r"s-000000.tar.gz: a gzip-compressed tar: not supported; decompress"):
            _read_all(p, **kw)


@pytest.mark.parametrize("members", [[], [("dir/", None)]])
def test_an_empty_evaluation_shard_is_said(tmp_path, members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for name, _ in members:
            ti = tarfile.TarInfo(name)
            ti.type = tarfile.DIRTYPE
            tf.addfile(ti)
    p = tmp_path / "s-000000.tar"
    p.write_bytes(buf.getvalue())
    with pytest.raises(ShardError, match=r"no readable samples to evaluate \(empty, or folders only\?\) in shards"):
        _read_all(p)


def test_the_dashboard_json_after_a_nan_loss_is_json():
    import json

    from labkit.dashboard import ConsoleSink, Dashboard

    dash = Dashboard(sink=ConsoleSink(io.StringIO()), find_syncs=False, controls=False)
    dash.history += [{"step": 1, "loss": float("nan")}, {"step": 2, "loss": float("inf")}, {"step": 3, "loss": 0.5}]

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    data = json.loads(dash.to_json(), parse_constant=refuse)
    assert [r["loss"] for r in data["history"]] == [None, None, 0.5] and data["nonfinite"] == 2


def test_a_network_error_reading_the_pointer_is_retried_then_read_failed_never_a_fallback(gcs_bucket, monkeypatch):
    import warnings

    import torch

    from labkit.checkpoint import CheckpointManager
    from labkit.checkpoint.state import ReadFailed

    root = f"gs://{gcs_bucket}/run"
    m = CheckpointManager(root, keep=3, rt=None, best_metric=None, async_save=False, format="file")
    for s in (1, 2):
        m.save(s, {"w": torch.full((2,), float(s)), "step": s})
    m.close()
    m = CheckpointManager(root, rt=None, best_metric=None)
    real, calls = m.store.get_versioned, []

    def drops_once(name):
        calls.append(name)
        if len(calls) == 1:
            raise ConnectionError("connection reset by peer")
        return real(name)

    monkeypatch.setattr(m.store, "get_versioned", drops_once)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "falling back" warning
        assert m.restore()["step"] == 2  # read again: not step 1 with a warning

    def always_down(name):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(m.store, "get_versioned", always_down)
    with pytest.raises(ReadFailed, match=r"run/latest failed 3 times .*instead of falling back"):
        m.restore()


def test_a_dcp_metadata_declaring_an_absurd_size_is_refused_before_allocating(tmp_path):
    import json
    import pickle

    import torch

    from labkit.checkpoint.safe_load import CheckpointRefused
    from labkit.checkpoint.sharded import MARKER, ShardedCheckpointManager, folder_name
    from labkit.cloud import gcs

    ck = ShardedCheckpointManager(tmp_path)
    ck.save(1, {"w": torch.ones(4), "step": 1})
    ck.close()
    folder = tmp_path / folder_name(1)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    meta.state_dict_metadata["w"].size = torch.Size([1 << 40])  # 4 TB of float32
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    rec = json.loads((folder / MARKER).read_text())  # the commit record made to agree: only the size is wrong
    rec["files"][".metadata"] = {
        "crc32c": gcs.crc32c_b64(folder / ".metadata"),
        "size": (folder / ".metadata").stat().st_size,
    }
    (folder / MARKER).write_text(json.dumps(rec))
    with pytest.raises(
        CheckpointRefused, match=r"w declares \(1099511627776,\) torch.float32 .* the metadata is damaged"
    ):
        ShardedCheckpointManager(tmp_path).restore(step=1)  # no template: every entry would be allocated


def test_a_gs_object_replaced_mid_read_is_said_to_have_changed_not_to_be_missing(gcs_bucket):
    from data_tools.urls import ObjectChanged, open_url
    from labkit.cloud import gcs

    url = f"gs://{gcs_bucket}/x.bin"
    gcs.blob(url).upload_from_string(b"a" * (9 << 20))  # past the reader's 8 MiB chunk: a second request follows
    with open_url(url, 10) as f:
        assert f.read(1 << 20) == b"a" * (1 << 20)
        gcs.blob(url).upload_from_string(b"b" * (9 << 20))  # a new generation
        with pytest.raises(ObjectChanged, match=rf"gs://{gcs_bucket}/x.bin changed while it was read"):
            f.read()
