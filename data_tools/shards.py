"""Write images as webdataset tar shards plus a manifest, locally or to gs://.

    from data_tools.shards import write_dataset, write_shards, load_manifest, verify_manifest
    m = write_dataset("digits", "train", "/tmp/digits", samples_per_shard=256)   # -> manifest dict
    m = write_shards(images, labels, "gs://bucket/cifar", split="train", class_names=names)
    verify_manifest("gs://bucket/cifar/manifest.json")     # sha256 of every shard, names the bad one

Layout: `<out>/<split>-000000.tar, ...` and `<out>/manifest.json`: one folder per split (e.g.
out/train and out/val), since the manifest name is fixed. Each sample is `{__key__, png|ppm, cls}`.

The manifest is written last, so a reader that finds it knows every shard is complete. For
gs:// each shard goes to a temp file first, is uploaded with a verified crc32c
(labkit.gcs.upload_file) and deleted: disk use stays at one shard.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
import time

import numpy as np

MANIFEST = "manifest.json"
FORMAT = "labkit-shards/1"
ENCODINGS = ("png", "ppm")
SHARD_MTIME = 1_700_000_000  # member timestamps: fixed, so equal inputs give byte-identical shards


# -- reading any URL -----------------------------------------------------------------------------
def _gopen_gs(url, mode="rb", bufsize=8192, **kw):
    """webdataset handler for gs://: streams through the process-wide google-cloud-storage client
    (no gsutil subprocess, connections reused)."""
    from labkit import gcs

    if mode != "rb":
        raise ValueError(f"gs:// handler only reads, asked for mode {mode!r} on {url}")
    return gcs.open_read(url)


def register_gs() -> None:
    """Route webdataset's gs:// opener through labkit.gcs (its default shells out to gsutil)."""
    import importlib

    # importlib, not `import webdataset.gopen`: the package re-exports a function named gopen
    # that shadows the module of the same name
    importlib.import_module("webdataset.gopen").gopen_schemes["gs"] = _gopen_gs


def open_url(url: str):
    """Binary read stream for a local path, file://, gs:// or http(s):// URL."""
    import importlib

    register_gs()
    return importlib.import_module("webdataset.gopen").gopen(url, "rb")


def is_not_found(e: BaseException) -> bool:
    """FileNotFoundError, or google-cloud-storage's NotFound (raised on the first read of a
    missing gs:// object)."""
    if isinstance(e, FileNotFoundError):
        return True
    try:
        from google.api_core.exceptions import NotFound
    except ImportError:
        return False
    return isinstance(e, NotFound)


def read_bytes(url: str) -> bytes:
    with open_url(url) as f:
        return f.read()


def sibling(url: str, name: str) -> str:
    """The URL of `name` in the same folder as `url` (works for paths and URLs)."""
    head = url.rsplit("/", 1)[0] if "/" in url else "."
    return f"{head}/{name}"


# -- manifest -------------------------------------------------------------------------------------
def load_manifest(url: str) -> dict:
    """Read a manifest.json (path or URL); shard URLs are added as m["urls"]."""
    try:
        m = json.loads(read_bytes(url))
    except json.JSONDecodeError as e:
        raise ValueError(f"manifest {url} is not valid JSON: {e}") from None
    except Exception as e:
        if is_not_found(e):
            raise FileNotFoundError(f"manifest not found: {url}") from None
        raise
    if m.get("format") != FORMAT or "shards" not in m:
        raise ValueError(f"{url} is not a labkit shard manifest (format={m.get('format')!r})")
    m["urls"] = [sibling(url, s["name"]) for s in m["shards"]]
    m["manifest_url"] = url
    return m


def verify_manifest(manifest: dict | str) -> dict:
    """Read every shard and compare its sha256 and size with the manifest.

    Raises ValueError naming the first shard that differs. Returns the manifest."""
    m = load_manifest(manifest) if isinstance(manifest, str) else manifest
    for url, s in zip(m["urls"], m["shards"]):
        check_shard_bytes(read_bytes(url), url, s)
    return m


