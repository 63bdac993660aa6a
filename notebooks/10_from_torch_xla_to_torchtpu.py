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
# # From torch_xla to TorchTPU: each idea of the course, mapped and run on both sides
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/labkit/labkit/blob/main/notebooks/10_from_torch_xla_to_torchtpu.ipynb)
#
# This course taught PyTorch on TPUs through torch_xla: lazy tensors, `torch_xla.sync()`, GSPMD's `mark_sharding`.
# Google now ships a second stack for the same chips, TorchTPU. It runs eager PyTorch, compiles with
# `torch.compile`, and shards with DTensor, the engine of notebooks 08 and 09. This notebook maps each torch_xla idea
# of the course to its TorchTPU counterpart, one section each. Where it is cheap, both sides run here and an `assert`
# compares them. By the end you can:
#
# - replace `torch_xla.sync()` and the lazy graph with eager steps and `torch.compile(dynamic=False)`, and show that
#   both give the same losses;
# - find what the IR, the HLO and the metrics report told you in `torch._dynamo.explain`, the recompile log and
#   `torch.profiler`;
# - write a `mark_sharding` partition spec as DTensor placements on a `DeviceMesh`, and say which rows each rank keeps;
# - feed batches with a DataLoader and pinned copies instead of the device loader, and step with DDP or FSDP2 instead
#   of `xm.optimizer_step`;
# - say which compile cache each stack keeps, and what carries over unchanged: static shapes, no host reads in the
#   loop, checkpoints and the FLOP arithmetic.
#
# **Time**: 35-65 s of run time in fast mode on a 2-core CPU, quiet to busy. Most of it is importing torch_xla and
# Inductor's first compile in section 7, whose time depends on the machine's load. Full mode trains 6 steps instead of
# 4 and compiles section 2's step with Inductor instead of `aot_eager`. With Inductor's cache warm that added little;
# with an empty cache, one compile of that step took 34 s here. Reading and the three exercises take 30-40 minutes.
#
# *Measured on: 2-core CPU shared with other jobs, torch 2.9 and torch_xla 2.9 on XLA:CPU. Fast mode: 36 s under nbval
# with the solutions on, 64 s unsolved on a busier machine. Full mode: 44 s unsolved, Inductor's cache warm. With
# torch_xla hidden, as on an image without it, its cells are skipped: 17 s. TorchTPU's image without chips (torch 2.11,
# torch-tpu 0.2.0, Python 3.13, no torch_xla), run as a script without the set-up cell: 30 s, 18 s of it a cold Inductor
# compile.*
#
# **In the course**: after 07; next: the appendix, 05. It comes after the capstone because every row of its map
# points back to something the course taught: 00's lazy step, 03's meshes, 04's and 07's detectives, 08's and 09's
# compiled engine. It is the way out of the course, onto the stack Google now ships.
#
# > **Status, with sources and dates.**
# >
# > - Google's "PyTorch on Cloud TPU" page (cloud.google.com/tpu/docs, read 2026-11-29) puts TorchTPU
# >   (github.com/google-pytorch/torch_tpu, `pip install torch_tpu`) at the foundation of PyTorch on TPUs.
# > - Its PyTorch/XLA pages carry a banner (read 2026-11-29): PyTorch/XLA "is deprecated and replaced by TorchTPU.
# >   The PyTorch/XLA repo will be archived on November 15, 2026." torch_xla 2.9.0 is its last release on PyPI.
# > - `torch-tpu` 0.2.0 is on PyPI (read 2026-11-29). Its wheel's metadata requires torch ≥ 2.11, ≤ 2.15 and
# >   libtpu ≥ 0.0.50. Its wheels are for CPython 3.11 to 3.13, Linux x86_64.
# > - Colab's TPU image, as last checked (googlecolab/backend-info, snapshot of 2026-08-19, read 2026-11-29), ships
# >   torch 2.9 and torch_xla 2.9. There the torch_xla side of this notebook runs; TorchTPU does not.
# >
# > So both stacks matter: torch_xla where the image has it, TorchTPU on a TPU VM built from Google's guide.
#
# Every claim below is checked by an `assert`, or marked *read from torch-tpu 0.2.0's sources* with the file named,
# or *not verified here*. TorchTPU needs TPU chips, and there are none here. So the TorchTPU side runs on the plain
# CPU: `torch.compile` with Inductor, or `aot_eager` in fast mode, stands in for `backend="tpu"`. The torch_xla side
# runs on XLA:CPU (`PJRT_DEVICE=CPU`). Where torch_xla is not installed, each torch_xla cell says so in one line and
# the notebook goes on. The exercises print ✓ or ✗ and never stop *Run all*. Their solutions are in collapsed cells
# that run only with `LABKIT_SOLUTIONS=1`, as the test suite runs them.

# %% [markdown]
# ## Parameters

# %% tags=["parameters"]
import dataclasses, os, sys


@dataclasses.dataclass
class Params:
    batch_size: int = 32  # digits images per step (8x8 pixels, 64 features)
    hidden: int = 32  # width of the MLP's hidden layer
    steps: int = 6  # steps of each training run
    lr: float = 0.1  # plain SGD, so that both stacks run the same update
    seed: int = 0
    compile_backend: str = "inductor"  # stands in for TorchTPU's "tpu", which needs chips
    xla_devices: int = 4  # virtual XLA:CPU devices for the torch_xla side (SPMD), where there is no TPU
    FAST = {"steps": 4, "compile_backend": "aot_eager"}


try:
    import labkit

    P = labkit.from_env(Params)
except (ImportError, AttributeError):  # first run: the set-up cell installs labkit and reads them again
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

# %% [markdown]
# ## 1. Two stacks, one torch each
# A torch_xla release is built against one torch release: torch_xla 2.9 needs torch 2.9. TorchTPU 0.2.0 needs
# torch 2.11 to 2.15. So one Python environment holds one stack or the other, never both: installing TorchTPU into
# Colab's TPU image would replace its torch and break its torch_xla.
#
# The next cell reads what this environment has: torch's version, and the other packages' versions from their
# metadata, without importing them. It then checks the claim above on the version numbers themselves.

