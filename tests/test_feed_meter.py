"""The feed meter: the share of each step spent waiting for the next batch, on the dashboard, in the console
line and in labkit.explain. A deliberately slow loader makes it say input-bound; a fast one keeps it quiet.
Timings come from sleeps much longer than the loop's own work, so the verdicts do not depend on the machine."""

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
from tests.helpers import blobs, small_trainer, xla_counts


class SlowLoader:
    """A host loader that takes `delay` seconds per batch (a decoder that cannot keep up)."""

    def __init__(self, data, batch_size, delay):
        self.loader, self.delay = torch.utils.data.DataLoader(data, batch_size=batch_size), delay
        self.batch_size = batch_size

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            time.sleep(self.delay)
            yield batch


class BusyStep(labkit.Trainer):
    """A step that takes `busy` seconds of host time, standing in for a chip that is the bottleneck."""

    busy = 0.0

    def train_step(self, batch):
        time.sleep(self.busy)
        return super().train_step(batch)


def _fit(rt, loader=None, busy=0.0, steps=24):
    dash = Dashboard(title="feed", sink=ConsoleSink(io.StringIO()), controls=False)
    BusyStep.busy = busy
    tr = small_trainer(rt, blobs(n=16 * steps), batch_size=16, epochs=1, log_every=6, eval_every=0)
    tr = BusyStep(tr.model, tr.optimizer, rt, tr.cfg, loader or tr.train_loader.loader, callbacks=[dash])
    tr.fit()
    return tr, dash


def test_slow_loader_is_called_input_bound_everywhere():
    rt = labkit.setup("xla-cpu")
    before = xla_counts()[1]
    tr, dash = _fit(rt, SlowLoader(blobs(n=16 * 24), 16, delay=0.2))  # 0.2 s: far above a loaded step
    # the meter reads the host clock only: one device->host transfer per log interval, as without it
    assert xla_counts()[1] - before == 4
    # the first interval holds the compiles, and while they run the loader makes up to 12 batches ahead (8 on the
    # host, 4 on the device): a slow compile lets the second interval's 6 steps take them without starving
    later = tr.history[2:]
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


def test_fast_loader_keeps_the_meter_quiet():
    rt = labkit.setup("xla-cpu")
    tr, dash = _fit(rt, busy=0.05)
    assert all(r["data_wait_frac"] < INPUT_BOUND for r in tr.history[1:])
    assert not any("input-bound" in w for w in dash.frame()["warnings"])
    info = labkit.explain(dash, verbose=False)
    assert info["feed"]["data_wait_frac"] < INPUT_BOUND and "input-bound" not in info["text"]
    assert "the loader keeps up" in info["text"] or info["advice"]


def test_plain_cpu_explain_still_reports_the_feed():
    rt = labkit.setup("cpu")
    tr, dash = _fit(rt, SlowLoader(blobs(n=16 * 12), 16, delay=0.15), steps=12)
    info = labkit.explain(dash, verbose=False)
    assert info["xla"] is False and "not running on XLA" in info["text"] and "input-bound: " in info["text"]


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
