"""A DataLoader over a ShardStream: epochs, worker shutdown, and make_loader, the one-call entry.

from data_tools.loader import make_loader
train = make_loader("gs://bucket/cifar/train/manifest.json", 128, train=True, num_workers=2)
for epoch in range(3):
    train.set_epoch(epoch)
    for x, y in train: ...

Any WebDataset (shards that no labkit code wrote: webdataset's ShardWriter, tarp, a hub corpus):

    train = make_loader("photos/train-{000000..000009}.tar", 64, train=True, image_size=224, flip=True)
    val = make_loader("photos/val-{000000..000001}.tar", 64, train=False, image_size=224)
    make_loader(urls, 64, train=True, image_size=224, label="json:label", classes=["cat", "dog"])
    make_loader(urls, 64, train=True, image_size=224, transform=torchvision.transforms.v2.Compose([...]))

The image is a sample's first png/ppm/jpg/jpeg/webp field. `image_size` (an int or (h, w)) gives
(B, 3, h, w) batches whatever the stored sizes: training takes an ImageNet-style random-resized crop
(`crop_scale`, default 8-100 % of the area) and flips where allowed; evaluation resizes the shorter side
and takes the centre (data_tools.transforms.fit_image, which decodes JPEGs at a reduced size when it
can). Mean/std default to ImageNet's there. `transform` instead receives the decoded PIL RGB image and
returns a CHW tensor (a torchvision.transforms.v2 pipeline ending in PILToTensor or ToImage: uint8 is
normalised with mean/std; float, e.g. after v2.Normalize, is taken as it is), a PIL image or an HWC array;
every output must have one shape (static shapes), and its random draws come from torch's generator (seeded
per DataLoader worker by torch). `label` names the field: "cls" (default), "txt", any other field, or
"json:key" (a key of the json field, dotted for nested keys); its text is a class index or, with
`classes` (a list of names, or a dict name -> index), a class name. Without a manifest, the samples per
shard are counted once for training by reading every shard (bytes only, nothing decoded) and kept in
LABKIT_CACHE (default ~/.cache/labkit)/shard-counts.json, keyed by URL (and size and mtime for a local
file: a remote shard rewritten under the same name keeps its old count, so delete the file then);
num_samples= skips the count.
"""

from __future__ import annotations

import operator
import os

import torch

from .stream import ShardStream


def auto_workers() -> int:
    """Loader worker processes for this training process: the host cores it may run on (its CPU affinity),
    shared among the training processes of this host (LOCAL_WORLD_SIZE, which torchrun sets), less one core
    each for the training process itself. A 2-core Colab VM gets 1; 8 cores under torchrun with 4 processes, 1 each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    if not local.isdigit() or int(local) < 1:
        raise ValueError(f"num_workers='auto': LOCAL_WORLD_SIZE={local!r} is not a count of processes >= 1")
    return max(0, cores // int(local) - 1)


def _worker_count(num_workers) -> int:
    if num_workers == "auto":
        return auto_workers()
    if not isinstance(num_workers, bool) and hasattr(num_workers, "__index__") and operator.index(num_workers) >= 0:
        return operator.index(num_workers)
    raise ValueError(f"make_loader: num_workers={num_workers!r}: give a count >= 0, or 'auto'")


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
    def class_names(self):
        """The manifest's class names, or the `classes` given (None when neither)."""
        return self.dataset.class_names

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


def make_loader(
    source,
    batch_size: int,
    *,
    train: bool,
    num_workers: int | str = 0,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    **options,
) -> ShardLoader:
    """A DataLoader of (x float32 NCHW normalised, y int64) batches from shards; see data_tools.stream.

    source: manifest.json path/URL, or a brace pattern / list of shard URLs (a manifest.json in the
    same folder is used when present; otherwise pass num_samples for training). `options` go to
    ShardStream unchanged (rank, world_size, seed, shuffle_buffer, verify, skip_corrupt, num_samples,
    mean, std, last_batch, return_keys, augment, crop_padding, flip, timeout, image_size, label, classes,
    transform, crop_scale). flip=None (default) mirrors images only when the manifest says a mirror keeps
    the label ("hflip": CIFAR-10 yes, digits no); shards without a manifest are not flipped unless flip=True.
    image_size=S (or (h, w)): photos of any stored size come out (B, 3, S, S), ImageNet-style (random-resized
    crop in training, resized shorter side + centre crop in evaluation); transform=a torchvision.transforms.v2
    pipeline instead (see the module docstring). Without image_size and transform, images must have the
    manifest's size (labkit's own shards, 32x32): the CIFAR recipe, as fast as before.
    num_workers: loader worker processes (0: decode in the training process); "auto" gives one per host core
    this process may use, less one for training (auto_workers()). The batches' order depends on the count, so
    a run that must repeat its batches on another host passes a number.
    persistent_workers=True keeps the worker processes between epochs (no restart at each epoch's start: the
    chip does not wait for them); set_epoch() still reaches them (the epoch is a shared value)."""
    num_workers = _worker_count(num_workers)
    stream = ShardStream(source, batch_size, train=train, num_workers=num_workers, **options)
    kw = {}
    if num_workers > 0:
        kw = {"persistent_workers": persistent_workers}
        if prefetch_factor is not None:
            kw["prefetch_factor"] = prefetch_factor
    return ShardLoader(stream, **kw)
