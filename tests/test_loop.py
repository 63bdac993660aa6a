"""The training loop, optimizer_step and clipping on XLA:CPU and plain CPU."""

import copy
import os

import pytest
import torch

import labkit
from labkit import TrainConfig, Trainer
from labkit.optim import optimizer_step
from tests.helpers import blobs, mlp, small_trainer, xla_counts


@pytest.mark.parametrize("kind", ["xla-cpu", "cpu"])
def test_tiny_model_trains(kind):
    rt = labkit.setup(kind)
    ds = blobs()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []

    class Rec:
        def on_log(self, trainer, record):
            seen.append(record)

    cfg = TrainConfig(epochs=4, log_every=8, eval_every=2)
    tr = Trainer(
        model,
        opt,
        rt,
        cfg,
        torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True),
        torch.utils.data.DataLoader(ds, batch_size=64),
        callbacks=[Rec()],
    )
    hist = tr.fit()
    assert tr.step == 32 and len(hist) == 4 and seen == hist
    assert hist[-1]["loss"] < 0.6 * hist[0]["loss"], [h["loss"] for h in hist]
    assert all(h["examples"] == 8 * 32 for h in hist)
    assert [e["epoch"] for e in tr.eval_history] == [1, 3]
    assert tr.eval_history[-1]["val_acc"] > 0.8


def test_max_steps_stops_mid_epoch_and_keeps_position():
    rt = labkit.setup("cpu")
    tr = small_trainer(rt, blobs(), batch_size=32, epochs=3, max_steps=11, log_every=5)
    hist = tr.fit()
    assert tr.step == 11 and tr.epoch == 1 and tr.batch_in_epoch == 3
    assert [h["step"] for h in hist] == [5, 10, 11]  # the final partial interval is logged too


def _one_step(rt, model, x, y, clip=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3)
    for _ in range(2):  # two steps: the second uses the momentum buffers
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        norm = optimizer_step(opt, rt, clip_norm=clip)
        opt.zero_grad()
        rt.sync()
    return norm


@pytest.mark.parametrize("clip", [None, 0.05])
def test_xla_step_matches_eager_cpu(clip):
    """Same initial weights, same batch: XLA:CPU and eager CPU agree to 1e-5 (float32 rounding
    differences from XLA's fused kernels stay far below that)."""
    ds = blobs(n=32)
    x, y = ds.tensors
    cpu_model = mlp()
    xla_model = copy.deepcopy(cpu_model)
    cpu = labkit.setup("cpu")
    n_cpu = _one_step(cpu, cpu_model, x, y, clip)
    xla = labkit.setup("xla-cpu")
    xla_model.to(xla.device)
    n_xla = _one_step(xla, xla_model, x.to(xla.device), y.to(xla.device), clip)
    for (name, a), b in zip(cpu_model.state_dict().items(), xla_model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-5, msg=f"parameter {name}")
    if clip:
        torch.testing.assert_close(n_xla.cpu(), n_cpu, atol=1e-5, rtol=1e-5)


