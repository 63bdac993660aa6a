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
# # The compiled engine: torch.compile and DTensor, the step GPUs and TorchTPU run
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/labkit/labkit/blob/main/notebooks/08_the_compiled_engine.ipynb)
#
# The notebooks before this one (00, 04, 01, 06, 02, 03) taught one engine: torch_xla's lazy tensors, traced and
# compiled by XLA. This notebook teaches the other one. A GPU runs it today, and TorchTPU runs it on a TPU: eager
# PyTorch, compiled where you ask with `torch.compile`, sharded with DTensor. Everything is first written by hand with
# torch's own public APIs. By the end you can:
#
# - compile a whole training step (model, backward, optimizer) with `torch.compile(dynamic=False)`, say which graphs
#   it is made of and why, and check that it computes the eager losses;
# - find a graph break with `torch._dynamo.explain`, which gives its reason and line;
# - find a recompile by the guard that failed, fix both, and prove none is left with
#   `torch.compiler.set_stance("fail_on_recompile")`;
# - keep an optimizer's state on the device (`capturable=True`, a tensor learning rate), so that a schedule does not
#   compile a new graph each step;
# - measure what the host pays to launch each eager op, count a step's ops, and say when a step is host-bound and
#   what a CUDA graph's single launch would save;
# - place tensors and a model on a device mesh with DTensor and FSDP2, and say how FSDP2's layout differs from
#   torch_xla's FSDPv2.
#
# **Time**: 2.5–4 minutes of run time in fast mode on a busy 2-core CPU. Three parts take most of it, and each
# varies with the machine's load. One Inductor compile of the step in section 2 took 14 s on a quiet machine and 59 s
# cold on a busy one. The DTensor run of section 5 took 10 s quiet and 1–3 minutes busy. The Trainer's torchrun
# launches at the end took 19 s quiet and about a minute busy. The other compiles use `backend="aot_eager"` or
# `"eager"` and are quick. Full mode takes about 3 minutes plus the same
# DTensor run. On an NVIDIA H200 the notebook ran in 75 s. Reading and the four exercises take 35-50 minutes.
#
# *Measured on: 2-core CPU at load 12-18, torch 2.9, nbval: 2 min 51 s and 3 min 59 s, solutions off and on.
# GPU: NVIDIA H200 (141 GB), Python 3.12, torch 2.11.0+cu130, unsolved, 2026-11.*
#
# **In the course**: after 03; next: 09. It runs on the engine TorchTPU and GPUs run. It builds on three notebooks:
# 00 for a step and its graphs, 03 for the sharding plans, and 04 for recompiles and syncs.
#
# Every claim below is checked by an `assert`. The exercises print ✓ or ✗ and never stop *Run all*. Their solutions
# are in collapsed cells that run only with `LABKIT_SOLUTIONS=1`, as the test suite runs them.

# %% [markdown]
# ## Parameters

# %% tags=["parameters"]
import dataclasses, os, sys


@dataclasses.dataclass
class Params:
    batch_size: int = 64  # digits images per step (8x8 pixels, 64 features)
    hidden: int = 128  # width of the MLP's hidden layer
    steps: int = 20  # steps of each run
    lr: float = 3e-3  # AdamW
    warmup: int = 5  # linear warm-up steps of section 4's schedule
    seed: int = 0
    compile_backend: str = "inductor"  # section 2's compiler; "tpu" would be TorchTPU's (needs a TPU VM and torch >= 2.11)
    FAST = {"steps": 8, "hidden": 64, "warmup": 3}


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
# ## 1. Why a second engine
# Google now ships a second PyTorch stack for TPUs. Its "PyTorch on Cloud TPU" page (cloud.google.com/tpu/docs, read
# 2026-11-29) puts TorchTPU at the foundation. Its PyTorch/XLA pages carry a banner (read 2026-11-29): PyTorch/XLA "is
# deprecated and replaced by TorchTPU. The PyTorch/XLA repo will be archived on November 15, 2026." torch_xla 2.9.0
# is its last release. Colab's TPU image, as last checked (googlecolab/backend-info, snapshot of 2026-08-19), still
# ships torch 2.9 and torch_xla 2.9.
#
# TorchTPU (`pip install torch_tpu`, github.com/google-pytorch/torch_tpu) does not trace lazily. It runs **eager by
# default** on `torch.device("tpu")`. It compiles what you wrap with `torch.compile(backend="tpu", dynamic=False)`. It
# shards with DTensor on a `DeviceMesh`, one process per chip. That is the engine a GPU already runs, with
# `torch.compile` (Inductor) and DTensor/FSDP2.
#
# TorchTPU **cannot run here**: it needs TPU chips. So every claim about it below is *not verified here*. Its package,
# `torch-tpu` 0.2.0 on PyPI (read 2026-11-29), requires torch ≥ 2.11, ≤ 2.15 and libtpu ≥ 0.0.50, on Python 3.11 to
# 3.13; its `torch.compile` guide says PyTorch 2.10 or later. This notebook relies on the package's requirement. Notebook
# 10 maps each torch_xla idea of the course to TorchTPU, with the names read from that package's sources.
#
# What carries over from the earlier notebooks, and what was torch_xla's:
#
# | lesson | torch_xla (00, 03, 04) | this engine (GPU, TorchTPU) |
# |---|---|---|
# | one graph per input shape; pad to buckets, mask instead of indexing | yes | yes: `dynamic=False` compiles a graph per shape, guarded |
# | a host read stalls the device | `.item()` cuts the trace and syncs | `.item()` is a **graph break** and a sync |
# | a Python number that changes | passed to the device as data (only 0 and 1 are written into the graph: notebook 02) | with `dynamic=False`, a constant **guarded by value**: a new graph per value |
# | `torch_xla.sync()`, the lazy IR, the metrics report, `PT_XLA_DEBUG_LEVEL` | torch_xla's | none: `torch._dynamo.explain`, guards, `TORCH_LOGS` |
# | meshes with named axes, shard/replicate, bytes per device | `xs.Mesh`, `mark_sharding`, GSPMD | `DeviceMesh`, `Shard`/`Replicate`, DTensor, FSDP2 |
# | FSDP's layout | FSDPv2: the largest dimension | FSDP2: dim 0, padded |
#
# This notebook runs on the plain CPU, or on a GPU where there is one, not on XLA.

# %%
import contextlib, inspect, math, time

import torch
import torch._dynamo
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch._dynamo.utils import counters

from labkit.lessons import exercises  # check(), solutions_on(), results
from labkit.lessons.exercises import nb08  # this notebook's checkers

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
rt = labkit.setup(device.type)  # plain torch on this device (not XLA): the engine TorchTPU and GPUs run
backends = torch._dynamo.list_backends()  # leaves out the backends tagged "debug" unless asked
debugging = [b for b in ("eager", "aot_eager") if b in torch._dynamo.list_backends(exclude_tags=())]
print(f"torch {torch.__version__} on {device}; torch.compile's backends here: {backends}")
print(f"and the debugging backends this notebook uses, which list_backends() leaves out by default: {debugging}")
print("TorchTPU's 'tpu' backend installed here:", "tpu" in backends, "(TorchTPU: not verified here)")
assert "inductor" in backends and rt.device.type == device.type
assert debugging == ["eager", "aot_eager"]

# %% [markdown]
# ## 2. A whole training step, compiled by hand
# The data and model of notebook 00: scikit-learn's digits (1,797 real 8×8 images, no download) and a small MLP,
# trained with AdamW. First the eager step, whose losses are the reference.

# %%
digits = load_digits()
X = torch.tensor(digits.data, dtype=torch.float32) / 16.0
Y = torch.tensor(digits.target)
B = P.batch_size
batches = [(X[i : i + B].to(device), Y[i : i + B].to(device)) for i in range(0, P.steps * B, B)]


def make_model():
    torch.manual_seed(P.seed)
    return torch.nn.Sequential(torch.nn.Linear(64, P.hidden), torch.nn.ReLU(), torch.nn.Linear(P.hidden, 10)).to(device)


def eager_run():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=P.lr)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())  # stays on the device: one read at the end
    return torch.stack(losses).tolist()


eager = eager_run()
print("eager losses:", [round(v, 4) for v in eager])
assert eager[-1] < eager[0]

# %% [markdown]
# **Try the obvious thing first**: hand the whole step to Dynamo, `torch.compile`'s front end, and ask it what it
# captured. `torch._dynamo.explain(fn)(*args)` runs `fn` once under Dynamo and reports the graphs it made and every
# *graph break*: a place where Dynamo stops capturing, lets Python run the code, and starts a new graph after it.

