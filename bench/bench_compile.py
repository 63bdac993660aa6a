"""The compiled step, measured: labkit's Trainer compiled ÷ eager, and ÷ a hand-written torch.compile loop.

    .venv/bin/python bench/bench_compile.py [--models gpt,resnet] [--size small|gpt2] [--steps 10] [--trials 3]
        [--precision fp32|auto|bf16] [--device cpu|cuda] [--compile-backend inductor] [--batch N]

Three loops per model, side by side in one process, same initial weights, batches and optimizer:
- labkit eager: `Trainer(..., TrainConfig(compile="off"))` (LMTrainer for the GPT);
- labkit compiled: the same with compile="on" (labkit.runtime.step: the model and the optimizer step compiled);
- hand-written: what a careful user writes with torch.compile (torch.compile(model, dynamic=False), the
  optimizer step in a compiled function, autocast at labkit's dtype, the loss read every 20 steps).
Each loop first runs 3 steps (its compiles: the warm-up time printed is mostly compiling); then the trials
alternate their order (so a noisy machine's drifts hit all three), each timed run ending with a wait for the device.
Inductor's on-disk cache starts empty (a fresh TORCHINDUCTOR_CACHE_DIR): labkit compiles first and cold, the
hand-written loop then finds most kernels in the cache, so its warm-up is not a cold compile time.

--size small (the CPU default): a GPT of 2 layers, 128 wide, T=128, batch 8, and ResNet-18 at 32 px, batch 8.
--size gpt2 (for a GPU: `--device cuda --size gpt2`): the GPT at GPT-2-small shape (12 layers, 12 heads, 768
wide, T=1024, a 50,304-token vocabulary: 124 M parameters), batch 16, bf16, with its MFU (FLOPs per token from
GPT.flops_per_token, the chip's peak from labkit.dashboard.flops), and ResNet-50 at 224 px, batch 128, images/s.
Prints per-trial times, RATIO lines (compiled/eager, and labkit compiled/hand-written: goal <= 1.01), a HOST line
(the Python calls per step of labkit's compiled loop and the hand-written one, counted by cProfile: what labkit adds
on the host, exactly, where a timing on a shared machine spreads by more than the goal's 1 %) and a PAYBACK line: the compile's seconds (labkit's warm-up minus 3 compiled steps) over the per-step saving (eager minus compiled),
in steps: the run length above which TrainConfig(compile="auto") compiles on that device (labkit.runtime.step).
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a cold compile each run, in a folder removed at exit
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_compile_inductor_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torch.nn.functional as F
import torchvision

import labkit
from labkit.dashboard import flops
from labkit.lm import LMTrainer
from labkit.models import gpt
from labkit.models.gpt import GPT, GPTConfig
from labkit.runtime.layout import has_conv2d

SIZES = {
    # model -> (model shape, batch)
    "small": {
        "gpt": (dict(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=128), 8),
        "resnet": ("resnet18", 32, 8),
    },
    "gpt2": {
        "gpt": (dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), 16),
        "resnet": ("resnet50", 224, 128),
    },
}


class Workload:
    """One model family: builds the model, its optimizer, its data, and says what a hand loop's loss is."""

    def __init__(self, name, size, batch, steps, rt):
        self.name, self.rt = name, rt
        spec = SIZES[size][name]
        if name == "gpt":
            self.shape, self.batch = spec[0], batch or spec[1]
            T, V = self.shape["block_size"], self.shape["vocab_size"]
            g = torch.Generator().manual_seed(0)
            tok = torch.randint(0, V, (self.batch * (max(steps, 11) + 4), T + 1), generator=g)
            ds = torch.utils.data.TensorDataset(tok[:, :-1], tok[:, 1:])
            self.label = f"GPT {self.shape['n_layer']}x{self.shape['n_embd']} T={T} batch {self.batch}"
        else:
            self.arch, self.size, self.batch = spec[0], spec[1], batch or spec[2]
            g = torch.Generator().manual_seed(0)
            n = self.batch * (max(steps, 11) + 4)  # the HOST count runs 11 steps
            ds = torch.utils.data.TensorDataset(
                torch.randn(n, 3, self.size, self.size, generator=g), torch.randint(0, 10, (n,), generator=g)
            )
            self.label = f"{self.arch} {self.size} px batch {self.batch}"
        pin = rt.device.type == "cuda"
        self.data = torch.utils.data.DataLoader(ds, batch_size=self.batch, drop_last=True, pin_memory=pin)

    def model(self):
        torch.manual_seed(0)
        if self.name == "gpt":
            return GPT(GPTConfig(**self.shape))
        return getattr(torchvision.models, self.arch)(num_classes=10)

    def optimizer(self, model):
        if self.name == "gpt":
            return gpt.adamw(model, 3e-4, rt=self.rt)
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def loss(self, model, x, y):
        if self.name == "gpt":
            return model(x, y)[1]
        return F.cross_entropy(model(x), y)

    def units(self):
        """(what one row of a batch is, how many per row): tokens for the GPT, images for a ResNet."""
        return ("tokens", self.shape["block_size"]) if self.name == "gpt" else ("images", 1)


