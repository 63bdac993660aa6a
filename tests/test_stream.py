"""Streaming loader: exact coverage over replicas x workers, reproducible order, errors that name the shard."""

import io
import json
import os
import shutil
import tarfile

import numpy as np
import pytest
import torch

from data_tools import ShardError, load_source, make_loader, verify_manifest, write_shards
from data_tools.stream import PAD_LABEL


@pytest.fixture(scope="module")
def digits():
    x, y, names = load_source("digits", "train")
    return x[:330], y[:330], names


@pytest.fixture(scope="module")
def even(tmp_path_factory, digits):
    """320 samples in 8 equal shards of 40."""
    out = tmp_path_factory.mktemp("even")
    x, y, names = digits
    write_shards(x[:320], y[:320], str(out), class_names=names, samples_per_shard=40, source="digits")
    return out


@pytest.fixture(scope="module")
def uneven(tmp_path_factory, digits):
    """330 samples in 9 shards: eight of 40, one of 10."""
    out = tmp_path_factory.mktemp("uneven")
    x, y, names = digits
    write_shards(x, y, str(out), class_names=names, samples_per_shard=40, source="digits")
    return out


def _keys(loader):
    out = []
    for x, y, k in loader:
        assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape[1:] == (3, 32, 32)
        out.append([key for key, label in zip(k, y.tolist()) if label != PAD_LABEL])
    return out


@pytest.mark.parametrize("train", [True, False])
def test_every_sample_once_across_2_replicas_x_2_workers(even, train):
    man = str(even / "manifest.json")
    per_replica = []
    for rank in range(2):
        ld = make_loader(man, 10, train=train, rank=rank, world_size=2, num_workers=2, return_keys=True, seed=1)
        batches = _keys(ld)
        assert len(batches) == len(ld) == 16  # 320 / (2 x 10)
        assert all(len(b) == 10 for b in batches)
        per_replica.append([k for b in batches for k in b])
    everything = per_replica[0] + per_replica[1]
    assert len(everything) == 320 == len(set(everything))
    assert not set(per_replica[0]) & set(per_replica[1])


def test_uneven_shards_equal_full_batches_per_replica(uneven):
    man = str(uneven / "manifest.json")
    for rank in range(2):
        ld = make_loader(man, 16, train=True, rank=rank, world_size=2, num_workers=2, return_keys=True)
        batches = _keys(ld)
        assert len(ld) == len(batches) == 330 // 32  # the replica with 170 samples and the one with 160 alike
        assert all(len(b) == 16 for b in batches)
        keys = [k for b in batches for k in b]
        held = sum(ld.stream.counts[i] for i in ld.stream._replica_shards())  # 4 or 5 shards: 130..200 samples
        assert len(set(keys)) == min(held, 160)  # cycling repeats only what its share lacks


def test_eval_covers_every_sample_once_with_padding(uneven):
    man = str(uneven / "manifest.json")
    ld = make_loader(man, 64, train=False, return_keys=True)
    keys = [k for b in _keys(ld) for k in b]
    assert len(ld) == 6 and sorted(keys) == sorted(set(keys)) and len(keys) == 330
    x, y, k = list(ld)[-1]
    assert x.shape[0] == 64 and (y == PAD_LABEL).sum() == 64 - 330 % 64 and float(x[y == PAD_LABEL].abs().sum()) == 0
    part = make_loader(man, 64, train=False, last_batch="partial")
    assert [b[0].shape[0] for b in part] == [64] * 5 + [10]
    assert len(make_loader(man, 64, train=False, last_batch="drop")) == 5
    # two replicas x two workers: still exactly once
    keys = []
    for rank in range(2):
        keys += [
            k
            for b in _keys(make_loader(man, 32, train=False, rank=rank, world_size=2, num_workers=2, return_keys=True))
            for k in b
        ]
    assert len(keys) == 330 == len(set(keys))