# %%
import importlib.util

import torch

from labkit.envsetup import pair_problem, satisfies, version_of  # package metadata: imports neither stack

have = {"torch": str(torch.__version__)} | {name: version_of(name) for name in ("torch_xla", "torch-tpu", "libtpu")}
print("here:", ", ".join(f"{n} {v or 'absent'}" for n, v in have.items()))
TORCH_TPU_NEEDS = "torch>=2.11.0,<=2.15.0"  # torch-tpu 0.2.0's wheel metadata (Requires-Dist)


def suits_xla(torch_version):  # torch_xla 2.9 is built against torch 2.9 (labkit's set-up checks the pair the same way)
    return pair_problem(torch_version, "2.9.0") is None


print(
    f"torch {have['torch']} suits torch_xla 2.9: {suits_xla(have['torch'])}; "
    f"suits torch-tpu 0.2.0: {satisfies(have['torch'], TORCH_TPU_NEEDS)}"
)
releases = [f"2.{m}.{p}" for m in range(8, 17) for p in range(4)]
both = [v for v in releases if suits_xla(v) and satisfies(v, TORCH_TPU_NEEDS)]
assert both == [], both  # no torch release suits both stacks
HAVE_XLA = importlib.util.find_spec("torch_xla") is not None
print("the torch_xla side runs here" if HAVE_XLA else "no torch_xla here: the torch_xla cells say so and go on")

# %% [markdown]
# The first line lists what is installed. The second says which stack this torch suits. The `assert` checks every
# torch from 2.8 to 2.16 against both requirements: none meets both.
#
# ### The model and the data, for both sides
# The data is scikit-learn's digits: 1,797 real 8×8 images, no download. The model is a small MLP trained with plain
# SGD, so that nothing but the engine differs between the runs. `make_model(device)` builds it from the same seed
# every time, so every run starts from the same weights.

# %%
import tempfile, time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

from labkit.lessons import exercises  # check(), solutions_on(), results
from labkit.lessons.exercises import nb10  # this notebook's checkers

digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
Y = torch.tensor(digits.target)
B = P.batch_size
batches = [(X[i : i + B], Y[i : i + B]) for i in range(0, P.steps * B, B)]


def make_model(device="cpu"):
    torch.manual_seed(P.seed)
    return torch.nn.Sequential(torch.nn.Linear(64, P.hidden), torch.nn.ReLU(), torch.nn.Linear(P.hidden, 10)).to(device)


# The TorchTPU side: a TPU where TorchTPU found chips (torch.accelerator reports "tpu"), else the plain CPU.
acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
dev = acc if acc is not None and acc.type == "tpu" else torch.device("cpu")
backend = "tpu" if dev.type == "tpu" else P.compile_backend
print(f"{len(batches)} batches of {B}; the TorchTPU side runs on {dev} with torch.compile(backend={backend!r})")

# %% [markdown]
# ## 2. `torch_xla.sync()` and the lazy graph → eager steps and `torch.compile`
# Under torch_xla every op on an XLA tensor is recorded, not run. `torch_xla.sync()` cuts the record, compiles it the
# first time it is seen, and runs it (notebook 00). TorchTPU has no lazy trace. It runs **eager by default**: each op
# runs as Python reaches it, on `torch.device("tpu")`. A graph exists only where you ask for one, with
# `torch.compile(backend="tpu", dynamic=False)` (notebook 08).
#
# First the torch_xla side, as notebook 00 wrote it. Notebook 03's SPMD mode is switched on before the first step,
# over `P.xla_devices` virtual XLA:CPU devices, so that section 4 can shard on the same runtime. The loop keeps its
# losses on the device and reads them once, at the end. It also starts torch_xla's persistent compile cache in a
# temporary folder; section 7 reads it.

# %%
xla_cache = tempfile.mkdtemp(prefix="labkit-nb10-xla-cache-")
if HAVE_XLA:
    from labkit.spmd import mesh as spmd_mesh

    print(spmd_mesh.practice_devices(P.xla_devices, need=2))  # before torch_xla starts: TPU chips or virtual CPUs
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.initialize_cache(xla_cache, readonly=False)  # only before the first computation of the process
    xr.use_spmd()
    xdev = torch_xla.device()
    n_xla = xr.global_runtime_device_count()
    xmesh = xs.Mesh(list(range(n_xla)), (n_xla, 1), ("data", "model"))
    xla_tol = 1e-5 if xr.device_type() == "CPU" else 2e-2  # a TPU's float32 matmuls use bf16 passes by default

    def compiles():
        return met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0

    model = make_model(xdev)
    opt = torch.optim.SGD(model.parameters(), lr=P.lr)
    before, losses = compiles(), []
    for x, y in batches:
        x, y = x.to(xdev), y.to(xdev)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        xm.optimizer_step(opt)  # section 5: the gradients' all-reduce (none in one process), then opt.step()
        torch_xla.sync()  # cut the trace: compile it the first time, run it
        losses.append(loss.detach())
    lazy = torch.stack(losses).cpu().tolist()  # one device-to-host read for the whole run
    lazy_compiles = compiles() - before
    assert 1 <= lazy_compiles < len(batches)  # later steps reuse a cached graph
    print(f"lazy on {xdev} ({xr.device_type()}, {n_xla} devices): {lazy_compiles} graphs compiled for {len(batches)} steps")
    print("lazy losses:    ", [round(v, 4) for v in lazy])
else:
    lazy = None
    print("no torch_xla here: the lazy run is skipped")

# %% [markdown]
# The last lines give the device, the number of graphs XLA compiled for the whole run, and the losses. There are fewer
# graphs than steps: the first steps compile, and once a step's graph repeats, every later step reuses it from the
# cache.
#
# Now the TorchTPU side, twice. First eager, TorchTPU's default: no sync, no graph. Then the same step with the model
# compiled, with `dynamic=False`: TorchTPU's backend supports no other value (its docstring in
# `torch_tpu/_internal/compile/_backend.py`: "Only False is supported"). AOTAutograd compiles the backward with the
# model's forward. The optimizer runs eager.

