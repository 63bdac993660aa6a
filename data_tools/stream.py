"""Stream tar shards (local, gs://, http) into static-shape batches, split over replicas and workers.

    from data_tools.stream import make_loader
    train = make_loader("gs://bucket/cifar/train/manifest.json", 128, train=True, num_workers=2)
    val = make_loader("/data/cifar/val/manifest.json", 256, train=False, mean=train.mean, std=train.std)
    for epoch in range(3):
        train.set_epoch(epoch)                 # labkit's Trainer does this for you
        for x, y in labkit.device_loader(train, rt): ...   # x float32 NCHW normalised, y int64

Distribution is explicit (webdataset's default node splitter reads RANK/WORLD_SIZE, which
torch_xla's launcher does not set, so every core would read every shard): replica = `rank`/
`world_size` arguments, else labkit.device.current_runtime(), else torch.distributed, else 0/1;
worker = the DataLoader worker. Shards are dealt round-robin, replicas first, then workers.

Training: every replica yields exactly floor(samples / (world * batch)) full batches per epoch,
the same number everywhere (collectives stay in step, shapes stay static). A worker whose shards
hold fewer samples than its share reads them again (re-shuffled); extra samples are left for the
next epoch's shuffle. Shard order is a permutation seeded by (seed, epoch), the sample shuffle
buffer by (seed, epoch, rank, worker): the same seed, epoch, world size and num_workers give the
same batches. Iterating again without set_epoch() advances the epoch by itself.

Evaluation: each replica reads its shards once, in order. Every sample is seen exactly once
across replicas. `last_batch="pad"` (default) pads each worker's last batch to full size with
zero images and label -100 (PyTorch's cross_entropy ignore_index), keeping shapes static;
count real samples with `(y >= 0).sum()`. "partial" yields the smaller batch (a recompile on
XLA), "drop" drops it (labkit.Trainer's eval_step counts labels >= 0). Replicas may get
different numbers of eval batches.

Bad data raises with the shard URL (and key): ShardError for a corrupt/truncated tar, a sample
without `cls` or an undecodable image; ValueError for a sha256 mismatch (verify=True reads each
shard whole and checks it before yielding from it); FileNotFoundError for a missing shard.
skip_corrupt=True skips such samples instead (not sha256 mismatches) and counts them in
`loader.skipped` (shared with worker processes; a sample met again in a later pass counts again).
"""
from __future__ import annotations

import io
import math
import multiprocessing as mp

import numpy as np
import torch

from .shards import check_shard_bytes, is_not_found, load_manifest, open_url, register_gs, sibling
from .tario import TarFormatError, iter_tar
from .transforms import augment, decode_image, scale_stats, to_batch

PAD_LABEL = -100  # F.cross_entropy's default ignore_index
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class ShardError(ValueError):
    """Bad shard data; the message names the shard URL (and the key when known)."""


