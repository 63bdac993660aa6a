"""Where the venvs live: in the checkout (.venv, .venvs), except under a path that holds a space, where torch's
Inductor cannot link (it hands torch's library folder to the linker unquoted) and they move to the user's cache."""

from __future__ import annotations

from pathlib import Path

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
