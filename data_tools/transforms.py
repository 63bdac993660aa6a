"""Decode, augment and batch images for the shard loader (numpy on the host, in loader workers).

from data_tools.transforms import decode_image, augment, scale_stats, to_batch
img = augment(decode_image(png_bytes, size=(32, 32)), rng, flip=True)   # uint8 HWC, crop pad 4 + flip
x, y = to_batch([img], [3], *scale_stats(mean, std))   # float32 NCHW normalised, int64
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch

MAX_PIXELS = 4096 * 4096  # an image claiming more is refused before its pixels are decoded (~50 MB as RGB)


def decode_image(data: bytes, size: tuple[int, int] | None = None) -> np.ndarray:
    """PNG/PPM/JPEG bytes -> uint8 HWC RGB (no copy through convert() when already RGB: ~6 us).

    The header's size is checked before any pixel is decoded: against `size` (height, width) when
    given, else against MAX_PIXELS (a 160 KB PNG may claim 13000x13000 pixels, 500 MB decoded).
    16-bit greyscale (PNG mode I;16, or I) is scaled to 8 bits by dividing by 257, so that 65535 maps
    to 255 (the full 16-bit range; 12-bit data stored in 16 bits comes out dark, not wrong):
    Pillow's convert("RGB") would clip it to {0, 255}. Float images (mode F) are refused."""
    from PIL import Image

    with warnings.catch_warnings():  # Pillow's own limit (89 M pixels: a warning, 179 M: an error) comes first
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # in Image.open: ours is the one said
        try:
            im = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise ValueError(f"image claims more pixels than MAX_PIXELS ({MAX_PIXELS}): {e}") from None
    w, h = im.size
    if size is not None and (h, w) != tuple(size):
        raise ValueError(f"image is {w}x{h}, expected {size[1]}x{size[0]}")
    if w * h > MAX_PIXELS:
        raise ValueError(f"image claims {w}x{h} pixels, more than MAX_PIXELS ({MAX_PIXELS})")
    if im.mode == "RGB":
        return np.asarray(im)
    if im.mode.startswith("I"):  # I;16, I;16B, I;16L, I (32-bit int): integer grey levels above 255
        grey = np.asarray(im).astype(np.int64)
        if grey.min() < 0 or grey.max() > 65535:
            raise ValueError(f"{im.mode} image holds values outside 0..65535 ({grey.min()}..{grey.max()})")
        grey = ((grey + 128) // 257).astype(np.uint8)  # rounded: 257 * 255 = 65535
        return np.repeat(grey[..., None], 3, axis=2)
    if im.mode == "F":
        raise ValueError("float image (mode F): no 8-bit scale is implied; store uint8 or 16-bit PNG")
    return np.asarray(im.convert("RGB"))


def scale_stats(mean, std):
    """mean/std on the 0-1 scale -> (1,3,1,1) tensors on the 0-255 scale (saves a divide per pixel)."""
    return (
        torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) * 255.0,
        torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1) * 255.0,
    )


def to_batch(images, labels, mean255, std255):
    """uint8 HWC images + int labels -> (float32 NCHW normalised, int64)."""
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    return ((x - mean255) / std255).contiguous(), torch.tensor(labels, dtype=torch.int64)


def augment(img: np.ndarray, rng, padding: int = 4, flip: bool = False) -> np.ndarray:
    """Random crop of the original size from the zero-padded image, then, with `flip`, a horizontal
    flip with probability 1/2 (the CIFAR recipe). Flip only data whose mirror image keeps its label:
    a mirrored photo of a cat is a cat, a mirrored handwritten 3 is no digit (the manifest's "hflip"
    says which, see data_tools.sources.HFLIP)."""
    h, w = img.shape[:2]
    if padding:
        img = np.pad(img, ((padding, padding), (padding, padding), (0, 0)))
        i, j = rng.integers(0, 2 * padding + 1, size=2)
        img = img[i : i + h, j : j + w]
    if flip and rng.random() < 0.5:
        img = img[:, ::-1]
    return img