# %%
def train(model, step_model=None, device=dev):
    step_model = step_model or model
    opt = torch.optim.SGD(model.parameters(), lr=P.lr)
    losses = []
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(step_model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())  # stays on the device: one read at the end, as under torch_xla
    return torch.stack(losses).tolist()


eager = train(make_model(dev))
compiled_model = make_model(dev)
t0 = time.perf_counter()
compiled = train(compiled_model, torch.compile(compiled_model, backend=backend, dynamic=False))
print(f"compiled run, backend={backend!r}: {time.perf_counter() - t0:.1f} s, its compile included")
print("eager losses:   ", [round(v, 4) for v in eager])
print("compiled losses:", [round(v, 4) for v in compiled])
tol = 1e-5 if dev.type == "cpu" else 2e-2
assert torch.allclose(torch.tensor(compiled), torch.tensor(eager), atol=tol), (compiled, eager)
if lazy is not None:
    assert torch.allclose(torch.tensor(lazy), torch.tensor(eager), atol=max(tol, xla_tol)), (lazy, eager)
    print(f"lazy, eager and compiled agree within {max(tol, xla_tol):g}")
else:
    print(f"eager and compiled agree within {tol:g}")

# %% [markdown]
# The last line says which engines ran and how closely their losses agree: lazy, eager and compiled, or eager and
# compiled where torch_xla is missing. The printed time is mostly the compile. The compiled run's first step waited for
# it; the others reused the graph.
#
# What changed for the code: nothing but the lines that talk to the engine. The lazy loop needs `torch_xla.sync()` to
# run anything. Eager code runs without it. Under `torch.compile` the graph boundary is the compiled function: a call
# runs the whole graph. Both stacks share one rule: keep the losses on the device and read them once.
#
# On TorchTPU (*read from torch-tpu 0.2.0's sources*): `torch_tpu/_loader.py` wraps `torch.compile`. With no backend
# given, it picks `"tpu"` for TPU inputs and sets `dynamic=False`. For CPU inputs it picks the CPU default of
# `torch_tpu/_internal/compile/_backend.py`: Inductor, or `aot_eager` where no C++ compiler is found. Inductor on TPU
# inputs raises unless `options={"tpu_backend": "pallas"}`. `torch.tpu.set_eager_mode` and `torch.tpu.EagerMode`
# choose among eager modes (`torch_tpu/_internal/public_api.py`); what each mode does on a chip is *not verified
# here*.

# %% [markdown]
# ## 3. The IR, the HLO and the metrics report → the compiled graph, recompile logs and the profiler
# Under torch_xla you read a pending step's graph as IR or HLO, and counted compiles in the metrics report. Each has a
# counterpart under `torch.compile`:
#
# | torch_xla | `torch.compile` (TorchTPU, GPUs, CPU) |
# |---|---|
# | `_get_xla_tensors_text` (IR), `_get_xla_tensors_hlo` (HLO) | `torch._dynamo.explain(fn)(*args)`: the FX graphs, their ops, the breaks |
# | `CompileTime` in the metrics report | `explain`'s graph count; Dynamo's counters |
# | `PT_XLA_DEBUG_LEVEL`, the recompile detective | `TORCH_LOGS=recompiles`: the guard that failed |
# | `xp.trace` and XProf (notebook 04) | `torch.profiler`; on TorchTPU a Kineto backend for the chip |
#
# The torch_xla side first: one step recorded but not yet run, read as IR and as HLO.

# %%
def forward_loss(model, x, y):
    return F.cross_entropy(model(x), y)


if HAVE_XLA:
    model_x = make_model(xdev)
    pending = forward_loss(model_x, batches[0][0].to(xdev), batches[0][1].to(xdev))
    ir = torch_xla._XLAC._get_xla_tensors_text([pending])
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([pending])
    print(f"IR: {len(ir.splitlines())} lines; HLO: {len(hlo.splitlines())} lines; first IR nodes:")
    print("\n".join(ir.splitlines()[1:4]))
    assert "xla::device_data" in ir and "dot(" in hlo  # the weights as device data; the matmuls in the HLO
    torch_xla.sync()
else:
    print("no torch_xla here: the IR and the HLO are skipped")

# %% [markdown]
# The IR lists the step's ops as XLA nodes; its first nodes are the inputs, the weights among them. The HLO is the
# program XLA compiles, with `dot` instructions for its matmuls.
#
# The compiled side has no IR to print before a run. `torch._dynamo.explain` runs the function once under Dynamo and
# reports what it captured: the FX graphs, their ops, and every graph break with its reason.

# %%
import torch._dynamo

model_c = make_model(dev)
ex = torch._dynamo.explain(forward_loss)(model_c, *(t.to(dev) for t in batches[0]))
print(f"explain: {ex.graph_count} graph(s), {ex.graph_break_count} break(s), {ex.op_count} ops captured")
print("\n".join(ex.graphs[0].code.strip().splitlines()[:6]))
assert ex.graph_count == 1 and ex.graph_break_count == 0

# %% [markdown]
# One graph, no breaks: the whole forward and loss were captured. The printed code is the FX graph's Python form,
# what the backend compiles. On TorchTPU the backend turns this graph into MLIR (`fx_to_mlir` in
# `torch_tpu/_internal/compile/compiler.py`). With `TORCH_TRACE` set, it writes that program into the trace as an
# artifact named `torchtpu_stablehlo_graph`: the counterpart of torch_xla's HLO (*read from the sources; not verified
# here*).
#
# ### A recompile, seen from both sides
# A new batch shape is a new graph on both stacks. The cell below feeds one batch of 24 rows after the batches of
# `P.batch_size`. On the compiled side, `torch._logging.set_logs(recompiles=True)` is the in-code form of
# `TORCH_LOGS=recompiles`. It logs the guard that failed, and a handler keeps its message. On the torch_xla side
# `CompileTime` counts one more compile.

