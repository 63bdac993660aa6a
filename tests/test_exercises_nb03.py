"""Notebook 03's checkers: "split dim 0 always", a parameter count for bytes, a bf16 model counted at 4 bytes, the
forward-only Megatron count and a lying __eq__ all fail with a reason; the right answers pass."""

import math

import pytest
import torch

from labkit.lessons.exercises import NotDone, Wrong, nb03


class AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def fsdp(shape, devices, bytes_per=4):
    big = max(shape)
    return math.ceil(big / devices) * math.prod(shape) // big * bytes_per


def test_dp_bytes():
    model = torch.nn.Linear(5, 3)
    assert "B for this GPT" in nb03.check_dp_bytes(
        lambda m: sum(p.numel() * p.element_size() for p in m.parameters()), model
    )
    with pytest.raises(Wrong, match="number of parameters"):
        nb03.check_dp_bytes(lambda m: sum(p.numel() for p in m.parameters()), model)
    with pytest.raises(Wrong, match="bfloat16 gradient is 2 bytes"):
        nb03.check_dp_bytes(lambda m: 4 * sum(p.numel() for p in m.parameters()), model)
    with pytest.raises(Wrong, match="you say 72"):
        nb03.check_dp_bytes(lambda m: 72, model)  # this model's bytes, hard-coded
    with pytest.raises(NotDone):
        nb03.check_dp_bytes(..., model)


def test_fsdp_bytes_splits_the_largest_dimension():
    assert "shapes" in nb03.check_fsdp_bytes(fsdp)

    def dim0(shape, devices, bytes_per=4):
        return math.ceil(shape[0] / devices) * math.prod(shape) // shape[0] * bytes_per

    with pytest.raises(Wrong, match=r"split along dim 0; FSDPv2 splits the largest dimension"):
        nb03.check_fsdp_bytes(dim0)
    with pytest.raises(Wrong, match="is an exact 1/"):
        nb03.check_fsdp_bytes(lambda shape, n, bytes_per=4: math.prod(shape) * 4 / n)
    # an int subclass whose __eq__ lies is read as the int it is
    with pytest.raises(Wrong, match="you say 0"):
        nb03.check_fsdp_bytes(lambda shape, n, bytes_per=4: AlwaysEqual(0))


def test_megatron_bytes():
    assert "4 all-reduces" in nb03.check_megatron_bytes(lambda B, T, C, L, data: 4 * L * (B // data) * T * C * 4)
    with pytest.raises(Wrong, match="forward only"):
        nb03.check_megatron_bytes(lambda B, T, C, L, data: 2 * L * (B // data) * T * C * 4)
    with pytest.raises(Wrong, match="one data slice"):
        nb03.check_megatron_bytes(lambda B, T, C, L, data: 4 * L * B * T * C * 4)
    with pytest.raises(Wrong, match="your code raised ZeroDivisionError"):
        nb03.check_megatron_bytes(lambda B, T, C, L, data: B // 0)
