"""manifest.json: clear errors for a folder, an empty or malformed manifest."""

import json

import pytest

from data_tools import load_manifest


@pytest.mark.parametrize("bad", ["folder", "empty"])
def test_folder_or_empty_manifest_is_named(tmp_path, bad):
    if bad == "folder":
        with pytest.raises(IsADirectoryError, match=f"{tmp_path} is a folder; pass {tmp_path}/manifest.json"):
            load_manifest(str(tmp_path))
    else:
        (tmp_path / "manifest.json").write_text(json.dumps({"format": "labkit-shards/1", "shards": []}))
        with pytest.raises(ValueError, match="lists no shards"):
            load_manifest(str(tmp_path / "manifest.json"))


def test_malformed_manifests_name_the_file(tmp_path):
    p = tmp_path / "manifest.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match=f"manifest {p} is not valid JSON"):
        load_manifest(str(p))
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="is not a labkit shard manifest"):
        load_manifest(str(p))
    p.write_text(json.dumps({"format": "labkit-shards/1", "shards": [{"name": "a.tar"}]}))
    with pytest.raises(ValueError, match="shard entry 0 needs name, samples, bytes and sha256"):
        load_manifest(str(p))
