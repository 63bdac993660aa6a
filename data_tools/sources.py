"""Image sources for the shard writer: CIFAR-10, scikit-learn's digits, and a synthetic set.

    from data_tools.sources import load_source
    images, labels, class_names = load_source("digits", "train")   # uint8 NHWC (N, 32, 32, 3), int64 (N,)

Every source returns 32x32 RGB uint8 images so that one model and one transform fit all three.
`digits` ships inside the scikit-learn wheel (1,797 real 8x8 images) and therefore works
offline; CIFAR-10 needs a download or a local copy of the python batches.
"""

from __future__ import annotations

import os
import pickle

import numpy as np

SOURCES = ("cifar10", "digits", "synthetic")
SPLITS = ("train", "val")
# Does a horizontal mirror image keep its label? Written into the manifest ("hflip"); the loader's
# augmentation flips only where it does. A mirrored 3 or 6 is no digit (classes 3 and 6 then score
# 40-50 %); the synthetic classes are stripe angles, and a mirror turns one angle into another class's.
HFLIP = {"cifar10": True, "digits": False, "synthetic": False}
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")


def _cifar_dir(path: str) -> str | None:
    """The folder holding data_batch_1..5/test_batch: `path` itself or its cifar-10-batches-py child."""
    for d in (path, os.path.join(path, "cifar-10-batches-py")):
        if os.path.isfile(os.path.join(d, "data_batch_1")) and os.path.isfile(os.path.join(d, "test_batch")):
            return d
    return None


def _load_cifar_batches(d: str, split: str):
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    xs, ys = [], []
    for n in names:
        p = os.path.join(d, n)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"CIFAR-10 batch file missing: {p}")
        with open(p, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        xs.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        ys.extend(entry.get("labels", entry.get("fine_labels", [])))
    return np.ascontiguousarray(np.concatenate(xs)), np.asarray(ys, dtype=np.int64)


def load_cifar10(split: str, cifar_path: str | None = None, root: str | None = None):
    """CIFAR-10 from a local copy of the python batches (`cifar_path`), else torchvision's download."""
    _check_split(split)
    if cifar_path:
        d = _cifar_dir(cifar_path)
        if d is None:
            raise FileNotFoundError(
                f"--cifar-path {cifar_path!r} holds no CIFAR-10 python batches "
                "(expected data_batch_1..5 and test_batch, or a cifar-10-batches-py folder)"
            )
        x, y = _load_cifar_batches(d, split)
        return x, y, list(CIFAR10_CLASSES)
    import torchvision

    root = root or os.path.join(os.path.expanduser("~"), ".cache", "labkit", "cifar10")
    try:
        ds = torchvision.datasets.CIFAR10(root, train=(split == "train"), download=True)
    except Exception as e:  # URLError, socket timeouts, HTTP errors: all mean "no copy and no network"
        raise RuntimeError(
            f"CIFAR-10 could not be downloaded to {root} ({type(e).__name__}: {e}). Offline? "
            "Pass --cifar-path DIR with the python batches, or use --source digits "
            "(ships with scikit-learn) or --source synthetic."
        ) from e
    return np.ascontiguousarray(ds.data), np.asarray(ds.targets, dtype=np.int64), list(ds.classes)


def upscale_digits(images8: np.ndarray) -> np.ndarray:
    """(N, 8, 8) values 0..16 -> (N, 32, 32, 3) uint8, bilinear, grey replicated over RGB."""
    from PIL import Image

    out = np.empty((len(images8), 32, 32, 3), dtype=np.uint8)
    for i, im in enumerate(images8):
        g = Image.fromarray(np.clip(im * (255.0 / 16.0), 0, 255).astype(np.uint8), mode="L")
        out[i] = np.asarray(g.resize((32, 32), Image.BILINEAR))[..., None]
    return out


def load_digits(split: str, seed: int = 0, val_fraction: float = 0.2):
    """scikit-learn's 1,797 digits, upscaled to 32x32 RGB; a seeded 80/20 train/val split."""
    _check_split(split)
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    order = np.random.default_rng(seed).permutation(len(d.target))
    n_val = int(round(len(order) * val_fraction))
    idx = np.sort(order[n_val:] if split == "train" else order[:n_val])
    return upscale_digits(d.images[idx]), d.target[idx].astype(np.int64), [str(i) for i in range(10)]


def make_synthetic(n: int, seed: int = 0, num_classes: int = 10):
    """`n` seeded 32x32 RGB images whose class sets a colour and a stripe orientation (learnable),
    with random phase, brightness and noise so that it is not trivial."""
    if n <= 0:
        raise ValueError(f"--num-synthetic must be positive, got {n}")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=n).astype(np.int64)
    yy, xx = np.mgrid[0:32, 0:32].astype(np.float32)
    angles = np.linspace(0, np.pi, num_classes, endpoint=False)
    hues = np.stack(
        [
            np.linspace(0.2, 0.9, num_classes),
            np.linspace(0.9, 0.2, num_classes),
            (np.arange(num_classes) % 3) / 2.0 * 0.7 + 0.15,
        ],
        axis=1,
    )
    images = np.empty((n, 32, 32, 3), dtype=np.uint8)
    for i, c in enumerate(labels):
        a = angles[c] + rng.normal(0, 0.08)
        phase = rng.uniform(0, 2 * np.pi)
        wave = 0.5 + 0.5 * np.sin((np.cos(a) * xx + np.sin(a) * yy) * 0.7 + phase)
        img = wave[..., None] * hues[c][None, None, :] * rng.uniform(0.7, 1.0)
        img = img + rng.normal(0, 0.08, size=img.shape)
        images[i] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return images, labels, [f"class{i}" for i in range(num_classes)]


def load_source(
    source: str,
    split: str,
    *,
    cifar_path: str | None = None,
    num_synthetic: int = 2000,
    seed: int = 0,
    root: str | None = None,
):
    """(images uint8 (N,32,32,3), labels int64 (N,), class_names) for one split of one source.

    The synthetic val split uses a different seed stream than train (seed + 10_000), so the two
    never share images."""
    _check_split(split)
    if source == "cifar10":
        return load_cifar10(split, cifar_path=cifar_path, root=root)
    if source == "digits":
        return load_digits(split, seed=seed)
    if source == "synthetic":
        n = num_synthetic if split == "train" else max(1, num_synthetic // 5)
        return make_synthetic(n, seed=seed if split == "train" else seed + 10_000)
    raise ValueError(f"unknown source {source!r}; valid: {', '.join(SOURCES)}")


PHOTO_CLASSES = ["china", "flower"]  # scikit-learn's two bundled photos (640x427 JPEGs)


def sample_photos(n: int, seed: int = 0, sides=(160, 427)):
    """`n` real photos of varying size, offline: random crops (each side in `sides`) of scikit-learn's
    two sample photos, label = which photo. Returns ([uint8 HWC arrays], int64 labels, PHOTO_CLASSES).

    Two source images are little variety, but it is real photographic texture and colour, of the
    sizes a learner's own JPEGs have, for a loader to decode, crop and resize."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(photos), size=n).astype(np.int64)
    out = []
    for c in labels:
        img = photos[c]
        h, w = (int(rng.integers(sides[0], min(sides[1], s) + 1)) for s in img.shape[:2])
        top, left = int(rng.integers(0, img.shape[0] - h + 1)), int(rng.integers(0, img.shape[1] - w + 1))
        out.append(np.ascontiguousarray(img[top : top + h, left : left + w]))
    return out, labels, list(PHOTO_CLASSES)
