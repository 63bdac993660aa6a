"""Decode, resize, augment and batch images for the shard loader (on the host, in loader workers).

from data_tools.transforms import decode_image, augment, fit_image, scale_stats, to_batch
img = augment(decode_image(png_bytes, size=(32, 32)), rng, flip=True)   # uint8 HWC, crop pad 4 + flip
img = fit_image(jpeg_bytes, (224, 224), rng, train=True, flip=True)     # any size in, uint8 3x224x224 out
x, y = to_batch([img], [3], *scale_stats(mean, std))   # float32 NCHW normalised, int64

Two paths. labkit's own shards hold images of one size (32x32): they are decoded as they are
(`decode_image` refuses any other size) and augmented with the CIFAR recipe (`augment`). Photos of
any size (`image_size=` in make_loader) go through `fit_image`, the ImageNet recipe: training takes a
random-resized crop (torchvision's sampling: 8-100 % of the area, aspect 3/4-4/3) and flips where
allowed; evaluation resizes the shorter side to size/0.875 and takes the centre (256 -> 224).

Decoding is the host's biggest cost, so `fit_image` picks the crop from the header first, then decodes as little
as it can: a JPEG whose crop is >= 4x the output through Pillow's reduced "draft" decode (1/4 or 1/8 of the size,
computed in the DCT), any other JPEG through torchvision.io.decode_jpeg; then torch's antialiased resize of uint8.
Measured with bench/bench_feed.py (one core, ms per image, random-resized crop, Pillow 13, torchvision 0.24,
JPEG q90; a shared 2-core machine, so +-15 %):

                                      small photos (160-427 px a side)    phone photos (1920x1280)
    output                               224         64                      224         64
    fit_image (labkit)                   0.70        0.59                    5.9         3.9
    Pillow full decode + Pillow resize   0.99        0.72                    22.5        21.8
    Pillow draft decode + Pillow resize  1.00        0.51                    5.6         3.7
    decode_jpeg + v2 resized_crop        0.63        0.53                    7.2         7.0

No single decoder wins everywhere: torchvision's decoder is ~1.4x faster than Pillow's on a whole image, but a
draft decodes 1/16 or 1/64 of the pixels (still paying for the entropy decoding of every coefficient, hence
"only" 2-6x). Pillow's resize is ~3x slower than torch's on uint8. simplejpeg 1.9 (libjpeg-turbo with a reduced
decode, on PyPI; timed by the bench when installed) + Pillow's resize, same run as fit_image: 1.09 vs 0.73 (224) and
0.51 vs 0.59 (64) on the small photos, 4.96 vs 6.48 (224) and 3.40 vs 5.06 (64) on phone photos: 1.3-1.5x faster
only where photos are many times the output, slower at ImageNet sizes to 224; it is not a dependency (pre-resize
such shards instead, see notebook 06). PNG and WebP have no reduced decode: Pillow decodes them whole.
"""

from __future__ import annotations

import io
import json
import math
import re
import warnings

import numpy as np
import torch

MAX_PIXELS = 4096 * 4096  # an image claiming more is refused before its pixels are decoded (~50 MB as RGB)
IMAGE_FIELDS = ("png", "ppm", "jpg", "jpeg", "webp")  # the first one a sample has is its image
# a field's extension names the one Pillow decoder that may read it: a shard's bytes never reach another plugin
# (EPS would start Ghostscript on them; PSD, FITS, TIFF... are parsers no photo needs)
FIELD_FORMATS = {"png": ("PNG",), "ppm": ("PPM",), "jpg": ("JPEG",), "jpeg": ("JPEG",), "webp": ("WEBP",)}
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
EVAL_CROP = 0.875  # evaluation keeps the centre 87.5 % of the shorter side (224 of 256)
CROP_SCALE, CROP_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # torchvision's RandomResizedCrop defaults
# a JPEG whose crop is at least this many times the output is decoded by Pillow at 1/4 or 1/8 scale (draft);
# below it torchvision's decoder of the whole image is faster (a 1/2-scale draft still pays Pillow's slower
# entropy decoding of every coefficient: measured with bench/bench_feed.py, see the table above)
DRAFT_FROM = 4


