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
# # Past one device: FSDP2, HSDP and accumulation under torchrun, predicted then counted
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/labkit/labkit/blob/main/notebooks/09_past_one_device.ipynb)
#
# Notebook 08 trained the tiny GPT under FSDP2 on 4 processes. This one asks what a GPU node and a pod add. It covers
# memory per process for each layout, and gradient accumulation. It builds a model that never exists whole. It shows
# BatchNorm under bf16, evaluation over shares that do not divide, and a preemption that reaches only one process.
# labkit's rules predict each size first. Then gloo processes on this CPU count it. By the end you can:
#
# - predict the bytes each process holds under replicate (DDP), fsdp2, gathered or sharded accumulation and HSDP;
# - predict the collectives of one optimizer step, and check both against a run;
# - build a model on the meta device with the values of an ordinary build, and say why its peak is shards plus one
#   tensor;
# - say why one bf16 policy breaks BatchNorm, why uneven evaluation shares hang FSDP2, and what labkit does about both;
# - follow a SIGTERM from torchrun to every process, and say what fits in the 30 s before SIGKILL;
# - size a 7B model on 8 x 80 GB and choose a plan for 2 hosts of 8 GPUs, sizes this CPU cannot show.
#
# **Time**: 15–51 s of run time, quiet machine to busy. Most of it is the one torchrun launch of section 2, whose time
# depends on the machine's load. Fast mode only shortens the counted runs, so full mode takes about the same. Reading
# and the three exercises take 30-45 minutes.
#
# *Measured on: 2-core CPU shared with other jobs, torch 2.9, gloo, fast mode, 2026-11-29: two runs at a load of 3–5,
# the whole notebook 14.7 s and 15.4 s, the launch 9 s of each. Earlier runs on a busier machine took 32–51 s for the
# whole notebook; their launch times were not kept.*
#
# **In the course**: after 08; next: 07. It builds on 08: DTensor, FSDP2, the Trainer under torchrun. It also builds
# on 03's bytes and collectives per device.
#
# Every claim below is checked by an `assert` or marked *not verified here*. The exercises print ✓ or ✗ and never
# stop *Run all*. Their solutions are in collapsed cells that run only with `LABKIT_SOLUTIONS=1`, as the test suite
# runs them.

# %% [markdown]
# ## Parameters

# %% tags=["parameters"]
import dataclasses, os, sys


@dataclasses.dataclass
class Params:
    processes: int = 2  # gloo processes of the one torchrun launch (2 or 4)
    steps: int = 3  # optimizer steps of the counted runs
    accum_steps: int = 2  # micro-batches per optimizer step in the accumulation runs
    FAST = {"steps": 2}


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
# ## 1. Bytes per process, predicted
# The run of section 2 trains notebook 08's tiny GPT on `P.processes` gloo processes of one `torchrun`. The GPT has 2
# blocks of width 32 and float32 weights, and AdamW trains it. Before the run, labkit's rules say what each process
# will hold:
#
# - `dtensor_plans.predict_bytes` gives the weights a process keeps, padding included. FSDP2 splits dim 0, padded to
#   a multiple of the processes.
# - Gradients are as large as the weights. AdamW's two moments are twice as large.
# - Gathered accumulation under FSDP2 adds the whole model's weights and its whole unreduced gradients for the window
#   (`parallel.accumulation_bytes`). The end of this section walks through one window.
# - Sharded accumulation adds nothing, but it gathers again for every micro-batch.

# %%
import inspect, tempfile, time

import torch
import torch.nn.functional as F

from labkit import meta_init, parallel
from labkit.lessons import exercises, fsdp_trainer  # check(), solutions_on(), results; the torchrun launcher
from labkit.lessons.exercises import nb09  # this notebook's checkers
from labkit.models import GPT
from labkit.spmd import dtensor_plans