# %%
model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=P.lr)


def whole_step(x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


ex = torch._dynamo.explain(whole_step)(*batches[0])
ops = [sum(n.op == "call_function" for n in g.graph.nodes) for g in ex.graphs]
print(f"{ex.graph_count} graphs of {ops} ops, {ex.graph_break_count} graph break(s):")
for r in ex.break_reasons:
    where = r.user_stack[-1] if r.user_stack else None
    print(" -", r.reason.splitlines()[0], f"(line {where.lineno}: {where.line.strip()})" if where else "")
assert ex.graph_count == 2 and ex.graph_break_count == 1
assert "backward" in ex.break_reasons[0].reason, "loss.backward() inside the function is a graph break"
assert ops[0] < ops[1], "the first graph is the forward and the loss; the second, AdamW's update (more ops)"
torch._dynamo.reset()

# %% [markdown]
# Two graphs and one break: the forward with its loss, then, after the break, AdamW's update. Above them the cell
# printed a warning from Dynamo, `[3/0] Profiler function <class 'torch.autograd.profiler.record_function'> will be
# ignored`. It came while `explain` traced `opt.step`. `Optimizer.step` wraps itself in a profiler span, and Dynamo
# leaves profiler spans out of what it compiles. It is harmless here. It means a profile of the compiled update has no
# span named after the optimizer. Dynamo prints it once per process, so the compiled step below does not repeat it.
#
# `loss.backward()` inside a compiled function is a graph break. Dynamo does not trace `Tensor.backward()`, so the
# backward ran eagerly, outside any graph. In torch 2.9 it stays a break with *compiled autograd* on too
# (`torch._dynamo.config.compiled_autograd = True`, left off here). Compiled autograd does not let Dynamo trace through
# `backward()`. It records the backward when it runs, into a graph of its own.
#
# The way that works is to compile **the function that computes the loss**. AOTAutograd then traces its backward
# ahead of time and compiles forward and backward together. A plain `loss.backward()` then runs the compiled backward.
# The optimizer is compiled on its own, and `Optimizer.step` breaks around itself **on purpose**. `_use_grad` in
# `torch/optim/optimizer.py` calls `torch._dynamo.graph_break()` before and after the update. The update is compiled
# as an inference graph that updates the parameters in place. That is why `fullgraph=True` on `opt.step()` raises.
#
# The `explain` output above lists one break, the backward's. It does not list `_use_grad`'s two, although the update
# between them is captured as its second graph. torch's counters (`torch._dynamo.utils.counters["graph_break"]`) do
# count them, and the next cell prints them.
#
# A compiled step is therefore **two graphs as Dynamo counts them**, in `unique_graphs`. One is the loss, forward and
# backward; the other is the optimizer's update. It has two breaks, both torch's own. The backend sees more.
# AOTAutograd traces the loss's forward and backward as one *joint* graph. It then splits it into a forward and a
# backward, compiled separately: the backward only when the first `backward()` runs. So Inductor compiles **three**
# graphs, all in the first step: the forward in `loss_of`, the backward in `loss.backward()`, the update in
# `opt_step`. Later steps compile nothing.
#
# `dynamic=False` makes every shape a constant, as on XLA. A new shape compiles a new graph instead of a graph with
# symbolic sizes. TorchTPU's `torch.compile` guide asks for it (read 2026-11; not verified here). It also makes the
# step's graphs predictable. The backend is one argument, `P.compile_backend`: Inductor here, `"tpu"` on TorchTPU.
#
# The cell times the first step, which compiles, and then every later step alone. Eager and compiled run side by
# side on the same batches. Read the **minimum** of each: the fastest step is the one the rest of the machine disturbed
# least. On a busy machine, a step of about a millisecond can have a median far above its minimum. An average over a
# few steps can then make either engine look many times slower than the other.
#
# So each line gives the minimum, the median and the maximum: the spread says how far the machine moved the steps. The
# cell says which way the minima point, and by how much. Where the two ranges overlap widely, the run cannot order the
# engines.
#
# With Inductor on a machine without a GPU, the cell may also print `No CUDA runtime is found, using CUDA_HOME=...`.
# This torch build was made for CUDA, and Inductor's C++ compiler set-up looks for the CUDA toolkit. The CPU code it
# compiles does not need it.

# %%
torch._dynamo.reset()
counters.clear()
model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=P.lr)


@torch.compile(dynamic=False, backend=P.compile_backend)
def loss_of(x, y):  # forward and loss: one graph; AOTAutograd compiles its backward with it
    return F.cross_entropy(model(x), y)


@torch.compile(dynamic=False, backend=P.compile_backend)
def opt_step():  # the update: its own graph (Optimizer.step breaks around itself)
    opt.step()


def compiled_step(x, y):
    opt.zero_grad(set_to_none=True)
    loss = loss_of(x, y)
    loss.backward()  # runs the compiled backward
    opt_step()
    return loss.detach()


def timed(step, x, y):
    """(seconds, loss) of one step, the device waited for."""
    t0 = time.perf_counter()
    loss = step(x, y)
    rt.wait()
    return time.perf_counter() - t0, loss


first_s, loss0 = timed(compiled_step, *batches[0])
runs = [timed(compiled_step, x, y) for x, y in batches[1:]]
compiled = torch.stack([loss0] + [loss for _, loss in runs]).tolist()
comp_s = sorted(s for s, _ in runs)
graphs = counters["stats"]["unique_graphs"]
breaks = dict(counters["graph_break"])
worst = max(abs(a - b) for a, b in zip(eager, compiled))
model_e = make_model()  # the eager step again, timed the same way on the same batches
opt_e = torch.optim.AdamW(model_e.parameters(), lr=P.lr)


def eager_step(x, y):
    opt_e.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model_e(x), y)
    loss.backward()
    opt_e.step()
    return loss.detach()


timed(eager_step, *batches[0])  # its first step warms up too (allocations, AdamW's state)
eager_s = sorted(timed(eager_step, x, y)[0] for x, y in batches[1:])
med = lambda v: v[len(v) // 2]  # noqa: E731
ratio = comp_s[0] / eager_s[0]
print(f"{P.compile_backend}: first step {first_s:.1f} s (three compiles); {len(comp_s)} later steps, each timed alone:")
print(f"  eager    min {eager_s[0] * 1e3:7.2f} ms, median {med(eager_s) * 1e3:7.2f} ms, max {eager_s[-1] * 1e3:7.2f} ms")
print(f"  compiled min {comp_s[0] * 1e3:7.2f} ms, median {med(comp_s) * 1e3:7.2f} ms, max {comp_s[-1] * 1e3:7.2f} ms")
print(f"at the minimum the compiled step takes {ratio:.2f}x the eager one's time"
      + ("" if 0.5 < ratio < 2 else "; a gap this large on a 1 ms step is worth timing again on a quiet machine"))
print(f"{graphs} graphs; graph breaks: {[k.splitlines()[0] for k in breaks]} x {list(breaks.values())}")
print(f"largest |eager - compiled| loss over {len(compiled)} steps: {worst:.2e}")
assert graphs == 2, "one graph for the loss (with its backward), one for the optimizer's update"
assert sum(breaks.values()) == 2 and all("graph_break()" in k for k in breaks), "only _use_grad's two breaks"
assert worst < 1e-4  # the same maths; Inductor fuses and reorders float sums, so not bit for bit

# %% [markdown]
# ### The same step in `labkit.Trainer`
# labkit's Trainer compiles its step the same way when `TrainConfig(compile="on")`, off XLA. `compile_backend` picks
# the compiler. It compiles the loss with its backward, and `opt.step`. Its losses must be those of the hand-compiled
# step. The cell uses `compile_backend="aot_eager"`: the same graphs as Inductor without a second C++ compile.

# %%
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(X[: P.steps * B], Y[: P.steps * B]), batch_size=B, shuffle=False, drop_last=True
)
model_t = make_model()
opt_t = torch.optim.AdamW(model_t.parameters(), lr=P.lr)
cfg = labkit.TrainConfig(
    epochs=1, max_steps=P.steps, log_every=1, eval_every=0, compile="on", compile_backend="aot_eager"
)
history = labkit.Trainer(model_t, opt_t, rt, cfg, loader).fit()
trained = [r["loss"] for r in history]
worst_t = max(abs(a - b) for a, b in zip(compiled, trained))
print(f"{len(trained)} Trainer steps, largest |hand-compiled - Trainer| = {worst_t:.2e}")
assert len(trained) == len(compiled) and worst_t < 1e-4

