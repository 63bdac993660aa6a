# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lazy tensors by hand: one torch_xla training step, taken apart
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/labkit/labkit/blob/main/notebooks/00_lazy_tensors_by_hand.ipynb)
#
# The other notebooks train with `labkit.Trainer`. This one writes the training step by hand in plain torch_xla,
# so you see what the Trainer does for you and why. By the end you can:
#
# - write a torch_xla training step (`torch_xla.device()`, forward, backward, `optimizer.step()`, `torch_xla.sync()`)
#   and say what runs when;
# - print the lazy graph of a step (IR and HLO) and read torch_xla's metrics report (compiles, executions, counters);
# - cause a recompilation and a host sync, find each (metrics, labkit's sync finder, `PT_XLA_DEBUG_LEVEL=2`) and fix it;
# - check that `labkit.Trainer` computes exactly what your hand-written loop computes.
#
# **Time**: 25 s of run time in fast mode on a quiet 2-core CPU, 1–2 minutes on a busy one (102 s measured with the
# load at ~10 on 2 cores; XLA:CPU, solutions on; full mode ~45 s on a quiet machine); 20–40 minutes to read and do
# the three exercises.
#
# **In the course**: the first notebook; next: 04.
#
# **What is torch_xla's and what carries over.** Lazy tensors, `torch_xla.sync()`, one compiled graph per input
# shape, the metrics report and `PT_XLA_DEBUG_LEVEL` are torch_xla's. Static shapes (padding to buckets), masking
# instead of boolean indexing, and not reading the device inside the loop pay off on every compiled backend
# (`torch.compile` with CUDA graphs, TorchTPU, JAX) and most of them on an eager GPU too.
#
# > **Status: torch_xla 2.9.0 is the last release on PyPI so far.** PyTorch/XLA's README (its note of 2026-04-22) says
# > that *once TorchTPU is public* it will replace PyTorch/XLA (a plan, with its condition), and names no last version (an r2.10 branch exists, untagged). TorchTPU (public since 2026,
# > `pip install torch_tpu`; its package, `torch-tpu` 0.2.0, requires torch ≥ 2.11, though its `torch.compile` guide
# > says 2.10; that requirement is not verified here) uses `torch.device("tpu")`, runs **eager by default** and compiles with `torch.compile(backend="tpu")`.
# > Its default eager mode runs each op as Python reaches it (its documentation also names deferred and fused eager
# > modes, which queue ops before running them): there is no graph to cut, but `.item()`, `print(t)` and `if t:` still
# > wait for the chip to finish everything queued, so the host-sync lessons hold as they are. What carries over from this notebook: a compiled graph per
# > input shape (so bucketing and masking), host syncs that stall the chip (so read once per log interval), and
# > checking a wrapper against a hand-written loop. What does not: `torch_xla.sync()`, the lazy IR and
# > torch_xla's metrics and debug variables. TorchTPU was **not run here**: it needs a TPU VM (no CPU mode).
#
# Every claim below is checked by an `assert`. The exercises print ✓ or ✗ and never stop *Run all*; their
# solutions are in collapsed cells that run only with `LABKIT_SOLUTIONS=1` (as the test suite does).

# %% [markdown]
# ## Parameters

# %% tags=["parameters"]
import dataclasses, os, sys


@dataclasses.dataclass
class Params:
    batch_size: int = 64          # digits images per step (8x8 pixels, 64 features)
    hidden: int = 128             # width of the MLP's hidden layer
    steps: int = 28               # steps of the hand loop and of the Trainer: at most one pass (1,797 // 64 = 28)
    lr: float = 0.1               # SGD with momentum 0.9
    seed: int = 0
    FAST = {"steps": 12}          # CI-sized


try:
    import labkit
    P = labkit.from_env(Params)
except (ImportError, AttributeError):  # first run: the set-up cell installs labkit and reads them again
    P = Params()
P