N, K = P.processes, P.accum_steps
cfg = fsdp_trainer.gpt_config()
weights = sum(p.numel() for p in GPT(cfg).parameters())
whole = dtensor_plans.predict_bytes("data", cfg, N)  # float32 weights of a whole copy
shard = dtensor_plans.predict_bytes("fsdp", cfg, N)  # one process's padded shard
gathered_b, sharded_b = parallel.accumulation_bytes(weights, N, 4)
predicted = {  # plan: (weight bytes a process keeps, training state a process holds: weights, gradients, AdamW)
    "replicate": (whole, 4 * whole),
    "fsdp2": (shard, 4 * shard),
    f"fsdp2, k = {K} gathered": (shard, gathered_b),
    f"fsdp2, k = {K} sharded": (shard, sharded_b),
    "hsdp, 2 hosts x 2": (dtensor_plans.predict_bytes("fsdp", cfg, 2), 4 * dtensor_plans.predict_bytes("fsdp", cfg, 2)),
}
print(f"the GPT: {weights:,d} weights, {whole:,d} B of float32 weights; {N} processes")
print(f"{'plan':<24}{'weights kept':>14}{'state held':>12}")
for plan, (w, state) in predicted.items():
    print(f"{plan:<24}{w:>14,d}{state:>12,d}")

# %% [markdown]
# The table has one row a plan. "weights kept" is what a process keeps between steps. "state held" is 4 x that: the
# shard of weights, gradients and AdamW's two moments. The gathered row adds what the window keeps whole.
# `accumulation_bytes` leaves FSDP2's padding out. With 2 processes every first dimension here divides, so its sharded
# figure equals the fsdp2 row.
#
# The replicate row counts 16 B a weight. DDP holds one more copy of the gradients, in its buckets, unless
# `gradient_as_bucket_view=True` (see the [DDP documentation](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html)).
# labkit's replicate keeps torch's default, so a replicated weight costs about 20 B.
#
# The collectives of one optimizer step come from `dtensor_plans.predict_collectives`. FSDP2 gathers the root once,
# each block before its forward, and each block but the last again before its backward. The Trainer keeps the last
# block gathered after its forward, because its backward comes next. That makes 2 L all-gathers for L blocks. Each of
# the L + 1 units (the blocks and the root) has its gradients reduce-scattered once.
#
# `clip_norm` adds one all-reduce of a 4-byte partial norm. Gathered accumulation keeps k = 1's collectives. Sharded
# accumulation runs them for every micro-batch.

# %%
fsdp_comm = {op: v["count"] for op, v in dtensor_plans.predict_collectives("fsdp", cfg, N, last_kept=True).items()}
fsdp_comm["all-reduce"] = 1  # the gradient norm's partial sums (clip_norm=1.0)
predicted_comm = {
    "fsdp2": fsdp_comm,
    "gathered": dict(fsdp_comm),
    "sharded": {op: c * K if op != "all-reduce" else c for op, c in fsdp_comm.items()},
}
for name, comm in predicted_comm.items():
    print(f"{name:<9} per optimizer step: {comm}")
print(f"replicate: one all-reduce of the whole gradients, {whole:,d} B, per optimizer step (DDP's buckets)")

# %% [markdown]
# The printout gives the counts for L = 2 and k = 2. fsdp2 and gathered issue the same 4 all-gathers and
# 3 reduce-scatters. Sharded issues twice as many. The all-reduce of the norm stays at one a step in all three.
#
# ### One gathered window, micro-batch by micro-batch
# Where do those counts and the gathered row's bytes come from? Follow one window of k micro-batches, L blocks and N
# processes, in float32. Each process always holds its shards: 16 B a weight / N.
#
# The Trainer calls `gradient_sync(False)` for every micro-batch but the last. That turns off three things: the
# reduce-scatter, the reshard after each unit's forward, and the reshard after backward. The last micro-batch runs with
# torch's defaults again.
#
# | micro-batch | forward | backward | held besides the shards |
# |---|---|---|---|
# | 1 | all-gathers the root, then each block: L + 1 all-gathers; frees nothing | gathers nothing; whole gradients computed, not reduce-scattered | whole weights (4 B a weight); whole gradients (4 B a weight) once backward ends |
# | 2 to k − 1 | gathers nothing: the weights are still whole | gathers nothing; gradients added to the whole ones | whole weights and whole gradients |
# | k (the last) | gathers nothing; each block but the last frees its weights after its forward | gathers L − 1 blocks again; reduce-scatters each unit's summed gradients: L + 1 reduce-scatters | falls unit by unit back to the shards |
#
# Count the all-gathers: L + 1 in micro-batch 1 and L − 1 in micro-batch k. That is 2 L, as at k = 1. The
# reduce-scatters run only in micro-batch k: L + 1, as at k = 1.
#
# Memory peaks from the end of micro-batch 1's backward until micro-batch k's forward starts freeing units. There every
# process holds the whole weights and the whole gradients at once, besides its shards:
#
# $$\text{bytes} = \underbrace{4P}_{\text{weights}} + \underbrace{4P}_{\text{gradients}} + \underbrace{16P/N}_{\text{shards}}$$
#
# for P weights. One micro-batch's activations come on top, and the rule leaves them out. This sum is exercise 3's
# gathered formula.
#
# Sharded accumulation is k = 1's step run k times. It holds only the shards and one gathered unit at a time. It
# issues 2 L all-gathers and L + 1 reduce-scatters for every micro-batch: k times k = 1's.