def sniff_format(data: bytes) -> str:
    """The format `data` looks like, by its first bytes only (each Pillow plugin's prefix test; nothing is
    opened, no decoder runs): "EPS", "TIFF", ... or "unknown"."""
    from PIL import Image

    Image.init()
    head = bytes(data[:64])
    for fmt, (_factory, accept) in Image.OPEN.items():
        try:
            if accept is not None and accept(head):
                return fmt
        except Exception:  # noqa: BLE001 - a plugin's prefix test that chokes on 64 bytes says nothing
            continue
    return "unknown"


def open_image(data: bytes, size: tuple[int, int] | None = None, field: str | None = None):
    """The image's header only (no pixel decoded yet): a PIL Image, its size checked against `size`
    (height, width) when given, else against MAX_PIXELS (a 160 KB PNG may claim 13000x13000 pixels).

    Only the decoder that `field` names reads the bytes (FIELD_FORMATS: a `.jpg` field is read by Pillow's
    JPEG decoder and no other; no field: one of PNG, PPM, JPEG, WebP); anything else is refused naming the
    field and the format found (EPS bytes in a `.jpg` never reach Ghostscript). An EXIF orientation tag is
    applied (ImageOps.exif_transpose: a phone photo stored sideways comes out upright; this decodes the
    image whole). An animated PNG or WebP gives its first frame, as Pillow opens it."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if field is None:
        allowed = tuple(dict.fromkeys(f for fs in FIELD_FORMATS.values() for f in fs))
    elif field in FIELD_FORMATS:
        allowed = FIELD_FORMATS[field]
    else:
        raise ValueError(f"field {field!r} names no image format labkit decodes ({', '.join(FIELD_FORMATS)})")
    with warnings.catch_warnings():  # Pillow's own limit (89 M pixels: a warning, 179 M: an error) comes first
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # in Image.open: ours is the one said
        try:
            im = Image.open(io.BytesIO(data), formats=list(allowed))
        except Image.DecompressionBombError as e:
            raise ValueError(f"image claims more pixels than MAX_PIXELS ({MAX_PIXELS}): {e}") from None
        except UnidentifiedImageError:
            where = f"the {field!r} field" if field else "the image"
            raise ValueError(
                f"{where} holds {sniff_format(data)} data, not {'/'.join(allowed)}: refused (a field is read only "
                "by the decoder its extension names)"
            ) from None
    w, h = im.size
    if size is not None and (h, w) != tuple(size) and (w, h) != tuple(size):  # stored sideways is checked below
        raise ValueError(f"image is {w}x{h}, expected {size[1]}x{size[0]}")
    if w * h > MAX_PIXELS:
        raise ValueError(f"image claims {w}x{h} pixels, more than MAX_PIXELS ({MAX_PIXELS})")
    if im.getexif().get(0x0112, 1) != 1:  # EXIF Orientation: rotate/mirror as the camera meant it
        im = ImageOps.exif_transpose(im)
        w, h = im.size
    if size is not None and (h, w) != tuple(size):
        raise ValueError(f"image is {w}x{h}, expected {size[1]}x{size[0]}")
    return im


def rgb_array(im) -> np.ndarray:
    """A PIL image -> uint8 HWC RGB (no copy through convert() when already RGB: ~6 us).

    16-bit greyscale (PNG mode I;16, or I) is scaled to 8 bits by dividing by 257, so that 65535 maps
    to 255 (the full 16-bit range; 12-bit data stored in 16 bits comes out dark, not wrong):
    Pillow's convert("RGB") would clip it to {0, 255}. Float images (mode F) are refused."""
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


def decode_image(data: bytes, size: tuple[int, int] | None = None, field: str | None = None) -> np.ndarray:
    """PNG/PPM/JPEG/WebP bytes -> uint8 HWC RGB at the stored size (see open_image, rgb_array)."""
    return rgb_array(open_image(data, size, field))


def rgb_image(data: bytes, field: str | None = None):
    """Bytes -> a PIL RGB image at the stored size (what a user transform receives)."""
    from PIL import Image

    im = open_image(data, field=field)
    return im if im.mode == "RGB" else Image.fromarray(rgb_array(im))