# %% [markdown]
# ### Regional compilation: compile one block, reuse it
# A transformer is the same block L times. Compiling the whole model traces all L copies into one large graph, and
# compile time grows with L. *Regional compilation*, PyTorch's recipe of that name, compiles the block instead, with
# `block.compile()` on each. That call compiles the module's `_call_impl` (torch 2.9, `torch/nn/modules/module.py`).
# Dynamo keeps its cache on that function's code object, which every copy shares. So the copies after the first reuse
# the first's graph, as long as their guards pass. The cell measures it on six residual blocks. Its backend only counts
# the graphs it is handed, so nothing is compiled to machine code.

# %%
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        return F.gelu(self.fc(x)) + x


handed = []


def counting(gm, example_inputs):  # a backend: note the graph Dynamo hands over, run it as it is
    handed.append(len(gm.graph.nodes))
    return gm.forward


torch._dynamo.reset()
blocks = [Block() for _ in range(6)]
for b in blocks:
    b.compile(dynamic=False, backend=counting)
h = torch.randn(8, 64)
for b in blocks:
    h = b(h)
regional = list(handed)
torch._dynamo.reset()
handed.clear()


class Stack(torch.nn.Module):  # the whole model, compiled as one
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(6)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


torch.compile(Stack(), dynamic=False, backend=counting)(torch.randn(8, 64))
print(f"regional: {len(regional)} graphs of {regional} nodes for 6 blocks; whole model: {len(handed)} graph of "
      f"{handed} nodes")
assert len(regional) < 6 and len(handed) == 1 and max(regional) < handed[0]
torch._dynamo.reset()

# %% [markdown]
# Two graphs, not six and not one. The first block compiles. The second compiles again, because its input now
# requires grad: it is the first block's output, made from weights that require grad. That is a `requires_grad` guard,
# one of the kinds below. The remaining four pass that graph's guards and reuse it (torch 2.9, measured here with
# `TORCH_LOGS=recompiles`). The win grows with L: on a real transformer, compile time stays that of about one block.
#
# ## 3. A graph break and a recompile, planted, found and fixed
# From here on the lessons are about Dynamo: what it captures and what it guards. Dynamo runs before any backend. So
# the rest compiles with `backend="aot_eager"`: the same capture and the same AOTAutograd forward and backward as
# Inductor, run with eager kernels. A compile then costs milliseconds instead of Inductor's seconds of C++.
#
# **A graph break.** Someone wants to watch the largest activation, and writes it down as a Python float.

# %%
DYNAMO = "aot_eager"


class Watched(torch.nn.Module):
    """The MLP, with a watch on its largest hidden activation."""

    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.peak = 0.0

    def forward(self, x):
        h = self.net[:2](x)
        self.peak = max(self.peak, h.abs().max().item())  # the planted fault: a host read in the forward
        return self.net[2:](h)


ex = torch._dynamo.explain(Watched())(batches[0][0])
(reason,) = ex.break_reasons
where = reason.user_stack[-1]
print(f"{ex.graph_count} graphs, {ex.graph_break_count} break: {reason.reason.splitlines()[0]}")
print(f"at line {where.lineno} of its cell: {where.line.strip()}")
src, start = inspect.getsourcelines(Watched.forward)
planted_line = start + next(i for i, s in enumerate(src) if ".item()" in s)
assert ex.graph_break_count == 1 and "item" in reason.reason and where.lineno == planted_line

# %% [markdown]
# `.item()` needs the number on the host, so Dynamo stops the graph there. The device finishes what came before, and
# the value is copied back: a host sync, as on XLA. Python runs `max`, and a second graph starts. The fix keeps the
# watch on the device: a buffer updated with tensor ops, read once when someone looks at it.
#
# Dynamo's message offers a second fix: `torch._dynamo.config.capture_scalar_outputs = True`. Measured here on this
# model, `explain` then reports one graph and no break: `.item()` is traced as a symbolic number. Weigh it before you
# use it. The watch still ends in a Python float, `self.peak`. So the value still comes back to the host after each
# call: a sync per step, which the buffer below avoids. And the switch is process-wide. It changes how every `.item()`
# in every compiled function is traced: data-dependent numbers become *unbacked* symbols, which some ops cannot take.
# Keep the value a tensor when you can; use the switch when the scalar must be traced.

# %%
class WatchedOnDevice(torch.nn.Module):
    """The same watch, kept on the device: no read, no break."""

    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.register_buffer("peak", torch.zeros((), device=device))

    def forward(self, x):
        h = self.net[:2](x)
        self.peak.copy_(torch.maximum(self.peak, h.detach().abs().max()))
        return self.net[2:](h)


watched = WatchedOnDevice()
ex = torch._dynamo.explain(watched)(batches[0][0])
print(f"{ex.graph_count} graph, {ex.graph_break_count} breaks; peak so far {watched.peak.item():.3f} (read once, here)")
assert ex.graph_count == 1 and ex.graph_break_count == 0
torch._dynamo.reset()

# %% [markdown]
# **A recompile.** A label smoothing that anneals over training is passed to `F.cross_entropy` as a Python float. It
# changes every step. The last batch of the epoch is also smaller. With `dynamic=False` both are constants of the
# graph, checked by a *guard* before each call. When a guard fails, Dynamo compiles again. torch says which guard
# failed, and on which line. `torch._logging.set_logs(recompiles=True)` prints it, as does `TORCH_LOGS=recompiles`.
# The same text is kept in `torch._dynamo.utils.guard_failures`.

# %%
# an epoch of at most 6 steps whose last batch is short (fewer graphs than the recompile limit, 8: section 4)
ragged = batches[: min(5, len(batches) - 1)] + [(batches[-1][0][:12], batches[-1][1][:12])]


def smoothing_at(step):
    return 0.1 * (1 - step / len(ragged))


def run_loss(loss_fn, steps, *, as_tensor=False, stance_after_first=None):
    """Run `loss_fn(model, x, y, smoothing)` compiled, forward and backward, the smoothing a Python float (or a
    tensor); return (losses, graphs, guard failures)."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    f = torch.compile(loss_fn, dynamic=False, backend=DYNAMO)
    out = []
    for step, (x, y) in enumerate(steps):
        s = torch.tensor(smoothing_at(step), device=device) if as_tensor else smoothing_at(step)
        stance = stance_after_first if (stance_after_first and step > 0) else "default"
        with torch.compiler.set_stance(stance):
            loss = f(model, x, y, s)
        loss.backward()
        out.append(loss.detach())
    failures = [r for rs in torch._dynamo.utils.guard_failures.values() for r in rs]
    return torch.stack(out).tolist(), counters["stats"]["unique_graphs"], failures


def smoothed_loss(model, x, y, smoothing):
    return F.cross_entropy(model(x), y, label_smoothing=smoothing)  # the planted fault: a new float every step


def guard_and_line(reason):
    """'guard  <- line N: code' from one of guard_failures' texts ('guard  # code  # file:line in fn')."""
    parts = [p.strip() for p in reason.split("#")]
    line = parts[-1].split(":")[-1].split()[0] if len(parts) > 2 else "?"
    return f"{parts[0]}  <- line {line}: {parts[1]}" if len(parts) > 2 else parts[0]


torch._logging.set_logs(recompiles=True)
planted, graphs, failures = run_loss(smoothed_loss, ragged)
torch._logging.set_logs()
print(f"{len(ragged)} steps, {graphs} graphs ({graphs - 1} recompiles); the guards that failed, first each time:")
for r in dict.fromkeys(guard_and_line(r) for r in failures):
    print("  ", r)
assert graphs == len(ragged)
assert any("smoothing ==" in r and "label_smoothing=smoothing" in r for r in failures)
assert any("size mismatch at index 0" in r for r in failures)

# %% [markdown]
# The guard names the constant (`... == 0.1`) and the line that used it. The fix: make the changing number a
# *tensor*, whose value is data, not a guard. `F.cross_entropy` wants a float, so the smoothing is written out:
# `(1 - s) · NLL + s · mean(−log p)`, which is what `label_smoothing=s` computes.
#
# Then the short batch alone still recompiles, with `size mismatch at index 0`. So that is found next. It is fixed by
# dropping the batch (`drop_last=True`). Padding it to the batch size, with labels the loss ignores, would also work,
# as notebook 00 did.

