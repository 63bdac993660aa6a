"""labkit.doctor(): versions, warnings."""

import labkit
from labkit import envsetup
from labkit.doctor import check_versions, doctor, format_report, tpu_warnings


def test_version_mismatch_warning_names_fix():
    w = check_versions("2.8.1+cu126", "2.9.0")
    assert len(w) == 1
    assert "torch 2.8.1+cu126 does not match torch_xla 2.9.0" in w[0]
    assert "pip install 'torch==2.9.*'" in w[0]


def test_matching_versions_no_warning():
    assert check_versions("2.9.0", "2.9.0") == []
    assert check_versions("2.9.1+cpu", "2.9.0") == []
    assert check_versions("2.9.0", None) == []


def test_doctor_report(monkeypatch, capsys):
    monkeypatch.setenv("XLA_USE_BF16", "1")
    rt = labkit.setup("xla-cpu")
    r = doctor(rt)
    out = capsys.readouterr().out
    assert r["versions"]["torch"].startswith("2.9") and r["versions"]["torch_xla"].startswith("2.9")
    assert r["backend"] == "xla-cpu" and r["devices"] == ["xla:0"]
    assert any("XLA_USE_BF16" in w and "autocast" in w for w in r["warnings"])
    assert "WARNING: XLA_USE_BF16=1" in out
    assert "labkit doctor" in format_report(r)


def test_tpu_host_not_on_tpu_warns_with_fix(monkeypatch, tmp_path):
    """The host has TPU chips (TPU env var) but the runtime is XLA:CPU: the doctor says so and how to fix it."""
    rt = labkit.setup("xla-cpu")
    monkeypatch.setenv("LABKIT_HOST_ROOT", str(tmp_path))
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    r = doctor(rt, quiet=True)
    (w,) = [w for w in r["warnings"] if "TPU chip" in w]
    assert "8 TPU chip(s)" in w and "'xla-cpu'" in w and "unset PJRT_DEVICE" in w
    # this venv has torch_xla but no libtpu: the fix names the libtpu that torch_xla 2.9 needs
    assert "pip install libtpu==0.0.21.1" in w


def test_tpu_warning_names_the_process_holding_the_chips(tmp_path):
    """A fake host: one TPU chip on PCI, /dev/vfio/0 held open by another process."""
    dev = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x1ae0\n")
    (tmp_path / "dev/vfio").mkdir(parents=True)
    (tmp_path / "dev/vfio/0").touch()
    fd = tmp_path / "proc/4242/fd"
    fd.mkdir(parents=True)
    (fd / "7").symlink_to("/dev/vfio/0")
    (tmp_path / "proc/4242/cmdline").write_bytes(b"python\0train.py\0")
    tpu = envsetup.detect_tpu(str(tmp_path), env={})
    assert tpu.chips == 1
    (w,) = tpu_warnings(tpu, "xla-cpu", {"torch_xla": "2.9.0", "libtpu": "0.0.21.1"}, root=str(tmp_path))
    assert "4242 (python train.py)" in w and "kill 4242" in w
    assert tpu_warnings(tpu, "tpu", {}, root=str(tmp_path)) == []
    assert tpu_warnings(envsetup.Tpu(), "cpu", {}, root=str(tmp_path)) == []


def test_doctor_before_setup_reports_a_bad_pjrt_device(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_HOST_ROOT", str(tmp_path))
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    r = doctor(None, quiet=True)
    assert any("PJRT_DEVICE=TPU is set but this machine has no TPU" in w for w in r["warnings"])


def test_one_version_everywhere():
    """labkit.__version__, the doctor and pyproject.toml agree (envsetup.VERSION is the one home)."""
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert labkit.__version__ == envsetup.VERSION == project["version"]
    assert doctor(None, quiet=True)["versions"]["labkit"] == labkit.__version__


def test_doctor_names_torch_tpu_and_what_labkit_does_with_it(monkeypatch):
    from labkit import doctor as doc

    real = doc.version_of
    monkeypatch.setattr(doc, "version_of", lambda name: "0.2.0" if name in ("torch-tpu", "torch_tpu") else real(name))
    r = doc.doctor(quiet=True)
    (w,) = [w for w in r["warnings"] if "torch_tpu" in w]
    assert r["versions"]["torch_tpu"] == "0.2.0"
    assert "torch_tpu 0.2.0 is installed" in w and "sees no chip here" in w and "TPU_SKIP_MDS_QUERY=1" in w
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in w and "this one has torch_xla 2.9" in w
    (w,) = doc.torch_tpu_warnings({"torch_tpu": "0.2.0", "torch_xla": "2.9.0"}, chips=4)
    assert "trains on its 4 chip(s) as backend 'torch-tpu'" in w and "LABKIT_BACKEND=torch-tpu picks TorchTPU" in w
    monkeypatch.setattr(doc, "version_of", real)
    assert not [w for w in doc.doctor(quiet=True)["warnings"] if "torch_tpu" in w]  # not installed here


def test_gloo_reach_names_gloo_socket_ifname_when_the_rendezvous_does_not_answer():
    """torchrun over 2 simulated hosts (WORLD_SIZE 4, LOCAL_WORLD_SIZE 2) on the loopback: a rendezvous port that
    listens is reached; one nobody listens on, or an interface that does not exist, is a warning naming
    GLOO_SOCKET_IFNAME; one host alone is not checked."""
    import socket

    from labkit.doctor import gloo_reach_warnings

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = str(server.getsockname()[1])
        assert gloo_reach_warnings(env) == []
        assert gloo_reach_warnings({**env, "WORLD_SIZE": "2"}) == []  # one host: nothing to reach
    said = gloo_reach_warnings(env)  # the port closed: nothing answers there now
    assert len(said) == 1 and "does not answer" in said[0] and "GLOO_SOCKET_IFNAME" in said[0], said
    said = gloo_reach_warnings({**env, "GLOO_SOCKET_IFNAME": "nosuch0"})
    assert len(said) == 1 and "no IPv4 address from GLOO_SOCKET_IFNAME=nosuch0" in said[0], said
    said = gloo_reach_warnings({**env, "MASTER_ADDR": "10.255.255.1"})  # another host's address, from the loopback
    assert len(said) == 1 and "loopback address the other hosts cannot reach" in said[0], said
