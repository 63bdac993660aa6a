"""Shard writer: sources, manifest, local and gs:// output, atomic rewrites."""

import json
import os
import pickle
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from data_tools import load_manifest, load_source, make_loader, verify_manifest, write_shards


def _tar_members(path):
    with tarfile.open(path) as tf:
        return [m.name for m in tf.getmembers()]


def test_digits_source_is_32x32_rgb_with_disjoint_seeded_split():
    xt, yt, names = load_source("digits", "train")
    xv, yv, _ = load_source("digits", "val")
    assert xt.shape[1:] == (32, 32, 3) and xt.dtype == np.uint8 and yt.dtype == np.int64
    assert len(xt) + len(xv) == 1797 and abs(len(xv) - 359) <= 1 and names == [str(i) for i in range(10)]
    assert set(yt.tolist()) == set(range(10)) and xt.max() > 200
    again, _, _ = load_source("digits", "train")
    assert np.array_equal(again, xt)
    flat_t = {a.tobytes() for a in xt[:200]}
    assert not any(a.tobytes() in flat_t for a in xv)  # digits has no exact duplicates across the split


def test_synthetic_is_seeded_and_class_dependent():
    x, y, _ = load_source("synthetic", "train", num_synthetic=300, seed=3)
    x2, _, _ = load_source("synthetic", "train", num_synthetic=300, seed=3)
    assert np.array_equal(x, x2) and x.shape == (300, 32, 32, 3)
    means = np.stack([x[y == c].reshape(-1, 3).mean(0) for c in range(10)])
    assert np.ptp(means, axis=0).max() > 40  # classes differ in colour, so a model can learn them


def test_cifar_from_local_python_batches(tmp_path):
    rng = np.random.default_rng(0)
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    for name, n in [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 3)]:
        with open(d / name, "wb") as f:
            pickle.dump({"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": list(range(n))}, f)
    x, y, names = load_source("cifar10", "train", cifar_path=str(tmp_path))
    assert x.shape == (20, 32, 32, 3) and names[0] == "airplane"
    with pytest.raises(FileNotFoundError, match="no CIFAR-10 python batches"):
        load_source("cifar10", "val", cifar_path=str(tmp_path / "nowhere"))


def test_write_local_counts_caps_and_manifest(tmp_path):
    x, y, names = load_source("digits", "val")
    x, y = x[:150], y[:150]
    m = write_shards(x, y, str(tmp_path), split="val", class_names=names, samples_per_shard=40, source="digits")
    assert [s["name"] for s in m["shards"]] == [f"val-{i:06d}.tar" for i in range(4)]
    assert [s["samples"] for s in m["shards"]] == [40, 40, 40, 30] and m["num_samples"] == 150
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == m and m["class_names"] == names and m["image_size"] == [32, 32]
    assert np.allclose(m["mean"], x.reshape(-1, 3).mean(0) / 255, atol=1e-5)
    assert np.allclose(m["std"], (x.reshape(-1, 3) / 255).std(0), atol=1e-5)
    for s in m["shards"]:
        assert os.path.getsize(tmp_path / s["name"]) == s["bytes"]
    assert sorted(_tar_members(tmp_path / "val-000000.tar")[:2]) == ["val-0000000.cls", "val-0000000.png"]
    verify_manifest(str(tmp_path / "manifest.json"))
    again = write_shards(x, y, str(tmp_path / "again"), split="val", class_names=names, samples_per_shard=40)
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in m["shards"]]  # reproducible bytes
    # byte cap in tar bytes (~2.5 KB per sample: headers + padded payloads; 10 KiB records)
    m2 = write_shards(x[:10], y[:10], str(tmp_path / "small"), samples_per_shard=100, max_shard_bytes=12_000)
    assert len(m2["shards"]) >= 3 and sum(s["samples"] for s in m2["shards"]) == 10
    assert all(s["bytes"] <= 12_000 for s in m2["shards"]), m2["shards"]


