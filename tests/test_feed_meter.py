"""The feed meter: the share of each step spent waiting for the next batch, on the dashboard, in the console
line and in labkit.explain. A deliberately slow loader makes it say input-bound; a fast one keeps it quiet.

Its verdict is a fact about timings, so each side is proven on a fake clock (tests.helpers.FakeClock, read by
the Trainer's `log.clock`): a loader and a step that take a known time on it give the same numbers on any
machine. One test keeps the real clock, marked `timing`: a loader that sleeps 0.2 s per batch, far above a step
of the tiny model even on a loaded core, must be called input-bound (scripts/contention.sh runs it beside hogs)."""

import io
import math
import time

import pytest
import torch

import labkit
from labkit import Dashboard
from labkit.dashboard import ConsoleSink
from labkit.dashboard.explain import feed_of
from labkit.dashboard.rules import INPUT_BOUND, cores_needed, feed_finding
from tests.helpers import FakeClock, blobs, small_trainer, xla_counts


class SlowLoader:
    """A host loader that takes `delay` seconds per batch (a decoder that cannot keep up), on `sleep`'s clock."""

    def __init__(self, data, batch_size, delay, sleep=time.sleep):
        self.loader, self.delay, self.sleep = torch.utils.data.DataLoader(data, batch_size=batch_size), delay, sleep
        self.batch_size = batch_size

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.sleep(self.delay)
            yield batch


class BusyStep(labkit.Trainer):
    """A step that takes `busy` seconds of host time, standing in for a chip that is the bottleneck."""

    busy, sleep = 0.0, staticmethod(time.sleep)

    def train_step(self, batch):
        self.sleep(self.busy)
        return super().train_step(batch)


def _fit(rt, loader=None, busy=0.0, steps=24, clock=None, feed="auto"):
    """24 steps of 16 rows, logged every 6. clock: a FakeClock for the feed meter, the step's and the loader's
    time (the loader then runs in the loop's thread: feed="main"); None: the real clock."""
    dash = Dashboard(title="feed", sink=ConsoleSink(io.StringIO()), controls=False)
    tr = small_trainer(rt, blobs(n=16 * steps), batch_size=16, epochs=1, log_every=6, eval_every=0)
    loader = labkit.DeviceLoader(loader or tr.train_loader.loader, rt, feed="main" if clock is not None else feed)
    tr = BusyStep(tr.model, tr.optimizer, rt, tr.cfg, loader, callbacks=[dash])
    tr.busy = busy
    if clock is not None:
        tr.sleep, tr.log.clock = clock.sleep, clock
    tr.fit()
    return tr, dash


def _fake_fit(rt, delay, busy, steps=24):
    clock = FakeClock()
    return _fit(rt, SlowLoader(blobs(n=16 * steps), 16, delay, sleep=clock.sleep), busy, steps, clock=clock)


@pytest.mark.timing
def test_slow_loader_is_called_input_bound_everywhere():
    rt = labkit.setup("xla-cpu")
    before = xla_counts()[1]
    # 0.2 s a batch: far above a step of this model, even on a loaded core. The loader runs in the loop's thread
    # (feed="main"): torch_xla's loader thread would fill its queues while the first step compiles, and the steps
    # after it would take those batches without waiting, for as many intervals as a slow compile lasted (on one core
    # beside three CPU hogs: the second and third of four)
    tr, dash = _fit(rt, SlowLoader(blobs(n=16 * 24), 16, delay=0.2), feed="main")
    # the meter reads the host clock only: one device->host transfer per log interval, as without it
    assert xla_counts()[1] - before == 4
    later = tr.history[1:]  # the first interval holds the compiles
    assert all(r["data_wait_frac"] > 0.5 for r in later), [r["data_wait_frac"] for r in tr.history]
    assert all(0 <= r["data_wait_s"] <= r["step_s"] for r in tr.history) and all(r["data_wait_s"] > 0 for r in later)
    f = dash.frame()
    assert any(w.startswith("input-bound: ") and "% of step time waiting for data" in w for w in f["warnings"])
    lines = dash.sink.stream.getvalue().splitlines()
    assert any("| data wait " in ln for ln in lines) and any(ln.startswith("  ! input-bound: ") for ln in lines)
    info = labkit.explain(dash, verbose=False)
    assert info["feed"]["data_wait_frac"] > 0.5
    assert "input-bound: " in info["text"] and "add workers, pre-resize the shards, or smaller images" in info["text"]
    assert "feed: " in _text_of(dash)  # the figure's text panel