# %% [markdown]
# ## 2. One launch, counted
# One `torchrun` of `P.processes` gloo processes runs seven trainings in order:
#
# - replicate, fsdp2, and fsdp2 with k micro-batches, gathered and sharded.
#   `labkit.parallel.collective_counter` counts their collectives.
# - an ordinary and a meta-device build of the same model (section 3);
# - a run that gets SIGTERM (section 6). Process 1 alone sends SIGTERM to itself once it has finished step 2
#   (`sigterm_at`). That is how one process of a preempted job gets it.
#
# The cell prints how long the launch took. Most of that time is starting the processes: each one imports torch and
# labkit and joins the gloo group. So the time follows the machine's load. At a load of 3–5 on a 2-core machine it
# took 9 s; the first cell gives the runs.

# %%
tmp = tempfile.mkdtemp(prefix="labkit-nb09-")
progress = os.path.join(tmp, "progress")
count = {"steps": P.steps, "count": True}
preempt = {"progress": progress, "step_sleep": 0.1, "sigterm_at": [1, 2]}  # process 1, after its step 2
runs = [
    {"name": "replicate", "parallel": "replicate", **count},
    {"name": "fsdp2", "parallel": "fsdp2", **count},
    {"name": "gathered", "parallel": "fsdp2", "accum_steps": K, "fsdp_accumulate": "gathered", **count},
    {"name": "sharded", "parallel": "fsdp2", "accum_steps": K, "fsdp_accumulate": "sharded", **count},
    {"name": "plain", "parallel": "fsdp2", "steps": 3},
    {"name": "meta", "parallel": "fsdp2", "steps": 3, "meta": True},
    {"name": "preempt", "parallel": "fsdp2", "steps": 40, "ckpt": os.path.join(tmp, "ck"), **preempt},
]
signalled = preempt["sigterm_at"][1]  # the step after which process 1 signals itself
t0 = time.perf_counter()
report = fsdp_trainer.launch(N, runs)
print(f"one torchrun of {N} processes: {time.perf_counter() - t0:.0f} s")
assert not [n for n, r in report.items() if "error" in r], report
for name in ("replicate", "fsdp2", "gathered", "sharded"):
    r = report[name]
    print(f"{name:<9} weights {r['param_bytes']:>7,d} B, AdamW {r['opt_bytes']:>7,d} B, per step {r['comm']}")

# %% [markdown]
# Each line gives process 0's bytes after training and its collectives per optimizer step, counted. The next cell
# checks them against section 1's predictions.

# %%
meas = report
assert meas["replicate"]["param_bytes"] == predicted["replicate"][0] == meas["replicate"]["full_param_bytes"]
for name in ("fsdp2", "gathered", "sharded"):
    assert meas[name]["param_bytes"] == shard, (name, meas[name]["param_bytes"], shard)
    assert meas[name]["opt_bytes"] == 2 * meas[name]["param_bytes"]  # AdamW's two moments, sharded alike
    assert meas[name]["comm"] == predicted_comm[name], (name, meas[name]["comm"], predicted_comm[name])
assert meas["replicate"]["opt_bytes"] == 2 * whole
assert meas["replicate"]["comm_bytes"]["all-reduce"] == whole  # the whole gradients, once a step
print("bytes and collectives as predicted for", ", ".join(predicted_comm), "and replicate")
print("replicate's other traffic per step:", {op: b for op, b in meas["replicate"]["comm_bytes"].items() if op != "all-reduce"})