def test_same_seed_and_epoch_same_order_other_epoch_differs(even):
    man = str(even / "manifest.json")

    def run(epoch, seed=0, workers=2):
        ld = make_loader(man, 16, train=True, num_workers=workers, return_keys=True, seed=seed, shuffle_buffer=50)
        ld.set_epoch(epoch)
        return [k for b in _keys(ld) for k in b]

    a, b = run(3), run(3)
    assert a == b
    assert run(4) != a and sorted(run(4)) == sorted(a)
    assert run(3, seed=1) != a
    # a plain loop without set_epoch moves to the next epoch by itself
    ld = make_loader(man, 16, train=True, return_keys=True)
    e0 = [k for b in _keys(ld) for k in b]
    e1 = [k for b in _keys(ld) for k in b]
    assert ld.epoch == 1 and e0 != e1 and sorted(e0) == sorted(e1)


def test_persistent_workers_see_each_new_epoch(even):
    """persistent_workers=True keeps the worker processes (no restart at each epoch's start), and each epoch
    still reshuffles: set_epoch() and a plain loop's own next epoch reach the workers (a shared value), so
    every epoch is exactly what fresh workers would give."""
    man = str(even / "manifest.json")

    def epochs(persistent, set_epoch):
        ld = make_loader(man, 16, train=True, num_workers=2, return_keys=True, persistent_workers=persistent)
        out = []
        for e in range(3):
            if set_epoch:
                ld.set_epoch(e)
            out.append([k for b in _keys(ld) for k in b])
        return out

    fresh = epochs(False, True)
    assert fresh[0] != fresh[1] != fresh[2] and sorted(fresh[0]) == sorted(fresh[2])
    assert epochs(True, True) == fresh, "set_epoch() reaches persistent workers"
    assert epochs(True, False) == fresh, "a plain loop's next epoch reaches them too"


def test_train_batches_are_augmented_and_normalised(even):
    man = str(even / "manifest.json")
    m = json.loads((even / "manifest.json").read_text())
    ev = torch.cat([x for x, _ in make_loader(man, 64, train=False)])
    assert abs(float(ev.mean())) < 0.05 and abs(float(ev.std()) - 1) < 0.05  # manifest mean/std applied
    a = next(iter(make_loader(man, 8, train=True, shuffle_buffer=1, seed=0)))[0]
    b = next(iter(make_loader(man, 8, train=True, shuffle_buffer=1, seed=5)))[0]
    assert not torch.equal(a, b)  # different crops/flips (shard order differs too)
    pad_value = (0 - m["mean"][0]) / m["std"][0]
    crops = torch.cat([x for x, _ in make_loader(man, 64, train=True)])
    assert (crops[:, 0, 0, :] == pad_value).float().mean() > 0.2  # zero padding shows in crops


def test_gcs_round_trip(gcs_bucket, digits):
    x, y, names = digits
    url = f"gs://{gcs_bucket}/digits/train"
    write_shards(x[:120], y[:120], url, class_names=names, samples_per_shard=30)
    ld = make_loader(url + "/manifest.json", 20, train=False, return_keys=True, verify=True)
    keys = [k for b in _keys(ld) for k in b]
    assert len(keys) == 120 == len(set(keys))
    # a brace URL finds the manifest beside the shards; two workers use the gs:// handler after fork
    ld = make_loader(url + "/train-{000000..000003}.tar", 20, train=True, num_workers=2)
    xb, yb = next(iter(ld))
    assert len(ld) == 6 and xb.shape == (20, 3, 32, 32)
    import importlib

    assert importlib.import_module("webdataset.gopen").gopen_schemes["gs"].__module__ == "data_tools.urls"
    from labkit.cloud import gcs

    gcs.blob(url + "/train-000003.tar").delete()
    with pytest.raises(FileNotFoundError, match="shard not found: gs://.*train-000003.tar"):
        list(make_loader(url + "/manifest.json", 20, train=False))
    with pytest.raises(FileNotFoundError, match="manifest not found"):
        make_loader(f"gs://{gcs_bucket}/nothing/manifest.json", 20, train=False)


