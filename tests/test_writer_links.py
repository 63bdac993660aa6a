import os

import numpy as np

from data_tools.writer import write_shards


def test_planted_manifest_tmp_link_is_not_followed(tmp_path):
    """A `manifest.json.tmp` in --out that links to another file: the writer leaves that file as it was."""
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("keep me")
    os.symlink(victim, out / "manifest.json.tmp")
    write_shards(np.zeros((4, 8, 8, 3), np.uint8), [0, 1, 0, 1], str(out), class_names=["a", "b"])
    assert victim.read_text() == "keep me"
    assert (out / "manifest.json").is_file() and not (out / "manifest.json").is_symlink()
    assert [n for n in os.listdir(out) if n.endswith(".tmp")] == ["manifest.json.tmp"]  # no temp file left
