"""s3:// streaming through s3fs against a real S3-API server on 127.0.0.1 (moto's server, its own process)."""

from __future__ import annotations

import os

import pytest

from data_tools import load_source, make_loader, write_shards
from data_tools.stream import PAD_LABEL
from tests.s3_moto import free_port, moto_s3

pytest.importorskip("s3fs")
pytest.importorskip("moto")

BUCKET = "labkit-shards"


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on a free loopback port (tests/s3_moto.py)."""
    with moto_s3() as url:
        yield url


@pytest.fixture(scope="module")
def shards_on_s3(s3_server, tmp_path_factory):
    """120 digits in 4 shards written locally, uploaded as they are to s3://labkit-shards/digits/train/."""
    import boto3

    x, y, names = load_source("digits", "train")
    out = tmp_path_factory.mktemp("s3src")
    write_shards(x[:120], y[:120], str(out), class_names=names, samples_per_shard=30, source="digits")
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket=BUCKET)
    for name in sorted(os.listdir(out)):
        if os.path.isfile(out / name):
            s3.upload_file(str(out / name), BUCKET, f"digits/train/{name}")
    return out, f"s3://{BUCKET}/digits/train"


def _samples(loader):
    keys, labels = [], []
    for _x, y, k in loader:
        for key, label in zip(k, y.tolist()):
            if label != PAD_LABEL:
                keys.append(key)
                labels.append(label)
    return keys, labels


def test_s3_stream_equals_the_local_stream(shards_on_s3):
    local, url = shards_on_s3
    remote = make_loader(url + "/manifest.json", 20, train=False, return_keys=True, verify=True)
    here = make_loader(str(local / "manifest.json"), 20, train=False, return_keys=True, verify=True)
    got, want = _samples(remote), _samples(here)
    assert len(got[0]) == 120 == len(set(got[0]))
    assert got == want  # same keys, same labels, same order: sha256 of every shard checked on the way
    # two DataLoader workers open their own s3fs session after fork; a brace URL finds the manifest beside it
    ld = make_loader(url + "/train-{000000..000003}.tar", 20, train=True, num_workers=2)
    batches = list(ld)
    assert len(batches) == len(ld) == 6 and batches[0][0].shape == (20, 3, 32, 32)
    import importlib

    assert importlib.import_module("webdataset.gopen").gopen_schemes["s3"].__module__ == "data_tools.urls"


def test_missing_s3_shard_and_manifest_are_named(shards_on_s3, s3_server):
    import boto3

    _, url = shards_on_s3
    with pytest.raises(FileNotFoundError, match="manifest not found.*s3://labkit-shards/nothing/manifest.json"):
        make_loader(f"s3://{BUCKET}/nothing/manifest.json", 20, train=False)
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.copy_object(Bucket=BUCKET, Key="gap/train/manifest.json", CopySource=f"{BUCKET}/digits/train/manifest.json")
    for i in (0, 1, 2):  # shard 3 is not there
        name = f"train-00000{i}.tar"
        s3.copy_object(Bucket=BUCKET, Key=f"gap/train/{name}", CopySource=f"{BUCKET}/digits/train/{name}")
    with pytest.raises(FileNotFoundError, match=r"shard not found: s3://labkit-shards/gap/train/train-000003\.tar"):
        list(make_loader(f"s3://{BUCKET}/gap/train/manifest.json", 20, train=False))


def test_unreachable_s3_endpoint_is_a_connection_error_naming_the_url(monkeypatch, shards_on_s3):
    from data_tools import http_read, urls

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setattr(http_read.time, "sleep", lambda s: None)  # the backoff between tries (retrying)
    with pytest.raises(ConnectionError, match=r"cannot read s3://labkit-shards/digits/train/manifest.json: 3 attempts"):
        urls.read_bytes(f"s3://{BUCKET}/digits/train/manifest.json", timeout=2)


def test_no_credentials_is_a_permission_error_saying_what_to_set(monkeypatch, tmp_path, shards_on_s3):
    from data_tools import urls

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup off EC2
    with pytest.raises(PermissionError, match=r"s3://labkit-shards/digits/train/manifest.json: no AWS credentials"):
        urls.read_bytes(f"s3://{BUCKET}/digits/train/manifest.json", timeout=5)
