"""Write images as webdataset tar shards plus manifest.json, locally or to gs://, atomically.

    from data_tools.writer import write_dataset, write_shards
    m = write_dataset("digits", "train", "/tmp/digits", samples_per_shard=256)   # -> manifest dict
    m = write_shards(images, labels, "gs://bucket/cifar", split="train", class_names=names)

Layout: `<out>/<split>-000000.tar, ...` and `<out>/manifest.json`: one folder per split (e.g.
out/train and out/val), since the manifest name is fixed. Each sample is `{__key__, png|ppm, cls}`.

A rewrite never lets a manifest describe shards it did not write:
1. shards go to a staging place first (`<out>/.staging-<generation>/`; for gs:// a local temp
   file, uploaded with a verified crc32c, then deleted: disk use stays at one shard);
2. only when all are complete, the old manifest is deleted, the staged shards take their final
   names, and shards of an earlier, larger write (listed by the old manifest, not by the new one)
   are deleted, so a brace pattern cannot read them;
3. the new manifest is published last (an atomic rename, or one GCS upload).
Nothing else is touched: a folder whose manifest.json is not labkit's, or that holds a
`<split>-NNNNNN.tar` that no labkit manifest lists and labkit did not write (its tar header says),
is refused before anything is written; other files, and `.staging-*` folders that are not named
like labkit's, stay. A full disk removes the staging folder and says how much space was left.
A writer killed in 1 leaves the old dataset intact; killed in 2, no manifest (loaders fail with
"manifest not found"). The generation is a hash of the inputs and settings, stored in the manifest
and in every tar header (group `labkit-<generation>`): equal inputs give byte-identical shards, and a
loader refuses a shard whose generation differs from its manifest's.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import time

import numpy as np
import webdataset as wds

from .folders import open_folder
from .manifest import FORMAT, GROUP_PREFIX, MANIFEST, ShardError, load_manifest
from .sources import HFLIP, load_source
from .urls import redact

ENCODINGS = ("png", "ppm")
SHARD_MTIME = 1_700_000_000  # member timestamps: fixed, so equal inputs give byte-identical shards


def channel_stats(images: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-channel mean and std on the 0-1 scale of uint8 NHWC images (float64 accumulation)."""
    n = images.shape[0] * images.shape[1] * images.shape[2]
    flat = images.reshape(n, images.shape[3])
    s, s2 = np.zeros(flat.shape[1]), np.zeros(flat.shape[1])
    for i in range(0, n, 1 << 20):  # chunks: 50k CIFAR images as float64 at once would be ~1.2 GB
        c = flat[i : i + (1 << 20)].astype(np.float64) / 255.0
        s += c.sum(0)
        s2 += (c * c).sum(0)
    mean = s / n
    std = np.sqrt(np.maximum(s2 / n - mean * mean, 0.0))
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]


def encode_image(img: np.ndarray, encoding: str = "png") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG" if encoding == "png" else "PPM")
    return buf.getvalue()


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _padded(n: int) -> int:
    """Size on disk of a tar with `n` bytes of blocks: tarfile pads the archive to 10 KiB records."""
    return -(-n // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def generation(images: np.ndarray, labels: np.ndarray, **settings) -> str:
    """12 hex digits of sha256 over the pixels, labels and settings (~0.2 s for CIFAR-10's 150 MB)."""
    h = hashlib.sha256(np.ascontiguousarray(images).data)
    h.update(np.ascontiguousarray(labels).data)
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:12]


def _is_labkit_tar(head: bytes) -> bool:
    """The first tar header's group name is labkit's (`labkit-<generation>`)."""
    return len(head) >= 512 and head[297:329].startswith(GROUP_PREFIX.encode())


