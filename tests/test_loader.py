"""device_loader: device tensors, prefetch, static shapes (no recompiles)."""

import time

import pytest
import torch

import labkit
from labkit import DeviceLoader, TrainConfig, Trainer
from tests.helpers import blobs, mlp, small_trainer, xla_counts


def test_xla_loader_yields_device_tensors_and_prefetches():
    rt = labkit.setup("xla-cpu")
    dl = torch.utils.data.DataLoader(blobs(n=320), batch_size=32)
    loader = DeviceLoader(dl, rt, device_prefetch=4)
    assert len(loader) == 10
    it = iter(loader)
    x, y = next(it)
    assert x.device.type == "xla" and y.device.type == "xla" and x.shape == (32, 16)
    time.sleep(1.0)  # a slow training step: the background thread keeps loading
    assert loader.yielded == 1 and loader.fetched >= 3, (loader.fetched, loader.yielded)
    rest = list(it)
    assert len(rest) == 9 and loader.fetched == loader.yielded == 10


def test_each_xla_runtime_chooses_its_feed_and_says_why_once(monkeypatch, capsys):
    """Every XLA runtime copies batches on torch_xla's loader threads (on XLA:CPU a copy from the loop's thread waits
    for the running step and stalls the next one's tracing: bench_peers --ablations); feed="main" copies in the
    loop's thread, as Fabric does. The choice, not its timing."""
    from labkit.runtime.xla import SpmdRuntime, TpuRuntime, TpuSpmdRuntime, XlaRuntime

    feeds = [cls.feed for cls in (XlaRuntime, SpmdRuntime, TpuRuntime, TpuSpmdRuntime)]
    assert feeds == ["thread"] * 4 and XlaRuntime.feed_why != TpuRuntime.feed_why
    rt = labkit.setup("xla-cpu")
    monkeypatch.setattr(rt, "_said_feed", False)  # this process's runtime may have said it in an earlier test
    dl = torch.utils.data.DataLoader(blobs(n=96), batch_size=32)
    assert len(list(DeviceLoader(dl, rt))) == len(list(DeviceLoader(dl, rt))) == 3
    said = [line for line in capsys.readouterr().out.splitlines() if "batches are copied" in line]
    assert len(said) == 1 and "background thread" in said[0] and "XLA:CPU" in said[0], said

    def no_thread(self, host, sharding=None):
        raise AssertionError("pl.ParallelLoader started for feed='main'")

    monkeypatch.setattr(DeviceLoader, "xla_batches", no_thread)
    loader = DeviceLoader(dl, rt, feed="main")  # an explicit feed= wins over the runtime's choice
    it = iter(loader)
    x, y = next(it)
    assert x.device.type == "xla" and y.device.type == "xla" and x.shape == (32, 16)
    assert loader.fetched == loader.yielded == 1  # nothing is copied ahead of the step that asks
    assert len(list(it)) == 2
    with pytest.raises(AssertionError, match="ParallelLoader"):
        next(iter(DeviceLoader(dl, rt)))
    with pytest.raises(ValueError, match="feed must be one of"):
        DeviceLoader(dl, rt, feed="threads")


def test_cpu_loader_is_pass_through():
    rt = labkit.setup("cpu")
    dl = torch.utils.data.DataLoader(blobs(n=100), batch_size=32)
    loader = DeviceLoader(dl, rt)
    batches = list(loader)
    assert len(loader) == 3 == len(batches) and loader.dropped == 1  # 100 = 3*32 + 4
    assert all(b[0].shape[0] == 32 and b[0].device.type == "cpu" for b in batches)
    assert len(DeviceLoader(dl, rt, drop_partial=False)) == 4


def test_partial_batches_dropped_no_recompiles_over_three_epochs():
    """200 samples / batch 32 leaves a partial batch of 8 each epoch: dropped, so after
    the warm-up epoch the number of compiled graphs stays flat."""
    rt = labkit.setup("xla-cpu")
    model = mlp()
    counts, drops = [], []

    class Count:
        def on_epoch_end(self, trainer):
            counts.append(xla_counts()[0])
            drops.append(trainer.train_loader.dropped)

    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        rt,
        TrainConfig(epochs=4, log_every=3, eval_every=0),
        torch.utils.data.DataLoader(blobs(n=200), batch_size=32, shuffle=True),
        callbacks=[Count()],
    )
    tr.fit()
    # the last epoch ends at max steps on its last full batch: fed in the loop's thread (feed="main"), the short one
    # is never read; torch_xla's loader threads read ahead to it
    assert tr.step == 4 * 6 and drops[:3] == [1, 1, 1] and drops[3] in (0, 1), drops
    assert counts[1] == counts[2] == counts[3], counts


def test_skip_batches_on_host():
    rt = labkit.setup("xla-cpu")
    dl = torch.utils.data.DataLoader(torch.arange(10.0).reshape(10, 1), batch_size=2)
    loader = DeviceLoader(dl, rt)
    loader.skip_batches = 3
    got = [b.cpu().flatten().tolist() for b in loader]
    assert got == [[6.0, 7.0], [8.0, 9.0]] and loader.fetched == 2
    assert len(list(loader)) == 5  # the skip applies once


