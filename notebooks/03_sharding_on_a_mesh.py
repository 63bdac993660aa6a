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
# The GPT of notebook 02, trained the same number of steps on the same batches four ways:
#
# 1. **one device**: the reference;
# 2. **data parallel**: every device holds all the weights and a slice of the batch; gradients are summed;
# 3. **tensor parallel** (Megatron style): on a 2-D `data x model` mesh, each block's attention heads and MLP units
#    are split over the `model` axis, the batch over `data`;
# 4. **FSDP** (torch_xla's FSDPv2, `SpmdFullyShardedDataParallel`): every weight and the batch split over all devices.
#
# For each: a picture of where the weights and the batch live, the bytes of parameters and optimizer state one
# device holds, the collectives XLA put into the compiled step (read from its optimized HLO) next to what we
# predict on paper, step time and MFU, and the losses, which must match the one-device run. Then the bytes turned
# into time on real TPU generations, and last, the FSDP run checkpointed shard by shard and restored into the
# data-parallel layout, bit for bit. By the end you can:
#
# - build a mesh and mark shardings by hand, and read back where each tensor lives and which collectives XLA added;
# - predict each strategy's bytes per device and its collectives, and check them against the optimized HLO;
# - turn those bytes into time over a TPU generation's inter-chip links, and say at what batch per chip each
#   strategy stops waiting for the network (and predict it for a model and a slice this machine cannot run);
# - save a sharded checkpoint and restore it onto another layout.
#
# **Time**: about 1.5 min of CPU time in fast mode, 4–5 min of wall time on a 2-core CPU (8 virtual XLA:CPU devices
# compiling four partitioned training graphs); 50–70 minutes to read and do the five exercises.
#
# **In the course**: after 02; next: 08.
#
# On a TPU host with several chips (a v5e-8: 8 chips; a v4-8: 4 chips) the mesh is the chips. Anywhere else torch_xla
# runs on the CPU as 8 *virtual* devices in one process: the partitioning, the collectives and the bytes are real,
# the speed is not (all 8 share the same cores). That includes Colab's TPU runtime, a v5e-1 with **one** chip (one
# chip is not a mesh): the parameters cell then says so and switches to the CPU before torch_xla starts. torch_xla
# 2.9 has no GPU backend, so a GPU runtime practises on its CPU as well.
#
# Which lessons are torch_xla's: `xs.Mesh`, `xs.mark_sharding`, `SpmdFullyShardedDataParallel`, and GSPMD, XLA's
# sharding propagation and partitioner (the compiler, not your code, inserts the collectives). XLA is replacing GSPMD
# with **Shardy**, the partitioner JAX already uses by default; torch_xla 2.9 still runs GSPMD and logs a deprecation
# warning on every partitioned compile (hidden here, see the parameters cell). The ideas below are the same under both. Which carry over: the mesh with named axes, the placements
# (split a dimension over an axis, or replicate), what each strategy costs in memory and communication. Plain
# PyTorch writes the same with `init_device_mesh` + DTensor (`Shard(0)`, `Replicate()`), `parallelize_module` with
# `ColwiseParallel`/`RowwiseParallel` for Megatron, and `fully_shard` (FSDP2); JAX with `Mesh` + `PartitionSpec`.

