"""Tiny data and models shared by tests."""

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


def xla_counts():
    """(compiles, device->host transfers) so far in this process."""
    import torch_xla.debug.metrics as met

    c = met.metric_data("CompileTime")
    t = met.metric_data("TransferFromDeviceTime")
    return (c[0] if c else 0), (t[0] if t else 0)