def test_clip_matches_torch_and_never_syncs():
    torch.manual_seed(0)
    a, b = mlp(), mlp()
    b.load_state_dict(a.state_dict())
    x, y = blobs(n=16).tensors
    for m in (a, b):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    norm = optimizer_step(opt, labkit.setup("cpu"), clip_norm=0.01)  # clips, then steps
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.01)
    torch.testing.assert_close(norm, ref)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    # on XLA: clipping adds graph ops but no device->host transfer
    rt = labkit.setup("xla-cpu")
    m = mlp().to(rt.device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(m(x.to(rt.device)), y.to(rt.device)).backward()
    rt.sync()
    _, before = xla_counts()
    optimizer_step(opt, rt, clip_norm=0.01)
    rt.sync()
    assert xla_counts()[1] == before


def test_loop_reads_loss_once_per_interval_on_xla():
    """Transfers from the device: one batched read per log interval, nothing per step."""
    rt = labkit.setup("xla-cpu")
    tr = small_trainer(rt, blobs(n=512), batch_size=32, epochs=1, log_every=4)
    _, t0 = xla_counts()
    tr.fit()
    assert tr.step == 16 and len(tr.history) == 4
    assert xla_counts()[1] - t0 == 4


def test_an_intervals_values_come_back_in_one_copy_per_dtype_off_xla(monkeypatch):
    """Off XLA the log's read stacks one-element tensors and copies them once per device and dtype (on CUDA each
    copy is a wait for the device); larger tensors are copied one by one. Values, shapes and dtypes unchanged."""
    from labkit.accumulate import read, to_host

    losses = [torch.tensor(0.5 * i) for i in range(20)]
    extra = {"correct": torch.tensor(7), "acc": [torch.tensor([0.25]), torch.tensor([0.75])], "hist": torch.arange(3.0)}
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies.append(tuple(t.shape)) or real_cpu(t, *a, **k))
    vals = read({"loss": losses, **extra})
    assert vals == {"loss": sum(0.5 * i for i in range(20)), "correct": 7, "acc": 1.0, "hist": [0.0, 1.0, 2.0]}
    assert sorted(copies) == [(1,), (3,), (22,)], copies  # the int64 count, the vector, the 22 float32 scalars
    mixed = [torch.tensor([[1.5]], dtype=torch.bfloat16), torch.tensor(2.0), torch.ones(2, 3), torch.tensor([4])]
    copies.clear()
    back = to_host(mixed)
    assert len(copies) == 4  # bf16, float32, int64: one each; the 2x3 on its own
    for a, b in zip(mixed, back):
        assert b.device.type == "cpu" and b.shape == a.shape and b.dtype == a.dtype and torch.equal(a, b)


def test_checkpoint_every_zero_saves_at_each_epoch_end(tmp_path):
    from labkit.checkpoint import CheckpointManager

    rt = labkit.setup("cpu")
    model = mlp()
    ck = CheckpointManager(tmp_path, keep=3, rt=rt)
    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        TrainConfig(epochs=2, eval_every=0),
        torch.utils.data.DataLoader(blobs(n=64), batch_size=16),
        checkpoint=ck,
    )
    tr.fit()
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".pt")) == ["ckpt-00000004.pt", "ckpt-00000008.pt"]
    st = ck.restore()
    assert st["step"] == 8 and st["epoch"] == 2 and st["batch_in_epoch"] == 0  # resumes at the next epoch


class _NaNAt(torch.utils.data.Dataset):
    def __init__(self, bad_batch, batch=16):
        self.x, self.y = blobs(n=128).tensors
        self.x = self.x.clone()
        self.x[bad_batch * batch] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


@pytest.mark.parametrize("kind", ["xla-cpu", "cpu"])
def test_nonfinite_loss_stops_with_the_step(kind):
    rt = labkit.setup(kind)
    tr = small_trainer(rt, _NaNAt(bad_batch=5), batch_size=16, epochs=1, log_every=4, eval_every=0)
    _, t0 = xla_counts() if kind == "xla-cpu" else (0, 0)
    with pytest.raises(FloatingPointError, match="at step 6 "):
        tr.fit()
    assert tr.step == 8  # seen at the log of step 8, no per-step read
    if kind == "xla-cpu":
        # the log reads + the one per-step read that locates the step: no per-step host sync
        assert xla_counts()[1] - t0 <= 3
    tr = small_trainer(
        rt, _NaNAt(bad_batch=5), batch_size=16, epochs=1, log_every=4, eval_every=0, continue_on_nonfinite=True
    )
    with pytest.warns(RuntimeWarning, match="at step 6"):
        tr.fit()
    assert tr.step == 8


def test_overriding_on_log_keeps_callbacks_and_eval_uses_loss_fn():
    rt = labkit.setup("cpu")
    seen, mine = [], []

    class Rec:
        def on_log(self, trainer, record):
            seen.append(record["step"])

    class MyTrainer(Trainer):
        def on_log(self, record):
            mine.append(record["step"])

    def double_ce(out, y, reduction="mean"):
        return 2 * torch.nn.functional.cross_entropy(out, y, reduction=reduction)

    model = mlp()
    ds = blobs(n=64)
    tr = MyTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        rt,
        TrainConfig(epochs=1, log_every=2),
        torch.utils.data.DataLoader(ds, batch_size=16),
        torch.utils.data.DataLoader(ds, batch_size=64),
        loss_fn=double_ce,
        callbacks=[Rec()],
    )
    tr.fit()
    assert seen == mine == [2, 4]
    x, y = ds.tensors
    with torch.no_grad():
        ref = 2 * torch.nn.functional.cross_entropy(tr.model(x), y).item()
    assert tr.eval_history[-1]["val_loss"] == pytest.approx(ref, rel=1e-5)