# %%
def smoothed_loss_fixed(model, x, y, smoothing):  # smoothing: a tensor, a new value each step, the same graph
    logp = F.log_softmax(model(x), dim=-1)
    return (1 - smoothing) * F.nll_loss(logp, y) - smoothing * logp.mean()


fixed_once, graphs, failures = run_loss(smoothed_loss_fixed, ragged, as_tensor=True)
print(f"tensor smoothing, ragged epoch: {graphs} graphs; failed: {[r.split('#')[0].strip() for r in failures]}")
assert graphs == 2 and all("size mismatch at index 0" in r for r in failures)
worst = max(abs(a - b) for a, b in zip(planted, fixed_once))
assert worst < 1e-5, f"the written-out smoothing is the same loss ({worst:.1e})"

even = ragged[:-1]  # drop_last=True
fixed, graphs, failures = run_loss(smoothed_loss_fixed, even, as_tensor=True, stance_after_first="fail_on_recompile")
print(
    f"fixed: {len(even)} steps, {graphs} graph, {len(failures)} guard failures; "
    "after the first step it ran under set_stance('fail_on_recompile'), which raises on any recompile"
)
assert graphs == 1 and not failures
torch._dynamo.reset()

# %% [markdown]
# **A third way for the short batch: a dynamic dimension, with bounds.** Instead of padding, tell Dynamo that one
# dimension varies: `torch._dynamo.mark_dynamic(x, 0, min=2, max=64)` before the call. The graph is then traced with a
# symbolic batch size, guarded only by the bounds. Every size between them runs the same graph. A size outside them
# raises instead of compiling. This holds with `dynamic=False` too (torch 2.9, measured below with the counting backend
# of section 2). `dynamic=False` only stops Dynamo from making sizes dynamic *by itself*. Left alone, Dynamo compiles
# a static graph first, and a dynamic one at the first new size.
#
# The price: a backend that wants every shape fixed gets less from a symbolic size. XLA pads to the bound, and a CUDA
# graph needs one shape. That is why this notebook keeps shapes static and pads.

# %%
def doubled_sine(x):
    return torch.sin(x) * 2


def graphs_for(sizes, *, mark, dynamic=False):
    """Graphs Dynamo hands the counting backend for calls with these batch sizes."""
    torch._dynamo.reset()
    handed.clear()
    g = torch.compile(doubled_sine, dynamic=dynamic, backend=counting)
    for b in sizes:
        x = torch.randn(b, 8)
        if mark:
            torch._dynamo.mark_dynamic(x, 0, min=2, max=64)
        g(x)
    return len(handed)


sizes = (16, 12, 24, 16)
static, marked, automatic = graphs_for(sizes, mark=False), graphs_for(sizes, mark=True), graphs_for(sizes, mark=False, dynamic=None)
try:
    graphs_for((100,), mark=True)
    outside = "ran"
except Exception as e:  # torch's ConstraintViolationError: 100 is not in [2, 64]
    outside = type(e).__name__
torch._dynamo.reset()
print(f"batch sizes {sizes}: static {static} graphs, mark_dynamic(min=2, max=64) {marked}, left to Dynamo "
      f"(dynamic=None) {automatic}; a batch of 100 with those bounds: {outside}")
assert (static, marked, automatic) == (3, 1, 2) and outside != "ran"

# %% [markdown]
# ### The same findings from `labkit.explain()`
# labkit's `explain()` reads torch.compile's own record, off XLA. It gives the graphs, the recompiles with the guard
# that failed and the line, the graph breaks with their reason and line, and the time spent compiling. Given a
# `CompileRecord`, it reads only what ran since that record started. Here that is the two planted runs again, the break
# and the recompiles, and nothing from section 2. Each recompile site is one line, with every guard that failed there
# in order. The four smoothing values are one cause, the short batch another.

# %%
from labkit.dashboard import CompileRecord

record = CompileRecord()  # labkit listens to Dynamo's structured trace from here on (a Trainer's dashboard does this)
torch._dynamo.reset()
torch.compile(Watched(), dynamic=False, backend=DYNAMO)(batches[0][0])  # the planted break, compiled
run_loss(smoothed_loss, ragged)  # the planted recompiles
found = labkit.explain(record, verbose=True, rt=rt)
record.close()
recompile_lines = [a for a in found["advice"] if a.startswith("Recompile")]
assert "item" in found["text"] and "smoothing ==" in found["text"], "the break and the guard, named"
assert f":{planted_line}" in found["text"], "the planted break's line"
assert found["recompiles"] == len(ragged) - 1, "one per new smoothing value, one for the short batch"
assert len(recompile_lines) == 2 and f"({len(ragged) - 2} times)" in recompile_lines[0], recompile_lines
assert len(found["breaks"]) == 1 and not found["torch_breaks"], "no optimizer ran here: none of torch's own"
assert found["compiles"] == 2 + len(ragged), "forward before and after the break; smoothed_loss once per step"
torch._dynamo.reset()

# %% [markdown]
# Read the first line's counts. *Frames* are the Python functions Dynamo compiled, each compile counted: eight here.
# The watched `forward` counts twice: the part before the break, and the rest after it, which Dynamo compiles as a frame
# of its own. `smoothed_loss` counts six times: its first compile and five recompiles. The time is Dynamo's and
# AOTAutograd's work with the `aot_eager` backend.
#
# One break is yours, the `.item()`. None is torch's own, because no optimizer ran in this cell; section 2's two were
# `Optimizer.step`'s. The five recompiles come in two lines. The first counts four new smoothing values. The second is
# the last step, which brought a short batch *and* a new smoothing value. Dynamo reports the first guard that fails, and
# it checks the tensor's size before the number, so that line names only the batch. The graph it compiled then took in
# the new value too.
#
# **Every kind of guard, once.** Section 3 showed a size guard and a value guard. Dynamo checks more about each tensor
# argument: its size, its stride, its dtype, its device and `requires_grad`. The stride says how the elements are laid
# out in memory. It also checks global state, such as grad mode and autocast, on every call. Below, a function compiled
# with `dynamic=False` is called once. Then it is called again with one change of each kind this CPU can make, and
# torch's own text for the failed guard is printed.
#
# Each text starts with a prefix such as `0/0:`. That is the *compile id* of the cached graph whose guard failed:
# frame 0, its compile 0. `0/1` would be that frame's second graph. The recompile log (`TORCH_LOGS=recompiles`) prints
# the same lines.

# %%
def sine(x, scale):
    return torch.sin(x) * scale


x16 = torch.randn(16, 64)
tried = {
    "12 rows": ((torch.randn(12, 64), 0.5), contextlib.nullcontext()),
    "transposed view": ((torch.randn(64, 16).t(), 0.5), contextlib.nullcontext()),
    "float64": ((x16.double(), 0.5), contextlib.nullcontext()),
    "requires_grad": ((x16.clone().requires_grad_(True), 0.5), contextlib.nullcontext()),
    "under no_grad": ((x16, 0.5), torch.no_grad()),
    "scale 0.25": ((x16, 0.25), contextlib.nullcontext()),
    "new values": ((torch.randn(16, 64), 0.5), contextlib.nullcontext()),
}
guard_text = {}
for what, (args, ctx) in tried.items():
    torch._dynamo.reset()
    f = torch.compile(sine, dynamic=False, backend="eager")
    f(x16, 0.5)
    with ctx:
        f(*args)
    failed = [r for rs in torch._dynamo.utils.guard_failures.values() for r in rs]
    guard_text[what] = failed[0].splitlines()[0] if failed else "(no guard failed: the cached graph ran)"
    print(f"{what}:\n    {guard_text[what]}")  # torch's whole line: the guard, then its file:line
torch._dynamo.reset()
for what, marker in [("12 rows", "size mismatch"), ("transposed view", "stride mismatch"), ("float64", "dtype"),
                     ("requires_grad", "requires_grad"), ("under no_grad", "GLOBAL_STATE"), ("scale 0.25", "scale ==")]:
    assert marker in guard_text[what], (what, guard_text[what])
assert guard_text["new values"].startswith("(no guard failed"), "values are data, not guarded"

