"""Run in a subprocess (SPMD must be enabled before any XLA tensor exists):
data-parallel training of a tiny model over 4 virtual CPU devices."""

import os
import sys

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "4"

import torch  # noqa: E402

import labkit  # noqa: E402
from labkit import _xla  # noqa: E402
from tests.helpers import blobs, mlp  # noqa: E402

rt = labkit.setup("xla-cpu", spmd=True)
assert rt.spmd and rt.local_device_count == 4 and rt.world_size == 1, rt
model = mlp()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
cfg = labkit.TrainConfig(epochs=3, log_every=8, eval_every=0)
tr = labkit.Trainer(model, opt, rt, cfg, torch.utils.data.DataLoader(blobs(), batch_size=32, shuffle=True))
first = None
for batch in tr.train_loader:
    spec = _xla.sharding_spec(batch[0])
    first = spec
    break
hist = tr.fit()
print("SHARDING", first)
print("LOSS", hist[0]["loss"], hist[-1]["loss"])
sys.exit(0 if hist[-1]["loss"] < 0.7 * hist[0]["loss"] and "devices=[4" in first else 1)