# %%
import logging


class Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def fwd(x):
    return torch.relu(x @ torch.ones(64, 8, device=x.device)).sum(dim=1)


short = X[:24].to(dev)
kept, dynamo_log = Kept(), logging.getLogger("torch._dynamo")
torch._logging.set_logs(recompiles=True)
dynamo_log.addHandler(kept)
try:
    step_fn = torch.compile(fwd, backend=backend, dynamic=False)
    step_fn(batches[0][0].to(dev))
    step_fn(short)  # 24 rows: a guard on dim 0 fails
finally:
    dynamo_log.removeHandler(kept)
    torch._logging.set_logs()
recompiles = [m for m in kept.messages if "Recompiling" in m]
print(recompiles[0].splitlines()[-1].strip() if recompiles else "no recompile logged")
assert len(recompiles) == 1 and f"expected {B}, actual 24" in recompiles[0]
if HAVE_XLA:
    before = compiles()
    fwd(batches[0][0].to(xdev)), torch_xla.sync()
    seen = compiles()
    fwd(short.cpu().to(xdev)), torch_xla.sync()
    print(f"torch_xla: batch {B}, {seen - before} compile(s); then batch 24, {compiles() - seen} more")
    assert compiles() - seen == 1
else:
    print("no torch_xla here: its side of the recompile is skipped")

# %% [markdown]
# The first line is the guard that failed, as `TORCH_LOGS=recompiles` prints it: the tensor, its dimension, and the
# size expected and found. The log above the output shows the whole message. torch_xla says less: one more
# `CompileTime`, with no reason attached. Notebook 04's recompile detective had to find the reason by comparing
# graphs.
#
# ### The profiler
# `torch.profiler` records what each step ran. A compiled step shows up as a `Torch-Compiled Region`, with Dynamo's
# cache lookup before it. On TorchTPU, `torch_tpu/_loader.py` registers a Kineto backend for the chip, and
# `torch.tpu.profiler.TpuProfilerConfig` (`torch_tpu/_internal/profiler/profiler_config.py`) passes XLA's profiler
# options (*read from the sources; not verified here*).

# %%
import torch.profiler as tprof

with tprof.profile(activities=[tprof.ProfilerActivity.CPU]) as prof:
    step_fn(batches[0][0].to(dev))
names = [e.key for e in prof.key_averages()]
regions = sorted(n for n in names if n.startswith("Torch-Compiled Region"))
print("compiled regions:", regions, "| Dynamo's cache lookup:", "TorchDynamo Cache Lookup" in names)
assert regions and "TorchDynamo Cache Lookup" in names

# %% [markdown]
# The compiled step ran as one region, after Dynamo checked its guards. Without a GPU, the profiler may also print an
# `ERROR` line about `gpuGetDeviceCount`: it looked for a GPU to trace and found none. Nothing failed.

# %% [markdown]
# ## 4. `mark_sharding` → DTensor placements on a `DeviceMesh`
# Notebook 03 sharded with GSPMD: one process drives every device, and `xs.mark_sharding(t, mesh, partition_spec)`
# annotates a tensor. The partition spec has one entry per **tensor** dimension, naming the mesh axis that splits it,
# or `None`. XLA's partitioner then inserts the collectives.
#
# TorchTPU shards the way notebook 08 did: one process per chip, a `DeviceMesh` over the processes, and a DTensor
# whose `placements` have one entry per **mesh** axis: `Shard(d)` splits tensor dimension d along that axis,
# `Replicate()` copies the tensor. torch.distributed issues the collectives. The same layout, written both ways:
#
# | | torch_xla (GSPMD) | TorchTPU (DTensor) |
# |---|---|---|
# | mesh | `xs.Mesh(device_ids, (4, 1), ("data", "model"))` | `init_device_mesh("tpu", (4, 1), mesh_dim_names=("data", "model"))` |
# | batch split on "data" | `xs.mark_sharding(x, mesh, ("data", None))` | `distribute_tensor(x, mesh, [Shard(0), Replicate()])` |
# | a rank's piece | `xt.local_shards[i]` | `dt.to_local()` |
#
# The cell below lays out a 10 × 6 weight both ways over 4 devices. 10 rows do not split evenly over 4. The DTensor
# side runs on torch's test process group `"fake"` (`torch.testing._internal.distributed.fake_pg`), as notebook 08
# did: one process stands in for each rank in turn. Its shapes are real; it moves no data. The torch_xla side needs
# exactly 4 XLA devices: the virtual ones here, or a TPU host with 4 chips. Elsewhere it says so and is skipped.

# %%
import warnings

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

w = torch.arange(60.0).reshape(10, 6)
dtensor_rows = []
for rank in range(4):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        fake_mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("data", "model"))
        dtensor_rows.append(distribute_tensor(w, fake_mesh, [Shard(0), Replicate()]).to_local().shape[0])
    finally:
        dist.destroy_process_group()
