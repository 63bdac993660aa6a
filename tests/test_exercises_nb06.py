"""Notebook 06's checkers: each passes a right answer and turns away the wrong or half-right ones."""

import io
import math

import pytest
from PIL import Image

from data_tools import make_loader
from data_tools.sources import PHOTO_CLASSES
from labkit.lessons.exercises import NotDone, Wrong, nb06


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))


def _jpeg(image, fmt="JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_to_sample():
    def right(key, image, label, name):
        return {"__key__": key, "jpg": _jpeg(image, quality=90), "cls": label, "json": {"photo": name}}

    assert "read back" in nb06.check_to_sample(right)
    with pytest.raises(NotDone):
        nb06.check_to_sample(...)
    with pytest.raises(Wrong, match='"jpg" holds a PNG image'):
        nb06.check_to_sample(lambda k, im, y, n: dict(right(k, im, y, n), jpg=_jpeg(im, "PNG")))
    with pytest.raises(Wrong, match="store it uncropped"):
        nb06.check_to_sample(lambda k, im, y, n: dict(right(k, im, y, n), jpg=_jpeg(im[8:, 8:])))
    with pytest.raises(Wrong, match='"jpg" must hold the encoded JPEG as bytes, got ndarray'):
        nb06.check_to_sample(lambda k, im, y, n: dict(right(k, im, y, n), jpg=im))
    with pytest.raises(Wrong, match=r"sample \d+: json is .* want"):  # the class name of another class
        nb06.check_to_sample(lambda k, im, y, n: dict(right(k, im, y, n), json={"photo": PHOTO_CLASSES[0]}))
    with pytest.raises(Wrong, match=r"sample 0: cls holds b''"):
        nb06.check_to_sample(lambda k, im, y, n: {a: b for a, b in right(k, im, y, n).items() if a != "cls"})
    with pytest.raises(Wrong, match=r"sample 0: cls holds b'\w+', the class index is \d+"):  # a loader maps names
        nb06.check_to_sample(lambda k, im, y, n: dict(right(k, im, y, n), cls=n))
    cached = {}

    def first_jpeg_cached(k, im, y, n):  # one encoded picture for every sample
        cached.setdefault("jpg", _jpeg(im, quality=90))
        return dict(right(k, im, y, n), jpg=cached["jpg"])

    with pytest.raises(Wrong, match=r"sample [1-9]\d*: (jpg is a JPEG|its JPEG differs)"):
        nb06.check_to_sample(first_jpeg_cached)
    with pytest.raises(Wrong, match='"__key__" must be the key you were given'):
        nb06.check_to_sample(lambda k, im, y, n: dict(right(k, im, y, n), __key__="same"))


def test_eval_loader():
    def right(urls, batch_size, size):
        return make_loader(urls, batch_size, train=False, image_size=size, label="json:photo", classes=PHOTO_CLASSES)

    assert "labels from json" in nb06.check_eval_loader(right)
    with pytest.raises(NotDone):
        nb06.check_eval_loader(lambda urls, b, s: ...)

    def augmented(urls, batch_size, size):  # a training loader: random crops, and only full batches
        return make_loader(
            urls, batch_size, train=True, image_size=size, label="json:photo", classes=PHOTO_CLASSES, num_samples=20
        )

    with pytest.raises(Wrong, match=r"batches, want|differs between two passes|not the centre crop"):
        nb06.check_eval_loader(augmented)
    for _ in range(3):  # the photo count never divides the batch: a dropped last batch fails every call
        with pytest.raises(Wrong, match=r"batches, want"):
            nb06.check_eval_loader(
                lambda urls, b, s: make_loader(
                    urls, b, train=False, image_size=s, label="json:photo", classes=PHOTO_CLASSES, last_batch="drop"
                )
            )
    with pytest.raises(Wrong, match="has no 'cls' field"):
        nb06.check_eval_loader(lambda urls, b, s: make_loader(urls, b, train=False, image_size=s))
    with pytest.raises(Wrong, match="should be"):
        nb06.check_eval_loader(
            lambda urls, b, s: make_loader(
                urls, b, train=False, image_size=32, label="json:photo", classes=PHOTO_CLASSES
            )
        )
    with pytest.raises(Wrong, match="is no class index"):
        nb06.check_eval_loader(lambda urls, b, s: make_loader(urls, b, train=False, image_size=s, label="json:photo"))


def test_workers_needed():
    assert "cases" in nb06.check_workers_needed(lambda s, b, t: max(1, math.ceil(s * b / t - 1e-9)))
    with pytest.raises(NotDone):
        nb06.check_workers_needed(...)
    with pytest.raises(Wrong, match="want 2"):
        nb06.check_workers_needed(lambda s, b, t: round(s * b / t) + 1)  # one too many where it divides
    with pytest.raises(Wrong, match=r"want \d"):
        nb06.check_workers_needed(lambda s, b, t: int(s * b / t))  # rounded down: the pipeline falls behind
    with pytest.raises(Wrong, match="a count is a whole number"):
        nb06.check_workers_needed(lambda s, b, t: s * b / t)
