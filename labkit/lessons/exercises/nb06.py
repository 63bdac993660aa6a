"""Checkers for notebook 06 (bring your own WebDataset), and the notebook's slow link.

Each checker runs the learner's code on data it makes itself (real photo crops, a new seed, batch size and image
size on every call) and judges what comes out of the loader: the bytes webdataset's ShardWriter stored, the
batches make_loader yields, the number of workers a measured pipeline needs. No answer text is read.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import tempfile
import time

import numpy as np

from labkit.lessons.exercises import Wrong, call, integer, require, todo

__all__ = ["SlowLink", "check_eval_loader", "check_to_sample", "check_workers_needed", "write_reference"]

_calls = itertools.count(1)


class SlowLink:
    """A transform that first waits `delay_s` per sample (a sleep: no CPU used, as a remote bucket's latency
    would cost), then runs `transform`. It makes the feed meter's lesson visible on any machine: on a 2-core
    host the model and the decoders share the same cores, so real decoding alone cannot show workers helping."""

    def __init__(self, transform, delay_s: float):
        self.transform, self.delay_s = transform, float(delay_s)

    def __call__(self, image):
        time.sleep(self.delay_s)
        return self.transform(image)


def reference_sample(key: str, image: np.ndarray, label: int, class_name: str) -> dict:
    """The sample the first exercise asks for: JPEG bytes, the class index and a json with the class name."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=90)
    return {"__key__": key, "jpg": buf.getvalue(), "cls": label, "json": {"photo": class_name}}