# %% [markdown]
# ### Exercise 1 (08.guard): which guard does a change fail?
# A function is compiled with `dynamic=False` and called once as `f(x, scale)`. `x` is a float32 CPU tensor of shape
# (16, 64) that does not require grad. `scale = 0.5` is a Python float. Grad mode is on and autocast is off. Then a
# second call makes one change.
#
# For each change below, say which guard fails. Answer with one of `nb08.GUARD_KINDS`: `"size"`, `"stride"`,
# `"dtype"`, `"device"`, `"requires_grad"`, `"global"`, `"value"`, or `"none"` when the cached graph runs again. Some
# changes need a GPU: reason them out from what you saw. The checker refuses `torch.compile` while your answer runs. It
# asks about every change, in a new order each time.
#
# | change | the second call |
# |---|---|
# | `batch_12` | x has 12 rows instead of 16 |
# | `transposed` | x is `torch.randn(64, 16).t()`: the same shape, a transposed view |
# | `float64` | x is in float64 |
# | `bfloat16` | x is in bfloat16 |
# | `on_gpu` | x is on cuda:0 (a GPU machine, first call on the CPU) |
# | `other_gpu` | first call with x on cuda:0, then x on cuda:1 (a two-GPU machine) |
# | `needs_grad` | `x.requires_grad_(True)` |
# | `no_grad` | the call runs inside `torch.no_grad()` |
# | `autocast_gpu` | the call runs inside `torch.autocast('cuda', dtype=torch.bfloat16)`, x on cuda:0 both times |
# | `autocast_cpu` | the call runs inside `torch.autocast('cpu', dtype=torch.bfloat16)` |
# | `scale` | scale is 0.25 instead of 0.5 |
# | `same_scale` | scale is 0.5 again, computed as 1 / 2 |
# | `new_values` | x holds new random numbers, same shape, dtype and device |
#
# The cell below prints the same list from `nb08.CHANGES`, and asserts that this table still matches it.

# %%
for key, (text, _, _) in nb08.CHANGES.items():
    print(f"{key:>13}: {text}")
print("kinds:", nb08.GUARD_KINDS)
assert len(nb08.CHANGES) == 13 and nb08.GUARD_KINDS[-1] == "none" and len(nb08.GUARD_KINDS) == 8


# %%
# your turn: the kind of guard each change fails
def failing_guard(change):
    answers = {
        "batch_12": ...,
        "transposed": ...,
        "float64": ...,
        "bfloat16": ...,
        "on_gpu": ...,
        "other_gpu": ...,
        "needs_grad": ...,
        "no_grad": ...,
        "autocast_gpu": ...,
        "autocast_cpu": ...,
        "scale": ...,
        "same_scale": ...,
        "new_values": ...,
    }
    return answers[change]


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():

    def failing_guard(change):
        return {
            "batch_12": "size",
            "transposed": "stride",
            "float64": "dtype",
            "bfloat16": "dtype",
            "on_gpu": "device",
            "other_gpu": "device",
            "needs_grad": "requires_grad",
            "no_grad": "global",
            "autocast_gpu": "global",
            "autocast_cpu": "global",
            "scale": "value",
            "same_scale": "none",
            "new_values": "none",
        }[change]


# %%
exercises.check("08.guard", lambda: nb08.check_failing_guard(failing_guard))

# %% [markdown]
# ## 4. An optimizer whose state stays on the device
# A learning-rate schedule is the changing Python number every training loop has. With a float `lr`, the compiled
# `opt.step` bakes the value into its graph and guards it. So a warm-up that changes `lr` each step compiles a new
# optimizer graph each step. Two rules decide how many:
#
# - A value seen before passes the guards of the graph compiled for it. That graph is reused, not compiled again.
# - `torch._dynamo.config.recompile_limit` caps the graphs: 8 per function in torch 2.9. Past it, Dynamo compiles no
#   more for that function and runs new values eagerly. The graphs it already has still run for their own values.
#
# The fix is an `lr` that is a **tensor**: the scheduler writes each new value into it with `fill_`. With
# `capturable=True` the optimizer also keeps its `step` counter as a tensor on the parameters' device. It computes the
# bias corrections there too, so the whole update can stay one device graph. Without it, on a GPU, eager Adam's `step`
# is a CPU tensor, unless `fused=True` is set: the fused kernel keeps `step` on the device too, and labkit's CUDA
# runtime sets it (`rt.adamw_options()`). With neither, the bias corrections are Python numbers, worked out on the host
# every update.
#
# The name comes from CUDA graph capture. `torch.compile(mode="reduce-overhead")` records a compiled graph's GPU
# kernels once, as a CUDA graph. It then replays them with one launch per call. The kernels read fixed GPU addresses.
# So every value the update uses, its step counter and lr included, must already be a tensor on the GPU. A replay still
# runs some host code. torch's wrapper first copies each input that does not live at a recorded address into the
# graph's own buffers. The next replay overwrites the outputs of the last one.
#
# Its limits come from torch's *CUDAGraph Trees* page. A recorded graph may not call `.item()` or sync in any other
# way. It may not run CPU ops or data-dependent control flow. Each new input shape needs a new recording. A graph may
# mutate its static inputs: parameters, buffers and optimizer state, which stay at fixed addresses. A graph that
# mutates any other input, or touches CPU tensors, runs without CUDA graphs. None of this ran on this CPU. What its one
# launch saves on the host is measured and modelled at the end of this section.
#
# torch.compile turns `capturable` on by itself only for parameters on CUDA or XPU. It does so only while the
# optimizer's state is still empty (`torch/_dynamo/variables/optimizer.py`, torch 2.9). An optimizer that has stepped
# eagerly keeps what it had. On this CPU the host *is* the device, so the difference shows only on a GPU. There the
# cell's last assert runs.

# %%
def warmup(step):
    return min(1.0, (step + 1) / P.warmup)


def run_schedule(lr, *, compiled=True, capturable=False):
    """AdamW with a linear warm-up (LambdaLR), the step of section 2; returns (losses, graphs, failures, opt)."""
    torch._dynamo.reset()
    counters.clear()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=capturable)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    loss_of = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
    opt_step = opt.step
    if compiled:
        loss_of = torch.compile(loss_of, dynamic=False, backend=DYNAMO)
        # backend="eager": Dynamo's capture and guards only. The update has no backward for AOTAutograd to trace,
        # and each aot_eager compile of it costs seconds here; the graphs and guards counted are the same
        opt_step = torch.compile(opt.step, dynamic=False, backend="eager")
    out = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(x, y)
        loss.backward()
        opt_step()
        sched.step()
        out.append(loss.detach())
    failures = [r for rs in torch._dynamo.utils.guard_failures.values() for r in rs]
    return torch.stack(out).tolist(), counters["stats"]["unique_graphs"], failures, opt


reference, _, _, _ = run_schedule(P.lr, compiled=False)
_, graphs, failures, _ = run_schedule(P.lr)
lr_values = min(P.warmup, P.steps)
print(f"float lr, warm-up over {P.warmup} steps: {graphs} graphs (1 loss + {graphs - 1} optimizer)")
print("   first guard that failed:", failures[0].split("#")[0].strip())
assert graphs == 1 + lr_values and any("['lr']" in r for r in failures)

with_tensor, graphs, failures, opt = run_schedule(torch.tensor(P.lr, device=device), capturable=True)
state = opt.state[opt.param_groups[0]["params"][0]]
worst = max(abs(a - b) for a, b in zip(reference, with_tensor))
lr_now = opt.param_groups[0]["lr"]
print(f"tensor lr, capturable: {graphs} graphs, {len(failures)} guard failures; lr is still a tensor: {lr_now!r}")
print(f"   AdamW's step counter: {state['step']} on {state['step'].device}; largest |eager - compiled| = {worst:.1e}")
assert graphs == 2 and not failures and worst < 1e-4 and torch.is_tensor(lr_now)
assert state["step"].device == opt.param_groups[0]["params"][0].device
if device.type == "cuda":  # what capturable changes: without it, eager Adam keeps `step` on the host
    _, _, _, eager_opt = run_schedule(P.lr, compiled=False)
    assert next(iter(eager_opt.state.values()))["step"].device.type == "cpu"
torch._dynamo.reset()

# %% [markdown]
# The first line counts a float lr under a warm-up: one graph for the loss, and one for the optimizer per lr value.
# The guard that failed first is printed with its compile id, `3/0`. Frames are numbered in the order Dynamo started
# them since the reset. Frame 0 is the loss. `opt.step` runs through two wrappers first, the profiler hook and
# `_use_grad`, and each hands over to a new frame at its graph break: frames 1 and 2. Frame 3 is AdamW's `step`
# itself, the code that reads `param_groups[0]['lr']`. Its first graph, `3/0`, was compiled with the first step's lr
# baked in, the value the line prints. The next step's warm-up wrote a new float, so that guard failed.
#
# The third line is the fix: the lr is a tensor, so its value is data, and no guard reads it. AdamW's step counter
# lives on the parameters' device, as the last line says.

