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
# # Capstone: debug this run
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/labkit/labkit/blob/main/notebooks/07_capstone_debug_a_run.ipynb)
#
# A colleague hands you a training run that "works": the loss falls, nothing crashes. It is also several times slower
# than it should be. Five faults that learners meet in practice are planted in it:
#
# - a recompile on almost every step;
# - an op that falls back to the CPU;
# - a read from the device in every step;
# - a loader that starves the chip;
# - in the plan for the multi-chip run, a sharding that replicates the largest weight.
#
# Find each fault with the tools of the earlier notebooks. 04 gave the recompile detective and the sync finder, 00
# torch_xla's counters, 06 the time spent waiting for batches, and 03 the bytes each device holds. Fix it, and
# let the checkers measure your fixed run. Then predict the fixed step's time from this machine's FLOP/s (the
# roofline), and measure it.
#
# By the end you can find and fix, with measurements, the faults that make a real run slow. You can also predict a
# step's time from the device's FLOP/s before you measure it.
#
# **Time**: 1–5 minutes of run time on a 2-core CPU, on XLA:CPU; there is no fast mode. The three sharded runs of
# section 5 take about 12 s each on a quiet machine. Reading, finding the faults and fixing them in the four exercises
# take 60–90 minutes.
#
# *Measured on: 2-core CPU, XLA:CPU, torch 2.9, exercises unsolved: 61 s quiet, 260 s busy.*
#
# **In the course**: after 09; next: 10. The capstone uses 00's counters, 04's detective and sync finder,
# 06's feed meter and 03's bytes per device.
#
# Which lessons carry over? A starving input pipeline, a host read per step and a roofline prediction are the same on
# every backend. Recompiles on a new shape and CPU fallbacks are torch_xla's story. With TorchTPU, eager by default,
# the same shape changes cost `torch.compile` recompiles instead.

# %% [markdown]
# ## Parameters

# %% tags=["parameters"]
import dataclasses, math, os, sys


@dataclasses.dataclass
class Params:
    batch: int = 128
    width: int = 2048  # the MLP's hidden width: wide enough that matmuls, not Python, set the step time
    delay_ms: float = 0.5  # time to read and decode one sample (a sleep: no CPU used)
    steps: int = 14  # steps per measured run (the first two are warm-up)
    mesh_width: int = 512  # the MLP's width in the sharded run of section 5
    mesh_devices: int = 4  # virtual XLA:CPU devices it runs on
    NEEDS = ("torch_xla",)  # where torch_xla is missing, the set-up cell ends the notebook and says how to get it
    FAST = {}  # the run is already CI-sized


try:
    import labkit

    P = labkit.from_env(Params)
except ImportError:  # first run on Colab: the next cell installs labkit and reads the parameters again
    P = Params()
P

# %% [markdown]
# ## Set-up
# The next cell runs wherever you opened this notebook: Colab TPU or GPU, Kaggle, a TPU VM, a laptop. It keeps the
# torch the runtime already has, and its torch_xla when the pair matches. It installs only what is missing. It prints
# what it found and what it chose (`labkit setup: platform=... choice=...`). Where torch and torch_xla are missing or
# do not match, it installs the pair together and asks you to restart the runtime. That happens on a bare TPU VM, or
# after a torch upgraded by hand. Then run the notebook again.

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

# %%

import torch
import torch.nn.functional as F

from labkit.lessons import capstone, capstone_mesh
from labkit.lessons import exercises as ex
from labkit.lessons.exercises import nb07
from labkit.profiling import roofline

rt = labkit.setup()
XLA = rt.is_xla
print(rt)

# %% [markdown]
# ## 1. The run as it was handed over
# The data: scikit-learn's handwritten digits, 8×8. About a fifth of the labels are missing (`-100`), as in a
# semi-labelled or padded dataset. Reading and decoding a sample takes `P.delay_ms`. The model is an MLP. Read the
# loader and the step below: each hides one or more of the faults.

# %%
data = capstone.SlowDigits(delay_s=P.delay_ms / 1e3)
history = []  # the colleague logs every loss


def broken_loader(dataset, batch_size):
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=True, collate_fn=capstone.drop_unlabelled
    )  # "clean" batches


def broken_step(model, x, y, lr):
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    history.append(loss.item())  # log the loss
    correct = (logits.argmax(1)[y >= 0] == y[y >= 0]).sum()  # accuracy on labelled rows
    return loss.detach(), correct, (y >= 0).sum()


model = capstone.make_model(rt, P.width)
broken = capstone.measure(rt, model, broken_step, broken_loader(data, P.batch), steps=P.steps)
print(capstone.describe(broken))

