"""Step time of labkit's Trainer vs a hand-written torch_xla loop, same model, same run.

    PJRT_DEVICE=CPU .venv/bin/python bench/bench_loop.py [--model resnet50] [--steps 12] [--trials 3]

Both loops: torchvision model (10 classes), SGD+momentum, batches of 8x3x32x32 from an in-memory
dataset through a background device loader (torch_xla's MpDeviceLoader by hand, labkit.DeviceLoader), loss read every 20 steps in a step closure. Trials
alternate (hand, labkit, hand, labkit, ...) after each loop's own warm-up (its compiles), so slow
drifts of this noisy machine hit both. Prints per-trial times and the ratio labkit / hand-written
(goal <= 1.01).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch.nn.functional as F
import torchvision

import labkit


def make_data(n, bs):
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=bs, drop_last=True)


def make_model(name):
    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=10)


class HandLoop:
    """What a careful torch_xla user writes by hand (pytorch/xla examples style)."""

    def __init__(self, model_name, rt, data):
        import torch_xla.distributed.parallel_loader as pl

        self.rt = rt
        self.model = make_model(model_name).to(rt.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loader = pl.MpDeviceLoader(data, rt.device)
        self.losses = []

    def run(self, steps):
        import torch_xla
        import torch_xla.core.xla_model as xm

        it = iter(self.loader)
        for i in range(steps):
            x, y = next(it)
            self.opt.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            xm.optimizer_step(self.opt)
            if (i + 1) % 20 == 0:
                xm.add_step_closure(lambda v: self.losses.append(v.item()), args=(loss,))
            torch_xla.sync()
        xm.wait_device_ops()


class LabkitLoop:
    def __init__(self, model_name, rt, data):
        model = make_model(model_name)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        cfg = labkit.TrainConfig(epochs=10**6, log_every=20, eval_every=0)
        self.tr = labkit.Trainer(model, opt, rt, cfg, data)

    def run(self, steps):
        import torch_xla.core.xla_model as xm

        self.tr.cfg.max_steps = self.tr.step + steps
        self.tr.batch_in_epoch = 0  # start the (synthetic) epoch afresh: nothing to skip
        self.tr.fit()
        xm.wait_device_ops()


def timed(loop, steps):
    t = time.perf_counter()
    loop.run(steps)
    return (time.perf_counter() - t) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    rt = labkit.setup()
    data = make_data(a.batch * (a.steps + 4), a.batch)
    loops = {"hand-written": HandLoop(a.model, rt, data), "labkit": LabkitLoop(a.model, rt, data)}
    for name, loop in loops.items():
        t = time.perf_counter()
        loop.run(3)  # compiles: step 0, step 1 (optimizer state appears), steady state
        print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)
    times = {k: [] for k in loops}
    for trial in range(a.trials):
        for name, loop in loops.items() if trial % 2 == 0 else reversed(loops.items()):
            times[name].append(timed(loop, a.steps))
        print(f"trial {trial}: " + ", ".join(f"{k} {v[-1] * 1000:.0f} ms/step" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{rt.kind} {a.model} batch {a.batch}: hand-written {med['hand-written'] * 1000:.0f} ms/step, "
        f"labkit {med['labkit'] * 1000:.0f} ms/step"
    )
    print(f"RATIO labkit/hand-written step time = {med['labkit'] / med['hand-written']:.3f} (goal <= 1.01)")


if __name__ == "__main__":
    main()