def resolve_replica(rank=None, world_size=None) -> tuple[int, int]:
    """(rank, world_size): explicit args, else the labkit runtime, else torch.distributed, else (0, 1)."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError(f"pass both rank and world_size (got rank={rank}, world_size={world_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        return int(rank), int(world_size)
    from labkit.device import current_runtime

    rt = current_runtime()
    if rt is not None:
        return rt.ordinal, rt.world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def expand_urls(source) -> list[str]:
    """A brace pattern ("dir/train-{000000..000003}.tar"), or a list of them, -> list of URLs."""
    import braceexpand

    items = [source] if isinstance(source, str) else list(source or [])
    urls = [u for s in items for u in braceexpand.braceexpand(str(s))]
    if not urls:
        raise ValueError("no shard URLs given (empty list); pass a manifest.json or shard URLs")
    return urls


def _split(seq, index: int, count: int) -> list:
    """Round-robin share `index` of `count` (the explicit node and worker splitter)."""
    return list(seq[index::count])


def _allocate(total: int, weights: list[float]) -> list[int]:
    """Split integer `total` proportionally to `weights` (largest remainders), summing to `total`."""
    s = sum(weights)
    ideal = [total * w / s for w in weights] if s > 0 else [total / len(weights)] * len(weights)
    out = [int(math.floor(v)) for v in ideal]
    for i in sorted(range(len(ideal)), key=lambda i: (out[i] - ideal[i], i))[: total - sum(out)]:
        out[i] += 1
    return out


class ShardStream(torch.utils.data.IterableDataset):
    """The webdataset pipeline of one replica: shards -> samples -> shuffle -> decode -> batches."""

    def __init__(self, source, batch_size: int, *, train: bool, rank=None, world_size=None, num_workers: int = 0,
                 seed: int = 0, shuffle_buffer: int = 1000, verify: bool = False, skip_corrupt: bool = False,
                 num_samples: int | None = None, mean=None, std=None, last_batch: str = "pad",
                 return_keys: bool = False, augment: bool = True, crop_padding: int = 4):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if last_batch not in ("pad", "partial", "drop"):
            raise ValueError(f"last_batch must be 'pad', 'partial' or 'drop', got {last_batch!r}")
        register_gs()
        self.manifest = self._find_manifest(source)
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
        self.mean = tuple(mean if mean is not None else m.get("mean", CIFAR_MEAN))
        self.std = tuple(std if std is not None else m.get("std", CIFAR_STD))
        self.image_size = tuple(m.get("image_size", (32, 32)))
        self.epoch = 0
        self._decoded = 0  # per process: detects a pass with nothing readable
        self._skipped = mp.Value("q", 0)  # shared with DataLoader workers (they run in other processes)
        S, R, W = len(self.urls), self.world_size, self.num_workers
        if S < R * W:
            raise ValueError(f"{S} shard(s) for {R} replica(s) x {W} worker(s) = {R * W} readers: every reader needs "
                             f"at least one shard (write smaller shards or use fewer workers) [{self.urls[0]} ...]")
        counts = [e["samples"] if e else None for e in self.entries]
        if None in counts:
            if num_samples is None and train:
                raise ValueError(f"no manifest found beside {self.urls[0]}: pass num_samples= (the total number of "
                                 "samples) so that every replica can yield the same number of batches")
            counts = [num_samples / S] * S if num_samples is not None else None
        self.counts = counts
        self.num_samples = int(round(sum(counts))) if counts else None
        if train:
            self.batches_per_epoch = self.num_samples // (R * self.batch_size)
            if self.batches_per_epoch == 0:
                raise ValueError(f"{self.num_samples} samples cannot fill one batch of {self.batch_size} on each of "
                                 f"{R} replica(s); lower batch_size")

    # -- setup helpers --------------------------------------------------------------------
    @staticmethod
    def _find_manifest(source):
        if isinstance(source, dict):
            raise TypeError("pass the manifest's path or URL, not the dict (shard URLs are relative to it)")
        if isinstance(source, str) and source.endswith(".json"):
            return load_manifest(source)
        urls = expand_urls(source)
        try:  # a manifest beside the shards gives sample counts and mean/std
            return load_manifest(sibling(urls[0], "manifest.json"))
        except Exception:
            return None

    def _entries(self) -> list:
        by_url = dict(zip(self.manifest["urls"], self.manifest["shards"])) if self.manifest else {}
        return [by_url.get(u) for u in self.urls]

    @property
    def skipped(self) -> int:
        """Corrupt samples skipped so far (skip_corrupt=True), summed over workers."""
        return int(self._skipped.value)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

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
        return _split(order, self.rank, self.world_size)  # node splitter

    def _worker_shards(self, worker: int) -> list[int]:
        return _split(self._replica_shards(), worker, self.num_workers)  # worker splitter

    def _worker_batches(self, worker: int) -> int:
        """Train: this worker's share of batches_per_epoch, proportional to the samples it holds."""
        per = [sum(self.counts[i] for i in self._worker_shards(w)) for w in range(self.num_workers)]
        return _allocate(self.batches_per_epoch, per)[worker]

    # -- pipeline stages ----------------------------------------------------------------------------
    def _count_skip(self, n: int = 1) -> None:
        with self._skipped.get_lock():
            self._skipped.value += n

    def _read_tar(self, idx: int):
        url, entry = self.urls[idx], self.entries[idx]
        key, n = None, 0
        try:
            stream = open_url(url)
            if self.verify and entry:
                data = stream.read()
                stream.close()
                check_shard_bytes(data, url, entry)
                stream = io.BytesIO(data)
            with stream:
                sample = {}
                for name, payload in iter_tar(stream):
                    base = name.rsplit("/", 1)[-1]
                    k, _, ext = base.partition(".")
                    k = name[: len(name) - len(base)] + k
                    if k != key:
                        if sample:
                            n += 1
                            yield sample
                        key, sample = k, {"__key__": k, "__url__": url}
                    sample[ext.lower()] = payload
                if sample:
                    n += 1
                    yield sample
        except Exception as e:
            if is_not_found(e):
                raise FileNotFoundError(f"shard not found: {url}") from None
            if not isinstance(e, (TarFormatError, EOFError, OSError)):
                raise
            msg = f"shard {url}: corrupt or truncated tar after {n} sample(s) (last key {key!r}): {e}"
            if not self.skip_corrupt:
                raise ShardError(msg) from e
            self._count_skip(max(1, (entry["samples"] - n) if entry else 1))
            return
        if entry and n != entry["samples"]:
            msg = f"shard {url}: {n} samples, manifest says {entry['samples']} (truncated or replaced)"
            if not self.skip_corrupt:
                raise ShardError(msg)
            self._count_skip(max(0, entry["samples"] - n))

    def _shuffle(self, samples, rng):
        if self.shuffle_buffer <= 1:
            yield from samples
            return
        buf = []
        for s in samples:
            if len(buf) < self.shuffle_buffer:
                buf.append(s)
                continue
            j = rng.integers(len(buf))
            buf[j], s = s, buf[j]
            yield s
        rng.shuffle(buf)  # the end of a pass flushes: a pass never leaks into the next one
        yield from buf

    def _samples(self, worker: int):
        """Raw samples of this worker: training cycles its shards until its batch quota is met."""
        shards = self._worker_shards(worker)
        if not self.train:
            for i in shards:
                yield from self._read_tar(i)
            return
        # Endless passes; _batches stops at the quota, so a pass is only started when needed and
        # samples skipped as corrupt are made up for from the next pass.
        p = 0
        while True:
            rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, p])
            order = shards if p == 0 else list(rng.permutation(shards))
            before = self._decoded
            yield from self._shuffle((s for i in order for s in self._read_tar(i)), rng)
            if self._decoded == before:
                raise ShardError(f"no readable samples in shards {[self.urls[i] for i in shards]}")
            p += 1

    def _decode(self, samples, rng):
        h, w = self.image_size
        for s in samples:
            url, key = s["__url__"], s["__key__"]
            try:
                if "cls" not in s:
                    raise ShardError(f"shard {url}: sample {key!r} has no 'cls' field (fields: "
                                     f"{sorted(k for k in s if not k.startswith('__'))})")
                ext = next((e for e in ("png", "ppm", "jpg", "jpeg") if e in s), None)
                if ext is None:
                    raise ShardError(f"shard {url}: sample {key!r} has no image (png/ppm/jpg) field")
                try:
                    img = decode_image(s[ext])
                    label = int(s["cls"])
                except Exception as e:
                    raise ShardError(f"shard {url}: sample {key!r} cannot be decoded: {e}") from e
                if img.shape[:2] != (h, w):
                    raise ShardError(f"shard {url}: sample {key!r} is {img.shape[1]}x{img.shape[0]}, expected {w}x{h}")
            except ShardError:
                if not self.skip_corrupt:
                    raise
                self._count_skip()
                continue
            if self.augment:
                img = augment(img, rng, self.crop_padding)
            self._decoded += 1
            yield img, label, key

    def _batches(self, items, quota=None):
        mean, std = scale_stats(self.mean, self.std)
        buf, made = [], 0

        def collate(buf):
            x, y = to_batch([b[0] for b in buf], [b[1] for b in buf], mean, std)
            return (x, y, [b[2] for b in buf]) if self.return_keys else (x, y)

        for item in items:
            buf.append(item)
            if len(buf) == self.batch_size:
                yield collate(buf)
                buf, made = [], made + 1
                if quota is not None and made >= quota:
                    return
        if buf and not self.train and self.last_batch != "drop":
            if self.last_batch == "pad":
                x, y, *k = collate(buf)
                n = self.batch_size - len(buf)
                x = torch.cat([x, torch.zeros((n,) + tuple(x.shape[1:]))])
                y = torch.cat([y, torch.full((n,), PAD_LABEL, dtype=torch.int64)])
                yield (x, y, k[0] + [""] * n) if self.return_keys else (x, y)
            else:
                yield collate(buf)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, nw = (info.id, info.num_workers) if info else (0, 1)
        if nw != self.num_workers:
            raise RuntimeError(f"ShardStream was planned for {self.num_workers} worker(s) but runs in {nw}; "
                               "pass the DataLoader's num_workers to make_loader")
        import webdataset as wds

        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, 1 << 20])
        quota = self._worker_batches(worker) if self.train else None
        return iter(wds.DataPipeline(lambda: self._samples(worker), lambda it: self._decode(it, rng),
                                     lambda it: self._batches(it, quota)))


