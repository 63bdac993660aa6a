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
# # A GPT-style transformer language model on TPU / GPU / CPU
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/labkit/labkit/blob/main/notebooks/02_transformer_lm.ipynb)
#
# What this notebook does, top to bottom:
#
# 1. **Set-up**: the same call as in notebook 01 finds the accelerator, and a doctor checks versions.
# 2. **Text**: the tokens are bytes, 256 of them, so there is no tokenizer. Offline, the text is the Python Language
#    Reference that ships with every Python. Online, it is tiny-shakespeare, 1 MB.
# 3. **The model**: a decoder-only transformer written out in `labkit/models/gpt.py`, about 350 lines. It has
#    pre-norm blocks, causal self-attention, and an output layer tied to the input embedding.
# 4. **Training** with labkit's loop and dashboard: loss, tokens per second, and **MFU**. MFU is model FLOPs
#    utilisation: the share of the chip's peak arithmetic that the model actually uses.
# 5. **Sampling text** without a new XLA compile for every token.
# 6. **What XLA did**, in plain words.
#
# Every claim about this run is checked by an `assert`. What the text says about TPUs, which it cannot measure
# here, is marked *not verified here*. On Colab: *Runtime → Change runtime type → TPU*, then *Run all*.

# %% [markdown]
# By the end you can train a byte-level GPT, read tokens/s and MFU, and sample text without a compile per token.
# You can also predict its memory: weights, gradients, AdamW state and activations. From that you can say whether it
# fits one TPU chip.
#
# **Time**: 1.5–5 minutes of run time in fast mode on a 2-core CPU, quiet machine to busy. The range is the machine's
# load: XLA compiles the graphs on the same cores as everything else, and compiling is most of a short run. On an NVIDIA
# H200 the notebook runs in 17 s. On a Colab TPU v5e-1, full mode should take about 3–6 minutes, an estimate *not
# verified here*. Reading and the exercises take 45–60 minutes.
#
# *Measured on: 2-core x86_64 CPU, XLA:CPU, torch_xla 2.9, fast mode: 4.4 min at a load of 14–16, beside a run of
# notebook 01, with 75 s of it compiling. NVIDIA H200 (141 GB), torch 2.11.0+cu130, exercises unsolved: 17 s,
# 2026-11.*
#
# **In the course**: after 06; next: 03.

# %% [markdown]
# ## Parameters
# Every knob lives in this cell. Each one can also be set from the environment as `LABKIT_<NAME>`, for example
# `LABKIT_MAX_STEPS=500`.
#
# `LABKIT_FAST=1` gives the CI-sized run: a 2-layer, 64-wide model trained for 400 steps. The defaults are sized for
# one Colab TPU: 10.7 M parameters and 5,000 steps.

# %% tags=["parameters"]
import dataclasses, os, sys


@dataclasses.dataclass
class Params:
    source: str = "auto"          # auto (shakespeare when online, else offline) | offline | shakespeare | a file path
    block_size: int = 256         # context length T (bytes)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.1
    batch_size: int = 64          # sequences per chip and step: with SPMD a step takes batch_size x chips sequences
    spmd: str = "auto"            # auto (on with more than one chip, e.g. a v5e-8) | on | off: one process, every chip
    max_steps: int = 5000
    evals: int = 10               # evaluate this many times during training (the steps split into equal parts)
    eval_batches: int = 20        # validation batches per evaluation (the same windows every time)
    lr: float = 1e-3              # AdamW peak learning rate (linear warm-up, then cosine decay to 10%)
    weight_decay: float = 0.1
    precision: str = "auto"       # auto (bf16 on TPU) | bf16 | fp16 | fp32 | true | false: labkit.precision.choose
    log_every: int = 100          # read metrics every N steps (one device->host transfer each)
    gen_tokens: int = 600         # bytes to sample at the end
    temperature: float = 0.8
    top_k: int = 40
    seed: int = 0
    save_to: str = ""             # "": keep nothing; else a folder or gs://YOUR_BUCKET/prefix for the trained model
    gcp_project: str = ""         # Google Cloud project for your bucket ("": GOOGLE_CLOUD_PROJECT, then your credentials)
    # CI-sized: offline text, a tiny model, a high learning rate so 400 steps show real learning; 400 > 325
    # also checks that AdamW does not recompile where its bias correction rounds to 1 (see "Train")
    FAST = {"source": "offline", "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64, "dropout": 0.0,
            "batch_size": 16, "max_steps": 400, "evals": 2, "eval_batches": 4, "lr": 1e-2, "log_every": 40,
            "gen_tokens": 150}


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
# `choice=keep` means nothing was installed. Where torch and torch_xla are missing or do not match, it installs the
# pair together and asks you to restart the runtime. Run the notebook again after the restart.

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
# ## 1. Find the device
# labkit looks for a TPU first, then a CUDA GPU, then torch_xla on the CPU, then plain PyTorch. CI runs this
# notebook on torch_xla's CPU backend.
#
# bfloat16 autocast is on by default where the chip has matrix units for it. A TPU's MXUs work in bf16 natively. A
# CUDA GPU has them from compute capability 8.0, Ampere and later. An older GPU gets float16 with a gradient scaler,
# and a CPU gets float32. `labkit.precision.choose` makes the choice, and the cell prints it.
#
# The cell's last line is the batch plan: how many chips share a step, and how many sequences each one takes.

# %%
import math, time

import numpy as np
import torch

rt = labkit.setup(spmd=P.spmd)
report = labkit.doctor(rt)
assert labkit.setup() is rt
PREC = labkit.precision.choose(rt, P.precision)  # bf16 on TPU / CUDA >= 8.0, fp16 + GradScaler below, else fp32
PLAN = labkit.spmd.batch_plan(rt, P.batch_size)   # SPMD: the host loads every chip's share, sharded on "data"
print(f"backend {rt.kind}, device {rt.device}, {rt.world_size} replica(s), precision {PREC}")
print(PLAN.describe())

# %% [markdown]
# ## 2. The text
# A language model learns to predict the next token from the ones before it. Our tokens are bytes. So the
# vocabulary is exactly 256, and nothing has to be downloaded or trained to split text into tokens. The price is
# sequences about four times longer than with a word-piece tokenizer.
#
# * **offline**, with no network needed: the *Python Language Reference* that every CPython carries for `help()`
#   (`pydoc_data.topics`). It holds about 460 KB of English prose about Python, with code samples.
# * **shakespeare**: Karpathy's tiny-shakespeare, 1.1 MB, downloaded once to `~/.cache/labkit` when online.
#
# The first 90 % of the text trains and the last 10 % validates. A batch is a set of random windows of
# `block_size + 1` bytes, drawn with a seeded generator. The input is a window's first `block_size` bytes, and the
# targets are the same window shifted by one. Every batch has the same shape, so XLA compiles the training step once.
#
# The cell prints the text's size, a 400-byte sample of it between two rules, and one batch's shape.