# %% [markdown]
# ### Exercise 2 (08.graphs): how many graphs will this step compile?
# Take section 2's step: the loss compiled with `dynamic=False`, AdamW with a **float** lr, and `opt.step` compiled
# with `dynamic=False`. Step *i* trains on a batch of `batch_rows[i]` rows with learning rate `lrs[i]`. The two lists
# have the same length, e.g. `batch_rows = [32, 32, 12]`, `lrs = [1e-3, 2e-3, 2e-3]`.
#
# Write `predict_graphs(batch_rows, lrs)`: the number of graphs Dynamo compiles in the whole run. Section 4's two rules
# apply. A value seen before reuses its graph. The recompile limit is 8 graphs per compiled function, and the graphs
# compiled before it still run. The checker asks about schedules and batch sizes this notebook never ran, new ones each
# time. It refuses `torch.compile` while your answer runs.

# %%
# your turn
def predict_graphs(batch_rows, lrs):
    return ...


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():

    def predict_graphs(batch_rows, lrs):
        limit = 8  # torch._dynamo.config.recompile_limit: then the function runs eagerly
        return min(limit, len(set(batch_rows))) + min(limit, len(set(lrs)))  # loss+backward per shape; update per lr


# %%
exercises.check("08.graphs", lambda: nb08.check_predict_graphs(predict_graphs))

# %% [markdown]
# ### What a CUDA graph saves: the host's launches, measured here
# Eager, every op the step runs costs the host a dispatch: Python, torch's dispatcher, autograd's checks. Only then can
# its kernel start on the device. A GPU runs a launched kernel while the host goes on to the next one. So the host can
# stay ahead, unless its launches take longer than the kernels run. Then the GPU waits on the host.
#
# The cell measures the host's part on this machine. First, the time per eager op: 16-element in-place adds, whose
# arithmetic takes nanoseconds. Second, the ops one step of section 2's model dispatches, its backward and AdamW's
# update included. `labkit.profiling.roofline.count_kernels` counts them; views and `.item()` are left out, as they
# launch no kernel. What a GPU adds to a launch, and a CUDA graph's replay, are **not verified here**.
#
# K is this CPU's count. Here AdamW updates one weight after another, several ops each. On a GPU, torch picks its
# *foreach* form, a few kernels per group of weights. `fused=True` does the whole update in a handful of launches
# (torch's AdamW documentation). A GPU's K is smaller by most of the update's share.

# %%
from labkit.profiling import roofline

model = make_model()
opt = torch.optim.AdamW(model.parameters(), lr=P.lr)
x, y = batches[0]


def eager_step():
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


eager_step()  # AdamW's state exists from here on: the step counted and timed below is an ordinary one
ops = roofline.count_kernels(eager_step)
K = sum(ops.values())
L = roofline.dispatch_s()
rt.wait()  # on a GPU the timing starts with nothing queued and ends when the device is done
t0 = time.perf_counter()
for _ in range(20):
    eager_step()
rt.wait()
step_s = (time.perf_counter() - t0) / 20
print(f"host time per eager op on this machine: {L * 1e6:.1f} µs; one training step dispatches K = {K} ops "
      f"({len(ops)} kinds, most: {', '.join(f'{n} x{c}' for n, c in sorted(ops.items(), key=lambda kv: -kv[1])[:3])})")
print(f"K x L = {K * L * 1e3:.2f} ms of dispatch alone; the whole eager step took {step_s * 1e3:.2f} ms here (the rest: "
      "Python around the ops, and the arithmetic itself: on a CPU the host is the device)")
print(f"on a GPU this step would be host-bound at least where its kernels run shorter than about {L * 1e6:.0f} µs each "
      "(a GPU launch adds the driver's own cost to this dispatch: not measured here)")
assert ops.get("aten.addmm", 0) >= 2 and "aten.threshold_backward" in ops  # the forward and the backward counted
assert K >= 2 * len(list(model.parameters())) and 1e-7 < L < 1e-3  # the update too: at least two ops per weight
print(f"the step took {step_s / (K * L):.1f}x K x L: the dispatches are a floor under it (the two were timed apart, "
      "so a busy machine can move this ratio either way)")

# %% [markdown]
# ### Exercise 3 (08.overhead): host-bound, device-bound, and a CUDA graph
# A step runs `kernels` kernels. Each costs the host `launch_us` µs to launch and the device `kernel_us` µs to run. The
# step is timed alone, from its first launch to its last kernel's end. Eager, the host launches one kernel after
# another while the device runs what it was given. A kernel starts once it is launched and the one before it has
# ended. `torch.compile(mode="reduce-overhead")` records the kernels once as a CUDA graph and replays them with **one**
# launch.
#
# Write `step_time_us(kernels, launch_us, kernel_us, cuda_graph)`. The checker draws a host-bound step, a device-bound
# one and a tiny one on every call. It passes within 2 %, so for many kernels the rough form is enough. It refuses
# `roofline.launch_bound_s`, the model it compares with.

# %%
# your turn
def step_time_us(kernels, launch_us, kernel_us, cuda_graph):
    return ...


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():

    def step_time_us(kernels, launch_us, kernel_us, cuda_graph):
        if cuda_graph:
            return launch_us + kernels * kernel_us  # one launch, then the kernels back to back
        return kernels * max(launch_us, kernel_us)  # the slower stream sets the time (host- or device-bound)


# %%
exercises.check("08.overhead", lambda: nb08.check_overhead(step_time_us))

# %% [markdown]
# ### On a GPU: figures from one run
# *Measured on: NVIDIA H200 (141 GB), Python 3.12, torch 2.11.0+cu130, 2026-11.*
#
# This section's lessons decide a GPU's speed. Two figures from one GPU run show what they give.
#
# GPT-2 small (T = 1024, batch 16, bf16), compiled, reached 41.3 % MFU. MFU is the share of the GPU's peak bf16 FLOP/s
# that the model's own arithmetic used. On ResNet-50 (224 px, batch 64, bf16 autocast, eager, NCHW), a step took
# 28.7 ms under labkit's Trainer. It took 29.1 ms in a hand-written loop, 29.1 ms under Lightning Fabric and 29.5 ms
# under Accelerate. There the GPU's work hides each loop's own cost.
#
# Where the step is short, the loop's host work shows. On a small MLP at batch 64, a step took 1.75 ms under labkit
# and 1.50 ms in the hand loop. Compiled, a ResNet-50 step under labkit took 1.21× the hand loop's. Each figure is one
# run, so no spread: they say where to look, not how large the gap is.
#
# **Memory format.** A GPU's tensor cores want a convolution's activations in channels_last order (NHWC). PyTorch's
# default for a 4-D tensor is NCHW. A hand-written loop on ResNet-50 at batch 128 measured:
#
# | layout | ms a step | images/s |
# |---|---|---|
# | NCHW, eager | 54.6 | 2,343 |
# | channels_last, eager | 29.5 | 4,343 |
# | channels_last + `torch.compile` | 22.9 | 5,578 |
#
# channels_last alone nearly doubles the images a second. Compiling adds another 28 %. You ask for it with
# `model.to(memory_format=torch.channels_last)`, and the same for each batch. labkit's CUDA runtime trains
# convolutional models in channels_last; no GPU has run that code yet, so the table is the hand loop's. On a TPU you
# do nothing: XLA chooses its own layout for every tensor.

# %% [markdown]
# ## 5. Placing a model with DTensor
# On torch_xla one process drove every device, and `mark_sharding` told GSPMD how to split a tensor (notebook 03). On
# this engine each device has its own process: torchrun starts one rank per GPU or TPU chip. The processes join a
# process group, and a `DeviceMesh` arranges the ranks in a grid with named axes.
#
# A **DTensor** is a tensor whose *placements* say, per mesh axis, how it is laid out. There are three:
#
# - `Shard(d)`: split along dimension d;
# - `Replicate()`: a whole copy on each rank;
# - `Partial()`: each rank holds a part of a sum, pending a reduction.
#
# `distribute_tensor(t, mesh, placements)` lays a tensor out. Each rank keeps only its piece (`.to_local()`).
#
# One process here stands in for rank 0, and then rank 7, of a mesh of 8. It uses torch's own test backend `"fake"`
# (`torch.testing._internal.distributed.fake_pg`). That process group accepts every collective and does nothing. The
# shapes each rank holds are real; the values are not, so nothing here trains. A gloo mesh of one process would show
# nothing, since every shard would be the whole tensor. Real multi-process runs, with losses, come after the exercise.

