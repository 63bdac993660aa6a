"""labkit.setup(compile_cache=...): the setting's parsing, and torch_xla's persistent cache across two
real processes on XLA:CPU (files written by the first, the second's lookup finding them by graph hash)."""

import os
import subprocess
import sys

import pytest

from labkit import compile_cache as cc
from labkit.config import TrainConfig, from_env
from labkit.lessons.compile_cache_demo import first_step_in_child


def test_auto_is_on_for_tpu_only(monkeypatch):
    monkeypatch.delenv(cc.ENV, raising=False)
    folder, note = cc.resolve(None, "tpu")
    assert folder == os.path.expanduser(os.path.join("~", ".cache", "labkit", "xla-cache")) and note.startswith("on")
    for kind in ("xla-cpu", "cuda", "cpu"):
        folder, note = cc.resolve(None, kind)
        assert folder is None and "auto" in note, (kind, note)


def test_values_and_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(cc.ENV, raising=False)
    assert cc.resolve(True, "xla-cpu")[0].endswith(os.path.join("labkit", "xla-cache"))
    assert cc.resolve("yes", "xla-cpu")[0] is not None and cc.resolve("Off", "tpu")[0] is None
    assert cc.resolve(False, "tpu") == (None, "off (compile_cache)")
    assert cc.resolve(str(tmp_path / "c"), "tpu")[0] == str(tmp_path / "c")
    assert cc.resolve(tmp_path / "c", "xla-cpu")[0] == str(tmp_path / "c")  # a Path
    assert cc.resolve("~/xc", "tpu")[0] == os.path.expanduser("~/xc")
    # the environment variable, and the argument winning over it
    monkeypatch.setenv(cc.ENV, str(tmp_path / "env"))
    assert cc.resolve(None, "xla-cpu") == (str(tmp_path / "env"), f"on ({cc.ENV})")
    assert cc.resolve(False, "xla-cpu")[0] is None
    monkeypatch.setenv(cc.ENV, "0")
    assert cc.resolve(None, "tpu") == (None, f"off ({cc.ENV})")
    # not XLA: nothing to cache, and it says why
    folder, note = cc.resolve(True, "cuda")
    assert folder is None and "does not run through XLA" in note
    # a LABKIT_ variable of labkit's own: not taken for a misspelt config field
    monkeypatch.setenv(cc.ENV, "1")
    from_env(TrainConfig)


@pytest.mark.parametrize(
    "value, source", [("maybe", "compile_cache"), ("gs://bucket/cache", "compile_cache"), (3, "compile_cache")]
)
def test_bad_values_name_the_setting(monkeypatch, value, source):
    monkeypatch.delenv(cc.ENV, raising=False)
    with pytest.raises(ValueError, match=source):
        cc.resolve(value, "tpu")
    if isinstance(value, str):
        monkeypatch.setenv(cc.ENV, value)
        with pytest.raises(ValueError, match=cc.ENV):
            cc.resolve(None, "tpu")


@pytest.mark.heavy  # three fresh processes, each importing torch_xla and compiling
def test_two_processes_share_the_cache(tmp_path):
    folder = str(tmp_path / "xla-cache")
    cold = first_step_in_child(folder, "mlp", "xla-cpu")
    assert cold["cache"] == folder and cold["note"] == "on"
    assert cold["entries"], "the first process wrote no cached program"
    assert sorted(os.listdir(folder)) == cold["entries"]
    assert cold["counters"]["PersistentCacheMiss"] >= 1 and cold["compiles"] >= 1
    warm = first_step_in_child(folder, "mlp", "xla-cpu")
    assert warm["entries"] == cold["entries"], "the second process should find, not add, the same programs"
    c = warm["counters"]
    assert c["PersistentCacheMiss"] == 0, c  # every graph of the step was found on disk by its hash
    assert c["PersistentCacheHit"] + c["PersistentCacheDeserializeFailure"] >= 1, c
    # XLA:CPU (measured, torch_xla 2.9): the CPU client cannot deserialise, so it compiles again. On a TPU
    # the same lookup is a PersistentCacheHit and `compiles` drops to 0.
    assert c["PersistentCacheDeserializeFailure"] >= 1 and warm["compiles"] >= 1
    assert warm["loss"] == pytest.approx(cold["loss"])
    off = first_step_in_child(None, "mlp", "xla-cpu")
    assert off["cache"] is None and not any(off["counters"].values())


@pytest.mark.heavy  # a fresh process
def test_too_late_is_said_not_hidden(tmp_path):
    """A computation before setup(): torch_xla has built its cache without a folder; setup warns, rt says off."""
    code = (
        "import warnings, torch, torch_xla, labkit\n"
        "(torch.ones(2, device=torch_xla.device()) * 2).cpu()\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    rt = labkit.setup('xla-cpu', compile_cache={str(tmp_path / 'c')!r})\n"
        "print('CACHE', rt.compile_cache, '|', rt.info['compile_cache'], '|', [str(x.message) for x in w])\n"
    )
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("CACHE"))
    assert line.startswith("CACHE None |") and "already ran a computation" in line, line
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")
