"""Tiny data and models shared by tests, and the environment of a child process."""

import os

import torch
import torch.nn as nn


def blobs(n=256, dim=16, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ w).argmax(1))


def mlp(dim=16, classes=4, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, classes))


class FakeClock:
    """A host clock for the code's timing seams (e.g. a Trainer's `log.clock`, the feed meter's): its time moves
    only when a test says so, by `sleep(seconds)` and by `tick` at every read. A verdict computed from it is the
    same on any machine, however loaded."""

    def __init__(self, tick=0.0):
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def child_env(root, **extra) -> dict:
    """This process's environment for a child Python that imports labkit and tests from `root` (a checkout or a
    copy of one), plus `extra` variables. The outer pytest's PYTEST_ADDOPTS is left out: a child pytest would read
    the outer run's options (its -x, -k, plugins) as its own."""
    env = dict(os.environ, PYTHONPATH=str(root), **extra)
    env.pop("PYTEST_ADDOPTS", None)
    return env


def xla_counts():
    """(compiles, device->host transfers) so far in this process."""
    import torch_xla.debug.metrics as met

    c = met.metric_data("CompileTime")
    t = met.metric_data("TransferFromDeviceTime")
    return (c[0] if c else 0), (t[0] if t else 0)


def small_trainer(rt, data=None, *, batch_size=32, lr=0.1, model=None, eval_data=None, trainer_cls=None, **kwargs):
    """The small Trainer most loop, dashboard and checkpoint tests need: an MLP (or `model`), SGD at `lr`,
    DataLoaders over `data` (default blobs()) and `eval_data`. TrainConfig fields go in kwargs (epochs=2,
    log_every=4, ...); the rest (callbacks, checkpoint, precision, ...) go to the Trainer."""
    import dataclasses

    import labkit

    fields = {f.name for f in dataclasses.fields(labkit.TrainConfig)}
    cfg = labkit.TrainConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in fields})
    model = model if model is not None else mlp()
    loader = torch.utils.data.DataLoader(data if data is not None else blobs(), batch_size=batch_size)
    evals = torch.utils.data.DataLoader(eval_data, batch_size=batch_size) if eval_data is not None else None
    cls = trainer_cls or labkit.Trainer
    return cls(model, torch.optim.SGD(model.parameters(), lr=lr), rt, cfg, loader, evals, **kwargs)
