"""Every store implements the declared interface (labkit.cloud.protocol) and behaves as it says: create-only
puts refuse a taken name, get/open read what put wrote, list and delete see it. The s3:// case runs against
moto's S3 server on 127.0.0.1; S3Store's own tests are tests/test_s3_store.py."""

from __future__ import annotations

import pytest

from data_tools.url_store import URLStore
from labkit.cloud import GCSStore, LocalStore, ObjectStore, ReadStore, S3Store, open_store
from labkit.cloud.protocol import VersionConflict, VersionedStore
from tests.s3_moto import moto_s3


def _stores(tmp_path, gcs_bucket):
    return [LocalStore(tmp_path / "run"), GCSStore(f"gs://{gcs_bucket}/run", retry_deadline_s=10)]


@pytest.fixture(scope="module")
def s3_bucket():
    """A bucket on moto's S3 server on 127.0.0.1 (tests/s3_moto.py), for this module's s3:// case."""
    pytest.importorskip("moto")
    import boto3

    with moto_s3():
        boto3.client("s3").create_bucket(Bucket="labkit-protocol")
        yield "labkit-protocol"


def _writable(where, tmp_path, request):
    if where == "s3":
        return S3Store(f"s3://{request.getfixturevalue('s3_bucket')}/run", retry_deadline_s=10)
    return _stores(tmp_path, request.getfixturevalue("gcs_bucket"))[where == "gs"]


@pytest.mark.parametrize("where", ["local", "gs", "s3"])
def test_writable_store_follows_the_protocol(where, tmp_path, request):
    store = _writable(where, tmp_path, request)
    assert isinstance(store, ObjectStore) and isinstance(store, ReadStore)
    store.put_if_absent("a/ckpt-00000001.pt", b"one")
    with pytest.raises(FileExistsError, match="already exists"):
        store.put_if_absent("a/ckpt-00000001.pt", b"two")  # create-only: the first writer's bytes stay
    assert store.get("a/ckpt-00000001.pt") == b"one"
    src = tmp_path / "src.bin"
    src.write_bytes(b"from a file")
    with pytest.raises(FileExistsError):
        store.put_if_absent("a/ckpt-00000001.pt", src)
    store.put("a/ckpt-00000001.pt", b"replaced")  # put: meant to overwrite
    with store.open("a/ckpt-00000001.pt") as f:
        assert f.read() == b"replaced"
    assert store.list("a/") == ["a/ckpt-00000001.pt"]
    store.put(".staging-x/s.tar", b"staged")  # move: the writer's publish step (a rename, or a server-side copy)
    store.put("s.tar", b"old")
    store.move(".staging-x/s.tar", "s.tar")
    assert store.get("s.tar") == b"staged" and store.list(".staging-x") == []
    with pytest.raises(FileNotFoundError):
        store.move(".staging-x/s.tar", "t.tar")
    store.delete("s.tar")
    store.delete("a/ckpt-00000001.pt")
    store.delete("a/ckpt-00000001.pt")  # missing: no error
    assert store.list() == []
    with pytest.raises(FileNotFoundError):
        store.get("a/ckpt-00000001.pt")
    with pytest.raises(FileNotFoundError):
        with store.open("a/ckpt-00000001.pt") as f:
            f.read()
    assert store.url("x").endswith("run/x")


def test_gs_replaces_a_versioned_object_only_at_the_version_read(tmp_path, gcs_bucket):
    for store in _stores(tmp_path, gcs_bucket):
        assert isinstance(store, VersionedStore)
        assert store.get_versioned("latest")[0] is None
    store = _stores(tmp_path, gcs_bucket)[1]
    _, v0 = store.get_versioned("latest")
    v1 = store.put_if_version("latest", b"{}", v0)
    with pytest.raises(VersionConflict):
        store.put_if_version("latest", b"{}", v0)  # another writer read v0 too: its write fails
    assert store.get_versioned("latest") == (b"{}", v1)


def test_open_store_picks_the_implementation(tmp_path, gcs_bucket):
    assert isinstance(open_store(tmp_path), LocalStore)
    assert isinstance(open_store(f"gs://{gcs_bucket}/p"), GCSStore)


def test_url_store_reads_any_prefix(tmp_path, gcs_bucket):
    LocalStore(tmp_path).put("s/x.bin", b"abc")
    GCSStore(f"gs://{gcs_bucket}/s", retry_deadline_s=10).put("x.bin", b"def")
    for prefix, want in [(tmp_path / "s", b"abc"), (f"file://{tmp_path}/s", b"abc"), (f"gs://{gcs_bucket}/s", b"def")]:
        store = URLStore(prefix, timeout=10)
        assert isinstance(store, ReadStore) and not isinstance(store, ObjectStore)  # read-only
        assert store.get("x.bin") == want
        with store.open("x.bin") as f:
            assert f.read() == want
        with pytest.raises(FileNotFoundError):
            store.get("missing.bin")
