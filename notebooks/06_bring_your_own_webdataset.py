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
# # Bring your own WebDataset, and see whether the chip is starving
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/labkit/labkit/blob/main/notebooks/06_bring_your_own_webdataset.ipynb)
#
# Notebook 01 trained on shards that labkit wrote itself: 32×32 images, with a manifest of counts and checksums. The
# datasets you bring next are WebDatasets that someone else wrote, with webdataset's `ShardWriter`, with `tarp`, or as
# a corpus on a hub. They hold photos of every size, labels in `cls`, `json` or `txt`, and no manifest. By the end you
# can:
#
# - write a WebDataset of real photos with webdataset's own `ShardWriter`;
# - stream any WebDataset into fixed-size batches with `make_loader(..., image_size=S)`, with labels from whichever
#   field holds them. Training gets random-resized crops, evaluation a centre crop.
# - read labkit's **feed meter**: the share of each step spent waiting for the next batch;
# - explain a run that is *input-bound*, then make it *compute-bound* by adding loader workers, with the arithmetic to
#   say how many.
#
# **Time**: 1–11 minutes of run time in fast mode on a 2-core CPU. On a quiet machine it takes about a minute. The
# feed-meter runs of section 3 take most of it, and a busy machine slows every step they time. When the load changes
# under them, they are measured again. Reading and the three exercises take 20–30 minutes.
#
# *Measured on: 2-core CPU, XLA:CPU, torch 2.9, fast mode: about 1 minute quiet with solutions on; 679 s unsolved,
# beside a dozen busy processes.*
#
# **In the course**: after 01; next: 02.
#
# **What carries over.** Four things are the same with TorchTPU, with JAX's Grain, or on a GPU. They are tar shards
# streamed in order, decoding on the host in worker processes, static batch shapes, and the question "is the chip
# waiting for data?".
# Only the device copy at the end differs. `torch_xla`'s `ParallelLoader`, inside `labkit.DeviceLoader`, is
# torch_xla's own.
#
# Every claim below is checked by an `assert`. The exercises print ✓ or ✗ and never stop *Run all*. Their solutions
# are in collapsed cells that run only with `LABKIT_SOLUTIONS=1`, as the test suite runs them.

# %% [markdown]
# ## Parameters

# %% tags=["parameters"]
import dataclasses, os, sys


@dataclasses.dataclass
class Params:
    photos: int = 480             # photos to write (crops of scikit-learn's two sample photos)
    per_shard: int = 40           # photos per shard: 12 shards, so that up to 12 workers each read their own
    size: int = 224               # the fixed size batches come out at (ImageNet's; CI runs 32 to keep the CPU quick)
    batch: int = 16               # photos per step
    steps: int = 20               # steps per feed-meter run, at most one epoch (photos // batch); a log every 4
    slowness: float = 4.0         # the slow link makes one worker this many times slower than a step
    seed: int = 0
    FAST = {"photos": 240, "per_shard": 20, "size": 32}  # CI-sized


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
# ## 1. Write a WebDataset of real photos
# A WebDataset is a set of plain tar files. The files of one sample share a key, such as `photo00042.jpg`,
# `photo00042.cls` and `photo00042.json`, and sit next to each other. So a shard can be read front to back from a
# bucket, with no index. webdataset's `ShardWriter` takes one dict per sample: `"__key__"`, plus one entry per file,
# named by its extension. It starts a new shard every `maxcount` samples.
#
# The photos: scikit-learn ships two real photos inside its wheel, a Chinese temple and a flower, as 640×427 JPEGs. So
# this works offline. `sample_photos` cuts them into many crops of 160–427 px a side. The label says which photo.

# %%
import io, math

import torch
from PIL import Image

from data_tools import make_loader
from data_tools.sources import sample_photos
from labkit.dashboard import INPUT_BOUND, feed_of
from labkit.lessons import exercises as ex
from labkit.lessons.exercises import nb06

rt = labkit.setup()
print(rt)
images, labels, CLASSES = sample_photos(P.photos, seed=P.seed)
sizes = sorted({im.shape[:2] for im in images})
print(f"{len(images)} photos, {sizes[0]} to {sizes[-1]} pixels (h, w), classes {CLASSES}")
assert len(sizes) > 50, "photos of many sizes"

# %% [markdown]
# **1. A sample for `ShardWriter`.** Write `to_sample(key, image, label, class_name)`. It returns a dict with four
# entries:
#
# - `"__key__"`: the key;
# - `"jpg"`: the photo as **JPEG bytes**. Encode the uint8 HWC array with Pillow, quality 90, uncropped.
# - `"cls"`: the class index;
# - `"json"`: the dict `{"photo": class_name}`.
#
# webdataset encodes ints and dicts by the extension.