# %% [markdown]
# ## Parameters
# Every knob lives in this cell; each can be set from the environment as `LABKIT_<NAME>`. `LABKIT_FAST=1` gives
# the CI-sized run: a 1-layer, 32-wide GPT, 4 steps of each strategy (8 virtual devices on a 2-core CPU compile
# slowly: the whole notebook takes about 90 s of CPU time, most of it compiling four partitioned training graphs).
# The defaults are sized for a TPU host with 8 chips.
#
# This cell also prepares the devices, because it must happen before torch_xla starts (`labkit.spmd.practice_devices`
# prints what it chose): without a TPU, or on a TPU host with fewer than 2 chips, 8 virtual XLA:CPU devices
# (`PJRT_DEVICE=CPU`, `CPU_NUM_DEVICES=8`); everywhere, XLA's optimized HLO dumped as text
# (`XLA_FLAGS=--xla_dump_to=...`), where the collectives can be counted; and XLA's C++ log level raised to errors
# (`TF_CPP_MIN_LOG_LEVEL=2`), because torch_xla 2.9's XLA prints the same GSPMD-to-Shardy deprecation warning once per partitioned
# compile, dozens of times. If torch_xla already runs on a one-chip TPU in this kernel, the cell says so: restart the
# runtime and run it first.

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
# ## 1. The devices and the mesh
# `labkit.setup(spmd=True)` switches torch_xla to SPMD: one process, one program written for one big device, and
# `mark_sharding` to say how each tensor is laid out over a `Mesh`. Data parallelism and FSDP use a 1-D mesh over
# all devices; tensor parallelism a 2-D one, `data x model`: devices 0,1 form a model group (they split one
# layer), 0,2,4,6 a data group (they hold the same weight slice and different batch slices).

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
# `labkit.models.gpt.GPT` as in notebook 02, trained on the same offline text (the Python Language Reference, bytes as
# tokens). Every strategy starts from the same initial weights (seeded) and sees the same list of batches, so
# the four loss curves must agree up to floating-point rounding: a sum split over devices is added in another
# order. Tensor parallelism needs whole attention heads per device, so its copy of the model keeps q, k and v as
# three matrices (`labkit.spmd.sharding.split_qkv`, the same values): split by rows, each device gets whole heads.

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
# Before labkit's strategies do it for you, lay the GPT out yourself. All of GSPMD's interface is two calls:
#
# * `xs.Mesh(device_ids, mesh_shape, axis_names)`: the devices arranged as an array whose axes have names. Here
#   `(devices / 2, 2)` named `("data", "model")`: each row of the array is a *model group* (the devices that split
#   one layer), each column a *data group* (the devices that hold the same slices and see different sequences).
# * `xs.mark_sharding(t, mesh, spec)`: a *partition spec* has one entry per dimension of `t`: the name of the mesh
#   axis to split that dimension over, or `None` to keep it whole. It splits nothing by itself: it annotates the
#   tensor, and when the step compiles, XLA's SPMD partitioner writes each device's part of the program and inserts
#   the collectives the layout needs.
#
# Megatron's pair for every MLP: `mlp.fc` (4C x C, output by input features) split by its rows, so each device of a
# model group computes a slice of the hidden units and GELU needs nothing from the others (*column parallel*, in
# Megatron's terms: the weight's output columns when it is written input x output); `mlp.proj` (C x 4C) split
# by its columns, so each device multiplies its own hidden slice and holds a *partial sum* of the output (*row
# parallel*). Predict before running: completing that sum takes an **all-reduce within each model group** (the 2
# devices of one row of the mesh, over the `model` axis), and the weights left whole here (attention, embeddings)
# get gradients summed over the data groups. The batch is split by sequences over `"data"`. Two training steps,
# then the layout read back and the collectives read from the compiled step's HLO.

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
# **The whole Megatron block.** Attention gets the same pair: q, k and v are column parallel (each device of a model
# group computes whole heads of its own, and attention needs nothing from the other heads) and the attention's output
# projection is row parallel (a partial sum, completed by an all-reduce). labkit's tensor-parallel strategy (section
# 4) splits both, the MLP as above. Per block that makes **2 all-reduces in the forward** (attention's output and the
# MLP's), each of one data slice's activations, (B/data, T, C). The backward mirrors them: the gradient with respect
# to a column-parallel layer's input is a partial sum over the devices' slices, so the inputs of q/k/v and of
# `mlp.fc` need **2 more**: 4 all-reduces per block, all within a model group. Section 7 counts them in the HLO;
# exercise 4 asks for their bytes.

# %% [markdown]
# **Reading a sharding string.** `S.sharding_of` prints torch_xla's own text, XLA's HLO sharding. For
# `mlp.fc.weight` on this (4, 2) mesh, split by rows over `"model"`, it reads like
# `{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}`:
# `[2,1,4]` cuts the tensor into 2 × 1 tiles (dim 0 in two, dim 1 whole), and the last number, 4, with
# `last_tile_dim_replicate`, says each tile is held by 4 devices (the data axis: a copy per data group). The device
# ids follow, tile by tile: tile 0 (the first half of the rows) on devices 0, 2, 4, 6, tile 1 on 1, 3, 5, 7, one
# device of each model group (rows `[0, 1]`, `[2, 3]`, ... above) per half. `{replicated}` is a tensor every device
# holds whole; `{devices=[4,1]0,1,2,3}` without the last word, a tensor cut in 4 with no copies.
#
# XLA also added collectives nobody asked for (the all-gathers above): wherever a tensor laid out one way meets an
# op that needs another, the partitioner moves data; section 7 counts them for every strategy.
#
# The strategies below do exactly this for you: `labkit.spmd.make_mesh` builds the same mesh, and the tensor-parallel
# one marks the same two weights (plus attention's heads), and the batch, the same way. The cell after training
# checks it: the same sharding strings and, from the same weights and batches, the same losses.
#
# *torch_xla's*: `xs.Mesh`, `xs.mark_sharding` and reading the partitioned HLO. *Carries over*: a mesh of named axes
# and a placement per tensor dimension are DTensor's `DeviceMesh` with `Shard(dim)` / `Replicate()` (TorchTPU's
# sharding; not run here) and JAX's `NamedSharding` with a `PartitionSpec`.