print("DTensor [Shard(0), Replicate()], rows per rank:", dtensor_rows)
assert dtensor_rows == [3, 3, 3, 1]  # torch.chunk's split: ceil(10 / 4) = 3 rows a rank until the rows run out
if HAVE_XLA and n_xla == 4:
    xt = xs.mark_sharding(w.to(xdev), xmesh, ("data", None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch_xla 2.9's unpadded_data indexes with a list, which torch deprecates
        held = [tuple(s.data.shape) for s in xt.local_shards]
        real = [s.unpadded_data.shape[0] for s in xt.local_shards]
    print(f"torch_xla ('data', None): {torch_xla._XLAC._get_xla_sharding_spec(xt.global_tensor)}; "
          f"each device holds {held}, of which real rows {real}")
    assert real == dtensor_rows and {h[0] for h in held} == {3}  # the same rows; XLA pads the last shard
else:
    print("no torch_xla here, or not 4 XLA devices: the mark_sharding side is skipped")

# %% [markdown]
# Both layouts give each rank the same rows: 3, 3, 3 and 1. They differ in what a device holds. XLA pads every shard
# to one size, so the last device holds 3 rows, 2 of them padding. DTensor's `Shard` splits like `torch.chunk`, so the
# last rank holds 1 row. FSDP2 pads its own shards, as notebook 09 measured.
#
# On TorchTPU (*read from torch-tpu 0.2.0's sources; not verified here*): the process group backends are named
# `"tpu"` and `"tpu_dist"`. `torch_tpu/_loader.py` registers them when it finds chips. `torch.tpu.topology_aware_mesh`
# (`torch_tpu/_internal/distributed/device_mesh.py`) returns a rank layout that follows the chips' links, to pass to
# `DeviceMesh`. `torch_tpu/_internal/distributed/from_local.py` makes `DTensor.from_local` warn when its shape and
# stride are left out.
#
# Exercise 1 asks you to turn any partition spec into placements. Exercise 2 asks which shape any rank keeps.

# %% [markdown]
# ## 5. The device loader → a DataLoader with pinned copies
# Notebook 01 fed the chip through torch_xla's `ParallelLoader`, inside `labkit.DeviceLoader`. A background thread
# copies each batch to the device, a few batches ahead, and under SPMD shards it on "data" as it copies.
#
# TorchTPU's public API has no loader of its own (`torch_tpu/_internal/public_api.py` lists none). The feed is
# upstream torch's: a `DataLoader` with `pin_memory=True`, so that batches sit in page-locked host memory, then
# `.to(device, non_blocking=True)`. With one process per chip, each process loads its own share of the data.
# Whether `pin_memory` pins for the `tpu` device is not in TorchTPU's Python sources (*not verified here*).
#
# The cell below feeds the same batches both ways and compares them.

# %%
from torch.utils.data import DataLoader, TensorDataset

ds = TensorDataset(X[: P.steps * B], Y[: P.steps * B])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # without an accelerator, torch warns that pin_memory does nothing
    host = DataLoader(ds, batch_size=B, drop_last=True, pin_memory=True)
    fed = [(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)) for x, y in host]
    first = next(iter(host))[0]
print(f"DataLoader: {len(fed)} batches of {tuple(fed[0][0].shape)}; pinned: {first.is_pinned()} "
      f"(an accelerator here: {torch.accelerator.is_available()})")
assert all(torch.equal(a.cpu(), b) and torch.equal(c.cpu(), d) for (a, c), (b, d) in zip(fed, batches))
if HAVE_XLA:
    import torch_xla.distributed.parallel_loader as pl

    xla_fed = list(pl.MpDeviceLoader(host, xdev, input_sharding=xs.ShardingSpec(xmesh, ("data", None))))
    spec = torch_xla._XLAC._get_xla_sharding_spec(xla_fed[0][0])
    print(f"MpDeviceLoader: {len(xla_fed)} batches on {xla_fed[0][0].device}, images sharded as {spec}")
    assert all(torch.equal(a.cpu(), b) for (a, _), (b, _) in zip(xla_fed, batches)) and "devices=" in spec
else:
    print("no torch_xla here: the device loader is skipped")

# %% [markdown]
# Both feeds deliver the same batches. The DataLoader line says whether the batch was pinned. Pinning needs an
# accelerator: on a plain CPU torch skips it, and the copy to the CPU is no copy at all. The torch_xla loader line
# shows the batches on the XLA device, already sharded over the mesh.
#
# `drop_last=True` keeps every batch the same shape, on both stacks. A short last batch would be a new graph under
# `torch.compile(dynamic=False)` too (section 3's recompile).

# %% [markdown]
# ## 6. `xm.optimizer_step` → DDP and FSDP2
# Section 2's lazy loop called `xm.optimizer_step(opt)`. With several processes (`xmp.spawn`), it all-reduces the
# gradients and then steps. With one process, or under SPMD, there is nothing to reduce: it is `opt.step()`. Under
# SPMD the partitioner inserts the reductions itself.
#
# With one process per chip, as on TorchTPU, the reduction moves into the model's wrapper. DDP all-reduces the
# gradients during the backward. FSDP2's `fully_shard` keeps each weight as a sharded DTensor, gathers it for the
# forward and reduce-scatters its gradient. The optimizer is plain `opt.step()`.
#
# Below, both wrappers train on a gloo process group of one process. It is a real group: every collective runs,
# over one rank. On a TPU host the group would be `dist.init_process_group("tpu")`, one process per chip (*read from
# `torch_tpu/_loader.py`; not verified here*).

# %%
import inspect

from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def fsdp2(model):
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


cpu = torch.device("cpu")  # gloo runs on the CPU
ddp = train(DDP(make_model()), device=cpu)
sharded = fsdp2(make_model())
fsdp = train(sharded, device=cpu)
print("DDP losses:  ", [round(v, 4) for v in ddp])
print("FSDP2 losses:", [round(v, 4) for v in fsdp])
print("FSDP2's first weight:", type(sharded[0].weight).__name__, sharded[0].weight.placements)
reference = eager if dev.type == "cpu" else train(make_model(), device=cpu)
assert ddp == reference and fsdp == reference  # one process: the same arithmetic, to the last bit
assert isinstance(sharded[0].weight, torch.distributed.tensor.DTensor)
if HAVE_XLA:
    print("xm.optimizer_step all-reduces through xm.reduce_gradients:", "all_reduce" in inspect.getsource(xm.reduce_gradients))

# %% [markdown]
# On one process DDP and FSDP2 compute exactly the eager losses. FSDP2's weights are DTensors, `Shard(0)` on a mesh
# of one. Notebook 09 counted what they cost on 2 processes: DDP one all-reduce of the gradients a step; FSDP2
# all-gathers and reduce-scatters per unit.

# %% [markdown]
# ## 7. torch_xla's persistent cache → `torch.compile`'s caches
# torch_xla keeps compiled XLA programs in a folder (`xr.initialize_cache`, labkit's `compile_cache`). A second process
# finds them by the graph's hash. On a TPU it loads them instead of compiling. On XLA:CPU it writes them but cannot
# load them (`labkit/compile_cache.py` records the measurement).
#
# `torch.compile` keeps several caches. Dynamo's in-memory cache holds guarded graphs per function.
# AOTAutograd's cache and Inductor's FX graph cache are on disk (`TORCHINDUCTOR_CACHE_DIR`, under the temporary folder
# by default). `torch.compiler.save_cache_artifacts()` packs them into bytes that another machine can load with
# `load_cache_artifacts()`. TorchTPU's backend goes through AOTAutograd's cache too: `torch_tpu/_internal/compile/
# _backend.py` bundles its compiled programs into `AOTAutogradCache` entries (*read from the sources; not verified
# here*).
#
# The torch_xla side first: what section 2's runs left in the cache folder.

# %%
if HAVE_XLA:
    files = os.listdir(xla_cache)
    misses = met.counter_value("PersistentCacheMiss") or 0
    print(f"torch_xla's cache: {len(files)} file(s) written, {misses} lookup(s) missed (programs compiled and saved)")
    assert len(files) >= 1 and misses >= 1
else:
    print("no torch_xla here: its persistent cache is skipped")

# %% [markdown]
# Each miss is a graph that was not in the folder: XLA compiled it and saved it there. A second process would look
# them up by hash.
#
# Now `torch.compile`'s disk caches, with Inductor. The cell compiles a small function. `torch._dynamo.reset()` then
# forgets every compiled graph, as a new process would. The second compile looks the graph up on disk. Inductor's
# counters say what happened.

# %%
from torch._dynamo.utils import counters


def small(x, w):
    return torch.relu(x @ w).sum(dim=1)


args = (torch.randn(8, 16), torch.randn(16, 4))
counters.clear()
torch._dynamo.reset()
try:
    t0 = time.perf_counter()
    torch.compile(small, backend="inductor", dynamic=False)(*args)
    first = time.perf_counter() - t0, dict(counters["inductor"])
    torch._dynamo.reset()  # as a new process: nothing compiled in memory
    t0 = time.perf_counter()
    torch.compile(small, backend="inductor", dynamic=False)(*args)
    second = time.perf_counter() - t0, dict(counters["inductor"])
    packed = torch.compiler.save_cache_artifacts()
except Exception as e:  # noqa: BLE001 - no C++ compiler, for one: say so and go on
    print(f"Inductor could not compile here ({type(e).__name__}): the cache demonstration is skipped")
    first = None
if first:
    print(f"first compile {first[0]:.1f} s, FX graph cache hits {first[1].get('fxgraph_cache_hit', 0)}, "
          f"misses {first[1].get('fxgraph_cache_miss', 0)}")
    print(f"after reset   {second[0]:.2f} s, hits {second[1].get('fxgraph_cache_hit', 0)}")
    print(f"save_cache_artifacts(): {len(packed[0]):,d} bytes to carry to another machine" if packed else "nothing packed")
    assert second[1].get("fxgraph_cache_hit", 0) == first[1].get("fxgraph_cache_hit", 0) + 1

# %% [markdown]
# The first compile either missed the disk cache and wrote to it, or hit an entry that an earlier run of this
# notebook left: the first line says which. The compile after the reset hit the cache and skipped Inductor's code
# generation; the second line gives its time. The last line is the cache packed as bytes, for a machine whose folder
# is empty.

# %% [markdown]
# ## 8. What carries over unchanged
# Four habits of the course hold on both stacks, as they are. Each gets one check below, run on both sides where
# torch_xla is here.
#
# **Static shapes and buckets.** Section 3 showed that a new batch shape is a new graph on both stacks. The fix is
# the same: pad the batch to a bucket on the host and mask the padded rows out of the loss (notebooks 00 and 02).
# The cell pads the 24-row batch to `P.batch_size` rows. It checks that no new graph appears, and that the masked
# loss equals the loss of the 24 real rows.

# %%
def masked_loss(model, x, y, mask):
    per_row = F.cross_entropy(model(x), y, reduction="none")
    return (per_row * mask).sum() / mask.sum()


def pad(x, y, rows):
    n = x.shape[0]
    mask = torch.cat([torch.ones(n), torch.zeros(rows - n)])
    return F.pad(x, (0, 0, 0, rows - n)), F.pad(y, (0, rows - n)), mask


xs24, ys24 = X[:24], Y[:24]
padded = pad(xs24, ys24, B)
model_p = make_model(dev)
kept = Kept()
torch._logging.set_logs(recompiles=True)
dynamo_log.addHandler(kept)
try:
    loss_fn = torch.compile(masked_loss, backend=backend, dynamic=False)
    full = loss_fn(model_p, *(t.to(dev) for t in pad(*batches[0], B)))
    short_loss = loss_fn(model_p, *(t.to(dev) for t in padded))
finally:
    dynamo_log.removeHandler(kept)
    torch._logging.set_logs()
plain = F.cross_entropy(make_model(dev)(xs24.to(dev)), ys24.to(dev))
print(f"compiled: batch {B}, then 24 rows padded to {B}: {len(kept.messages)} recompile(s); "
      f"masked loss {short_loss.item():.5f}, loss of the 24 rows {plain.item():.5f}")
assert not kept.messages and torch.allclose(short_loss, plain, atol=1e-5)
if HAVE_XLA:
    model_xp = make_model(xdev)
    masked_loss(model_xp, *(t.to(xdev) for t in pad(*batches[0], B))), torch_xla.sync()
    seen = compiles()
    masked_loss(model_xp, *(t.to(xdev) for t in padded)), torch_xla.sync()
    print(f"torch_xla: the padded batch compiled {compiles() - seen} new graph(s)")
    assert compiles() == seen
else:
    print("no torch_xla here: its side of the buckets is skipped")

# %% [markdown]
# No new graph on either side, and the mask makes the padded loss the real one.
#
# **No host reads in the loop.** Under torch_xla, `.item()` inside the step cuts the trace and waits for the device
# (notebook 04's sync finder). Under `torch.compile` it is a graph break: the graph ends there, the host reads the
# value, and a second graph starts. On TorchTPU the read also waits for the chip to finish its queue (its
# documentation; *not verified here*). The cell counts the break with `explain` and the transfer with torch_xla's
# metrics.

# %%
def step_with_read(model, x, y):
    loss = forward_loss(model, x, y)
    scale = 0.5 if loss.item() > 10 else 1.0  # a host read: Python needs the number to choose
    return loss * scale


ex = torch._dynamo.explain(step_with_read)(make_model(dev), *(t.to(dev) for t in batches[0]))
print(f"compiled: {ex.graph_count} graphs, {ex.graph_break_count} break: {str(ex.break_reasons[0].reason).splitlines()[0]}")
assert ex.graph_count == 2 and ex.graph_break_count == 1
if HAVE_XLA:
    reads = (met.metric_data("TransferFromDeviceTime") or [0])[0]
    step_with_read(make_model(xdev), *(t.to(xdev) for t in batches[0]))
    print("torch_xla: device-to-host transfers during the step:", met.metric_data("TransferFromDeviceTime")[0] - reads)
    assert met.metric_data("TransferFromDeviceTime")[0] > reads
else:
    print("no torch_xla here: its side of the host read is skipped")

# %% [markdown]
# The compiled step splits in two at `.item()`, and the reason names it. Dynamo also prints its own warning about
# the break, with the line that caused it. On torch_xla the same line costs a device-to-host transfer. The fix is
# the same on both: keep the value on the device (`torch.where`), and read once per log interval.
#
# **Checkpoints.** torch.distributed.checkpoint (DCP) writes each process's shards into one folder and loads them
# into any layout (notebooks 08 and 09). It is upstream torch, so it is TorchTPU's checkpoint format as it is. The
# cell saves section 6's FSDP2 model and loads it into a fresh one. torch_xla has DCP planners of its own for SPMD
# (`torch_xla.experimental.distributed_checkpoint`); here the cell only checks that they are installed.

# %%
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

ck = tempfile.mkdtemp(prefix="labkit-nb10-dcp-")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch 2.9's DCP writer touches TypedStorage, deprecated
    dcp.save({"model": get_model_state_dict(sharded)}, checkpoint_id=ck)
    fresh = fsdp2(make_model())
    torch.nn.init.zeros_(fresh[0].weight)
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=ck)
    set_model_state_dict(fresh, state["model"])
