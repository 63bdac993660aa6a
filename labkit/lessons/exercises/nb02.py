"""Checkers for notebook 02 (a GPT language model). Each one tests what the learner's answer does."""

from __future__ import annotations

import math

from labkit.lessons.exercises import Wrong, require, todo

__all__ = ["check_bits_per_byte", "check_bucket", "check_flops_per_token"]


def check_bucket(bucket, block_size: int = 256) -> str:
    """02.bucket: bucket(n) -> the padded length for a prompt of n bytes, so that XLA compiles few graphs:
    at least n, at most block_size, a multiple of 32, and never more than 31 bytes of padding."""
    todo(bucket)
    shapes = set()
    for n in range(1, block_size + 1):
        b = bucket(n)
        require(isinstance(b, int), f"bucket({n}) = {b!r}: return an int (a length)")
        require(b >= n, f"bucket({n}) = {b}: shorter than the prompt, bytes would be cut")
        require(b <= block_size, f"bucket({n}) = {b}: longer than the model's window ({block_size})")
        if b % 32:
            raise Wrong(f"bucket({n}) = {b}: not a multiple of 32, so almost every length is its own graph")
        require(b - n < 32, f"bucket({n}) = {b}: {b - n} bytes of padding, more work than needed")
        shapes.add(b)
    return f"{block_size} prompt lengths -> {len(shapes)} graphs instead of {block_size}"


def check_bits_per_byte(bpb) -> str:
    """02.bpb: bpb(nats) -> bits per byte of a per-byte cross-entropy measured in nats."""
    todo(bpb)
    for nats in (math.log(256), 1.0, 0.5):
        got = bpb(nats)
        if abs(got - nats * math.log(2)) < 1e-9 and nats != 0:
            raise Wrong("multiplied by ln 2: a bit is ln 2 nats, so divide")
        require(abs(got - nats / math.log(2)) < 1e-9, f"bpb({nats:.3f}) = {got}: uniform over 256 bytes is 8 bits")
    return "ln 256 nats = 8 bits"


def check_flops_per_token(flops, model) -> str:
    """02.flops: flops(N, L, T, d) -> training FLOPs per token; compared with the model's own count."""
    todo(flops)
    c = model.cfg
    got = flops(model.num_params(), c.n_layer, c.block_size, c.n_embd)
    want = model.flops_per_token()
    if abs(got - 2 * model.num_params()) < 1e-6 * want:
        raise Wrong("2N is the forward pass only: backward costs about twice the forward")
    require(abs(got - want) <= 1e-6 * want, f"you say {got:,.0f} FLOPs per token, the model counts {want:,.0f}")
    return f"{want / 1e6:.1f} MFLOPs per token"