class ShardLoader(torch.utils.data.DataLoader):
    """A DataLoader over a ShardStream (batch_size=None: batches come from the pipeline).

    Iterating again without set_epoch() moves to the next epoch, so a plain `for` loop over
    epochs reshuffles."""

    def __init__(self, stream: ShardStream, **kw):
        super().__init__(stream, batch_size=None, num_workers=stream.dataloader_workers, **kw)
        self._iterated, self._epoch_set = False, False

    @property
    def stream(self) -> ShardStream:
        return self.dataset

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)
        self._epoch_set = True

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    @property
    def skipped(self) -> int:
        return self.dataset.skipped

    @property
    def manifest(self):
        return self.dataset.manifest

    @property
    def mean(self):
        return self.dataset.mean

    @property
    def std(self):
        return self.dataset.std

    def __iter__(self):
        if self._iterated and not self._epoch_set:
            self.dataset.epoch += 1
        self._iterated, self._epoch_set = True, False
        return self._guarded(super().__iter__())

    @staticmethod
    def _guarded(it):
        """Stop worker processes as soon as the loop ends by error or break: left to the garbage
        collector (the iterator sits in the exception's traceback), their shutdown waited 10 s."""
        try:
            yield from it
        except BaseException:
            stop = getattr(it, "_shutdown_workers", None)
            if stop is not None:
                stop()
            raise