# %% [markdown]
# ## Set-up
# Runs wherever you opened this (Colab TPU or GPU, Kaggle, a TPU VM, a laptop) and never replaces what the runtime
# already has: it keeps the image's torch (and torch_xla when the pair matches), installs only what is missing,
# and prints what it found and chose (`labkit setup: platform=... choice=...`). Only where torch and torch_xla are
# missing or do not match (a bare TPU VM, a torch upgraded by hand) it installs the pair together and asks you to
# restart the runtime; then run the notebook again.

# %% tags=["setup"]
# Set-up: keeps the torch (+ torch_xla) the runtime already has, installs only what is missing.
import importlib.util, os, subprocess, sys

def _labkit_dir():
    spec = importlib.util.find_spec("labkit")
    d = spec and spec.submodule_search_locations and list(spec.submodule_search_locations)[0]
    return d if d and os.path.exists(os.path.join(d, "envsetup.py")) else None

if _labkit_dir() is None:  # absent, or PyPI's unrelated "labkit": install ours (no dependencies yet)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(pip + ["uninstall", "-y", "labkit"], capture_output=True)
    spec = os.environ.get("LABKIT_PIP_SPEC", "").strip() or "labkit-xla @ git+https://github.com/labkit/labkit"
    if spec.lstrip().startswith("-"):  # pip would read it as an option
        raise SystemExit("LABKIT_PIP_SPEC starts with '-': give a path, a URL or a requirement, not a pip option")
    r = subprocess.run(pip + ["install", "--no-deps", spec])
    if r.returncode:  # not check=True: its message would print the spec, which may carry a token
        raise SystemExit(f"installing labkit failed (pip exit {r.returncode}): pip's message is above")
    importlib.invalidate_caches()
    for m in [m for m in sys.modules if m == "labkit" or m.startswith("labkit.")]:
        del sys.modules[m]
_spec = importlib.util.spec_from_file_location("labkit_envsetup", os.path.join(_labkit_dir(), "envsetup.py"))
envsetup = sys.modules["labkit_envsetup"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(envsetup)
envsetup.main()  # prints "labkit setup: platform=... / choice=..."; asks for a restart if one is needed
import labkit
P = labkit.from_env(Params)
print("labkit", labkit.__version__, "from", os.path.dirname(labkit.__file__))

# %% [markdown]
# ## 1. A training step by hand
# On an XLA device every torch op only *records* itself in a graph (a lazy tensor); nothing is computed until
# something needs the values: `torch_xla.sync()`, which cuts the graph, compiles it (the first time XLA sees it)
# and runs it, or any read on the host, which does the same for the graph behind the value it reads (`.item()`,
# `print(t)`, `if t:`, `.cpu()`; section 5 counts them). Here is the whole
# loop: a small MLP on scikit-learn's digits (1,797 real 8×8 images, shipped with the wheel: no download).
# A TPU runtime uses the TPU; anywhere else this notebook uses torch_xla on the CPU (XLA:CPU), which compiles and
# runs graphs exactly the same way.

# %%
import math, subprocess, tempfile, textwrap

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from labkit.lessons import exercises  # check(), solutions_on(), results
from labkit.lessons.exercises import nb00  # this notebook's checkers

rt = labkit.setup()
if not rt.is_xla:  # a GPU runtime picks torch's own CUDA; this notebook is about torch_xla
    rt = labkit.setup("xla-cpu")  # says what to pip install when torch_xla is missing
import torch_xla
import torch_xla.debug.metrics as met

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
Y = torch.tensor(digits.target)
data = torch.utils.data.TensorDataset(X, Y)
loader = torch.utils.data.DataLoader(data, batch_size=P.batch_size, shuffle=False, drop_last=True)


def make_model():
    torch.manual_seed(P.seed)  # the same initial weights every time it is called
    return torch.nn.Sequential(torch.nn.Linear(64, P.hidden), torch.nn.ReLU(), torch.nn.Linear(P.hidden, 10))


def compiles():
    """Graphs XLA has compiled so far in this process."""
    return (met.metric_data("CompileTime") or (0,))[0]


assert P.steps <= len(loader), f"steps={P.steps}: at most {len(loader)} (one pass over the data, in order)"
print(rt)

# %%
device = torch_xla.device()
model = make_model().to(device)
opt = torch.optim.SGD(model.parameters(), lr=P.lr, momentum=0.9)
losses, compiled = [], []
for x, y in (b for _, b in zip(range(P.steps), loader)):
    x, y = x.to(device), y.to(device)      # host -> device copy
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)    # recorded, not computed
    loss.backward()                        # recorded too
    opt.step()                             # and this
    torch_xla.sync()                       # now: compile (first time) and run the step's graph
    losses.append(loss.detach())           # still a device tensor: reading it now would wait for the device
    compiled.append(compiles())