def test_upsample_unique_keys_and_ppm(tmp_path):
    x, y, _ = load_source("synthetic", "train", num_synthetic=30)
    m = write_shards(x, y, str(tmp_path), upsample=3, samples_per_shard=50, encoding="ppm")
    assert m["num_samples"] == 90 and m["upsample"] == 3
    names = [n for s in m["shards"] for n in _tar_members(tmp_path / s["name"])]
    keys = [n.split(".")[0] for n in names if n.endswith(".ppm")]
    assert len(keys) == 90 == len(set(keys))
    loader = make_loader(str(tmp_path / "manifest.json"), 30, train=False, augment=False)
    xb, yb = next(iter(loader))
    back = (xb * torch_t(m["std"]) + torch_t(m["mean"])) * 255
    assert np.allclose(back.permute(0, 2, 3, 1).numpy(), x[:30], atol=0.01)  # ppm is lossless too
    assert yb.tolist() == y[:30].tolist()


def torch_t(v):
    import torch

    return torch.tensor(v).view(1, 3, 1, 1)


def test_write_to_gcs_and_verify(gcs_bucket):
    from labkit.cloud import gcs

    url = f"gs://{gcs_bucket}/digits/val"
    x, y, names = load_source("digits", "val")
    m = write_shards(x[:60], y[:60], url, split="val", class_names=names, samples_per_shard=25)
    assert [s["samples"] for s in m["shards"]] == [25, 25, 10]
    assert gcs.exists(url + "/manifest.json") and gcs.exists(url + "/val-000002.tar")
    back = load_manifest(url + "/manifest.json")
    assert back["urls"][0] == url + "/val-000000.tar" and back["shards"] == m["shards"]
    verify_manifest(back)
    # a shard replaced behind the manifest's back is caught and named
    gcs.blob(url + "/val-000001.tar").upload_from_string(b"x" * m["shards"][1]["bytes"])
    with pytest.raises(ValueError, match="val-000001.tar: sha256"):
        verify_manifest(url + "/manifest.json")


def test_write_to_missing_bucket_is_clear(gcs_server):
    x, y, _ = load_source("synthetic", "train", num_synthetic=5)
    with pytest.raises(FileNotFoundError, match="no-such-bucket-xyz"):
        write_shards(x, y, "gs://no-such-bucket-xyz/a")


# -- rewriting a folder: never an old manifest over new shards ------------------------------------------
def _read_all(man, **kw):
    """Every (key, label, image) of a manifest, in order, as the loader delivers them."""
    out = []
    for x, y, k in make_loader(man, 50, train=False, augment=False, return_keys=True, last_batch="partial", **kw):
        out += [(key, int(label), img) for key, label, img in zip(k, y.tolist(), x)]
    return out