# %%
def to_sample(key, image, label, class_name): ...  # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():

    def to_sample(key, image, label, class_name):
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="JPEG", quality=90)
        return {"__key__": key, "jpg": buf.getvalue(), "cls": label, "json": {"photo": class_name}}


# %%
ex.check("06.to_sample", lambda: nb06.check_to_sample(to_sample))

# %% [markdown]
# Now the whole dataset is written, with your function if it passed, else with the reference, so that *Run all* goes
# on. No manifest is written: this is a WebDataset as anyone would write it. The printout says whose writer ran, how
# many shards and MB it wrote, and the first files of the first shard: one key's `.cls`, `.jpg` and `.json` side by
# side.

# %%
write = to_sample if ex.results.get("06.to_sample") else nb06.reference_sample
folder = labkit.scratch("photos")  # a fresh folder; earlier runs' folders are removed
urls = nb06.write_reference(folder, images, labels, CLASSES, to_sample=write, per_shard=P.per_shard)
mb = sum(os.path.getsize(u) for u in urls) / 1e6
print("writer:", "yours" if write is to_sample else "the reference", f"| {len(urls)} shards, {mb:.1f} MB")
print(os.path.basename(urls[0]), "holds", [m for m in __import__("tarfile").open(urls[0]).getnames()[:3]], "...")
assert len(urls) == P.photos // P.per_shard and not os.path.exists(os.path.join(folder, "manifest.json"))

# %% [markdown]
# ## 2. Stream it at a fixed size
# On XLA every new input shape is a new graph, so the loader must turn photos of any size into one shape.
# `make_loader(urls, batch, train=True, image_size=S)` does what ImageNet training does. It takes a **random-resized
# crop**, 8–100 % of the photo's area with an aspect of 3:4 to 4:3, and resizes it to S×S. It also flips it
# horizontally where you allow it (`flip=True`). A mirrored temple is still a temple, but a mirrored digit is not a
# digit. So without a manifest the default is no flip.
#
# Every replica needs to yield the same number of batches, so the loader needs the sample counts. It finds them by
# reading the shards once and caches them; or pass `num_samples=`.
#
# Decoding is the host's big cost. labkit decodes a JPEG with torchvision's decoder. When the crop is at least 4× the
# output, it uses Pillow's reduced "draft" decode instead: each side 1/4 or 1/8, so 1/16 or 1/64 of the pixels. The
# figures are in `data_tools/transforms.py`, measured by `bench/bench_feed.py`.

# %%
train = make_loader(urls, P.batch, train=True, image_size=P.size, flip=True, seed=P.seed)
x, y = next(iter(train))
print(f"{len(train)} batches per epoch of x {tuple(x.shape)} {x.dtype}, y {y.tolist()}")
assert tuple(x.shape) == (P.batch, 3, P.size, P.size) and x.dtype == torch.float32
assert sorted(set(y.tolist())) <= [0, 1] and len(train) == P.photos // P.batch

import matplotlib.pyplot as plt

mean, std = torch.tensor(train.mean).view(3, 1, 1), torch.tensor(train.std).view(3, 1, 1)
fig, axes = plt.subplots(2, 8, figsize=(12, 3.4))
for ax, img, lab in zip(axes.flat, x, y):
    ax.imshow((img * std + mean).clamp(0, 1).permute(1, 2, 0).numpy())
    ax.set_title(CLASSES[lab], fontsize=8)
    ax.axis("off")
fig.suptitle(f"a training batch: photos of any size, random-resized crops at {P.size}x{P.size}")
plt.show()

# %% [markdown]
# The line gives the batches per epoch, the batch's shape and dtype, and its labels. Every batch has the one shape the
# step was compiled for, whatever the photos' sizes. The figure shows one batch: crops of different parts and scales of
# the two photos, each resized to the same square.

# %% [markdown]
# A `transform=` argument takes your own pipeline instead, e.g. torchvision's v2 transforms. It receives the decoded
# PIL image, and it must return one shape every time:

# %%
from torchvision.transforms import v2

mine = v2.Compose([v2.RandomResizedCrop(P.size, scale=(0.3, 1.0), antialias=True), v2.PILToTensor()])
xt, _ = next(iter(make_loader(urls, P.batch, train=True, transform=mine)))
assert tuple(xt.shape) == (P.batch, 3, P.size, P.size)

