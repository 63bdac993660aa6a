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
# The other notebooks train with `labkit.Trainer`. This one writes the training step by hand, in plain torch_xla.
# You will see what the Trainer does for you, and why. By the end you can:
#
# - write a torch_xla training step and say what runs when: `torch_xla.device()`, forward, backward,
#   `optimizer.step()`, `torch_xla.sync()`;
# - print the lazy graph of a step, as IR and as HLO;
# - read torch_xla's metrics report: compiles, executions, counters;
# - cause a recompilation and a host sync, find each, and fix it;
# - check that `labkit.Trainer` computes exactly what your hand-written loop computes.
#
# **Time**: from 25 s on a quiet machine to 1.7 minutes on a busy one, of run time in fast mode. The range is the
# machine's load: XLA compiles each graph on the same cores that everything else uses. Reading and the three exercises
# take 20–40 minutes.
#
# *Measured on: 2-core x86_64 CPU, XLA:CPU, torch_xla 2.9, fast mode: 25 s quiet; 79–102 s at a load of 10–12,
# with the exercises solved or not; full mode about 45 s quiet.*
#
# **In the course**: the first notebook; next: 04.
#
# **What is torch_xla's, and what carries over.** Some of what you meet here belongs to torch_xla alone: lazy
# tensors, `torch_xla.sync()`, the metrics report and `PT_XLA_DEBUG_LEVEL`. The rest pays off on every compiled
# backend: `torch.compile` with CUDA graphs, TorchTPU and JAX. That rest is three habits. Keep shapes static by
# padding to buckets. Use masks instead of boolean indexing. Never read the device inside the loop. Most of these
# help on an eager GPU too.
#
# > **Status: TorchTPU replaces PyTorch/XLA; Colab still ships torch_xla.** Facts, each with its source and the
# > date it was read:
# >
# > - Google's "PyTorch on Cloud TPU" page (cloud.google.com/tpu/docs, read 2026-11-29) puts TorchTPU
# >   (github.com/google-pytorch/torch_tpu, `pip install torch_tpu`) at the foundation of PyTorch on TPUs.
# > - Its PyTorch/XLA pages carry a banner (read 2026-11-29): PyTorch/XLA "is deprecated and replaced by TorchTPU.
# >   The PyTorch/XLA repo will be archived on November 15, 2026." torch_xla 2.9.0 is its last release on PyPI.
# > - `torch-tpu` 0.2.0 is on PyPI (read 2026-11-29). Its wheel requires torch ≥ 2.11, ≤ 2.15 and libtpu ≥ 0.0.50,
# >   on Python 3.11 to 3.13. So it cannot share an environment with torch_xla 2.9, which needs torch 2.9.
# > - Colab's TPU image, as last checked (googlecolab/backend-info, snapshot of 2026-08-19, read 2026-11-29), ships
# >   torch 2.9 and torch_xla 2.9. This notebook runs there as it is.
# >
# > TorchTPU uses `torch.device("tpu")`, runs **eager by default**, and compiles with `torch.compile(backend="tpu")`.
# > Eager, each op runs as Python reaches it, so there is no graph to cut. Its documentation also names deferred and
# > fused eager modes, which queue ops before they run. In every mode, `.item()`, `print(t)` and `if t:` still wait
# > for the chip to finish what it has queued. So the host-sync lessons hold as they are.
# >
# > What carries over from this notebook: a compiled graph per input shape, so bucketing and masking; host syncs
# > that stall the chip, so one read per log interval; and checking a wrapper against a hand-written loop. What
# > does not: `torch_xla.sync()`, the lazy IR, and torch_xla's metrics and debug variables. Notebook 10 maps each of
# > them to its TorchTPU counterpart. TorchTPU was **not run here**: it needs TPU chips.
#
# Every claim below is checked by an `assert`. The exercises print ✓ or ✗ and never stop *Run all*. Their
# solutions sit in collapsed cells that run only with `LABKIT_SOLUTIONS=1`, which the test suite sets.

