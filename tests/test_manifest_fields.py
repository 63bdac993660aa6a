"""Every field of a manifest is checked when it is loaded, and each refusal names the manifest and the field."""

import json

import pytest

from data_tools import manifest as mf

GOOD = {"name": "train-000000.tar", "samples": 10, "bytes": 2048, "sha256": "ab" * 32}


def _write(tmp_path, **over):
    m = {"format": mf.FORMAT, "shards": [dict(GOOD)], "mean": [0.5], "std": [0.25], "num_classes": 10}
    m.update(over)
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps(m) if not isinstance(m, str) else m)
    return str(p)


def test_a_good_manifest_loads(tmp_path):
    assert mf.load_manifest(_write(tmp_path))["urls"][0].endswith("train-000000.tar")


@pytest.mark.parametrize(
    "over, says",
    [
        ({"shards": [GOOD, GOOD]}, "lists shard 'train-000000.tar' twice"),
        ({"std": [0.25, 0.0, 0.3]}, "std=.* each > 0"),
        ({"mean": ["a"]}, "mean=.* finite numbers"),
        ({"num_classes": -3}, "num_classes=-3"),
        ({"mean": [0.5, 0.4]}, r"mean=\[0.5, 0.4\] has 2 values for images of 3 channels"),
        ({"std": [0.2, 0.2, 0.2, 0.2], "channels": 3}, "std=.* has 4 values for images of 3 channels"),
        ({"image_size": 32}, r"image_size=32 must be \[height, width\]"),
        ({"image_size": [32, 0]}, "image_size=.* two positive integers"),
        ({"channels": "3"}, "channels='3' must be a positive integer"),
        ({"shards": [{**GOOD, "samples": "10"}]}, r"shard entry 0 \('train-000000.tar'\) has samples='10'"),
        ({"shards": [{**GOOD, "bytes": -1}]}, "has bytes=-1"),
        ({"shards": [{**GOOD, "sha256": "xyz"}]}, "has sha256='xyz'"),
    ],
)
def test_bad_fields_are_named(tmp_path, over, says):
    url = _write(tmp_path, **over)
    with pytest.raises(ValueError, match=says) as e:
        mf.load_manifest(url)
    assert "manifest.json" in str(e.value)


def test_deep_json_and_a_huge_body_are_refused_by_name(tmp_path, monkeypatch):
    p = tmp_path / "manifest.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="manifest .*manifest.json nests JSON too deeply"):
        mf.load_manifest(str(p))
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 1000)
    p.write_text(json.dumps({"format": mf.FORMAT, "shards": [GOOD] * 50}))
    with pytest.raises(ValueError, match="manifest.json: more than 1,000 bytes"):
        mf.load_manifest(str(p))