# %% [markdown]
# **2. An evaluation loader.** Write `eval_loader(urls, batch_size, size)`. It gives evaluation batches at
# `size`×`size`: the shorter side resized, then the centre crop, so every pass gives the same batches. Every photo comes
# once, with the last batch padded. The labels are read from the json's `"photo"` field, a class **name**: use
# `label="json:photo"` and `classes=CLASSES`. The checker's shards have no `cls` at all.

# %%
def eval_loader(urls, batch_size, size): ...  # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():

    def eval_loader(urls, batch_size, size):
        return make_loader(urls, batch_size, train=False, image_size=size, label="json:photo", classes=CLASSES)


# %%
ex.check("06.eval_loader", lambda: nb06.check_eval_loader(eval_loader))

# %% [markdown]
# ## 3. Is the chip starving? The feed meter
# Every step, labkit's Trainer reads the host clock around `next(batch)`. That is two clock reads and no device sync.
# Each log record then says three things:
#
# - `data_wait_s`: how long a step waited for its batch;
# - `step_s`: how long the whole step took;
# - `data_wait_frac`: the share of the step spent waiting.
#
# The dashboard shows it: "data wait 62%" in the console line. Where the dashboard draws its figure, the share is also
# a dotted purple curve on the examples/s panel, read on that panel's right-hand axis. In console mode
# (`LABKIT_CONSOLE=1`, as in CI) there is no figure, only the line. The dashboard says **input-bound** when the share
# passes 25 %. `labkit.explain(dash)` says it for the whole run.
#
# First the model on its own: a small ResNet, torchvision's with one block per stage, fed from batches already in
# memory. Data then costs nothing. Its step time is what the loader has to keep up with.
#
# Where the model runs on the CPU, with no accelerator, its math and the loader's workers share the host's cores.
# PyTorch's intra-op pool takes every core by default. Its threads wait for each other at every op, so when another
# process holds a core, a step stalls. On an accelerator the model's math runs on the chip, and the host's cores are
# all the loader's. So on the CPU the model gets half the cores, and the workers the rest.
#
# *Measured on: a 2-core machine, this model's 35 ms step beside two busy processes. 2 threads: median 95 ms,
# outliers of 1.8 s. 1 thread: 50 ms, none above 94 ms.*

# %%
from torchvision.models.resnet import BasicBlock, ResNet

import labkit
from labkit import Dashboard, TrainConfig, Trainer

if rt.device.type == "cpu":
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
print(f"the model runs on {rt.device}; host threads for its ops: {torch.get_num_threads()}")


