"""The collectives a sharding strategy needs, predicted from first principles (bytes of gradients,
activations and parameters per step), to compare with what XLA's partitioner inserted (read from the
optimized HLO by labkit.spmd.sharding.count_collectives).

    pred = labkit.spmd.predict.predict_data_parallel(cfg, global_batch=16)
"""

from __future__ import annotations

import math


def predict_data_parallel(cfg, global_batch: int, bytes_per: int = 4) -> dict:
    """Collectives of one data-parallel training step, from first principles (float32).

    Every device holds all the weights and computes the gradient of its slice of the batch; the step
    needs the sum over devices of every gradient: one all-reduce per parameter tensor, of the
    parameter's bytes. In all: the parameter bytes, whatever the batch (`global_batch` is accepted for
    symmetry with the other predictions; activations never travel). Nothing else is needed.

    What a compiler adds on top is not predicted here: compare with count_collectives() of the
    optimized HLO and explain the difference (see extra_collectives)."""
    del global_batch  # activations stay on their device: the batch size does not enter
    if not cfg.bias:
        raise ValueError("predict_data_parallel assumes GPTConfig(bias=True)")
    shapes = gpt_param_shapes(cfg)
    return {"all-reduce": {"count": len(shapes), "bytes": sum(math.prod(s) for s in shapes) * bytes_per}}


def _split(n: int, ways: int, what: str) -> int:
    if n % ways:
        raise ValueError(f"{what}={n} does not divide evenly over {ways} devices")
    return n // ways


def predict_tensor_parallel(cfg, global_batch: int, data: int, model: int, bytes_per: int = 4) -> dict:
    """Collectives of one Megatron tensor-parallel step on a data x model mesh, from first principles
    (float32; split_qkv GPT, gpt_tensor_parallel_specs).

    Megatron (Shoeybi et al. 2019, section 3): per block, forward, the two row-parallel outputs
    (attention projection, MLP projection) are partial sums: 2 all-reduces over the model group of one
    data slice's activations (B/data, T, C); backward, the input gradients of the two column-parallel
    layers (q/k/v, MLP fc) are partial sums: 2 more. So 4 per block, each B/data x T x C.
    Data parallelism over the `data` axis: each gradient all-reduced once, at the size one device holds
    (split matrices at 1/model).

    What a compiler adds on top is not predicted here: compare with the optimized HLO."""
    C, L, T, H = cfg.n_embd, cfg.n_layer, cfg.block_size, cfg.n_head
    if not cfg.bias:
        raise ValueError("predict_tensor_parallel assumes GPTConfig(bias=True)")
    Cm = _split(C, model, "n_embd")
    _split(H, model, "n_head")  # whole heads per device
    b = _split(global_batch, data, "global_batch")
    act = b * T * C  # one data slice's activations
    V = cfg.vocab_size
    # per block as one device holds it: 2 LayerNorms, q/k/v (rows split) + biases, attention proj (columns
    # split) + bias, MLP fc (rows split) + bias, MLP proj (columns split) + bias
    per_block = [C] * 4 + [Cm * C] * 3 + [Cm] * 3 + [C * Cm, C] + [4 * Cm * C, 4 * Cm, C * 4 * Cm, C]
    grads = [V * C, T * C] + per_block * L + [C, C]
    return {"all-reduce": {"count": len(grads) + 4 * L, "bytes": (sum(grads) + 4 * L * act) * bytes_per}}


def extra_collectives(predicted: dict, measured: dict) -> dict:
    """What the compiled step moved beyond a prediction, per kind: {kind: {"count": n, "bytes": b}}
    (negative where it moved less). The numbers to explain in words."""
    out = {}
    for kind in sorted(set(predicted) | set(measured)):
        p = predicted.get(kind, {"count": 0, "bytes": 0})
        m = measured.get(kind, {"count": 0, "bytes": 0})
        d = {"count": m["count"] - p["count"], "bytes": m["bytes"] - p["bytes"]}
        if d["count"] or d["bytes"]:
            out[kind] = d
    return out


def gpt_param_shapes(cfg) -> list[tuple[int, ...]]:
    """Shapes of labkit.models.gpt.GPT's parameters (bias=True; the output layer is the tied token table)."""
    C, T, V = cfg.n_embd, cfg.block_size, cfg.vocab_size
    block = [(C,), (C,), (3 * C, C), (3 * C,), (C, C), (C,), (C,), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,)]
    return [(V, C), (T, C)] + block * cfg.n_layer + [(C,), (C,)]


def predict_fsdp(cfg, devices: int, bytes_per: int = 4) -> dict:
    """FSDP (ZeRO-3) on paper: what one device holds, and the textbook communication per step.

    param_bytes / opt_bytes: exact. Every parameter is split over all devices along its largest
    dimension (the first, on a tie: FSDPv2's shard_maximal; one that does not divide is padded:
    ceil), and AdamW keeps two moments of the same shards.
    textbook: each weight all-gathered whole before its forward use and again for its backward
    (2 x the parameter bytes, two per parameter), its gradient reduce-scattered (counted, as in
    count_collectives, by the unreduced input: the parameter bytes). That is what FSDP in PyTorch
    (FSDP2) issues by construction. Under GSPMD (torch_xla's FSDPv2) the partitioner chooses per
    op: on XLA:CPU with small layers it moves activations (all-to-all, collective-permute) and
    all-reduces gradients instead, so only the per-device bytes are a prediction to assert there."""
    if not cfg.bias:
        raise ValueError("predict_fsdp assumes GPTConfig(bias=True)")
    shapes = gpt_param_shapes(cfg)
    full = sum(math.prod(s) for s in shapes) * bytes_per
    shard = sum(math.ceil(max(s) / devices) * math.prod(s) // max(s) for s in shapes) * bytes_per
    return {
        "param_bytes": shard,
        "opt_bytes": 2 * shard,
        "textbook": {
            "all-gather": {"count": 2 * len(shapes), "bytes": 2 * full},
            "reduce-scatter": {"count": len(shapes), "bytes": full},
        },
    }