def check_shard_bytes(data: bytes, url: str, entry: dict) -> None:
    if len(data) != entry["bytes"]:
        raise ValueError(f"shard {url}: {len(data)} bytes, manifest says {entry['bytes']} (truncated or replaced)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry["sha256"]:
        raise ValueError(f"shard {url}: sha256 {digest[:16]}... does not match manifest {entry['sha256'][:16]}...")


def channel_stats(images: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-channel mean and std on the 0-1 scale of uint8 NHWC images (float64 accumulation)."""
    n = images.shape[0] * images.shape[1] * images.shape[2]
    flat = images.reshape(n, images.shape[3])
    s = np.zeros(flat.shape[1]); s2 = np.zeros(flat.shape[1])
    for i in range(0, n, 1 << 20):  # chunks: 50k CIFAR images as float64 at once would be ~1.2 GB
        c = flat[i:i + (1 << 20)].astype(np.float64) / 255.0
        s += c.sum(0); s2 += (c * c).sum(0)
    mean = s / n
    std = np.sqrt(np.maximum(s2 / n - mean * mean, 0.0))
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]


def encode_image(img: np.ndarray, encoding: str = "png") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG" if encoding == "png" else "PPM")
    return buf.getvalue()


# -- writing --------------------------------------------------------------------------------------
def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _padded(n: int) -> int:
    """Size on disk of a tar with `n` bytes of blocks: tarfile pads the archive to 10 KiB records."""
    return -(-n // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def write_shards(images: np.ndarray, labels, out: str, *, split: str = "train", class_names=None,
                 upsample: int = 1, samples_per_shard: int = 1000, max_shard_bytes: int = 64 << 20,
                 encoding: str = "png", source: str = "custom", extra: dict | None = None,
                 verbose: bool = False) -> dict:
    """Write uint8 NHWC `images` with int `labels` as `<out>/<split>-%06d.tar` + manifest.json.

    `upsample` repeats the set K times with unique keys (`<split>-<rep>-<index>`); mean/std are
    computed on the images once (repetition does not change them). Shards close at
    `samples_per_shard` samples or before they would exceed `max_shard_bytes` (tar bytes; only a
    sample larger than the cap on its own). Returns the manifest dict."""
    import webdataset as wds
    from labkit import gcs

    images = np.asarray(images)
    labels = np.asarray(labels, dtype=np.int64)
    if images.ndim != 4 or images.shape[3] != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 (N, H, W, 3), got {images.dtype} {images.shape}")
    if len(images) != len(labels) or len(images) == 0:
        raise ValueError(f"{len(images)} images but {len(labels)} labels (need the same, non-zero number)")
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
    if upsample < 1 or samples_per_shard < 1:
        raise ValueError(f"upsample ({upsample}) and samples_per_shard ({samples_per_shard}) must be >= 1")
    num_classes = int(labels.max()) + 1
    class_names = list(class_names) if class_names is not None else [str(i) for i in range(num_classes)]
    remote = gcs.is_gcs(out)
    if remote:
        gcs.ensure_bucket(out)
        tmpdir = tempfile.mkdtemp(prefix="labkit-shards-")
        local_dir = tmpdir
    else:
        os.makedirs(out, exist_ok=True)
        local_dir = out
    shards: list[dict] = []
    counts: list[int] = []

    def post(fname):  # called by ShardWriter when a shard is closed
        name = os.path.basename(fname)
        entry = {"name": name, "samples": counts[-1], "bytes": os.path.getsize(fname), "sha256": _sha256_file(fname)}
        if remote:
            gcs.upload_file(fname, gcs.join(out, name))
            os.remove(fname)
        shards.append(entry)
        if verbose:
            print(f"wrote {name}: {entry['samples']} samples, {entry['bytes'] / 1e6:.1f} MB", flush=True)

    # A fixed integer mtime: with the default (float time.time()) every member gets a pax header
    # (two more 512-byte blocks: shards 2x larger and slower to parse), and the same images would
    # give a different sha256 on every run. We decide when a shard closes: ShardWriter's own size
    # counts payload bytes only, while a member costs a 512-byte header plus padding to 512.
    writer = wds.ShardWriter(os.path.join(local_dir, f"{split}-%06d.tar"), maxcount=1 << 62, maxsize=float("inf"),
                             post=post, verbose=0, mtime=SHARD_MTIME)
    tar_bytes = 1024  # the end-of-archive blocks
    try:
        for rep in range(upsample):
            for i in range(len(images)):
                key = f"{split}-{rep:02d}-{i:07d}" if upsample > 1 else f"{split}-{i:07d}"
                sample = {"__key__": key, encoding: encode_image(images[i], encoding), "cls": str(int(labels[i]))}
                cost = sum(512 + -(-len(sample[k] if k == encoding else sample[k].encode()) // 512) * 512
                           for k in (encoding, "cls"))
                if counts and (counts[-1] >= samples_per_shard or _padded(tar_bytes + cost) > max_shard_bytes):
                    writer.next_stream()  # closes (and posts) the current shard
                    counts.append(0)
                    tar_bytes = 1024
                if not counts:
                    counts.append(0)
                writer.write(sample)
                counts[-1] += 1
                tar_bytes += cost
    finally:
        writer.close()
        if remote:
            os.rmdir(tmpdir) if not os.listdir(tmpdir) else None
    mean, std = channel_stats(images)
    manifest = {
        "format": FORMAT, "source": source, "split": split, "encoding": encoding,
        "image_size": [int(images.shape[1]), int(images.shape[2])], "channels": 3,
        "num_classes": len(class_names), "class_names": class_names, "mean": mean, "std": std,
        "num_samples": int(sum(s["samples"] for s in shards)), "upsample": upsample,
        "shards": shards, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if extra:
        manifest.update(extra)
    body = json.dumps(manifest, indent=1).encode()
    if remote:  # last: its presence says every shard is complete
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            f.write(body)
        try:
            gcs.upload_file(f.name, gcs.join(out, MANIFEST))
        finally:
            os.remove(f.name)
    else:
        tmp = os.path.join(out, MANIFEST + ".tmp")
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, os.path.join(out, MANIFEST))  # atomic: never a half-written manifest
    return manifest


def write_dataset(source: str, split: str, out: str, *, upsample: int = 1, samples_per_shard: int = 1000,
                  max_shard_bytes: int = 64 << 20, encoding: str = "png", cifar_path: str | None = None,
                  num_synthetic: int = 2000, seed: int = 0, verbose: bool = False) -> dict:
    """Load one split of a source (see data_tools.sources) and write it with write_shards.

    `upsample` applies to the train split only (val stays as it is)."""
    from .sources import load_source

    images, labels, names = load_source(source, split, cifar_path=cifar_path, num_synthetic=num_synthetic, seed=seed)
    return write_shards(images, labels, out, split=split, class_names=names,
                        upsample=upsample if split == "train" else 1, samples_per_shard=samples_per_shard,
                        max_shard_bytes=max_shard_bytes, encoding=encoding, source=source,
                        extra={"seed": seed}, verbose=verbose)
