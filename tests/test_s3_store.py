"""labkit.cloud.s3_store.S3Store against a real S3-API server on 127.0.0.1 (moto's, its own process): create-only
puts, versioned replacement, the writer lock, errors that name the culprit, and checkpoints end to end.
The behaviour every store shares is tests/test_store_protocol.py (its s3 case)."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from labkit.cloud import open_store
from labkit.cloud.gcs import crc32c_b64
from labkit.cloud.protocol import VersionConflict, VersionedStore
from labkit.cloud.s3_store import S3Store
from tests.s3_moto import free_port, moto_s3

pytest.importorskip("moto")
pytest.importorskip("boto3")

BUCKET = "labkit-ckpt"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A boto3 client on moto's server, with BUCKET made: what another writer (or a person) would use."""
    import boto3

    with moto_s3():
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        yield client


@pytest.fixture
def root(s3):
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


def _lock(s3, root) -> dict:
    return json.loads(s3.get_object(Bucket=BUCKET, Key=f"{root.split('/', 3)[3]}/.writer.lock")["Body"].read())


def test_open_store_gives_an_s3_store_and_a_missing_bucket_is_named(root):
    store = open_store(root)
    assert isinstance(store, S3Store) and isinstance(store, VersionedStore)
    assert (store.bucket, store.prefix, store.url("a/b")) == (BUCKET, root.split("/", 3)[3] + "/", f"{root}/a/b")
    with pytest.raises(FileNotFoundError, match="bucket no-such-bucket does not exist at http://127.0.0.1"):
        S3Store("s3://no-such-bucket/run")


def test_put_if_absent_refuses_a_taken_name_and_accepts_its_own_retry(root, tmp_path):
    store = S3Store(root, retry_deadline_s=10)
    src = tmp_path / "ckpt.pt"
    src.write_bytes(os.urandom(3 << 20))  # a file source, streamed from disk
    crc = crc32c_b64(str(src))
    store.put_if_absent("ckpt-00000001.pt", src, crc)
    store.put_if_absent("ckpt-00000001.pt", src, crc)  # a retry whose first reply was lost: its own object
    with pytest.raises(FileExistsError, match=rf"{root}/ckpt-00000001.pt already exists"):
        store.put_if_absent("ckpt-00000001.pt", b"another run's", crc32c_b64(b"another run's"))
    with pytest.raises(FileExistsError):
        store.put_if_absent("ckpt-00000001.pt", b"no crc")  # without a crc nothing can prove it ours
    assert store.get("ckpt-00000001.pt") == src.read_bytes()
    with store.open("ckpt-00000001.pt") as f:  # streamed
        assert f.read(10) == src.read_bytes()[:10]
    with pytest.raises(FileNotFoundError, match=rf"{root}/nothing.pt does not exist"):
        store.open("nothing.pt")


def test_put_if_version_refuses_a_stale_version(root, s3):
    store = S3Store(root)
    assert store.get_versioned("latest") == (None, None)
    v1 = store.put_if_version("latest", b'{"step": 1}', None)  # None: create only
    with pytest.raises(VersionConflict):
        store.put_if_version("latest", b'{"step": 1}', None)  # another writer created it first
    v2 = store.put_if_version("latest", b'{"step": 2}', v1)
    with pytest.raises(VersionConflict, match=f"{root}/latest: not at version"):
        store.put_if_version("latest", b'{"step": 3}', v1)  # read v1 too, but v2 is there now
    assert store.get_versioned("latest") == (b'{"step": 2}', v2)
    store.delete("latest")
    with pytest.raises(VersionConflict):
        store.put_if_version("latest", b'{"step": 3}', v2)  # deleted since it was read


def test_a_second_writer_is_refused_naming_the_holder(root, s3, monkeypatch):
    from labkit.cloud import s3_store

    first, second = S3Store(root), S3Store(root)
    first.acquire_writer()
    assert first.list() == []  # the lock is not listed
    with pytest.raises(
        RuntimeError, match=rf"another checkpoint writer \(host .* pid {os.getpid()}, lock renewed 0 min"
    ):
        second.acquire_writer()
    first.release_writer()
    second.acquire_writer()  # given back: now the second may write
    second.check_writer()
    assert _lock(s3, root)["id"] == second._lock["id"]
    # a lock nobody renewed for the lease (on the server's clock) is taken over by any writer
    monkeypatch.setattr(s3_store, "LEASE_S", 0)
    third = S3Store(root)
    with pytest.warns(UserWarning, match=rf"taking over the writer lock of host .* pid {os.getpid()} \(not renewed"):
        third.acquire_writer()
    assert _lock(s3, root)["id"] == third._lock["id"]