same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(sharded.parameters(), fresh.parameters()))
print(f"DCP folder {sorted(os.listdir(ck))}; FSDP2 weights equal after load: {same}")
assert same
if HAVE_XLA:
    print("torch_xla's DCP planners installed:", importlib.util.find_spec("torch_xla.experimental.distributed_checkpoint") is not None)
dist.destroy_process_group()

# %% [markdown]
# **The FLOP and byte arithmetic.** A step's FLOPs and bytes belong to the model and the batch, not to the engine.
# torch's `FlopCounterMode` counts the matmuls that run. The cell counts one training step on the CPU, and the same
# step traced on the XLA device.

# %%
from torch.utils.flop_counter import FlopCounterMode


def count_step_flops(device):
    model = make_model(device)
    x, y = (t.to(device) for t in batches[0])
    with FlopCounterMode(display=False) as fc:
        F.cross_entropy(model(x), y).backward()
    return fc.get_total_flops()


cpu_flops = count_step_flops("cpu")
weights = sum(p.numel() for p in make_model().parameters())
print(f"one step, batch {B}: {cpu_flops:,d} FLOPs counted on the CPU; {weights:,d} weights, {4 * weights:,d} B in float32")
if HAVE_XLA:
    xla_flops = count_step_flops(xdev)
    torch_xla.sync()
    print(f"the same step traced by torch_xla: {xla_flops:,d} FLOPs")
    assert xla_flops == cpu_flops