def _owned(folder, out: str, split: str) -> set[str]:
    """Names a write to `folder` may replace or delete: the shards its labkit manifest lists, and
    `<split>-NNNNNN.tar` files a killed labkit write left (their tar headers say labkit). Refuses,
    before anything is written or deleted, a folder whose manifest.json is not labkit's, or that holds
    a `<split>-NNNNNN.tar` labkit did not write: the writer never deletes what is not its own."""
    names = set(folder.names())
    owned: set[str] = set()
    if MANIFEST in names:
        try:
            owned = {s["name"] for s in load_manifest(folder.url(MANIFEST))["shards"]}
        except ShardError:  # a labkit manifest naming files outside the folder: refuse as it is
            raise
        except ValueError as e:
            raise ValueError(
                f"{redact(out)} holds a manifest.json that labkit did not write ({e}); refusing to write "
                "there, nothing was changed: pick another folder, or move its contents away yourself"
            ) from None
    shard = re.compile(rf"{re.escape(split)}-\d{{6}}\.tar")
    for name in sorted(names - owned):
        if shard.fullmatch(name):
            if not _is_labkit_tar(folder.head(name)):
                raise ValueError(
                    f"{redact(out)} holds {name}, which no labkit manifest lists and labkit did not write; "
                    "refusing to overwrite or delete it, nothing was changed: pick another folder, or move "
                    "it away yourself"
                )
            owned.add(name)
    return owned