def test_http_manifest_and_brace_url(even):
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(even))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        ld = make_loader(base + "/manifest.json", 40, train=False, return_keys=True)
        assert len({k for b in _keys(ld) for k in b}) == 320
        ld = make_loader(base + "/train-{000000..000007}.tar", 40, train=True, num_workers=2)
        assert len(ld) == 8 and sum(1 for _ in ld) == 8  # the manifest beside them was found over http
    finally:
        server.shutdown()


def test_url_list_without_manifest_counts_or_takes_num_samples(tmp_path, even, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    for i in range(4):
        shutil.copy(even / f"train-{i:06d}.tar", tmp_path)
    urls = [str(tmp_path / f"train-{i:06d}.tar") for i in range(4)]
    ld = make_loader(urls, 10, train=True)  # no manifest: the shards are counted once (and cached)
    assert ld.stream.counts == [40] * 4 and (tmp_path / "cache" / "shard-counts.json").exists()
    ld = make_loader(urls, 10, train=True, num_samples=160, return_keys=True)
    assert len(ld) == 16 and len({k for b in _keys(ld) for k in b}) == 160
    assert sum(len(b) for b in _keys(make_loader(urls, 50, train=False, return_keys=True, last_batch="partial"))) == 160


# -- bad input -------------------------------------------------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_empty_url_list_and_too_few_shards(even):
    with pytest.raises(ValueError, match="no shard URLs"):
        make_loader([], 8, train=True)
    with pytest.raises(ValueError, match=r"8 shard\(s\) for 3 replica\(s\) x 3 worker\(s\) = 9"):
        make_loader(str(even / "manifest.json"), 8, train=True, rank=0, world_size=3, num_workers=3)


def test_truncated_and_corrupt_tar_name_the_shard(tmp_path, even):
    d = _copy(even, tmp_path / "t")
    shard = d / "train-000002.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2 + 100])
    with pytest.raises(ShardError, match="train-000002.tar.*(corrupt or truncated|samples, manifest)"):
        list(make_loader(str(d / "manifest.json"), 10, train=False))
    # garbage in a header block
    shard.write_bytes(data[:5120] + b"\xff" * 1024 + data[6144:])
    with pytest.raises(ShardError, match="train-000002.tar"):
        list(make_loader(str(d / "manifest.json"), 10, train=False, num_workers=2))
    # skip_corrupt: the rest is read and the loss is counted
    ld = make_loader(
        str(d / "manifest.json"), 10, train=False, skip_corrupt=True, last_batch="partial", num_workers=2
    )  # the counter is shared with the worker processes
    n = sum(b[0].shape[0] for b in ld)
    assert ld.skipped >= 1 and n + ld.skipped >= 320 - 40 and n < 320


def test_missing_shard_or_manifest_is_named(tmp_path, even):
    d = _copy(even, tmp_path / "g")
    os.remove(d / "train-000006.tar")
    with pytest.raises(FileNotFoundError, match="train-000006.tar"):
        list(make_loader(str(d / "manifest.json"), 10, train=False))
    with pytest.raises(FileNotFoundError, match="manifest not found: .*nope/manifest.json"):
        make_loader(str(tmp_path / "nope" / "manifest.json"), 10, train=True)


def _rewrite(shard, fn):
    """Rewrite a tar member by member through fn(name, data) -> (name, data) or None, keeping the
    headers' owner fields (the writer's generation), as an edit of the members would."""
    with tarfile.open(shard) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(shard, "w") as tf:
        for m, data in members:
            r = fn(m.name, data)
            if r is not None:
                m.name, m.size = r[0], len(r[1])
                tf.addfile(m, io.BytesIO(r[1]))


def test_missing_cls_and_bad_png_name_shard_and_key(tmp_path, even):
    d = _copy(even, tmp_path / "m")
    _rewrite(d / "train-000001.tar", lambda n, b: None if n == "train-0000045.cls" else (n, b))
    with pytest.raises(ShardError, match=r"train-000001.tar: sample 'train-0000045' has no 'cls'"):
        list(make_loader(str(d / "manifest.json"), 10, train=False))
    _rewrite(d / "train-000003.tar", lambda n, b: (n, b"not a png") if n == "train-0000130.png" else (n, b))
    ld = make_loader(str(d / "manifest.json"), 10, train=True, skip_corrupt=True, return_keys=True)
    batches = _keys(ld)
    keys = {k for b in batches for k in b}
    assert ld.skipped == 2 and "train-0000045" not in keys and len(ld) == len(batches) == 32
    shutil.copy(even / "train-000001.tar", d)  # only the bad png is left
    with pytest.raises(ShardError, match=r"train-000003.tar: sample 'train-0000130' cannot be decoded"):
        list(make_loader(str(d / "manifest.json"), 10, train=False, skip_corrupt=False))


def test_sha256_mismatch_with_verify(tmp_path, even):
    d = _copy(even, tmp_path / "s")
    shard = d / "train-000005.tar"
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0xFF  # one flipped byte inside a PNG payload: tar still parses
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="train-000005.tar: sha256"):
        verify_manifest(str(d / "manifest.json"))
    with pytest.raises(ValueError, match="train-000005.tar: sha256"):
        list(make_loader(str(d / "manifest.json"), 10, train=False, verify=True))