# %% [markdown]
# ## Parameters
# Every knob of this notebook lives in this cell. Each one can also be set from the environment as
# `LABKIT_<NAME>`; `LABKIT_FAST=1` gives the CI-sized run, 12 steps instead of 28. The cell shows the values in use.

# %% tags=["parameters"]
import dataclasses, os, sys


@dataclasses.dataclass
class Params:
    batch_size: int = 64          # digits images per step (8x8 pixels, 64 features)
    hidden: int = 128             # width of the MLP's hidden layer
    steps: int = 28               # steps of the hand loop and of the Trainer: at most one pass (1,797 // 64 = 28)
    lr: float = 0.1               # SGD with momentum 0.9
    seed: int = 0
    NEEDS = ("torch_xla",)  # where torch_xla is missing, the set-up cell ends the notebook and says how to get it
    FAST = {"steps": 12}          # CI-sized


try:
    import labkit
    P = labkit.from_env(Params)
except (ImportError, AttributeError):  # first run: the set-up cell installs labkit and reads them again
    P = Params()
P

# %% [markdown]
# ## Set-up
# This cell runs wherever you opened the notebook: Colab TPU or GPU, Kaggle, a TPU VM or a laptop. It never
# replaces what the runtime already has. It keeps the image's torch, and its torch_xla when the two match, and
# installs only what is missing.
#
# It prints what it found and what it chose, as `labkit setup: platform=...` and `labkit setup: choice=...`.
# `choice=keep` means nothing was installed. Where torch and torch_xla are missing or do not match, as on a bare TPU
# VM or after a torch upgraded by hand, it installs the pair together. It then asks you to restart the runtime;
# run the notebook again after the restart.

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
envsetup.main(needs=getattr(Params, "NEEDS", ()))  # prints "labkit setup: ..."; a restart or a missing stack stops here
import labkit
P = labkit.from_env(Params)
print("labkit", labkit.__version__, "from", os.path.dirname(labkit.__file__))

# %% [markdown]
# ## 1. A training step by hand
# On an XLA device a torch op does not compute anything. It only *records* itself in a graph, and the tensor it
# returns is a *lazy tensor*. Nothing runs until something needs the values.
#
# Two things need them. `torch_xla.sync()` cuts the graph, compiles it the first time XLA sees it, and runs it. A
# read on the host does the same for the graph behind the value it reads. Such reads are `.item()`, `print(t)`,
# `if t:` and `.cpu()`; section 6 counts them.
#
# Here is the whole loop. It trains a small MLP on scikit-learn's digits: 1,797 real 8×8 images. They ship with
# the wheel, so nothing is downloaded.
#
# On a TPU runtime the loop runs on the TPU. Anywhere else, a GPU runtime included, it runs on torch_xla's CPU
# backend, XLA:CPU. XLA:CPU compiles and runs graphs the same way a TPU does. The first cell prints the runtime it
# chose: `kind='xla-cpu'` or a TPU.

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
# The cell above printed one loss per step. The first is close to ln 10 ≈ 2.30, the loss of a uniform guess over
# 10 classes; then it falls.
#
# ## 2. The lazy graph of one step
# Before `sync()`, a tensor is only a description of how to compute it. torch_xla can print that description in
# two forms.
#
# The first is torch_xla's own IR, one line per op. `xla::device_data` marks an input already on the device: a
# weight or the batch. `aten::addmm` is a `Linear` layer.
#
# The second is the HLO that XLA compiles. Its `parameter(n)` lines are the inputs, `dot` is a matmul and `maximum`
# is the ReLU.
#
# Look for the ops you wrote, and then for the shapes. Every shape is written into the graph: `f32[64,64]` is the
# batch, 64 images of 64 pixels. That is why a new shape makes a new graph.
#
# Both calls are **private** torch_xla APIs (`torch_xla._XLAC`). They are fine for learning, but a library should
# not rely on them.

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
# torch_xla counts everything it does. `metrics_report()` is long, and these entries matter:
#
# - `CompileTime`: how many graphs were compiled, and how long compiling took;
# - `ExecuteTime`: how many graphs ran;
# - `TransferFromDeviceTime`: how many device→host reads;
# - `CachedCompile` and `UncachedCompile`: a graph found in the cache, or compiled anew;
# - `aten::*`: ops that ran through torch's own CPU kernel instead of an XLA lowering. Each one costs a sync and a
#   slow op.
#
# One `aten::*` name is not a fallback of your maths. `aten::_local_scalar_dense` is how torch spells `.item()`
# itself: a read. It is counted once for each loss read after the loop.
#
# The report prints totals in torch_xla's own format. `Accumulator: 05s989ms562.984us` means 5 s, 989 ms and
# 562.984 µs. The lines below the report's block use `met.metric_data` instead, which counts nanoseconds, and print
# them as seconds (`5.990 s`). The report's block is `CompileTime` alone, so compare it with the `CompileTime`
# line below it. The two totals agree to the last printed digit.
#
# The last line lists the compiles after each step of section 1. Step 0 compiles the step. Step 1 compiles again,
# because SGD's momentum buffers now exist and are new graph inputs. From then on every step is the same graph,
# served from the cache. `CompileTime` counts one graph more than the loop's two: section 2's.

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
# A batch of another size is another graph. The usual sources are the last, smaller batch of an epoch and
# sentences of different lengths. Below, one step runs at batch 50 after training at 64. The cell prints how many
# new graphs that step compiled.

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
# The fix is to pad the batch on the host to a shape XLA already knows. The padding rows get the label -100, which
# `cross_entropy` ignores, so the loss stays the same. The padded batch reuses the compiled graph of batch 64: the
# cell prints 0 new graphs.

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
# Padding everything to the largest batch wastes work when sizes vary a lot. The usual compromise is *buckets*:
# round the size up to a multiple of 8, so that only a few graphs ever exist.
#
# Write `pad_batch(x, y)`. It pads two host tensors to the next multiple of 8 rows: `x`, of rows × features, and
# `y`, the labels. The padding rows of `x` are zeros, and those of `y` get the label -100.
#
# The check runs your function on batches of 8 sizes on the XLA device. It counts the compiles, which should be one
# per bucket. It also compares the loss with the loss of the unpadded batch.

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
if exercises.check("00.bucket", lambda: nb00.check_pad_batch(pad_batch)):
    print("Batch sizes now share one graph per bucket of 8 rows, and the padding leaves the loss unchanged.")