class LabkitLoop:
    def __init__(self, work, rt, precision, compile, backend):
        model = work.model()
        opt = work.optimizer(model)
        cfg = labkit.TrainConfig(epochs=10**6, log_every=20, eval_every=0, compile=compile, compile_backend=backend)
        cls = LMTrainer if work.name == "gpt" else labkit.Trainer
        self.tr = cls(model, opt, rt, cfg, work.data, precision=precision)
        self.flops_model = model

    def run(self, steps):
        self.tr.cfg.max_steps = self.tr.step + steps
        self.tr.batch_in_epoch = 0  # start the (synthetic) epoch afresh: nothing to skip
        self.tr.fit()
        self.tr.rt.wait()  # the device has finished what the steps queued


class HandCompiledLoop:
    """What a careful PyTorch user writes with torch.compile (the PyTorch tutorials' compiled model and optimizer).
    On CUDA a model with 2-D convolutions and its batches in channels_last, as that user would for tensor cores
    (ResNet-50 on an H200: 29.5 ms a step against 54.6 in NCHW, eager): the best the hand loop gets, not a straw man."""

    def __init__(self, work, rt, precision, backend):
        self.work, self.rt, self.dtype = work, rt, precision.dtype
        self.device = rt.device
        model = work.model()
        cl = self.device.type == "cuda" and has_conv2d(model)
        self.fmt = torch.channels_last if cl else torch.contiguous_format
        self.model = torch.compile(model.to(self.device, memory_format=self.fmt), dynamic=False, backend=backend)
        self.opt = work.optimizer(self.model)
        opt = self.opt

        @torch.compile(dynamic=False, backend=backend)
        def opt_step():
            opt.step()

        self.opt_step = opt_step
        self.losses = []

    def run(self, steps):
        it = iter(self.work.data)
        for i in range(steps):
            x, y = next(it)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            x = x.contiguous(memory_format=self.fmt) if x.dim() == 4 else x
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                loss = self.work.loss(self.model, x, y)
            loss.backward()
            self.opt_step()
            self.opt.zero_grad(set_to_none=True)
            if (i + 1) % 20 == 0:
                self.losses.append(loss.item())
        self.rt.wait()


def host_calls(loop, steps) -> int:
    """Python function calls the host makes to run `steps` steps (cProfile's count: exact, where a timing on a
    noisy machine cannot resolve a few per cent)."""
    prof = cProfile.Profile()
    prof.enable()
    loop.run(steps)
    prof.disable()
    return pstats.Stats(prof).total_calls


def timed(loop, steps):
    t = time.perf_counter()
    loop.run(steps)
    return (time.perf_counter() - t) / steps