def test_a_loader_slower_than_the_step_is_input_bound_on_a_fake_clock():
    """50 ms per batch against a 10 ms step: 5/6 of every step is the wait, whatever the machine's speed."""
    rt = labkit.setup("xla-cpu")
    tr, dash = _fake_fit(rt, delay=0.05, busy=0.01)
    for r in tr.history:
        assert r["data_wait_s"] == pytest.approx(0.05) and r["step_s"] == pytest.approx(0.06), r
        assert r["data_wait_frac"] == pytest.approx(5 / 6), r
    (w,) = dash.frame()["warnings"]
    assert w.startswith("input-bound: 83 % of step time waiting for data (0.05 s of 0.06 s per step)"), w
    assert "  ! input-bound: 83 % " in dash.sink.stream.getvalue()
    info = labkit.explain(dash, verbose=False)
    assert info["feed"]["data_wait_frac"] == pytest.approx(5 / 6) and "input-bound: 83 %" in info["text"]


def test_a_loader_faster_than_the_step_keeps_the_meter_quiet_on_a_fake_clock():
    """10 ms per batch against a 50 ms step: 1/6 of the step waits, under INPUT_BOUND: no verdict."""
    rt = labkit.setup("xla-cpu")
    tr, dash = _fake_fit(rt, delay=0.01, busy=0.05)
    assert all(r["data_wait_frac"] == pytest.approx(1 / 6) for r in tr.history), tr.history
    assert 1 / 6 < INPUT_BOUND and dash.frame()["warnings"] == []
    assert "input-bound" not in dash.sink.stream.getvalue()
    info = labkit.explain(dash, verbose=False)
    assert info["feed"]["data_wait_frac"] == pytest.approx(1 / 6) and "input-bound" not in info["text"]
    assert "the loader keeps up" in info["text"]


def test_plain_cpu_explain_still_reports_the_feed():
    rt = labkit.setup("cpu")
    tr, dash = _fake_fit(rt, delay=0.15, busy=0.0, steps=12)
    info = labkit.explain(dash, verbose=False)
    assert info["xla"] is False and "not running on XLA" in info["text"] and "input-bound: 100 %" in info["text"]


def test_a_wait_counts_only_when_no_batch_was_ready():
    """A wait that began with two or more batches made ahead (torch_xla's loader thread) is the copy of a finished
    batch queued behind the step, not the input pipeline: the meter leaves it out. Each batch takes 50 ms here."""
    from labkit import TrainConfig
    from labkit.steplog import StepLog

    clock = FakeClock()

    class Queue:  # a DeviceLoader's counters: fetched - yielded = batches made ahead when the loop asks
        def __init__(self, aheads):
            self.aheads, self.yielded, self.fetched = aheads, 0, aheads[0]

        def __iter__(self):
            for i, _ in enumerate(self.aheads):
                clock.sleep(0.05)
                self.yielded += 1
                self.fetched = self.yielded + (self.aheads[i + 1] if i + 1 < len(self.aheads) else 0)
                yield i

    log = StepLog(labkit.setup("cpu"), TrainConfig(log_every=1), clock=clock)
    q = Queue([3, 2, 1, 0])
    assert list(log.timed(q, q)) == [0, 1, 2, 3]
    assert log._wait_s == pytest.approx(0.1)  # the last two: one batch ahead, then none


def test_the_rule_and_the_run_summary():
    assert (
        feed_finding(None) == [] and feed_finding(INPUT_BOUND - 0.01) == [] and feed_finding(0.9, 0.001, 0.0011) == []
    )
    (f,) = feed_finding(0.62, 0.124, 0.2)
    assert f.short == (
        "input-bound: 62 % of step time waiting for data (0.124 s of 0.2 s per step): "
        "add workers, pre-resize the shards, or smaller images"
    )

    class Rows:  # the first interval (compiles) is left out; the others count by their steps
        history = [
            {"step": 5, "data_wait_frac": 0.0, "data_wait_s": 0.0, "step_s": 9.0},
            {"step": 10, "data_wait_frac": 0.5, "data_wait_s": 0.1, "step_s": 0.2},
            {"step": 30, "data_wait_frac": 0.0, "data_wait_s": 0.0, "step_s": 0.2},
        ]

    feed = feed_of(Rows())
    assert abs(feed["data_wait_frac"] - 0.1) < 1e-9 and abs(feed["step_s"] - 0.2) < 1e-9
    assert feed_of(object()) is None