def _same(a, b):
    return len(a) == len(b) and all(
        ka == kb and la == lb and torch_equal(ia, ib) for (ka, la, ia), (kb, lb, ib) in zip(a, b)
    )


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def _kill_writer_midway(out, tmp_path, marker="wrote train-000003.tar"):
    """Run the CLI on a 4,000-image rewrite of `out` and SIGKILL it once it reports its 4th shard."""
    cmd = [
        sys.executable,
        "-m",
        "data_tools",
        "--source",
        "synthetic",
        "--split",
        "train",
        "--num-synthetic",
        "4000",
        "--samples-per-shard",
        "20",
        "--seed",
        "2",
        "--out",
        str(out),
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in p.stdout:
            seen.append(line)
            if marker in line:
                break
    finally:
        p.kill()
        p.wait(timeout=60)
    assert any(marker in line for line in seen), "".join(seen)[-2000:]


def _check_after_kill(man, before):
    """The old manifest still describes exactly the old data, or the loader refuses clearly."""
    try:
        after = _read_all(man, verify=False)  # no sha256: the generation alone must catch a mix
    except (FileNotFoundError, ValueError) as e:  # ShardError is a ValueError
        assert "manifest not found" in str(e) or "not from the write" in str(e), e
    else:
        assert _same(after, before), "the old manifest serves other images than it describes"


def test_rewrite_killed_midway_never_mixes_old_manifest_and_new_shards(tmp_path):
    out = tmp_path / "train"
    x, y, names = load_source("synthetic", "train", num_synthetic=200, seed=1)
    write_shards(x, y, str(out), class_names=names, samples_per_shard=20)
    man = str(out / "manifest.json")
    before = _read_all(man)
    _kill_writer_midway(out, tmp_path)
    _check_after_kill(man, before)
    # a complete, smaller rewrite leaves only its own shards: a brace pattern cannot reach stale ones
    m = write_shards(x[:80], y[:80], str(out), class_names=names, samples_per_shard=20)
    assert sorted(os.listdir(out)) == sorted([s["name"] for s in m["shards"]] + ["manifest.json"])
    assert [k for k, _, _ in _read_all(man)] == [f"train-{i:07d}" for i in range(80)]
    with pytest.raises(FileNotFoundError, match="train-000004.tar"):
        _read_all(str(out / "train-{000000..000009}.tar"))


def test_shard_of_another_write_is_refused_by_name(tmp_path):
    x, y, names = load_source("synthetic", "train", num_synthetic=100, seed=1)
    x2, y2, _ = load_source("synthetic", "train", num_synthetic=100, seed=2)
    a, b = tmp_path / "a", tmp_path / "b"
    ma = write_shards(x, y, str(a), class_names=names, samples_per_shard=25)
    mb = write_shards(x2, y2, str(b), class_names=names, samples_per_shard=25)
    assert ma["generation"] != mb["generation"]
    with tarfile.open(a / "train-000000.tar") as tf:
        assert {m.gname for m in tf.getmembers()} == {"labkit-" + ma["generation"]}
    (a / "train-000001.tar").write_bytes((b / "train-000001.tar").read_bytes())  # same name, same size
    from data_tools import ShardError

    with pytest.raises(ShardError, match=r"train-000001.tar is not from the write that manifest.json describes"):
        _read_all(str(a / "manifest.json"), verify=False)
    again = write_shards(x, y, str(tmp_path / "c"), class_names=names, samples_per_shard=25)
    assert again["generation"] == ma["generation"]  # equal inputs, equal generation, byte-identical shards


def test_gcs_rewrite_killed_midway_and_stale_shards(gcs_bucket, tmp_path):
    from labkit.cloud import gcs

    url = f"gs://{gcs_bucket}/syn/train"
    x, y, names = load_source("synthetic", "train", num_synthetic=200, seed=1)
    write_shards(x, y, url, class_names=names, samples_per_shard=20)
    before = _read_all(url + "/manifest.json")
    _kill_writer_midway(url, tmp_path)  # the subprocess inherits STORAGE_EMULATOR_HOST
    _check_after_kill(url + "/manifest.json", before)
    m = write_shards(x[:60], y[:60], url, class_names=names, samples_per_shard=20)
    listed = sorted(b.name for b in gcs.client().list_blobs(gcs_bucket, prefix="syn/train/"))
    assert listed == sorted(f"syn/train/{n}" for n in [s["name"] for s in m["shards"]] + ["manifest.json"])
    assert len(_read_all(url + "/manifest.json")) == 60


def test_labels_outside_the_classes_are_refused_when_writing(tmp_path):
    x, y, names = load_source("synthetic", "train", num_synthetic=20)
    bad = y.copy()
    bad[7] = 12
    with pytest.raises(ValueError, match=r"label 12 of image 7 is outside 0..9"):
        write_shards(x, bad, str(tmp_path), class_names=names)
    bad[7] = -100
    with pytest.raises(ValueError, match=r"label -100 of image 7"):
        write_shards(x, bad, str(tmp_path))
    with pytest.raises(ValueError, match="max_shard_bytes"):
        write_shards(x, y, str(tmp_path), max_shard_bytes=0)