# -- feeding labkit's Trainer on XLA:CPU ------------------------------------------------------------
def test_feeds_trainer_on_xla_without_recompiles(even, uneven):
    """2 epochs + evaluation each epoch: no compile after the first epoch, and the padded eval
    batches count exactly the 330 real samples."""
    import torch_xla.debug.metrics as met

    import labkit
    from labkit import TrainConfig, Trainer

    rt = labkit.setup("xla-cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train = make_loader(str(even / "manifest.json"), 32, train=True, num_workers=2)
    val = make_loader(str(uneven / "manifest.json"), 64, train=False, mean=train.mean, std=train.std)
    seen = []

    class Probe:
        def on_epoch_end(self, trainer):
            seen.append((train.epoch, met.metric_data("CompileTime")[0], met.counter_value("UncachedCompile")))

    tr = Trainer(model, opt, rt, TrainConfig(epochs=2, log_every=5, eval_every=1), train, val, callbacks=[Probe()])
    hist = tr.fit()
    assert tr.step == 2 * 10 and [e[0] for e in seen] == [0, 1]
    assert seen[1][1:] == seen[0][1:], seen  # CompileTime and UncachedCompile unchanged in epoch 2
    assert all(np.isfinite(h["loss"]) for h in hist)
    # val_acc over the real samples only: recount on the host with the same model
    model_cpu = tr.module.to("cpu").eval()
    with torch.no_grad():
        hits = sum(int((model_cpu(x).argmax(1) == y).sum()) for x, y in val)  # padding (-100) never hits
    assert hits > 0 and tr.eval_history[-1]["val_acc"] == pytest.approx(hits / 330, abs=1e-6)


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_reader_matches_tarfile(tmp_path, fmt):
    from data_tools.tario import TarFormatError, iter_tar

    members = [("a/b/k1.png", b"x" * 700), ("k1.cls", b"3"), ("d" * 120 + "/k2.png", b""), ("k2.cls", b"12" * 300)]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        dir_info = tarfile.TarInfo("somedir")
        dir_info.type = tarfile.DIRTYPE
        tf.addfile(dir_info)
    raw = buf.getvalue()
    assert list(iter_tar(io.BytesIO(raw))) == members
    ends = []  # every cut before the end-of-archive blocks is an error, never a silent short read
    last = max(i for i in range(0, len(raw), 512) if raw[i : i + 512].strip(b"\0"))
    for cut in range(0, last + 512, 256):
        with pytest.raises(TarFormatError):
            list(iter_tar(io.BytesIO(raw[:cut])))
        ends.append(cut)
    assert len(ends) > 5


# -- labels, I/O failures, sha256 while streaming -----------------------------------------------------
@pytest.mark.parametrize("label", [b"12", b"-100"])
def test_label_outside_the_classes_names_shard_and_key(tmp_path, even, label):
    d = _copy(even, tmp_path / "l")
    _rewrite(d / "train-000001.tar", lambda n, b: (n, label) if n == "train-0000045.cls" else (n, b))
    want = rf"train-000001.tar: sample 'train-0000045' has label {label.decode()}, outside 0..9 \(10 classes"
    with pytest.raises(ShardError, match=want):
        list(make_loader(str(d / "manifest.json"), 10, train=False, verify=False))
    with pytest.raises(ShardError, match=want):
        list(make_loader(str(d / "manifest.json"), 10, train=True, num_workers=2, verify=False))
    ld = make_loader(
        str(d / "manifest.json"),
        10,
        train=False,
        skip_corrupt=True,
        return_keys=True,
        verify=False,
        last_batch="partial",
    )
    keys = [k for b in _keys(ld) for k in b]
    assert ld.skipped == 1 and len(keys) == 319 and "train-0000045" not in keys


def test_sha256_checked_while_streaming_by_default(tmp_path, even):
    """A flipped bit inside a PNG's pixel data that still decodes: only the sha256 can tell."""
    d = _copy(even, tmp_path / "h")
    shard = d / "train-000004.tar"
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tf:
        m = next(m for m in tf.getmembers() if m.name.endswith(".png"))
    from data_tools.transforms import decode_image

    png = bytes(data[m.offset_data : m.offset_data + m.size])
    good = decode_image(png)

    def silent(i):  # the flip of bit 0 of byte i decodes, to other pixels
        bad = bytearray(png)
        bad[i] ^= 0x01
        try:
            return not np.array_equal(decode_image(bytes(bad)), good)
        except Exception:
            return False

    i = next(i for i in range(len(png)) if silent(i))
    data[m.offset_data + i] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="train-000004.tar: sha256"):
        list(make_loader(str(d / "manifest.json"), 10, train=False))
    with pytest.warns(UserWarning, match="train-000004.tar: sha256"):  # skip_corrupt: reported, not raised
        list(make_loader(str(d / "manifest.json"), 10, train=False, skip_corrupt=True))
    assert len(list(make_loader(str(d / "manifest.json"), 10, train=False, verify=False))) == 32


def test_unreachable_server_is_an_error_even_with_skip_corrupt(even):
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.endswith("manifest.json"):
                body = (even / "manifest.json").read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(FileNotFoundError, match=r"shard not found: http://.*/train-000000.tar"):
            list(make_loader(base + "/manifest.json", 10, train=False, skip_corrupt=True))
    finally:
        server.shutdown()
        server.server_close()
    # the server is gone: connection refused, retried a bounded number of times, then named
    with pytest.raises(ConnectionError, match=r"cannot read http://127.0.0.1:\d+/\S+: 3 attempts.*refused"):
        list(make_loader([base + "/train-000000.tar"], 10, train=False, skip_corrupt=True, num_samples=40, timeout=1))


def test_folder_instead_of_manifest_and_empty_shard_list(tmp_path, even):
    with pytest.raises(IsADirectoryError, match=r"is a folder; pass .*/manifest.json"):
        make_loader(str(even), 10, train=True)
    bad = tmp_path / "manifest.json"
    m = json.loads((even / "manifest.json").read_text())
    bad.write_text(json.dumps({**m, "shards": []}))
    with pytest.raises(ValueError, match=r"manifest .*manifest.json lists no shards"):
        make_loader(str(bad), 10, train=True)
