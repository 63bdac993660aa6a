"""TorchTPU without its package: the set-up's decisions on a TorchTPU image, what it sets before torch starts, the
stop of a torch_xla notebook, and the TorchTPU runtime's choices that need no chip. The real package is checked in
its simulated image (tests/test_images.py: test_torch_tpu_contract and the torchtpu-vm notebooks)."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit import envsetup as es
from labkit.runtime import step as _step
from labkit.runtime.torch_tpu import CALLS, COMPILE_BACKEND, TorchTpuRuntime, chips
from tests.test_envsetup import _facts

ROOT = Path(__file__).resolve().parents[1]
NEEDS = "torch>=2.11.0,<=2.15.0"  # torch-tpu 0.2.0's Requires-Dist on torch
TORCHTPU_VM = dict(torch="2.12.0+cu130", torch_tpu="0.2.0", libtpu="0.0.52", numpy="2.5.5")


def _tpu_vm(**kw):
    f = _facts("tpu-vm", chips=4, **{**TORCHTPU_VM, **kw})
    return dataclasses.replace(f, torch_tpu_needs=NEEDS)


def test_a_torch_tpu_image_is_kept():
    """torch 2.12 + torch-tpu 0.2.0 + libtpu 0.0.52 on a TPU host, no torch_xla: keep all three and install only
    labkit's missing dependencies, none of them torch's family, with torch, torch_tpu and libtpu pinned."""
    f = _tpu_vm(torchvision="0.27.0")
    d = es.plan(f)
    assert d.choice == "keep" and not d.restart and not d.uninstall
    assert not any(es._req_name(r) in es.PROTECTED for r in d.install), d.install
    assert "torch_tpu 0.2.0" in d.reason and "LABKIT_INSTALL_TORCH_XLA=1" in d.reason
    cons = es.constraints(f, d)
    assert {"torch==2.12.0+cu130", "torch-tpu==0.2.0", "libtpu==0.0.52"} <= set(cons)


def test_torch_xla_only_when_asked_and_the_decision_says_what_it_replaces():
    d = es.plan(dataclasses.replace(_tpu_vm(), asked_torch_xla=True))
    assert d.choice == "install-pair" and d.restart and d.uninstall == ["torch-tpu"]
    assert "torch_xla==2.9.0" in d.install and "libtpu==0.0.21.1" in d.install
    assert [r for r in d.install if es._req_name(r) == "torchvision"] == ["torchvision==0.24.0"]
    for said in ("replaces torch 2.12.0+cu130", "libtpu 0.0.52", "removing torch_tpu 0.2.0"):
        assert said in d.reason, d.reason
    assert es.decision_line(d).endswith("then restart")


def test_asking_for_torch_xla_where_it_is_there_changes_nothing():
    f = _facts("colab-tpu", chips=1, torch="2.9.0+cpu", torch_xla="2.9.0", torchvision="0.24.0", libtpu="0.0.21.1")
    assert es.plan(dataclasses.replace(f, asked_torch_xla=True)).choice == "keep"


def test_a_torch_outside_torch_tpus_range_is_named_with_the_fix():
    d = es.plan(_tpu_vm(torch="2.16.0"))
    assert d.choice == "keep" and "outside torch_tpu 0.2.0's range" in d.reason
    assert "pip install 'torch>=2.11.0,<=2.15.0'" in d.reason


@pytest.mark.parametrize(
    "version, ok", [("2.11.0", True), ("2.15.0+cpu", True), ("2.15.1", False), ("2.10.2", False), ("2.12", True)]
)
def test_satisfies_reads_torch_tpus_range(version, ok):
    assert es.satisfies(version, NEEDS) is ok


def test_the_setting_is_read_by_name(monkeypatch):
    monkeypatch.setenv(es.INSTALL_TORCH_XLA, "maybe")
    with pytest.raises(ValueError, match="LABKIT_INSTALL_TORCH_XLA='maybe'"):
        es.flag(es.INSTALL_TORCH_XLA)
    monkeypatch.setenv(es.INSTALL_TORCH_XLA, "yes")
    assert es.flag(es.INSTALL_TORCH_XLA)


def test_no_chip_settings_only_with_torch_tpu_and_no_chip(tmp_path, monkeypatch):
    versions = {"torch-tpu": "0.2.0"}
    monkeypatch.setattr(es, "version_of", lambda d: versions.get(d))
    env = {}
    assert es.no_chip_settings(env, str(tmp_path)) == es.NO_CHIP_ENV == env
    assert env["TPU_SKIP_MDS_QUERY"] == "1"
    mine = {"TPU_SKIP_MDS_QUERY": "0", "TF_CPP_MIN_LOG_LEVEL": "1", "TPU_WORKER_HOSTNAMES": "w0,w1"}
    assert es.no_chip_settings(dict(mine), str(tmp_path)) == {}  # the user's own values stay
    chip = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
    chip.mkdir(parents=True)
    (chip / "vendor").write_text(es.TPU_VENDOR + "\n")
    assert es.no_chip_settings({}, str(tmp_path)) == {}  # a chip: libtpu needs the metadata server
    versions.clear()
    assert es.no_chip_settings({}, str(tmp_path / "empty")) == {}  # no torch-tpu: nothing to quiet


def test_a_torch_xla_notebook_stops_with_a_message_and_installs_nothing(monkeypatch):
    """main(needs=("torch_xla",)) where torch_xla is missing: the two set-up lines, then NeedsTorchXla before act()
    runs; IPython shows its message alone (_render_traceback_)."""
    f = _tpu_vm()
    monkeypatch.setattr(es, "gather", lambda: f)
    monkeypatch.setattr(es, "act", lambda *a, **k: pytest.fail("act() ran: the stop must come before any install"))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    with pytest.raises(es.NeedsTorchXla) as err:
        es.main("/src/labkit", needs=("torch_xla",))
    msg = str(err.value)
    assert err.value._render_traceback_() == [msg]
    assert "torch 2.12.0+cu130 with TorchTPU (torch_tpu 0.2.0)" in msg and "Nothing was installed" in msg
    assert "Colab's TPU runtime" in msg and "%env LABKIT_INSTALL_TORCH_XLA=1" in msg and "removes torch_tpu" in msg
    assert [ln.split()[2].split("=")[0] for ln in out.getvalue().splitlines()[:2]] == ["platform", "choice"]
    # with the setting on, the same notebook is not stopped: the pair is being installed
    asked = dataclasses.replace(f, asked_torch_xla=True)
    assert es.needs_message(("torch_xla",), asked, es.plan(asked)) is None
    # a notebook that needs nothing, or an image with torch_xla, is not stopped either
    assert es.needs_message((), f, es.plan(f)) is None
    with_xla = _facts("colab-tpu", chips=1, torch="2.9.0", torch_xla="2.9.0")
    assert es.needs_message(("torch_xla",), with_xla, es.plan(with_xla)) is None


def test_the_notebooks_that_need_torch_xla_say_so():
    """Params.NEEDS is what the set-up cell passes: the notebooks that import torch_xla outside a guard name it."""
    needs = {
        p.name[:2] for p in sorted((ROOT / "notebooks").glob("[0-9]*.py")) if 'NEEDS = ("torch_xla",)' in p.read_text()
    }
    imports = {
        p.name[:2]
        for p in sorted((ROOT / "notebooks").glob("[0-9]*.py"))
        if any(ln.startswith(("import torch_xla", "from torch_xla")) for ln in p.read_text().splitlines())
    }
    assert imports <= needs, f"notebooks importing torch_xla at top level without NEEDS: {sorted(imports - needs)}"
    image = (ROOT / "images" / "torchtpu-vm.txt").read_text()
    stops = next(ln for ln in image.splitlines() if ln.startswith("# stops:")).split("(")[0].split()[2:]
    assert set(stops) == needs, "the TorchTPU image's '# stops:' line lists the notebooks that need torch_xla"


def test_the_runtime_compiles_with_the_tpu_backend(capsys):
    """compile="auto" on TorchTPU compiles (PAYBACK_STEPS["torch-tpu"]), with backend "tpu" in place of the config's
    default "inductor", said once; an explicit backend is kept."""
    rt = TorchTpuRuntime("torch-tpu", torch.device("cpu"))
    assert type(rt) is TorchTpuRuntime and _step.PAYBACK_STEPS["torch-tpu"].steps == 0
    cap = rt.step_capture("auto", "inductor", steps=10)
    assert cap.compiled and cap.backend == COMPILE_BACKEND == "tpu"
    rt.step_capture("auto", "inductor", steps=10)
    assert capsys.readouterr().out.count("torch.compile backend 'tpu'") == 1
    assert rt.step_capture("on", "aot_eager").backend == "aot_eager"
    assert not rt.step_capture("off", "inductor").compiled
    assert rt.precision_for("auto", "auto").device_type == "tpu"
    with pytest.raises(ValueError, match="fp16 on a TPU"):
        rt.precision_for("fp16", "fp16")


def test_no_torch_tpu_here_means_no_chips():
    assert chips() == 0
    assert all(n.startswith(("torch.tpu.", "torch.accelerator.")) for n in CALLS)


def test_asking_for_torch_tpu_without_it_names_what_is_there(monkeypatch):
    import labkit

    monkeypatch.setenv("LABKIT_BACKEND", "torch-tpu")
    with pytest.raises(labkit.BackendError, match="backend 'torch-tpu'.*no torch_tpu"):
        labkit.setup()


def test_import_labkit_sets_nothing_without_torch_tpu():
    code = "import os, labkit; print(os.environ.get('TPU_SKIP_MDS_QUERY'))"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "None"


def _found(**kw):
    base = dict(torch_xla=False, tpu=None, libtpu=False, torch_tpu=None, torch_tpu_chips=0, cuda=False, cuda_devices=0)
    return {**base, **kw}


@pytest.mark.parametrize(
    "found, want",
    [
        (_found(torch_tpu="0.2.0", torch_tpu_chips=4, tpu="4 chip(s)", libtpu=True), "torch-tpu"),
        (_found(torch_tpu="0.2.0", torch_tpu_chips=4, tpu="4 chip(s)", libtpu=True, torch_xla=True), "tpu"),
        (_found(torch_tpu="0.2.0", tpu="4 chip(s): TPU_ACCELERATOR_TYPE=v6e-4"), "cpu"),
        (_found(torch_tpu="0.2.0", cuda=True, cuda_devices=1), "cuda"),
    ],
    ids=["torch-tpu-chips", "both-stacks", "no-chips", "gpu-box"],
)
def test_detection_picks_torch_tpu_where_it_sees_chips(monkeypatch, found, want):
    """A TPU host with torch_tpu and chips: the TorchTPU runtime; with torch_xla too, torch_xla, said in one line that
    names the setting; without chips, the CPU, said in one line."""
    from labkit import device

    monkeypatch.delenv("LABKIT_BACKEND", raising=False)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setattr(device, "detect", lambda: found)
    assert device.resolve_backend() == want
    note = device.torch_tpu_note(found, want)
    if want == "torch-tpu":
        assert note is None
    elif want == "tpu":
        assert "sees 4 chip(s)" in note and "LABKIT_BACKEND=torch-tpu" in note
    else:
        assert "found TorchTPU (torch_tpu 0.2.0" in note and "no TPU chips" in note and f"running on {want}" in note
    if found["torch_tpu_chips"]:
        monkeypatch.setenv("LABKIT_BACKEND", "torch-tpu")
        assert device.resolve_backend() == "torch-tpu"


def test_torchrun_on_torch_tpu_without_its_launch_env_is_refused_by_name(monkeypatch):
    from labkit import device

    monkeypatch.setenv("WORLD_SIZE", "4")
    for k in ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(
        device.BackendError, match="TORCH_TPU_SLICEBUILDER_ADDRESSES, TORCH_TPU_TOPOLOGY.*torch.tpu.distributed"
    ):
        device.setup_torch_tpu()


def test_every_data_moving_c10d_op_is_counted_and_nothing_else():
    """labkit.parallel.count counts by op kind: each of torch's c10d collectives maps to one of COLLECTIVES, and the
    other ops of those namespaces (waits, barriers, torch 2.11's helpers) to none of them."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the c10d and functional ops)

    from labkit.parallel.count import COLLECTIVES
    from labkit.spmd.dtensor_plans import op_name

    ops = {
        o.split("::")[1].split(".")[0]
        for o in torch._C._dispatch_get_all_op_names()
        if o.startswith(("c10d::", "_c10d_functional::"))
    }
    assert {"allreduce_", "_allgather_base_", "reduce_scatter_tensor", "wait_tensor", "barrier"} <= ops
    for raw in sorted(ops):
        bare = raw.strip("_")
        if bare.startswith(("barrier", "monitored_barrier", "wait")):
            assert op_name(f"c10d.{raw}") not in COLLECTIVES, raw
        else:
            assert op_name(f"c10d.{raw}") in COLLECTIVES, raw
    assert op_name("_c10d_functional.wrap_autograd_tensor") not in COLLECTIVES