def fit(loader, title):
    torch.manual_seed(P.seed)
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=len(CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    dash = Dashboard(title=title, controls=False, chance=0.5)
    cfg = TrainConfig(epochs=1, max_steps=P.steps, log_every=4, eval_every=0)
    Trainer(model, opt, rt, cfg, loader, callbacks=[dash]).fit()
    return dash


in_memory = [b for _, b in zip(range(P.steps), train)]  # decoded once, before training
free = fit(in_memory, "data in memory")
step_s = min(r["step_s"] for r in free.history[1:])  # the least disturbed interval after the compiles
assert feed_of(free) is not None, "the feed meter measured the wait"
print(f"a step takes {step_s * 1e3:.0f} ms with data in memory; waiting: {feed_of(free)['data_wait_frac']:.0%}")

# %% [markdown]
# The first line says where the model runs, and how many host threads its ops get. On XLA two `[labkit]` lines follow.
# The first gives the memory format the runtime chose for the model. The second says that a background thread copies
# batches to the device a few steps ahead, so that a copy never holds up the loop. The last line is the step time with
# data in memory, and its small wait. That step time is the pace the loader must keep.
#
# On a busy machine the wait can be larger: the step then waits for the host's cores, not for data. The dashboard knows
# the batches were in memory, so it never advises more workers for this run.

# %% [markdown]
# Now stream from a **slow link**. Every photo takes `slow.delay_s` seconds to arrive before it is decoded. That is a
# sleep, as a remote bucket's latency would cost. It uses no CPU, so the experiment works the same on a 2-core machine,
# where the model and real decoders would fight over the same cores. The delay makes one loader `P.slowness` times
# slower than a step. Then add workers: each DataLoader worker process reads its own shards and builds whole batches.
#
# Timing is noisy. The step time measured above holds only while nothing else takes the model's cores, and on a small
# host the loader's own workers do. So runs that are compared are measured side by side. Each run also says how long
# its steps computed: the step minus the wait. When that is more than 2x off the step time the delay was set from, the
# runs are measured again, and the notebook says so.

# %%
slow = nb06.SlowLink(v2.Compose([v2.RandomResizedCrop(P.size, antialias=True), v2.PILToTensor()]), delay_s=0.0)


def stream(workers):
    return make_loader(urls, P.batch, train=True, transform=slow, flip=True, num_workers=workers, seed=P.seed)


def busy_s(feed):  # the part of a step not spent waiting: the pace the loader has to keep up with
    return feed["step_s"] - feed["data_wait_s"]


def feed_runs(worker_counts, tries=3):
    """One run per worker count, side by side, with the slow link set from `step_s`. The model's step time
    can change between the measurement of `step_s` and these runs (a shared machine's other work, or on a
    small host the workers' own decoding takes cores from the model): when a run's busy time is more than 2x
    off `step_s`, the premise of the experiment is gone, so `step_s` is taken from what the runs measured and
    all of them run again (said; the last of `tries` stands). Returns the dashboards and whether the premise held."""
    global step_s
    for attempt in range(tries):
        slow.delay_s = P.slowness * step_s / P.batch  # seconds per photo: one loader is P.slowness x too slow
        dashes = {w: fit(stream(w), f"{w} workers") for w in worker_counts}
        busy = sorted(busy_s(feed_of(d)) for d in dashes.values())
        if all(0.5 <= b / step_s <= 2 for b in busy) or attempt == tries - 1:
            return dashes, all(0.5 <= b / step_s <= 2 for b in busy)
        print(f"the steps computed in {busy[0] * 1e3:.0f}-{busy[-1] * 1e3:.0f} ms, not the {step_s * 1e3:.0f} ms "
              "the delay was set from (other work, or the workers themselves, took cores from the model): "
              "measuring again with the delay set from these")
        step_s = busy[len(busy) // 2]


dashes, premise = feed_runs([0, 2])
runs = {w: feed_of(d) for w, d in dashes.items()}
for workers, r in runs.items():
    print(f"{workers} workers: {r['data_wait_frac']:.0%} of the step waiting for data")
if premise:  # a batch's link alone takes 4 steps; the step computed in at most 2: it waits at least half of each step
    assert runs[0]["data_wait_frac"] >= INPUT_BOUND, "one loader several times slower than the step: input-bound"
else:
    print("this machine's speed changed too much between the runs to compare them: the figures are for reading only")

# %% [markdown]
# Each line is one run: its workers and the share of each step spent waiting. One loader is input-bound, as the assert
# says. The assert runs only when the steps computed at the pace the delay was set from. A machine too busy for that
# gets a line that says so instead.
#
# Two workers may look almost fine here. In a short run the loader's queues fill while the first step compiles: two
# batches per worker, and DeviceLoader's own. A run of `P.steps` steps, capped at one epoch, barely drains them: in fast
# mode's 15 steps, 4 log intervals. A longer run shows the deficit. In a 40-step run on this machine, 2 workers waited
# 50–80 % of every interval after the first, 4 about half, and 8 almost never.
#
# The exception was each epoch's start. The DataLoader starts its worker processes anew, since
# `persistent_workers=False` is PyTorch's default, and the chip waited about half a second.
# `make_loader(..., persistent_workers=True)` keeps them. `set_epoch()` still reaches them, since the epoch is a shared
# value (tested). So each epoch reshuffles as with fresh workers. How much of that half second it saves was not
# measured here.
#
# **3. How many workers?** One worker builds a batch in `sample_s × batch_size` seconds, one sample after another.
# Write `workers_needed(sample_s, batch_size, step_s)`: the fewest workers that, side by side, deliver a batch every
# `step_s` seconds, and at least 1.

# %%
def workers_needed(sample_s, batch_size, step_s): ...  # your code


# %% colab={"cellView": "form"} jupyter={"source_hidden": true} tags=["solution"]
# @title Solution (collapsed: click to show; runs only with LABKIT_SOLUTIONS=1)
if ex.solutions_on():
    import math

    def workers_needed(sample_s, batch_size, step_s):
        return max(1, math.ceil(round(sample_s * batch_size / step_s, 9)))


# %%
ex.check("06.workers", lambda: nb06.check_workers_needed(workers_needed))

# %% [markdown]
# With just enough workers, the loader only keeps pace on average. Worker start-up and jitter still leave steps
# waiting. So the cell gives it twice what the arithmetic says: your answer if it passed, else the reference. Then it
# runs beside a fresh run with one loader, and the meter goes quiet.
#
# On XLA the host runs ahead of the device. The batch's upload can queue behind the previous step's execution. So a
# compute-bound run still shows a little wait, which is why the meter speaks only above 25 %.
#
# The arithmetic counts the link alone. The cell also times the host's own work per photo. Sometimes even the doubled
# workers cannot deliver a batch per step: a GPU's step of a few ms is one case, as one shard per worker runs out first.
# The cell then says so. Either way it prints the meter's verdict. A busy machine can flip that verdict. So the cell
# checks what it cannot flip: when the steps kept their pace, the wait fell and the steps got faster.

# %%
import time

link_s, slow.delay_s = slow.delay_s, 0.0  # time the host's own part first: reading, decoding and cropping a photo
t0 = time.perf_counter()
_ = [b for _, b in zip(range(2), stream(0))]
photo_s, slow.delay_s = (time.perf_counter() - t0) / (2 * P.batch), link_s
need = workers_needed(slow.delay_s, P.batch, step_s) if ex.results.get("06.workers") else math.ceil(P.slowness)
many = min(2 * need, len(urls))  # every worker needs a shard of its own
print(f"{slow.delay_s * 1e3:.0f} ms per photo x {P.batch} photos, {step_s * 1e3:.0f} ms per step: {need} workers needed")
dashes, premise = feed_runs([0, many])  # measured again beside one loader, so that the two compare
dash = dashes[many]
runs.update({w: feed_of(d) for w, d in dashes.items()})
for w, r in runs.items():
    print(f"{w:2d} workers: {r['data_wait_frac']:5.0%} waiting, {r['step_s'] * 1e3:5.0f} ms per step")
per_batch = (slow.delay_s + photo_s) * P.batch  # one worker's time for a batch: the link, then the decode
verdict = "input-bound" if runs[many]["data_wait_frac"] >= INPUT_BOUND else "compute-bound"
if many * step_s >= per_batch:  # the workers can deliver a batch per step
    print(f"{many} workers can deliver a batch per step; the meter's verdict: {verdict}")
else:
    print(f"{many} workers (one per shard) cannot keep up with a {step_s * 1e3:.0f} ms step: each needs "
          f"{per_batch * 1e3:.0f} ms per batch ({photo_s * 1e3:.1f} ms per photo of host work besides the link). "
          "A chip this fast needs more shards and workers, or photos stored near the size it trains at")
if premise:  # the link alone makes one loader's batch 4 steps long: the workers' runs wait less, and step faster
    assert runs[many]["data_wait_frac"] < runs[0]["data_wait_frac"], "more workers, less waiting"
    assert runs[many]["step_s"] < runs[0]["step_s"], "and every step is faster"
else:
    print("this machine's speed changed too much between the runs to compare them: the figures are for reading only")
info = labkit.explain(dash)

# %% [markdown]
# While the runs with many workers start, torch may print a `UserWarning`: "This DataLoader will create 8 worker
# processes in total. Our suggested max number of worker in current system is 2". torch compares the workers with the
# host's cores and warns above them. Here that is on purpose. The workers mostly sleep on the slow link, so they use
# little CPU, and each reads its own shard. With real decoding, workers beyond the cores would only take turns on them.
#
# The table lists every run so far: the workers, the share of the step spent waiting, and the ms per step. The run with
# the most workers waits least, and its steps are the fastest. The last lines are `labkit.explain`'s verdict on that
# run. Its "0 graphs compiled" is no fault: the earlier runs in this kernel had compiled the step already, and this
# run reused their graphs.

# %% [markdown]
# ## What carries over
# * Any backend: WebDataset tar shards, decoding in worker processes, fixed-size batches, and the feed meter's
#   question. On a real TPU host the decode itself is the slow link. `bench/bench_feed.py` measures images/s per host
#   core, about 600–900 at 224 px here. It also says how many cores one chip would need at a stated demand.
# * torch_xla's: `ParallelLoader`, the device copy inside `labkit.DeviceLoader`. TorchTPU and JAX have their own device
#   prefetch; the host side is unchanged.
# * Next: pre-resize your shards near the training size. Decoding a 4000-px phone photo to train at 224 wastes most of
#   the decode. Then split the shards across hosts. Under SPMD one process per host feeds all its chips. So labkit
#   splits by hosts, `xr.process_index()` and `xr.process_count()`, not by chips (`xr.global_ordinal()`). `make_loader`
#   does it for you.