hand = [t.item() for t in losses]          # read once, after the loop
print("losses:", " ".join(f"{v:.3f}" for v in hand))
assert hand[-1] < hand[0], "the loss falls"

# %% [markdown]
# ## 2. The lazy graph of one step
# Before `sync()`, a tensor is only a description of how to compute it. torch_xla can print it: first its own IR
# (one line per op, `xla::device_data` are the inputs already on the device: weights and the batch), then the
# HLO that XLA compiles (`parameter(n)` inputs, `dot` for the matmuls, `maximum` for the ReLU). Look for the ops
# you wrote and for the shapes: every shape is part of the graph, which is why a new shape is a new graph.
# Both calls are **private** torch_xla APIs (`torch_xla._XLAC`): fine for learning, not for a library.

# %%
x, y = next(iter(loader))
pending = F.cross_entropy(model(x.to(device)), y.to(device))  # not synced: still a graph
ir = torch_xla._XLAC._get_xla_tensors_text([pending])
hlo = torch_xla._XLAC._get_xla_tensors_hlo([pending])
print("\n".join(ir.splitlines()[:12]), "\n   ...", len(ir.splitlines()), "IR lines\n")
entry = hlo[hlo.index("\nENTRY") :].splitlines()  # the main computation (reductions come before it)
print("\n".join(ln for ln in entry if any(op in ln for op in ("ENTRY", "parameter(", " dot(", " maximum("))))
assert "xla::device_data" in ir and "addmm" in ir
assert " dot(" in hlo and f"f32[{P.batch_size},64]" in hlo  # the batch's shape is written into the graph
torch_xla.sync()

# %% [markdown]
# ## 3. What the metrics say
# torch_xla counts everything it does. `metrics_report()` is long; the lines that matter:
# `CompileTime` (how many graphs were compiled and how long it took), `ExecuteTime` (graph runs),
# `TransferFromDeviceTime` (device→host reads), and counters: `CachedCompile` (a graph found in the cache),
# `UncachedCompile`, and `aten::*` (ops that ran through torch's own CPU kernel instead of an XLA lowering: each
# is a sync and a slow op). One `aten::*` name is not a fallback of your maths: `aten::_local_scalar_dense` is how
# torch spells `.item()` itself, a read, counted once per loss read after the loop. One compile more than the loop's
# two is section 2's graph.
#
# Two spellings of one kind of figure: the report prints a metric's total as `Accumulator: 05s989ms562.984us`
# (5 s, 989 ms, 562.984 µs: torch_xla's own format), and the lines below print totals from `met.metric_data`, in
# nanoseconds turned into seconds (`5.990 s`). The report's block is `CompileTime` alone; the lines below are three
# metrics, so compare the `CompileTime` line with it: measured here, the two agree to the microsecond.
# Step 0 compiles the step; step 1 compiles again because the optimizer's momentum buffers now exist (a new
# graph input); from then on every step is the same graph, served from the cache.

# %%
report = met.metrics_report()
block = report[report.index("Metric: CompileTime") :].splitlines()[:4]
print("\n".join(block), "\n")  # the first lines of the report's CompileTime entry
for name in ("CompileTime", "ExecuteTime", "TransferFromDeviceTime"):
    count, total_ns, _ = met.metric_data(name)
    print(f"{name:24s} {count:4d} samples, {total_ns / 1e9:7.3f} s in total")