# %% [markdown]
# Every fsdp2 process kept its 1/`P.processes` share of the weights and of AdamW's state: half, with the default 2
# processes. Each plan issued exactly the predicted collectives. For 2 blocks that is 4 all-gathers and 3
# reduce-scatters, the same with gathered accumulation, and twice as many with sharded accumulation over 2
# micro-batches.
#
# Replicate all-reduced the whole gradients once a step. It also issued a small broadcast, whose bytes a step are
# printed above. That broadcast is not the gradients; its source is not traced here.
#
# The run did not measure the gathered window's memory. `param_bytes` is read after training, when the weights are
# sharded again. That figure is the rule's (section 1), *not verified here*.

# %% [markdown]
# ## 3. A model larger than one device: the meta-device build
# Built the ordinary way, every process first holds the whole model and only then shards it. So a model whose weights
# do not fit one device cannot be built at all.
#
# `labkit.meta_init.build` constructs the model on the meta device: shapes, no memory. It records each tensor's
# initialisation with the random generator's state. After sharding, `materialize` fills one whole tensor at a time on
# the CPU and keeps only the process's shard. The peak per process is then its shards plus the largest single tensor.
#
# First, in this kernel: a meta build, materialized whole, gives the same values as `torch.manual_seed(0)` and the
# constructor.

# %%
torch.manual_seed(0)
ordinary = GPT(cfg)
meta = meta_init.build(lambda: GPT(cfg), seed=0)
print("built on the meta device:", meta_init.is_meta(meta), "| wte.weight on", meta.wte.weight.device)
meta_init.materialize(meta, torch.device("cpu"))
a, b = ordinary.state_dict(), meta.state_dict()
assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
name, largest = max(((n, p.numel() * p.element_size()) for n, p in ordinary.named_parameters()), key=lambda t: t[1])
print(f"{len(a)} tensors equal; the largest, {name}, {largest:,d} B of {whole:,d} B")
plain_l, meta_l = report["plain"]["global_losses"], report["meta"]["global_losses"]
print("fsdp2, ordinary build:", [round(v, 4) for v in plain_l])
print("fsdp2, meta build:    ", [round(v, 4) for v in meta_l])
assert plain_l == meta_l

# %% [markdown]
# The first lines compare the two builds in this kernel: every tensor equal. The last two lines are the losses of the
# fsdp2 runs of section 2. The meta build trained with the same losses as the ordinary build, to the last bit.
#
# A process's peak while building is its shards plus the largest tensor, printed above, instead of the whole model.
# The tiny GPT is too small for that to show in memory. `tests/test_fsdp_trainer.py` measures it on a GPT of
# 12.75 M weights, whose float32 weights take 48.6 MiB. There the meta build's peak RSS must stay under 0.75 of the
# ordinary build's. Measured: 34.5 MiB against 72.8 MiB per process, on 2 gloo processes.
#
# The price is time. The initialisation runs once to record, and once per process to replay.

# %% [markdown]
# ## 4. BatchNorm under bf16
# FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)` gathers every weight of a unit in bf16. BatchNorm's running mean and
# variance are buffers, which FSDP2 never casts: they stay float32. torch's `batch_norm` takes a bf16 input with
# float32 weights and statistics. It refuses bf16 weights with float32 statistics. The cell below shows both on the
# CPU.

# %%
x = torch.randn(4, 3, 5, 5, dtype=torch.bfloat16)
stats = torch.zeros(3), torch.ones(3)  # running mean and variance: float32 buffers
try:
    F.batch_norm(x, *stats, torch.ones(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16), training=True)
    failed = None
except RuntimeError as e:
    failed = str(e)
print("bf16 weights, float32 statistics:", failed)
y = F.batch_norm(x, *stats, torch.ones(3), torch.zeros(3), training=True)
print("float32 weights, bf16 input ->", y.dtype)
assert failed and "expected scalar type BFloat16 but found Float" in failed and y.dtype == torch.bfloat16