def crop_box(width: int, height: int, size, rng, train: bool, scale=CROP_SCALE, ratio=CROP_RATIO):
    """(left, top, right, bottom) of the region that becomes the output, in the image's pixels.

    train: torchvision's RandomResizedCrop sampling (area share in `scale`, log-uniform aspect in
    `ratio`, 10 tries, then the centre at the nearest allowed aspect); eval: the centre of the image
    resized so that its shorter side is max(size) / EVAL_CROP."""
    th, tw = size
    if not train:
        s = max(th, tw) / (EVAL_CROP * min(width, height))  # output pixels per image pixel
        cw, ch = min(width, tw / s), min(height, th / s)
        left, top = (width - cw) / 2, (height - ch) / 2
        return (left, top, left + cw, top + ch)
    area, logr = width * height, (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        a = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*logr))
        cw, ch = round(math.sqrt(a * aspect)), round(math.sqrt(a / aspect))
        if 0 < cw <= width and 0 < ch <= height:
            left, top = int(rng.integers(0, width - cw + 1)), int(rng.integers(0, height - ch + 1))
            return (left, top, left + cw, top + ch)
    aspect = width / height  # 10 misses (a very long image): the centre, aspect clamped into `ratio`
    cw, ch = (width, round(width / ratio[0])) if aspect < ratio[0] else (round(height * ratio[1]), height)
    cw, ch = (width, height) if ratio[0] <= aspect <= ratio[1] else (min(cw, width), min(ch, height))
    left, top = (width - cw) // 2, (height - ch) // 2
    return (left, top, left + cw, top + ch)


def fit_image(
    data: bytes, size, rng, *, train: bool, flip: bool = False, scale=CROP_SCALE, ratio=CROP_RATIO, field=None
):
    """Image bytes of any size -> a uint8 CHW tensor of `size` (height, width): the crop (see crop_box) resized
    by torchvision's antialiased bilinear resize (~3x faster than Pillow's on uint8). A JPEG whose crop is at
    least DRAFT_FROM times the output is decoded by Pillow at a reduced scale (draft mode: 1/4 or 1/8, the
    smallest that leaves the crop >= size); any other JPEG by torchvision.io.decode_jpeg (~1.4x faster than
    Pillow's full decode); PNG and WebP by Pillow; a photo with an EXIF orientation by Pillow, whole, turned
    upright first (open_image). Training flips with probability 1/2 when `flip`."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    im = open_image(data, field=field)  # turned upright: format None, so decoded by Pillow below
    width, height = im.size
    left, top, right, bottom = crop_box(width, height, size, rng, train, scale, ratio)
    th, tw = size
    if im.format == "JPEG" and min((right - left) / tw, (bottom - top) / th) < DRAFT_FROM:  # decode whole
        x = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    else:
        if im.format == "JPEG":  # decode fewer pixels: the draft keeps the crop >= size
            im.draft("RGB", (math.ceil(width * tw / (right - left)), math.ceil(height * th / (bottom - top))))
            fx, fy = im.size[0] / width, im.size[1] / height  # the reduced size is rounded up: one factor per axis
            left, top, right, bottom = left * fx, top * fy, min(right * fx, im.size[0]), min(bottom * fy, im.size[1])
        x = torch.from_numpy(np.array(rgb_array(im))).permute(2, 0, 1)  # a writable copy: torch shares it
    top, left = int(top), int(left)
    h, w = max(1, round(bottom) - top), max(1, round(right) - left)
    x = F.resized_crop(x, top, left, h, w, [th, tw], antialias=True)
    if train and flip and rng.random() < 0.5:
        x = x.flip(-1)
    return x


def scale_stats(mean, std):
    """mean/std on the 0-1 scale -> (1,3,1,1) tensors on the 0-255 scale (saves a divide per pixel)."""
    return (
        torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) * 255.0,
        torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1) * 255.0,
    )


def to_batch(images, labels, mean255, std255):
    """uint8 HWC arrays + int labels -> (float32 NCHW normalised, int64). CHW tensors (a user transform's
    output) are stacked as they are: uint8 ones normalised with mean/std, float ones taken as given."""
    y = torch.tensor(labels, dtype=torch.int64)
    if isinstance(images[0], torch.Tensor):
        x = torch.stack(images)
        return (x.float().sub_(mean255).div_(std255) if x.dtype == torch.uint8 else x.float()).contiguous(), y
    # NCHW while still uint8 (a quarter of the bytes), then normalised in place: 4x faster than permuting
    # floats and copying them contiguous afterwards (1.39 -> 0.35 ms per 224x224 image, one core)
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous().float()
    return x.sub_(mean255).div_(std255), y


def as_chw(out) -> torch.Tensor:
    """A user transform's output (a CHW tensor, a PIL image or an HWC array) -> a CHW tensor."""
    if isinstance(out, torch.Tensor):
        return out
    arr = np.array(out)  # a writable copy (a PIL image's array is read-only; torch would share it)
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=2)
    return torch.from_numpy(arr).permute(2, 0, 1)


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


