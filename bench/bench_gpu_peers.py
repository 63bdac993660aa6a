"""labkit beside a hand-written loop, Lightning Fabric and HF Accelerate on torch's own CUDA (or the plain CPU).

    python bench/bench_gpu_peers.py --device cuda --model resnet50 --memory-format channels_last [--segments 3]
        [--steps 30] [--batch 64] [--size 224] [--frameworks hand,labkit,fabric,accel]
    python bench/bench_gpu_peers.py --device cpu --model mlp --batch 64       # the host tax, on this machine

Each framework runs in its own process (one framework's allocator, cuDNN plans and patches never touch another's),
one after another: a warm-up of --warmup steps (cuDNN's autotuner, the allocator), then --segments timed segments of
--steps steps, each ended by waiting for the device. Every loop trains the same model from the same seed on the same
pre-made batches (an in-memory dataset, a pinned DataLoader), SGD + momentum, bf16 autocast on CUDA (fp32 on the
CPU), the loss read every 20 steps, the model and the batches in --memory-format (the hand loop, Fabric and Accelerate
convert them by hand, as their users would; labkit by TrainConfig.memory_format). Prints each framework's median ms a
step and images/s, and RATIO lines against the hand loop (goal: labkit <= 1.02x) and against each peer (goal <= 1).
A framework that is not installed is skipped with the line that installs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

FRAMEWORKS = ("hand", "labkit", "fabric", "accel")
NEEDS = {"fabric": "lightning", "accel": "accelerate"}
LOG_EVERY = 20
MARK = "@@ "


def make_model(name):
    import torch

    torch.manual_seed(0)
    if name == "mlp":
        return torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )
    import torchvision

    return getattr(torchvision.models, name)(num_classes=10)


def make_data(a, n_batches, pin):
    import torch

    size = 32 if a.model == "mlp" else a.size
    g = torch.Generator().manual_seed(0)
    n = a.batch * min(n_batches, 8)  # 8 batches cycled: the feed is not what is measured here
    ds = torch.utils.data.TensorDataset(torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,)))
    return torch.utils.data.DataLoader(ds, batch_size=a.batch, drop_last=True, pin_memory=pin)


def cycled(loader, steps):
    while True:
        for b in loader:
            yield b
            steps -= 1
            if steps == 0:
                return


class Loop:
    """Steps run so far over every segment (the loss is read every LOG_EVERY of them, on every loop alike)."""

    seen = 0

    def read(self, loss):
        self.seen += 1
        if self.seen % LOG_EVERY == 0:
            self.last = loss.item()


class Hand(Loop):
    def __init__(self, a):
        import torch

        self.dev, self.fmt = torch.device(a.device), _fmt(a)
        self.model = make_model(a.model).to(self.dev, memory_format=self.fmt)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.data, self.bf16 = make_data(a, a.steps, self.dev.type == "cuda"), self.dev.type == "cuda"

    def run(self, n):
        import torch
        import torch.nn.functional as F

        for x, y in cycled(self.data, n):
            x = x.to(self.dev, non_blocking=True).contiguous(memory_format=self.fmt)
            y = y.to(self.dev, non_blocking=True)
            with torch.autocast(self.dev.type, torch.bfloat16, enabled=self.bf16):
                loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.read(loss)


class Labkit(Loop):
    def __init__(self, a):
        import torch

        import labkit

        rt = labkit.setup(a.device)
        model = make_model(a.model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        fmt = {"channels_last": "channels_last", "nchw": "contiguous"}[a.memory_format]
        cfg = labkit.TrainConfig(epochs=10**6, log_every=LOG_EVERY, eval_every=0, compile="off", memory_format=fmt)
        prec = labkit.precision.choose(rt, "bf16" if a.device == "cuda" else "fp32")
        self.tr = labkit.Trainer(model, opt, rt, cfg, make_data(a, a.steps, False), precision=prec)

    def run(self, n):
        self.tr.cfg.max_steps = self.tr.step + n
        self.tr.fit()


class Fabric(Hand):
    def __init__(self, a):
        import torch
        from lightning.fabric import Fabric as F_

        self.fabric = F_(accelerator=a.device, devices=1, precision="bf16-mixed" if a.device == "cuda" else "32-true")
        self.fmt = _fmt(a)
        model = make_model(a.model).to(memory_format=self.fmt)
        self.model, self.opt = self.fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        self.data = self.fabric.setup_dataloaders(make_data(a, a.steps, a.device == "cuda"))

    def run(self, n):
        import torch.nn.functional as F

        for x, y in cycled(self.data, n):
            loss = F.cross_entropy(self.model(x.contiguous(memory_format=self.fmt)), y)
            self.fabric.backward(loss)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.read(loss)


class Accel(Fabric):
    def __init__(self, a):
        import torch
        from accelerate import Accelerator

        self.fabric = Accelerator(mixed_precision="bf16" if a.device == "cuda" else "no", cpu=a.device == "cpu")
        self.fmt = _fmt(a)
        model = make_model(a.model).to(memory_format=self.fmt)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.model, self.opt, self.data = self.fabric.prepare(model, opt, make_data(a, a.steps, a.device == "cuda"))


def _fmt(a):
    import torch

    return torch.channels_last if a.memory_format == "channels_last" else torch.contiguous_format


def child(a):
    import torch

    loop = {"hand": Hand, "labkit": Labkit, "fabric": Fabric, "accel": Accel}[a.child](a)

    def wait():
        if a.device == "cuda":
            torch.cuda.synchronize()

    t = time.perf_counter()
    loop.run(a.warmup)
    wait()
    warm, times = time.perf_counter() - t, []
    for _ in range(a.segments):
        t = time.perf_counter()
        loop.run(a.steps)
        wait()
        times.append((time.perf_counter() - t) / a.steps)
    print(MARK + json.dumps({"warmup_s": warm, "step_s": times}), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model", default="resnet50", help="mlp or a torchvision model name")
    p.add_argument("--memory-format", default="channels_last", choices=("channels_last", "nchw"))
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--segments", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a)
    label = f"{a.model} {a.memory_format if a.model != 'mlp' else ''}".strip()
    print(
        f"== {label}, batch {a.batch}, {a.device}: {a.warmup} warm-up steps, {a.segments} x {a.steps} timed", flush=True
    )
    res = {}
    for fw in a.frameworks.split(","):
        if fw in NEEDS and importlib.util.find_spec(NEEDS[fw]) is None:
            print(f"skipped {fw}: not installed (pip install {NEEDS[fw]})")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]), "--child", fw]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(MARK)]
        if out.returncode or not lines:
            print(f"  {fw} FAILED (exit {out.returncode}):\n{out.stderr[-2000:]}", flush=True)
            continue
        res[fw] = json.loads(lines[-1][len(MARK) :])
        s = res[fw]["step_s"]
        med = statistics.median(s)
        print(
            f"  {fw:<7} {med * 1e3:8.2f} ms a step (segments {min(s) * 1e3:.2f}-{max(s) * 1e3:.2f}), "
            f"{a.batch / med:9.0f} images/s, warm-up {res[fw]['warmup_s']:.1f} s",
            flush=True,
        )
    med = {fw: statistics.median(r["step_s"]) for fw, r in res.items()}
    for fw in ("hand", "fabric", "accel"):
        if "labkit" in med and fw in med:
            goal = "1.02" if fw == "hand" else "1"
            print(f"RATIO {label} labkit/{fw} step time = {med['labkit'] / med[fw]:.3f} (goal <= {goal}, {a.device})")


if __name__ == "__main__":
    sys.exit(main())
