"""Feeding a chip from a WebDataset of photos: decoders, labkit's stream beside webdataset's own pipeline,
images/s per host core, and the cores one chip needs.

    .venv/bin/python bench/bench_feed.py [--photos 400] [--trials 3]

The photos: real JPEGs (quality 90) of 160-427 px a side cut from scikit-learn's two sample photos
(data_tools.sources.sample_photos; ImageNet's average is ~400x350), written with webdataset's own
ShardWriter (jpg + cls, no labkit manifest), so that nothing labkit writes is assumed. The decoders are
also timed on 20 phone-sized photos (the two enlarged to 1920x1280), where a reduced decode matters.

1. Decoders, one image at a time on one core, to 224 and to 64, each with the same random-resized crop:
   labkit's fit_image (Pillow's reduced "draft" decode where the crop is >= 2x the output, else
   torchvision.io.decode_jpeg; torch's antialiased resize), Pillow decoding the whole image or a draft
   then Pillow's resize, and torchvision.io.decode_jpeg + torchvision.transforms.v2's resized crop.
   simplejpeg is timed when installed.
2. One pipeline against the other, in one run, doing the same work (decode + random-resized crop + flip
   + normalise, batches of 64): labkit's make_loader(image_size=S, flip=True) and webdataset's
   WebDataset(...).shuffle().decode("pil").to_tuple().map_tuple(v2 transforms).batched(), both in the
   main process (num_workers=0: images/s per host core). The ratio labkit / webdataset (goal >= 1).
3. Host cores needed to feed one chip at a stated demand: a TPU's from public figures; an H200's measured
   (ResNet-50, 224 px, bf16, channels_last + torch.compile, a hand loop, 2026-11-28: 5,578 images/s), and 8 of them
   for one node.
4. --formats jpg,png: the pipeline of 2. on the same photos stored as PNG (lossless: larger files, a slower decode).
5. --gpu-decode cuda: torchvision.io.decode_jpeg on the GPU, a batch of JPEG byte tensors per call (nvJPEG), then
   each image's crop resized to 224 on the GPU: images/s of one GPU's decode, against its demand. The host only
   reads the bytes. (--gpu-decode cpu runs the same calls on the CPU: the GPU check's dry run.)

Best of --trials per figure (the least disturbed on a shared machine); figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from data_tools import make_loader  # noqa: E402
from data_tools.sources import sample_photos  # noqa: E402
from data_tools.transforms import IMAGENET_MEAN, IMAGENET_STD, crop_box, fit_image  # noqa: E402

# Training images/s one chip consumes, from public reports, NOT measured here (no TPU on this machine):
# ResNet-50 at 224 px on one TPU v5e chip in bf16 is reported at roughly 2,500 img/s (MLPerf-style runs);
# a small ResNet at 64 px asks several times more. Change it to your own model's figure.
CHIP_DEMAND = {224: 2500, 64: 10000}
# One NVIDIA H200, measured (a hand-written loop, ResNet-50 at 224 px, bf16, channels_last, torch.compile, batch 128,
# 2026-11-28): 5,578 images/s. A node holds 8.
GPU_DEMAND, GPUS_PER_NODE = {224: 5578}, 8


def best(fn, trials: int) -> float:
    out = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def write_photos(folder: str, n: int, fmt: str = "jpg") -> tuple[list[str], list[bytes]]:
    import webdataset as wds
    from PIL import Image

    images, labels, _ = sample_photos(n, seed=0)
    jpegs = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, **({"format": "JPEG", "quality": 90} if fmt == "jpg" else {"format": "PNG"}))
        jpegs.append(buf.getvalue())
    folder = os.path.join(folder, fmt)
    os.makedirs(folder, exist_ok=True)
    with wds.ShardWriter(os.path.join(folder, "photos-%06d.tar"), maxcount=100, verbose=0) as sink:
        for i, (data, label) in enumerate(zip(jpegs, labels)):
            sink.write({"__key__": f"p{i:06d}", fmt: data, "cls": str(int(label)).encode()})
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar")), jpegs


def gpu_decode(jpegs: list[bytes], device: str, batch: int, trials: int, size: int = 224) -> float:
    """images/s of torchvision's batched decode_jpeg on `device`, plus a random crop of each resized to size."""
    import torch.nn.functional as F
    from torchvision.io import decode_jpeg

    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in jpegs]
    rng = np.random.default_rng(0)

    def run():
        for i in range(0, len(data) - batch + 1, batch):
            imgs = decode_jpeg(data[i : i + batch], device=device)
            out = []
            for img in imgs:
                h, w = img.shape[-2:]
                s = int(min(h, w) * rng.uniform(0.5, 1.0))
                y, x = int(rng.integers(0, h - s + 1)), int(rng.integers(0, w - s + 1))
                crop = img[None, :, y : y + s, x : x + s].float()
                out.append(F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True))
            torch.cat(out)
        if device == "cuda":
            torch.cuda.synchronize()

    run()  # warm: nvJPEG's handles, the allocator
    return (len(data) // batch) * batch / best(run, trials)


def large_jpegs(n: int = 20) -> list[bytes]:
    """Phone-sized photos: the two sample photos enlarged to 1920x1280 (bicubic), turned a little each time."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    out = []
    for i in range(n):
        big = Image.fromarray(load_sample_images().images[i % 2]).resize((1920, 1280), Image.BICUBIC)
        buf = io.BytesIO()
        big.rotate(3 * i).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def time_decoders(jpegs: list[bytes], size: int, trials: int) -> None:
    base = None
    for name, fn in decoders(size).items():
        rng = np.random.default_rng(0)
        ms = 1e3 * best(lambda fn=fn, rng=rng: [fn(data, rng) for data in jpegs], trials) / len(jpegs)
        base = base or ms
        print(f"  {name:36s} {ms:6.2f} ms   {base / ms:4.2f}x labkit's speed")


def decoders(size: int):
    """name -> fn(jpeg bytes, rng) -> an image of size x size (HWC uint8 or CHW tensor)."""
    from PIL import Image
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import functional as F

    def pil(data, rng, draft):
        im = Image.open(io.BytesIO(data))
        box = crop_box(*im.size, (size, size), rng, train=True)
        if draft:  # Pillow's reduced JPEG decode, scaled so that the crop stays >= size
            w, h = im.size
            im.draft("RGB", (int(w * size / (box[2] - box[0])) + 1, int(h * size / (box[3] - box[1])) + 1))
            fx, fy = im.size[0] / w, im.size[1] / h
            box = (box[0] * fx, box[1] * fy, min(box[2] * fx, im.size[0]), min(box[3] * fy, im.size[1]))
        return np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR, box=box))

    def tv_decode_jpeg(data, rng):
        x = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        left, top, right, bottom = crop_box(x.shape[2], x.shape[1], (size, size), rng, train=True)
        return F.resized_crop(
            x, int(top), int(left), int(bottom - top), int(right - left), [size, size], antialias=True
        )

    out = {
        "labkit fit_image": lambda data, rng: fit_image(data, (size, size), rng, train=True),
        "PIL full decode + PIL resize": lambda data, rng: pil(data, rng, draft=False),
        "PIL draft decode + PIL resize": lambda data, rng: pil(data, rng, draft=True),
        "torchvision.io.decode_jpeg + v2": tv_decode_jpeg,
    }
    try:
        import simplejpeg

        def sj(data, rng):
            im = Image.fromarray(simplejpeg.decode_jpeg(data, min_height=size, min_width=size))
            box = crop_box(*im.size, (size, size), rng, train=True)
            return np.asarray(im.resize((size, size), Image.BILINEAR, box=box))

        out["simplejpeg (reduced) + PIL resize"] = sj
    except ImportError:
        print("  (simplejpeg not installed: not timed)")
    return out


def webdataset_pipeline(urls: list[str], size: int, batch: int):
    """webdataset's own way to the same batches, with torchvision's transforms."""
    import webdataset as wds
    from torchvision.transforms import v2

    tf = v2.Compose(
        [
            v2.PILToTensor(),
            v2.RandomResizedCrop(size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    return (
        wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=None, empty_check=False)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(tf, int)
        .batched(batch, partial=False)
    )


def images_per_s(make, trials: int) -> float:
    n = {"images": 0}

    def run():
        n["images"] = sum(int(x.shape[0]) for x, _ in make())

    seconds = best(run, trials)
    return n["images"] / seconds


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--photos", type=int, default=400)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--formats", default="jpg", help="jpg,png: the pipeline also on PNG shards of the same photos")
    p.add_argument("--gpu-decode", choices=("cuda", "cpu"), help="only the batched decode_jpeg on this device (5.)")
    a = p.parse_args(argv)
    if a.gpu_decode:
        with tempfile.TemporaryDirectory(prefix="bench-feed-") as d:
            _, jpegs = write_photos(d, a.photos)
            rate = gpu_decode(jpegs, a.gpu_decode, min(a.batch, len(jpegs)), a.trials)
        print(f"decode_jpeg on {a.gpu_decode}, batches of {min(a.batch, len(jpegs))}, crop + resize to 224 there")
        print(
            f"FEED gpu decode {rate:.0f} images/s on {a.gpu_decode} ({rate / GPU_DEMAND[224]:.2f}x one H200's demand)"
        )
        return
    torch.set_num_threads(1)  # one host core per figure: what one loader worker gets
    with tempfile.TemporaryDirectory() as d:
        urls, jpegs = write_photos(d, a.photos)
        big = large_jpegs()
        sides = [s for data in jpegs[:50] for s in __import__("PIL.Image").Image.open(io.BytesIO(data)).size]
        mb = sum(map(len, jpegs)) / len(jpegs) / 1e3
        print(f"{len(jpegs)} JPEGs, {min(sides)}-{max(sides)} px a side, {mb:.0f} KB on average, {len(urls)} shards")
        per_core = {}
        for size in (224, 64):
            print(f"\n== to {size}x{size}: decode + crop + resize, ms per image (one core, best of {a.trials})")
            time_decoders(jpegs, size, a.trials)
            print(f"   the same for {len(big)} photos of 1920x1280 ({sum(map(len, big)) / len(big) / 1e3:.0f} KB)")
            time_decoders(big, size, a.trials)
            print(f"== to {size}x{size}: whole pipeline, batches of {a.batch}, main process (img/s per core)")
            os.environ.setdefault("LABKIT_CACHE", os.path.join(d, "cache"))
            ours = images_per_s(
                lambda s=size: make_loader(urls, a.batch, train=True, image_size=s, flip=True, verify=False), a.trials
            )
            theirs = images_per_s(lambda s=size: webdataset_pipeline(urls, s, a.batch), a.trials)
            per_core[size] = ours
            print(f"  labkit make_loader(image_size={size}, flip=True)  {ours:7.0f} img/s")
            print(f"  webdataset + torchvision v2 ({size})              {theirs:7.0f} img/s")
            print(f"  ratio labkit / webdataset: {ours / theirs:.2f}")
        png = {}
        for fmt in [f for f in a.formats.split(",") if f and f != "jpg"]:
            purls, _ = write_photos(d, a.photos, fmt)
            png[fmt] = images_per_s(
                lambda u=purls: make_loader(u, a.batch, train=True, image_size=224, flip=True, verify=False), a.trials
            )
            print(f"== {fmt.upper()}: labkit make_loader(image_size=224, flip=True)  {png[fmt]:7.0f} img/s per core")
    print("\n== host cores to feed one chip (a TPU's demand: public figures, not verified here)")
    for size, rate in per_core.items():
        need = CHIP_DEMAND[size]
        print(f"  {size} px: {need} img/s per chip / {rate:.0f} img/s per core = {need / rate:.1f} cores")
    for fmt, rate in [("jpg", per_core.get(224))] + list(png.items()):
        if rate:
            need = GPU_DEMAND[224] / rate
            print(
                f"FEED {fmt} 224 px: {rate:.0f} images/s per core; one H200 ({GPU_DEMAND[224]:,} images/s) needs "
                f"{need:.0f} cores, a node of {GPUS_PER_NODE} needs {need * GPUS_PER_NODE:.0f}"
            )


if __name__ == "__main__":
    main()