# %% [markdown]
# ## 5. Shapes that only the data know
# `pred[y >= 0]` keeps the rows whose label is valid. How many rows that is depends on the *values* in `y`. XLA
# compiles for fixed shapes, so torch_xla must learn the count first.
#
# It runs the mask on the device and copies it to the host. That copy is `aten::nonzero`: a CPU fallback and a
# sync. The result's shape then enters the graph, so a new count means a new graph.
#
# The cell prints one pair per mask: CPU fallbacks, then new graphs. Each mask costs one fallback. The three masks
# keep 8, 11 and 12 rows. The first compiles two graphs: the mask itself, and the mean over its 8 rows. Each later
# mask reuses the mask's graph but has a new count, so it adds one graph.

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
# Write `masked_mean(pred, y)`: the mean of `pred` over the positions where `y >= 0`. Every intermediate tensor
# must keep a fixed shape. Hint: use `torch.where`, or multiply by the mask and divide by its sum.
#
# The check runs it on masks where half to four fifths of the values are valid, and prints how many. The value must
# be right and computed on the device, with no `aten::*` fallback and no transfer. All masks must share one graph.

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
if exercises.check("00.mask", lambda: nb00.check_masked_mean(masked_mean)):
    print("Your mean keeps every shape fixed: one graph serves every mask, with no CPU fallback and no transfer.")