# %% [markdown]
# ## 4. Train four ways
# `labkit.lessons.parallel_gpt.train` builds the model for a strategy, creates AdamW's moments with each weight's
# sharding before the first step (one compile), runs the steps with the batch marked as split, waits for the
# device after each step (honest step times), and reads the collectives from the newest compiled step graph.
#
# The FSDP run prints torch's `Full backward hook is firing when gradients are computed with respect to module outputs
# since no inputs require gradients`: torch_xla's FSDPv2 hooks each wrapped module's backward (to place an
# optimization barrier), and a GPT's input is token ids, which never require gradients. Expected, harmless.

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
# Below, for each strategy, two weight matrices of block 0 and the batch, split into the slices the devices hold.
# Not to scale: every tensor fills a box of the same size (its shape is in the title), so the slices show *how* a
# tensor is split, not how big it is. Colour: the first device holding a slice; grey: every device holds all of it.
#
# * **one device**: under SPMD the program with nothing sharded is *replicated*: every device holds all of it
#   and computes the whole step. On a TPU that takes the time of one chip; on the CPU the 8 copies share the
#   cores (section 8). It is the reference the other three must agree with.
# * **data parallel**: the MLP's weights are whole on every device (grey); the batch's rows (sequences) are split
#   into 8.
# * **tensor parallel**: as in section 3, `mlp.fc` (4C x C) is split by rows (column parallel: each device of a
#   model group computes half the hidden units), `mlp.proj` (C x 4C) by columns (row parallel: each half produces
#   a partial sum of the output, which an all-reduce completes). Devices 0,2,4,6 hold the same half; the batch is split in 4 over
#   `data`, each quarter held by a model pair.
# * **FSDP**: every weight is split 8 ways along its largest dimension (FSDPv2's choice: rows of `mlp.fc`, columns
#   of `mlp.proj`), one slice per device; the batch too.

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
# Read from each tensor's sharding (`labkit.spmd.sharding.device_bytes`: the largest shard of each tensor, padding
# included). AdamW keeps two moments per weight, each with its weight's layout, so optimizer state is twice the
# parameters in every strategy: 3x the weights in all, plus gradients and activations (not counted here).
#
# * data parallel: everything replicated, the same as one device. Memory does not shrink with more devices.
# * tensor parallel: the split matrices are halved (`model_axis=2`); embeddings, LayerNorms and the
#   row-parallel biases stay whole.
# * FSDP: every tensor split over all devices (8 here) along its largest dimension, the first of them on a tie
#   (torch_xla's FSDPv2 rule, whatever the order of the dimensions; PyTorch's FSDP2, `fully_shard`, splits dim 0
#   instead unless its `shard_placement_fn` says otherwise, so this rule is FSDPv2's alone): about **total / 8**, exactly when every tensor's largest
#   dimension divides by 8 (where one does not, its last slices are padded, so a device holds a little more);
#   `labkit.spmd.sharding.predict_fsdp` computes it from the shapes alone.

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
# Four exercises that check themselves (`labkit.lessons.exercises`; a fifth follows section 7b): replace each `...`, run the cell, then the
# check cell below it. A solution hides in the collapsed cell between them (it runs only with `LABKIT_SOLUTIONS=1`).
# If you leave an exercise, its check prints "not yet" and the rest of the notebook runs on.
#
# **1.** How many bytes must one data-parallel training step all-reduce? Write `dp_bytes(model)`, from a model's
# parameters: the size of the buffers the step sums (what one device then *sends* is another number, section 7b); the check tries it on models of other sizes and dtypes, then on `probe` (the GPT of section 2), before
# section 7 shows what XLA did.

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
# `xs.mark_sharding(param, mesh, spec)` for every parameter, with a *partition spec*: one entry per dimension of
# the tensor, the name of a mesh axis to split that dimension over, or `None` to keep it whole. It splits each
# parameter along its **largest** dimension over the mesh's `"fsdp"` axis (the first of them on a tie), nothing
# else. That rule is torch_xla FSDPv2's: PyTorch's FSDP2 (`fully_shard`) splits dim 0 of every parameter unless
# you pass a `shard_placement_fn`. Write `fsdp_shard(t, mesh)`: mark the XLA tensor `t` that way on `mesh` (1-D, axis `"fsdp"`, all devices)
# and return it. The check gives it tensors of random shapes (the largest dimension first, last, in the middle,
# tied) and compares the layout with the one torch_xla's `SpmdFullyShardedDataParallel` itself gives a parameter of
# the same shape; it also counts torch_xla's device-to-host copies: the tensor must stay where it is.

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
# **3.** Predict what that layout costs. When the largest dimension does not divide over the devices, every slice
# has the size of the first (`ceil(size / devices)` of that dimension) and the last ones are padded. Write
# `fsdp_bytes(shape, devices, bytes_per=4)`: the bytes one device holds. The check measures its answers on the
# mesh (tensors of random shapes, float32 and bfloat16, laid out by torch_xla's FSDPv2 and read from their
# shardings), tries other device counts against the rule on paper, and sums your function over `probe`'s
# parameters: it must give the FSDP run's bytes per device of section 6, exactly. `math` is imported above
# (`math.ceil`, `math.prod`).

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
# **4.** Megatron's tensor parallelism all-reduces activations inside every block: section 3 counted **4 per block**
# (2 in the forward, 2 in the backward), each of one data slice's activations, (B/data, T, C), within a model
# group (section 7 finds them in the HLO). Write
# `megatron_bytes(B, T, C, L, data)`: the float32 bytes of the activation buffers one model group all-reduces in one
# training step (every model group does the same for its own data slice: do not add the groups up), for a global
# batch of B sequences of T tokens, width C, L blocks, on a mesh whose `data` axis has `data` devices.

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
# Under SPMD you never call a collective: XLA's partitioner (GSPMD here; Shardy in newer XLA) inserts them where a
# sharded computation needs data another device holds. They are visible only in the *optimized* HLO (after
# partitioning), which XLA dumped; `labkit.spmd.sharding.count_collectives` reads count and bytes (the buffer each
# one works on) per kind. First, the prediction, from first principles, per training step, float32, for `L`
# blocks, width `C`, context `T`, global batch `B`:
#
# * **data parallel** (`predict_data_parallel`): every device computes the gradient of its slice of the batch, and
#   the step needs their sum: one **all-reduce** per parameter tensor, of the parameter bytes. Nothing else moves.
# * **tensor parallel** (`predict_tensor_parallel`, Megatron): section 3's 4 all-reduces per block (2 forward, 2
#   backward), each within one model group, of one data slice's activations (B/data, T, C). Then data parallelism
#   over the `data` axis: each gradient all-reduced at the size one device holds.
# * **FSDP** (`predict_fsdp`): the textbook (ZeRO-3, and what PyTorch's FSDP2 issues by construction) gathers
#   every weight before its forward and again before its backward (**all-gather**, 2 x the parameter bytes) and
#   **reduce-scatters** each gradient (the parameter bytes).
#
# Then what XLA did, and the difference (`labkit.spmd.sharding.extra_collectives`). On XLA:CPU (torch_xla 2.9) the
# compiled step moves **more** than the prediction, and each extra has a reason:
#
# * the tied token table is one parameter but gets two gradients (embedding lookup, output layer), and XLA
#   all-reduces each before adding them: one extra all-reduce of `256 x C`;
# * the mean loss: three scalar all-reduces;
# * LayerNorm: GSPMD partitions LayerNorm's backward, as torch_xla lowers it, with two **all-gathers** of the whole
#   batch's (B, T, C) activations per LayerNorm (`2L + 1` of them): activations travel where the textbook moves
#   none. That is a property of this partitioner on this graph, not of data parallelism;
# * tensor parallel only: q, k and v are three matrices here, so their input gradients are all-reduced one by one
#   (3 instead of Megatron's 1: 2 extra per block), and the partitioner re-gathers the heads around
#   `scaled_dot_product_attention` (four all-gathers per block of one data slice's activations) instead of keeping
#   them apart; marking q, k and v's layout inside the attention with `mark_sharding` is the usual remedy (not
#   tried here);
# * FSDP: with layers this small GSPMD moves *activations* (all-to-all, collective-permute, activation
#   all-gathers), and it sums each gradient with an **all-reduce** of the whole gradient followed by a slice that
#   keeps this device's 1/8 (a reduce-scatter written as all-reduce + dynamic-slice: section 7b finds them in the
#   HLO). Only the bytes per device (section 6) are a prediction it honours exactly; below we assert what must
#   hold whichever way XLA goes: the weights are never replicated, and communication costs more than data
#   parallelism's.
#
# The sizes printed are the *buffers* the collectives work on. Adding them across kinds is not what a device
# sends: a ring all-gather or reduce-scatter of a buffer V sends V·(W−1)/W per device, an all-reduce twice that
# (section 7b). So the comparison below counts what one device sends (`labkit.spmd.comm.traffic`).
#
# What is asserted: the measured step moves at least the predicted bytes in all-reduces (the gradients must be
# summed, whatever else happens), and on XLA:CPU the extras are exactly the ones listed above. On a TPU XLA combines
# and schedules collectives its own way (async pairs, combined all-reduces, reduce-scatter): there the cell prints
# prediction, measurement and difference and does not insist on the breakdown.

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
# **Reading a difference line.** Each entry is the measured count minus the predicted one, then the bytes, measured
# minus predicted. The two signs can differ. FSDP's all-gather entry has fewer gathers than the textbook's two per
# weight tensor but more bytes: some of XLA:CPU's gathers carry activations (B·T rows of C), which textbook FSDP never
# gathers. Its negative reduce-scatter entry is the textbook's reduce-scatters, all missing: section 7b finds them,
# written as all-reduces followed by a slice.