# %% [markdown]
# The first line is torch's refusal: bf16 weights beside float32 statistics. The second shows the way out: float32
# weights take the bf16 input and return bf16.
#
# So one bf16 policy over a ResNet fails at its first BatchNorm. labkit's fsdp2 plan makes the BatchNorms of each
# residual block one unit, with float32 weights (`fully_shard` takes a list of modules). It leaves their bf16 input as
# it comes (`FullyShard.batchnorm_precision`). On a GPU such a BatchNorm runs torch's native CUDA kernel, not cuDNN's
# (*not verified here*).
#
# The cost is latency, not bytes. ResNet-50 has 17 such units for its 53 BatchNorms: one for the stem, one per block.
# Each unit costs one small all-gather in forward and one small reduce-scatter in backward. It stays gathered from
# forward to backward, so backward gathers nothing again. That is 34 small collectives a step. A unit per BatchNorm,
# freed after forward, took 159. `tests/test_fsdp_resnet.py` trains a ResNet that way under bf16 on gloo processes and
# counts its collectives; it is *not run here*.
#
# Each process also updates its own running statistics from its own batches. So before every evaluation and save, the
# Trainer broadcasts process 0's buffers (`parallel.broadcast_buffers`). DDP does the same at every forward.

# %% [markdown]
# ## 5. Evaluation across ranks
# Evaluation shards rarely split evenly: 5 batches over 2 processes give one process 3 and the other 2. Under FSDP2
# every forward all-gathers. So the process with a third batch waits in an all-gather, while the other has gone on to
# the metrics' all-reduce. Both wait until the process group's timeout, then fail. Under labkit that timeout is 600 s
# (`LABKIT_DIST_TIMEOUT_S`).
#
# `Processes.lockstep` runs the evaluation until every process is out of batches. Before each batch, one all-reduce
# (MAX) of a 4-byte flag says whether any process still has one. A process that has run out repeats its last batch as
# padding, which counts nothing.
#
# The rule behind it: a loop that issues collectives runs the same number of times on every process, whatever each
# process's share of the data. `tests/test_fsdp_resnet.py` evaluates shares of 3 and 2 batches that way; that run is
# *not repeated here*. The source is short enough to read:

# %%
print(inspect.getsource(parallel.Processes.lockstep).split('"""')[-1].strip())

# %% [markdown]
# Read the loop from the top. Every process calls the all-reduce before every batch, whether it has a batch or not. The
# flag alone decides when all of them stop, together. A process without a batch yields its last one again, marked
# `False`: it runs the forward and its collectives, and its result is not counted. The `RuntimeError` covers a process
# that has no batch at all to repeat.

# %% [markdown]
# ## 6. A preemption that arrives through torchrun
# A preempted host's processes get SIGTERM, but not always at the same step, and sometimes only one of them does. A
# process that stopped on its own would leave the others waiting in the next collective.
#
# `labkit.interrupts.StepVote` makes SIGTERM only set a flag. At the end of every step, one all-reduce (MAX) of five
# int32 flags tells every process the same thing: SIGTERM, a NaN loss, and a callback's stop, stop after the epoch
# and save. Then all of them save the same step and stop together.
#
# The run of section 2 got SIGTERM on process 1 alone, at the end of its step 2. Here is the order of events:
#
# 1. Step 2's compute ends. Process 1's step-end callback sends it SIGTERM, and its handler sets the flag.
# 2. Still at step 2's end, both processes vote. The MAX carries process 1's flag to process 0.
# 3. Both save step 2, and both stop with `Preempted`.
#
# A signal that arrives during a step's compute waits for that step's vote, at its end. So every process stops at
# the same step: the one in which the signal arrived.

# %%
ends = report["preempt"]["ends"]  # each process's [last step, stopped by SIGTERM]
print(f"SIGTERM to process 1 after its step {signalled}; each process's [last step, preempted]: {ends}")
saved = sorted(os.listdir(os.path.join(tmp, "ck")))
print("in the checkpoint folder:", saved)
assert all(e == ends[0] for e in ends) and ends[0][1] is True  # every process stopped at one step, preempted
assert ends[0][0] == signalled  # raised before step 2's vote, agreed in it: that step
assert [n for n in saved if n.startswith("step-")] == [f"step-{ends[0][0]:08d}"]  # that step, saved once