# %% [markdown]
# ## 2. Find the faults with the kit's tools
# `capstone.measure` ran the steps under labkit's `HealthMonitor` (the recompile detective) and `SyncFinder`. It read
# torch_xla's counters before and after, and timed how long each step waited for its batch.
#
# * **Recompiles**: the detective says which input changed shape, and the line that was running.
# * **CPU fallbacks**: an `aten::` counter that grows means an op ran on the host, with a transfer each way.
# * **Host reads**: the sync finder names each line that copied a value from the device.
# * **A starving chip**: the time each step spends blocked on the loader. Here the recompiles still dominate the step,
#   so the wait looks like a small share. Once they are gone, it is most of the step. Fix one fault and the next one
#   shows: measure again after each fix.

# %%
for ev in broken["recompile_events"][:3]:
    print(
        f"step {ev['step']}: {ev['reason']}  ({'; '.join(c['input'] + ' ' + c['old'] + ' -> ' + c['new'] for c in ev['changes'])})"
    )
print("CPU fallbacks:", broken["fallbacks"])
print("reads per line:", broken["read_lines"])
print(f"waiting for batches: {broken['wait_s'] * 1e3:.0f} ms per step ({broken['wait_share']:.0%} of the step)")
sequential = P.batch * P.delay_ms / 1e3  # decoding a whole batch, one sample after another
assert broken["wait_s"] >= 0.7 * sequential, "each step waits for a whole batch to be decoded"
assert len(set(broken["shapes"])) > 1, "batches of many sizes"
if XLA:  # the sync finder, the recompile detective and the fallback counters read torch_xla's metrics
    assert broken["reads"] >= broken["steps"], "a read in every step"
    assert broken["compiles_after_warmup"] > 0 and broken["recompile_events"], "new graphs after warm-up"
    assert "aten::nonzero" in broken["fallbacks"], "the boolean index ran on the CPU"
else:
    print(f"not on XLA ({rt.kind}): the sync finder, the recompile detective and the fallback counters are "
          "torch_xla's; here a .item() still waits for the device, but nothing counts it")

# %% [markdown]
# What the tools say, in words:
# * `drop_unlabelled` removes rows on the host, so every batch has another number of rows. On XLA that is a new graph
#   for each new size: the detective's "batch shape changed". Keep the rows, and let the loss ignore them
#   (`ignore_index=-100` is cross-entropy's default). Count accuracy with a mask.
# * `logits.argmax(1)[y >= 0]` is a boolean index. Its size depends on the data, so XLA cannot compile it, and
#   `aten::nonzero` runs on the CPU. Multiply by the mask or use `torch.where`: both keep the shape.
# * `history.append(loss.item())` waits for the device in every step. Return the loss, and read it once per log
#   interval. labkit's Trainer does that in a step closure.
# * The loader decodes in the training process, one sample after another: while it decodes, the chip waits. Worker
#   processes (`num_workers`) decode ahead, in parallel. `drop_last=True` keeps the last batch full.
#
# On this 2-core machine, DataLoader warns that its "suggested max number of worker ... is 2" when you ask for more. The
# warning counts cores. This decode is a sleep, a wait for a read as a network or disk read is, and needs no core. So
# more workers than cores still cut the wait here. The warning matters for a decode that computes, such as a JPEG's.
# There, workers beyond the host's cores only take turns.
#
# ## Your turn
# **1. Fix the step.** Write `fixed_step(model, x, y, lr)` returning `(loss, correct, labelled)` as device tensors. It
# computes the same numbers as `broken_step`, but with no fallback, no read, and one graph for every batch.

# %%
def fixed_step(model, x, y, lr): ...  # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():

    def fixed_step(model, x, y, lr):
        logits = model(x)
        loss = F.cross_entropy(logits, y, ignore_index=-100)
        model.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        keep = y >= 0
        return loss.detach(), ((logits.argmax(1) == y) & keep).sum(), keep.sum()


# %%
ex.check("07.fix_step", lambda: nb07.check_fixed_step(fixed_step, rt))

# %% [markdown]
# **2. Feed the chip.** Write `fixed_loader(dataset, batch_size)`. It yields batches of exactly `batch_size` rows,
# the unlabelled ones kept, and each sample once per epoch. The check gives the dataset 3 ms per sample and each step
# 100 ms of work. Both are sleeps. Your loader must be fast enough that a step waits for its batch less than 30 % of
# the time. How many samples must be decoded in parallel?
#
# The sleeps are far above a loader's own CPU work, so a busy machine does not change the verdict. Handing a batch
# over from a worker process still costs milliseconds on a loaded machine. So a loader over 30 % is timed again, in
# turns with a 4-worker loader, under the same load. It passes if its median wait per step is within 25 ms of that
# loader's, a quarter of the step. The message prints both numbers. A loader that decodes in the main process waits its
# whole decode, 96 ms or more a step, and fails either way.

