"""The pieces notebooks 01/02 and `python -m labkit.train` share: data, model, optimizer, schedule.

    from labkit.lessons import recipes
    manifests = recipes.image_shards("digits", "data/shards")        # written once, reused after
    train, val = recipes.image_loaders(manifests, plan, rt, num_workers=2, seed=0)
    model, opt = recipes.build_resnet(10, cifar_stem=True, optimizer="sgd", lr=0.1, seed=0, rt=rt)

One home for each recipe: a notebook calls the same function the script calls, so a lesson and a
pod run train the same model on the same data. Each function is a few lines on purpose: the
notebook text explains the steps, this file keeps them from drifting apart.
"""

from __future__ import annotations

import functools
import os

import torch

from labkit.optim import warmup_cosine


# -- images (notebook 01) --------------------------------------------------------------------------
def local_gcs_root(data_dir: str, server=None, server_root: str = "data/local-gcs"):
    """(server, gs:// data root): a GCS-API server on 127.0.0.1 (started unless `server` is one already
    running) with the bucket labkit-local. The server sets STORAGE_EMULATOR_HOST, so labkit.cloud.gcs and
    data_tools talk to it as they would to Google."""
    from labkit.cloud import gcs
    from labkit.cloud.emulator import LocalGCSServer

    own = server is None
    server = server or LocalGCSServer(root=os.path.abspath(server_root)).start()
    try:
        if gcs.client().lookup_bucket("labkit-local") is None:
            gcs.client().create_bucket("labkit-local")
    except BaseException:
        if own:  # started here and not handed back: stopped here
            server.close()
        raise
    return server, "gs://labkit-local/" + data_dir.strip("/").replace("/", "-")


def image_shards(source: str, data_root: str, upsample: int = 1, samples_per_shard: int = 2500) -> dict:
    """{split: manifest.json URL} for train and val under data_root/SOURCE-xUPSAMPLE/, writing the
    WebDataset shards only when no manifest of that source and split is there yet."""
    from data_tools import load_manifest, write_dataset

    manifests = {}
    for split in ("train", "val"):
        out = f"{data_root}/{source}-x{upsample}/{split}"
        try:  # already written (an earlier run): reuse it
            m = load_manifest(f"{out}/manifest.json")
            if m.get("source") != source or m.get("split") != split:
                raise ValueError(f"{out}/manifest.json holds {m.get('source')}/{m.get('split')}")
        except (FileNotFoundError, ValueError):
            write_dataset(source, split, out, upsample=upsample, samples_per_shard=samples_per_shard)
        manifests[split] = f"{out}/manifest.json"
    return manifests


def image_loaders(manifests: dict, plan, rt, num_workers: int = 0, seed: int = 0):
    """(train, val) shard loaders yielding plan.host_batch images. Shards are dealt to this process by
    the backend's data split: a TPU pod host (xr.process_index / process_count) or a torchrun rank."""
    from data_tools import make_loader

    rank, world = rt.data_split()
    split = {"rank": rank, "world_size": world}
    train = make_loader(manifests["train"], plan.host_batch, train=True, num_workers=num_workers, seed=seed, **split)
    val = make_loader(
        manifests["val"], plan.host_batch, train=False, num_workers=num_workers, mean=train.mean, std=train.std, **split
    )
    return train, val


def build_resnet(num_classes: int, cifar_stem: bool, optimizer: str, lr: float, seed: int, rt, meta: bool = False):
    """A fresh ResNet-50 (seeded) and its optimizer: SGD+Nesterov or AdamW (capturable on XLA). meta: built on the
    meta device (labkit.meta_init), given memory (only its shards) by the Trainer's plan."""
    from labkit import meta_init
    from labkit.models.resnet import image_optimizer, resnet50_cifar

    torch.manual_seed(seed)
    make = functools.partial(resnet50_cifar, num_classes=num_classes, cifar_stem=cifar_stem)
    model = meta_init.build(make, seed) if meta else make()
    return model, image_optimizer(model, optimizer, lr, xla=rt.capturable_optimizers, fused=rt.fused_optimizers)


def resnet_schedule(optimizer, total: int):
    """Linear warm-up over the first 10% of steps, cosine to 2% at `total`, flat after it."""
    return warmup_cosine(optimizer, warmup=max(1, total // 10), total=total, floor=0.02)


# -- text (notebook 02) ----------------------------------------------------------------------------
def text_batches(train_data, val_data, plan, rt, *, block_size, steps_per_eval, eval_batches, seed, name):
    """(train, val) TextBatches of plan.host_batch windows. shared_order: a step's windows depend on the
    global batch only, so one process, SPMD and torchrun ranks train on the same data."""
    from data_tools.text import TextBatches

    rank, world = rt.data_split()
    split = {"rank": rank, "world_size": world, "name": name, "shared_order": True}
    train = TextBatches(train_data, plan.host_batch, block_size, steps_per_eval, seed=seed, **split)
    val = TextBatches(val_data, plan.host_batch, block_size, eval_batches, seed=seed + 1, fixed=True, **split)
    return train, val


def build_gpt(gcfg, lr: float, weight_decay: float, max_steps: int, seed: int, rt, meta: bool = False):
    """(model, optimizer, scheduler): the GPT seeded on host and device, AdamW with decay on matrices
    (capturable on XLA), warm-up over 5% of the steps and cosine to 10%. meta: built on the meta device
    (labkit.meta_init), given memory (only its shards) by the Trainer's plan."""
    from labkit import meta_init
    from labkit.models.gpt import GPT, adamw

    rt.manual_seed(seed)
    torch.manual_seed(seed)
    model = meta_init.build(functools.partial(GPT, gcfg), seed) if meta else GPT(gcfg)
    optimizer = adamw(model, lr, weight_decay, betas=(0.9, 0.95), rt=rt)
    scheduler = warmup_cosine(optimizer, warmup=max(1, max_steps // 20), total=max_steps, floor=0.1)
    return model, optimizer, scheduler


def load_text(source: str) -> tuple[str, bytes]:
    """(name, bytes) of a corpus: 'auto' is tiny-shakespeare when it can be downloaded, else the
    offline text; 'offline', 'shakespeare' or a file path otherwise (see data_tools.text)."""
    from data_tools import text

    if source == "auto":
        try:
            return "shakespeare", text.load_corpus("shakespeare")
        except ConnectionError as e:
            print("offline:", str(e).split(":")[0], "- using the bundled text instead")
            source = "offline"
    return source, text.load_corpus(source)