# %% [markdown]
# Both processes stopped at step 2, both marked preempted. The folder holds one checkpoint, `step-00000002`. Both
# processes wrote their shards into it; no process gathered the whole state.
#
# `.writer.lock` is not a checkpoint. It is the file process 0 locks while it writes to the folder, and it names the
# writer's host and PID. A second run saving to the same folder fails on that lock instead of deleting this run's
# checkpoints. The lock is released when the writer closes or dies. The file stays, with the last writer's name in
# it.
#
# When torchrun itself gets SIGTERM, it passes SIGTERM on to its workers. It then waits a fixed time before SIGKILL;
# torch's own source gives that time:

# %%
from torch.distributed.elastic.multiprocessing.api import PContext

grace = inspect.signature(PContext.close).parameters["timeout"].default
print(f"torchrun: SIGTERM to the workers, SIGKILL {grace} s later (PContext.close)")
assert grace == 30 and "SIGKILL" in inspect.getdoc(PContext.close)
state = 12 * weights  # a checkpoint: the weights and AdamW's two moments, float32 (no gradients)
big = 12 * 7e9  # a 7B model's
print(f"checkpoint: the tiny GPT {state:,d} B; a 7B model {big / 1e9:,.0f} GB, {big / grace / 1e9:.1f} GB/s to save in {grace} s")

# %% [markdown]
# A checkpoint holds the weights and AdamW's two moments, in float32: 12 B a weight. Gradients are not saved. labkit's
# `trainer_state` saves exactly those, besides a few small counters.
#
# What fits in those 30 s is the step in flight, the vote, and a save whose bytes go out at your storage's rate. The
# tiny GPT's state, printed above, fits at any rate. A 7B model's 84 GB would need 2.8 GB/s with no time left for the
# step. That is more than a host's upload to a bucket is likely to reach (*not verified here*).
#
# So a large run saves on a schedule. SIGTERM then only finishes the save already going up. A Spot VM gets the same
# 30 s from Google Compute Engine after its SIGTERM (its preemption documentation; *not verified here*).

# %% [markdown]
# ## 7. HSDP over two hosts
# HSDP shards inside a host and replicates across hosts. On 2 hosts of 2 processes, each process keeps the shard of a
# 2-process fsdp2 run: the hsdp row of section 1. The all-gathers and reduce-scatters stay on the host's links.
#
# Only the gradients cross hosts. After each unit's reduce-scatter, each process all-reduces that unit's gradient
# shard with its twin on the other host. That is one all-reduce per unit: L + 1 a step.
#
# To compare the two layouts, count the same quantity for both: the bytes one process sends a step. This uses the
# textbook ring algorithm. An all-gather or a reduce-scatter over n processes sends (n − 1)/n of the full tensor. An
# all-reduce sends 2(n − 1)/n of its buffer. The libraries, gloo and NCCL, may pick other algorithms, so these are
# estimates.

# %%
cross = dtensor_plans.predict_bytes("fsdp", cfg, 2)  # each process's float32 gradient shard, padded
flat = dtensor_plans.predict_collectives("fsdp", cfg, 4, last_kept=True)  # the Trainer's units
spanning = flat["all-gather"]["bytes"] + flat["reduce-scatter"]["bytes"]  # gathered results, unreduced inputs
hsdp_sent = 2 * (2 - 1) / 2 * cross  # a ring all-reduce over the 2 twins, summed over the units
flat_sent = (4 - 1) / 4 * spanning  # ring all-gathers and reduce-scatters over the 4 processes
print(f"hsdp, 2 hosts x 2: {cfg.n_layer + 1} all-reduces a step cross hosts, {hsdp_sent:,.0f} B sent per process")
print(f"fsdp2 over the same 4 processes: {flat['all-gather']['count'] + flat['reduce-scatter']['count']} collectives "
      f"a step span both hosts, {flat_sent:,.0f} B sent per process ({flat_sent / hsdp_sent:.1f} x)")
assert hsdp_sent == cross < flat_sent

# %% [markdown]
# HSDP sends each unit's gradient shard once a step, and every one of those bytes crosses hosts. Flat fsdp2 sends
# the multiple printed above, all over collectives that span both hosts. In a ring of 4 processes on 2 hosts, 2 of
# the 4 links cross hosts. Flat fsdp2's all-gathers carry every unit's whole weights. The root's and the last block's
# travel once a step, since they stay gathered from the forward to the backward. Every other block's travel twice: in
# the forward, and again in the backward. With L blocks that is 2L all-gathers for L + 1 units. So with the 2 blocks
# here one unit of three travels twice; with many blocks, nearly all of them do.