# -- labels ----------------------------------------------------------------------------------
_INDEX = re.compile(r"[+-]?[0-9]+")  # int() also takes "1_0" (10) and other scripts' digits: a label does not
MAX_CLASSES = 2**31  # a class index past it is no class (and overflows the int64 collate on the way)


def parse_label(sample: dict, field: str, classes: dict) -> int:
    """The class index in `field` ("cls", "txt", ..., or "json:key.subkey"): an integer (ASCII digits only:
    "1_0" is refused, not read as 10), or a class name found in `classes` (name -> index)."""
    name, _, path = field.partition(":")
    value = sample[name]
    if path:
        try:
            value = json.loads(value)
        except RecursionError:  # a label nested thousands deep: damaged, named (skip_corrupt skips it)
            raise ValueError(f"{name} is JSON nested too deep to read") from None
        for k in path.split("."):
            if not isinstance(value, dict) or k not in value:
                raise ValueError(f"{name} has no key {path!r}")
            value = value[k]
    elif isinstance(value, bytes):
        value = value.decode("utf-8").strip()
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"label {value!r:.40} in {field!r} is neither a class index nor a class name")
    if isinstance(value, str) and value in classes:
        return classes[value]
    if isinstance(value, str) and not _INDEX.fullmatch(value):
        where = f"not one of the {len(classes)} classes given" if classes else "pass classes=[names] to map names"
        raise ValueError(f"label {value!r:.40} in {field!r} is no class index: {where}")
    index = int(value)
    if not -MAX_CLASSES < index < MAX_CLASSES:
        raise ValueError(f"label {str(value):.40} in {field!r} is too large for a class index")
    return index


def class_index(classes) -> dict:
    """`classes` (a list of names, or a dict name -> index) as a dict name -> index; duplicate names, and
    indices that are not non-negative ints (a bool, a string, a float), are refused naming the setting."""
    if isinstance(classes, dict):
        bad = {k: v for k, v in classes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0}
        if bad:
            raise ValueError(f"classes: indices must be ints >= 0, got {dict(list(bad.items())[:3])!r}")
        return {str(k): v for k, v in classes.items()}
    names = [str(c) for c in classes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"classes: names given twice: {dup[:5]} (each name must map to one index)")
    return {n: i for i, n in enumerate(names)}


def check_image_size(image_size):
    """image_size= as (height, width) of positive ints, or None; anything else refused naming the setting."""
    if image_size is None:
        return None
    size = (image_size, image_size) if isinstance(image_size, int) and not isinstance(image_size, bool) else image_size
    if (
        not isinstance(size, (tuple, list))
        or len(size) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in size)
    ):
        raise ValueError(f"image_size={image_size!r}: expected a positive int or (height, width) of positive ints")
    return tuple(size)


def check_crop_scale(scale) -> tuple:
    """crop_scale= as (low, high) area shares with 0 < low <= high <= 1, else refused naming the setting."""
    ok = isinstance(scale, (tuple, list)) and len(scale) == 2
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scale)
    if not ok or not 0 < scale[0] <= scale[1] <= 1:
        raise ValueError(f"crop_scale={scale!r}: expected (low, high) with 0 < low <= high <= 1 (shares of the area)")
    return (float(scale[0]), float(scale[1]))
