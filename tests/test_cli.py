"""The shard-writing command line: it writes, and bad settings give one clear line, fast."""

import json
import socket
import subprocess
import sys
import time

import pytest


def _cli(*args, env=None, module="data_tools.shard", timeout=120):
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_cli_writes_shards(tmp_path):
    out = tmp_path / "val"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_tools.shard",
            "--source",
            "digits",
            "--split",
            "val",
            "--out",
            str(out),
            "--samples-per-shard",
            "100",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["source"] == "digits" and m["split"] == "val" and len(m["shards"]) == 4 and m["num_samples"] == 359
    assert "359 samples in 4 shards" in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_tools.shard",
            "--source",
            "cifar10",
            "--split",
            "val",
            "--out",
            str(tmp_path / "c"),
            "--cifar-path",
            str(tmp_path / "none"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--cifar-path" in r.stderr


def _one_clear_line(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 or lines[0].startswith("usage:"), r.stderr  # one line, or argparse's usage + one
    assert "error:" in lines[-1], r.stderr
    for w in words:
        assert w in lines[-1], (w, r.stderr)


@pytest.mark.heavy
def test_cli_bad_outputs_and_settings_are_one_line(tmp_path):
    base = ["--source", "synthetic", "--split", "val", "--num-synthetic", "20", "--quiet"]
    f = tmp_path / "a-file"
    f.write_text("x")
    _one_clear_line(_cli(*base, "--out", str(f)), "error:", str(f), "is a file")
    _one_clear_line(
        _cli(*base, "--out", "/sys/labkit-not-writable"), "error:", "/sys/labkit-not-writable", "cannot write"
    )
    _one_clear_line(
        _cli(*base, "--out", str(tmp_path / "o"), "--max-shard-bytes", "0"), "--max-shard-bytes", "must be >= 1"
    )
    _one_clear_line(_cli(*base, "--out", str(tmp_path / "o"), "--samples-per-shard", "-3"), "must be >= 1")
    r = _cli(*base, "--out", str(tmp_path / "ok"), module="data_tools")  # python -m data_tools is the same
    assert r.returncode == 0 and json.loads((tmp_path / "ok" / "manifest.json").read_text())["num_samples"] == 4


@pytest.mark.heavy
def test_cli_unreachable_gcs_fails_fast(tmp_path):
    import os

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: every connection is refused
    env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
    t = time.monotonic()
    r = _cli("--source", "synthetic", "--split", "val", "--num-synthetic", "20", "--out", "gs://some-bucket/x", env=env)
    _one_clear_line(r, "error:", f"cannot reach GCS at http://127.0.0.1:{port}", "some-bucket")
    assert time.monotonic() - t < 60  # the client's default retry stayed silent for ~120 s
