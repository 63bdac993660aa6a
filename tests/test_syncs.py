"""The host-sync finder and the recompile detective on XLA:CPU: reads counted per user line, no added
transfer or execution, the line and the changed input of each recompilation, Tensor restored after."""

import io

import torch

import labkit
from labkit import Dashboard, TrainConfig, Trainer
from labkit.dashboard import ConsoleSink
from labkit.dashboard.health import HealthMonitor
from labkit.dashboard.syncs import SyncFinder
from tests.helpers import blobs, mlp


def _counts():
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    xm.wait_device_ops()
    return tuple((met.metric_data(n) or (0,))[0] for n in ("ExecuteTime", "TransferFromDeviceTime", "CompileTime"))


def _loop(rt, w, steps, reads: bool):
    import torch_xla

    total = 0.0
    for _ in range(steps):
        loss = (w @ w).tanh().mean()
        if reads:
            if loss > 0:  # a Python `if` on a device value
                total += 1
            total += loss.item()
        torch_xla.sync()
    return total


def test_reads_are_counted_per_line_and_the_finder_adds_none():
    rt = labkit.setup("xla-cpu")
    w = torch.randn(24, 24, device=rt.device)
    _loop(rt, w, 2, reads=True)  # compile both graphs outside the comparison
    before = _counts()
    _loop(rt, w, 6, reads=True)
    plain = [a - b for a, b in zip(_counts(), before)]
    finder = SyncFinder()
    before = _counts()
    with finder:
        _loop(rt, w, 6, reads=True)
    watched = [a - b for a, b in zip(_counts(), before)]
    assert watched == plain, (plain, watched)  # (executions, transfers, compiles): nothing added
    lines = {s.code: n for s, n in finder.take().items()}
    assert lines == {"if loss > 0:  # a Python `if` on a device value": 6, "total += loss.item()": 6}, lines
    assert all(s.file == __file__ for s in finder.total)  # the user's line, not torch's or labkit's
    assert finder.take() == {}  # take() starts a new window
    assert "item" not in torch.Tensor.__dict__ and "__bool__" not in torch.Tensor.__dict__  # unwrapped again
    with finder:
        _loop(rt, w, 3, reads=False)  # the fixed loop: no read at all
    assert finder.take() == {}


def test_detective_names_the_changed_input_and_the_line():
    import torch_xla

    rt = labkit.setup("xla-cpu")
    lin = torch.nn.Linear(8, 3).to(rt.device)
    finder, mon = SyncFinder(), HealthMonitor(rt, warmup_steps=2)
    mon.finder = finder
    with finder:
        for step, length in enumerate([16, 16, 16, 12, 16, 12]):  # variable-length batches
            ids = torch.randn(4, length, 8, device=rt.device)
            out = lin(ids).sum()
            torch_xla.sync()  # the line that compiles the new graph
            mon.on_step(step, {"ids": ids})
    assert [e["step"] for e in mon.events] == [3]  # length 12 compiles once; the cache serves it again
    ev = mon.events[0]
    assert ev["reason"] == "input 'ids' dim 1 changed (16→12)"
    assert ev["changes"] == [{"input": "input 'ids'", "old": "[4,16,8] float32", "new": "[4,12,8] float32"}]
    assert ev["site"].startswith("test_syncs.py:") and ev["site"].endswith(
        "torch_xla.sync()  # the line that compiles the new graph"
    )
    assert out.device.type == "xla"


class Branchy(Trainer):
    """A step with a data-dependent Python branch: each branch taken is its own graph."""

    def train_step(self, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        if loss > 1.3:  # data-dependent: reads the loss, picks a graph
            loss = loss * 2
        loss.backward()
        return loss


def test_dashboard_names_the_branch_line_and_the_syncs():
    rt = labkit.setup("xla-cpu")
    out = io.StringIO()
    dash = Dashboard(title="branchy", sink=ConsoleSink(out))
    model = mlp(dim=26)
    tr = Branchy(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        rt,
        TrainConfig(epochs=1, log_every=5, eval_every=0),
        torch.utils.data.DataLoader(blobs(n=32 * 20, dim=26), batch_size=32),
        callbacks=[dash],
    )
    tr.fit()
    events = dash.health.events
    assert events, "the loss crosses 1.3 while training: the other branch compiles after warm-up"
    assert all(e["site"].endswith("if loss > 1.3:  # data-dependent: reads the loss, picks a graph") for e in events)
    assert (
        events[0]["via"] == "__bool__"
        and events[0]["changes"] == []
        and "branched on a device value" in events[0]["reason"]
    )
    syncs = {s.code: n for s, n in dash.finder.total.items()}
    assert syncs == {"if loss > 1.3:  # data-dependent: reads the loss, picks a graph": 20}, syncs
    assert (
        "if loss > 1.3" in out.getvalue()
        and "device->host reads in the last 5 steps at test_syncs.py:" in out.getvalue()
    )
    info = labkit.explain(dash, verbose=False)
    assert any("if loss > 1.3" in a and "torch.where" in a for a in info["advice"]), info["advice"]
    assert not dash.finder.active and "__bool__" not in torch.Tensor.__dict__  # fit() ended: unwrapped