def bench(work, rt, precision, a):
    loops = {
        "eager": LabkitLoop(work, rt, precision, "off", a.compile_backend),
        "labkit": LabkitLoop(work, rt, precision, "on", a.compile_backend),
        "hand": HandCompiledLoop(work, rt, precision, a.compile_backend),
    }
    warm = {}
    for name, loop in loops.items():
        t = time.perf_counter()
        loop.run(3)  # compiles: step 1 (the model's graph, the optimizer's), then steady state
        warm[name] = time.perf_counter() - t
        print(f"{work.name}: warm-up {name} (3 steps, compiles included): {warm[name]:.1f} s", flush=True)
    times = {k: [] for k in loops}
    names = list(loops)
    for trial in range(a.trials):
        order = names[trial % len(names) :] + names[: trial % len(names)]  # rotate who goes first
        for name in order:
            times[name].append(timed(loops[name], a.steps))
        print(
            f"{work.name} trial {trial}: " + ", ".join(f"{k} {v[-1] * 1000:.1f} ms/step" for k, v in times.items()),
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    unit, per_row = work.units()
    rate = work.batch * per_row / med["labkit"]
    print(
        f"{rt.kind} ({rt.chip_name()}) {work.label}, {precision.name}, backend {a.compile_backend}: "
        f"eager {med['eager'] * 1000:.1f} ms/step, labkit compiled {med['labkit'] * 1000:.1f}, "
        f"hand-written compiled {med['hand'] * 1000:.1f}; {rate:,.0f} {unit}/s compiled; compile (warm-up minus 3 "
        f"steps) labkit {warm['labkit'] - 3 * med['labkit']:.1f} s, hand {warm['hand'] - 3 * med['hand']:.1f} s "
        "(hand's mostly cache hits)"
    )
    if work.name == "gpt":
        model = loops["labkit"].tr.module
        step_flops = model.flops_per_token(work.shape["block_size"]) * work.batch * work.shape["block_size"]
        peak, source = flops.peak_flops(rt, precision.name)
        mfu = flops.mfu(step_flops, med["labkit"], peak)
        total, counted = model.num_params(non_embedding=False), model.num_params()
        print(
            f"{work.name}: {total / 1e6:.1f} M parameters ({counted / 1e6:.1f} M in the FLOP count: no position table)"
        )
        print(f"MFU {work.name} labkit compiled = {mfu * 100:.1f} % of {source}" if mfu else f"MFU: no peak ({source})")
    per_step, per_run = {}, {}
    for name in ("labkit", "hand"):  # 1 step and 11: the difference is 10 steps' calls, the rest each run's own
        one, eleven = host_calls(loops[name], 1), host_calls(loops[name], 11)
        per_step[name] = (eleven - one) / 10
        per_run[name] = one - per_step[name]
    print(
        f"HOST {work.name}: Python calls per step labkit compiled {per_step['labkit']:,.0f}, hand-written "
        f"{per_step['hand']:,.0f} ({per_step['labkit'] / per_step['hand']:.3f}x); per run of the loop (labkit: one "
        f"fit() with its set-up and end) {per_run['labkit']:,.0f} vs {per_run['hand']:,.0f}"
    )
    compile_s, saving = warm["labkit"] - 3 * med["labkit"], med["eager"] - med["labkit"]
    payback = compile_s / saving if saving > 0 else float("inf")
    print(
        f"PAYBACK {work.name} {rt.kind}: compile {compile_s:.1f} s / saving {saving * 1000:.1f} ms/step = "
        + (f"{payback:,.0f} steps" if saving > 0 else "never (compiled is not faster)")
        + " (labkit.runtime.step.PAYBACK_STEPS holds one figure per device kind)"
    )
    print(f"RATIO {work.name} compiled/eager step time = {med['labkit'] / med['eager']:.3f}")
    print(
        f"RATIO {work.name} labkit compiled/hand-written compiled step time = {med['labkit'] / med['hand']:.3f} (goal <= 1.01)"
    )
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,resnet", help="comma-separated: gpt, resnet")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--batch", type=int, default=None, help="rows per batch (default: the size's)")
    ap.add_argument("--precision", default=None, help="labkit.precision.choose's want (default: fp32 small, bf16 gpt2)")
    ap.add_argument(
        "--device",
        "--backend",
        dest="device",
        default=None,
        help="labkit.setup's: cuda | cpu (default: cuda if there is one, else cpu)",
    )
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile's backend")
    ap.add_argument(
        "--sdpa",
        default="default",
        choices=sorted(SDPA),
        help="the attention kernel scaled_dot_product_attention tries first (default: torch's own order)",
    )
    a = ap.parse_args()
    # never XLA by default: its lazy trace is its compiler, and TrainConfig.compile="on" is refused there
    rt = labkit.setup(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = labkit.precision.choose(rt, a.precision or ("bf16" if a.size == "gpt2" else "fp32"))
    print(f"torch {torch.__version__}, {rt.kind} ({rt.chip_name()}), {precision}, sdpa {a.sdpa}", flush=True)
    with sdpa_first(a.sdpa):
        for name in a.models.split(","):
            bench(Workload(name.strip(), a.size, a.batch, a.steps, rt), rt, precision, a)


# --sdpa: the backend scaled_dot_product_attention tries first, the others after it in torch's order (a kernel that
# cannot run the call is skipped, never an error). On Hopper cuDNN's attention is the one to weigh against flash.
SDPA = {"default": None, "cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def sdpa_first(name: str):
    import contextlib

    if SDPA[name] is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rest = [b for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH") if b != SDPA[name]]
    order = [getattr(SDPBackend, b) for b in [SDPA[name], *rest]]
    return sdpa_kernel(order, set_priority=True)


if __name__ == "__main__":
    main()