def test_callbacks_request_checkpoint_and_stop(tmp_path):
    from labkit.checkpoint import CheckpointManager

    rt = labkit.setup("cpu")

    class Controls:
        def on_step_end(self, trainer, batch):
            if trainer.step == 3:
                trainer.request_checkpoint()
            if trainer.step == 5:
                trainer.request_stop()

    model = mlp()
    ck = CheckpointManager(tmp_path, rt=rt)
    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        TrainConfig(epochs=3, checkpoint_every=100, eval_every=0),
        torch.utils.data.DataLoader(blobs(), batch_size=16),
        checkpoint=ck,
        callbacks=[Controls()],
    )
    tr.fit()
    assert tr.step == 5 and ck.latest()["step"] == 3


def test_bad_learning_rate_and_empty_loader_are_named():
    rt = labkit.setup("cpu")
    model = mlp()
    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=float("nan")),
        rt,
        TrainConfig(),
        torch.utils.data.DataLoader(blobs(n=64), batch_size=16),
    )
    with pytest.raises(ValueError, match="lr=nan"):
        tr.fit()
    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        TrainConfig(),
        torch.utils.data.DataLoader(blobs(n=10), batch_size=16, drop_last=True),
    )
    with pytest.raises(ValueError, match="no batches"):
        tr.fit()


@pytest.mark.timing
def test_rate_since_epoch_start_when_the_closure_runs_in_the_next_epoch():
    """On XLA the interval's closure runs at the next sync; when the loop began the next epoch first, the
    rate since epoch start is still the finished epoch's (it once divided by the new epoch's few microseconds)."""
    import time

    from labkit.steplog import StepLog

    rt = labkit.setup("xla-cpu")
    model = mlp().to(rt.device)
    x = torch.randn(64, 16).to(rt.device)
    model(x).sum().cpu()  # compiled now, so that the sync below is quick
    t0 = time.perf_counter()
    log = StepLog(rt, TrainConfig(log_every=1))
    time.sleep(0.5)  # the epoch's work
    log.add(model(x).sum(), rows=64)
    records = []
    log.close(1, 0, torch.optim.SGD(model.parameters(), lr=0.1), records.append)
    assert records == []  # not read yet: XLA runs the closure after the step's graph
    log.begin_epoch()
    rt.sync()
    assert len(records) == 1
    spent = time.perf_counter() - t0
    assert 64 / spent <= records[0]["global_rate"] <= 64 / 0.5, (records[0], spent)


@pytest.mark.timing
@pytest.mark.parametrize("log_every", [4, 3])  # 3: an interval spans each epoch boundary
def test_rates_across_epoch_boundaries(log_every):
    """Every example is counted in some interval (one that spans an epoch boundary once dropped the first
    epoch's part: its rate came out halved), and the rate since epoch start, a running mean of the interval
    rates, never starts an epoch above them (it missed the host work after each reading: 991/s against 775/s)."""
    import time

    class Slow:  # host work after each step's reading, like a dashboard drawing
        def on_step_end(self, trainer, batch):
            time.sleep(0.02)

    rt = labkit.setup("cpu")
    tr = small_trainer(rt, blobs(n=8 * 32), epochs=3, log_every=log_every, callbacks=[Slow()])
    tr.fit()
    recs = tr.history
    assert sum(r["examples"] for r in recs) == 3 * 8 * 32, [r["examples"] for r in recs]
    later = [r for r in recs if r["epoch"] > 0]  # the fit's first interval is timed from fit() itself
    slowest, fastest = min(r["examples_per_s"] for r in later), max(r["examples_per_s"] for r in later)
    for r in later:
        assert slowest * 0.95 <= r["global_rate"] <= fastest * 1.05, (r, slowest, fastest)
