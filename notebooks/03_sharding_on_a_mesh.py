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
# # One GPT, four ways over a mesh of devices: data, tensor and fully sharded parallelism
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/labkit/labkit/blob/main/notebooks/03_sharding_on_a_mesh.ipynb)
#
# This notebook trains the GPT of notebook 02 four ways. Each way runs the same number of steps on the same batches:
#
# 1. **one device**: the reference;
# 2. **data parallel**: every device holds all the weights and a slice of the batch, and the gradients are summed;
# 3. **tensor parallel**, Megatron style: on a 2-D `data x model` mesh, each block's attention heads and MLP units are
#    split over the `model` axis, and the batch over `data`;
# 4. **FSDP** with torch_xla's FSDPv2, `SpmdFullyShardedDataParallel`: every weight and the batch are split over all
#    devices.
#
# For each strategy you see a picture of where the weights and the batch live. You see the bytes of parameters and
# optimizer state that one device holds. You see the collectives XLA put into the compiled step, read from its optimized
# HLO, next to what we predict on paper. Then come step time, MFU and the losses, which must match the one-device run.
#
# After that, the bytes become time on real TPU generations. Last, the FSDP run is saved shard by shard and restored
# into the data-parallel layout, bit for bit. By the end you can:
#
# - build a mesh and mark shardings by hand, then read back where each tensor lives and which collectives XLA added;
# - predict each strategy's bytes per device and its collectives, and check them against the optimized HLO;
# - turn those bytes into time over a TPU generation's inter-chip links;
# - say at what batch per chip each strategy stops waiting for the network, also for a model this machine cannot run;
# - save a sharded checkpoint and restore it onto another layout.
#
# **Time**: about 1.5 min of CPU time in fast mode, and 1.3–5 min of wall time, quiet machine to busy; 50–70 minutes to
# read and do the five exercises. Most of the run is spent compiling four partitioned training graphs for 8 virtual
# devices.
#
# *Measured on: 2-core CPU, XLA:CPU, torch_xla 2.9, fast mode.*
#
# **In the course**: after 02; next: 08.
#
# On a TPU host with several chips, the mesh is the chips: a v5e-8 has 8, a v4-8 has 4. Anywhere else, torch_xla runs on
# the CPU as 8 *virtual* devices in one process. The partitioning, the collectives and the bytes are real. The speed is
# not, because all 8 devices share the same cores.
#
# That includes Colab's TPU runtime, a v5e-1 with **one** chip. One chip is not a mesh, so the parameters cell says so
# and switches to the CPU before torch_xla starts. There is no GPU backend in torch_xla 2.9, so a GPU runtime practises
# on its CPU as well.
#
# Some lessons are torch_xla's own: `xs.Mesh`, `xs.mark_sharding`, `SpmdFullyShardedDataParallel`, and GSPMD. GSPMD is
# XLA's sharding propagation and partitioner: the compiler, not your code, inserts the collectives. XLA is replacing
# GSPMD with **Shardy**, the partitioner JAX already uses by default. torch_xla 2.9 still runs GSPMD. It logs a
# deprecation warning on every partitioned compile, which the parameters cell hides. The ideas below are the same under
# both partitioners.
#
# *Source: github.com/openxla/shardy, and JAX's guide to migrating to Shardy.*
#
# Other lessons carry over: the mesh with named axes, the placements, and what each strategy costs in memory and
# communication. A placement either splits a dimension over an axis or replicates it. Plain PyTorch writes the same with
# `init_device_mesh` and DTensor's `Shard(0)` and `Replicate()`. Megatron's split is `parallelize_module` with
# `ColwiseParallel` and `RowwiseParallel`, and FSDP2 is `fully_shard`. JAX writes it with `Mesh` and `PartitionSpec`.

# %% [markdown]
# ## Parameters
# Every knob lives in this cell. Each one can be set from the environment as `LABKIT_<NAME>`. `LABKIT_FAST=1` gives the
# CI-sized run: a 1-layer GPT of width 32, and 4 steps of each strategy. The defaults are sized for a TPU host with 8
# chips.
#
# This cell also prepares the devices, because that must happen before torch_xla starts. `labkit.spmd.practice_devices`
# prints what it chose:
#
# - without a TPU, or on a TPU host with fewer than 2 chips, 8 virtual XLA:CPU devices (`PJRT_DEVICE=CPU`,
#   `CPU_NUM_DEVICES=8`);
# - everywhere, XLA's optimized HLO dumped as text (`XLA_FLAGS=--xla_dump_to=...`), where the collectives can be
#   counted;
# - XLA's C++ log level raised to errors (`TF_CPP_MIN_LOG_LEVEL=2`). Otherwise torch_xla 2.9's XLA prints the same
#   GSPMD-to-Shardy deprecation warning once per partitioned compile, dozens of times.
#
# If torch_xla already runs on a one-chip TPU in this kernel, the cell says so. Restart the runtime and run this cell
# first.

# %% tags=["parameters"]
import dataclasses, os, sys, tempfile


@dataclasses.dataclass
class Params:
    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 256
    block_size: int = 128         # context length T (bytes)
    batch_size: int = 64          # sequences per step, in total (split over the devices)
    steps: int = 30               # training steps per strategy (the same batches for all four)
    lr: float = 3e-3              # AdamW
    model_axis: int = 2           # devices per tensor-parallel group: the mesh is (devices / model_axis) x model_axis
    loss_tol: float = 1e-2        # nats: how far a sharded run's loss may drift from the one-device run
    seed: int = 0
    checkpoint_dir: str = ""      # section 11: a local folder or gs://bucket/prefix; "": a new temporary folder
    # CI-sized: tiny model, few steps, a high learning rate so the loss visibly falls in 4 steps
    # T = 24, not 16: B·T (384 tokens) then differs from the vocabulary (256 bytes), so the HLO's shapes tell an
    # activation's rows from the embedding table's
    NEEDS = ("torch_xla",)  # where torch_xla is missing, the set-up cell ends the notebook and says how to get it
    FAST = {"n_layer": 1, "n_head": 4, "n_embd": 32, "block_size": 24, "batch_size": 16, "steps": 4, "lr": 3e-2,
            "loss_tol": 1e-3}


HLO_DIR = os.path.join(tempfile.gettempdir(), f"labkit-hlo-{os.getpid()}")   # XLA writes its compiled graphs here
try:
    import labkit
    HLO_DIR = labkit.scratch("hlo")   # a fresh folder; the dumps of earlier runs are removed
    P = labkit.from_env(Params)
    print(labkit.spmd.practice_devices(8, HLO_DIR))   # before torch_xla starts
except (ImportError, AttributeError):  # first run: the set-up cell installs labkit and reads them again
    P = Params()
P

# %% [markdown]
# ## Set-up
# This cell runs wherever you opened the notebook: Colab TPU or GPU, Kaggle, a TPU VM or a laptop. It never replaces
# what the runtime already has. It keeps the image's torch, and torch_xla too when the pair matches. It installs only
# what is missing, and prints what it found and chose (`labkit setup: platform=... choice=...`).
#
# Where torch and torch_xla are missing or do not match, it installs the pair together and asks you to restart the
# runtime. That happens on a bare TPU VM, or after torch was upgraded by hand. Then run the notebook again.

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
# ## 1. The devices and the mesh
# `labkit.setup(spmd=True)` switches torch_xla to SPMD. There is one process and one program, written as if for one big
# device. `mark_sharding` says how each tensor is laid out over a `Mesh`.
#
# Data parallelism and FSDP use a 1-D mesh over all devices. Tensor parallelism uses a 2-D one, `data x model`. Devices
# 0 and 1 form a model group: they split one layer. Devices 0, 2, 4 and 6 form a data group: they hold the same weight
# slice and different batch slices.
#
# The cell prints the backend and the number of devices. On the CPU it also says that the timings are not a TPU's.

# %%
import time

if HLO_DIR not in os.environ.get("XLA_FLAGS", ""):   # the parameters cell ran before labkit was installed
    print(labkit.spmd.practice_devices(8, HLO_DIR))
rt = labkit.setup(spmd=True)
if not rt.spmd:
    raise RuntimeError(f"this notebook needs torch_xla's SPMD over several devices; the backend is {rt.kind}")
N_DEV = labkit.spmd.addressable_devices()
DUMPING = HLO_DIR in os.environ.get("XLA_FLAGS", "")
print(f"backend {rt.kind}, {N_DEV} devices in one SPMD process; HLO dumped to {HLO_DIR}: {DUMPING}")
if rt.kind == "xla-cpu":
    print(f"running on {N_DEV} virtual XLA:CPU devices: the collectives and bytes are real, the timings are not a TPU's")
assert N_DEV >= 2, (f"one device is not a mesh: restart the runtime and run the parameters cell first "
                    f"({labkit.spmd.practice_devices(8, HLO_DIR)})")
assert N_DEV >= 2 and N_DEV % P.model_axis == 0, f"{N_DEV} devices do not split into model groups of {P.model_axis}"
assert P.batch_size % N_DEV == 0, f"batch_size={P.batch_size} must divide over {N_DEV} devices"

# %% [markdown]
# ## 2. The model and the batches
# The model is notebook 02's `labkit.models.gpt.GPT`, trained on the same offline text: the Python Language Reference,
# with bytes as tokens. Every strategy starts from the same seeded weights and sees the same list of batches. So the
# four loss curves must agree up to floating-point rounding, since a sum split over devices is added in another order.
#
# Tensor parallelism needs whole attention heads on each device. So its copy of the model keeps q, k and v as three
# matrices, with the same values (`labkit.spmd.sharding.split_qkv`). Split by rows, each device then gets whole heads.
# The cell prints the model's size and the FLOPs of one step, which section 8 uses for MFU.

# %%
from labkit.dashboard import flops
from data_tools import text
from labkit.lessons import parallel_gpt as PG
from labkit.spmd import sharding as S
from labkit.models import GPT, GPTConfig