else:
    print("no torch_xla here: its count is skipped")

# %% [markdown]
# The count is the same on both stacks: the engine changes how the matmuls run, not how many there are. The weights'
# bytes, and notebook 09's 16 B a weight under AdamW, stay as they are too. Exercise 3 asks you to predict that count
# from the layer sizes.

# %% [markdown]
# ### Exercise 1 (10.placements): a partition spec, written as placements
# Write `placements(partition_spec, mesh_axes)`. `partition_spec` is what `xs.mark_sharding` takes: one entry per
# **tensor** dimension, a mesh axis name or `None`. `mesh_axes` are the mesh's axis names, in order. Return DTensor's
# placements for the same layout: a list with one entry per **mesh** axis, `Shard(d)` where tensor dimension d names
# that axis, else `Replicate()`.
#
# For example, `("data", None)` on the axes `("data", "model")` gives `[Shard(0), Replicate()]`. The checker asks
# about 5 specs over meshes of 2 and 3 axes, drawn anew each time. DTensor's own layout functions are refused while
# your function runs.

# %%
# your turn
def placements(partition_spec, mesh_axes):
    return ...


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():

    def placements(partition_spec, mesh_axes):
        out = []
        for axis in mesh_axes:
            out.append(Shard(partition_spec.index(axis)) if axis in partition_spec else Replicate())
        return out


# %%
if exercises.check("10.placements", lambda: nb10.check_placements(placements)):
    print("Megatron's column split, (None, 'model') on ('data', 'model'):", placements((None, "model"), ("data", "model")))

# %% [markdown]
# ### Exercise 2 (10.local_shape): the rows one rank keeps
# Write `local_shape(shape, mesh_shape, placements, coord)`: the shape of the piece the rank at mesh coordinate
# `coord` keeps, for a tensor of `shape` laid out with `placements` on a mesh of `mesh_shape`. Each `Shard(d)` splits
# dimension d over that mesh axis the way `torch.chunk` does: ceil(n / k) a rank, in order, until nothing is left.
# So the last ranks can keep less, or nothing. `Replicate()` leaves the dimension whole.
#
# Section 4's weight is one case: `local_shape((10, 6), (4,), [Shard(0)], (3,))` is `(1, 6)`. The checker asks about
# 6 uneven splits on 1-D and 2-D meshes, drawn anew. Once it passes, the cell compares your function with the rows
# DTensor gave each rank in section 4.

