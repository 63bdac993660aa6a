"""labkit.setup(): detection, overrides, idempotence, clear errors."""

import pytest
import torch

import labkit
from labkit.device import BackendError, resolve_backend


def test_default_backend_here_is_xla_cpu(monkeypatch):
    monkeypatch.delenv("LABKIT_BACKEND", raising=False)
    # this machine: torch_xla installed, no TPU, no GPU
    assert resolve_backend() == "xla-cpu"


@pytest.mark.parametrize("kind", ["xla-cpu", "cpu"])
def test_setup_twice_returns_same_runtime(kind):
    rt1 = labkit.setup(kind)
    rt2 = labkit.setup(kind)
    assert rt1 is rt2
    assert rt1.kind == kind and rt1.world_size == 1 and rt1.ordinal == 0 and rt1.is_master
    assert rt1.is_xla == (kind == "xla-cpu")
    assert rt1.device.type == ("xla" if kind == "xla-cpu" else "cpu")


def test_env_override_and_bad_name(monkeypatch):
    monkeypatch.setenv("LABKIT_BACKEND", "cpu")
    assert labkit.setup().kind == "cpu"
    monkeypatch.setenv("LABKIT_BACKEND", "tpux")
    with pytest.raises(BackendError) as e:
        labkit.setup()
    msg = str(e.value)
    assert "'tpux'" in msg and "LABKIT_BACKEND" in msg
    for name in labkit.BACKENDS:
        assert name in msg


def test_tpu_where_none_says_what_was_found(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.delenv("COLAB_TPU_ADDR", raising=False)
    with pytest.raises(BackendError) as e:
        labkit.setup("tpu")
    msg = str(e.value)
    assert "no TPU" in msg and "no CUDA GPU" in msg and "torch_xla installed" in msg


def test_cuda_where_none(monkeypatch):
    with pytest.raises(BackendError, match="'cuda' was asked for"):
        labkit.setup("cuda")


def test_runtime_helpers_xla():
    rt = labkit.setup("xla-cpu")
    batch = {"x": torch.ones(2, 3), "meta": [torch.zeros(1), "keep"], "n": 3}
    moved = rt.to_device(batch)
    assert moved["x"].device.type == "xla" and moved["meta"][0].device.type == "xla"
    assert moved["meta"][1] == "keep" and moved["n"] == 3
    t = torch.tensor([1.0, 2.0], device=rt.device)
    assert rt.all_reduce(t, "mean") is t  # one replica: identity, no collective
    with pytest.raises(ValueError, match="'max'"):
        rt.all_reduce(t, "max")
    rt.rendezvous("noop")  # world size 1: returns
    seen = []
    rt.add_step_closure(lambda v: seen.append(v.item()), args=(t.sum(),))
    assert seen == []  # deferred until the step ends
    rt.sync()
    assert seen == [3.0]


def test_pjrt_device_tpu_without_a_tpu_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_HOST_ROOT", str(tmp_path))  # an empty host: no chips
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.delenv("LABKIT_BACKEND", raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(BackendError, match="PJRT_DEVICE=TPU is set but this machine has no TPU"):
        labkit.setup()


def test_tpu_chips_found_on_a_fake_host(monkeypatch, tmp_path):
    """Detection is envsetup's: PCI vendor 0x1ae0 counts; with torch_xla and chips, auto picks 'tpu' - and
    here, without libtpu, asking for it says what to install instead of falling back to the CPU."""
    d = tmp_path / "sys/bus/pci/devices/0000:00:05.0"
    d.mkdir(parents=True)
    (d / "vendor").write_text("0x1ae0\n")
    monkeypatch.setenv("LABKIT_HOST_ROOT", str(tmp_path))
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.delenv("LABKIT_BACKEND", raising=False)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert "1 chip(s)" in labkit.device.detect()["tpu"]
    monkeypatch.setattr(labkit.device.envsetup, "version_of", lambda d: None if d == "libtpu" else "2.9.0")
    assert resolve_backend() == "tpu"
    with pytest.raises(BackendError, match=r"libtpu is not installed.*pip install libtpu==0\.0\.21\.1"):
        resolve_backend("tpu")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # an explicit request for XLA:CPU wins on a TPU host
    assert resolve_backend() == "xla-cpu"


def test_mismatched_pair_is_refused_before_importing_torch_xla(monkeypatch):
    from labkit import device

    versions = {"torch": "2.11.0", "torch_xla": "2.9.0"}
    monkeypatch.setattr(device.envsetup, "version_of", lambda d: versions.get(d))
    with pytest.raises(BackendError, match=r"torch 2\.11\.0 does not match torch_xla 2\.9\.0.*torch==2\.9\.\*"):
        device._setup_xla("xla-cpu", False)


def test_tpu_in_use_names_the_process(tmp_path):
    from labkit.doctor import tpu_error_advice

    (tmp_path / "proc/31337").mkdir(parents=True)
    (tmp_path / "proc/31337/cmdline").write_bytes(b"python3\0-m\0ipykernel_launcher\0")
    msg = tpu_error_advice(
        "The TPU is already in use by process with pid 31337. Not attempting to load libtpu.so in this process.",
        root=str(tmp_path),
    )
    assert "process 31337 (python3 -m ipykernel_launcher)" in msg and "kill 31337" in msg
    fd = tmp_path / "proc/99/fd"
    fd.mkdir(parents=True)
    (fd / "5").symlink_to("/dev/accel0")
    busy = tpu_error_advice("TPU initialization failed: open(/dev/accel0): Device or resource busy", root=str(tmp_path))
    assert "process 99" in busy and "/dev/accel0 busy" in busy
    assert tpu_error_advice("some other failure", root=str(tmp_path)) is None


def test_a_backward_before_torch_xla_is_named_at_setup():
    """A backward run before the XLA devices start leaves them out of PyTorch's autograd engine, and every
    XLA backward after it fails with an internal assert; setup says what happened and what to do."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "PJRT_DEVICE": "CPU"}
    done = subprocess.run(
        [sys.executable, str(root / "tests" / "children" / "backward_before_xla.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED: a backward pass ran in this process before the XLA devices started" in done.stdout, done.stdout
    assert "Restart session" in done.stdout and "labkit.setup() before any training" in done.stdout