def test_a_taken_over_lock_stops_the_old_writer_and_stays(root, s3):
    old, new = S3Store(root), S3Store(root)
    old.acquire_writer()
    with pytest.raises(RuntimeError, match="another checkpoint writer"):
        new.acquire_writer()  # not resumed: refused
    with pytest.warns(UserWarning, match=r"taking over .* \(this run resumed it\)"):
        new.acquire_writer(takeover=True)
    with pytest.raises(RuntimeError, match=rf"{root}/.writer.lock was taken over by another writer"):
        old.check_writer()
    with pytest.raises(RuntimeError, match="does not hold the lock"):
        old.check_writer()
    old._lock = {"id": "stale"}  # as if it still thought it held the lock
    with pytest.warns(UserWarning, match="left in place"):
        old.release_writer()
    assert _lock(s3, root)["id"] == new._lock["id"]  # the new run's lock stays
    new._renewed -= 120  # a minute since the last renewal: check_writer rewrites it (If-Match) and it stays ours
    new.check_writer()
    assert new._lock is not None and _lock(s3, root)["id"] == new._lock["id"]
    new.release_writer()
    with pytest.raises(FileNotFoundError):
        open_store(root).get(".writer.lock")


def test_release_deletes_only_its_own_lock_even_after_its_check(root, s3, monkeypatch):
    """The delete itself is conditional (DeleteObject If-Match our ETag): a lock replaced between the
    check and the delete stays."""
    mine = S3Store(root)
    mine.acquire_writer()
    key = f"{mine.prefix}.writer.lock"
    s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps({"host": "elsewhere", "pid": 1, "id": "x"}).encode())
    monkeypatch.setattr(mine, "check_writer", lambda: None)  # the replacement lands after the check
    mine.release_writer()
    assert _lock(s3, root) == {"host": "elsewhere", "pid": 1, "id": "x"}
    with pytest.raises(RuntimeError, match=r"host elsewhere pid 1, lock renewed 0 min ago.*resume this run"):
        S3Store(root).acquire_writer()  # another host's fresh lock: refused, named


def test_errors_name_what_to_set(root, monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(PermissionError, match=rf"s3://{BUCKET}: no AWS credentials \(set AWS_ACCESS_KEY_ID"):
        S3Store(root)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    with pytest.raises(ConnectionError, match=rf"s3://{BUCKET}: .*could not reach the S3 endpoint {dead}"):
        S3Store(root, retry_deadline_s=1)


def test_checkpoint_manager_saves_and_restores_on_s3(root, s3):
    from labkit.checkpoint import CheckpointManager

    def state(step):
        return {"model": {"w": torch.full((4, 4), float(step)), "b": torch.arange(4.0)}, "step": step}

    ckpt = CheckpointManager(root, keep=2, best_metric=None, format="file")
    for step in (1, 2, 3):
        assert ckpt.save(step, state(step))
    ckpt.close()
    store = open_store(root)
    assert [n for n in store.list() if n.startswith("ckpt-")] == ["ckpt-00000002.pt", "ckpt-00000003.pt"]
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{store.prefix}.writer.lock")  # released
    got = CheckpointManager(root, keep=2, best_metric=None, format="file").restore()
    assert got["step"] == 3 and torch.equal(got["model"]["w"], state(3)["model"]["w"])


def test_a_dataset_is_written_to_s3_and_rewritten_through_the_same_store(s3):
    """data_tools' writer goes through the one store interface: a dataset written to s3://, streamed back, then
    rewritten smaller (the stale shard goes, nothing staged is left); a shard that no labkit write made is
    refused by name and kept."""
    from data_tools import load_manifest, load_source, make_loader, write_shards

    url = f"s3://{BUCKET}/digits-{uuid.uuid4().hex[:6]}/val"
    prefix = url.split(f"{BUCKET}/", 1)[1] + "/"
    x, y, names = load_source("digits", "val")
    m = write_shards(x[:60], y[:60], url, split="val", class_names=names, samples_per_shard=25)
    listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"])
    assert listed == [prefix + n for n in ("manifest.json", "val-000000.tar", "val-000001.tar", "val-000002.tar")]
    back = load_manifest(url + "/manifest.json")
    assert back["shards"] == m["shards"] and back["num_samples"] == 60
    labels = torch.cat([b[1] for b in make_loader(url + "/manifest.json", 20, train=False)])
    assert sorted(labels.tolist()) == sorted(int(v) for v in y[:60])
    write_shards(x[:30], y[:30], url, split="val", class_names=names, samples_per_shard=25)
    listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"])
    assert listed == [prefix + n for n in ("manifest.json", "val-000000.tar", "val-000001.tar")], listed
    s3.put_object(Bucket=BUCKET, Key=prefix + "val-000007.tar", Body=b"\0" * 1024)  # someone else's file
    with pytest.raises(ValueError, match="val-000007.tar, which no labkit manifest lists"):
        write_shards(x[:30], y[:30], url, split="val", class_names=names, samples_per_shard=25)
    assert s3.head_object(Bucket=BUCKET, Key=prefix + "val-000007.tar")["ContentLength"] == 1024
