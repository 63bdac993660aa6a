"""Step time of labkit's Trainer vs a hand-written loop, same model, same run, on the default backend.

    PJRT_DEVICE=CPU .venv/bin/python bench/bench_loop.py [--model resnet50] [--steps 12] [--trials 3]
        [--batch 8] [--size 32] [--precision fp32|auto|bf16|fp16] [--backend tpu|cuda|xla-cpu|cpu] [--compile off|on]

Both loops: torchvision model (10 classes), SGD+momentum, batches of BATCHx3xSIZExSIZE from an in-memory
dataset, loss read every 20 steps. On XLA the hand-written loop is pytorch/xla's examples' (MpDeviceLoader,
xm.optimizer_step, the loss read in a step closure, torch_xla.sync()); on CUDA and the CPU it is plain PyTorch
(a pinned DataLoader, non_blocking copies, torch.autocast at the same dtype labkit chose, a GradScaler under
fp16, loss.item()). --compile sets both sides alike: "off" (the default) compares eager with eager
(TrainConfig(compile="off")), "on" compiled with compiled (compile="on" against the hand loop with
torch.compile(model, dynamic=False) and its optimizer step in a compiled function, as bench_compile.py's); never
one compiled side against one eager side. On XLA only "off" applies (the lazy trace is both loops' compiler). Trials alternate (hand, labkit, labkit, hand, ...) after each loop's own warm-up (its
compiles), so slow drifts of a noisy machine hit both. Each timed run ends by waiting for the device. Prints
per-trial times and the ratio labkit / hand-written (goal <= 1.01).
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


def make_data(n, bs, size, pin=False):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=bs, drop_last=True, pin_memory=pin)


def make_model(name):
    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=10)


class HandLoop:
    """What a careful torch_xla user writes by hand (pytorch/xla examples style)."""

    def __init__(self, model_name, rt, data, precision):
        assert precision.dtype is None, "the hand-written XLA loop is fp32 (pass --precision fp32)"
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


class EagerHandLoop:
    """What a careful PyTorch user writes by hand for CUDA or the CPU (eager: each op runs as it is called)."""

    def __init__(self, model_name, rt, data, precision):
        self.device, self.dtype = rt.device, precision.dtype  # the same autocast dtype labkit chose (or fp32)
        self.model = make_model(model_name).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None
        self.data = data
        self.losses = []
        self.optimizer_step = self.opt.step

    def run(self, steps):
        it = iter(self.data)
        for i in range(steps):
            x, y = next(it)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            self.opt.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                loss = F.cross_entropy(self.model(x), y)
            if self.scaler is None:
                loss.backward()
                self.optimizer_step()
            else:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            if (i + 1) % 20 == 0:
                self.losses.append(loss.item())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class CompiledHandLoop(EagerHandLoop):
    """The same loop with torch.compile: the model (forward and backward), and the optimizer step in a compiled
    function (the PyTorch tutorials' compiled optimizer); under fp16 the GradScaler's step stays eager."""

    def __init__(self, model_name, rt, data, precision, backend="inductor"):
        super().__init__(model_name, rt, data, precision)
        self.model = torch.compile(self.model, dynamic=False, backend=backend)
        opt = self.opt

        @torch.compile(dynamic=False, backend=backend)
        def opt_step():
            opt.step()

        if self.scaler is None:
            self.optimizer_step = opt_step


class LabkitLoop:
    def __init__(self, model_name, rt, data, precision, compile="off", backend="inductor"):
        model = make_model(model_name)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        cfg = labkit.TrainConfig(epochs=10**6, log_every=20, eval_every=0, compile=compile, compile_backend=backend)
        self.tr = labkit.Trainer(model, opt, rt, cfg, data, precision=precision)

    def run(self, steps):
        self.tr.cfg.max_steps = self.tr.step + steps
        self.tr.batch_in_epoch = 0  # start the (synthetic) epoch afresh: nothing to skip
        self.tr.fit()
        self.tr.rt.wait()  # the device has finished what the steps queued


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
    ap.add_argument("--size", type=int, default=32, help="image side in pixels")
    ap.add_argument("--precision", default="fp32", help="labkit.precision.choose's want: fp32 | auto | bf16 | fp16")
    ap.add_argument("--backend", default=None, help="labkit.setup's: tpu | cuda | xla-cpu | cpu (default: detected)")
    ap.add_argument(
        "--compile", default="off", choices=("off", "on"), help="both loops eager (off) or both torch.compile'd (on)"
    )
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile's backend with --compile on")
    a = ap.parse_args()
    rt = labkit.setup(a.backend)
    precision = labkit.precision.choose(rt, a.precision)
    data = make_data(a.batch * (a.steps + 4), a.batch, a.size, pin=rt.device.type == "cuda")
    if rt.is_xla and a.compile == "on":
        ap.error("--compile on: not on XLA (torch_xla's lazy trace already compiles both loops' steps); use off")
    # the ways a careful user writes a loop: pytorch/xla's examples on XLA, plain PyTorch elsewhere (eager or compiled)
    if rt.is_xla:
        hand = HandLoop(a.model, rt, data, precision)
    elif a.compile == "on":
        hand = CompiledHandLoop(a.model, rt, data, precision, a.compile_backend)
    else:
        hand = EagerHandLoop(a.model, rt, data, precision)
    loops = {
        "hand-written": hand,
        "labkit": LabkitLoop(a.model, rt, data, precision, compile=a.compile, backend=a.compile_backend),
    }
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
        f"{rt.kind} ({rt.chip_name()}) {a.model} batch {a.batch} at {a.size} px, {precision.name}, compile "
        f"{a.compile} on both sides: hand-written {med['hand-written'] * 1000:.0f} ms/step, "
        f"labkit {med['labkit'] * 1000:.0f} ms/step"
    )
    print(
        f"RATIO labkit/hand-written step time (compile {a.compile}) = {med['labkit'] / med['hand-written']:.3f} (goal <= 1.01)"
    )


if __name__ == "__main__":
    main()