# %%
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD = 8
w = torch.randn(30, 12)  # 30 rows: they do not divide over 8
local = {}
for rank in (0, WORLD - 1):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    for name, placement in (("Shard(0)", Shard(0)), ("Shard(1)", Shard(1)), ("Replicate()", Replicate())):
        local[rank, name] = tuple(distribute_tensor(w, mesh, [placement]).to_local().shape)
    mesh2 = init_device_mesh("cpu", (2, 4), mesh_dim_names=("data", "model"))  # Megatron's column split, per data slice
    local[rank, "(Replicate(), Shard(0)) on 2x4"] = tuple(
        distribute_tensor(w, mesh2, [Replicate(), Shard(0)]).to_local().shape
    )
    dist.destroy_process_group()
for (rank, name), shape in local.items():
    print(f"rank {rank}: {name:>32} -> {shape}")
chunks = [len(c) for c in torch.arange(30).chunk(WORLD)]
print("torch.chunk(30 rows, 8):", chunks)
assert local[0, "Shard(0)"] == (chunks[0], 12) and local[WORLD - 1, "Shard(0)"] == (chunks[-1], 12)
assert local[0, "Shard(1)"] == (30, 2) and local[0, "Replicate()"] == (30, 12)
assert local[0, "(Replicate(), Shard(0)) on 2x4"] == (8, 12)

# %% [markdown]
# `Shard(0)` splits like `torch.chunk`: ⌈30/8⌉ = 4 rows to each rank until the rows run out. So rank 7 holds 2.
# `Shard(1)`'s 12 columns, 2 per rank, run out at rank 5: ranks 6 and 7 hold none.
#
# **FSDP2** (`fully_shard`) puts every parameter of a module on such a mesh as a DTensor, `Shard(0)`. It allocates
# each rank's piece **padded** to ⌈rows/devices⌉ rows, so every rank's buffer has the same size. The all-gather that
# rebuilds the weight needs equal pieces. torch_xla's FSDPv2 split each weight along its **largest** dimension instead
# (notebook 03). For a (10, 300) weight over 8 devices the two differ a lot. FSDP2 gives each device 2 padded rows of
# 300, and ranks 5–7 hold only padding. FSDPv2 splits the 300 columns, 38 per device.
#
# `reshard_after_forward` says whether a module's gathered weights are freed right after its forward. Freed, they are
# gathered again for the backward: less memory, one more all-gather. Its default in torch 2.9 is `None`. That means
# `True` for every module below the root, and `False` for the root, whose weights the backward needs first anyway.

# %%
for rank in (0, WORLD - 1):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(12, 30), torch.nn.ReLU(), torch.nn.Linear(30, 300), torch.nn.Linear(300, 10)
    )
    fully_shard(net[0])  # a child: resharded after its forward (default None -> True below the root)
    fully_shard(net)  # the root owns the rest (net[2], net[3]): kept gathered after the forward (None -> False)
    rows = {n: (tuple(p.to_local().shape), p.to_local().untyped_storage().nbytes()) for n, p in net.named_parameters()}
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in net.parameters())
    print(f"rank {rank}:", {n: f"{s} in {b} B" for n, (s, b) in rows.items()})
    assert rows["0.weight"][1] == math.ceil(30 / WORLD) * 12 * 4  # padded: the same buffer on every rank
    assert rows["3.weight"][1] == math.ceil(10 / WORLD) * 300 * 4  # (10, 300): 2 rows of 300, ranks 5-7 padding only
    net(torch.randn(4, 12))  # a forward on the fake group: shapes real, values not
    assert isinstance(net[0].weight, DTensor), "a child is resharded after its forward"
    assert not isinstance(net[3].weight, DTensor), "the root keeps its gathered weights for the backward"
    dist.destroy_process_group()
assert inspect.signature(fully_shard).parameters["reshard_after_forward"].default is None
print(
    f"FSDPv2 would give a (10, 300) weight {math.ceil(300 / WORLD) * 10 * 4} B per device; FSDP2 gives "
    f"{math.ceil(10 / WORLD) * 300 * 4} B"
)

# %% [markdown]
# ### Exercise 4 (08.fsdp2_bytes): bytes per device under FSDP2, on meshes this machine does not have
# Write `fsdp2_bytes(shape, devices, bytes_per)`: the bytes ONE device allocates for its shard of a parameter of that
# shape. `fully_shard` splits it over `devices` ranks, and each element takes `bytes_per` bytes. The checker asks about
# 8, 16 and 64 devices, shapes that do not divide, and biases shorter than the mesh, new ones each time. It refuses
# `fully_shard`, `distribute_tensor`, process groups and meshes while your answer runs.

