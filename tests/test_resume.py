"""Exact resume: a run killed with SIGKILL (between steps, or inside an upload) and resumed
ends with weights bit-identical to an uninterrupted run, on CPU and XLA:CPU, local and gs://."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# heavy: minutes of XLA:CPU compiles or real child processes; the Python 3.13 run leaves them to the 3.11 run
pytestmark = pytest.mark.heavy

SCRIPT = Path(__file__).parent / "children" / "ckpt_train_script.py"
STEPS, EVERY = 12, 3


def _run(root, out, backend, *extra, env=None, expect_kill=False):
    e = dict(os.environ, **(env or {}))
    p = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(root),
            str(out),
            "--steps",
            str(STEPS),
            "--every",
            str(EVERY),
            "--backend",
            backend,
            *extra,
        ],
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if expect_kill:
        assert p.returncode == -9, f"expected SIGKILL, got rc={p.returncode}\n{p.stderr[-2000:]}"
    else:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def _same(a, b):
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs after resume"


@pytest.mark.parametrize("backend", ["cpu", "xla-cpu"])
def test_kill_and_resume_bit_identical(tmp_path, backend):
    _run(tmp_path / "ref", tmp_path / "ref.pt", backend)
    kill_at = random.Random().randint(EVERY + 1, STEPS - 1)
    root = tmp_path / "run"
    _run(root, tmp_path / "x.pt", backend, "--kill-at", str(kill_at), expect_kill=True)
    assert not (tmp_path / "x.pt").exists()
    _run(root, tmp_path / "resumed.pt", backend, "--resume")
    _same(tmp_path / "ref.pt", tmp_path / "resumed.pt")


@pytest.mark.parametrize("backend,where", [("cpu", "gcs"), ("xla-cpu", "local")])
def test_kill_inside_upload(tmp_path, request, backend, where):
    root = f"gs://{request.getfixturevalue('gcs_bucket')}/run" if where == "gcs" else str(tmp_path / "run")
    _run(tmp_path / "ref", tmp_path / "ref.pt", backend)
    _run(root, tmp_path / "x.pt", backend, env={"CKPT_TEST_KILL": "9"}, expect_kill=True)
    from labkit.checkpoint import CheckpointManager

    assert CheckpointManager(root).latest()["step"] == 6  # the half-done save of step 9 is invisible
    _run(root, tmp_path / "resumed.pt", backend, "--resume")
    _same(tmp_path / "ref.pt", tmp_path / "resumed.pt")
    if where == "local":  # the killed writer's temp file was swept; only named checkpoints remain
        assert all(not n.endswith(".tmp") for n in os.listdir(root))


@pytest.mark.parametrize("sig,backend", [(signal.SIGINT, "xla-cpu"), (signal.SIGTERM, "cpu")])
def test_interrupt_during_a_pending_save_finishes_it(tmp_path, sig, backend):
    """Ctrl-C (what a Colab interrupt sends) or SIGTERM (a preempted TPU VM) while the upload of
    step 6 is still running: the upload finishes, `latest` names step 6, no temp file is left,
    and the interrupt still ends the run."""
    root, marker = tmp_path / "run", tmp_path / "pending"
    env = dict(os.environ, CKPT_TEST_HOLD="6:4", CKPT_TEST_MARKER=str(marker), PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            str(root),
            str(tmp_path / "x.pt"),
            "--steps",
            str(STEPS),
            "--every",
            str(EVERY),
            "--backend",
            backend,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 240
    while not marker.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the held upload never started"
    p.send_signal(sig)
    err, _ = p.communicate(timeout=120)
    assert p.returncode != 0 and ("KeyboardInterrupt" in err or "Preempted: SIGTERM" in err), err[-2000:]
    assert "terminate called" not in err, err[-2000:]
    assert not (tmp_path / "x.pt").exists()
    assert [n for n in os.listdir(root) if n.endswith(".tmp")] == []
    from labkit.checkpoint import CheckpointManager

    assert CheckpointManager(root).restore()["step"] == 6  # verified, and the step that was pending


def test_killed_gcs_upload_leaves_no_temp_file(tmp_path, gcs_bucket):
    """The temp file of a GCS upload killed mid-way used to stay in the system temp folder (one
    checkpoint-sized file per kill); the next run now sweeps it."""
    root, tmp = f"gs://{gcs_bucket}/run", tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    _run(root, tmp_path / "x.pt", "cpu", env={**env, "CKPT_TEST_KILL": "6"}, expect_kill=True)
    _run(root, tmp_path / "resumed.pt", "cpu", "--resume", env=env)
    left = [str(p) for p in tmp.rglob("*") if p.is_file() and ".ckpt-" in p.name]
    assert left == [], left