gcfg = GPTConfig(block_size=P.block_size, n_layer=P.n_layer, n_head=P.n_head, n_embd=P.n_embd, dropout=0.0)
train_data, _ = text.split(text.load_corpus("offline"))
batches = list(text.TextBatches(train_data, P.batch_size, P.block_size, P.steps, seed=P.seed, name="offline"))
assert len(batches) == P.steps and batches[0][0].shape == (P.batch_size, P.block_size)
probe = GPT(gcfg)
FLOPS_PER_STEP = probe.flops_per_token() * P.batch_size * P.block_size
PARAM_BYTES = sum(p.numel() * p.element_size() for p in probe.parameters())
print(f"{sum(p.numel() for p in probe.parameters()):,} parameters ({PARAM_BYTES / 1e6:.2f} MB float32), "
      f"{P.steps} steps of {P.batch_size} x {P.block_size} tokens, {FLOPS_PER_STEP / 1e9:.3f} GFLOP per step")

# %% [markdown]
# ## 3. Shard by hand first
# Before labkit's strategies do it for you, lay the GPT out yourself. GSPMD's whole interface is two calls:
#
# * `xs.Mesh(device_ids, mesh_shape, axis_names)` arranges the devices as an array whose axes have names. Here the shape
#   is `(devices / 2, 2)`, named `("data", "model")`. Each row of the array is a *model group*: the devices that split
#   one layer. Each column is a *data group*: the devices that hold the same slices and see different sequences.
# * `xs.mark_sharding(t, mesh, spec)` takes a *partition spec* with one entry per dimension of `t`. Each entry names the
#   mesh axis to split that dimension over, or is `None` to keep it whole. The call splits nothing by itself: it
#   annotates the tensor. When the step compiles, XLA's SPMD partitioner writes each device's part of the program. It
#   also inserts the collectives the layout needs.
#
# Megatron splits every MLP as a pair. `mlp.fc` is 4C x C, output features by input features. It is split by its rows,
# so each device of a model group computes a slice of the hidden units. GELU then needs nothing from the other devices.
# Megatron calls this *column parallel*, because it splits the output columns of the weight written as input x output.
#
# `mlp.proj` is C x 4C, split by its columns. Each device multiplies its own hidden slice and holds a *partial sum* of
# the output. Megatron calls this *row parallel*.
#
# Predict before running. Completing that sum takes an **all-reduce within each model group**: the 2 devices of one row
# of the mesh, over the `model` axis. The weights left whole here, attention and embeddings, get their gradients summed
# over the data groups. The batch is split by sequences over `"data"`. The cell runs two training steps. Then it reads
# back the layout, and reads the collectives from the compiled step's HLO.

# %%
import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

