"""labkit.scratch: a fresh folder per run; folders of ended runs are removed, nothing else is touched."""

import os
import subprocess
import sys

import pytest

import labkit
from labkit import scratch_dirs


def test_scratch_removes_only_ended_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_SCRATCH", str(tmp_path))
    # a run that ended: a child process makes a folder and exits
    code = "import labkit, pathlib; d = labkit.scratch('05'); pathlib.Path(d, 'model.pt').write_bytes(b'x' * 1000); print(d)"
    ended = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, LABKIT_SCRATCH=str(tmp_path)),
    ).stdout.strip()
    assert os.path.exists(os.path.join(ended, "model.pt"))
    # a folder that only looks like one (no marker), and another notebook's folder of an ended run
    lookalike = tmp_path / "labkit-05-999999-abc"
    lookalike.mkdir()
    (lookalike / "keep.txt").write_text("not labkit's")
    other = subprocess.run(
        [sys.executable, "-c", code.replace("'05'", "'photos'")],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, LABKIT_SCRATCH=str(tmp_path)),
    ).stdout.strip()

    mine = labkit.scratch("05")
    assert os.path.isdir(mine) and os.listdir(mine) == [scratch_dirs.MARKER]
    assert not os.path.exists(ended), "the folder of an ended run of the same notebook is removed"
    assert (lookalike / "keep.txt").exists(), "a folder without the marker is never removed"
    assert os.path.exists(other), "another notebook's folder is left to that notebook's next run"
    again = labkit.scratch("05")
    assert again != mine and os.path.exists(mine), "this process's own folders stay while it runs"
    assert scratch_dirs.sweep() == [other], "sweep() with no name removes every ended run's folder"


@pytest.mark.parametrize("bad", ["", "../x", ".hidden", "a/b"])
def test_scratch_refuses_names_that_leave_the_base(bad, tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_SCRATCH", str(tmp_path))
    with pytest.raises(ValueError, match="scratch name"):
        labkit.scratch(bad)