# %%
from labkit.lessons import recipes
from data_tools import text

SOURCE, data = recipes.load_text(P.source)   # auto: shakespeare when it downloads, else the offline text
train_data, val_data = text.split(data)
print(f"{text.corpus_source(SOURCE)}: {len(data):,} bytes ({len(train_data):,} train, {len(val_data):,} validation)")
print("-" * 60)
print(text.decode(train_data[2000:2400]))
print("-" * 60)
STEPS_PER_EVAL = max(1, P.max_steps // P.evals)
# two text.TextBatches: training windows drawn anew each epoch, validation the same windows every time
train_batches, val_batches = recipes.text_batches(train_data, val_data, PLAN, rt, block_size=P.block_size,
                                                  steps_per_eval=STEPS_PER_EVAL, eval_batches=P.eval_batches,
                                                  seed=P.seed, name=SOURCE)
x, y = next(iter(train_batches))
assert x.shape == y.shape == (PLAN.host_batch, P.block_size) and torch.equal(x[:, 1:], y[:, :-1])
print("one batch:", tuple(x.shape), x.dtype, "| targets are the inputs shifted by one byte")

# %% [markdown]
# ## 3. The model
# `labkit.models.gpt.GPT` is a decoder-only transformer in the style of GPT-2:
#
# * **Embeddings**: each byte gets a learned vector, `wte`, and each position 0..T-1 another, `wpe`. Their sum
#   enters the residual stream.
# * **Blocks**: `n_layer` of them. Each computes `x = x + attention(LayerNorm(x))`, then
#   `x = x + MLP(LayerNorm(x))`. This is *pre-norm*: the normalisation sits on the branch. So the residual path from
#   input to output is a plain sum, and gradients reach the first layer undamped. Deep stacks then train without
#   special warm-up tricks.
# * **Causal self-attention**: every position mixes information from itself and the positions before it, never
#   after. `F.scaled_dot_product_attention(..., is_causal=True)` applies the triangular mask. That mask lets one
#   forward pass train on all T next-byte predictions of a window at once.
# * **Weight tying**: the output layer turns the final vector into 256 scores, and it reuses the input embedding
#   matrix. That saves `256 × n_embd` parameters. It also ties "what a byte means" to "when a byte is likely".
# * **Init**: weights are drawn from N(0, 0.02). The layers that write into the residual stream are scaled by
#   1/sqrt(2·n_layer), so the stream does not grow with depth. At initialisation the model predicts all 256 bytes
#   about equally. So the loss starts near ln 256 = 5.55 nats, 8 bits per byte.
#
# **FLOPs**: a matrix product `(m×k)·(k×n)` costs 2·m·k·n FLOPs, a multiply and an add per term. Its backward pass
# costs about twice its forward: one product for the input's gradient, one for the weight's. Exercise 3 below turns
# that into the cost of a training step. `GPT.flops_per_token()` is labkit's count, and MFU uses it.
#
# The cell prints the model's size, its loss at initialisation next to ln 256, and the peak FLOP/s that MFU will
# divide by, with where that peak comes from.

# %%
from labkit.models import GPT, GPTConfig, bits_per_byte
from labkit.dashboard import flops

gcfg = GPTConfig(block_size=P.block_size, n_layer=P.n_layer, n_head=P.n_head, n_embd=P.n_embd, dropout=P.dropout)
torch.manual_seed(P.seed)
probe = GPT(gcfg)
with torch.no_grad():
    _, loss0 = probe(x, y)
N = probe.num_params()
FLOPS_PER_TOKEN = probe.flops_per_token()
TOKENS_PER_STEP = P.batch_size * P.block_size          # one chip's share of a step
print(f"{N / 1e6:.2f} M parameters (without the position table), {FLOPS_PER_TOKEN / 1e6:.1f} MFLOPs per token trained")
print(f"loss at initialisation {loss0.item():.3f} nats; uniform guessing gives ln 256 = {math.log(256):.3f}")
assert abs(loss0.item() - math.log(256)) < 0.3
PEAK, PEAK_SOURCE = flops.peak_flops(rt, PREC.name)  # the peak of the dtype this run computes in
print("peak for MFU:", PEAK_SOURCE)


# %% [markdown]
# ## 4. Train
# This is the same `labkit` loop as in the ResNet notebook. A language model changes two hooks, in `LMTrainer`: the
# model computes its own loss, and evaluation sums the loss and the next-byte hits over every position. The optimizer
# is AdamW, with a linear warm-up and a cosine decay.
#
# One XLA trap hides in plain AdamW. It computes its bias correction, `sqrt(1 - beta2**step)`, as a Python number.
# torch_xla passes most Python numbers to the device as data. But it writes 0 and 1 into the graph as constants.
#
# So on the step where the correction rounds to exactly 1.0, the graph changes and XLA recompiles mid-run. With
# beta2 = 0.95 that is step 325 in float32, the dtype the number takes on the device; in Python's float64 it would be
# step 730. `labkit.models.gpt.adamw` sets `capturable=True` on XLA. That keeps the step count on the device and
# computes the correction there, so one graph serves the whole run. The learning rate is a Python number too, so the
# schedule below never reaches exactly 0.
#
# The dashboard knows the work per step. So it reports tokens per second and MFU: achieved FLOP/s ÷ peak FLOP/s of
# one chip. A CPU has no meaningful vendor peak, so labkit measures one: a float32 matrix multiply timed for a
# second.
#
# The buttons act mid-run only when the cell runs `history = await labkit.dashboard.fit_with_buttons(trainer)`.
# With the plain call below, a click waits for the cell to end, as notebook 01 explains.
#
# The dashboard's first interval includes the compiles, so its first rate is too low and its first ETA too long.
# Both settle once the compiles are done. The cell first prints a few `[labkit]` lines. Each is a decision the runtime
# took once, with its reason. On XLA:CPU there are two: the memory format, and who copies batches to the device
# (notebook 00 explains the second). Another backend may add its own, such as cuDNN's autotuner on a GPU. The cell's
# last line gives the steps, the seconds, and the final validation loss in nats and in bits per byte.

# %%
# GPT(gcfg) seeded on host and device; labkit.models.gpt.adamw (decay on matrices only, capturable on XLA);
# warm-up over 5% of the steps, then cosine to 10%
model, optimizer, scheduler = recipes.build_gpt(gcfg, P.lr, P.weight_decay, P.max_steps, P.seed, rt)
cfg = labkit.TrainConfig(epochs=P.evals, max_steps=P.max_steps, clip_norm=1.0, log_every=P.log_every,
                         eval_every=1)
dash = labkit.Dashboard(title=f"GPT {P.n_layer}x{P.n_embd} on {SOURCE} ({rt.kind})", tokens_per_step=TOKENS_PER_STEP * PLAN.chips,
                        flops_per_step=FLOPS_PER_TOKEN * TOKENS_PER_STEP, peak_flops=PEAK,
                        chance=1 / 256)   # next-byte accuracy of guessing uniformly
trainer = labkit.LMTrainer(model, optimizer, rt, cfg, train_batches, val_batches, scheduler=scheduler, callbacks=[dash],
                    precision=PREC)
t0 = time.perf_counter()
history = trainer.fit()
TRAIN_S = time.perf_counter() - t0
final = trainer.eval_history[-1]
# a CPU copy for notebook 05 ($LABKIT_ARTIFACTS or ./checkpoints)
labkit.serve.save_for_serving(trainer, final, x[:4], arch={"name": "gpt", **dataclasses.asdict(gcfg)}, meta={"source": SOURCE})
print(f"{trainer.step} steps in {TRAIN_S:.0f} s; val loss {final['val_loss']:.3f} nats = "
      f"{bits_per_byte(final['val_loss']):.2f} bits per byte, next-byte accuracy {final['val_acc']:.1%}")

# %% [markdown]
# ### Did it learn, how fast, and did XLA behave?
# The cell below checks three claims and prints the figures behind them.
#
# * The training loss fell. The last logged interval is at least 0.5 nats below the first. The validation loss is
#   at least 1.5 nats, over 2 bits per byte, below uniform guessing.
# * After warm-up XLA compiled nothing new during training. Evaluation has its own forward-only graphs. They compile
#   at the first evaluation and are reused after, and the dashboard does not count them as recompilations.
# * Throughput in tokens per second, and MFU, with the source of the peak figure.
#
# Validation can sit *below* training here, for two reasons. Each training point averages an interval during which
# the model kept improving. And with the offline text, the last 10 % is the reference's last sections, which are
# simply easier to predict. The same model scored about 0.25 nats lower on it than on training windows. That was
# measured once, on a longer run, and this notebook does not re-check it.
#
# On a CPU the peak is what torch's own float32 matmul reaches on these cores. So MFU there says how close the whole
# compiled training step gets to one large matmul. It is not comparable with a TPU's MFU, which is measured against
# the chip's rated bf16 peak.
#
# On a TPU, small matrices leave the matrix units partly idle. These MXUs are 128×128 on v2–v5 and 256×256 on v6e
# Trillium. How busy the defaults keep them was not measured here, since CI has no TPU. The defaults are 384
# channels, a 256-byte context and batch 64. The MFU the dashboard prints on a TPU is the answer.
#
# A GPU figure for scale: GPT-2 small compiled with `torch.compile` reached 41.3 % MFU in bf16. That model is far
# larger than this one, which is why its matrices keep the tensor cores busy.
#
# *Measured on: NVIDIA H200, torch 2.11.0+cu130, GPT-2 small, T = 1024, batch 16, bf16, 2026-11.*

# %%
losses = [r["loss"] for r in history]
print("train loss per interval:", " ".join(f"{v:.2f}" for v in losses))
print("validation:", ", ".join(f"step {e['step']}: {e['val_loss']:.3f} ({bits_per_byte(e['val_loss']):.2f} bits/byte)"
                               for e in trainer.eval_history))
assert losses[-1] < losses[0] - 0.5, f"training loss did not fall by 0.5 nats: {losses[0]:.3f} -> {losses[-1]:.3f}"
assert final["val_loss"] < math.log(256) - 1.5, f"validation loss {final['val_loss']:.3f} is too close to uniform ({math.log(256):.3f})"
if rt.is_xla:
    print("recompilations after warm-up:", len(dash.health.events), [e["reason"] for e in dash.health.events])
    assert not dash.health.events, f"XLA recompiled after warm-up: {dash.health.events}"
steady = [r for r in dash.history[1:] if r.get("tokens_per_s")] or dash.history[-1:]   # the first interval includes compiling
TOK_S = float(np.median([r["tokens_per_s"] for r in steady]))
RATE = labkit.spmd.throughput(TOK_S, PLAN)             # tokens/s in total and per chip
MFU = flops.mfu(FLOPS_PER_TOKEN * TOKENS_PER_STEP, TOKENS_PER_STEP / RATE["per_chip"], PEAK)   # per chip
print(f"throughput {RATE['total']:,.0f} tokens/s in total, {RATE['per_chip']:,.0f} per chip over {PLAN.total_chips} chip(s); "
      f"{FLOPS_PER_TOKEN * RATE['per_chip'] / 1e12:.4f} TFLOP/s per chip, {FLOPS_PER_TOKEN * RATE['total'] / 1e12:.4f} in total")
print(f"MFU {MFU:.2%} per chip (the same for all of them together) of {PEAK_SOURCE}" if MFU is not None else f"MFU unknown: {PEAK_SOURCE}")

# %%
SAVED = dash.save_artifacts("gpt")            # headless runs ($LABKIT_ARTIFACTS) keep the figure and the curves
if SAVED:
    print("saved", *SAVED)
from IPython.display import Image, display

display(Image(dash.png_bytes(dpi=90)))   # the Figure is not pyplot's: drawn to PNG, it shows in any front end

# %% [markdown]
# The figure is the dashboard at the end of the run. The training loss falls, and the two validation points sit
# below it. Tokens/s climbs over the first intervals as the warm-up's compiles pass. It dips once more where the
# first evaluation compiled its graphs: the second red bar, bottom left, in the interval after that evaluation. The
# right axis of the tokens/s panel is the share of each step spent waiting for data; near 0 %, the loader keeps up.
#
# ## 5. Generate text without recompiling for every byte
# The textbook sampling loop feeds the model a sequence that grows by one token per step. On XLA every new input
# shape is a new graph, and every new graph is a compile. A 600-byte sample would mean hundreds of compiles.
# `GPT.generate` avoids that in three ways:
#
# * The model always runs on a **fixed window** of `block_size` bytes, kept on the device. While the window fills,
#   the position to read is a *device tensor*, not a Python number, so every step is the same graph. Causal attention
#   makes the unused tail of the window invisible. Once the window is full, it slides left by one byte: a second
#   graph.
# * The next byte is **sampled on the device**, with no `.item()` per byte. The Gumbel-max trick,
#   `argmax(logits / temperature + noise)`, draws from the softmax. Top-k keeps the k best scores, with a fixed k.
# * The bytes come back to the host **once**, at the end.
#
# The cost: each byte runs the full window through the model, since there is no key/value cache.
#
# The cell prints the sampled text, then a line with both calls' seconds and compiles. The first call compiles a
# few graphs. The second compiles none, which torch_xla's counter checks. A fast-mode model trained for a minute
# writes text that looks like the source's but reads as nonsense.

# %%
from labkit.dashboard import compile_count

PROMPT = "ROMEO:\n" if SOURCE == "shakespeare" else "The "
prompt = text.encode(PROMPT)[None].to(rt.device)
gen_model = trainer.module
c0, t0 = compile_count(), time.perf_counter()
out = gen_model.generate(prompt, P.gen_tokens, temperature=P.temperature, top_k=P.top_k)
first_s, compiles = time.perf_counter() - t0, compile_count() - c0
t0 = time.perf_counter()
out2 = gen_model.generate(prompt, P.gen_tokens, temperature=P.temperature, top_k=P.top_k)
again_s, compiles_again = time.perf_counter() - t0, compile_count() - c0 - compiles
print(PROMPT + text.decode(out[0]))
print("-" * 60)
print(f"{P.gen_tokens} bytes: first call {first_s:.1f} s with {compiles} compiles; second call {again_s:.1f} s "
      f"({P.gen_tokens / again_s:.0f} bytes/s) with {compiles_again} compiles")
assert out.shape == (1, P.gen_tokens)
if rt.is_xla:
    assert compiles <= 6, f"generate compiled {compiles} graphs for {P.gen_tokens} bytes: once per byte?"
    assert compiles_again == 0, "the second call should reuse every graph"

# %% [markdown]
# ## Your turn
# Three exercises check themselves (`labkit.lessons.exercises`). Replace each `...`, run the cell, then run the
# check cell. A solution hides in the collapsed cell between them, and it runs only with `LABKIT_SOLUTIONS=1`.
#
# **1. Bucketing.** A server gets prompts of every length from 1 to `block_size`. On XLA each length would be a
# graph to compile. Write `bucket(n)`: the length to pad a prompt of n bytes to. It is a multiple of 32, adds no more
# than 31 bytes of padding, and never passes the window. Then all lengths share a handful of graphs.

# %%
from labkit.lessons import exercises as ex
from labkit.lessons.exercises import nb02


def bucket(n):
    ...   # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():
    def bucket(n):
        return min(P.block_size, 32 * math.ceil(n / 32))

# %%
if ex.check("02.bucket", lambda: nb02.check_bucket(bucket, P.block_size, rt)):
    print("Every prompt length now pads to one of a handful of shapes, so a server compiles a handful of graphs.")

# %% [markdown]
# **2. Parameters, predicted from the shapes.** Write `gpt_params(V, T, L, d)`: how many parameters labkit's GPT
# has with vocabulary V, context T, and L blocks of width d. Read `labkit/models/gpt.py` for the details. Biases are
# on. Each LayerNorm has a weight and a bias. The MLP is 4× wide. The output layer is tied to the token table.
#
# The check counts real models of four other shapes. It also checks one model of billions of parameters that this
# machine could not train. Building a GPT or any of its parts inside your function is refused, because that would
# be the measurement, not a prediction.

# %%
def gpt_params(V, T, L, d):
    ...   # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():
    def gpt_params(V, T, L, d):
        block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
        return V * d + T * d + L * block + 2 * d   # tables, blocks, the final LayerNorm

# %%
if ex.check("02.params", lambda: nb02.check_gpt_params(gpt_params)):
    print("Your count matches real models of every shape tried: the parameters follow from the shapes alone.")

# %% [markdown]
# **Memory, predicted then measured.** Training with AdamW in float32 keeps three numbers per parameter between
# steps: the weight and Adam's two moments, 12 bytes. During the step its gradient adds 4 more, so the peak is 16
# bytes. Between steps the loop frees the gradients, with `zero_grad(set_to_none=True)`.
#
# The cell compares that prediction with the bytes this run's model and optimizer really hold. Then it does the same
# arithmetic on paper for two larger GPTs and one TPU v5e chip, which has 16 GB of HBM. Activations come on top;
# the cell after counts them.

# %%
import functools


def state_bytes(model, opt):
    """Bytes of weights, gradients (where allocated) and optimizer state, as they are (measured)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
        total += p.grad.numel() * p.grad.element_size() if p.grad is not None else 0
        for t in opt.state.get(p, {}).values():
            total += t.numel() * t.element_size() if torch.is_tensor(t) and t.dim() else 0
    return total


n_all = sum(p.numel() for p in trainer.module.parameters())
measured = state_bytes(trainer.module, trainer.optimizer)
print(f"between steps: predicted 12 x {n_all:,} = {12 * n_all / 1e6:.2f} MB, measured {measured / 1e6:.2f} MB; "
      f"16 x = {16 * n_all / 1e6:.2f} MB during a step")
assert abs(measured - 12 * n_all) <= 0.01 * 12 * n_all, (measured, 12 * n_all)
HBM = 16e9  # TPU v5e, per chip (Google Cloud's TPU page; not verified here)


@functools.cache  # a shape's count once: the cells below ask again for each batch size
def params_of(L, H, d, T, V):
    """Parameters of labkit's GPT at this shape, counted on a build on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        big = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=d))
    return sum(p.numel() for p in big.parameters())  # the tied output layer is counted once


for name, (L_, H_, d_, T_, V_) in {"GPT-2 small shape": (12, 12, 768, 1024, 50257),
                                   "1.3 B": (24, 16, 2048, 2048, 50257)}.items():
    n = params_of(L_, H_, d_, T_, V_)
    need = 16 * n
    verdict = "fits one v5e chip" if need < HBM else f"needs FSDP over at least {math.ceil(need / HBM)} chips"
    print(f"{name}: {n / 1e6:,.0f} M parameters, {need / 1e9:.1f} GB of weights + gradients + AdamW state: {verdict}")

# %% [markdown]
# **Activations, predicted then measured.** The forward pass keeps tensors for the backward pass: the
# *activations*. They grow with the tokens in the batch, not with the parameters.
#
# Count them for labkit's GPT per token, in floats. Each block keeps:
#
# - the block's input and the first LayerNorm's output: d each;
# - q, k and v: 3d;
# - the attention's output, d: the projection reads it as a view of the same storage, so it is kept once;
# - the second LayerNorm's input and output: d each;
# - the MLP's hidden layer before and after GELU: 4d each.
#
# That is **16·d per block**. After the last block come the final LayerNorm's input and output, 2d, and the
# log-softmax over the vocabulary, V. So the total is `4 · tokens · (16·L·d + 2·d + V)` bytes in float32. It leaves
# out a few floats per token: LayerNorm's mean and variance, the attention's log-sum-exp per head, and the token ids.
#
# The cell measures the kept bytes with `torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd
# keeps. It runs on the plain CPU, where tensors have storage to measure, for two model sizes at two batch sizes.
# Each line gives the prediction, the measurement, and their gap, about 1 %.

# %%
def saved_for_backward(model, x, y):
    """Bytes autograd keeps for the backward pass of one forward pass: every saved tensor's storage once,
    the weights left out (they are there anyway)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return sum(kept.values())


def activation_bytes(L, d, V, tokens):
    return 4 * tokens * (16 * L * d + 2 * d + V)


for L_, d_, H_ in ((2, 64, 4), (4, 128, 8)):
    for B_, T_ in ((2, 64), (8, 32)):
        torch.manual_seed(0)
        small = GPT(GPTConfig(block_size=T_, n_layer=L_, n_head=H_, n_embd=d_, dropout=0.0))
        xb, yb = torch.randint(0, 256, (B_, T_)), torch.randint(0, 256, (B_, T_))
        got, want = saved_for_backward(small, xb, yb), activation_bytes(L_, d_, 256, B_ * T_)
        print(f"L={L_} d={d_}, {B_} x {T_} tokens: predicted {want / 1e6:.2f} MB, measured {got / 1e6:.2f} MB "
              f"({got / want - 1:+.1%})")
        assert abs(got - want) <= 0.03 * want, (L_, d_, B_, T_, got, want)  # what is left out: ~1 %

# %% [markdown]
# On XLA the compiler decides what stays in memory: it fuses ops and may recompute. So the saved tensors are what the
# program *asks* to keep.
#
# One difference is visible in them. PyTorch's CPU attention is a fused kernel that keeps only a log-sum-exp per
# head. torch_xla's default `scaled_dot_product_attention` is a matmul and a softmax, and it keeps the attention
# probabilities, of shape (B, H, T, T). That is **H·T more floats per token per block**: more than 16·d once
# T > 16·d/H. Flash-attention kernels avoid that; on a TPU these are torch_xla's Pallas kernels, not verified here.
#
# The cell looks for that tensor on this backend. Then it does the arithmetic for two GPTs on a v5e chip, with the
# tensor counted. At these sizes the activations, not the weights, decide the verdict.
#
# Besides more chips, the usual cures are a smaller batch per chip, bf16 activations at half the bytes, and
# recomputing activations in the backward pass instead of keeping them. The tool for that is
# `torch.utils.checkpoint`; torch_xla has its own `checkpoint`.

# %%
if rt.is_xla:
    shapes = []

    def note(t):
        shapes.append(tuple(t.shape))
        return t

    torch.manual_seed(0)
    small = GPT(GPTConfig(block_size=32, n_layer=1, n_head=4, n_embd=64, dropout=0.0)).to(rt.device)
    xb = torch.randint(0, 256, (2, 32)).to(rt.device)
    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
        small(xb, xb)
    print("saved by XLA's attention:", [s for s in shapes if s[-2:] == (32, 32)])
    assert (2, 4, 32, 32) in shapes, "torch_xla's SDPA keeps the (B, H, T, T) probabilities for backward"
else:
    print(f"on {rt.kind} attention is a fused kernel here: the (B, H, T, T) probabilities are not kept")

for name, (L_, d_, H_, T_) in {"GPT-2 small shape": (12, 768, 12, 1024), "1.3 B": (24, 2048, 16, 2048)}.items():
    n = params_of(L_, H_, d_, T_, 50257)
    for B_ in (8, 32):
        act = activation_bytes(L_, d_, 50257, B_ * T_) + 4 * B_ * T_ * L_ * H_ * T_  # with the attention matrix
        need = 16 * n + act
        verdict = "fits one v5e chip" if need < HBM else f"needs {math.ceil(need / HBM)} chips with FSDP"
        print(f"{name}, batch {B_} x {T_}: {16 * n / 1e9:.1f} GB of state + {act / 1e9:.1f} GB of activations: "
              f"{verdict} (v5e figures not verified here)")

# %% [markdown]
# **Recomputing activations.** Here the cure named above is applied. `GPTConfig(recompute=True)` wraps each block
# in `torch.utils.checkpoint`. The forward pass then keeps only each block's input, d floats per token. The backward
# pass runs the block's forward again to rebuild the rest, one block at a time.
#
# Predicted: `4 · tokens · (L·d + 2·d + V)` bytes kept instead of `4 · tokens · (16·L·d + 2·d + V)`. While one block
# is being rebuilt, that block's 16·d comes on top, and on XLA its attention matrix too.
#
# The price is one more forward pass of the blocks. A step's work goes from 1 + 2 (forward, backward) to about
# 1 + 1 + 2, so a step should take about 4/3 of the time. The cell measures both on the plain CPU, side by side.
# The losses and gradients stay the same; `tests/test_gpt_recompute.py` checks them, dropout included.
#
# On XLA, give the model torch_xla's checkpoint:
# `model.recompute_fn = functools.partial(torch_xla.utils.checkpoint.checkpoint, use_reentrant=True)`. Its
# optimization barrier keeps the compiler from merging the recomputed forward back into the first one. Without it
# the activations would be kept after all. This was not verified on a TPU here.
#
# The bytes do not vary. The time does, with the machine's load. So the cell times the two models in alternating
# rounds, each round one forward and backward of each, and prints the median and the range over the rounds.

# %%
def kept_bytes(L, d, V, tokens, recompute=False):
    return 4 * tokens * ((L * d if recompute else 16 * L * d) + 2 * d + V)


def fwd_bwd_s(model, xb):
    """Seconds of one forward + backward."""
    t0 = time.perf_counter()
    model(xb, xb)[1].backward()
    return time.perf_counter() - t0


L_, d_, H_, B_, T_ = 4, 128, 8, 4, 64
ROUNDS = 9  # about 0.15 s a round on a 2-core CPU: the spread costs a second or two
xb = torch.randint(0, 256, (B_, T_))
models, kept, losses = {}, {}, {}
for rc in (False, True):
    torch.manual_seed(0)
    m = models[rc] = GPT(GPTConfig(block_size=T_, n_layer=L_, n_head=H_, n_embd=d_, dropout=0.0, recompute=rc))
    kept[rc] = saved_for_backward(m, xb, xb)
    losses[rc] = m(xb, xb)[1].item()
    fwd_bwd_s(m, xb)  # a first, untimed call: allocations and caches
    want = kept_bytes(L_, d_, 256, B_ * T_, rc)
    print(f"recompute={rc!s:5}: predicted {want / 1e6:.2f} MB kept, measured {kept[rc] / 1e6:.2f} MB "
          f"({kept[rc] / want - 1:+.1%})")
    assert abs(kept[rc] - want) <= 0.03 * want, (rc, kept[rc], want)
assert losses[True] == losses[False]
seconds = {False: [], True: []}
for r in range(ROUNDS):  # alternate which goes first, so that a busy moment hits both alike
    for rc in ((False, True) if r % 2 else (True, False)):
        seconds[rc].append(fwd_bwd_s(models[rc], xb))
for rc, ts in seconds.items():
    ms = sorted(t * 1e3 for t in ts)
    print(f"recompute={rc!s:5}: forward + backward median {ms[len(ms) // 2]:.0f} ms, range {ms[0]:.0f}-{ms[-1]:.0f} ms")
ratios = sorted(t / f for t, f in zip(seconds[True], seconds[False]))
print(f"{kept[False] / kept[True]:.1f}x less kept for {ratios[len(ratios) // 2]:.2f}x the time, median of {ROUNDS} "
      f"rounds (range {ratios[0]:.2f}-{ratios[-1]:.2f}x; predicted ~1.33x: one more forward)")
assert kept[True] < kept[False] / 4

# %% [markdown]
# The first two lines compare the bytes, and the bytes match the prediction on any machine. The next three compare
# the time. Compare the median ratio with the predicted 1.33×, and read the range beside it. One run at a load of 3–5
# on a 2-core CPU gave a median of 1.46×, with rounds from 1.20× to 2.09×: near the prediction, but a range that wide
# cannot tell 1.33× from 1.5×.
#
# On a busier machine a single round can take several times as long, whichever model it timed. A range far wider than
# the 33 % the prediction is about neither confirms it nor refutes it. The bytes are the lesson's result; the time is a
# check that only a quiet machine makes sharp.

# %% [markdown]
# **An out-of-memory on a v5e, predicted, read and fixed.** Take the GPT-2 small shape: 12 layers, d = 768,
# 12 heads, 1,024-token windows and GPT-2's 50,257-token vocabulary. Train it with AdamW in float32 on one v5e chip,
# with 16 GB of HBM. At batch 8 it fits. At batch 16 the activations alone pass 16 GB.
#
# On a TPU that program would fail when XLA compiles it, before any step runs. The error says `RESOURCE_EXHAUSTED`
# and lists the largest buffers. While a run goes, `rt.memory()` reads the HBM: bytes in use and the limit, from
# `xm.get_memory_info`.
#
# Reading the error the way the prediction does tells you which term to cut: the activations, not the state.
# Recomputation brings them under the limit at the same batch. So the global batch, and with it the learning rate,
# stays unchanged. All of this is predicted here, not verified on a TPU.
#
# The cell's first line is `rt.memory()` on this runtime: a CPU has no HBM to report.

# %%
def v5e_need(L, d, H, T, V, batch, recompute):
    """Bytes one chip needs: weights + gradients + AdamW state (16 per parameter) and activations, XLA's (B, H, T, T)
    attention probabilities included; recomputing, the blocks' inputs plus one block rebuilt at a time."""
    n = params_of(L, H, d, T, V)
    per_block = 16 * d + H * T  # floats per token a block keeps (XLA's attention: its probabilities too)
    kept = (L * d + 2 * d + V + per_block) if recompute else (L * per_block + 2 * d + V)
    return 16 * n + 4 * batch * T * kept


shape = dict(L=12, d=768, H=12, T=1024, V=50257)
print("the HBM this run reads:", rt.memory() or f"none on {rt.kind} (a TPU reports bytes used and the limit)")
for batch, rc in ((8, False), (16, False), (16, True)):
    need = v5e_need(**shape, batch=batch, recompute=rc)
    print(f"GPT-2 small shape, batch {batch:2d} x 1024, recompute={rc!s:5}: {need / 1e9:5.1f} GB -> "
          f"{'fits' if need < HBM else 'out of memory'} on a v5e's 16 GB (predicted, not verified here)")
assert v5e_need(**shape, batch=8, recompute=False) < HBM < v5e_need(**shape, batch=16, recompute=False)
assert v5e_need(**shape, batch=16, recompute=True) < HBM

# %% [markdown]
# **bf16: range against precision, measured.** A float has an exponent, which sets its range, and a fraction, which
# sets its precision. For float32 these are 8 exponent bits and 23 fraction bits. For fp16 they are 5 and 10. For
# bf16 they are 8 and 7, which makes 8 significant bits with the implicit one. So bf16 has float32's range with far less precision. The cell measures
# what that means for training, on this CPU:
#
# * **Underflow.** A gradient of 1e-8 is below fp16's smallest number, 6e-8. It becomes 0, and that weight stops
#   learning. bf16 keeps it, because its smallest normal number is float32's, 1.2e-38. That is why fp16 training
#   needs loss scaling: multiply the loss by e.g. 2^16 before backward, and divide the gradients after. torch's
#   `GradScaler` does this, and `labkit.precision` uses it for fp16. A TPU computes in bf16 and needs none.
# * **Overflow.** fp16's largest number is 65,504, so an activation of 70,000 is `inf`. bf16 reaches 3.4e38, like
#   float32.
# * **Precision.** bf16 steps by 2^-7 ≈ 0.0078 near 1.0. So `w + lr·g` with lr·g = 1e-3 rounds back to `w`. A model
#   whose weights were stored in bf16 would stop learning. So mixed precision keeps **float32 master weights**.
#   Autocast computes the matmuls in bf16, while the parameters, their gradients and the optimizer's update stay
#   float32.

# %%
def tiny_grad(dtype, scale=1.0):
    """d(loss)/dw of loss = sum(w * 1e-4) * 1e-4 * scale, computed in dtype, then unscaled in float32: 1e-8 exactly."""
    w = torch.ones(4, dtype=dtype, requires_grad=True)
    ((w * torch.full((4,), 1e-4, dtype=dtype)).sum() * (1e-4 * scale)).backward()
    return w.grad.float() / scale


g16, gbf, g16_scaled = tiny_grad(torch.float16), tiny_grad(torch.bfloat16), tiny_grad(torch.float16, 2.0**16)
print(f"gradient 1e-8: fp16 {g16[0].item():.3g}, bf16 {gbf[0].item():.3g}, fp16 with the loss scaled by 2^16 "
      f"{g16_scaled[0].item():.3g}")
assert (g16 == 0).all() and (gbf > 0.98e-8).all() and (g16_scaled > 0.98e-8).all()
big = torch.tensor(70000.0)
print(f"70,000: fp16 {big.half().item()}, bf16 {big.bfloat16().item():.0f}; max fp16 {torch.finfo(torch.float16).max:.0f}, "
      f"bf16 {torch.finfo(torch.bfloat16).max:.3g}, float32 {torch.finfo(torch.float32).max:.3g}")
assert big.half().isinf() and big.bfloat16().isfinite()
assert torch.finfo(torch.bfloat16).tiny == torch.finfo(torch.float32).tiny  # float32's range: no loss scaling
w16, w32 = torch.ones((), dtype=torch.bfloat16), torch.ones(())
for _ in range(100):  # 100 SGD steps of lr * g = 1e-3
    w16, w32 = w16 + torch.tensor(1e-3, dtype=torch.bfloat16), w32 + 1e-3
print(f"after 100 updates of 1e-3: a bf16 weight {w16.item():.4f} (each one rounded away), a float32 master "
      f"weight {w32.item():.4f}; bf16's step near 1.0: {torch.finfo(torch.bfloat16).eps}")
assert w16.item() == 1.0 and abs(w32.item() - 1.1) < 1e-4

# %% [markdown]
# **How `GradScaler` picks its scale.** No one scale suits a whole run, so torch's scaler moves it. Suppose a step's
# gradients hold an `inf` or a `NaN`, because the scaled loss overflowed fp16. Then `scaler.step` **skips** the
# optimizer step, and `update()` multiplies the scale by `backoff_factor`, 0.5.
#
# After `growth_interval` steps in a row without an overflow, 2,000 by default, it multiplies the scale by
# `growth_factor`, 2.0. That probes upward again. These are torch 2.9's `torch.amp.GradScaler` defaults, with an
# `init_scale` of 2^16.
#
# So a few skipped steps at the start of an fp16 run are the scaler finding its level, not a fault. Skipped steps
# that never stop are a fault. Below, on the CPU, a growth interval of 3 shows it in six steps, with one
# overflowing gradient at step 1. Read the printed lines: step 1 is skipped and halves the scale, and after three
# clean steps, at step 4, the scale doubles back.

# %%
w_s = torch.nn.Parameter(torch.ones(4))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
opt_s = torch.optim.SGD([w_s], lr=0.1)
scale_log = []
for step, g in enumerate([1e-3, float("inf"), 1e-3, 1e-3, 1e-3, 1e-3]):
    opt_s.zero_grad()
    scaler.scale((w_s * g).sum()).backward()
    before = w_s.detach().clone()
    scaler.step(opt_s)  # skipped when the gradients are not finite
    scaler.update()
    scale_log.append((step, not torch.equal(before, w_s.detach()), scaler.get_scale()))
    print(f"step {step}: gradient {g:g} -> {'updated' if scale_log[-1][1] else 'skipped'}, scale now {scale_log[-1][2]:g}")
assert [t[1] for t in scale_log] == [True, False, True, True, True, True]
assert [t[2] for t in scale_log] == [2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**16, 2.0**16]  # halved; 3 clean steps: doubled

# %% [markdown]
# **XLA's matmul precision.** On a TPU, a float32 matrix product is by default not computed in float32. XLA rounds
# the inputs to bf16 for one MXU pass and accumulates the products in float32.
#
# torch_xla 2.9 sets this per process with `torch_xla.backends.set_mat_mul_precision`. Its three settings are
# `"default"`, `"high"` and `"highest"`. Per its docstring they give about 8, 14 and 22 significant bits, in 1, 3 and 6
# passes. Underneath it calls `torch_xla._XLAC._xla_set_mat_mul_precision`. `torch_xla.backends.get_mat_mul_precision()`
# reads the setting back.
#
# The XLA:CPU here multiplies in float32 whatever the setting says. So the cell reads the setting, then emulates the
# default's rounding on the CPU. Its last line compares the two errors. A float32 model on a TPU sees errors of
# about 1e-3, not 1e-7 (not verified on a TPU here).

# %%
if rt.is_xla:
    import torch_xla.backends

    print("torch_xla.backends.get_mat_mul_precision():", torch_xla.backends.get_mat_mul_precision())
gen = torch.Generator().manual_seed(0)
A, Bm = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
exact = A.double() @ Bm.double()
err32 = ((A @ Bm).double() - exact).abs().max() / exact.abs().max()
err_bf16_pass = ((A.bfloat16().float() @ Bm.bfloat16().float()).double() - exact).abs().max() / exact.abs().max()
print(f"256x256 float32 matmul, largest error relative to the largest entry: float32 {err32:.1e}; inputs rounded "
      f"to bf16 first (a TPU's 'default') {err_bf16_pass:.1e}")
assert err_bf16_pass > 100 * err32


# %% [markdown]
# **3. A step's time, predicted before it is measured.** Write `predict_step_s(V, T, L, d, batch, flops_per_s)`: the
# seconds one training step on `batch` windows of T bytes takes at `flops_per_s`. Derive the FLOPs per token from
# section 3's two rules.
#
# - Every parameter takes part in one multiply-add per token in the forward pass, and backward costs twice that.
# - Count every parameter of exercise 2 except the position table, which is a lookup, not a matmul. Biases and
#   LayerNorms are a few % of the parameters. labkit's count gives them 6 FLOPs each too, as if each were a weight.
#   What it leaves out is their own elementwise work (`flops_per_token`'s docstring in `labkit/models/gpt.py`).
# - Attention adds two products without weights in every layer: the scores Q·Kᵀ, and the mix of the values. Each
#   runs over all T positions of the window. Count the full T×T square, as the usual convention does, although the
#   causal mask makes half of it zeros.
#
# The check uses shapes where T, d and V all differ, and passes within 2 % of labkit's count. The cell after it
# compares such a prediction with this run's measured step, at this device's measured FLOP/s.

# %%
def predict_step_s(V, T, L, d, batch, flops_per_s):
    ...   # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():
    def predict_step_s(V, T, L, d, batch, flops_per_s):
        n = gpt_params(V, T, L, d) - T * d             # without the position table
        return (6 * n + 12 * L * T * d) * batch * T / flops_per_s

# %%
if ex.check("02.step_time", lambda: nb02.check_step_time(predict_step_s)):
    print("Your FLOPs per step match labkit's count; the next cell sets such a prediction against this run's step.")

# %%
from labkit.profiling import roofline


def time_steps(steps=6, warmup=2):
    """Seconds per training step now: the same step on a twin built as the trained model was (which is left as it is)."""
    twin_model, twin_opt, _ = recipes.build_gpt(gcfg, P.lr, P.weight_decay, P.max_steps, P.seed, rt)
    twin = labkit.LMTrainer(twin_model, twin_opt, rt, cfg, train_batches, precision=PREC)
    batches = iter(twin.train_loader)
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        twin.train_step(next(batches))
        twin.run_optimizer()
        rt.sync()
    return (time.perf_counter() - t0) / steps


measured_step = TOKENS_PER_STEP / RATE["per_chip"]   # the training run's median step
here = roofline.measure(rt)
for attempt in range(3):
    predicted = FLOPS_PER_TOKEN * TOKENS_PER_STEP / here.flops
    print(f"{here.name}: {here.flops / 1e9:.0f} GFLOP/s on a large matmul; one step predicted {predicted * 1e3:.1f} ms, "
          f"measured {measured_step * 1e3:.1f} ms ({measured_step / predicted:.1f}x)")
    high = roofline.upper_bound(predicted, 30)   # no upper bound when the matmuls take under a millisecond
    if 0.7 <= measured_step / predicted <= high or attempt == 2:
        break
    # the step was timed during training, the matmul just now: other work on a shared machine can start or stop
    # in between (on a CPU both slow down with it), so time both again, side by side
    print("outside the stated tolerance: timing the step and the matmul again, side by side")
    measured_step = time_steps()
    here = roofline.measure(rt)
# stated tolerance: the roofline is a floor (>= 0.7x allows for noise); small matrices, softmax, LayerNorms and the
# optimizer's memory-bound update keep a small model well above it (<= 30x, on a loaded 2-core machine; 5.5-10x
# measured on 2-core machines on XLA:CPU; the CI-sized model on the plain CPU, quiet: ~13 ms for 4.9 ms, 2.6x). On a
# fast chip a small model's matmuls take microseconds and launching its kernels sets the step: only the floor holds
if high == float("inf"):
    print(f"launch-bound: {predicted * 1e3:.2f} ms of matmuls is under {roofline.LAUNCH_FLOOR_S * 1e3:.0f} ms; "
          "kernel launches and Python set this step's time, so only the roofline's floor is checked")
assert 0.7 <= measured_step / predicted <= high, (measured_step, predicted)

# %% [markdown]
# The measured step is several times the prediction, and that is expected. The prediction counts only the model's
# FLOPs, at the speed of one large matmul. A small model's step also spends time in softmax, LayerNorms, the
# optimizer's update and Python, none of which run at that speed. So the assert checks a floor, 0.7× the
# prediction, and a ceiling of 30×. On a fast chip the ceiling goes: there kernel launches, not FLOPs, set a small
# model's step, and the cell says so. The ratio itself varies with the machine's load.
#
# ### Use your own bucket
# Set `save_to` to `gs://YOUR_BUCKET/gpt` to keep the trained model. The bucket must exist:
# `gcloud storage buckets create gs://YOUR_BUCKET --location=us-central1`, in the TPU's region. Your account needs
# `roles/storage.objectAdmin` on it.
#
# Sign-in happens only when the path starts with `gs://`. On Colab it is a pop-up. On Kaggle, attach Add-ons >
# Google Cloud Services. On a TPU VM, its service account is used. A missing bucket, a 403 or missing credentials
# stop the cell here, with the fix.

# %%
if P.save_to:
    from labkit.cloud import gcs
    from labkit.checkpoint import CheckpointManager

    if gcs.sign_in(P.save_to, project=P.gcp_project or None):
        gcs.check_access(P.save_to, write=True)
    saver = CheckpointManager(P.save_to, keep=1, rt=rt)
    saver.save(trainer.step, trainer.state_dict(), metrics=final, force=True)
    saver.wait()
    print("saved step", trainer.step, "to", P.save_to)

# %% [markdown]
# ## 6. What did XLA do?
# `labkit.explain(dash)` reads torch_xla's metrics. It reports compile time against execute time, recompilations
# and their causes, ops that fell back to the CPU, and device→host transfers. Each comes with what to do about it.
#
# Its first line gives this run's graphs and the seconds spent compiling them. In a run this short, compiling can
# take longer than the steps themselves; a long run amortises it. On a GPU or plain CPU, explain says there is no
# XLA to explain.

# %%
info = labkit.explain(dash)

# %% [markdown]
# **Where to go from here**
# * On a Colab TPU the defaults train a 10.7 M-parameter model on 256-byte windows. Watch MFU on the dashboard, and
#   try a larger `batch_size` or `n_embd`. Multiples of 128 fit the 128×128 MXUs of TPU v2–v5. v6e's are 256×256, so
#   there use multiples of 256.
# * `LABKIT_SOURCE=/path/to/any.txt` trains on your own text.
# * `python -m labkit.train gpt --max-steps 5000` trains the same model from a terminal, from the same recipes, with
#   these parameters as flags. It also runs on a pod slice or under `torchrun` (README: *Scale out*).
# * The loss in bits per byte compares across tokenizers. A byte-level model at 1.5 bits/byte on English is doing
#   well for its size.
# * **Where this goes next.** PyTorch/XLA's README (its note of 2026-04-22) names TorchTPU as its replacement once
#   TorchTPU is public; TorchTPU was not run here. Ends with torch_xla: the lazy step, the `CompileTime` count behind
#   the recompile checks, and `explain`'s metrics. Carries over: bucketed prompt lengths, the 6·N FLOPs per token,
#   MFU, and the memory arithmetic. Generation over a fixed window, read at a device-tensor position, carries over
#   too: it compiles a few graphs and then none, and under `torch.compile` its guards keep holding.