# %%
# your turn
def fsdp2_bytes(shape, devices, bytes_per):
    return ...


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():

    def fsdp2_bytes(shape, devices, bytes_per):
        rows = -(-shape[0] // devices)  # dim 0, padded up to a multiple of the devices
        return rows * math.prod(shape[1:]) * bytes_per


# %%
if exercises.check("08.fsdp2_bytes", lambda: nb08.check_fsdp2_bytes(fsdp2_bytes)):
    # and on the layout measured above (rank 7 of 8): your rule gives the padded buffers fully_shard allocated
    assert (
        fsdp2_bytes((30, 12), WORLD, 4) == rows["0.weight"][1]
        and fsdp2_bytes((10, 300), WORLD, 4) == rows["3.weight"][1]
    )

# %% [markdown]
# ### The plans of notebook 03 on 4 real processes
# `labkit.lessons.dtensor_mesh` trains notebook 03's fast GPT for 3 AdamW steps under its three plans, written with
# DTensor:
#
# - **data**: FSDP2 on a (4, 1) mesh, so every weight is whole and the gradients are all-reduced;
# - **fsdp**: `fully_shard` on the block, then on the root;
# - **tensor**: Megatron's pairs with `parallelize_module`, on a 2 × 2 (data, model) mesh.
#
# It launches a child `torchrun` of 4 CPU processes over gloo, one per device. Each process holds its own shards and
# issues its own collectives, counted over the last step with `CommDebugMode`. `run(gspmd=False)` runs this DTensor side
# alone: in 10 s on a quiet 2-core machine, 1–3 minutes on a busy one. With the default `gspmd`, where torch_xla is
# installed, it also runs notebook 03's GSPMD strategies on 4 virtual XLA devices. `compare(report)` then puts the
# engines side by side.
#
# `tests/test_dtensor_plans.py` checks that full comparison. Per device it measured 85,888 parameter bytes for data,
# 21,472 for fsdp and 60,864 for tensor. The losses were [5.4985, 4.5570, 3.1474] for every plan on both engines.

# %%
from labkit.lessons import dtensor_mesh
from labkit.models import GPTConfig
from labkit.spmd import dtensor_plans

t0 = time.perf_counter()
report = dtensor_mesh.run(gspmd=False)  # the DTensor side only: one torchrun of 4 gloo processes
print(f"{time.perf_counter() - t0:.0f} s\n")
print(dtensor_mesh.describe(report))

# %% [markdown]
# Everything that run measured can be predicted here without a process:
#
# - the bytes each device holds: FSDP2 pads dim 0 (`dtensor_plans.predict_bytes`);
# - the collectives of one step (`predict_collectives`);
# - the losses, from one process on the whole batch.
#
# Beside FSDP2 stands the layout torch_xla's FSDPv2 would give the same weights: the largest dimension split. The bytes
# are the same here, since every dimension divides by 4, but the split is not.
#
# One line needs reading. The **data** plan is FSDP2 on a (4, 1) mesh: each unit is sharded over a group of one device,
# and replicated over the 4. So each unit's gradients are all-reduced over the replicas: one all-reduce per unit, the
# root and each block. Then torch 2.9 also issues FSDP2's reduce-scatter of each unit over that group of one device, which
# moves nothing. Those are the data plan's reduce-scatters, one per unit, counted with the bytes they are handed.
# torch 2.11 skips them; `dtensor_plans.predict_collectives` says so, and predicts either.

# %%
DEVICES, cfg08 = report["devices"], GPTConfig(dropout=0.0, **report["config"])
batch = inspect.signature(dtensor_mesh.run).parameters["batch_size"].default  # the global batch run() drew
for plan, got in report["dtensor"].items():
    assert got["param_bytes"] == dtensor_plans.predict_bytes(plan, cfg08, DEVICES), (plan, got["param_bytes"])
    assert max(abs(a - b) for a, b in zip(got["losses"], report["single_losses"])) <= dtensor_mesh.LOSS_TOL, plan
    assert got["collectives"] == dtensor_plans.predict_collectives(plan, cfg08, DEVICES, batch), plan
    ops = ", ".join(f"{v['count']} {k}" for k, v in sorted(got["collectives"].items()))
    print(f"{plan:>6}: {got['param_bytes']:>6,d} B per device, losses, collectives ({ops}): as predicted")
fsdp_rows = report["dtensor"]["fsdp"]["rows"]  # [name, shape, local shape, placement, split dims, bytes]
fsdpv2 = sum(dtensor_plans.nbytes(dtensor_plans.largest_dim_shard_shape(s, DEVICES)) for _, s, *_ in fsdp_rows)
assert fsdpv2 == report["dtensor"]["fsdp"]["param_bytes"]  # same bytes...
print(f"fsdp: FSDPv2 (largest dimension) would hold {fsdpv2:,d} B per device as well, split elsewhere for:")
moved = [
    n for n, s, local_shape, *_ in fsdp_rows if tuple(local_shape) != dtensor_plans.largest_dim_shard_shape(s, DEVICES)
]
for n, s, local_shape, *_ in fsdp_rows:
    if n in moved:
        print(
            f"{n} {tuple(s)}: FSDP2 holds {tuple(local_shape)}, "
            f"FSDPv2 would hold {dtensor_plans.largest_dim_shard_shape(s, DEVICES)}"
        )
assert moved == ["wpe.weight", "blocks.0.mlp.proj.weight"], moved  # ...another split: the wider-than-tall weights
assert report["dtensor"]["fsdp"]["collectives"]["all-gather"]["count"] == 2 * cfg08.n_layer + 1

# %% [markdown]
# Under fsdp one step all-gathers 3 times for 1 block. The block is gathered before its forward, and again before its
# backward, since it is resharded after its forward. The root's own weights, those no block owns, are gathered once a
# step. `reshard_after_forward` is `False` at the root, so they stay gathered for the backward and are freed after it.
# Each unit's gradients are reduce-scattered once.
#
# The two engines lay out `wpe.weight`, 16 positions × 32, and `blocks.0.mlp.proj.weight` (32 × 128) differently.
# FSDP2 splits the rows; FSDPv2 splits the longer columns. With shapes that do not divide, the bytes would differ too,
# since FSDP2 pads dim 0.

# %% [markdown]
# ### The Trainer on 4 processes under FSDP2, resumed on 2
# The same `labkit.Trainer` as in section 2 trains past one device with one setting: `TrainConfig(parallel="fsdp2")`,
# or `--parallel fsdp2` on `python -m labkit.train`. It lays the model out with `fully_shard` on each block, then the
# root, over torchrun's processes. `"replicate"` is DDP. `"auto"` picks by whether weights, gradients and AdamW state
# fit a device.
#
# The loop does not ask which. A plan object (`labkit.parallel`) wraps the model. It skips the gradient reduction of
# all but the last accumulated micro-batch, and gives the state under the plain model's names. A `CheckpointManager`
# then writes a sharded checkpoint with DCP, each process its own shards. A run on another number of processes reads
# it back.
#
# Below, `labkit.lessons.fsdp_trainer` starts a `torchrun` of 4 gloo processes. They train the tiny GPT, 2 blocks of
# 32, count bytes and collectives over its steps, and save a checkpoint at step 2. Then a `torchrun` of 2 resumes from
# it and, for comparison, trains the same 4 steps uninterrupted. Both took 19 s in all on a quiet 2-core machine, and
# about a minute on a busy one.

# %%
import tempfile

from labkit.lessons import fsdp_trainer

ckpt08 = tempfile.mkdtemp(prefix="labkit-nb08-fsdp-")
t0 = time.perf_counter()
four = fsdp_trainer.launch(
    4,
    [
        {"name": "counted", "parallel": "fsdp2", "steps": 2, "count": True, "clip": 0.0},
        {"name": "saved", "parallel": "fsdp2", "steps": 4, "stop_at": 2, "checkpoint_every": 2, "ckpt": ckpt08},
    ],
)
two = fsdp_trainer.launch(
    2,
    [
        {"name": "resumed", "parallel": "fsdp2", "steps": 4, "resume": True, "ckpt": ckpt08},
        {"name": "whole", "parallel": "fsdp2", "steps": 4},
    ],
)
print(f"{time.perf_counter() - t0:.0f} s")
cfg_t = fsdp_trainer.gpt_config()
counted = four["counted"]
predicted = dtensor_plans.predict_collectives("fsdp", cfg_t, 4, last_kept=True)
print(
    f"{counted['plan']}: {counted['param_bytes']:,d} parameter bytes on process 0 of {counted['full_param_bytes']:,d}"
)
print(f"AdamW state: {counted['opt_bytes']:,d} bytes per device")
for op in sorted(predicted):
    print(f"{op}: {counted['comm'][op]:g} per step counted, {predicted[op]['count']} predicted")
assert counted["param_bytes"] == dtensor_plans.predict_bytes("fsdp", cfg_t, 4)
assert counted["opt_bytes"] == 2 * counted["param_bytes"]
assert counted["comm"] == {op: v["count"] for op, v in predicted.items()}, (counted["comm"], predicted)
whole, resumed = two["whole"]["global_losses"], two["resumed"]["global_losses"]
print("4 processes, steps 1-2:", [round(v, 4) for v in four["saved"]["global_losses"]])
print("2 processes resumed, steps 3-4:", [round(v, 4) for v in resumed])
print("2 processes, uninterrupted:   ", [round(v, 4) for v in whole])
assert two["resumed"]["first_step"] == 3  # the data position: the step after the checkpoint's
assert max(abs(a - b) for a, b in zip(four["saved"]["global_losses"] + resumed, whole)) < 1e-4

# %% [markdown]
# Each process holds a quarter of every weight: dim 0, padded, as `predict_bytes` says. One step issues exactly the
# collectives `predict_collectives` says: 4 all-gathers and 3 reduce-scatters for 2 blocks. With `clip_norm` set, one
# all-reduce more carries the gradient norm's partial sums. That is one all-gather fewer than the blocks sharded by hand
# above. The Trainer keeps its last block gathered after forward, because backward needs it at once.
#
# The resumed run continues at step 3 with the losses of the uninterrupted one. They agree to float32 rounding: the
# sums split over 2 processes instead of 4. On real hosts only the launch changes: `torchrun --nnodes 2 ...
# --rdzv-endpoint HOST0:PORT`, and a checkpoint root every host reaches (gs://).

# %% [markdown]
# ## What you saw
# | | caused by | seen with | fixed by |
# |---|---|---|---|
# | a graph break | `loss.backward()` in a compiled function; `.item()` in a forward; `Optimizer.step` (on purpose) | `torch._dynamo.explain` (reason, line), `counters["graph_break"]` | compile the loss (AOTAutograd compiles its backward); keep values on the device |
# | a recompile | a Python number that changes (a smoothing, a float lr), a new shape | the failed guard: `TORCH_LOGS=recompiles`, `guard_failures` | tensors for changing numbers, fixed shapes (`drop_last`, padding); `set_stance("fail_on_recompile")` proves it |
# | optimizer state on the host | `capturable=False` on a GPU, a float lr | the guard on `param_groups[0]['lr']` | `lr=torch.tensor(...)`, `capturable=True` |
# | a host-bound step | many small kernels, each launched by the host | ops per step × host time per op (`roofline.count_kernels`, `dispatch_s`) against the kernels' time | one launch for the whole step: a CUDA graph (`mode="reduce-overhead"`); fewer, larger kernels (Inductor's fusion, a larger batch) |
# | a slow convolution on a GPU | NCHW activations | images/s, NCHW against channels_last (H200: 2,343 against 4,343) | `channels_last`; labkit's CUDA runtime sets it (not yet run on a GPU); XLA picks layouts itself |
# | a layout | `Shard(0)` / FSDP2 (dim 0, padded) vs FSDPv2 (largest dimension) | `.to_local()`, `.placements`, the padded buffers | choose the plan per weight |
#
# On TorchTPU (not verified here) the same code runs with `backend="tpu"` and a `"tpu"` process group, one process per
# chip; both names are registered by `torch_tpu/_loader.py` in `torch-tpu` 0.2.0. On a GPU it runs with Inductor and
# NCCL. Notebook 10 maps the rest of the course onto TorchTPU.

# %%
passed = sum(exercises.results.get(n, False) for n in ("08.guard", "08.graphs", "08.overhead", "08.fsdp2_bytes"))
print(f"exercises passed: {passed} of 4")
