"""num_workers="auto": loader processes from the cores this process may use, shared among a host's training
processes, and the loader built with that count streams every sample once."""

import pytest
import torch

from data_tools import make_loader
from data_tools.loader import auto_workers
from tests.test_feed_photos import write_photos


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(n)), raising=False)

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return set_cores


@pytest.mark.parametrize(("n", "local", "want"), [(8, None, 7), (8, "4", 1), (8, "16", 0), (2, None, 1), (1, None, 0)])
def test_one_worker_per_free_core_shared_among_local_processes(cores, monkeypatch, n, local, want):
    cores(n)
    if local is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert auto_workers() == want


@pytest.mark.parametrize("local", ["0", "two", "-1"])
def test_a_bad_local_world_size_is_named(cores, monkeypatch, local):
    cores(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        auto_workers()


@pytest.mark.parametrize("bad", ["many", -1, True, 1.5, "2"])
def test_a_worker_count_that_is_not_one_is_named(tmp_path, monkeypatch, bad):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    shards = write_photos(str(tmp_path / "p"), n=8, per_shard=4)
    with pytest.raises(ValueError, match=r"num_workers=.*'auto'"):
        make_loader(shards, 4, train=False, image_size=16, num_workers=bad)


def test_auto_streams_every_sample_once_with_that_many_workers(tmp_path, cores, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    cores(3)
    shards = write_photos(str(tmp_path / "p"), n=24, per_shard=4)
    loader = make_loader(shards, 5, train=False, image_size=16, num_workers="auto", return_keys=True)
    assert loader.num_workers == 2
    keys, shapes = [], set()
    for x, y, k in loader:
        shapes.add(tuple(x.shape))
        keys += [key for key, label in zip(k, y.tolist()) if label >= 0]
    assert shapes == {(5, 3, 16, 16)}
    assert sorted(keys) == [f"s{i:05d}" for i in range(24)]
    assert torch.is_tensor(y)