# %%
def fixed_loader(dataset, batch_size): ...  # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():

    def fixed_loader(dataset, batch_size):
        return torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=4, persistent_workers=True
        )


# %%
ex.check("07.fix_loader", lambda: nb07.check_fixed_loader(fixed_loader))

# %% [markdown]
# ## 3. Predict the fixed step, then measure it
# The roofline: a step that does F FLOPs at this device's measured matmul rate takes at least F / (FLOP/s). A linear
# layer does one multiply-add (2 FLOPs) per weight per sample in the forward pass. The backward pass does about twice
# that: gradients for the inputs and for the weights. `roofline.measure` times a large matmul and a memory-bound copy
# on this device.

# %%
here = roofline.measure(rt)
print(
    f"{here.name}: {here.flops / 1e9:.0f} GFLOP/s (matmul), {here.bandwidth / 1e9:.1f} GB/s, "
    f"ridge at {here.ridge:.0f} FLOPs per byte"
)

# %% [markdown]
# The line gives the matmul rate, the bandwidth, and the ridge: the FLOPs per byte above which a step is
# compute-bound. Read the bandwidth with its conditions. On XLA:CPU it is a copy run as an XLA graph on a shared 2-core
# machine, the graph's launch included. That gives around 1 GB/s here, a small fraction of what the machine's memory
# can stream. It is this device's effective rate for a memory-bound op, which is what the roofline needs. It is no
# property of the memory. On a TPU the same cell measures HBM; Google's v5e page rates it at 819 GB/s (not verified
# here).

# %% [markdown]
# **3. Predict.** Write `predict_step_s(batch, model, machine)`: the seconds of matmul work in one training step at
# `machine.flops`. Count the elements of the weight matrices yourself, from `model.parameters()`.
# `capstone.weights(model)` is not allowed.

# %%
def predict_step_s(batch, model, machine): ...  # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():

    def predict_step_s(batch, model, machine):
        weights = sum(p.numel() for p in model.parameters() if p.dim() == 2)
        return 6 * batch * weights / machine.flops


# %%
ex.check("07.predict", lambda: nb07.check_predict_step(predict_step_s))

# %% [markdown]
# ## 4. The fixed run
# The run uses your fixes if they passed, else the reference fixes, so that *Run all* goes on. The line below says
# which.

# %%
step_fn = fixed_step if ex.results.get("07.fix_step") else capstone.reference_step
make_loader = (
    fixed_loader
    if ex.results.get("07.fix_loader")
    else (lambda d, b: torch.utils.data.DataLoader(d, batch_size=b, shuffle=True, drop_last=True, num_workers=4))
)
print(
    "step:",
    "yours" if step_fn is fixed_step else "the reference fix",
    "| loader:",
    "yours" if make_loader is fixed_loader else "the reference fix",
)
model = capstone.make_model(rt, P.width)
fixed = capstone.measure(rt, model, step_fn, make_loader(data, P.batch), steps=P.steps)
print(capstone.describe(fixed))
print(
    f"step time {broken['step_s'] * 1e3:.0f} ms -> {fixed['step_s'] * 1e3:.0f} ms "
    f"({broken['step_s'] / fixed['step_s']:.1f}x faster)"
)
assert len(set(fixed["shapes"])) == 1
compute_s = fixed["step_s"] * (1 - fixed["wait_share"])  # the part of a step not spent waiting
print(
    f"waiting for batches: {broken['wait_s'] * 1e3:.0f} ms -> {fixed['wait_s'] * 1e3:.0f} ms per step, "
    f"{fixed['wait_share']:.0%} of the step (exercise 2's bar: 30 %)"
)
if compute_s < P.batch * P.delay_ms / 1e3 / 4:  # a fast chip: four workers cannot keep up, and that is the finding
    print(
        f"this device computes a step in {compute_s * 1e3:.1f} ms, faster than four workers decode a batch: "
        f"keeping up would take about {math.ceil(P.batch * P.delay_ms / 1e3 / compute_s)} workers"
    )
assert fixed["wait_s"] < broken["wait_s"], "the workers cut the wait"
if XLA:
    assert fixed["reads"] == 0 and fixed["compiles_after_warmup"] == 0 and not fixed["fallbacks"]