def test_the_verdict_says_how_many_cores_one_chip_needs():
    """Injected figures, never a timing: 4 workers deliver a batch every 0.2 s while the step alone takes 0.05 s, so
    the chip asks 4 x 0.2 / 0.05 = 16 cores' worth; a GPU node's case (an H200 step of ResNet-50: 11.5 ms for 64
    images, 0.9 of it waiting on 8 workers) asks 80. Without workers the verdict is as before; a step that only
    waits needs an unbounded number."""
    assert cores_needed(0.15, 0.2, 4) == pytest.approx(16) and cores_needed(0.0, 0.2, 0) == pytest.approx(1)
    assert cores_needed(0.2, 0.2, 2) == math.inf
    (f,) = feed_finding(0.75, 0.15, 0.2, 4, 320.0)
    assert f.advice.endswith(
        " One chip needs about 16 host cores decoding at this rate (4 workers now, 80 images/s each)."
    )
    (g,) = feed_finding(0.9, 0.1035, 0.115, 8)
    assert "about 80 host cores" in g.advice and "(8 workers now)" in g.advice
    (h,) = feed_finding(0.5, 0.1, 0.2, 0, 64.0)
    assert "about 2 host cores" in h.advice and "(the loop's own process now, 64 images/s each)" in h.advice
    (old,) = feed_finding(0.75, 0.15, 0.2)
    assert "host cores" not in old.advice

    class Rows:
        history = [
            {"step": 5, "data_wait_frac": 0.5, "data_wait_s": 0.1, "step_s": 0.2},
            {"step": 10, "data_wait_frac": 0.5, "data_wait_s": 0.1, "step_s": 0.2, "data_workers": 2},
        ]
        history[1]["examples_per_s"] = 100.0

    feed = feed_of(Rows())
    assert feed["workers"] == 2 and feed["images_per_s"] == 100.0


def test_the_log_records_the_loaders_workers():
    rt = labkit.setup("cpu")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.arange(8) % 2), 4)
    model = torch.nn.Linear(4, 2)
    cfg = labkit.TrainConfig(max_steps=2, log_every=1, eval_every=0, compile="off")
    tr = labkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt, cfg, data)
    tr.fit()
    assert [r["data_workers"] for r in tr.history] == [0, 0]


def _text_of(dash) -> str:
    fig = dash.figure()
    return "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)


def test_data_already_in_memory_never_gets_add_workers():
    """A run fed from a list of batches made before it decodes nothing: a wait there is the device copy or a busy
    host, so the verdict names those and never advises workers or smaller images (injected figures, no timing)."""
    (f,) = feed_finding(0.62, 0.124, 0.2, None, 100.0, in_memory=True)
    assert "already in memory" in f.short and "cannot help" in f.advice
    for wrong in ("add workers", "pre-resize", "num_workers", "host cores"):
        assert wrong not in f.short and wrong not in f.advice, wrong
    assert feed_finding(0.1, 0.01, 0.1, in_memory=True) == []  # below the threshold: quiet, as a loader's

    class Rows:
        history = [
            {"step": 5, "data_wait_frac": 0.5, "data_wait_s": 0.1, "step_s": 0.2, "data_in_memory": True},
            {"step": 10, "data_wait_frac": 0.5, "data_wait_s": 0.1, "step_s": 0.2, "data_in_memory": True},
        ]

    assert feed_of(Rows())["in_memory"] is True
    info = labkit.explain(Rows(), rt=labkit.setup("cpu"))
    assert "add workers" not in info["text"] and "already in memory" in info["text"], info["text"]


def test_the_log_records_a_list_of_batches_as_in_memory():
    rt = labkit.setup("cpu")
    batches = [(torch.randn(4, 4), torch.arange(4) % 2) for _ in range(2)]
    model = torch.nn.Linear(4, 2)
    cfg = labkit.TrainConfig(max_steps=2, log_every=1, eval_every=0, compile="off")
    tr = labkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt, cfg, batches)
    tr.fit()
    assert [r.get("data_in_memory") for r in tr.history] == [True, True]
    assert all("data_workers" not in r for r in tr.history)