# %% [markdown]
# ## 7b. Bytes into time
# **A reduce-scatter, looked for.** FSDP's textbook step reduce-scatters each gradient: every device ends with the
# sum over all devices of *its own* 1/W slice. The count above has no `reduce-scatter` on XLA:CPU. What XLA:CPU
# wrote instead, read from the same HLO (`labkit.spmd.sharding.sliced_all_reduces`): an all-reduce of the whole
# gradient, then an instruction that reads it with `partition-id` (this device's number) and keeps one slice of
# 1/W, usually fused into AdamW's update. Same result, twice the traffic of a reduce-scatter. XLA's GPU compiler has
# a pass that rewrites exactly this pattern into a reduce-scatter (`ReduceScatterCreator`); the CPU compiler of
# torch_xla 2.9 does not run it; on a TPU the cell prints what that compiler chose (not verified here).
#
# Each line of the list reads: the all-reduce, the shape it sums, the slice each device keeps, and the fused
# instruction that slices it. The shape tells what is summed; the fast run's sizes differ on purpose (vocabulary
# 256, B·T = 384 tokens, C = 32). A `(C,)` result is a LayerNorm parameter's gradient, `(256, C)` the token
# table's, and `(C, 256)` most likely the same table, transposed, as the tied output layer uses it. A result with
# B·T rows is an activation, sliced along C. The cell's last line counts the results that have a parameter's shape. The other gradients are reduced
# by the collectives the count above lists, which this notebook does not take apart.

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
# **What a device sends, and how long it takes.** Per device, over a ring of W devices, for a buffer of V bytes
# (`labkit.spmd.comm.sent`): an all-gather or a reduce-scatter sends **V·(W−1)/W**, an all-reduce
# **2·V·(W−1)/W** (a reduce-scatter followed by an all-gather). So per step, for N weights of g bytes:
#
# | strategy | collectives per step | bytes one device sends |
# |---|---|---|
# | data parallel | all-reduce of the gradients | 2·N·g·(W−1)/W |
# | FSDP (ZeRO-3) | all-gather the weights twice (forward, backward), reduce-scatter the gradients | 3·N·g·(W−1)/W: **1.5×** data parallelism |
# | tensor parallel (Megatron) | 4 all-reduces of one data slice's activations (tokens × C) per block | 8·L·tokens·C·g·(M−1)/M |
#
# The time is bytes ÷ what a chip can send over its inter-chip interconnect (ICI). Google's Cloud TPU pages give
# a *bidirectional* ICI bandwidth per chip; a chip sends half of it, and only with every port busy (a ring along one
# axis of v5e's 2-D torus uses 2 of its 4 ports: twice the time). Those pages also give a pod's "all-reduce
# bandwidth", which divided by the pod's chips is the same figure, a check the tests make. **Not verified here**
# (no TPU): the figures are Google's (docs.cloud.google.com/tpu/docs/v4, v5e, v5p-training, v6e, read 2026-11);
# v4's page has no per-chip figure and its value is derived from the pod's all-reduce bandwidth.

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
# **Where each strategy starts waiting for the network.** A step's compute grows with the tokens each chip
# processes; the data-parallel and FSDP traffic does not (it is the weights' size). With perfect overlap the step
# is compute-bound while each collective takes no longer than the compute **that runs while its data exists**: a
# gradient appears during the backward, so its all-reduce can hide behind the backward (4 of the 6 FLOPs per weight
# and token), never behind the forward, which is over before the first gradient exists. For N weights, b tokens per
# chip, F FLOP/s per chip and S bytes sent per second (scaling-book, "How to Parallelize a Transformer for
# Training": data parallelism and FSDP are compute-bound above the same per-axis bound, C / W_ici;
# `comm.critical_tokens`):
#
# - data parallel: backward 4·N·b/F ≥ 2·N·g/S  →  **b ≥ g·F / (2·S)**
# - FSDP: forward 2·N·b/F ≥ N·g/S (one all-gather) and backward 4·N·b/F ≥ 2·N·g/S (all-gather + reduce-scatter):
#   **the same b**. FSDP sends 1.5× the bytes, but a third of them go out during the forward, which data
#   parallelism has nothing to hide behind.
# - tensor parallel: per block and token, compute 72·C²/M FLOPs against 8·C·g·(M−1)/M bytes sent: the batch cancels,
#   and the bound is on the width per device: **C ≥ g·(M−1)·F / (9·S)** (`comm.critical_width`, `max_model_axis`).
#
# N cancels too. Below, bf16 (g = 2) at the chip's peak and every port busy: the *least* batch that can be
# compute-bound. At a real MFU of 40 %, multiply the batch by 0.4; with half the ports (a ring along one axis of
# the 2-D torus), by 2; on a slice without wraparound links (see below), by about 2 again. The direction is the
# lesson: the faster the chip against its links (v6e), the more tokens each chip needs before the network hides.
#
# **Rings need wraparound.** The ring formulas assume each axis closes into a ring. Wraparound links exist only on
# axes of 16 chips on v5e and v6e, and only on slices made of whole 4×4×4 cubes on v4 and v5p. Google Cloud's TPU
# pages list the slice shapes but do not state this rule; it comes from the JAX team's book *How to Scale Your Model*
# (its TPU chapter). The slices a learner rents, a v5e-8 (2×4) or a v4-8 (2×2×1), have none: a collective there
# runs along a line, roughly twice a ring's time. Not verified here (no TPU).
#
# **This is the hardware's critical batch, not the optimizer's.** McCandlish et al. 2018 ("An Empirical Model of
# Large-Batch Training") define a *statistical* critical batch size: beyond it, a larger global batch no longer cuts
# the steps needed, and raising the learning rate with the batch stops paying. The bound here says how many tokens
# each chip needs to keep the network hidden; theirs says how large the global batch (tokens per chip × chips) may
# grow before the extra chips stop buying progress. A run needs both: the first sets a floor per chip, the second a
# ceiling on chips × that floor.
#
# **How the overlap happens, and what each collective can hide behind.** The bound assumes the transfers run while
# the chip computes. Someone has to arrange that. On a TPU, XLA issues collectives asynchronously (in a TPU's
# optimized HLO, pairs such as `all-gather-start` / `all-gather-done`) and its *latency-hiding scheduler* places
# independent compute between the start and the done. On a host with TPU chips, torch_xla 2.9 adds
# `xla_latency_hiding_scheduler_rerun` to `LIBTPU_INIT_ARGS` at import (its `__init__.py`: rerun the scheduler with
# less memory if overlapping ran out); elsewhere it sets nothing. Not verified here: XLA:CPU has no such scheduler. Under FSDP2 on GPUs, the all-gather of the next module is issued on its own stream while
# the current one computes (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` issue them earlier,
# at the cost of memory). Either way, each collective can only hide behind compute that needs none of its result:
# a block's weight gather behind the previous block's matmuls, a gradient's reduction behind the backward of the
# layers below it; the gradient computed last (the first layer's) has nothing left to hide behind, and the
# optimizer step waits for its reduction.
#
# **Across slices.** Chips of one slice talk over ICI; slices talk over the data-centre network (DCN), far slower
# per chip. Google's TPU pages (read 2026-11) give a v5e host two 100 Gbit/s NICs for its 8 chips: 25 Gbit/s, about
# 3.1 GB/s per chip each way. Compare it with what a chip *sends* over ICI, 200 GB/s, since the pages' 400 GB/s
# counts both directions. A v5p chip gets 50 Gbit/s of DCN against 600 GB/s sent over ICI, 1,200 GB/s both ways.
# Whether that 50 Gbit/s is each way is not said on the page and not verified here; the cell reads it so.
#
# The usual layout follows from the bounds above: FSDP or tensor parallelism inside a slice over ICI, and data
# parallelism across slices over DCN, where the only traffic is one gradient all-reduce per step, hidden behind the
# backward. The gradients are first reduce-scattered inside each slice, so each of a slice's M chips sends over DCN
# only its 1/M share. The bound keeps the data-parallel form with S the DCN rate per chip, but counts the tokens of a
# whole slice: **b·M ≥ g·F / (2·S_DCN)**. The cell below prints it per slice and per chip of a 256-chip slice.
# It is a prediction from the pages' figures, not verified here: no TPU, XLA may arrange multislice collectives
# differently, and the NICs also carry the input pipeline.

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
# **5. Your turn: time over the links, and what hides.** Two predictions nothing here can run (no TPU). The check
# holds them to `labkit.spmd.comm`'s rules on inputs it draws anew on every call, and refuses that module's own
# functions while yours run.
#
# - `allreduce_seconds(nbytes, chips, send_bytes_per_s, wraparound)`: the seconds of a ring all-reduce of a buffer
#   of `nbytes` along one axis of `chips` chips, each chip sending `send_bytes_per_s` over the ports that axis uses
#   (section 7b: 2·B·(n−1)/n bytes per chip), and twice that when the axis has no wraparound link
#   (`wraparound=False`: a line, the rough factor above).
# - `exposed_seconds(backward_s, reduce_s)`: per layer, its backward time and its gradient's reduction time, both
#   listed in the order the backward runs (index 0: the last layer, computed first). Return the seconds the step
#   still waits for reductions after its backward ends, when each reduction starts as soon as its gradient exists
#   *and* the links are free (the previous reduction is done).

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
# Your functions on two slices of v5e (the library's, if the check has not passed yet): data parallelism over one
# axis, a GPT of 24 blocks of width 2,048 (12·C² weights a block, bf16 gradients: 101 MB each), 2,048 tokens per
# chip, each block's gradient all-reduced as soon as its backward is done. The axis of 4 chips of a v5e-8 (2×4)
# is a line; the axis of 16 of a v5e-256 (16×16) is a ring. A ring along one axis uses 2 of a v5e's 4 ports.

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
# At the chip's peak the line's all-reduce of a block takes longer than the next block's backward, so the reductions
# queue and the step waits about half its backward again; on the ring each hides behind the next block's backward
# and only the first block's, computed last, is left. At 40 % MFU the backward is slow enough on both, and what is
# left is that last all-reduce alone: the line's is 1.6 times the ring's, as (3/4)·2 / (15/16) says.