# %% [markdown]
# The prediction against the measurement. The roofline is a floor. The step also updates every weight, a memory-bound
# pass over the parameters and gradients (see the bandwidth above). It also launches its work and syncs.
#
# The stated tolerance: the measured step is at least 0.7× and at most 10× the matmul prediction. 10× leaves room for
# a loaded 2-core CI machine; on an idle one it was 2.4–3.1×. The matmul rate and the step were measured a minute
# apart. On a shared machine other work can start or stop in between. So when the ratio falls outside the tolerance,
# both are measured again, side by side, at most twice, and the cell says so. A machine's speed is no fact about the
# step, so the cell prints the ratio for you to read and asserts only the prediction's arithmetic.

# %%
flops_step = 6 * P.batch * capstone.weights(model)
weight_bytes = 6 * 4 * sum(p.numel() for p in model.parameters())  # float32, about 6 passes: forward, backward, grads, update
for _ in range(3):
    pred = roofline.predict(flops_step, bytes_moved=weight_bytes, machine=here)
    compute_s = fixed["step_s"] * (1 - fixed["wait_share"])
    print(
        f"predicted {pred['s'] * 1e3:.1f} ms ({pred['bound']}-bound: {pred['compute_s'] * 1e3:.1f} ms of matmuls, "
        f"{pred['memory_s'] * 1e3:.1f} ms moving the weights); measured {compute_s * 1e3:.1f} ms "
        f"({compute_s / pred['compute_s']:.1f}x the matmuls alone)"
    )
    high = roofline.upper_bound(pred["compute_s"], 10)  # none when the matmuls take under a millisecond
    if 0.7 <= compute_s / pred["compute_s"] <= high:
        break
    print("outside the tolerance: measuring the matmul rate and the fixed step again, side by side")
    here = roofline.measure(rt)
    fixed = capstone.measure(rt, capstone.make_model(rt, P.width), step_fn, make_loader(data, P.batch), steps=P.steps)
if high == float("inf"):
    print("launch-bound: under a millisecond of matmuls, kernel launches and Python set the step; only the floor is checked")
if not 0.7 <= compute_s / pred["compute_s"] <= high:
    print("still outside the tolerance after three tries: other work on this machine changed its speed between "
          "the two measurements; read the ratios above as this run's, not the step's")
assert pred["compute_s"] == flops_step / here.flops and pred["s"] >= pred["compute_s"]  # the floor is the matmuls
v5e = roofline.predict(flops_step, weight_bytes, roofline.V5E)
print(
    f"on paper, one TPU v5e chip: {v5e['s'] * 1e6:.0f} µs ({v5e['bound']}-bound, intensity "
    f"{v5e['intensity']:.0f} FLOPs/byte vs the chip's ridge at {roofline.V5E.ridge:.0f}; not verified here)"
)

# %% [markdown]
# ## 5. The plan for several chips
# The colleague also wrote the plan for the multi-chip run, on a Kaggle v5e-8 TPU VM. It is FSDP: every weight split
# over the chips along one dimension, and the batch split over the same axis, so that each chip holds 1/N of the model.
# The plan is a rule, written once for every model:

# %%
def colleague_plan(model, devices):
    """Split each weight matrix over the chips along its larger dimension; biases are small: keep them whole."""
    plan = {}
    for name, p in model.named_parameters():
        if p.dim() == 2 and p.shape[0] > p.shape[1]:
            plan[name] = ("fsdp", None)
        elif p.dim() == 2 and p.shape[1] > p.shape[0]:
            plan[name] = (None, "fsdp")
        else:
            plan[name] = (None,) * p.dim()  # whole on every chip
    return plan


# %% [markdown]
# This process already drives its own device, one chip on Colab's v5e-1, and a process cannot switch to a mesh of
# several. So `capstone_mesh.run` trains the model under the plan in a fresh Python process, on `P.mesh_devices`
# virtual XLA:CPU devices. XLA's partitioning and the bytes each device holds are real; the timings are not a TPU's.
#
# It reads the layout with notebook 03's tools, `labkit.spmd.sharding.layout_table` and `device_bytes`. It also trains
# a replicated copy on the same batches: a layout must not change the losses. The table's sharding strings read as
# notebook 03 section 3 taught. `{devices=[4,1]0,1,2,3}` cuts a weight into 4 × 1 tiles, one per device, no copies.
# `{replicated}` is a whole copy on every device.

