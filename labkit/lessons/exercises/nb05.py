"""Checkers for notebook 05 (export and int8). Each one tests what the learner's answer does."""

from __future__ import annotations

import torch

from labkit.lessons.exercises import Wrong, require, todo

__all__ = ["check_dynamic_export", "check_int8_size", "check_kv_flops"]


def check_int8_size(predicted_bytes, measured_int8_bytes: int, measured_fp32_bytes: int) -> str:
    """05.int8_size: the size of the int8 program, predicted from the model before looking at the file."""
    todo(predicted_bytes)
    require(isinstance(predicted_bytes, (int, float)) and predicted_bytes > 0, "give a number of bytes")
    if abs(predicted_bytes - measured_fp32_bytes) < 0.1 * measured_fp32_bytes:
        raise Wrong("that is the float32 size: the quantized weights take 1 byte per element, not 4")
    err = abs(predicted_bytes - measured_int8_bytes) / measured_int8_bytes
    require(
        err < 0.25,
        f"{predicted_bytes / 1e6:.1f} MB is {err:.0%} off: count conv/linear weights at 1 byte, the rest at 4",
    )
    return f"within {err:.0%} of {measured_int8_bytes / 1e6:.1f} MB"


def check_dynamic_export(serve, model, x: torch.Tensor) -> str:
    """05.dynamic_batch: `serve` must answer like the model for batch sizes it was not exported with."""
    todo(serve)
    with torch.no_grad():
        for b in (1, 3, x.shape[0]):
            try:
                got = serve(x[:b])
            except Exception as e:  # a program exported with a static batch refuses other shapes
                raise Wrong(f"batch {b} fails ({type(e).__name__}): export with a dynamic batch dimension") from None
            want = model(x[:b])
            require(
                tuple(got.shape) == tuple(want.shape), f"batch {b}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
            )
            require(torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"batch {b}: outputs differ from the model's")
    return "batch 1, 3 and " + str(x.shape[0])


def check_kv_flops(ratio) -> str:
    """05.kv_flops: ratio(T, t) -> how many times more positions the window generator runs than the cached one
    for the t-th new token (1-based), with a full window of T positions: T positions vs 1."""
    todo(ratio)
    for T, t in ((64, 1), (64, 10), (128, 5), (16, 16)):
        got = ratio(T, t)
        require(got == T, f"ratio({T}, {t}) = {got}: the window runs all {T} positions for every token, the cache one")
    return "T : 1 per token"
