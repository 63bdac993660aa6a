"""The training loop, optimizer_step and clipping on XLA:CPU and plain CPU."""
import copy

import pytest
import torch

import labkit
from labkit import TrainConfig, Trainer
from labkit.optim import clip_grad_norm, optimizer_step
from tests.helpers import blobs, mlp, xla_counts


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
    tr = Trainer(model, opt, rt, cfg, torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True),
                 torch.utils.data.DataLoader(ds, batch_size=64), callbacks=[Rec()])
    hist = tr.fit()
    assert tr.step == 32 and len(hist) == 4 and seen == hist
    assert hist[-1]["loss"] < 0.6 * hist[0]["loss"], [h["loss"] for h in hist]
    assert all(h["examples"] == 8 * 32 for h in hist)
    assert [e["epoch"] for e in tr.eval_history] == [1, 3]
    assert tr.eval_history[-1]["val_acc"] > 0.8


def test_max_steps_stops_mid_epoch_and_keeps_position():
    rt = labkit.setup("cpu")
    model = mlp()
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt, TrainConfig(epochs=3, max_steps=11, log_every=5),
                 torch.utils.data.DataLoader(blobs(), batch_size=32))
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
    norm = clip_grad_norm(opt, 0.01)
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
    model = mlp()
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt,
                 TrainConfig(epochs=1, log_every=4), torch.utils.data.DataLoader(blobs(n=512), batch_size=32))
    _, t0 = xla_counts()
    tr.fit()
    assert tr.step == 16 and len(tr.history) == 4
    assert xla_counts()[1] - t0 == 4
