"""Notebook 01's checkers: a right answer passes; answers that are wrong, faked or crash say "not yet"."""

import pytest
import torch

import labkit
from labkit.lessons.exercises import NotDone, Wrong, nb01


@pytest.fixture(scope="module")
def rt():
    return labkit.setup("xla-cpu")


def test_feed_bytes_is_measured_by_torch_xla(rt):
    assert "every byte accounted for" in nb01.check_feed_bytes(lambda b, c, h, w: b * c * h * w * 4 + 8 * b, rt)
    with pytest.raises(Wrong, match="images only; the labels travel too"):
        nb01.check_feed_bytes(lambda b, c, h, w: b * c * h * w * 4, rt)
    with pytest.raises(Wrong, match="not as uint8 pixels"):
        nb01.check_feed_bytes(lambda b, c, h, w: b * c * h * w + 8 * b, rt)
    with pytest.raises(Wrong, match=r"you say 98,368 bytes, torch_xla's OutboundData counted"):
        nb01.check_feed_bytes(lambda b, c, h, w: 98_368, rt)  # one shape's answer, hard-coded
    with pytest.raises(Wrong, match="must be a number"):
        nb01.check_feed_bytes(lambda b, c, h, w: str(b * c * h * w * 4 + 8 * b), rt)
    with pytest.raises(NotDone):
        nb01.check_feed_bytes(lambda b, c, h, w: ..., rt)


def test_feed_bytes_off_xla_uses_the_tensors_sizes():
    cpu = labkit.Runtime("cpu", torch.device("cpu"))
    assert "accounted" in nb01.check_feed_bytes(lambda b, c, h, w: b * c * h * w * 4 + 8 * b, cpu)


class AlwaysEqual:
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


def test_pad_labels():
    def right(y, batch):
        return torch.cat([y, torch.full((batch - len(y),), -100, dtype=y.dtype)])

    assert "nothing to the loss" in nb01.check_pad_labels(right)
    with pytest.raises(Wrong, match="padding must be -100"):
        nb01.check_pad_labels(lambda y, b: torch.cat([y, torch.zeros(b - len(y), dtype=y.dtype)]))
    with pytest.raises(Wrong, match="return a tensor, got AlwaysEqual"):
        nb01.check_pad_labels(lambda y, b: AlwaysEqual())
    with pytest.raises(Wrong, match=r"your code raised RuntimeError: .*\(at test_exercises_nb01.py:\d+\)"):
        nb01.check_pad_labels(lambda y, b: torch.cat([y, torch.full((b,), -100)]).view(5, 7))


def test_resume_position():
    assert "exactly once" in nb01.check_resume_position(lambda step, per: divmod(step, per))
    with pytest.raises(Wrong, match="the next batch to train is"):
        nb01.check_resume_position(lambda step, per: divmod(step + 1, per))
    with pytest.raises(Wrong, match="return the pair"):
        nb01.check_resume_position(lambda step, per: step)
    with pytest.raises(NotDone):
        nb01.check_resume_position(lambda step, per: None)  # the placeholder body: unpacking it crashed before
    with pytest.raises(Wrong, match="must be a number"):
        nb01.check_resume_position(lambda step, per: (AlwaysEqual(), AlwaysEqual()))
