"""Where the venvs live: in the checkout (.venv, .venvs), except under a path that holds a space, where torch's
Inductor cannot link (it hands torch's library folder to the linker unquoted) and they move to the user's cache;
and what an image's pin-file header says about the runs in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.children.image_job import load_image_venv


def test_image_venvs_stay_in_the_checkout_unless_its_path_holds_a_space(monkeypatch, tmp_path):
    image_venv = load_image_venv()
    assert image_venv.venvs_dir(Path("/work/labkit")) == Path("/work/labkit/.venvs")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    drive = image_venv.venvs_dir(Path("/content/drive/My Drive/labkit"))
    tab = image_venv.venvs_dir(Path("/tmp/a\tb/labkit"))
    assert drive.is_relative_to(tmp_path / "cache" / "labkit" / "venvs") and drive.name == "images"
    assert not any(c.isspace() for c in str(drive)) and drive != tab  # one folder per checkout
    assert drive.parent.name.startswith("labkit-")  # the checkout's folder name, then a hash of its path


def test_an_image_header_says_which_notebooks_run_on_several_devices(tmp_path):
    """`# devices: 01=2 02=4` is read per notebook; a malformed pair or a notebook the image does not run is an error
    naming the pin file (tests/test_spmd.py finds its multi-device runs through it)."""
    image_venv = load_image_venv()
    head = "# python: 3.12\n# notebooks: 00 01 02  (why)\n"
    good = tmp_path / "good.txt"
    good.write_text(head + "# devices: 01=2 02=4  (a v5e-8)\nnumpy==2.0.0\n")
    assert image_venv.load(good).devices == {"01": 2, "02": 4}
    assert image_venv.load("kaggle-tpu").devices == {"01": 2, "02": 4}
    for line, said in (("01=two", "01=two"), ("1=2", "1=2"), ("01=0", "01=0"), ("07=2", "['07']")):
        bad = tmp_path / "bad.txt"
        bad.write_text(head + f"# devices: {line}\nnumpy==2.0.0\n")
        with pytest.raises(ValueError, match="bad.txt") as err:
            image_venv.load(bad)
        assert said in str(err.value)


def test_a_build_is_refused_for_disk_only_when_its_wheels_must_be_downloaded(monkeypatch, tmp_path):
    """With every wheel in uv's cache a venv is hardlinks, so a build needs WARM_GB free plus what it must download,
    not the image's whole size; a wheel for another Python does not count as cached. The refusal names the venv, the
    figures and the largest missing wheel."""
    image_venv = load_image_venv()
    pypi = tmp_path / "uv" / "wheels-v7" / "pypi"
    for entry in (
        "torch/2.9.0-cp312-cp312-manylinux_2_28_x86_64",
        "numpy/2.3.4-cp313-cp313-manylinux_2_28_x86_64",
        "protobuf/5.29.6-cp38-abi3-manylinux2014_x86_64",
        "six/1.17.0-6a4c2b1e0f9d8c7b",
    ):
        (pypi / entry).mkdir(parents=True)
    (pypi / "torch" / "2.9.0-cp313-cp313-manylinux_2_28_x86_64.http").write_text("")  # a download's record only
    monkeypatch.setattr(image_venv, "CACHE", tmp_path / "uv")
    pins = {"torch": "2.9.0", "numpy": "2.3.4", "protobuf": "5.29.6", "six": "1.17.0"}
    assert image_venv.uncached("3.13", pins) == ["torch==2.9.0"]
    assert image_venv.uncached("3.12", pins) == ["numpy==2.3.4"]
    img = image_venv.Image(
        name="colab-tpu",
        pin_file=tmp_path / "x.txt",
        python="3.13",
        pins=pins,
        env={},
        run_env={},
        expect={},
        colab=True,
    )
    monkeypatch.setattr(image_venv, "VENVS", tmp_path)
    free = {"gb": 2.0}
    monkeypatch.setattr(image_venv.shutil, "disk_usage", lambda p: type("U", (), {"free": free["gb"] * 1e9})())
    with pytest.raises(RuntimeError, match=r"colab-tpu venv .*2\.0 GB free, it needs about 2\.8 GB .*torch==2\.9\.0"):
        image_venv.check_disk(img)
    assert image_venv.needs_gb(["torch==2.9.0", "nvidia-cudnn-cu12==9.10.2.21", "six==1.17.0"]) == pytest.approx(3.91)
    img.python = "3.12"  # only numpy is missing: a small wheel
    image_venv.check_disk(img)
    img.python = "3.13"
    img.pins.pop("torch")
    image_venv.check_disk(img)  # all cached: 2 GB is plenty
    free["gb"] = 0.1
    with pytest.raises(RuntimeError, match=r"0\.1 GB free, it needs about 1\.0 GB \(all wheels cached"):
        image_venv.check_disk(img)
