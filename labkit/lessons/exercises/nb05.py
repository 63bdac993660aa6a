"""Checkers for notebook 05 (export and int8). Each one runs the learner's code on models and inputs that change
with every call and judges the artefact it makes: a byte count against real tensors and files, an exported program
by its dynamic dimension and its answers."""

from __future__ import annotations

import itertools
import random

import torch

from labkit.lessons.exercises import Wrong, call, close, integer, number, require, todo

__all__ = ["check_dynamic_export", "check_int8_size", "check_kv_cache_bytes"]

_calls = itertools.count(1)


def _rule(model) -> int:
    """What PT2E's x86 quantizer stores: conv and linear weights as int8 (1 byte), everything else float32."""
    return sum(p.numel() * (1 if p.dim() > 1 else 4) for p in model.parameters())


def _other_models(k: int):
    rng = random.Random(k)
    c, w = rng.choice([8, 16, 24]), rng.choice([32, 64, 96])
    yield torch.nn.Sequential(
        torch.nn.Conv2d(3, c, 3),
        torch.nn.BatchNorm2d(c),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(c * 30 * 30, 10),
    )
    yield torch.nn.Sequential(
        torch.nn.Linear(w, 2 * w), torch.nn.GELU(), torch.nn.LayerNorm(2 * w), torch.nn.Linear(2 * w, 7)
    )


def check_int8_size(predict_int8_bytes, model, measured_int8_bytes: int | None, measured_fp32_bytes: int | None) -> str:
    """05.int8_size: predict_int8_bytes(model) -> bytes of the int8 program's weights, from the model alone. Checked
    on two other models against the quantizer's rule, then on `model` against the file section 4 measured (25 %:
    the file also holds scales, zero points and the program)."""
    todo(predict_int8_bytes)
    for other in _other_models(next(_calls)):
        got = number(call(predict_int8_bytes, other), f"predict_int8_bytes of a {len(other)}-layer model")
        want = _rule(other)
        if abs(got - 4 * sum(p.numel() for p in other.parameters())) < 1e-6:
            raise Wrong("that is the float32 size: the quantized weights take 1 byte per element, not 4")
        close(got, want, 0.02, "a model of your own shape", hint="conv/linear weights at 1 byte, the rest at 4")
    if measured_int8_bytes is None:  # no int8 file here (the PT2E flow is missing): the rule alone was checked
        return "the quantizer's rule on two models (no int8 file to compare with here)"
    got = number(call(predict_int8_bytes, model), "predict_int8_bytes(model)")
    if abs(got - measured_fp32_bytes) < 0.1 * measured_fp32_bytes:
        raise Wrong("that is the float32 size: the quantized weights take 1 byte per element, not 4")
    err = close(got, measured_int8_bytes, 0.25, "this model's int8 file")
    return f"within {err:.0%} of the {measured_int8_bytes / 1e6:.1f} MB file"


def _batch_is_dynamic(program) -> bool:
    """The first input's dimension 0 is a symbol (torch.export's Dim), not a number fixed at export."""
    for node in program.graph_module.graph.nodes:
        if node.op == "placeholder" and node.name in program.graph_signature.user_inputs:
            val = node.meta.get("val")
            return val is not None and isinstance(val.shape[0], torch.SymInt)
    return False


def check_dynamic_export(program, model, x: torch.Tensor) -> str:
    """05.dynamic_batch: `program` must be a torch.export.ExportedProgram whose batch dimension is dynamic, answering
    like `model` on batch sizes picked at random (never the one it was traced with, most likely)."""
    todo(program)
    require(
        isinstance(program, torch.export.ExportedProgram),
        f"give the exported program (torch.export.export(...)), not a {type(program).__name__}: an eager model "
        "answers any batch, but it is not what a server loads",
    )
    require(
        _batch_is_dynamic(program), "the batch dimension is a fixed number: export with dynamic_shapes={...: {0: Dim}}"
    )
    rng = random.Random(next(_calls))
    sizes = sorted({1, rng.randint(2, 9), rng.randint(10, x.shape[0])})
    run = program.module()
    with torch.no_grad():
        for b in sizes:
            try:
                got = run(x[:b])
            except Exception as e:
                raise Wrong(f"batch {b} fails ({type(e).__name__}): the program does not accept that size") from None
            want = model(x[:b])
            require(
                tuple(got.shape) == tuple(want.shape), f"batch {b}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
            )
            require(
                bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4)), f"batch {b}: outputs differ from the model's"
            )
    return f"an ExportedProgram with a dynamic batch, right on batches {sizes}"


def check_kv_cache_bytes(kv_cache_bytes) -> str:
    """05.kv_cache: kv_cache_bytes(n_layer, n_head, block_size, n_embd, batch) -> bytes of a float32 key/value
    cache for a whole window, predicted, then compared with the cache labkit's GPT really allocates (empty_cache)
    for four shapes where the window and the width differ."""
    from labkit.models import GPT, GPTConfig

    todo(kv_cache_bytes)
    rng = random.Random(next(_calls))
    for _ in range(4):
        L, H = rng.randint(1, 4), rng.choice([2, 4])
        d, T, B = H * rng.choice([8, 16]), rng.choice([24, 40, 72]), rng.randint(1, 5)
        got = integer(call(kv_cache_bytes, L, H, T, d, B), f"kv_cache_bytes({L}, {H}, {T}, {d}, {B})")
        cache = GPT(GPTConfig(block_size=T, n_layer=L, n_head=H, n_embd=d)).empty_cache(B)
        want = cache.numel() * cache.element_size()
        if got == want // 2:
            raise Wrong("keys AND values: two tensors per layer")
        if got == want * H:
            raise Wrong("the heads split the width: n_head x head_dim = n_embd, count it once")
        require(got == want, f"L={L}, heads={H}, T={T}, d={d}, batch {B}: you say {got:,}, the cache is {want:,} bytes")
    return "four shapes: 2 x layers x batch x window x width x 4 bytes"