class _TruncatedShards(torch.utils.data.Dataset):
    """Reads like a shard stream whose 5th sample is cut short (the error data_tools raises)."""

    def __init__(self, n=64, bad=37):
        self.x, self.y = blobs(n=n).tensors
        self.bad = bad

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.bad:
            from data_tools.stream import ShardError

            raise ShardError(f"gs://bucket/train-000003.tar: truncated at member {i:06d}.png")
        return self.x[i], self.y[i]


@pytest.mark.parametrize("kind,feed", [("xla-cpu", "thread"), ("xla-cpu", "main"), ("cpu", "auto")])
def test_loader_error_stops_fit_with_its_traceback(kind, feed):
    """On XLA (feed="thread") the batches come from torch_xla's loader thread, which used to swallow the error
    (a thread traceback on stderr, the epoch ended early, fit returned normally)."""
    from data_tools.stream import ShardError

    rt = labkit.setup(kind)
    tr = small_trainer(rt, _TruncatedShards(), batch_size=8, epochs=2, log_every=2, eval_every=0)
    tr.train_loader.feed = feed
    with pytest.raises(ShardError, match="train-000003.tar") as info:
        tr.fit()
    assert any(e.name == "__getitem__" for e in info.traceback), "the traceback lost the loader's frame"
    assert tr.step <= 4 and tr.epoch == 0  # batch 4 (samples 32-39) failed: nothing after it trained


def test_batches_of_varying_size_are_an_error_naming_the_batch():
    """14 batches of 8..21 rows (a bucketing sampler): before, every batch whose size differed from the
    first was dropped on XLA and fit() ended after one step without a word. Only a short LAST batch may
    be dropped; here batch 1 (9 rows after 8) names itself."""
    rt = labkit.setup("xla-cpu")
    ds = blobs(n=sum(range(8, 22)))
    sizes = list(range(8, 22))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    sampler = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
    model = mlp()
    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        TrainConfig(epochs=1, log_every=1, eval_every=0),
        torch.utils.data.DataLoader(ds, batch_sampler=sampler),
    )
    with pytest.raises(ValueError, match=r"batch 1 has 9 rows, batch 0 had 8"):
        tr.fit()
    assert tr.step <= 1


def test_only_a_short_last_batch_is_dropped():
    rt = labkit.setup("xla-cpu")
    ds = blobs(n=40)
    shrink = [list(range(0, 16)), list(range(16, 24)), list(range(24, 40))]  # 16, 8, 16: the 8 is not last
    with pytest.raises(ValueError, match=r"batch 1 has 8 rows, batch 0 had 16"):
        list(DeviceLoader(torch.utils.data.DataLoader(ds, batch_sampler=shrink), rt))
    grow = [list(range(0, 8)), list(range(8, 24))]  # a batch larger than the first: an error too
    with pytest.raises(ValueError, match=r"batch 1 has 16 rows, batch 0 had 8"):
        list(DeviceLoader(torch.utils.data.DataLoader(ds, batch_sampler=grow), rt))
    last = DeviceLoader(torch.utils.data.DataLoader(ds, batch_size=16), rt)  # 16, 16, 8
    assert len(list(last)) == 2 and last.dropped == 1
    free = DeviceLoader(torch.utils.data.DataLoader(ds, batch_sampler=shrink), rt, drop_partial=False)
    assert [b[0].shape[0] for b in free] == [16, 8, 16]


def test_length_under_a_distributed_sampler_is_this_process_share_and_the_last_interval_is_recorded():
    """DDP's canonical loader: a DistributedSampler gives process 0 of 4 13 of 50 samples, 3 whole batches of 4 (the
    short one dropped), not the whole dataset's 12. The Trainer plans 3 steps, and the run's last interval (step 3,
    log_every=2) is recorded."""
    labkit.setup("xla-cpu")  # XLA's devices start before any backward in this process (labkit.device says why)
    rt = labkit.setup("cpu")
    data = blobs(n=50)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=4, rank=0, shuffle=False)
    dl = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    loader = DeviceLoader(dl, rt)
    assert len(loader) == 3 == len(list(loader)) and loader.partial_rows() == 1
    model = mlp()
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt, TrainConfig(epochs=1, log_every=2), dl)
    assert tr.total_steps() == 3
    assert [r["step"] for r in tr.fit()] == [2, 3]


def test_fit_records_the_steps_after_the_last_log_when_a_callback_stops_it():
    labkit.setup("xla-cpu")  # XLA's devices start before any backward in this process
    rt = labkit.setup("cpu")

    class StopAt6:
        def on_step_end(self, trainer, batch):
            if trainer.step == 6:
                trainer.request_stop()

    tr = small_trainer(rt, blobs(n=320), epochs=1, log_every=4, eval_every=0, callbacks=[StopAt6()])
    history = tr.fit()
    assert [r["step"] for r in history] == [4, 6] and history[-1]["examples"] == 2 * 32