for name in ("UncachedCompile", "CachedCompile", "MarkStep"):
    print(f"{name:24s} {met.counter_value(name)}")
from labkit.dashboard import NOT_FALLBACKS  # aten::_local_scalar_dense: .item(), a read, not a fallback

aten = {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")}
print("aten::* CPU fallbacks:", {n: v for n, v in aten.items() if n not in NOT_FALLBACKS},
      "| reads (.item()):", {n: v for n, v in aten.items() if n in NOT_FALLBACKS})
print("compiles after each step:", compiled)
assert compiled[1] == compiled[0] + 1 and len(set(compiled[1:])) == 1, "no compile after step 2"
assert met.counter_value("CachedCompile") >= len(compiled) - 2

# %% [markdown]
# ## 4. A recompilation, caused and fixed
# A batch of another size is another graph. Typical source: the last, smaller batch of an epoch, or sentences of
# different lengths. Below: one step at batch 50 after training at 64.

# %%
def train_step(x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x.to(device)), y.to(device), ignore_index=-100)
    loss.backward()
    opt.step()
    torch_xla.sync()
    return loss


before = compiles()
train_step(X[:50], Y[:50])
print("batch of 50:", compiles() - before, "new graph(s)")
assert compiles() == before + 1

# %% [markdown]
# The fix: pad the batch on the host to the shape XLA already knows, with labels -100 that `cross_entropy`
# ignores (so the loss is the same). The padded batch reuses the compiled graph of batch 64.

# %%
def pad_to(x, y, rows):
    extra = rows - len(x)
    return F.pad(x, (0, 0, 0, extra)), F.pad(y, (0, extra), value=-100)


before = compiles()
xp, yp = pad_to(X[:50], Y[:50], P.batch_size)
train_step(xp, yp)
print("batch of 50 padded to", P.batch_size, ":", compiles() - before, "new graph(s)")
assert compiles() == before
with torch.no_grad():  # the padding rows do not change the loss
    a = F.cross_entropy(model(xp.to(device)), yp.to(device), ignore_index=-100)
    b = F.cross_entropy(model(X[:50].to(device)), Y[:50].to(device))
    assert abs(a.item() - b.item()) < 1e-5

# %% [markdown]
# ### Exercise 1: bucket by multiples of 8
# Padding everything to the largest batch wastes work when sizes vary a lot. The usual compromise is
# *buckets*: round the size up to a multiple of 8, so at most a few graphs exist. Write `pad_batch(x, y)` that pads
# host tensors `x` (rows × features) and `y` (labels) to the next multiple of 8 rows, labels -100 for the padding.
# The check runs it on batches of 8 sizes on the XLA device and counts the compiles (one per bucket) and compares
# the loss with the unpadded one.

# %%
# your turn
def pad_batch(x, y):
    return ...  # YOUR CODE: (x padded with zero rows, y padded with -100), both to a multiple of 8 rows


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():
    def pad_batch(x, y):
        return pad_to(x, y, 8 * math.ceil(len(x) / 8))  # pad on the host: on the device it would be a graph per size

# %%
exercises.check("00.bucket", lambda: nb00.check_pad_batch(pad_batch))

# %% [markdown]
# ## 5. Shapes that only the data know
# `pred[y >= 0]` keeps the rows whose label is valid: how many depends on the *values* of `y`. XLA compiles for
# fixed shapes, so torch_xla runs the mask on the device, copies it to the host (`aten::nonzero`, a CPU fallback
# and a sync), and the result's shape then enters the graph: a new graph whenever the count changes.