def write_reference(folder: str, images, labels, classes, to_sample=reference_sample, per_shard: int = 40):
    """Shards written by webdataset's ShardWriter from to_sample(key, image, label, class_name); their URLs."""
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    with wds.ShardWriter(os.path.join(folder, "photos-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (img, y) in enumerate(zip(images, labels)):
            sink.write(to_sample(f"photo{i:05d}", img, int(y), classes[int(y)]))
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar"))


def _photos(k: int, n: int):
    from data_tools.sources import sample_photos

    return sample_photos(n, seed=1000 + k, sides=(64, 200))


def _stored(urls) -> dict[str, dict[str, bytes]]:
    """Every sample's fields as the tar files hold them: {key: {extension: bytes}}, read with tarfile (no loader
    that could map or forgive a field)."""
    import tarfile

    out: dict[str, dict[str, bytes]] = {}
    for url in urls:
        with tarfile.open(url) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    key, _, ext = member.name.partition(".")
                    out.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return out


def _same_sample(fields: dict[str, bytes], image, label: int, name: str, i: int) -> None:
    """One written sample, byte by byte: `cls` the class index as text, `json` {"photo": name}, `jpg` a JPEG of
    this very photo (not another one, not the first one cached)."""
    import json

    from PIL import Image

    require(
        fields.get("cls", b"").strip() == str(label).encode(),
        f"sample {i}: cls holds {fields.get('cls', b'')[:20]!r}, the class index is {label}: store the index (an int)",
    )
    try:
        meta = json.loads(fields.get("json", b"null"))
    except ValueError:
        raise Wrong(f"sample {i}: json holds {fields.get('json', b'')[:30]!r}, not JSON") from None
    require(
        isinstance(meta, dict) and meta.get("photo") == name,
        f'sample {i}: json is {meta!r}, want {{"photo": {name!r}}}',
    )
    try:
        im = Image.open(io.BytesIO(fields.get("jpg", b"")))
        im.load()
    except Exception as e:
        raise Wrong(f"sample {i}: jpg is not an image Pillow can open: {e}") from None
    h, w = image.shape[:2]
    require(im.format == "JPEG" and im.size == (w, h), f"sample {i}: jpg is a {im.format} {im.size}, the photo {w}x{h}")
    diff = float(np.abs(np.asarray(im.convert("RGB"), dtype=np.int16) - image).mean())
    require(diff < 12, f"sample {i}: its JPEG differs from its photo by {diff:.0f} grey levels: another picture?")


def check_to_sample(to_sample) -> str:
    """06.to_sample: to_sample(key, image, label, class_name) -> a dict for ShardWriter. Judged by writing the
    dicts with ShardWriter and reading the shards back: the key, a JPEG of the same picture, the class index in
    `cls` and the class name under "photo" in `json` (the loader reads labels from both). Every written sample's
    stored bytes are read back with tarfile and compared with its own photo, index and name."""
    from PIL import Image

    from data_tools import make_loader

    todo(to_sample)
    k = next(_calls)
    images, labels, classes = _photos(k, 12)
    out = call(to_sample, "probe", images[0], int(labels[0]), classes[int(labels[0])])
    require(isinstance(out, dict), f"return a dict (field -> value), got {type(out).__name__}")
    require(out.get("__key__") == "probe", f'"__key__" must be the key you were given, got {out.get("__key__")!r}')
    jpg = out.get("jpg")
    require(isinstance(jpg, bytes), f'"jpg" must hold the encoded JPEG as bytes, got {type(jpg).__name__}')
    try:
        im = Image.open(io.BytesIO(jpg))
        im.load()
    except Exception as e:
        raise Wrong(f'"jpg" is not an image Pillow can open: {e}') from None
    require(im.format == "JPEG", f'"jpg" holds a {im.format} image: save it with format="JPEG"')
    h, w = images[0].shape[:2]
    require(im.size == (w, h), f"the JPEG is {im.size[0]}x{im.size[1]}, the photo {w}x{h}: store it uncropped")
    diff = float(np.abs(np.asarray(im.convert("RGB"), dtype=np.int16) - images[0]).mean())
    require(diff < 12, f"the JPEG differs from the photo by {diff:.0f} grey levels on average: another picture?")
    with tempfile.TemporaryDirectory() as d:
        try:
            urls = write_reference(d, images, labels, classes, to_sample=lambda *a: call(to_sample, *a), per_shard=6)
        except Wrong:  # the learner's own error, already worded
            raise
        except Exception as e:
            raise Wrong(f"webdataset's ShardWriter cannot write your dict: {type(e).__name__}: {e}") from None
        stored = _stored(urls)
        require(
            sorted(stored) == [f"photo{i:05d}" for i in range(len(images))],
            f"the shards hold the keys {sorted(stored)[:3]}...: use the key you were given",
        )
        for i, (img, y) in enumerate(zip(images, labels)):
            _same_sample(stored[f"photo{i:05d}"], img, int(y), classes[int(y)], i)
        for label in ("cls", "json:photo"):
            ld = make_loader(urls, 4, train=False, image_size=32, label=label, classes=classes, num_samples=12)
            try:
                got = [int(v) for _, y in ld for v in y]
            except Exception as e:
                raise Wrong(f"reading the labels from {label!r} failed: {e}") from None
            require(got == [int(v) for v in labels], f"labels read from {label!r} are {got}, written {labels.tolist()}")
    return "12 photos written with ShardWriter, every stored field read back: same pictures, index in cls, name in json"


def check_eval_loader(eval_loader) -> str:
    """06.eval_loader: eval_loader(urls, batch_size, size) -> batches (x, y) for evaluation. Judged against shards
    with only `jpg` and `json` (no `cls`): every photo once (the last batch padded with label -100), images
    (B, 3, size, size) with the centre crop (the same batches on a second pass, equal to labkit's own), labels
    from the json's class name."""
    import torch

    from data_tools import make_loader
    from data_tools.sources import PHOTO_CLASSES

    todo(eval_loader)
    k = next(_calls)
    batch, size = 8 + 4 * (k % 2), 40 + 8 * (k % 3)
    n = 2 * batch + 1 + (7 * k) % (batch - 1)  # never a multiple of the batch: there is a short last batch
    images, labels, classes = _photos(k, n)

    def json_only(key, img, y, name):
        s = reference_sample(key, img, y, name)
        del s["cls"]
        return s

    with tempfile.TemporaryDirectory() as d:
        urls = write_reference(d, images, labels, classes, to_sample=json_only, per_shard=8)
        want = make_loader(urls, batch, train=False, image_size=size, label="json:photo", classes=PHOTO_CLASSES)
        want = list(want)
        passes = []
        for _ in range(2):
            loader = call(eval_loader, urls, batch, size)
            try:
                passes.append(list(loader))
            except Exception as e:
                first = str(e).splitlines()[0] if str(e) else ""
                raise Wrong(f"iterating your loader raised {type(e).__name__}: {first}") from None
    got = passes[0]
    require(len(got) == len(want), f"{len(got)} batches, want {len(want)} ({n} photos in batches of {batch}, padded)")
    for i, (b, w) in enumerate(zip(got, want)):
        require(isinstance(b, (tuple, list)) and len(b) == 2, f"batch {i}: yield (x, y), got {type(b).__name__}")
        x, y = b
        require(
            torch.is_tensor(x) and tuple(x.shape) == tuple(w[0].shape), f"batch {i}: x should be {tuple(w[0].shape)}"
        )
        require(torch.equal(y, w[1]), f"batch {i}: labels {y.tolist()}, want {w[1].tolist()} (from json 'photo')")
        require(torch.equal(x, passes[1][i][0]), f"batch {i} differs between two passes: evaluation must not augment")
        require(
            bool(torch.allclose(x, w[0], atol=1e-4)), f"batch {i}: not the centre crop at {size}x{size} (train=False)"
        )
    return f"{n} photos, batches of {batch} at {size}x{size}, labels from json"


def check_workers_needed(workers_needed) -> str:
    """06.workers: workers_needed(sample_s, batch_size, step_s) -> the fewest loader workers that prepare one
    batch per step (each worker makes its own batches, one sample after another). Judged on varied inputs."""
    todo(workers_needed)
    k = next(_calls)
    rng = np.random.default_rng(k)
    cases = [(0.004, 32, 0.064), (0.005, 16, 0.02), (0.002, 64, 0.5)]  # exactly 2, exactly 4, less than 1
    cases += [
        (float(rng.uniform(0.001, 0.02)), int(rng.integers(8, 129)), float(rng.uniform(0.01, 0.3))) for _ in range(5)
    ]
    for sample_s, batch, step_s in cases:
        want = max(1, math.ceil(round(sample_s * batch / step_s, 9)))
        got = integer(call(workers_needed, sample_s, batch, step_s), "your answer")
        require(
            got == want,
            f"workers_needed({sample_s:.4g}, {batch}, {step_s:.4g}) = {got}, want {want}: one worker makes a batch "
            "in sample_s x batch_size seconds; how many must work side by side to deliver one every step_s?",
        )
    return f"{len(cases)} cases"