# %% [markdown]
# **A prediction for what cannot run here.** A GPT of 24 layers, width 2,048, context 2,048 (about 1.2 B weights),
# trained in bf16 with fp32 master weights and AdamW on a **v5e-256** (256 chips, 16 GB each), one sequence per
# chip. First the memory: 16 bytes per weight (bf16 weight and gradient 2 + 2, fp32 master 4, two fp32 moments 8)
# is 19 GB, more than a v5e's 16 GB before a single activation: data parallelism does not fit; FSDP splits it 256
# ways. Then the time, by hand, then by the library: FSDP sends 3·N·2·255/256 bytes per chip per step, about 7 GB,
# 36 ms at 200 GB/s, against 75 ms of matmuls at the peak; at 40 % MFU the matmuls take 190 ms and hide it
# easily. Nothing here ran on a TPU: these are the paper figures' consequences, to check on a slice.
#
# Two conditions hide in those figures. **Bytes per weight, g = 2, holds only if the gathers move bf16.** Under
# autocast (notebook 02) the weights and gradients stay fp32 (16 bytes a weight still: fp32 weight 4 + gradient 4 +
# two moments 8) and FSDP gathers fp32, g = 4. That holds for FSDP2; what FSDPv2 gathers under autocast is not
# verified here. bf16 gathers need FSDP2's `MixedPrecisionPolicy(param_dtype=
# torch.bfloat16)`; with its `reduce_dtype=torch.float32` (the usual choice: sums in fp32) the reduce-scatter still
# moves 4 bytes a weight, and the traffic is (2 + 2 + 4) / (3 × 2) = **1.33×** the figure above. **Compute, 6·N
# per token, counts the weights only.** Attention's score and value products add 12·L·T·d per token (notebook 02's
# exercise counts them; `GPT.flops_per_token` includes them): here +17 %, more time to hide the traffic behind.

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
# ## 8. Step time and MFU
# Median seconds per step after the first (compiling) one, each step waited for. MFU = the model's FLOPs per step
# (`GPT.flops_per_token`, the same for every strategy) / step time / peak. On a TPU the peak is one chip's rated
# figure times the chips the strategy uses (one for `single`). On the CPU the 8 virtual devices are threads on the
# same cores, so every strategy is measured against one figure: a float32 matmul timed on this machine
# (`labkit.dashboard.flops.measure_cpu_peak`). CPU times say what the *bookkeeping* costs (the collectives become memory
# copies), not what a mesh of chips would gain, and the "one device" run computes its step 8 times over (once
# per virtual device, replicated). At this size the model is far too small to fill even a CPU.

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
# ## 9. The same training, four times
# The sharded runs compute the same sums in another order, so their losses drift from the one-device run by
# rounding only: within `loss_tol` nats at every step (and the loss fell, so there was something to agree on).