# %% [markdown]
# Two hosts need two torchrun launches joined by a rendezvous. That would double this notebook's run time, so it is *not
# run here*. `tests/test_fsdp_trainer.py` runs it on 127.0.0.1 and counts the collectives per mesh dimension. There the
# cross-host all-reduces carry each process's gradient shard, within 2 % of its expected size: half the weights' bytes,
# since each host holds 2 processes. The losses equal the flat run's.
#
# ### The same ideas on a TPU pod
# On a TPU pod under torch_xla, the names change but the ideas do not. The mesh is GSPMD's `xs.Mesh` over every chip
# of every host (notebook 03). Under torch.distributed it is DTensor's `DeviceMesh` over processes. HSDP's two axes
# become `xs.HybridMesh`. One axis spans the chips of a slice, over ICI, the fast links. The other spans slices, over
# DCN, the data-centre network.
#
# The compiler inserts the all-gathers and reduce-scatters from your sharding annotations, so no process group issues
# them. A multi-host TPU VM runs one process per host: the same script on every host, started on all of them at once
# instead of by torchrun. `xm.rendezvous(tag)` then plays the part of the process group's barrier.
# `xr.process_index()` and `xr.process_count()` count hosts, as `RANK` and `WORLD_SIZE` count processes under
# torchrun. The bytes per chip follow the same rules as above: 16 B a weight over the chips that share it.

# %% [markdown]
# ### Exercise 1 (09.gpu_bytes): a 7B model on 8 x 80 GB
# Write `gpu_bytes(params, gpus, unit_params, gather_bytes)`: the bytes ONE GPU holds under FSDP2 with AdamW,
# activations left out. Count two parts:
#
# - its shard of the float32 weights, gradients and AdamW's two moments: 16 B a weight, split over `gpus`;
# - one unit's weights gathered whole while it runs, at `gather_bytes` a weight (2 under bf16).
#
# The result is a lower bound. Activations, the unit's gradients during its backward, communication buffers and the
# allocator's slack come on top.
#
# The checker first asks about 7e9 weights on 8 GPUs, with a unit of 7e9 // 32 weights gathered in bf16. Then it asks
# about models of 1 to 70 B weights over 16, 64 and 8 GPUs, drawn anew each time. labkit's own rules are refused while
# your function runs. Once it passes, the cell prints the 7B case: 14.4 GB a GPU, well inside half of 80 GB.

# %%
# your turn
def gpu_bytes(params, gpus, unit_params, gather_bytes):
    return ...


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():

    def gpu_bytes(params, gpus, unit_params, gather_bytes):
        return params * 16 / gpus + unit_params * gather_bytes