# %%
pred = torch.randn(16).to(device)
torch_xla.sync()
seen = []
for k in range(3):
    y = torch.tensor([-1 if (i + k) % (k + 2) == 0 else 1 for i in range(16)]).to(device)
    fb, c0 = met.counter_value("aten::nonzero") or 0, compiles()
    m = pred[y >= 0].mean()
    torch_xla.sync()
    seen.append(((met.counter_value("aten::nonzero") or 0) - fb, compiles() - c0))
print("(CPU fallbacks, new graphs) per mask:", seen)
assert all(f == 1 for f, _ in seen) and sum(c for _, c in seen) >= 2

# %% [markdown]
# ### Exercise 2: the same mean without dynamic shapes
# Write `masked_mean(pred, y)`: the mean of `pred` over the positions where `y >= 0`, with every intermediate
# tensor of a fixed shape (hint: `torch.where`, or multiply by the mask and divide by its sum). The check runs it on
# masks where half to four fifths of the values are valid (it prints how many): the value must be right, computed on
# the device with no `aten::*` fallback and no transfer, and one graph for all masks.

# %%
# your turn
def masked_mean(pred, y):
    return ...  # YOUR CODE


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():
    def masked_mean(pred, y):
        keep = y >= 0
        return torch.where(keep, pred, 0.0).sum() / keep.sum()

# %%
exercises.check("00.mask", lambda: nb00.check_masked_mean(masked_mean))

# %% [markdown]
# ## 6. A host sync, caused and found
# `loss.item()` inside the loop is the most common way to slow a TPU down: the host waits for the step to finish
# and copy the loss back before it can trace the next step, so the chip idles while Python works. On a CPU the
# cost is small; on a TPU it serialises host and chip. labkit's `SyncFinder` counts device→host reads per line of
# *your* code (it wraps `Tensor.item`, `__bool__`, ... while active and adds no transfer of its own).

# %%
from labkit.dashboard import SyncFinder

finder = SyncFinder()
with finder:
    total = 0.0
    for _, (x, y) in zip(range(5), loader):
        loss = train_step(x, y)
        total += loss.item()  # the host sync
print(finder.report())
((site, n),) = finder.total.items()
assert n == 5 and "loss.item()" in site.code

# %% [markdown]
# torch_xla can say the same from the inside: `PT_XLA_DEBUG_LEVEL=2` prints an "Execution Analysis" for every
# graph run, with its cause and the Python line that triggered it. It is read once, when torch_xla starts, so it
# needs a fresh process: below, a tiny script runs in a child with the variable set. (torch_xla 2.9 prints no
# separate "TransferFromDevice" line at this level: the `.item()` shows up as an execution whose cause is "user
# code trying to access tensor value".)

# %%
script = textwrap.dedent("""
    import torch, torch_xla
    w = torch.randn(8, 8, device=torch_xla.device())
    total = 0.0
    for step in range(2):
        loss = (w @ w).tanh().mean()
        total += loss.item()  # the host sync
        torch_xla.sync()
""")
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(script)
env = dict(os.environ, PT_XLA_DEBUG_LEVEL="2", PJRT_DEVICE="CPU")  # XLA:CPU even on a TPU: this kernel holds the chips
out = subprocess.run([sys.executable, f.name], env=env, capture_output=True, text=True, timeout=300)
lines = (out.stdout + out.stderr).splitlines()
execs = [i for i, line in enumerate(lines) if "Execution Cause" in line]
for i in execs[:2]:
    print("\n".join(lines[i : i + 9]), "\n")
item_no = 1 + script.splitlines().index("    total += loss.item()  # the host sync")
where = f"{os.path.basename(f.name)}:{item_no})"  # the frame line names the script and the .item() line
hits = [i for i in execs if "access tensor value" in lines[i + 1] and any(where in ln for ln in lines[i : i + 10])]
print(f"{len(hits)} executions caused by line {item_no} (total += loss.item())")
assert out.returncode == 0 and len(hits) == 2, "PT_XLA_DEBUG_LEVEL=2 names the .item() line, once per step"
os.unlink(f.name)