# %%
ref = results["single"].losses
for name, r in results.items():
    diff = max(abs(a - b) for a, b in zip(r.losses, ref))
    print(f"{name:7s} final loss {r.losses[-1]:.4f}, largest difference from one device {diff:.2e} nats")
    assert len(r.losses) == P.steps and diff < P.loss_tol, f"{name} drifted {diff:.2e} nats (loss_tol={P.loss_tol})"
assert ref[-1] < ref[0] - 0.3, f"the loss did not fall: {ref[0]:.3f} -> {ref[-1]:.3f}"

# %% [markdown]
# ## 10. What each strategy costs, and when to pick it
# * **Data parallel**: every device holds the whole model and its optimizer state; the gradients (the size of the
#   model) are all-reduced once per step. The simplest and usually the fastest while the model, its gradients and
#   AdamW's two moments fit one chip: 4x the weights in float32, section 6's 3x plus the gradients. Pick it first.
# * **FSDP**: memory per device falls to ~1/N of the weights and optimizer state, paid for with more
#   communication: the weights travel every step, forward and backward, 1.5× what data parallelism sends per
#   device (section 7b), but a third of it travels during the forward, so its tokens-per-chip bound is the same as
#   data parallelism's. Pick it when data parallelism no longer fits: the step is big enough that the gathers hide
#   behind compute (large batch x context per chip).
# * **Tensor parallel**: splits the layers themselves, so it also cuts activation memory and the work per device
#   for one sequence, at the price of all-reduces of activations inside every block, on the critical path.
#   Keep the model axis within the fastest links: on a TPU the chips of one slice joined by ICI (the inter-chip
#   interconnect; a slice can span several hosts, and across slices traffic goes over the slower data-centre
#   network); on GPUs the ones joined by NVLink. Combine it with data parallelism or FSDP on the other mesh axis,
#   as here.
#
# torch_xla-specific: `xs.Mesh`, `xs.mark_sharding`, `SpmdFullyShardedDataParallel`, and the fact that the
# compiler chooses the collectives (GSPMD in torch_xla 2.9; XLA's Shardy is replacing it, and a different
# partitioner may place different collectives, which is one more reason to read the HLO rather than trust a
# recorded count): you predict from first principles, then read the HLO and explain the difference. What carries over: the
# mesh, the placements, and the costs above. In plain PyTorch: `init_device_mesh("cuda", (4, 2),
# mesh_dim_names=("data", "model"))` + DTensor,
# `parallelize_module(block, mesh["model"], {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})`, and
# `fully_shard(model)` (FSDP2) for ZeRO-3, which issues the textbook all-gathers and reduce-scatters itself
# (per module; `reshard_after_forward` defaults to None in torch 2.9: True for the modules below the root, which
# gather their weights again for the backward, False at the root, which keeps them; FSDP2 shards dim 0 of each
# parameter unless `shard_placement_fn` says otherwise, where torch_xla's FSDPv2 takes the largest dimension); in
# JAX, `Mesh` + `PartitionSpec` + `jax.jit` with the same GSPMD/Shardy partitioner as here.

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
# ## 11. Save sharded, restore onto another layout
# A checkpoint of the FSDP run must not gather the model onto one host first (for a model that needs FSDP, the
# whole of it may not fit there). `labkit.checkpoint.CheckpointManager` sees that the state is split over
# devices and writes it in the *sharded format*: PyTorch's Distributed Checkpoint (DCP) with torch_xla's SPMD
# planners stores each device's slice once, with its offsets in the global tensor, then a `COMMITTED` marker
# (a save killed midway is never restored). Because every slice knows where it belongs, the checkpoint restores
# onto any layout: here into the data-parallel model, where every device holds all of it; on a TPU VM onto
# another number of chips (the tests restore 8 devices onto 4 and onto 1). `restore(into=...)` fills the
# target's own tensors, which keep their layout.
#
# Carries over: DCP is plain PyTorch (`torch.distributed.checkpoint`; on GPUs with FSDP2/DTensor state). The
# SPMD planners and the sharded XLA tensors are torch_xla's.
#
# The save prints warnings from torch 2.9's DCP about torch_xla 2.9's planners, not about this checkpoint: "The
# function definition for SavePlanner.set_up_planner has been updated to include the storage_meta argument" (the
# planner was written for an older DCP) and a `TypedStorage is deprecated` notice (how the planner reaches the
# bytes). A third comes from torch_xla itself (`xla_sharded_tensor.py`): "Using a non-tuple sequence for
# multidimensional indexing is deprecated", how it cuts the padding off a shard. All three are harmless and go away
# when the libraries agree again.

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
# **Where this goes next.** TorchTPU, which PyTorch/XLA's README (2026-04-22) says will replace torch_xla once it is public (not run here: it needs TPU chips), shards with DTensor
# and one process per chip instead of GSPMD's one process per host.
# * Ends with torch_xla: `xs.Mesh`, `xs.mark_sharding`, `SpmdFullyShardedDataParallel`, the SPMD planners of the
#   sharded checkpoint, and reading the partitioned HLO dump.
# * Carries over: meshes with named axes, a placement per tensor dimension, the bytes each layout keeps per device
#   and the collectives it costs (the same arithmetic in sections 6 and 7), and DCP checkpoints that restore onto
#   another layout.