# %%
MESH = capstone_mesh.available() is None
if MESH:
    handed = capstone_mesh.run(
        colleague_plan(capstone.make_model(None, P.mesh_width), P.mesh_devices), P.mesh_width, P.mesh_devices
    )
    print(capstone_mesh.describe(handed))
    even = handed["bytes_total"] / handed["devices"]
    worst = max(handed["rows"], key=lambda row: row[4])
    print(f"the largest share: {worst[0]} {tuple(worst[1])}, {worst[4]:,d} bytes on every device ({worst[3]})")
    assert worst[0] == "2.weight" and worst[3] == "{replicated}", worst
    assert handed["bytes_per_device"] > 2 * even, "most of the model is on every device"
    assert capstone_mesh.same_losses(handed), ("a layout is not maths", handed["losses"], handed["replicated_losses"])
else:
    print(capstone_mesh.available() + "; this section and exercise 4 need torch_xla")

# %% [markdown]
# The table says it. The hidden layer's weight is square, so neither of the rule's comparisons holds. The rule
# replicated it, the largest weight of the model, on every chip. Nothing fails, and the losses are the same as before.
# The cost is memory: N copies of the biggest matrix. A model sized to fit only when split N ways would not fit on a
# chip at all. That is not shown here, since the virtual devices share the host's memory. A smaller model keeps less
# room for activations and batch.
#
# The fix takes the tie rule of torch_xla's FSDPv2 (notebook 03): on a tie, split the first dimension. It adds a rule
# of its own that FSDPv2 does not have: split only a dimension that divides over the chips. FSDPv2 splits the largest
# dimension whether it divides or not, and pads the last shard (notebook 03's `fsdp_bytes`). This plan would rather
# leave no padding. So for the output layer, with 10 rows, it looks for a dimension that divides. The "largest
# dimension, first on a tie" rule is FSDPv2's own. PyTorch's FSDP2 (`fully_shard`) splits dim 0, unless its
# `shard_placement_fn` says otherwise.
#
# **4. Fix the plan.** Write `fixed_plan(model, devices)`, returning `{parameter name: spec}`. Split every weight matrix
# over the `"fsdp"` axis along a dimension that divides by `devices`: the larger one when both do, the first on a tie.
# Biases may stay whole. The check runs your plan on the virtual devices for a model of another width. It reads what
# each device holds before the first step and after the last. Then it asks your plan about a width on the other side
# of the 64 inputs, and about 5 devices, and compares each spec with the rule.

# %%
def fixed_plan(model, devices): ...  # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():

    def fixed_plan(model, devices):
        plan = {}
        for name, p in model.named_parameters():
            if p.dim() == 2:
                fits = [d for d in (0, 1) if p.shape[d] % devices == 0]
                d = max(fits, key=lambda d: (p.shape[d], -d))  # the larger; the first on a tie
                plan[name] = ("fsdp", None) if d == 0 else (None, "fsdp")
        return plan


# %%
if MESH:
    ex.check("07.fix_plan", lambda: nb07.check_fixed_plan(fixed_plan, P.mesh_devices))
else:
    print("exercise 4 is not checked here:", capstone_mesh.available())

# %% [markdown]
# The plan of the multi-chip run, yours if it passed, else the reference fix:

# %%
if MESH:
    plan_fn = fixed_plan if ex.results.get("07.fix_plan") else capstone_mesh.reference_plan
    print("plan:", "yours" if plan_fn is fixed_plan else "the reference fix")
    split = capstone_mesh.run(plan_fn(capstone.make_model(None, P.mesh_width), P.mesh_devices), P.mesh_width, P.mesh_devices)
    print(capstone_mesh.describe(split))
    even = split["bytes_total"] / split["devices"]
    print(f"per device: {handed['bytes_per_device']:,d} -> {split['bytes_per_device']:,d} bytes "
          f"({handed['bytes_per_device'] / split['bytes_per_device']:.1f}x less)")
    assert split["bytes_per_device"] <= 1.05 * even, (split["bytes_per_device"], even)
    assert capstone_mesh.same_losses(split), (split["losses"], split["replicated_losses"])

# %% [markdown]
# ## Where this goes next
# * Carries over to TorchTPU and any backend: static batch shapes, masks instead of boolean indexing, no host read per
#   step, and workers that keep the chip fed. The roofline arithmetic carries over too: FLOPs ÷ FLOP/s, bytes ÷
#   bandwidth.
# * Ends with torch_xla: the lazy-graph counters (`CompileTime`, `aten::` fallbacks) and `torch_xla.sync()`. TorchTPU
#   runs eagerly, so its "recompile" is a `torch.compile` guard failure, read with `TORCH_LOGS=recompiles`.
# * The sharding plan carries over as an idea. TorchTPU shards with DTensor: `distribute_tensor` with `Shard(d)` or
#   `Replicate()` placements on a `DeviceMesh`. There a `Replicate()` on the largest weight costs the same memory.
#   `mark_sharding` and the HLO's sharding strings are torch_xla's.
