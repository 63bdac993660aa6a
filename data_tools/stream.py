"""Stream tar shards (local, gs://, http) into static-shape batches, split over replicas and workers.

    from data_tools import make_loader        # data_tools.loader: the DataLoader around ShardStream
    train = make_loader("gs://bucket/cifar/train/manifest.json", 128, train=True, num_workers=2)
    val = make_loader("/data/cifar/val/manifest.json", 256, train=False, mean=train.mean, std=train.std)
    for epoch in range(3):
        train.set_epoch(epoch)                 # labkit's Trainer does this for you
        for x, y in labkit.DeviceLoader(train, rt): ...   # x float32 NCHW normalised, y int64

Distribution is explicit (see data_tools.plan): shards are dealt round-robin to replicas (the node
splitter, by torch_xla's global ordinal) and then to DataLoader workers (the worker splitter); training
permutes shard order first (shardshuffle, seeded by seed and epoch). Pipeline: our tar reader
(data_tools.tario) -> webdataset's group_by_keys -> its shuffle -> decode/augment -> its batched.

Training: every replica yields exactly floor(samples / (world * batch)) full batches per epoch, the
same number everywhere (collectives stay in step, shapes stay static). A worker whose shards hold
fewer samples than its share reads them again (re-shuffled); extra samples are left for the next
epoch's shuffle. Shard order is a permutation seeded by (seed, epoch), the sample shuffle buffer by
(seed, epoch, rank, worker): the same seed, epoch, world size and num_workers give the same batches.
Iterating again without set_epoch() advances the epoch by itself. Augmentation: a random crop of the
image padded by `crop_padding`, a horizontal flip where the manifest allows it ("hflip"; `flip=`).
Any WebDataset (no labkit manifest): `image_size=`, `label=`, `classes=`, `transform=` (data_tools.loader).

Evaluation: each replica reads its shards once, in order. Every sample is seen exactly once across
replicas. `last_batch="pad"` (default) pads each worker's last batch to full size with zero images
and label -100 (PyTorch's cross_entropy ignore_index), keeping shapes static; count real samples
with `(y >= 0).sum()`. "partial" yields the smaller batch (a recompile on XLA), "drop" drops it
(labkit.Trainer's eval_step counts labels >= 0). Replicas may get different numbers of eval batches.

Bad data raises with the shard URL (and key): ShardError for a corrupt/truncated tar, a sample without
its label field or image, a label that is no class or outside the manifest's classes, an undecodable
image, a sha256 mismatch, or a shard from another write than its manifest's (data_tools.writer);
FileNotFoundError for a missing shard; OSError (ConnectionError, TimeoutError) for I/O that failed after
bounded retries (data_tools.urls). verify="stream" (default) hashes each shard as its bytes pass (no
second read; bench/bench_data.py has the cost) and raises at the shard's end, when its samples are
already on their way; verify=True reads each shard whole and checks it before yielding from it.
skip_corrupt=True skips corrupt samples instead (never I/O failures, never a shard of another write)
and counts them in `loader.skipped` (shared with worker processes; a sample met again in a later pass
counts again); a streamed sha256 mismatch is then a warning.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import numbers
import os
import random

import numpy as np
import torch
import webdataset as wds

from .manifest import ShardError, load_manifest
from .plan import allocate, expand_urls, resolve_replica, split_round_robin
from .shard_reader import count_samples, read_shard  # noqa: F401  (count_samples: also public here)
from .sources import HFLIP
from .transforms import (
    CROP_SCALE,
    IMAGE_FIELDS,
    IMAGENET_MEAN,
    IMAGENET_STD,
    as_chw,
    augment,
    check_crop_scale,
    check_image_size,
    class_index,
    decode_image,
    fit_image,
    parse_label,
    rgb_image,
    scale_stats,
    to_batch,
)
from .urls import DEFAULT_TIMEOUT, redact, register_webdataset, sibling

PAD_LABEL = -100  # F.cross_entropy's default ignore_index
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class ShardStream(torch.utils.data.IterableDataset):
    """The webdataset pipeline of one replica: shards -> samples -> shuffle -> decode -> batches."""

    def __init__(
        self,
        source,
        batch_size: int,
        *,
        train: bool,
        rank=None,
        world_size=None,
        num_workers: int = 0,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        verify: bool | str = "stream",
        skip_corrupt: bool = False,
        num_samples: int | None = None,
        mean=None,
        std=None,
        last_batch: str = "pad",
        return_keys: bool = False,
        augment: bool = True,
        crop_padding: int = 4,
        flip: bool | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        image_size=None,
        label: str = "cls",
        classes=None,
        transform=None,
        crop_scale=CROP_SCALE,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: expected an integer >= 1 (True is not a batch size)")
        if last_batch not in ("pad", "partial", "drop"):
            raise ValueError(f"last_batch must be 'pad', 'partial' or 'drop', got {last_batch!r}")
        if verify not in (True, False, "stream"):
            raise ValueError(f"verify must be True (whole shard first), 'stream' or False, got {verify!r}")
        register_webdataset()
        self.timeout = float(timeout)
        self.manifest = self._find_manifest(source, self.timeout)
        if self.manifest is not None and (isinstance(source, str) and source.endswith(".json")):
            self.urls = list(self.manifest["urls"])
        else:
            self.urls = expand_urls(source)
        self.entries = self._entries()
        self.batch_size, self.train, self.seed = int(batch_size), bool(train), int(seed)
        self.rank, self.world_size = resolve_replica(rank, world_size)
        self.dataloader_workers = int(num_workers)
        self.num_workers = max(1, int(num_workers))  # readers per replica (the main process when 0)
        self.shuffle_buffer, self.verify, self.skip_corrupt = int(shuffle_buffer), verify, skip_corrupt
        self.last_batch, self.return_keys = last_batch, return_keys
        self.augment, self.crop_padding = augment and train, int(crop_padding)
        m = self.manifest or {}
        # photos at a size of our choosing (image_size=) or through the caller's transform, else the stored size
        self.resize, image_size = image_size is not None, check_image_size(image_size)
        self.image_size = image_size if self.resize else tuple(m.get("image_size", (32, 32)))
        self.transform, self.crop_scale, self.label = transform, check_crop_scale(crop_scale), str(label)
        self._shape = (3, *self.image_size) if self.resize else None  # what a user transform must return
        photo_mean, photo_std = (IMAGENET_MEAN, IMAGENET_STD) if self.resize else (CIFAR_MEAN, CIFAR_STD)
        self.mean = tuple(mean if mean is not None else m.get("mean", photo_mean))
        self.std = tuple(std if std is not None else m.get("std", photo_std))
        names = list(classes) if classes is not None else m.get("class_names")
        self.class_index = class_index(classes if isinstance(classes, dict) else names or [])
        self.class_names = names
        # horizontal flips only where a mirror image keeps its label: the manifest says (CIFAR-10 yes,
        # digits no); a manifest written before it said so: by its source; no manifest: no flips
        self.flip = bool(flip if flip is not None else m.get("hflip", HFLIP.get(m.get("source"), False)))
        self.generation = m.get("generation")
        self.num_classes = m.get("num_classes") or (max(self.class_index.values()) + 1 if classes else None)
        self._decoded = 0  # per process: detects a pass with nothing readable
        # shared with DataLoader workers (other processes): the skips they count, and the epoch, which persistent
        # workers (they keep their copy of this object between epochs) read at each epoch's start
        self._skipped, self._epoch = mp.Value("q", 0), mp.Value("q", 0)
        S, R, W = len(self.urls), self.world_size, self.num_workers
        if S < R * W:
            raise ValueError(
                f"{S} shard(s) for {R} replica(s) x {W} worker(s) = {R * W} readers: every reader needs "
                f"at least one shard (write smaller shards or use fewer workers) [{redact(self.urls[0])} ...]"
            )
        counts = [e["samples"] if e else None for e in self.entries]
        if None in counts:  # training needs the count: every replica must yield the same number of batches
            if num_samples is None and train:
                counts = count_samples(self.urls, self.timeout)
            else:
                counts = [num_samples / S] * S if num_samples is not None else None
        self.counts = counts
        self.num_samples = int(round(sum(counts))) if counts else None
        if train:
            self.batches_per_epoch = self.num_samples // (R * self.batch_size)
            if self.batches_per_epoch == 0:
                raise ValueError(
                    f"{self.num_samples} samples cannot fill one batch of {self.batch_size} on each of "
                    f"{R} replica(s); lower batch_size"
                )

    # -- setup helpers --------------------------------------------------------------------
    @staticmethod
    def _find_manifest(source, timeout):
        if isinstance(source, dict):
            raise TypeError("pass the manifest's path or URL, not the dict (shard URLs are relative to it)")
        if isinstance(source, (str, os.PathLike)):
            source = os.fspath(source)
            if source.endswith((".json", "/")) or os.path.isdir(source):  # a folder: load_manifest says so
                return load_manifest(source, timeout)
        urls = expand_urls(source)
        try:  # a manifest beside the shards gives sample counts and mean/std
            return load_manifest(sibling(urls[0], "manifest.json"), timeout)
        except ShardError:  # ours, but names a shard outside its folder: never quietly ignored
            raise
        except (FileNotFoundError, ValueError):  # none there, or not ours; network failures do raise
            return None

    def _entries(self) -> list:
        by_url = dict(zip(self.manifest["urls"], self.manifest["shards"])) if self.manifest else {}
        return [by_url.get(u) for u in self.urls]

    @property
    def skipped(self) -> int:
        """Corrupt samples skipped so far (skip_corrupt=True), summed over workers."""
        return int(self._skipped.value)

    # the epoch lives in shared memory (see __init__): read and set as a plain int
    epoch = property(lambda self: int(self._epoch.value), lambda self, e: setattr(self._epoch, "value", int(e)))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.train:
            return self.batches_per_epoch
        if self.counts is None:
            raise TypeError("length unknown: no manifest and no num_samples")
        n = 0
        for w in range(self.num_workers):
            k = sum(self.counts[i] for i in self._worker_shards(w))
            n += math.floor(k / self.batch_size) if self.last_batch == "drop" else math.ceil(k / self.batch_size)
        return int(n)

    # -- the plan: which shards this replica/worker reads -----------------------------------------
    def _replica_shards(self) -> list[int]:
        order = list(range(len(self.urls)))
        if self.train:  # shardshuffle: the same permutation on every replica, new each epoch
            order = list(np.random.default_rng([self.seed, self.epoch]).permutation(len(order)))
        return split_round_robin(order, self.rank, self.world_size)  # node splitter

    def _worker_shards(self, worker: int) -> list[int]:
        return split_round_robin(self._replica_shards(), worker, self.num_workers)  # worker splitter

    def _worker_batches(self, worker: int) -> int:
        """Train: this worker's share of batches_per_epoch, proportional to the samples it holds."""
        per = [sum(self.counts[i] for i in self._worker_shards(w)) for w in range(self.num_workers)]
        return allocate(self.batches_per_epoch, per)[worker]

    # -- pipeline stages ----------------------------------------------------------------------------
    def _count_skip(self, n: int = 1) -> None:
        with self._skipped.get_lock():
            self._skipped.value += n

    def _read_tar(self, idx: int):
        """Samples of one shard, checked against its manifest entry (data_tools.shard_reader)."""
        return read_shard(
            self.urls[idx],
            self.entries[idx],
            generation=self.generation,
            verify=self.verify,
            timeout=self.timeout,
            skip_corrupt=self.skip_corrupt,
            count_skip=self._count_skip,
        )

    def _samples(self, worker: int):
        """Raw samples of this worker: evaluation reads its shards once, training cycles them until its batch quota
        is met. A pass that gives nothing readable (empty shards, folders only, every sample skipped) is an error."""
        shards = self._worker_shards(worker)
        # Training: endless passes; the quota stops the pipeline, so a pass is only started when needed and
        # samples skipped as corrupt are made up for from the next pass. webdataset's shuffle
        # flushes its buffer at the end of its input: a pass never leaks into the next one.
        for p in itertools.count():
            seed = np.random.SeedSequence([self.seed, self.epoch, self.rank, worker, p]).generate_state(2)
            rng = random.Random(int(seed[0]) << 32 | int(seed[1]))
            order = shards if p == 0 else rng.sample(shards, len(shards))
            before = self._decoded
            samples = (s for i in order for s in self._read_tar(i))
            shuffle = self.train and self.shuffle_buffer > 1
            yield from (
                wds.filters._shuffle(samples, self.shuffle_buffer, self.shuffle_buffer, rng) if shuffle else samples
            )
            if self._decoded == before:
                what = "" if self.train else " to evaluate (empty, or folders only?)"
                raise ShardError(f"no readable samples{what} in shards {[redact(self.urls[i]) for i in shards]}")
            if not self.train:
                return

    def _decode(self, samples, rng):
        for s in samples:
            url, key = redact(s["__url__"]), s["__key__"]
            try:
                img, label = self._sample(s, url, key, rng)
            except ShardError:
                if not self.skip_corrupt:
                    raise
                self._count_skip()
                continue
            self._decoded += 1
            yield img, label, key

    def _sample(self, s, url, key, rng):
        """One sample -> (image, label), or a ShardError naming the shard and the key."""
        field = self.label.partition(":")[0]
        ext = next((e for e in IMAGE_FIELDS if e in s), None)
        if field not in s or ext is None:
            what = f"no {field!r} field" if field not in s else f"no image ({'/'.join(IMAGE_FIELDS)}) field"
            raise ShardError(
                f"shard {url}: sample {key!r} has {what} (fields: {sorted(k for k in s if not k.startswith('__'))})"
            )
        try:
            label = parse_label(s, self.label, self.class_index)
        except (ValueError, KeyError, TypeError) as e:
            raise ShardError(f"shard {url}: sample {key!r}: {e}") from None
        k = self.num_classes
        if not (0 <= label < k if k else label >= 0):  # -100 would be taken for padding
            raise ShardError(
                f"shard {url}: sample {key!r} has label {label}, outside "
                + (f"0..{k - 1} ({k} classes)" if k else "0.. (no manifest, no classes)")
            )
        try:  # the header's size is checked before any pixel is decoded (a PNG may claim gigapixels)
            return self._image(s[ext], rng, ext), label
        except Exception as e:
            raise ShardError(f"shard {url}: sample {key!r} cannot be decoded: {e} (field {ext!r})") from e

    def _image(self, data: bytes, rng, field: str):
        if self.transform is not None:  # the caller's pipeline: its output must keep one shape
            x = as_chw(self.transform(rgb_image(data, field)))
            self._shape = self._shape or tuple(x.shape)
            if tuple(x.shape) != self._shape:
                raise ValueError(f"transform gave shape {tuple(x.shape)}, expected {self._shape} (static shapes)")
            return x
        if self.resize:  # any stored size -> image_size (ImageNet recipe)
            kw = dict(train=self.augment, flip=self.flip, scale=self.crop_scale, field=field)
            return fit_image(data, self.image_size, rng, **kw)
        img = decode_image(data, size=self.image_size, field=field)  # labkit's own shards: one stored size
        return augment(img, rng, self.crop_padding, flip=self.flip) if self.augment else img

    def _collate(self, items):
        x, y = to_batch([b[0] for b in items], [b[1] for b in items], *self._stats)
        n = self.batch_size - len(items)
        if n and self.last_batch == "pad":  # static shapes: zero images, label -100 (ignored by the loss)
            x = torch.cat([x, torch.zeros((n,) + tuple(x.shape[1:]))])
            y = torch.cat([y, torch.full((n,), PAD_LABEL, dtype=torch.int64)])
        return (x, y, [b[2] for b in items] + [""] * n) if self.return_keys else (x, y)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, nw = (info.id, info.num_workers) if info else (0, 1)
        if nw != self.num_workers:
            raise RuntimeError(
                f"ShardStream was planned for {self.num_workers} worker(s) but runs in {nw}; "
                "pass the DataLoader's num_workers to make_loader"
            )
        self._stats = scale_stats(self.mean, self.std)
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, 1 << 20])
        # training takes exactly its quota of samples before batching: webdataset's batched() looks one
        # sample ahead, which past the quota would start another pass over the shards for nothing
        take = (
            (lambda it: itertools.islice(it, self._worker_batches(worker) * self.batch_size))
            if self.train
            else (lambda it: it)
        )
        return iter(
            wds.DataPipeline(
                lambda: self._samples(worker),
                lambda it: self._decode(it, rng),
                take,
                wds.batched(
                    self.batch_size, collation_fn=self._collate, partial=not self.train and self.last_batch != "drop"
                ),
            )
        )