# %% [markdown]
# ### Exercise 3: read the device once
# Write `quiet_epoch(model, opt, batches)`: train one step per `(x, y)` host batch, exactly like the loop in
# section 1, and return the epoch's mean loss as a Python float, reading the device **at most once**
# (sum the losses on the device, read after the loop). The check runs it under a `SyncFinder` and compares
# with the per-step `.item()` version.

# %%
# your turn
def quiet_epoch(model, opt, batches):
    ...  # YOUR CODE: the loop of section 1, the losses summed on the device
    return ...  # the mean loss as a float


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():
    def quiet_epoch(model, opt, batches):
        dev = next(model.parameters()).device
        total = torch.zeros((), device=dev)
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            total += loss.detach()  # on the device: no read
            torch_xla.sync()
        return total.item() / len(batches)  # the one read

# %%
exercises.check("00.sync", lambda: nb00.check_quiet_epoch(quiet_epoch))

# %% [markdown]
# ## 7. The same training with `labkit.Trainer`
# The Trainer's step is the loop of section 1 with hooks (`train_step`, `run_optimizer`), a background
# host→device loader, and a loss summed on the device and read once per `log_every` steps inside a *step closure*
# (`xm.add_step_closure(fn)`: torch_xla runs `fn` right after the next `torch_xla.sync()` has launched the step's
# graph, so reading the loss there costs no sync of its own: the values are being computed anyway). Same model (same seed), same data in the same order (`shuffle=False`), same optimizer:
# with `log_every=1` each logged loss is one step's loss, and it must equal the hand loop's.

# %%
model2 = make_model()
opt2 = torch.optim.SGD(model2.parameters(), lr=P.lr, momentum=0.9)
cfg = labkit.TrainConfig(epochs=1, max_steps=P.steps, log_every=1, eval_every=0)
history = labkit.Trainer(model2, opt2, rt, cfg, loader).fit()
trained = [r["loss"] for r in history]
worst = max(abs(a - b) for a, b in zip(hand, trained))
print(f"{len(trained)} steps, largest |hand - Trainer| = {worst:.2e}")
assert len(trained) == len(hand) and worst < 1e-5

# %% [markdown]
# ## What you saw
# | | caused by | seen with | fixed by |
# |---|---|---|---|
# | a compile per new graph | a new shape (batch 50), a data-dependent shape (`pred[y >= 0]`), new optimizer state | `CompileTime`, `compiles()` | fixed shapes: pad to a bucket on the host, masks instead of indexing |
# | a CPU fallback | an op without an XLA lowering (`aten::nonzero`) | `aten::*` counters | a fixed-shape rewrite |
# | a host sync | `.item()`, `print(t)`, `if t:` in the loop | `SyncFinder`, `PT_XLA_DEBUG_LEVEL=2` | sum on the device, read once per log interval |
#
# Next: notebook 04 runs one model every way PyTorch can capture it and gives you the tools the later notebooks use
# (the recompile detective, the sync finder, a profile); notebook 01 then trains a ResNet-50 with the Trainer, whose
# dashboard watches all three for you.
#
# **Where this goes next.** torch_xla 2.9.0 is the last release on PyPI so far; TorchTPU (`torch-tpu`
# on PyPI, not run here: it needs a TPU, torch ≥ 2.11 by its package's requirement, and has no CPU mode), which PyTorch/XLA's README (2026-04-22) says will
# replace torch_xla once it is public, is eager by default and builds graphs with `torch.compile` (read 2026-11).
# * Ends with torch_xla: the lazy tensor, `torch_xla.sync()`, the IR and HLO dumps, and the metrics report's
#   counters (`CompileTime`, `aten::*`, `TransferFromDeviceTime`).
# * Carries over: a new shape is a new graph (under `torch.compile` a guard failure and a recompile), a data-
#   dependent shape breaks the graph, and a host read per step stalls the chip; padding to buckets, masks instead of
#   indexing and reading once per log interval are the same fixes.

# %%
print({k: v for k, v in exercises.results.items() if k.startswith("00.")})