# %%
if exercises.check("09.gpu_bytes", lambda: nb09.check_gpu_bytes(gpu_bytes)):
    need = gpu_bytes(7 * 10**9, 8, 7 * 10**9 // 32, 2)
    print(f"7B on 8 GPUs: {need / 1e9:.1f} GB a GPU before activations; fits half of 80 GB: {need <= 40e9}")

# %% [markdown]
# ### Exercise 2 (09.pick_plan): which plan does "auto" pick on 2 hosts of 8 GPUs?
# Write `pick_plan(params, memory, devices, hosts)`. It returns `"replicate"`, `"hsdp"` or `"fsdp2"`, as
# `TrainConfig(parallel="auto")` does. `memory` is one device's, in bytes. Apply three rules in order:
#
# 1. Replicate, where a whole copy's state (16 B a weight) fits half of `memory`. The other half is for activations.
# 2. Else, on 2 hosts or more, hsdp, where a host's share fits half of `memory`. A host's share is the state split over
#    the `devices // hosts` GPUs of one host.
# 3. Else fsdp2.
#
# The checker draws one memory size, 40, 80, 96 or 141 GB a GPU. It then asks about 6 cases in a new order, each near
# one rule's boundary:
#
# - a model replicate fits, on 2 hosts of 8 GPUs;
# - the same model on 1 host of 8;
# - a model only hsdp fits, on 2 hosts;
# - the same model on 1 host, where hsdp is no choice;
# - a model neither fits;
# - a model whose state fits the whole memory but not half of it.
#
# Once it passes, the cell prints its pick for 1, 7 and 70 B weights on 2 hosts of 8 GPUs of 80 GB.

# %%
# your turn
def pick_plan(params, memory, devices, hosts):
    return ...


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():

    def pick_plan(params, memory, devices, hosts):
        if params * 16 <= memory / 2:
            return "replicate"
        if hosts > 1 and params * 16 / (devices // hosts) <= memory / 2:
            return "hsdp"
        return "fsdp2"


# %%
if exercises.check("09.pick_plan", lambda: nb09.check_pick_plan(pick_plan)):
    for b in (1, 7, 70):
        print(f"{b}B weights, 2 hosts x 8 GPUs of 80 GB:", pick_plan(b * 10**9, 80 * 10**9, 16, 2))

# %% [markdown]
# ### Exercise 3 (09.accumulate): gathered or sharded accumulation
# Write `accumulate_cost(mode, params, processes, k, n_layer)`. It returns a pair: the bytes a process holds through
# the accumulation window, and the all-gathers per optimizer step. The model is a GPT of `n_layer` blocks under fsdp2
# in float32, with k micro-batches a step. `mode` is `"gathered"` or `"sharded"`.
#
# Section 1's walk through one window gives both parts:
#
# - Both modes hold the shard: 16 B a weight over the processes, rounded down to whole bytes.
# - Gathered also holds the whole weights and the whole unreduced gradients, 4 B a weight each. It issues k = 1's
#   collectives.
# - Sharded issues k = 1's collectives for every micro-batch.
#
# The checker asks about 4 windows, drawn anew: 1 M to 10 B weights, 2 to 16 processes, k from 2 to 8, and 2, 12 or 32
# blocks. The run of section 2 is one case: 2 processes, k = 2, 2 blocks. Once your function passes, the cell compares
# its all-gathers with the ones counted there.

# %%
# your turn
def accumulate_cost(mode, params, processes, k, n_layer):
    return ...


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# solution (runs only with LABKIT_SOLUTIONS=1)
if exercises.solutions_on():

    def accumulate_cost(mode, params, processes, k, n_layer):
        shard = params * 16 // processes
        if mode == "gathered":
            return params * (4 + 4) + shard, 2 * n_layer
        return shard, k * (2 * n_layer)


# %%
if exercises.check("09.accumulate", lambda: nb09.check_accumulate(accumulate_cost)):
    for mode in ("gathered", "sharded"):
        _, gathers = accumulate_cost(mode, weights, N, K, cfg.n_layer)
        print(f"{mode}: {gathers} all-gathers a step predicted, {report[mode]['comm']['all-gather']:g} counted above")
        assert gathers == report[mode]["comm"]["all-gather"]

# %% [markdown]
# ## What you saw
# | | what it costs a process | checked here by |
# |---|---|---|
# | replicate (DDP) | a whole copy: 16 B a weight, about 20 B with DDP's gradient buckets; one all-reduce of the gradients a step | bytes and the all-reduce's size, counted |
# | fsdp2 | 16 B a weight / processes, plus one gathered unit; 2 L all-gathers, L + 1 reduce-scatters | bytes and collectives, counted |
# | accumulation, gathered | + whole weights and gradients for the window; k = 1's collectives | collectives counted; memory from the rule |
# | accumulation, sharded | the shard only; k times the collectives | collectives counted |
# | meta-device build | shards + the largest tensor at the peak; the same values | values and losses equal |
# | BatchNorm under bf16 | a float32 unit per block: 1 small all-gather and 1 reduce-scatter a step each | the dtype error, reproduced |
# | uneven evaluation | one 4-byte all-reduce a batch (`lockstep`) | read; tested in `tests/test_fsdp_resnet.py` |
# | preemption | one 20-byte all-reduce a step (`StepVote`: five int32 flags); 30 s before SIGKILL | one SIGTERM, a stop at that step on every process, one checkpoint |
# | hsdp | the host's shard; L + 1 all-reduces of gradient shards across hosts a step | predicted; counted in `tests/test_fsdp_trainer.py` |

# %%
passed = sum(exercises.results.get(n, False) for n in ("09.gpu_bytes", "09.pick_plan", "09.accumulate"))
print(f"exercises passed: {passed} of 3")
