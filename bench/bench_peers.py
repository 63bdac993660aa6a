"""labkit beside what a user would pick instead: a hand-written torch_xla loop, Lightning Fabric, HF Accelerate.

    PJRT_DEVICE=CPU .venv/bin/python bench/bench_peers.py [--models mlp,resnet18] [--trials 5] [--no-data]
        [--ablations] [--install]
    --install puts the peers (lightning-fabric, accelerate, pinned) into bench/.peers, a folder of the benchmark's
    own, never into the venv or the lock; a missing one is skipped. --ablations adds labkit-main and hand-main.

1. Training. The same run through each framework: same model init (seed 0), same batches in the same
   order (an in-memory dataset, no shuffle), SGD + momentum, loss read every 20 steps in a step closure.
   Each framework runs in its OWN process (PJRT_DEVICE=CPU): one framework's compiled graphs, threads
   and patches never touch another's. After each process's warm-up (its compiles, not timed) the
   trials are interleaved (hand, labkit, fabric, accel, hand, ...), so slow drifts of this shared
   machine hit all of them; step times are medians with the spread (min-max) of the trials, ratios
   the median of per-round ratios (the load of a shared machine shifts between rounds).
   Two models: an overhead-bound MLP (batch 64: host work per step dominates) and a compute-bound
   ResNet-18 (torchvision, batch 16, 32x32). Also printed: how many graphs each compiled
   (torch_xla.debug.metrics CompileTime count) and whether the final losses agree.
   Fabric on XLA:CPU: `accelerator="tpu"` refuses to start without TPU chips, so its check
   (XLAAccelerator.is_available / auto_device_count) is patched in the child; Accelerate picks xla:0
   by itself.
2. Data (--no-data skips it): labkit's shard stream (data_tools.make_loader) / webdataset's own
   `wds.WebDataset(urls).shuffle().decode().map().batched()` on the same shards, same PNG decode,
   same crop+flip, same batch, same number of DataLoader workers (samples/s, interleaved trials).
Prints RATIO lines (goal: labkit <= every peer and <= 1.01 x hand-written).

What explains the gaps (measured here, 2026-11-24, cProfile in the child): on the MLP most of a step is
`_xla_step_marker`. The hand loop (and Accelerate's) call zero_grad() at the top of the step, so at the
sync the gradients are live tensors and become outputs of the graph; labkit zeroes them (set to None)
right after the optimizer step, before the sync: 12-13 vs 28-35 ms per MLP step for the same hand loop
with zero_grad moved. Fabric's single-device XLA strategy copies each batch in the main thread (no
MpDeviceLoader) and cuts the graph inside its optimizer step (barrier=True). On ResNet-18 labkit's own
Python per step (loop, accumulator, hooks) is ~1-2 ms of a ~450 ms step; the rest is the device.
ResNet-18, Fabric's lead (issue #52: labkit/Fabric 1.10), taken apart 2026-11-28 on the same 2-core machine while
other jobs ran beside it (load 4-12), with --ablations (one change each, each in its own process, interleaved; the
runs were made with labkit fed in its own thread as "labkit" and with the threads as "labkit-thread"):
- Who copies the batches. labkit and the hand loop feed the device through torch_xla's loader threads
  (pl.ParallelLoader / MpDeviceLoader: a thread reading the DataLoader and one copying, device_prefetch=4 batches per
  copy); Fabric's one-device strategy copies each batch in the loop's thread (`.to(device)` in its DataLoader
  wrapper). Counted (torch_xla's metrics, the same in every run): the threads compile a third graph at the first
  sync (3 graphs against 2 for every loop fed in its own thread: Fabric, hand-main, labkit-main), warm-up only, and
  copy 4 batches per transfer (2-3 TransferToDevice per 10 steps; 1 per batch from the loop's thread, 2 for
  Fabric's per-tensor .to). CPU time per ResNet-18 step (process_time, every thread): 400-440 ms for all five loops.
  Timed: labkit with the threads / fed in its own thread = 0.593 on the MLP (5 rounds of 100 steps, 0.301-0.854:
  every round faster with the threads) and 1.020 on ResNet-18 (6 rounds of 10 steps, 0.662-4.111); hand-main/hand
  1.928 on the MLP (0.909-3.025), 0.749 on ResNet-18 (0.440-2.442). On XLA:CPU a copy to the device waits for the
  step running on the same cores; from the loop's thread that stalls the tracing of the next step, which is most of
  an MLP step: this is where Fabric loses the MLP (labkit/Fabric 0.612 there, rounds 0.451-0.883). So labkit keeps
  the threads on XLA:CPU as on a TPU (the runtime's `feed`, said once, with the reason); feed="main" is Fabric's way.
- Reading the loss. Every loop adds its read every 20 steps, but the peers counted from 0 in each timed run of 15
  steps, so the hand loop, Fabric and Accelerate never read in a trial (TransferFromDevice 0 per run) while labkit
  read on its own count (1-2 per 10 steps): a device->host transfer stalls the host until the step ran. Fixed: every
  loop now counts over all its runs, so each pays the same reads.
- Where the sync falls, and zero_grad: Fabric cuts the graph inside its optimizer step (barrier=True) and zeroes at
  the top of the next, so its gradients are outputs of the graph; labkit zeroes (set_to_none) before the sync, which
  the MLP above measured as the better order. Not Fabric's lead.
- Host Python: labkit's own per step is ~1-2 ms of a ResNet-18 step (cProfile, 2026-11-24); not the lead either.
With the final labkit (the threads) in 6 rounds of 10 steps, load 2.6-9: ResNet-18 labkit/Fabric 0.950 (rounds
0.659-1.265), labkit-main/labkit 0.990 (0.584-1.858); MLP (2 rounds of 20 steps) labkit/Fabric 0.363 (0.102-0.624),
labkit-main/labkit 2.302 (1.118-3.486). So labkit's median is at or under Fabric's on both models here.
What stays open: the step time on ResNet-18. In the two least loaded rounds (10 steps each) labkit with the threads
took 224 / 249 ms, fed in its own thread 232 / 229, Fabric 216 / 215, the hand loop 219 / 219; over 6 rounds at load
7-12 labkit (fed in its own thread) / Fabric 1.099 (rounds 0.389-1.467). Spreads that wide cannot show or exclude
a 10 % gap: rerun `--models resnet18 --ablations` on a quiet machine (each RATIO line prints its spread).
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

os.environ.setdefault("PJRT_DEVICE", "CPU")

FRAMEWORKS = ("hand", "labkit", "fabric", "accel")
# --ablations: one change each, to say what a gap is made of. labkit-main: labkit with each batch copied in the
# loop's thread (DeviceLoader(feed="main"), Fabric's way) instead of torch_xla's loader threads (its runtime's
# choice); hand-main: the hand-written loop the same way instead of MpDeviceLoader's threads
ABLATIONS = ("labkit-main", "hand-main")
# the module each framework needs, and the line that installs it (pins: pyproject.toml's `bench` extra)
NEEDS = {"fabric": ("lightning_fabric", "lightning-fabric==2.6.6"), "accel": ("accelerate", "accelerate==1.15.0")}
# --install puts the peers here, never into the project's venv or its lock (requirements.txt): --no-deps, so they
# cannot move torch; these are what they import beyond the venv's packages
PEERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".peers")
PEER_DEPS = ("lightning-utilities==0.15.3", "huggingface_hub==2.4.0", "safetensors==0.8.0")
MODELS = {"mlp": 64, "resnet18": 16}  # model -> batch size
LOG_EVERY = 20
MARK = "@@ "  # protocol lines from a child start with this; its other output (banners, logs) is dropped


# -- one framework, in a child process ---------------------------------------------------------------
def make_model(name):
    import torch

    torch.manual_seed(0)
    if name == "mlp":
        return torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(3 * 32 * 32, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def make_data(batch, batches):
    import torch

    g = torch.Generator().manual_seed(0)
    n = batch * batches
    ds = torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=batch, drop_last=True)


def make_optimizer(model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


class Loop:
    """run(n): n steps from the start of the data (every framework sees the same batches)."""

    losses: list

    seen = 0  # steps run so far, over all runs: the loss is read every LOG_EVERY of them, as labkit's log is (a
    # count that restarted with each run of 15 timed steps never read it: labkit paid a transfer the others did not)

    def note_loss(self, i, loss):
        import torch_xla.core.xla_model as xm

        self.seen += 1
        if self.seen % LOG_EVERY == 0:
            xm.add_step_closure(lambda v: self.losses.append(v.item()), args=(loss,))

    def final_loss(self) -> float:
        return self.last.item()  # a device->host transfer, once, after the timing


class Hand(Loop):
    """What a careful torch_xla user writes by hand (pytorch/xla examples style)."""

    def __init__(self, model, data):
        import torch_xla

        dev = torch_xla.device()
        self.model = make_model(model).to(dev)
        self.opt = make_optimizer(self.model)
        self.loader = self.feed(data, dev)
        self.losses = []

    def feed(self, data, dev):
        import torch_xla.distributed.parallel_loader as pl

        return pl.MpDeviceLoader(data, dev)  # background threads copy batches ahead

    def run(self, n):
        import torch.nn.functional as F
        import torch_xla
        import torch_xla.core.xla_model as xm

        for i, (x, y) in zip(range(n), self.loader):
            self.opt.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            xm.optimizer_step(self.opt)
            self.note_loss(i, loss)
            torch_xla.sync()
        self.last = loss


class HandMain(Hand):
    """The hand-written loop with each batch copied in the loop's thread (Fabric's way on one XLA device)."""

    def feed(self, data, dev):
        class Here:
            def __iter__(self):
                return ((x.to(dev), y.to(dev)) for x, y in data)

        return Here()


class Labkit(Loop):
    feed = "auto"  # the runtime's choice (XLA:CPU and TPU: torch_xla's loader threads; said once)

    def __init__(self, model, data):
        import labkit

        rt = labkit.setup("xla-cpu")
        m = make_model(model)
        cfg = labkit.TrainConfig(epochs=10**6, log_every=LOG_EVERY, eval_every=0)

        class Trainer(labkit.Trainer):  # keeps the last step's loss (the log has interval means)
            def train_step(self, batch):
                self.last = super().train_step(batch)
                return self.last

        self.tr = Trainer(m, make_optimizer(m), rt, cfg, labkit.DeviceLoader(data, rt, feed=self.feed))

    def run(self, n):
        self.tr.cfg.max_steps = self.tr.step + n
        self.tr.batch_in_epoch = 0  # start the epoch afresh, like the others
        self.tr.fit()

    @property
    def last(self):
        return self.tr.last


class LabkitMain(Labkit):
    feed = "main"  # each batch copied in the loop's thread, as Fabric does on one XLA device


class Fabric(Loop):
    def __init__(self, model, data):
        from lightning_fabric import Fabric as F_
        from lightning_fabric.accelerators.xla import XLAAccelerator

        # no TPU chips on XLA:CPU: Fabric's own check would refuse accelerator="tpu"
        XLAAccelerator.is_available = staticmethod(lambda: True)
        XLAAccelerator.auto_device_count = staticmethod(lambda: 1)
        self.fabric = F_(accelerator="tpu", devices=1, precision="32-true")
        # on XLA the model goes to the device BEFORE its optimizer is made (Fabric's TPU guide):
        # fabric.setup(model, optimizer) would leave the optimizer stepping the old CPU parameters
        self.model = self.fabric.setup_module(make_model(model))
        self.opt = self.fabric.setup_optimizers(make_optimizer(self.model))
        self.loader = self.fabric.setup_dataloaders(data)
        self.losses = []

    def run(self, n):
        import torch.nn.functional as F

        for i, (x, y) in zip(range(n), self.loader):
            self.opt.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            self.fabric.backward(loss)
            self.opt.step()
            self.note_loss(i, loss)
        self.last = loss


class Accel(Loop):
    def __init__(self, model, data):
        from accelerate import Accelerator

        self.acc = Accelerator()  # picks xla:0 by itself under PJRT_DEVICE
        m = make_model(model)
        self.model, self.opt, self.loader = self.acc.prepare(m, make_optimizer(m), data)
        self.losses = []

    def run(self, n):
        import torch.nn.functional as F

        for i, (x, y) in zip(range(n), self.loader):
            self.opt.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            self.acc.backward(loss)
            self.opt.step()
            self.note_loss(i, loss)
        self.last = loss


def child(fw, model, batch, batches):
    """Serve `run N` lines from the parent on stdin; answer with MARK + JSON on stdout."""
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def say(**kw):
        print(MARK + json.dumps(kw), flush=True)

    loops = {"hand": Hand, "hand-main": HandMain, "labkit": Labkit, "labkit-main": LabkitMain}
    loop = dict(loops, fabric=Fabric, accel=Accel)[fw](model, make_data(batch, batches))
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "run":
            t = time.perf_counter()
            loop.run(int(arg))
            xm.wait_device_ops()
            say(seconds=time.perf_counter() - t)
        elif cmd == "done":
            compiles = met.metric_data("CompileTime")
            say(graphs=compiles[0] if compiles else 0, loss=loop.final_loss())
            return


# -- the parent: start the children, interleave their trials --------------------------------------------
class Child:
    def __init__(self, fw, model, batch, batches):
        env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONUNBUFFERED="1")
        if os.path.isdir(PEERS_DIR):  # the peers' own folder (--install), after everything the venv has
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (env.get("PYTHONPATH"), PEERS_DIR)))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", fw, "--models", model]
        cmd += ["--batch", str(batch), "--batches", str(batches)]
        self.fw = fw
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, line) -> dict:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        for out in self.p.stdout:
            if out.startswith(MARK):
                return json.loads(out[len(MARK) :])
        raise RuntimeError(f"{self.fw}: child exited with {self.p.wait()} (its error is printed above)")

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def install_peers() -> None:
    """The peers' pinned wheels into PEERS_DIR (--no-deps: torch and the venv stay as they are)."""
    pins = [pin for _, pin in NEEDS.values()] + list(PEER_DEPS)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", PEERS_DIR, *pins]
    print("installing the peers:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def missing(fw) -> str | None:
    if fw in NEEDS and importlib.util.find_spec(NEEDS[fw][0]) is None:
        return NEEDS[fw][1]
    return None


def bench_model(model, a, frameworks):
    batch = MODELS[model]
    steps = a.steps if a.steps else (200 if model == "mlp" else 15)
    print(f"== {model}, batch {batch}: {a.warmup} warm-up steps, then {a.trials} trials x {steps} steps", flush=True)
    kids = {}
    try:
        for fw in frameworks:
            kids[fw] = Child(fw, model, batch, max(steps, a.warmup))
        times = {fw: [] for fw in kids}
        for fw, k in list(kids.items()):  # warm-up one after another: compiles, not timed
            try:
                r = k.ask(f"run {a.warmup}")
                print(f"  warm-up {fw}: {r['seconds']:.1f} s", flush=True)
            except (RuntimeError, BrokenPipeError) as e:
                print(f"  {fw} FAILED: {e}", flush=True)
                kids.pop(fw).close()
                times.pop(fw)
        for trial in range(a.trials):
            order = list(kids) if trial % 2 == 0 else list(reversed(kids))
            for fw in order:
                times[fw].append(kids[fw].ask(f"run {steps}")["seconds"] / steps)
            print(f"  trial {trial}: " + ", ".join(f"{fw} {v[-1] * 1e3:.1f}" for fw, v in times.items()) + " ms/step")
        ends = {fw: k.ask("done") for fw, k in kids.items()}
    finally:
        for k in kids.values():
            k.close()
    med = {fw: statistics.median(v) for fw, v in times.items()}

    def ratio(a, b):  # the median of per-round ratios, and their spread (min-max): the load shifts between rounds
        r = [x / y for x, y in zip(times[a], times[b])]
        return statistics.median(r), min(r), max(r)

    for fw, v in times.items():
        vs_hand = "{:6.3f}x hand ({:.3f}-{:.3f})".format(*ratio(fw, "hand")) if "hand" in times else ""
        print(
            f"  {fw:<13} {med[fw] * 1e3:8.1f} ms/step (trials {min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})  {vs_hand}  "
            f"graphs compiled {ends[fw]['graphs']:3d}  final loss {ends[fw]['loss']:.5f}"
        )
    losses = [e["loss"] for e in ends.values()]
    agree = max(losses) - min(losses) <= 1e-3 * max(1.0, abs(losses[0]))
    print(f"  final losses {'agree' if agree else 'DIFFER'} (spread {max(losses) - min(losses):.2e})")
    pairs = [(fw, "hand", " (goal <= 1.01)" if fw == "labkit" else "") for fw in FRAMEWORKS if fw != "hand"]
    pairs += [("labkit", fw, " (goal <= 1)") for fw in ("fabric", "accel")]
    pairs += [("labkit-main", "labkit", " (ablation: batches copied in the loop's thread)")]
    pairs += [("hand-main", "hand", " (ablation: batches copied in the loop's thread)")]
    pairs += [("labkit-main", "fabric", " (ablation: labkit fed as Fabric is)")]
    for a, b, note in pairs:
        if a in times and b in times and a != b:
            r, lo, hi = ratio(a, b)
            print(f"RATIO {model} {a}/{b} step time = {r:.3f} (rounds {lo:.3f}-{hi:.3f}){note}")


# -- the data path ------------------------------------------------------------------------------------------
def bench_data(a):
    import tempfile

    import numpy as np
    import torch
    import webdataset as wds

    from data_tools import load_manifest, load_source, make_loader, write_shards
    from data_tools.transforms import augment, decode_image, scale_stats, to_batch

    x, y, names = load_source("digits", "train")
    reps = -(-a.images // len(x))  # digits repeated to --images: an epoch long enough to time
    x, y = np.concatenate([x] * reps)[: a.images], np.concatenate([y] * reps)[: a.images]
    tmp = tempfile.mkdtemp(prefix="bench-peers-")
    m = write_shards(x, y, os.path.join(tmp, "shards"), class_names=names, samples_per_shard=250)
    man = os.path.join(tmp, "shards", "manifest.json")
    urls = load_manifest(man)["urls"]
    mean, std = scale_stats(m["mean"], m["std"])
    bs, workers = 64, a.workers

    def png(key, data):  # the same PIL decode as the stream's; None: not ours, webdataset tries the next
        return decode_image(data) if key.endswith(".png") else None

    def crop_flip(sample):
        img, label = sample
        return augment(img, np.random.default_rng(), 4), int(label)

    def collate(items):
        return to_batch([i for i, _ in items], [c for _, c in items], mean, std)

    def webdataset_loader():
        ds = (
            wds.WebDataset(
                urls, shardshuffle=len(urls), nodesplitter=wds.single_node_only, workersplitter=wds.split_by_worker
            )
            .shuffle(1000)
            .decode(png)
            .to_tuple("png", "cls")
            .map(crop_flip)
            .batched(bs, collation_fn=collate, partial=False)
        )
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)

    def labkit_loader():
        return make_loader(man, bs, train=True, num_workers=workers, shuffle_buffer=1000)

    def rate(make):
        t, n = time.perf_counter(), 0
        for xb, _ in make():
            n += xb.shape[0]
        return n / (time.perf_counter() - t)

    print(
        f"== data: {len(x)} digits PNG 32x32 in {len(urls)} shards, batch {bs}, {workers} DataLoader workers, crop+flip"
    )
    rate(labkit_loader), rate(webdataset_loader)  # warm: page cache, imports
    ra, rb = [], []
    for trial in range(a.trials):
        pair = ((labkit_loader, ra), (webdataset_loader, rb))
        for make, out in pair if trial % 2 == 0 else reversed(pair):
            out.append(rate(make))
    la, wb = statistics.median(ra), statistics.median(rb)
    print(f"  labkit shard stream   {la:8.0f} samples/s (trials {min(ra):.0f}-{max(ra):.0f})")
    print(f"  webdataset pipeline   {wb:8.0f} samples/s (trials {min(rb):.0f}-{max(rb):.0f})")
    print(f"RATIO data labkit/webdataset samples/s = {la / wb:.3f} (goal >= 1, sha256 checked while streaming)")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mlp,resnet18", help="comma-separated: mlp, resnet18")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated: " + ", ".join(FRAMEWORKS))
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=0, help="timed steps per trial (0: 200 for the MLP, 15 for ResNet-18)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the compiles)")
    p.add_argument(
        "--data", action=argparse.BooleanOptionalAction, default=True, help="compare the data path with webdataset's"
    )
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers for --data")
    p.add_argument("--images", type=int, default=6000, help="images in the shards for --data")
    p.add_argument(
        "--ablations", action="store_true", help="also run " + ", ".join(ABLATIONS) + " (what a gap is made of)"
    )
    p.add_argument("--install", action="store_true", help=f"pip install the peers into {PEERS_DIR} first")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--batches", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a.child, a.models, a.batch, a.batches)
    if a.install:
        install_peers()
    if os.path.isdir(PEERS_DIR):
        sys.path.append(PEERS_DIR)  # so missing() finds what --install put there
    frameworks = []
    for fw in a.frameworks.split(",") + (list(ABLATIONS) if a.ablations else []):
        pip = missing(fw)
        if pip:
            print(f"skipped {fw}: not installed (--install puts {pip} into {PEERS_DIR})")
        else:
            frameworks.append(fw)
    t = time.perf_counter()
    for model in [m for m in a.models.split(",") if m]:  # --models "": the data path alone
        bench_model(model, a, frameworks)
    if a.data:
        bench_data(a)
    print(f"total {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