ids = np.arange(N_DEV)
hand_mesh = xs.Mesh(ids, (N_DEV // P.model_axis, P.model_axis), ("data", "model"))
print(f"mesh {dict(zip(hand_mesh.axis_names, hand_mesh.mesh_shape))}; model groups (rows):",
      ids.reshape(hand_mesh.mesh_shape).tolist())

torch.manual_seed(P.seed)                      # the same initial weights as every strategy below
hand = GPT(gcfg).to(torch_xla.device())
for block in hand.blocks:
    xs.mark_sharding(block.mlp.fc.weight, hand_mesh, ("model", None))    # rows: hidden units split
    xs.mark_sharding(block.mlp.proj.weight, hand_mesh, (None, "model"))  # columns: partial sums of the output
opt = torch.optim.AdamW(hand.parameters(), lr=P.lr, betas=(0.9, 0.95), weight_decay=0.0)
seen = S.dumped(HLO_DIR) if DUMPING else set()
hand_losses = []
for xb, yb in batches[:2]:
    xb, yb = xb.to(torch_xla.device()), yb.to(torch_xla.device())
    xs.mark_sharding(xb, hand_mesh, ("data", None))   # (B, T): sequences split over "data"
    xs.mark_sharding(yb, hand_mesh, ("data", None))
    _, loss = hand(xb, yb)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch_xla.sync()
    hand_losses.append(loss.detach())
hand_losses = [float(v) for v in torch.stack(hand_losses).cpu()]
w = hand.blocks[0].mlp
hand_layout = {"mlp.fc.weight": S.sharding_of(w.fc.weight), "mlp.proj.weight": S.sharding_of(w.proj.weight),
               "batch": S.sharding_of(xb)}
shapes = {"mlp.fc.weight": tuple(w.fc.weight.shape), "mlp.proj.weight": tuple(w.proj.weight.shape),
          "batch": tuple(xb.shape)}
for name, spec in hand_layout.items():
    print(f"{name:16s} {str(shapes[name]):10s} one device holds {S.shard_shape(shapes[name], spec)}:  {spec}")
print("losses of two steps:", " ".join(f"{v:.4f}" for v in hand_losses))
assert S.shard_shape(shapes["mlp.fc.weight"], hand_layout["mlp.fc.weight"])[0] == shapes["mlp.fc.weight"][0] // P.model_axis
assert S.shard_shape(shapes["batch"], hand_layout["batch"])[0] == P.batch_size // (N_DEV // P.model_axis)
if DUMPING:
    _, hlo = S.newest_step_graph(HLO_DIR, seen)
    ops = S.collective_ops(hlo)
    tally = {}
    for o in ops:
        tally.setdefault((o["op"], o["group"]), []).append(o["result"])
    for (op, group), results_ in sorted(tally.items()):
        print(f"  {len(results_):3d} x {op:10s} within groups of {group} devices, e.g. {results_[0]}")
    # predicted: each model-group all-reduce carries one output of the MLP for this device's sequences, (B/data, T, C)
    per_sum = P.batch_size // (N_DEV // P.model_axis) * P.block_size * P.n_embd * 4
    mine = [o["bytes"] for o in ops if o["op"] == "all-reduce" and o["group"] == P.model_axis]
    print(f"predicted {per_sum:,} B per all-reduce within a model group; measured {sorted(set(mine))}")
    assert mine and per_sum in mine and all(b % per_sum == 0 for b in mine), \
        "the row-parallel proj's partial sums are completed by an all-reduce within each model group"
    assert any(o["op"] == "all-reduce" and o["group"] > P.model_axis for o in ops), \
        "gradients of the weights left whole are summed across the data groups"

# %% [markdown]
# After the mesh line, the printout has three parts. First, each tensor's shape, the slice one device holds, and its
# sharding string. Then the losses of the two steps. Last, the collectives of the step, grouped by kind and group size,
# with the predicted size of the model group's all-reduce beside the measured ones.
#
# **The whole Megatron block.** Attention gets the same pair. q, k and v are column parallel: each device of a model
# group computes whole heads of its own, and attention needs nothing from the other heads. Attention's output projection
# is row parallel: it gives a partial sum, which an all-reduce completes. labkit's tensor-parallel strategy in section 4
# splits both attention and the MLP.
#
# Per block that makes **2 all-reduces in the forward**, after attention and after the MLP. Each carries one data
# slice's activations, (B/data, T, C). The backward mirrors them. The gradient with respect to a column-parallel layer's
# input is a partial sum over the devices' slices. So the inputs of q/k/v and of `mlp.fc` need **2 more**. That makes 4
# all-reduces per block, all within a model group. Section 7 counts them in the HLO, and exercise 4 asks for their
# bytes.

# %% [markdown]
# **Reading a sharding string.** `S.sharding_of` prints torch_xla's own text, XLA's HLO sharding. Take `mlp.fc.weight`
# on this (4, 2) mesh, split by rows over `"model"`. Its string reads like
# `{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}`.
#
# - `[2,1,4]` cuts the tensor into 2 × 1 tiles: dim 0 in two, dim 1 whole.
# - The last number, 4, with `last_tile_dim_replicate`, says that 4 devices hold each tile. That is the data axis: one
#   copy per data group.
# - The device ids follow, tile by tile. Tile 0, the first half of the rows, lives on devices 0, 2, 4 and 6. Tile 1
#   lives on 1, 3, 5 and 7. So each model group, such as `[0, 1]` or `[2, 3]`, holds both halves.
# - `{replicated}` is a tensor every device holds whole. `{devices=[4,1]0,1,2,3}`, without the last word, is a tensor
#   cut in 4 with no copies.
#
# XLA also added collectives nobody asked for: the all-gathers above. Wherever a tensor laid out one way meets an op
# that needs another layout, the partitioner moves data. Section 7 counts these for every strategy.
#
# The strategies below do exactly this for you. `labkit.spmd.make_mesh` builds the same mesh. The tensor-parallel
# strategy marks the same two weights, attention's heads, and the batch, the same way. The cell after training checks
# it: the same sharding strings and, from the same weights and batches, the same losses.
#
# *torch_xla's*: `xs.Mesh`, `xs.mark_sharding` and reading the partitioned HLO. *Carries over*: a mesh of named axes and
# a placement per tensor dimension. DTensor writes them as `DeviceMesh` with `Shard(dim)` and `Replicate()`, which is
# also how TorchTPU shards (not run here). JAX writes them as `NamedSharding` with a `PartitionSpec`.

# %% [markdown]
# ## 4. Train four ways
# `labkit.lessons.parallel_gpt.train` does five things for each strategy:
#
# 1. it builds the model;
# 2. it creates AdamW's moments with each weight's sharding before the first step, so the step compiles once;
# 3. it runs the steps with the batch marked as split;
# 4. it waits for the device after each step, so the step times are honest;
# 5. it reads the collectives from the newest compiled step graph.
#
# Each strategy prints one line: its mesh, its seconds including compiling, and its first and last losses. The losses
# should start at the same value on every line.
#
# The FSDP run prints a warning from torch:
# `Full backward hook is firing when gradients are computed with respect to module outputs since no inputs require gradients`.
# torch_xla's FSDPv2 hooks each wrapped module's backward to place an optimization barrier. A GPT's input is token ids,
# which never require gradients. The warning is expected and harmless.

# %%
STRATEGIES = ("single", "data", "tensor", "fsdp")
results = {}
for name in STRATEGIES:
    t0 = time.perf_counter()
    results[name] = r = PG.train(PG.Strategy(name, model_axis=P.model_axis), gcfg, batches, lr=P.lr,
                                 dump_dir=HLO_DIR if DUMPING else None, seed=P.seed)
    print(f"{name:7s} mesh {r.mesh_shape}: {time.perf_counter() - t0:5.1f} s with compiling; losses "
          + " ".join(f"{v:.3f}" for v in r.losses[:3]) + (" ... " + f"{r.losses[-1]:.3f}" if P.steps > 3 else ""))

# %%
tp = results["tensor"]
lib = dict(tp.model.named_parameters())
lib_layout = {"mlp.fc.weight": S.sharding_of(lib["blocks.0.mlp.fc.weight"]),
              "mlp.proj.weight": S.sharding_of(lib["blocks.0.mlp.proj.weight"]), "batch": tp.batch_spec}
drift = max(abs(a - b) for a, b in zip(hand_losses, tp.losses))
print(f"by hand vs labkit's tensor parallel: same layout {lib_layout == hand_layout}; losses of two steps differ by "
      f"at most {drift:.1e} nats (tolerance {P.loss_tol:g})")
assert lib_layout == hand_layout, (lib_layout, hand_layout)
assert drift <= P.loss_tol, (hand_losses, tp.losses[:2])

# %% [markdown]
# ## 5. Where the weights and the batch live
# The cell above compares the hand-made layout with labkit's tensor-parallel strategy. Look for `same layout True` and a
# loss difference below the tolerance.
#
# The figure below shows, for each strategy, two weight matrices of block 0 and the batch. Each is split into the slices
# the devices hold. The figure is not to scale: every tensor fills a box of the same size, with its shape in the title.
# The slices show *how* a tensor is split, not how big it is. The colour is the first device holding a slice. Grey means
# every device holds all of it.
#
# * **one device**: under SPMD, a program with nothing sharded is *replicated*. Every device holds all of it and
#   computes the whole step. On a TPU that takes the time of one chip. On the CPU the 8 copies share the cores (section
#   8). This run is the reference the other three must agree with.
# * **data parallel**: the MLP's weights are whole on every device (grey). The batch's rows, its sequences, are split
#   into 8.
# * **tensor parallel**: as in section 3. `mlp.fc` (4C x C) is split by rows, column parallel: each device of a model
#   group computes half the hidden units. `mlp.proj` (C x 4C) is split by columns, row parallel: each half produces a
#   partial sum of the output, which an all-reduce completes. Devices 0, 2, 4 and 6 hold the same half. The batch is
#   split in 4 over `data`, and a model pair holds each quarter.
# * **FSDP**: every weight is split 8 ways along its largest dimension, one slice per device. That is FSDPv2's choice:
#   rows of `mlp.fc`, columns of `mlp.proj`. The batch is split 8 ways too.

# %%
SHOWN = ("blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight")
panels = []
for name, r in results.items():
    layout = {row[0]: row for row in r.layout}
    tensors = [(w.split(".", 2)[2], layout[w][1], layout[w][3]) for w in SHOWN]
    tensors.append(("batch (B, T)", (P.batch_size, P.block_size), r.batch_spec))
    mesh_text = "replicated" if name == "single" else str(r.mesh_shape)
    panels.append({"strategy": name, "devices": N_DEV, "mesh": mesh_text,
                   "tensors": tensors})
fig = labkit.spmd.draw_layouts(panels)
if os.environ.get("LABKIT_ARTIFACTS"):   # headless runs ($LABKIT_ARTIFACTS) keep the figure
    os.makedirs(os.environ["LABKIT_ARTIFACTS"], exist_ok=True)
    png = os.path.join(os.environ["LABKIT_ARTIFACTS"], "sharding-layouts.png")
    fig.savefig(png, dpi=110)
    print("saved", png)

fc = {name: S.tile_devices(2, {row[0]: row for row in r.layout}[SHOWN[0]][3]) for name, r in results.items()}
assert fc["single"] == fc["data"] == {(0, 0): []}, "data parallel replicates every weight"
assert sorted(map(len, fc["tensor"].values())) == [N_DEV // P.model_axis] * P.model_axis, fc["tensor"]
assert sorted(sum(fc["fsdp"].values(), [])) == list(range(N_DEV)), "FSDP gives each device its own slice"
assert len(S.tile_devices(2, results["data"].batch_spec)) == N_DEV
assert len(S.tile_devices(2, results["tensor"].batch_spec)) == N_DEV // P.model_axis

# %% [markdown]
# ## 6. Bytes one device holds
# The bytes are read from each tensor's sharding with `labkit.spmd.sharding.device_bytes`. It counts the largest shard
# of each tensor, padding included. AdamW keeps two moments per weight, each with its weight's layout. So optimizer
# state is twice the parameters in every strategy, and 3x the weights in all. Gradients and activations come on top and
# are not counted here.
#
# * data parallel: everything is replicated, the same as one device. Memory does not shrink with more devices.
# * tensor parallel: the split matrices are halved (`model_axis=2`). Embeddings, LayerNorms and the row-parallel biases
#   stay whole.
# * FSDP: every tensor is split over all 8 devices along its largest dimension, the first of them on a tie. That is
#   torch_xla FSDPv2's rule, whatever the order of the dimensions. PyTorch's FSDP2, `fully_shard`, splits dim 0 instead
#   unless its `shard_placement_fn` says otherwise.
# * FSDP holds about **total / 8**, exactly when every tensor's largest dimension divides by 8. Where one does not, its
#   last slices are padded, so a device holds a little more. `labkit.spmd.sharding.predict_fsdp` computes it from the
#   shapes alone.
#
# The table's last column divides each strategy's parameter bytes by the one-device figure. Read 1.000 for data
# parallelism, a value between 0.5 and 1 for tensor parallelism, and about 0.125 for FSDP.

# %%
FS = S.predict_fsdp(gcfg, N_DEV)
single_bytes = results["single"].param_bytes
print(f"{'strategy':8s} {'params/device':>14s} {'AdamW/device':>13s} {'vs one device':>14s}")
for name, r in results.items():
    print(f"{name:8s} {r.param_bytes:14,d} {r.opt_bytes:13,d} {r.param_bytes / single_bytes:14.3f}")
assert single_bytes == PARAM_BYTES and results["data"].param_bytes == single_bytes
assert all(r.opt_bytes == 2 * r.param_bytes for r in results.values()), "AdamW: two moments per weight"
assert results["fsdp"].param_bytes == FS["param_bytes"] and results["fsdp"].opt_bytes == FS["opt_bytes"]
assert abs(results["fsdp"].param_bytes * N_DEV / single_bytes - 1) < 0.05, "FSDP holds about total / devices"
assert results["fsdp"].param_bytes < results["tensor"].param_bytes < single_bytes

# %% [markdown]
# ## Your turn: predict, then measure
# Four exercises check themselves here (`labkit.lessons.exercises`), and a fifth follows section 7b. Replace each `...`,
# run the cell, then run the check cell below it. A solution hides in the collapsed cell between them. It runs only with
# `LABKIT_SOLUTIONS=1`. If you leave an exercise, its check prints "not yet" and the rest of the notebook runs on.
#
# **1.** How many bytes must one data-parallel training step all-reduce? Write `dp_bytes(model)` from a model's
# parameters. The answer is the size of the buffers the step sums. What one device then *sends* is another number, which
# section 7b computes. The check tries your function on models of other sizes and dtypes. Then it tries it on `probe`,
# the GPT of section 2, before section 7 shows what XLA did.

# %%
import math  # for the exercises: math.ceil and math.prod

from labkit.lessons import exercises as ex
from labkit.lessons.exercises import nb03

def dp_bytes(model):
    ...   # your code

# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():
    def dp_bytes(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

# %%
ex.check("03.dp_bytes", lambda: nb03.check_dp_bytes(
    dp_bytes, probe, results["data"].collectives.get("all-reduce", {}).get("bytes")))

# %% [markdown]
# **2.** Lay a tensor out as FSDPv2 lays out a parameter, on the device. `SpmdFullyShardedDataParallel` calls
# `xs.mark_sharding(param, mesh, spec)` for every parameter. The *partition spec* has one entry per dimension of the
# tensor: the name of a mesh axis to split that dimension over, or `None` to keep it whole.
#
# FSDPv2 splits each parameter along its **largest** dimension over the mesh's `"fsdp"` axis, and nothing else. On a tie
# it takes the first of the largest dimensions. That rule is torch_xla FSDPv2's. PyTorch's FSDP2 (`fully_shard`) splits
# dim 0 of every parameter unless you pass a `shard_placement_fn`.
#
# Write `fsdp_shard(t, mesh)`. It marks the XLA tensor `t` that way on `mesh` and returns it. The mesh is 1-D, with the
# axis `"fsdp"` over all devices. The check gives your function tensors of random shapes, with the largest dimension
# first, last, in the middle, or tied. It compares the layout with the one that torch_xla's
# `SpmdFullyShardedDataParallel` gives a parameter of the same shape. It also counts torch_xla's device-to-host copies:
# the tensor must stay where it is.

# %%
import torch_xla.distributed.spmd as xs

mesh = labkit.spmd.make_mesh(None, ("fsdp",))   # all devices on one axis named "fsdp", as in the FSDP run

def fsdp_shard(t, mesh):
    ...   # your code: xs.mark_sharding(t, mesh, spec), then return t


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():
    def fsdp_shard(t, mesh):
        big = list(t.shape).index(max(t.shape))   # index() finds the first of equal sizes
        xs.mark_sharding(t, mesh, tuple("fsdp" if d == big else None for d in range(t.dim())))
        return t

# %%
ex.check("03.fsdp_shard", lambda: nb03.check_fsdp_shard(fsdp_shard, mesh))

# %% [markdown]
# **3.** Predict what that layout costs. When the largest dimension does not divide over the devices, every slice has
# the size of the first one, `ceil(size / devices)` of that dimension. The last slices are padded. Write
# `fsdp_bytes(shape, devices, bytes_per=4)`: the bytes one device holds.
#
# The check measures its answers on the mesh. It lays out tensors of random shapes, float32 and bfloat16, with
# torch_xla's FSDPv2 and reads their shardings. It tries other device counts against the rule on paper. Then it sums
# your function over `probe`'s parameters: that must give section 6's FSDP bytes per device, exactly. `math` is imported
# above, for `math.ceil` and `math.prod`.

# %%
def fsdp_bytes(shape, devices, bytes_per=4):
    ...   # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():
    def fsdp_bytes(shape, devices, bytes_per=4):
        big = max(shape)
        return math.ceil(big / devices) * math.prod(shape) // big * bytes_per

# %%
ex.check("03.fsdp_bytes", lambda: nb03.check_fsdp_bytes(fsdp_bytes, mesh, probe, results["fsdp"].param_bytes))

# %% [markdown]
# **4.** Megatron's tensor parallelism all-reduces activations inside every block. Section 3 counted **4 per block**, 2
# in the forward and 2 in the backward. Each carries one data slice's activations, (B/data, T, C), within a model group.
# Section 7 finds them in the HLO.
#
# Write `megatron_bytes(B, T, C, L, data)`: the float32 bytes of the activation buffers that one model group all-reduces
# in one training step. Every model group does the same for its own data slice, so do not add the groups up. The global
# batch is B sequences of T tokens, the width is C, there are L blocks, and the mesh's `data` axis has `data` devices.

# %%
def megatron_bytes(B, T, C, L, data):
    ...   # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():
    def megatron_bytes(B, T, C, L, data):
        return 4 * L * (B // data) * T * C * 4   # 2 forward + 2 backward per block, one data slice each

# %%
ex.check("03.megatron", lambda: nb03.check_megatron_bytes(megatron_bytes))

# %% [markdown]
# ## 7. The collectives, predicted and measured
# Under SPMD you never call a collective. XLA's partitioner inserts them where a sharded computation needs data that
# another device holds. Here the partitioner is GSPMD; newer XLA uses Shardy. The collectives are visible only in the
# *optimized* HLO, after partitioning, which XLA dumped. `labkit.spmd.sharding.count_collectives` reads their count and
# bytes per kind. The bytes are the size of the buffer each collective works on.
#
# First, the prediction from first principles. It counts one training step in float32, for `L` blocks, width `C`,
# context `T` and global batch `B`:
#
# * **data parallel** (`predict_data_parallel`): every device computes the gradient of its slice of the batch. The step
#   needs their sum: one **all-reduce** per parameter tensor, of the parameter bytes. Nothing else moves.
# * **tensor parallel** (`predict_tensor_parallel`, Megatron): section 3's 4 all-reduces per block, 2 forward and 2
#   backward. Each runs within one model group, on one data slice's activations, (B/data, T, C). Then comes data
#   parallelism over the `data` axis: each gradient is all-reduced at the size one device holds.
# * **FSDP** (`predict_fsdp`): the textbook, ZeRO-3. It gathers every weight before its forward and again before its
#   backward: **all-gathers** of 2 x the parameter bytes. It **reduce-scatters** each gradient, of the parameter bytes.
#
# PyTorch's FSDP2 gathers a little less than the textbook, because it works per *unit*: each module passed to
# `fully_shard`. The root unit keeps its weights gathered from the forward to the backward, so it gathers them once a
# step. labkit's FSDP2 plan makes each residual block a unit. Its Trainer also keeps the last block gathered after its
# forward, since that block's backward comes next. So one step issues 2 L all-gathers for L blocks, and one
# reduce-scatter per unit, L + 1 in all. Notebooks 08 and 09 count them.
#
# Then the cell prints what XLA did, and the difference (`labkit.spmd.sharding.extra_collectives`). On XLA:CPU with
# torch_xla 2.9 the compiled step moves **more** than the prediction. Each extra has a reason:
#
# * The tied token table is one parameter but gets two gradients, from the embedding lookup and from the output layer.
#   XLA all-reduces each before adding them: one extra all-reduce of `256 x C`.
# * The mean loss costs three scalar all-reduces.
# * LayerNorm: GSPMD partitions LayerNorm's backward, as torch_xla lowers it, with two **all-gathers** of the whole
#   batch's activations, (B, T, C), per LayerNorm. There are `2L + 1` LayerNorms. So activations travel where the
#   textbook moves none. That is a property of this partitioner on this graph, not of data parallelism.
# * Tensor parallel only: q, k and v are three matrices here, so their input gradients are all-reduced one by one. That
#   is 3 all-reduces instead of Megatron's 1, or 2 extra per block.
# * Tensor parallel only: the partitioner re-gathers the heads around `scaled_dot_product_attention`, instead of keeping
#   them apart. That costs four all-gathers per block, each of one data slice's activations. Marking q, k and v's layout
#   inside the attention with `mark_sharding` should keep the heads apart; that is *not verified here*.
# * FSDP: with layers this small, GSPMD moves *activations*, with all-to-all, collective-permute and activation
#   all-gathers. It sums each gradient with an **all-reduce** of the whole gradient, then a slice that keeps this
#   device's 1/8. That is a reduce-scatter written as all-reduce + dynamic-slice; section 7b finds them in the HLO.
# * FSDP: only the bytes per device of section 6 are a prediction that GSPMD honours exactly. So the cell asserts what
#   must hold whichever way XLA goes. The weights are never replicated, and communication costs more than data
#   parallelism's.
#
# The sizes printed are the *buffers* the collectives work on. Added up across kinds, they are not what a device sends.
# A ring all-gather or reduce-scatter of a buffer V sends V·(W−1)/W per device, and an all-reduce twice that, as section
# 7b shows. So the comparison at the end counts what one device sends (`labkit.spmd.comm.traffic`).
#
# What is asserted: the measured step moves at least the predicted bytes in all-reduces, since the gradients must be
# summed whatever else happens. On XLA:CPU the extras are exactly the ones listed above. On a TPU, XLA combines and
# schedules collectives its own way, with async pairs, combined all-reduces and reduce-scatters. There the cell prints
# prediction, measurement and difference, and does not insist on the breakdown. How a TPU's compiler splits them is *not
# verified here*.

# %%
from labkit.spmd import comm


def fmt(coll):
    return ", ".join(f"{k} {v['count']} x = {v['bytes'] / 1e6:.3f} MB" for k, v in sorted(coll.items()) if v["count"]) or "none"


def fmt_extra(extra):
    return ", ".join(f"{k} {d['count']:+d} ({d['bytes'] / 1e6:+.3f} MB)" for k, d in sorted(extra.items())) or "none"


data_axis = N_DEV // P.model_axis
PRED = {"single": {},
        "data": S.predict_data_parallel(gcfg, P.batch_size),
        "tensor": S.predict_tensor_parallel(gcfg, P.batch_size, data_axis, P.model_axis),
        "fsdp": FS["textbook"]}
EXTRA = {name: S.extra_collectives(PRED[name], r.collectives) for name, r in results.items()}
for name, r in results.items():
    print(f"{name:7s} predicted:  {fmt(PRED[name])}" + ("  (textbook ZeRO-3)" if name == "fsdp" else ""))
    print(f"{'':7s} measured:   {fmt(r.collectives)}")
    print(f"{'':7s} difference: {fmt_extra(EXTRA[name])}")
if DUMPING:
    assert results["single"].collectives == {}, "one device needs no collective"
    for name in ("data", "tensor"):   # the gradients must be summed, whatever else the partitioner does
        got = results[name].collectives.get("all-reduce", {"bytes": 0})["bytes"]
        assert got >= PRED[name]["all-reduce"]["bytes"], f"{name}: all-reduced {got:,} B < predicted"
if DUMPING and rt.kind == "xla-cpu":   # the extras explained above, term by term (torch_xla 2.9, GSPMD)
    C, L, T, B = gcfg.n_embd, gcfg.n_layer, gcfg.block_size, P.batch_size
    table, scalars, ln = gcfg.vocab_size * C * 4, 3 * 4, 2 * L + 1
    act = (B // data_axis) * T * C * 4          # one data slice's activations
    assert EXTRA["data"] == {"all-reduce": {"count": 1 + 3, "bytes": table + scalars},
                             "all-gather": {"count": 2 * ln, "bytes": 2 * ln * B * T * C * 4}}, EXTRA["data"]
    assert EXTRA["tensor"] == {"all-reduce": {"count": 1 + 3 + 2 * L, "bytes": table + scalars + 2 * L * act},
                               "all-gather": {"count": 2 * ln + 4 * L,
                                              "bytes": 2 * ln * B * T * C * 4 + 4 * L * act}}, EXTRA["tensor"]
    sent = {n: comm.traffic(results[n].ops) for n in ("data", "fsdp")}   # bytes one device sends, ring factors
    assert sent["fsdp"] > sent["data"], f"FSDP sent {sent['fsdp']:,.0f} bytes per device, data parallel {sent['data']:,.0f}"
    assert sum(c["op"] == "all-reduce" and c["result"] == "f32[]" for c in results["fsdp"].ops) == 3, "the mean loss"
    print(f"per device, FSDP sent {sent['fsdp'] / sent['data']:.1f}x what data parallelism sent in this step graph "
          f"(XLA:CPU's choices: activations travel); the textbook ratio is "
          f"{comm.traffic(comm.strategy_collectives('fsdp', 1, N_DEV)) / comm.traffic(comm.strategy_collectives('data', 1, N_DEV)):.1f}x")
elif not DUMPING:
    print("no HLO dump (XLA_FLAGS was set after torch_xla started): restart the kernel to count collectives")

# %% [markdown]
# **Reading a difference line.** Each entry is the measured count minus the predicted one. Then come the bytes, measured
# minus predicted. The two signs can differ.
#
# FSDP's all-gather entry has fewer gathers than the textbook's two per weight tensor, but more bytes. Some of XLA:CPU's
# gathers carry activations, B·T rows of C, which textbook FSDP never gathers. Its negative reduce-scatter entry is the
# textbook's reduce-scatters, all missing. Section 7b finds them, written as all-reduces followed by a slice.
#
# The last line of the output compares what one device sent under FSDP with data parallelism in this step graph. Read
# the measured ratio beside the textbook's 1.5x. The measured one is larger because XLA:CPU moves activations.

# %% [markdown]
# ## 7b. Bytes into time
# **A reduce-scatter, looked for.** FSDP's textbook step reduce-scatters each gradient. Every device ends with the sum
# over all devices of *its own* 1/W slice. The count above has no `reduce-scatter` on XLA:CPU.
#
# What XLA:CPU wrote instead can be read from the same HLO with `labkit.spmd.sharding.sliced_all_reduces`. It is an
# all-reduce of the whole gradient, then an instruction that reads it with `partition-id`, this device's number. That
# instruction keeps one slice of 1/W, and is usually fused into AdamW's update. The result is the same, at twice the
# traffic of a reduce-scatter.
#
# XLA's GPU compiler has a pass, `ReduceScatterCreator` in XLA's source, that rewrites exactly this pattern into a
# reduce-scatter. The CPU compiler of torch_xla 2.9 does not run it, as the count shows. On a TPU the cell prints what
# that compiler chose; that case is *not verified here*.
#
# Each line of the list gives the all-reduce, the shape it sums, the slice each device keeps, and the fused instruction
# that slices it. The shape tells what is summed. The fast run's sizes differ on purpose: vocabulary 256, B·T = 384
# tokens, C = 32.
#
# - A `(C,)` result is a LayerNorm parameter's gradient.
# - `(256, C)` is the token table's gradient. `(C, 256)` is most likely the same table, transposed, as the tied output
#   layer uses it.
# - A result with B·T rows is an activation, sliced along C.
#
# The cell's last line counts the results that have a parameter's shape. The other gradients are reduced by the
# collectives that the count above lists. This notebook does not take those apart.

# %%
fsdp_text = open(results["fsdp"].hlo_path).read() if DUMPING else ""
sliced = S.sliced_all_reduces(fsdp_text)
rs = results["fsdp"].collectives.get("reduce-scatter", {"count": 0})["count"]
print(f"FSDP step graph: {rs} reduce-scatter(s); {len(sliced)} all-reduce(s) each device then slices to 1/W:")
for a in sliced:
    print(f"  {a['all-reduce']:15s} {a['result']:12s} -> {a['slice']:10s} in {a['user']} (groups of {a['group']})")
param_shapes = {"f32[" + ",".join(map(str, p.shape)) + "]" for p in probe.parameters()}
of_params = sum(a["result"] in param_shapes for a in sliced)
print(f"{of_params} of the {len(sliced)} have the shape of one of the model's {len(list(probe.parameters()))} parameter "
      f"tensors (a gradient); vocabulary {gcfg.vocab_size}, B·T = {P.batch_size * P.block_size} tokens, C = {P.n_embd}")
if DUMPING and rt.kind == "xla-cpu":
    assert rs == 0 and sliced, "XLA:CPU writes FSDP's gradient reduce-scatters as all-reduce + a slice"
    # a LayerNorm weight's gradient, (C,) summed whole and cut to (C/W,): a parameter's, not an activation's
    assert f"f32[{P.n_embd}]" in {a["result"] for a in sliced}, sliced
    assert f"f32[{P.n_embd // N_DEV}]" in {a["slice"] for a in sliced}, sliced
    assert not S.sliced_all_reduces(open(results["data"].hlo_path).read()), "data parallelism keeps whole gradients"
elif DUMPING:
    print("on this backend:", "reduce-scatter" if rs else "all-reduce + slice" if sliced else "neither found")

# %% [markdown]
# **What a device sends, and how long it takes.** Take a ring of W devices and a buffer of V bytes
# (`labkit.spmd.comm.sent`). An all-gather or a reduce-scatter sends **V·(W−1)/W** per device. An all-reduce sends
# **2·V·(W−1)/W**, because it is a reduce-scatter followed by an all-gather. So per step, for N weights of g bytes:
#
# | strategy | collectives per step | bytes one device sends |
# |---|---|---|
# | data parallel | all-reduce of the gradients | 2·N·g·(W−1)/W |
# | FSDP (ZeRO-3) | all-gather the weights twice (forward, backward), reduce-scatter the gradients | 3·N·g·(W−1)/W: **1.5×** data parallelism |
# | tensor parallel (Megatron) | 4 all-reduces of one data slice's activations (tokens × C) per block | 8·L·tokens·C·g·(M−1)/M |
#
# The time is the bytes divided by what a chip can send over its inter-chip interconnect, ICI. Google's Cloud TPU pages
# give a *bidirectional* ICI bandwidth per chip. A chip sends half of it, and only with every port busy. A ring along
# one axis of v5e's 2-D torus uses 2 of its 4 ports, so it takes twice the time.
#
# Those pages also give a pod's "all-reduce bandwidth". Divided by the pod's chips, it gives the same figure, and the
# tests check that. v4's page has no per-chip figure, so v4's value is derived from the pod's all-reduce bandwidth. The
# figures are Google's and were not measured here: there is no TPU. They are marked *not verified here* in the table.
#
# *Source: docs.cloud.google.com/tpu/docs/v4, v5e, v5p-training and v6e, read 2026-11.*

# %%
from labkit.dashboard import flops as F_

print(f"{'chip':5s} {'sends/s':>9s} {'bf16 peak':>10s}   {'ports':>5s}  source")
for chip, link in comm.ICI.items():
    print(f"{chip:5s} {link.send_bytes_per_s / 1e9:6.0f} GB/s {F_.PEAKS['TPU ' + chip]['bf16'] / 1e12:6.0f} TFLOP/s {link.ports:5d}  "
          f"{link.source} (not verified here)")
print("\nthis notebook's GPT, what one device sent per step (read from the HLO above), in time over each chip's ICI:")
print(f"{'strategy':8s} {'bytes sent':>11s} " + " ".join(f"{c:>9s}" for c in comm.ICI))
for name, r in results.items():
    b = comm.traffic(r.ops)
    print(f"{name:8s} {b:11,.0f} " + " ".join(f"{1e6 * comm.ICI[c].seconds(b):7.2f}us" for c in comm.ICI))
assert comm.traffic(results["single"].ops) == 0
textbook = {s: comm.traffic(comm.strategy_collectives(s, PARAM_BYTES / 4, N_DEV, bytes_per=4)) for s in ("data", "fsdp")}
assert textbook["fsdp"] == 1.5 * textbook["data"], textbook   # not 3x: the buffers of different collectives differ
print(f"textbook, this GPT in float32 on {N_DEV} devices: data parallel sends {textbook['data']:,.0f} B per device, "
      f"FSDP {textbook['fsdp']:,.0f} B (1.5x)")

# %% [markdown]
# The first table lists each chip's send rate, its bf16 peak and its ports. The second turns the bytes this notebook's
# GPT sent per step into microseconds over each chip's ICI. FSDP's row is the largest, as section 7 found. The last line
# gives the textbook figures for this GPT: FSDP sends 1.5x what data parallelism sends.
#
# **Where each strategy starts waiting for the network.** A step's compute grows with the tokens each chip processes.
# The data-parallel and FSDP traffic does not: it is the size of the weights. With perfect overlap, the step is
# compute-bound while each collective takes no longer than the compute **that runs while its data exists**.
#
# A gradient appears during the backward, so its all-reduce can hide behind the backward only. The backward is 4 of the
# 6 FLOPs per weight and token. The forward is over before the first gradient exists.
#
# Take N weights, b tokens per chip, F FLOP/s per chip and S bytes sent per second. The bounds below follow the scaling
# book, "How to Parallelize a Transformer for Training". There, data parallelism and FSDP are compute-bound above the
# same per-axis bound, C / W_ici. `comm.critical_tokens` computes it:
#
# - data parallel: backward 4·N·b/F ≥ 2·N·g/S  →  **b ≥ g·F / (2·S)**
# - FSDP: forward 2·N·b/F ≥ N·g/S for one all-gather, and backward 4·N·b/F ≥ 2·N·g/S for an all-gather and a
#   reduce-scatter. That gives **the same b**. FSDP sends 1.5× the bytes, but a third of them go out during the forward,
#   and data parallelism has nothing to send then.
# - tensor parallel: per block and token, compute is 72·C²/M FLOPs against 8·C·g·(M−1)/M bytes sent. The batch cancels,
#   and the bound is on the width per device: **`C ≥ g·(M−1)·F / (9·S)`**. `comm.critical_width` and `max_model_axis`
#   compute it.
#
# N cancels too. The cell below takes bf16 (g = 2) at the chip's peak with every port busy. So it prints the *least*
# batch that can be compute-bound. At a real MFU of 40 %, multiply the batch by 0.4. With half the ports, as on a ring
# along one axis of the 2-D torus, multiply by 2. On a slice without wraparound links, multiply by about 2 again.
#
# The direction is the lesson. The faster the chip against its links, as on v6e, the more tokens each chip needs before
# the network hides.
#
# **Rings need wraparound.** The ring formulas assume that each axis closes into a ring. Google's v5p page states the
# rule for v5p: every slice of one 4×4×4 cube or more is a full 3-D torus, and the smaller slices are not. Some
# multi-cube shapes can also be twisted tori. Google's v4 page lists which v4 slice shapes form a 3-D torus.
#
# On v5e and v6e, wraparound links exist only on axes of 16 chips. That rule comes from the JAX team's book *How to
# Scale Your Model*, in its TPU chapter. The slices a learner rents have none: a v5e-8, shaped 2×4, or a v4-8, shaped
# 2×2×1. A collective there runs along a line, which takes roughly twice a ring's time. That factor is *not verified
# here*.
#
# *Sources: cloud.google.com/tpu/docs/v5p and cloud.google.com/tpu/docs/v4; jax-ml.github.io/scaling-book.*
#
# **This is the hardware's critical batch, not the optimizer's.** McCandlish et al. define a *statistical* critical
# batch size in "An Empirical Model of Large-Batch Training" (2018). Beyond it, a larger global batch no longer cuts the
# steps needed, and raising the learning rate with the batch stops paying.
#
# The bound here says how many tokens each chip needs to keep the network hidden. Theirs says how large the global batch
# may grow before extra chips stop buying progress. The global batch is tokens per chip × chips. A run needs both: the
# first sets a floor per chip, the second a ceiling on chips × that floor.
#
# **How the overlap happens.** The bound assumes that the transfers run while the chip computes. Someone has to arrange
# that. On a TPU, XLA issues collectives asynchronously: a TPU's optimized HLO holds pairs such as `all-gather-start` /
# `all-gather-done`. XLA's *latency-hiding scheduler* places independent compute between the start and the done.
#
# On a host with TPU chips, torch_xla 2.9 adds `xla_latency_hiding_scheduler_rerun` to `LIBTPU_INIT_ARGS` at import, in
# its `__init__.py`. That flag reruns the scheduler with less memory if overlapping ran out of it. Elsewhere torch_xla
# sets nothing. XLA:CPU has no such scheduler, so none of this is verified here.
#
# Under FSDP2 on GPUs, the all-gather of the next unit is issued on its own stream while the current unit computes.
# `set_modules_to_forward_prefetch` and `set_modules_to_backward_prefetch` issue them earlier, at the cost of memory.
#
# Either way, each collective can hide only behind compute that needs none of its result. A block's weight gather hides
# behind the previous block's matmuls. A gradient's reduction hides behind the backward of the layers below it. The
# gradient computed last, the first layer's, has nothing left to hide behind. The optimizer step waits for its
# reduction.
#
# **Across slices.** Chips of one slice talk over ICI. Slices talk over the data-centre network, DCN, which is far
# slower per chip. Google's TPU pages give a v5e host two 100 Gbit/s NICs for its 8 chips. That is 25 Gbit/s, about 3.1
# GB/s per chip each way. Compare it with what a chip *sends* over ICI, 200 GB/s: the pages' 400 GB/s counts both
# directions.
#
# A v5p chip gets 50 Gbit/s of DCN, against 600 GB/s sent over ICI, or 1,200 GB/s both ways. The page does not say
# whether that 50 Gbit/s is each way. The cell reads it so, which is *not verified here*.
#
# *Source: cloud.google.com/tpu/docs/v5e and v5p, read 2026-11.*
#
# The usual layout follows from the bounds above. FSDP or tensor parallelism runs inside a slice over ICI. Data
# parallelism runs across slices over DCN, where the only traffic is the gradients' all-reduce, hidden behind the
# backward. Under FSDP2 that layout is HSDP: its cross-host all-reduce runs once per unit, L + 1 times a step (notebook
# 09).
#
# The gradients are first reduce-scattered inside each slice. So each of a slice's M chips sends only its 1/M share over
# DCN. The bound keeps the data-parallel form, with S the DCN rate per chip, but counts the tokens of a whole slice:
# **b·M ≥ g·F / (2·S_DCN)**. The cell below prints it per slice and per chip of a 256-chip slice.
#
# This is a prediction from the pages' figures, *not verified here*. There is no TPU, XLA may arrange multislice
# collectives differently, and the NICs also carry the input pipeline.

# %%
print(f"{'chip':5s} {'F/S':>6s} {'data: tokens/chip':>18s} {'FSDP: tokens/chip':>18s} {'Megatron axis at C=2048':>24s}")
crit = {}
for chip in comm.ICI:
    peak = F_.PEAKS["TPU " + chip]["bf16"]
    crit[chip] = {s: comm.critical_tokens(s, peak, chip) for s in ("data", "fsdp")}
    print(f"{chip:5s} {peak / comm.ICI[chip].send_bytes_per_s:6.0f} {crit[chip]['data']:18,.0f} "
          f"{crit[chip]['fsdp']:18,.0f} {comm.max_model_axis(2048, peak, chip):>24d}")
for chip, c in crit.items():
    peak, send = F_.PEAKS["TPU " + chip]["bf16"], comm.ICI[chip].send_bytes_per_s
    assert abs(c["data"] - peak / send) < 1e-6 * c["data"] and abs(c["fsdp"] - c["data"]) < 1e-6 * c["fsdp"]
assert crit["v6e"]["fsdp"] > 2048 > crit["v5e"]["fsdp"], "one 2,048-token sequence per chip: enough on v5e, not on v6e"
# data parallelism across slices over DCN: tokens per slice (b·M) >= g·F / (2·S_DCN), S_DCN per chip (bytes/s)
DCN_PER_CHIP = {"v5e": 2 * 100e9 / 8 / 8, "v5p": 50e9 / 8}  # tpu/docs/v5e: 2 x 100 Gbps NICs per 8-chip host; v5p: 50 Gbps
for chip, dcn in DCN_PER_CHIP.items():
    peak = F_.PEAKS["TPU " + chip]["bf16"]
    per_slice = 2 * peak / (2 * dcn)
    print(f"{chip}: DCN {dcn / 1e9:.2f} GB/s per chip ({comm.ICI[chip].send_bytes_per_s / dcn:.0f}x less than its ICI send rate): data "
          f"parallelism across slices hides behind the backward from {per_slice:,.0f} tokens per slice, "
          f"{per_slice / 256:,.0f} per chip of a 256-chip slice")
    assert per_slice / 256 < crit[chip]["data"], "the slice's reduce-scatter leaves DCN a 1/M share: a lower bar per chip"

# %% [markdown]
# The first table gives each chip's ratio F/S and the least tokens per chip for data parallelism and FSDP: the two
# columns are equal, as the bound says. The last column is the largest model axis at which a width of 2,048 stays
# compute-bound. The two DCN lines give the tokens per slice, and per chip of a 256-chip slice, that hide the
# cross-slice all-reduce.
#
# **5. Your turn: time over the links, and what hides.** Write two predictions that nothing here can run, since there is
# no TPU. The check holds them to `labkit.spmd.comm`'s rules, on inputs it draws anew on every call. It refuses that
# module's own functions while yours run.
#
# - `allreduce_seconds(nbytes, chips, send_bytes_per_s, wraparound)`: the seconds of a ring all-reduce of a buffer of
#   `nbytes` along one axis of `chips` chips. Each chip sends `send_bytes_per_s` over the ports that axis uses. Section
#   7b gives the bytes: 2·B·(n−1)/n per chip. When the axis has no wraparound link (`wraparound=False`), it is a line:
#   take twice the time, the rough factor above.
# - `exposed_seconds(backward_s, reduce_s)`: for each layer, its backward time and its gradient's reduction time. Both
#   lists run in the order the backward runs, so index 0 is the last layer, computed first. Return the seconds the step
#   still waits for reductions after its backward ends. Each reduction starts as soon as its gradient exists *and* the
#   links are free, that is, once the previous reduction is done.

# %%
def allreduce_seconds(nbytes, chips, send_bytes_per_s, wraparound):
    ...   # your code


def exposed_seconds(backward_s, reduce_s):
    ...   # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():
    def allreduce_seconds(nbytes, chips, send_bytes_per_s, wraparound):
        ring = 2 * nbytes * (chips - 1) / chips / send_bytes_per_s   # reduce-scatter + all-gather
        return ring if wraparound else 2 * ring                      # a line: about twice a ring

    def exposed_seconds(backward_s, reduce_s):
        ready = end = 0.0
        for back, red in zip(backward_s, reduce_s):
            ready += back                     # this layer's gradient exists
            end = max(ready, end) + red       # its reduction waits for the gradient and for the links
        return end - ready

# %%
ex.check("03.comm_time", lambda: nb03.check_comm_time(allreduce_seconds, exposed_seconds))

# %% [markdown]
# The next cell runs your functions on two slices of v5e, or the library's if the check has not passed yet. The setting
# is data parallelism over one axis. The GPT has 24 blocks of width 2,048, with 12·C² weights a block. Its bf16
# gradients are 101 MB a block, and each chip gets 2,048 tokens. Each block's gradient is all-reduced as soon as its
# backward is done.
#
# The axis of 4 chips of a v5e-8 (2×4) is a line. The axis of 16 chips of a v5e-256 (16×16) is a ring. A ring along one
# axis uses 2 of a v5e's 4 ports.

# %%
passed = ex.results.get("03.comm_time", False)
ring_fn = allreduce_seconds if passed else (lambda b, n, s, w: comm.ring_seconds("all-reduce", b, n, s, w))
exposed_fn = exposed_seconds if passed else comm.exposed_seconds
C_X, L_X, TOK_X = 2048, 24, 2048
grad_bytes = 12 * C_X**2 * 2
axis_rate = comm.ICI["v5e"].send_bytes_per_s * 2 / comm.ICI["v5e"].ports
back_peak = 4 * 12 * C_X**2 * TOK_X / F_.PEAKS["TPU v5e"]["bf16"]   # a block's backward at the chip's peak
print("(your functions)" if passed else "(the library's functions: exercise 5 is not done yet)")
waits = {}
for name, shape in (("v5e-8", (2, 4)), ("v5e-256", (16, 16))):
    n, wrap = shape[1], comm.wraparound("v5e", shape)[1]
    t = ring_fn(grad_bytes, n, axis_rate, wrap)
    waits[name] = {mfu: exposed_fn([back_peak / mfu] * L_X, [t] * L_X) for mfu in (1.0, 0.4)}
    print(f"{name:8s} axis of {n:2d} ({'ring' if wrap else 'line'}): a block's all-reduce {1e3 * t:5.2f} ms; "
          f"after a backward of {1e3 * L_X * back_peak:.0f} ms at the peak the step waits {1e3 * waits[name][1.0]:5.2f} ms, "
          f"after {1e3 * L_X * back_peak / 0.4:.0f} ms at 40% MFU {1e3 * waits[name][0.4]:5.2f} ms")
print("not verified here (no TPU): Google's ICI figure and wraparound rule, and the line's factor 2, are the inputs")
assert waits["v5e-8"][1.0] > 10 * waits["v5e-256"][1.0], waits   # the line's reductions queue; the ring's hide
assert 0.4 < waits["v5e-8"][1.0] / (L_X * back_peak) < 0.6, waits   # "about half its backward again"
assert abs(waits["v5e-8"][0.4] / waits["v5e-256"][0.4] - 2 * (3 / 4) / (15 / 16)) < 1e-5, waits   # only the last

# %% [markdown]
# Read the two slices' lines above. At the chip's peak, the line's all-reduce of a block takes longer than the next
# block's backward. So the reductions queue, and the step waits about half its backward again. On the ring, each
# reduction hides behind the next block's backward. Only the first block's is left, since it is computed last.
#
# At 40 % MFU the backward is slow enough on both. What is left is that last all-reduce alone. The line's is 1.6 times
# the ring's, as `(3/4)·2 / (15/16)` says.

# %% [markdown]
# **A prediction for what cannot run here.** Take a GPT of 24 layers, width 2,048 and context 2,048: about 1.2 B
# weights. It trains in bf16 with fp32 master weights and AdamW on a **v5e-256**: 256 chips of 16 GB each. Each chip
# gets one sequence.
#
# First the memory. A weight costs 16 bytes: bf16 weight and gradient, 2 + 2; fp32 master, 4; two fp32 moments, 8. That
# is 19 GB, more than a v5e's 16 GB before a single activation. So data parallelism does not fit, and FSDP splits the
# state 256 ways.
#
# Then the time, first by hand, then by the library. FSDP sends 3·N·2·255/256 bytes per chip per step, about 7 GB. That
# takes 36 ms at 200 GB/s, against 75 ms of matmuls at the peak. At 40 % MFU the matmuls take 190 ms and hide it easily.
# Nothing here ran on a TPU: these are the consequences of the pages' figures, to check on a slice.
#
# Two conditions hide in those figures. **Bytes per weight, g = 2, holds only if the gathers move bf16.** Under
# autocast, as in notebook 02, the weights and gradients stay fp32. A weight still costs 16 bytes: fp32 weight 4,
# gradient 4, two moments 8. FSDP2 then gathers fp32, so g = 4. What FSDPv2 gathers under autocast is *not verified
# here*.
#
# bf16 gathers need FSDP2's `MixedPrecisionPolicy(param_dtype=torch.bfloat16)`. The usual `reduce_dtype=torch.float32`
# sums in fp32, so the reduce-scatter still moves 4 bytes a weight. The traffic is then `(2 + 2 + 4) / (3 × 2)` =
# **1.33×** the figure above.
#
# **Compute, 6·N per token, counts the weights only.** Attention's score and value products add 12·L·T·d per token.
# Notebook 02's exercise counts them, and `GPT.flops_per_token` includes them. Here they add 17 %: more time to hide the
# traffic behind.

# %%
import math

from labkit.models import GPTConfig as _Cfg
from labkit.profiling import roofline

V5E = roofline.V5E

big = _Cfg(block_size=2048, n_layer=24, n_head=16, n_embd=2048, dropout=0.0)
N_BIG = sum(math.prod(s) for s in S.gpt_param_shapes(big))
W, TOK, PEAK_V5E, ICI_V5E = 256, 2048, F_.PEAKS["TPU v5e"]["bf16"], comm.ICI["v5e"]
by_hand = {"dp_fits": 16 * N_BIG <= V5E.memory, "fsdp_fits": 16 * N_BIG / W <= V5E.memory,
           "fsdp_bytes": 3 * N_BIG * 2 * (W - 1) / W, "fsdp_s": 3 * N_BIG * 2 * (W - 1) / W / 200e9,
           "compute_s": 6 * N_BIG * TOK / 197e12}
lib = {"dp_fits": comm.fits(N_BIG, V5E.memory, W, "data"), "fsdp_fits": comm.fits(N_BIG, V5E.memory, W, "fsdp"),
       "fsdp_bytes": comm.step_comm("fsdp", N_BIG, W, "v5e")["bytes"],
       "fsdp_s": comm.step_comm("fsdp", N_BIG, W, "v5e")["seconds"],
       "compute_s": comm.compute_seconds(N_BIG, TOK, PEAK_V5E)}
print(f"{N_BIG / 1e9:.2f} B weights on a v5e-256, {TOK} tokens per chip: training state (weights, gradients, fp32 master, AdamW moments) "
      f"{16 * N_BIG / 1e9:.1f} GB (a v5e has {V5E.memory / 1e9:.0f} GB): data parallel fits {lib['dp_fits']}, "
      f"FSDP fits {lib['fsdp_fits']}; FSDP sends {lib['fsdp_bytes'] / 1e9:.2f} GB per chip per step, "
      f"{1e3 * lib['fsdp_s']:.1f} ms, against {1e3 * lib['compute_s']:.1f} ms of matmuls at the peak")
assert set(lib) == set(by_hand) and all(abs(lib[k] - by_hand[k]) <= 1e-9 * abs(by_hand[k]) for k in lib), (lib, by_hand)
assert not lib["dp_fits"] and lib["fsdp_fits"] and lib["fsdp_s"] < lib["compute_s"]
# the two conditions: gathers in bf16 but gradients reduced in fp32 (MixedPrecisionPolicy(reduce_dtype=fp32)), and
# attention's 12·L·T·d FLOPs per token beside the weights' 6·N
mixed = comm.traffic([{"op": "all-gather", "bytes": 2 * N_BIG, "group": W}] * 2
                                     + [{"op": "reduce-scatter", "bytes": 4 * N_BIG, "group": W}])
attn = 12 * big.n_layer * big.block_size * big.n_embd
print(f"with fp32 gradient reduction: {mixed / lib['fsdp_bytes']:.2f}x the bytes ({ICI_V5E.seconds(mixed) * 1e3:.1f} ms); "
      f"attention adds {attn / (6 * N_BIG):.0%} to the compute ({1e3 * (6 * N_BIG + attn) * TOK / PEAK_V5E:.1f} ms)")
assert abs(mixed / lib["fsdp_bytes"] - 4 / 3) < 1e-9 and 0.15 < attn / (6 * N_BIG) < 0.19
assert TOK > comm.critical_tokens("fsdp", PEAK_V5E, "v5e", devices=W)

# %% [markdown]
# The first printed line gives the memory, whether each strategy fits, and FSDP's bytes and milliseconds against the
# matmuls. The second gives the two conditions: 1.33x the bytes with fp32 reduction, and the compute with attention
# added.
#
# ## 8. Step time and MFU
# The step time is the median seconds per step after the first, compiling, one. Each step is waited for. MFU is the
# model's FLOPs per step divided by the step time and by the peak. The FLOPs come from `GPT.flops_per_token` and are the
# same for every strategy.
#
# On a TPU the peak is one chip's rated figure times the chips the strategy uses, one for `single`. On the CPU the 8
# virtual devices are threads on the same cores. So every strategy is measured against one figure: a float32 matmul
# timed on this machine (`labkit.dashboard.flops.measure_cpu_peak`).
#
# CPU times say what the *bookkeeping* costs, since the collectives become memory copies. They do not say what a mesh of
# chips would gain. The "one device" run computes its step 8 times over, once per replicated virtual device. At this
# size the model is far too small to fill even a CPU.

# %%
PEAK, PEAK_SOURCE = flops.peak_flops(rt, "fp32")
mfu = {}
for name, r in results.items():
    chips = 1 if (name == "single" or rt.kind != "tpu") else N_DEV
    mfu[name] = flops.mfu(FLOPS_PER_STEP, r.step_s, PEAK * chips if PEAK else None)
    print(f"{name:7s} {r.step_s * 1e3:8.1f} ms/step  MFU " + (f"{mfu[name]:.2%}" if mfu[name] is not None else "unknown"))
print("peak:", PEAK_SOURCE)
assert all(r.step_s > 0 for r in results.values())
assert all(m is None or 0 < m < 1 for m in mfu.values()), mfu

# %% [markdown]
# Each line above gives a strategy's milliseconds per step and its MFU, and the last line names the peak used. Compare
# the strategies with each other only: on the CPU these times measure bookkeeping, not a mesh.
#
# ## 9. The same training, four times
# The sharded runs compute the same sums in another order. So their losses drift from the one-device run by rounding
# only: within `loss_tol` nats at every step. The loss also fell, so there was something to agree on. In the output,
# read each strategy's largest difference from one device: it should be near float32 rounding, far below `loss_tol`.

# %%
ref = results["single"].losses
for name, r in results.items():
    diff = max(abs(a - b) for a, b in zip(r.losses, ref))
    print(f"{name:7s} final loss {r.losses[-1]:.4f}, largest difference from one device {diff:.2e} nats")
    assert len(r.losses) == P.steps and diff < P.loss_tol, f"{name} drifted {diff:.2e} nats (loss_tol={P.loss_tol})"
assert ref[-1] < ref[0] - 0.3, f"the loss did not fall: {ref[0]:.3f} -> {ref[-1]:.3f}"

# %% [markdown]
# ## 10. What each strategy costs, and when to pick it
# * **Data parallel**: every device holds the whole model and its optimizer state. The gradients, the size of the model,
#   are all-reduced once per step. It is the simplest strategy and usually the fastest while the state fits one chip.
#   The state is the model, its gradients and AdamW's two moments: 4x the weights in float32, section 6's 3x plus the
#   gradients. Pick it first.
# * **FSDP**: memory per device falls to ~1/N of the weights and optimizer state. The price is more communication: the
#   weights travel every step, forward and backward. A device sends 1.5× what data parallelism sends (section 7b). A
#   third of it travels during the forward, so its bound on tokens per chip is the same as data parallelism's. Pick it
#   when data parallelism no longer fits and the step is big enough for the gathers to hide behind compute. That means a
#   large batch × context per chip.
# * **Tensor parallel**: it splits the layers themselves. So it also cuts activation memory and the work per device for
#   one sequence. The price is all-reduces of activations inside every block, on the critical path. Combine it with data
#   parallelism or FSDP on the other mesh axis, as here.
# * Keep the tensor-parallel axis within the fastest links. On a TPU those are the chips of one slice, joined by ICI. A
#   slice can span several hosts; across slices, traffic goes over the slower data-centre network. On GPUs the fastest
#   links are NVLink.
#
# What is torch_xla's: `xs.Mesh`, `xs.mark_sharding`, `SpmdFullyShardedDataParallel`, and the compiler choosing the
# collectives. torch_xla 2.9 uses GSPMD, and XLA's Shardy is replacing it. A different partitioner may place different
# collectives. That is one more reason to read the HLO rather than trust a recorded count. You predict from first
# principles, then read the HLO and explain the difference.
#
# What carries over: the mesh, the placements, and the costs above. In plain PyTorch:
#
# - the mesh: `init_device_mesh("cuda", (4, 2), mesh_dim_names=("data", "model"))`, with DTensor;
# - Megatron: `parallelize_module(block, mesh["model"], {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})`;
# - ZeRO-3: `fully_shard(model)`, FSDP2, which issues its all-gathers and reduce-scatters itself, per unit;
# - in JAX: `Mesh`, `PartitionSpec` and `jax.jit`, with the same GSPMD or Shardy partitioner as here.
#
# FSDP2's `reshard_after_forward` defaults to `None` in torch 2.9. That means `True` for the units below the root, which
# gather their weights again for the backward. It means `False` at the root, which keeps them. So with one unit per
# block, a plain `fully_shard` step all-gathers 2 L + 1 times and reduce-scatters L + 1 times, as notebook 08 counts.
# With labkit's Trainer, which also keeps the last block gathered, a step issues 2 L all-gathers (notebook 09). FSDP2
# shards dim 0 of each parameter unless `shard_placement_fn` says otherwise. torch_xla's FSDPv2 takes the largest
# dimension instead.

# %%
rows = []
for name, r in results.items():
    coll = ", ".join(f"{k} {v['count']}" for k, v in sorted(r.collectives.items())) or "none"
    moved = comm.traffic(r.ops)   # bytes one device sends (section 7b), not the buffers added up
    rows.append((name, r.param_bytes + r.opt_bytes, coll, moved, r.step_s, mfu[name], r.losses[-1]))
print(f"{'strategy':8s} {'bytes/device':>13s} {'MB sent/dev':>13s} {'ms/step':>8s} {'MFU':>7s} {'final loss':>10s}  collectives")
for name, b, coll, moved, step, m, loss in rows:
    print(f"{name:8s} {b:13,d} {moved / 1e6:13.3f} {step * 1e3:8.1f} {(f'{m:.2%}' if m is not None else '-'):>7s} "
          f"{loss:10.4f}  {coll}")
assert len(rows) == 4

# %% [markdown]
# The table above sums up one run: bytes per device, MB sent per device, step time, MFU, final loss and the collectives
# XLA placed. Read the bytes column for memory and the MB column for traffic: FSDP holds the least and sends the most.
#
# ## 11. Save sharded, restore onto another layout
# A checkpoint of the FSDP run must not gather the model onto one host first. For a model that needs FSDP, the whole of
# it may not fit there. `labkit.checkpoint.CheckpointManager` sees that the state is split over devices. So it writes
# the *sharded format*: PyTorch's Distributed Checkpoint, DCP, with torch_xla's SPMD planners.
#
# DCP stores each device's slice once, with its offsets in the global tensor. Then it writes a `COMMITTED` marker, so a
# save killed midway is never restored. Because every slice knows where it belongs, the checkpoint restores onto any
# layout. Here it restores into the data-parallel model, where every device holds all of it. On a TPU VM it can restore
# onto another number of chips; the tests restore 8 devices onto 4 and onto 1. `restore(into=...)` fills the target's
# own tensors, which keep their layout.
#
# Carries over: DCP is plain PyTorch (`torch.distributed.checkpoint`), used on GPUs with FSDP2 and DTensor state. The
# SPMD planners and the sharded XLA tensors are torch_xla's.
#
# The save prints three warnings. They are about the libraries, not about this checkpoint:
#
# - "The function definition for SavePlanner.set_up_planner has been updated to include the storage_meta argument", from
#   torch 2.9's DCP: torch_xla 2.9's planner was written for an older DCP.
# - `TypedStorage is deprecated`, also from DCP: it is how the planner reaches the bytes.
# - "Using a non-tuple sequence for multidimensional indexing is deprecated", from torch_xla's own
#   `xla_sharded_tensor.py`: it is how torch_xla cuts the padding off a shard.
#
# All three are harmless, and they go away when the libraries agree again.
#
# The output's first line gives the files and how long `save()` blocked. The second checks that each element is stored
# once: the weights plus twice their bytes of AdamW state. The files are larger, because each slice carries a header.
# The last line should read every weight and every moment bit-identical.

# %%
import math
import torch
from torch.distributed.checkpoint import FileSystemReader
from labkit.checkpoint import CheckpointManager
from labkit.checkpoint import folder_name, is_sharded

CKPT = P.checkpoint_dir or labkit.scratch("sharded")
fsdp, dp = results["fsdp"], results["data"]
state = {"model": fsdp.model.state_dict(), "optimizer": fsdp.optimizer.state_dict()}
assert is_sharded(state), "FSDP's weights and AdamW moments are split over the devices"
ck = CheckpointManager(CKPT, keep=1, best_metric=None)
t0 = time.perf_counter()
ck.save(P.steps, state)       # copies each device's slice to the host, writes in a background thread
blocked = time.perf_counter() - t0
ck.close()                    # waits for the write and the marker
record = ck.latest()
files = record["files"]
print(f"saved step {record['step']} to {CKPT}/{folder_name(P.steps)}: save() blocked {blocked:.2f} s; files "
      + ", ".join(f"{n} {f['size']:,} B" for n, f in files.items()) + " + COMMITTED")
assert record["step"] == P.steps and any(n.endswith(".distcp") for n in files)

if not CKPT.startswith("gs://"):  # every element stored exactly once: the slices of each tensor tile it
    meta = FileSystemReader(os.path.join(CKPT, folder_name(P.steps))).read_metadata()
    tensors = {k: m for k, m in meta.state_dict_metadata.items() if hasattr(m, "chunks")}
    pieces = sum(len(m.chunks) for m in tensors.values())
    assert all(sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size) for m in tensors.values())
    # the state is the weights *and* AdamW's two moments (3x the weights, + a step count each), each element once; the rest of
    # the files is the format's: a header per slice in the .distcp files, and the metadata file
    elements = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in tensors.values())
    weights = sum(t.numel() * t.element_size() for t in state["model"].values())
    on_disk = sum(f["size"] for f in files.values())
    print(f"{len(tensors)} tensors in {pieces} slices, each element once: {elements:,} B of elements "
          f"({weights:,} B of weights + {elements - weights:,} B of AdamW state) in {on_disk:,} B of files")
    assert on_disk >= elements and 2 * weights <= elements - weights < 2.1 * weights, (weights, elements)

# restore into the data-parallel model and its optimizer (their tensors are replicated on every device)
target = {"model": dp.model.state_dict(), "optimizer": dp.optimizer.state_dict()}
assert not is_sharded(target)
assert CheckpointManager(CKPT, best_metric=None).restore(into=target) is target
dp.model.load_state_dict(target["model"])
dp.optimizer.load_state_dict(target["optimizer"])
got, want = dp.model.state_dict(), fsdp.model.state_dict()
same = [k for k in want if torch.equal(got[k].cpu(), want[k].cpu())]
o_got, o_want = dp.optimizer.state_dict()["state"], fsdp.optimizer.state_dict()["state"]
moments = [(i, k) for i in o_want for k in ("exp_avg", "exp_avg_sq")]
same_m = [m for m in moments if torch.equal(o_got[m[0]][m[1]].cpu(), o_want[m[0]][m[1]].cpu())]
tiles = S.tile_devices(2, S.sharding_of(dp.model.blocks[0].mlp.fc.weight))
print(f"data-parallel model after restore: {len(same)} of {len(want)} weights and {len(same_m)} of {len(moments)} "
      f"AdamW moments bit-identical to FSDP's; mlp.fc.weight is "
      f"{'whole on every device' if tiles == {(0, 0): []} else tiles}")
assert len(same) == len(want), sorted(set(want) - set(same))
assert len(same_m) == len(moments), sorted(set(moments) - set(same_m))
assert tiles == {(0, 0): []}, "the target keeps its own layout"

# %% [markdown]
# **Where this goes next.** Google's PyTorch/XLA pages now say that PyTorch/XLA is deprecated and replaced by TorchTPU,
# and that its repository is archived on November 15, 2026. TorchTPU shards with DTensor and one process per chip,
# instead of GSPMD's one process per host. Notebook 10 maps this notebook's meshes and `mark_sharding` to DTensor
# placements. TorchTPU is not run on a chip here.
#
# *Source: cloud.google.com/tpu/docs, the "PyTorch on Cloud TPU" page and the banner of its PyTorch/XLA pages; read
# 2026-11-29.*
#
# * Ends with torch_xla: `xs.Mesh`, `xs.mark_sharding`, `SpmdFullyShardedDataParallel`, the SPMD planners of the sharded
#   checkpoint, and reading the partitioned HLO dump.
# * Carries over: meshes with named axes, a placement per tensor dimension, the bytes each layout keeps per device and
#   the collectives it costs, from the arithmetic of sections 6 and 7. DCP checkpoints restore onto another layout.