# %%
# your turn
def local_shape(shape, mesh_shape, placements, coord):
    return ...


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():
    import math

    def local_shape(shape, mesh_shape, placements, coord):
        out = list(shape)
        for k, c, p in zip(mesh_shape, coord, placements):
            if isinstance(p, Shard):
                rows = math.ceil(out[p.dim] / k)
                out[p.dim] = max(0, min(rows, out[p.dim] - c * rows))
        return tuple(out)


# %%
if exercises.check("10.local_shape", lambda: nb10.check_local_shape(local_shape)):
    mine = [local_shape((10, 6), (4, 1), [Shard(0), Replicate()], (r, 0))[0] for r in range(4)]
    print("your rows per rank:", mine, "| DTensor's in section 4:", dtensor_rows)
    assert mine == dtensor_rows

# %% [markdown]
# ### Exercise 3 (10.step_flops): the FLOPs of a training step
# Write `step_flops(batch, sizes)`: the FLOPs of one training step (forward and backward) of an MLP whose Linear
# layers go `sizes[0] → sizes[1] → ...`, at `batch` rows. Count the matmuls only, as `FlopCounterMode` does: biases
# and activations are left out. A multiply-add is 2 FLOPs. Count three parts per layer:
#
# - the forward matmul, `batch × in × out` multiply-adds;
# - the weight's gradient, as many;
# - the input's gradient, as many, for every layer but the first: the first layer's input is the data, which needs no
#   gradient.
#
# The checker asks about this notebook's MLP and three MLPs drawn anew. Once it passes, the cell compares your count
# with the one `FlopCounterMode` gave in section 8.

# %%
# your turn
def step_flops(batch, sizes):
    return ...


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():

    def step_flops(batch, sizes):
        total = 0
        for n, (i, o) in enumerate(zip(sizes[:-1], sizes[1:])):
            total += 2 * batch * i * o * (2 if n == 0 else 3)
        return total


# %%
if exercises.check("10.step_flops", lambda: nb10.check_step_flops(step_flops)):
    mine = step_flops(B, [64, P.hidden, 10])
    print(f"your count for this notebook's step: {mine:,d}; FlopCounterMode's: {cpu_flops:,d}")
    assert mine == cpu_flops

# %% [markdown]
# ## What you saw
# Each row names where it was verified. *CPU*: the plain CPU, the stand-in for TorchTPU's engine. *XLA:CPU*: torch_xla
# 2.9 with `PJRT_DEVICE=CPU`. *Sources*: read from torch-tpu 0.2.0's wheel, file named; nothing of TorchTPU ran here,
# because it needs TPU chips.
#
# | torch_xla idea | TorchTPU counterpart | verified here by |
# |---|---|---|
# | `torch_xla.sync()`, the lazy graph | eager by default; `torch.compile(backend="tpu", dynamic=False)` | CPU and XLA:CPU: equal losses (section 2); `"tpu"` picked for TPU inputs, `dynamic=False`: sources, `_loader.py` |
# | IR, HLO | `torch._dynamo.explain`: FX graphs, ops, breaks | CPU: one graph, no break; XLA:CPU: IR and HLO read (section 3) |
# | `CompileTime`, the recompile detective | `TORCH_LOGS=recompiles`: the failed guard | CPU: the guard logged; XLA:CPU: one more compile (section 3) |
# | `xp.trace`, XProf | `torch.profiler`; a Kineto backend for the chip | CPU: a `Torch-Compiled Region` recorded; the backend and `TpuProfilerConfig`: sources, `_loader.py`, `profiler_config.py` |
# | `mark_sharding`, `xs.Mesh` | DTensor `Shard`/`Replicate` on a `DeviceMesh`; `topology_aware_mesh` | CPU (fake process group) and XLA:CPU: the same rows a rank, XLA's padded (section 4); the mesh helper: sources, `device_mesh.py` |
# | `ParallelLoader`, `labkit.DeviceLoader` | `DataLoader(pin_memory=True)`, `.to(device, non_blocking=True)` | CPU and XLA:CPU: the same batches (section 5); pinning for `tpu`: not verified |
# | `xm.optimizer_step` | DDP, FSDP2 on a `"tpu"` process group | CPU (gloo, one process): losses equal eager (section 6); the `"tpu"` backends: sources, `_loader.py` |
# | the persistent cache | Dynamo's, AOTAutograd's and Inductor's caches; `save_cache_artifacts` | XLA:CPU: files written; CPU: a hit after reset (section 7); TorchTPU's use of AOTAutograd's cache: sources, `compile/_backend.py` |
# | static shapes, buckets | the same | CPU and XLA:CPU: no new graph for a padded batch (section 8) |
# | no host reads in the loop | the same: `.item()` is a graph break | CPU: a break counted; XLA:CPU: a transfer counted (section 8) |
# | checkpoints | DCP, upstream torch | CPU (gloo): an FSDP2 save and load (section 8) |
# | FLOP and byte arithmetic | the same | CPU and XLA:CPU: equal FLOP counts (section 8) |
#
# The CPU rows also ran with torch 2.11 and torch-tpu 0.2.0 installed (Python 3.13, no chips, no torch_xla), with the
# same losses and counts. Notebook 08 also ran on an NVIDIA H200 (README's time table): the compiled engine itself is
# verified on a GPU. No row here was run on a TPU, with either stack.
#
# What stays unverified until TorchTPU runs on a chip: what `backend="tpu"` compiles and how fast it runs; what each
# eager mode queues; the `"tpu"` process groups and `topology_aware_mesh`; whether `pin_memory` pins for the `tpu`
# device; TorchTPU's compiled programs found again in AOTAutograd's cache by a second process; its Kineto backend in a
# profile.
#
# Next, the appendix: notebook 05 serves the trained models on a CPU.

# %%
passed = sum(exercises.results.get(n, False) for n in ("10.placements", "10.local_shape", "10.step_flops"))
print(f"exercises passed: {passed} of 3")