# %% [markdown]
# ## 6. A host sync, caused and found
# `loss.item()` inside the loop is the most common way to slow a TPU down. The host waits for the step to finish
# and for the loss to come back. Only then can it trace the next step, so the chip idles while Python works. On a
# CPU the cost is small. On a TPU it serialises host and chip.
#
# labkit's `SyncFinder` counts device→host reads per line of *your* code. While it is active it wraps
# `Tensor.item`, `__bool__` and the other reads. It adds no transfer of its own. Its report below names one line,
# `total += loss.item()`, and the count in front of it, 5, is one read per step.

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
# torch_xla can say the same from the inside. With `PT_XLA_DEBUG_LEVEL=2` it prints an "Execution Analysis" for
# every graph it runs: its cause and the Python line that triggered it.
#
# torch_xla reads the variable once, when it starts, so it needs a fresh process. Below, a tiny script runs in a
# child process with the variable set. torch_xla 2.9 prints no separate "TransferFromDevice" line at this level.
# The `.item()` shows up as an execution whose cause is "user code trying to access tensor value".
#
# The cell prints the first two analyses. The first is the `.item()` line's read. The second is the
# `torch_xla.sync()` on the next line, with cause "user torch_xla.sync". The last line counts the executions the
# `.item()` line caused: one per step.

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
# Write `quiet_epoch(model, opt, batches)`. It trains one step per `(x, y)` host batch, exactly like the loop in
# section 1. It returns the epoch's mean loss as a Python float.
#
# It may read the device **at most once**. So sum the losses on the device, and read the sum after the loop. The
# check runs your function under a `SyncFinder` and compares its result with the per-step `.item()` version.

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
if exercises.check("00.sync", lambda: nb00.check_quiet_epoch(quiet_epoch)):
    print("One read an epoch gives the same mean loss as a read every step.")

# %% [markdown]
# ## 7. The same training with `labkit.Trainer`
# The Trainer's step is the loop of section 1, cut into named hooks such as `train_step` and `run_optimizer`. It adds
# two things. A background loader copies the next batches from host to device. And the loss is summed on the device
# and read only once per `log_every` steps, inside a *step closure*.
#
# A step closure is a function given to `xm.add_step_closure(fn)`. torch_xla runs `fn` right after the next
# `torch_xla.sync()` has launched the step's graph. Reading the loss there costs no sync of its own, because the
# values are being computed anyway.
#
# The comparison below uses the same model and seed, the same data in the same order (`shuffle=False`), and the same
# optimizer. With `log_every=1` each logged loss is one step's loss, so it must equal the hand loop's.
#
# The cell first prints a `[labkit]` line: who copies batches to the device, and why. On XLA:CPU a background
# thread does. Copying from the loop's own thread would stall the tracing of the next step. The repository's
# benchmark of training loops, `bench/bench_peers.py`, measured an MLP step 1.7× longer that way. The last line
# prints the largest difference between the Trainer's losses and yours; the assert allows float32 rounding,
# under 1e-5.

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
# Next, notebook 04 runs one model every way PyTorch can capture it. It also gives you the tools the later
# notebooks use: the recompile detective, the sync finder and a profile. Notebook 01 then trains a ResNet-50 with
# the Trainer, whose dashboard watches all three problems for you.
#
# **Where this goes next.** PyTorch/XLA is deprecated and replaced by TorchTPU. The banner on Google's PyTorch/XLA
# pages (read 2026-11-29) says its repository "will be archived on November 15, 2026". torch_xla 2.9.0 is its last
# release, and Colab's TPU image still ships it. TorchTPU (`torch-tpu` 0.2.0 on PyPI, torch ≥ 2.11) is eager by
# default and builds graphs with `torch.compile`. It was not run here: it needs TPU chips. Notebook 10 maps what this
# notebook taught onto it.
#
# * Ends with torch_xla: the lazy tensor, `torch_xla.sync()`, the IR and HLO dumps, and the metrics report's
#   counters (`CompileTime`, `aten::*`, `TransferFromDeviceTime`).
# * Carries over: a new shape is a new graph; under `torch.compile` it is a guard failure and a recompile. A
#   data-dependent shape breaks the graph. A host read per step stalls the chip. The fixes are the same: pad to
#   buckets, use masks instead of indexing, and read once per log interval.
#
# *Sources read 2026-11-29: Google's "PyTorch on Cloud TPU" page and its PyTorch/XLA pages, `torch-tpu` 0.2.0's
# package metadata on PyPI, and googlecolab/backend-info's snapshot of 2026-08-19.*

# %%
print({k: v for k, v in exercises.results.items() if k.startswith("00.")})
