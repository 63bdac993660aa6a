"""Any WebDataset in, static shapes out: shards that webdataset's own ShardWriter wrote (no labkit manifest),
photos of mixed sizes and formats, labels from cls / json / txt, streamed at a fixed size."""

import io
import json
import os

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from data_tools import ShardError, make_loader
from data_tools.stream import PAD_LABEL, count_samples
from data_tools.transforms import crop_box, fit_image

CLASSES = ["red", "green", "blue"]


def _photo(rng, label: int, w: int, h: int) -> Image.Image:
    """A photo-like image whose dominant colour is its class (so labels can be checked from pixels)."""
    img = rng.integers(0, 60, size=(h, w, 3)).astype(np.uint8)
    img[..., label] += 180
    return Image.fromarray(img)


def _encode(im: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format={"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt], quality=90)
    return buf.getvalue()


def write_photos(folder, n=60, per_shard=16, seed=0, fields=("cls", "json", "txt")):
    """n photos of 48-120 px a side in jpg/png/webp, written with webdataset's ShardWriter (no manifest)."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    with wds.ShardWriter(os.path.join(folder, "train-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            label = int(rng.integers(0, 3))
            fmt = ("jpg", "png", "webp")[i % 3]
            w, h = (int(v) for v in rng.integers(48, 121, size=2))
            sample = {"__key__": f"s{i:05d}", fmt: _encode(_photo(rng, label, w, h), fmt)}
            if "cls" in fields:
                sample["cls"] = str(label).encode()
            if "json" in fields:
                sample["json"] = json.dumps({"meta": {"label": CLASSES[label]}, "size": [w, h]}).encode()
            if "txt" in fields:
                sample["txt"] = CLASSES[label].encode()
            sink.write(sample)
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".tar"))
    return [os.path.join(folder, f) for f in shards]


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return write_photos(str(tmp_path_factory.mktemp("photos")))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))


def _dominant(x, mean, std):
    """The class a batch image shows: its brightest channel after undoing the normalisation."""
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    return (x * s + m).mean(dim=(2, 3)).argmax(dim=1)


@pytest.mark.parametrize("label", ["cls", "json:meta.label", "txt"])
@pytest.mark.parametrize("train", [True, False])
def test_mixed_sizes_stream_at_a_fixed_size_with_correct_labels(photos, label, train):
    ld = make_loader(photos, 8, train=train, image_size=40, label=label, classes=CLASSES, flip=True)
    seen = 0
    for x, y in ld:
        assert x.shape == (8, 3, 40, 40) and x.dtype == torch.float32 and y.dtype == torch.int64
        real = y != PAD_LABEL
        assert (_dominant(x[real], ld.mean, ld.std) == y[real]).all()
        seen += int(real.sum())
    assert seen == (56 if train else 60)  # training: 60 // 8 full batches; evaluation: all, padded
    assert ld.class_names == CLASSES and ld.mean == (0.485, 0.456, 0.406)  # ImageNet's for photos


def test_counted_once_and_cached(photos, tmp_path):
    counts = count_samples(photos)
    assert counts == [16, 16, 16, 12]
    cached = json.loads((tmp_path / "cache" / "shard-counts.json").read_text())
    assert sorted(cached.values()) == [12, 16, 16, 16]
    # the cache answers without reading: a shard's bytes are no longer needed (key: path, size, mtime)
    key = next(k for k in cached if k.startswith(os.path.abspath(photos[0])))
    cached[key] = 5
    (tmp_path / "cache" / "shard-counts.json").write_text(json.dumps(cached))
    assert count_samples(photos)[0] == 5
    assert len(make_loader(photos, 10, train=True, image_size=32, num_samples=60)) == 6


def test_random_resized_crop_and_centre_crop_regions():
    rng = np.random.default_rng(0)
    for _ in range(200):
        left, top, right, bottom = crop_box(300, 200, (64, 64), rng, train=True)
        area = (right - left) * (bottom - top)
        assert 0 <= left < right <= 300 and 0 <= top < bottom <= 200 and 0.079 * 60000 <= area <= 60000
        assert 3 / 4 - 0.02 <= (right - left) / (bottom - top) <= 4 / 3 + 0.02
    # evaluation: the shorter side resized to 64 / 0.875, its centre kept: 175 px of the 200 (87.5 %)
    assert crop_box(300, 200, (64, 64), rng, train=False) == (62.5, 12.5, 237.5, 187.5)


@pytest.mark.parametrize("size", [64, 300])  # 640x480 to 64: a reduced decode; to 300: torchvision's decoder
def test_fast_decoders_match_a_full_pillow_decode(size):
    """The reduced decode and torchvision's decoder are optimisations only: the same picture as Pillow's full
    decode with the same crop and resize (within JPEG's and the two resizers' rounding)."""
    rng = np.random.default_rng(1)
    yy, xx = np.mgrid[0:480, 0:640]
    smooth = np.stack([xx * 255 // 640, yy * 255 // 480, (xx + yy) * 255 // 1120], axis=2).astype(np.uint8)
    data = _encode(Image.fromarray(smooth), "jpg")
    fast = fit_image(data, (size, size), np.random.default_rng(0), train=False)
    full = Image.open(io.BytesIO(data)).convert("RGB")
    box = crop_box(640, 480, (size, size), rng, train=False)
    slow = torch.from_numpy(np.array(full.resize((size, size), Image.BILINEAR, box=box))).permute(2, 0, 1)
    assert fast.dtype == torch.uint8 and fast.shape == slow.shape == (3, size, size)
    assert (fast.int() - slow.int()).abs().float().mean() < 3
    # sides that do not divide by the draft's 2, 4 or 8 (its size is rounded up): every crop stays inside
    odd = _encode(Image.fromarray(smooth[:427, :637]), "jpg")
    for train in (True, False):
        assert all(fit_image(odd, (40, 40), rng, train=train).shape == (3, 40, 40) for _ in range(100))


def test_a_torchvision_v2_pipeline_as_the_transform(photos):
    from torchvision.transforms import v2

    pipeline = v2.Compose([v2.RandomResizedCrop(48, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()])
    ld = make_loader(photos, 6, train=True, transform=pipeline, num_workers=2)
    batches = list(ld)
    assert len(batches) == len(ld) == 10 and all(x.shape == (6, 3, 48, 48) for x, _ in batches)
    mean = torch.tensor(ld.mean).view(1, 3, 1, 1)
    assert (_dominant(batches[0][0], ld.mean, ld.std) == batches[0][1]).all() and mean.sum() > 0
    # a float output (after v2.Normalize) is taken as it is; a shape that changes is refused by sample
    floats = v2.Compose([v2.CenterCrop(40), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])
    x, _ = next(iter(make_loader(photos, 4, train=False, transform=floats)))
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    with pytest.raises(ShardError, match=r"sample 's0000\d' cannot be decoded: transform gave shape"):
        list(make_loader(photos, 4, train=False, transform=v2.PILToTensor()))


def test_bad_samples_are_named(tmp_path):
    urls = write_photos(str(tmp_path / "nolabel"), n=8, fields=("json",))
    with pytest.raises(ShardError, match=r"train-000000.tar: sample 's00000' has no 'cls' field \(fields: \["):
        list(make_loader(urls, 4, train=False, image_size=32))
    with pytest.raises(
        ShardError, match=r"sample 's00000': label '\w+' in 'json:meta.label' is no class index: pass classes"
    ):
        list(make_loader(urls, 4, train=False, image_size=32, label="json:meta.label"))
    with pytest.raises(
        ShardError, match=r"sample 's00000': label '\w+' in 'json:meta.label' is no class index: not one"
    ):
        list(make_loader(urls, 4, train=False, image_size=32, label="json:meta.label", classes=["cyan"]))
    with pytest.raises(ShardError, match=r"sample 's00000': json has no key 'class'"):
        list(make_loader(urls, 4, train=False, image_size=32, label="json:class"))
    # a broken image: named with its shard and key, or skipped and counted
    bad = str(tmp_path / "bad")
    os.makedirs(bad)
    with wds.ShardWriter(os.path.join(bad, "train-%06d.tar"), verbose=0) as sink:
        sink.write({"__key__": "ok", "cls": b"1", "jpg": _encode(_photo(np.random.default_rng(0), 1, 50, 60), "jpg")})
        sink.write({"__key__": "broken", "cls": b"2", "jpg": b"\xff\xd8 not a jpeg"})
    url = os.path.join(bad, "train-000000.tar")
    with pytest.raises(ShardError, match=r"train-000000.tar: sample 'broken' cannot be decoded"):
        list(make_loader([url], 2, train=False, image_size=32))
    ld = make_loader([url], 1, train=False, image_size=32, skip_corrupt=True)
    assert len(list(ld)) == 1 and ld.skipped == 1


def test_stored_size_without_image_size_is_still_refused(photos):
    """labkit's own path is unchanged: without image_size a photo of another size is an error naming it."""
    with pytest.raises(ShardError, match=r"cannot be decoded: image is \d+x\d+, expected 32x32"):
        list(make_loader(photos, 8, train=True, num_samples=60))


def test_photos_from_the_gcs_server(gcs_bucket, photos):
    from labkit.cloud import gcs

    for p in photos:
        gcs.blob(f"gs://{gcs_bucket}/photos/{os.path.basename(p)}").upload_from_filename(p)
    url = f"gs://{gcs_bucket}/photos/train-{{000000..000003}}.tar"
    ld = make_loader(url, 10, train=True, image_size=36, label="txt", classes=CLASSES, num_workers=2)
    batches = list(ld)
    assert len(ld) == len(batches) == 6 and all(x.shape == (10, 3, 36, 36) for x, _ in batches)
    assert all((_dominant(x, ld.mean, ld.std) == y).all() for x, y in batches)