def make_loader(source, batch_size: int, *, train: bool, rank=None, world_size=None, num_workers: int = 0,
                seed: int = 0, shuffle_buffer: int = 1000, verify: bool = False, skip_corrupt: bool = False,
                num_samples: int | None = None, mean=None, std=None, last_batch: str = "pad",
                return_keys: bool = False, augment: bool = True, prefetch_factor: int | None = None,
                persistent_workers: bool = False) -> ShardLoader:
    """A DataLoader of (x float32 NCHW normalised, y int64) batches from shards; see the module doc.

    source: manifest.json path/URL, or a brace pattern / list of shard URLs (a manifest.json in the
    same folder is used when present; otherwise pass num_samples for training).
    persistent_workers keeps worker processes between epochs, but then set_epoch() no longer
    reaches them (they hold their own copy of the stream): leave it off unless epochs don't matter."""
    stream = ShardStream(source, batch_size, train=train, rank=rank, world_size=world_size, num_workers=num_workers,
                         seed=seed, shuffle_buffer=shuffle_buffer, verify=verify, skip_corrupt=skip_corrupt,
                         num_samples=num_samples, mean=mean, std=std, last_batch=last_batch,
                         return_keys=return_keys, augment=augment)
    kw = {}
    if num_workers > 0:
        kw = {"persistent_workers": persistent_workers}
        if prefetch_factor is not None:
            kw["prefetch_factor"] = prefetch_factor
    return ShardLoader(stream, **kw)
