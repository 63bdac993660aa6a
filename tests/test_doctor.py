"""labkit.doctor(): versions, warnings."""
import labkit
from labkit.doctor import check_versions, doctor, format_report


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


def test_pjrt_fallback_warning(monkeypatch):
    """A TPU was expected (TPU env var) but the runtime is XLA:CPU: the doctor says PJRT fell back."""
    rt = labkit.setup("xla-cpu")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    r = doctor(rt, quiet=True)
    assert any("fell back to the CPU" in w for w in r["warnings"])