# -- writing --------------------------------------------------------------------------------------------
def write_shards(
    images: np.ndarray,
    labels,
    out: str,
    *,
    split: str = "train",
    class_names=None,
    upsample: int = 1,
    samples_per_shard: int = 1000,
    max_shard_bytes: int = 64 << 20,
    encoding: str = "png",
    source: str = "custom",
    hflip: bool | None = None,
    extra: dict | None = None,
    verbose: bool = False,
) -> dict:
    """Write uint8 NHWC `images` with int `labels` as `<out>/<split>-%06d.tar` + manifest.json.

    `upsample` repeats the set K times with unique keys (`<split>-<rep>-<index>`); mean/std are
    computed on the images once (repetition does not change them). Shards close at
    `samples_per_shard` samples or before they would exceed `max_shard_bytes` (tar bytes; only a
    sample larger than the cap on its own). Labels must lie in 0..len(class_names)-1.
    `hflip`: whether a mirror image keeps its label (the loader's augmentation flips only then);
    None: data_tools.sources.HFLIP for a known source, else False.
    Returns the manifest dict."""
    images = np.asarray(images)
    labels = np.asarray(labels, dtype=np.int64)
    if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 (N, H, W, 3), got {images.dtype} {images.shape}")
    if len(images) != len(labels) or len(images) == 0:
        raise ValueError(f"{len(images)} images but {len(labels)} labels (need the same, non-zero number)")
    if not split or any(c in split for c in "/\\:\0") or split.startswith("."):
        raise ValueError(f"split {split!r} must be a plain name (no /, \\, :, leading dot): it starts every shard name")
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
    if upsample < 1 or samples_per_shard < 1 or max_shard_bytes < 1:
        raise ValueError(
            f"upsample ({upsample}), samples_per_shard ({samples_per_shard}) and max_shard_bytes "
            f"({max_shard_bytes}) must be >= 1"
        )
    class_names = list(class_names) if class_names is not None else [str(i) for i in range(int(labels.max()) + 1)]
    bad = np.flatnonzero((labels < 0) | (labels >= len(class_names)))
    if len(bad):
        raise ValueError(
            f"label {labels[bad[0]]} of image {bad[0]} is outside 0..{len(class_names) - 1} "
            f"({len(class_names)} classes; {len(bad)} bad label(s) in all)"
        )
    settings = dict(
        split=split,
        class_names=class_names,
        upsample=upsample,
        samples_per_shard=samples_per_shard,
        max_shard_bytes=max_shard_bytes,
        encoding=encoding,
        format=FORMAT,
    )
    gen = generation(images, labels, **settings)
    folder = open_folder(out)
    owned = _owned(folder, out, split)  # refuses a folder holding what labkit did not write
    staging = folder.stage(gen)
    shards: list[dict] = []
    counts: list[int] = []

    def post(fname):  # called by ShardWriter when a shard is closed
        name = os.path.basename(fname)
        entry = {"name": name, "samples": counts[-1], "bytes": os.path.getsize(fname), "sha256": _sha256_file(fname)}
        folder.staged(fname, name)
        shards.append(entry)
        if verbose:
            print(f"wrote {name}: {entry['samples']} samples, {entry['bytes'] / 1e6:.1f} MB", flush=True)

    # A fixed integer mtime: with the default (float time.time()) every member gets a pax header
    # (two more 512-byte blocks: shards 2x larger and slower to parse), and the same images would
    # give a different sha256 on every run. We decide when a shard closes: ShardWriter's own size
    # counts payload bytes only, while a member costs a 512-byte header plus padding to 512.
    writer = wds.ShardWriter(
        os.path.join(staging, f"{split}-%06d.tar"),
        maxcount=1 << 62,
        maxsize=float("inf"),
        post=post,
        verbose=0,
        mtime=SHARD_MTIME,
        user="labkit",
        group=GROUP_PREFIX + gen,
    )
    tar_bytes = 1024  # the end-of-archive blocks
    try:
        for rep in range(upsample):
            for i in range(len(images)):
                key = f"{split}-{rep:02d}-{i:07d}" if upsample > 1 else f"{split}-{i:07d}"
                sample = {"__key__": key, encoding: encode_image(images[i], encoding), "cls": str(int(labels[i]))}
                cost = sum(
                    512 + -(-len(sample[k] if k == encoding else sample[k].encode()) // 512) * 512
                    for k in (encoding, "cls")
                )
                if counts and (counts[-1] >= samples_per_shard or _padded(tar_bytes + cost) > max_shard_bytes):
                    writer.next_stream()  # closes (and posts) the current shard
                    counts.append(0)
                    tar_bytes = 1024
                if not counts:
                    counts.append(0)
                writer.write(sample)
                counts[-1] += 1
                tar_bytes += cost
        writer.close()
    except BaseException as e:
        try:  # closing flushes the tar: on a full disk it fails again, and the staging folder must still go
            writer.close()
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        folder.done(staging)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            where = folder.local_dir(staging)
            free = shutil.disk_usage(where).free / 1e6
            raise OSError(
                errno.ENOSPC,
                f"no space left on {where} ({free:.0f} MB free) while writing shards of {out}; the partly "
                "written shards were removed and the folder's previous dataset is unchanged",
            ) from e
        raise
    mean, std = channel_stats(images)
    manifest = {
        "format": FORMAT,
        "generation": gen,
        "source": source,
        "split": split,
        "encoding": encoding,
        "image_size": [int(images.shape[1]), int(images.shape[2])],
        "channels": 3,
        "num_classes": len(class_names),
        "class_names": class_names,
        "mean": mean,
        "std": std,
        "num_samples": int(sum(s["samples"] for s in shards)),
        "upsample": upsample,
        "hflip": bool(hflip if hflip is not None else HFLIP.get(source, False)),
        "shards": shards,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if extra:
        manifest.update(extra)
    # publish: unpublish the old manifest, move shards into place, drop stale ones, manifest last
    folder.delete(MANIFEST)
    new = {s["name"] for s in shards}
    for name in sorted(new):
        folder.publish(staging, name)
    for name in sorted(owned - new):  # only what the old manifest listed, or labkit's own leftovers
        folder.delete(name)
    folder.write_manifest(json.dumps(manifest, indent=1).encode())
    folder.done(staging)
    return manifest


def write_dataset(
    source: str,
    split: str,
    out: str,
    *,
    upsample: int = 1,
    samples_per_shard: int = 1000,
    max_shard_bytes: int = 64 << 20,
    encoding: str = "png",
    cifar_path: str | None = None,
    num_synthetic: int = 2000,
    seed: int = 0,
    verbose: bool = False,
) -> dict:
    """Load one split of a source (see data_tools.sources) and write it with write_shards.

    `upsample` applies to the train split only (val stays as it is)."""
    images, labels, names = load_source(source, split, cifar_path=cifar_path, num_synthetic=num_synthetic, seed=seed)
    return write_shards(
        images,
        labels,
        out,
        split=split,
        class_names=names,
        upsample=upsample if split == "train" else 1,
        samples_per_shard=samples_per_shard,
        max_shard_bytes=max_shard_bytes,
        encoding=encoding,
        source=source,
        extra={"seed": seed},
        verbose=verbose,
    )
