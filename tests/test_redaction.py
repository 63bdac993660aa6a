"""One redaction (labkit.redact) for every URL and command line that reaches a message, a log line or a file:
user info with raw '/', '#', '?', signed-URL parameters, another process's command line, the set-up cell's
decision line, s3:// and gs:// errors (refused as parameter errors, never retried), the sample-count cache."""

from __future__ import annotations

import json
import os
import stat
import time
import warnings

import pytest

from labkit import envsetup as es
from labkit.redact import redact, redact_command

SECRETS = ("SECRETKEY", "PA55", "TOKEN123", "SIGVALUE", "CREDVALUE")


def _clean(text: str) -> bool:
    return not any(s in text for s in SECRETS)


@pytest.mark.parametrize(
    "url, keep",
    [
        ("s3://AKIA:SECRETKEY/with/slashes@bucket/run", "bucket/run"),
        ("gs://user:TOKEN123#frag?q@bucket/run", "bucket/run"),
        ("https://u:PA55/x#y?z@host.example/x.tar", "host.example/x.tar"),
        ("https://host.example/x?X-Goog-Signature=SIGVALUE&X-Goog-Credential=CREDVALUE&x=1", "x=1"),
        ("https://h/x?X-Amz-Signature=SIGVALUE&X-Amz-Credential=CREDVALUE%2F2026&X-Amz-Security-Token=TOKEN123", "h/x"),
        ("https://h/x?Signature=SIGVALUE&sig=SIGVALUE&key=SECRETKEY&access_token=TOKEN123", "h/x"),
        ("labkit-xla @ git+https://u:PA55/a#b?c@github.com/labkit/labkit@main", "github.com/labkit/labkit@main"),
    ],
)
def test_one_redaction_hides_user_info_and_signatures(url, keep):
    shown = redact(f"cannot read {url}: timed out")
    assert _clean(shown) and keep in shown and shown.endswith("timed out"), shown
    assert es.redact is redact  # envsetup, labkit.cloud and data_tools show URLs through this one function


def test_a_command_line_hides_urls_options_and_assignments():
    cmd = ["python", "train.py", "--token", "TOKEN123", "--api-key=SECRETKEY", "HF_TOKEN=TOKEN123",
           "https://u:PA55@h/x?X-Goog-Signature=SIGVALUE", "--steps", "10"]  # fmt: skip
    shown = redact_command(cmd)
    assert _clean(shown) and "train.py" in shown and "--steps 10" in shown, shown


def test_the_tpu_busy_advice_hides_the_other_process_secrets(tmp_path):
    proc = tmp_path / "proc" / "4242"
    proc.mkdir(parents=True)
    args = ["python", "train.py", "--data", "https://u:PA55@h/x?X-Goog-Signature=SIGVALUE", "--token", "TOKEN123"]
    (proc / "cmdline").write_bytes(b"\0".join(a.encode() for a in args) + b"\0")
    advice = es.tpu_error_advice("The TPU is already in use by process with pid 4242", root=str(tmp_path))
    assert "4242" in advice and "train.py" in advice and _clean(advice), advice
    (proc / "fd").mkdir()
    (proc / "fd" / "3").symlink_to("/dev/accel0")  # what the doctor lists: every holder of a TPU device
    (holder,) = es.tpu_holders(str(tmp_path))
    assert holder[0] == 4242 and "train.py" in holder[1] and _clean(holder[1]), holder


@pytest.mark.parametrize("password", ["PA55/x", "PA55#x", "PA55?x"])
def test_the_decision_line_hides_a_password_with_raw_separators(password):
    spec = f"labkit-xla @ git+https://user:{password}@github.com/labkit/labkit"
    line = es.decision_line(es.Decision("jupyter", "keep", "why", [], spec))
    assert "PA55" not in line and "github.com/labkit/labkit" in line, line


def test_a_blank_pip_spec_is_unset_in_envsetup_and_in_the_set_up_cell(monkeypatch):
    import subprocess

    monkeypatch.setenv("LABKIT_PIP_SPEC", "   ")
    assert es.pip_spec() == f"{es.DIST_NAME} @ {es.PUBLISHED}"
    # the cell, run by a Python without labkit, its pip calls recorded instead of run
    code = (
        "import subprocess\ncalls = []\n"
        "subprocess.run = lambda cmd, **kw: calls.append(cmd) or type('R', (), {'returncode': 0})()\n"
        + es.SETUP_CELL.split("importlib.invalidate_caches()")[0]
        + "\nprint(calls[-1][-1])"
    )
    env = {**os.environ, "LABKIT_PIP_SPEC": "   ", "PYTHONPATH": ""}
    cmd = ["/usr/bin/env", "-u", "VIRTUAL_ENV", "python3", "-I", "-c", code]  # a Python without labkit
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/", timeout=120)
    assert r.stdout.strip() == f"{es.DIST_NAME} @ {es.PUBLISHED}", (r.stdout, r.stderr[-500:])


@pytest.mark.parametrize(
    "root", ["s3://AKIA:SECRETKEY/x@bucket/run", "gs://user:TOKEN123@bucket/run", "s3://Bad_Bucket!/run"]
)
def test_bucket_urls_with_credentials_or_bad_names_are_refused_at_once(root):
    from data_tools.urls import open_url
    from labkit.cloud import open_store

    for call in (lambda: open_store(root), lambda: open_url(root + "/manifest.json", timeout=5)):
        with pytest.raises(ValueError):
            call()  # the first call pays for imports
        t = time.monotonic()
        with pytest.raises(ValueError) as e:
            call()
        assert time.monotonic() - t < 0.4  # a parameter error: not retried as a network failure (0.5 s backoff)
        assert _clean(str(e.value)) and ("carries no credentials" in str(e.value) or "no valid bucket" in str(e.value))


def test_the_count_cache_stores_no_credential_and_is_private(tmp_path, monkeypatch):
    from data_tools import load_source, make_loader, write_shards
    from tests.test_hostile_data import _Server

    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    x, y, names = load_source("synthetic", "train", num_synthetic=40, seed=1)
    out = tmp_path / "d"
    write_shards(x, y, str(out), class_names=names, samples_per_shard=20, source="custom")
    server = _Server()
    try:
        server.auth = "bob:PA55"
        for i in range(2):
            server.files[f"/d/train-00000{i}.tar"] = (out / f"train-00000{i}.tar").read_bytes()
        base = f"http://bob:PA55@127.0.0.1:{server.port}/d"
        urls = [f"{base}/train-00000{i}.tar?X-Goog-Signature=SIGVALUE&token=TOKEN123" for i in range(2)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = make_loader(urls, 10, train=True, timeout=5)
            assert len(next(iter(loader))[1]) == 10
        assert all(_clean(str(w.message)) for w in caught)
    finally:
        server.close()
    path = tmp_path / "cache" / "shard-counts.json"
    text = path.read_text()
    assert _clean(text) and "train-000001.tar" in text and sorted(json.loads(text).values()) == [20, 20], text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
