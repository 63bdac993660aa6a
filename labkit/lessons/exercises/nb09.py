"""Checkers for notebook 09 (past one device: FSDP2, HSDP and accumulation under torchrun). Each asks for a size or a
choice that 2 CPU processes cannot show: the bytes a GPU holds for a 7B model sharded over 8, 16 or 64 GPUs, the plan
"auto" picks on 2 hosts of 8 GPUs, and what accumulating k micro-batches costs in memory and in all-gathers. The
inputs are drawn anew on every call and chosen so that each known mistake gives another answer. While the learner's
function runs, labkit's own rules (labkit.parallel.auto_plan, accumulation_bytes, labkit.spmd.comm.fits and this
module's rules) are refused by their code objects.

    from labkit.lessons.exercises import check, nb09
    check("09.gpu_bytes", lambda: nb09.check_gpu_bytes(gpu_bytes))
    check("09.pick_plan", lambda: nb09.check_pick_plan(pick_plan))
    check("09.accumulate", lambda: nb09.check_accumulate(accumulate_cost))
"""

from __future__ import annotations

import itertools
import random

from labkit.lessons.exercises import Wrong, call, integer, mistake, number, refusing, require, todo
from labkit.parallel import STATE_BYTES_PER_WEIGHT, accumulation_bytes, auto_plan
from labkit.spmd.comm import fits

__all__ = [
    "PLANS",
    "accumulate_rule",
    "check_accumulate",
    "check_gpu_bytes",
    "check_pick_plan",
    "gpu_bytes_rule",
]

PLANS = ("replicate", "hsdp", "fsdp2")
GB = 10**9
_calls = itertools.count(1)


def gpu_bytes_rule(params: int, gpus: int, unit_params: int, gather_bytes: int) -> float:
    """Bytes one GPU holds under FSDP2 with AdamW, activations left out: its shard of the float32 weights, gradients
    and AdamW's two moments (16 B a weight / gpus) plus one unit's weights gathered in the gather dtype."""
    return params * STATE_BYTES_PER_WEIGHT / gpus + unit_params * gather_bytes


def accumulate_rule(mode: str, params: int, processes: int, k: int, n_layer: int) -> tuple[int, int]:
    """(bytes a process holds through the window, all-gathers per optimizer step) for a GPT of `n_layer` blocks under
    fsdp2 in float32, k micro-batches: labkit.parallel.accumulation_bytes, and 2 L all-gathers per k = 1 step (the
    root once, each block before its forward, each block but the last again before its backward: the last stays
    gathered after its forward), once (gathered) or k times."""
    gathered, sharded = accumulation_bytes(params, processes, 4)
    per_step = 2 * n_layer
    return (gathered, per_step) if mode == "gathered" else (sharded, k * per_step)


def _rules():
    return [auto_plan, accumulation_bytes, fits, gpu_bytes_rule, accumulate_rule]


WORK_IT_OUT = "work it out from the inputs: labkit's rule is the answer here"


def _same(got: float, want: float) -> bool:
    return abs(got - want) <= max(1.0, 1e-9 * abs(want))


def check_gpu_bytes(gpu_bytes) -> str:
    """09.gpu_bytes: gpu_bytes(params, gpus, unit_params, gather_bytes) -> bytes one GPU holds under FSDP2 (see
    gpu_bytes_rule). Judged on a 7B model over 8 GPUs in bf16 and on models drawn anew, over 8, 16 and 64 GPUs."""
    todo(gpu_bytes)
    rng = random.Random(next(_calls))
    cases = [(7 * GB, 8, 7 * GB // 32, 2)]
    for gpus in (16, 64, 8):
        layers = rng.choice([24, 32, 40, 48])
        params = rng.randrange(1, 70) * GB + rng.randrange(10**6)
        cases.append((params, gpus, params // layers, rng.choice([2, 4])))
    for params, gpus, unit, gather in cases:
        with refusing(_rules(), WORK_IT_OUT):
            got = number(call(gpu_bytes, params, gpus, unit, gather), f"gpu_bytes({params}, {gpus}, {unit}, {gather})")
        want = gpu_bytes_rule(params, gpus, unit, gather)
        if _same(got, want):
            continue
        what = f"{params / GB:.2f} B weights over {gpus} GPUs, a unit of {unit / GB:.3f} B gathered at {gather} B"
        wrong = {
            "forgot to split the state over the GPUs?": params * 16 + unit * gather,
            "forgot the gathered unit: a GPU holds one unit whole while it runs": params * 16 / gpus,
            "12 B a weight? the gradients count too: weight 4 + gradient 4 + AdamW's two moments 8": params * 12 / gpus
            + unit * gather,
            f"the unit is gathered at {gather} B a weight, not 4": params * 16 / gpus + unit * 4,
            "the gathered unit is whole on every GPU: do not divide it": params * 16 / gpus + unit * gather / gpus,
        }
        hint = next((h for h, v in wrong.items() if _same(got, v) and not _same(v, want)), "")
        raise Wrong(f"{what}: " + (hint or f"you say {got:,.0f} B, one GPU holds {want:,.0f} B"))
    return f"{len(cases)} models over 8, 16 and 64 GPUs"


def _plan_cases(rng) -> list[tuple[int, int, int, int]]:
    """(params, memory, devices, hosts): one case for each rule, each near its boundary, in a new order."""
    mem = rng.choice([40, 80, 96, 141]) * GB
    half = mem // 2
    small = half // 16 - rng.randrange(1, 10**6)  # a whole copy fits half: replicate
    host = half * 8 // 16 - rng.randrange(1, 10**6)  # a host's share of 8 fits: hsdp on 2 hosts
    big = half * 8 // 16 + rng.randrange(10**6, 10**8)  # not even a host's share fits: fsdp2
    full = half // 16 + rng.randrange(1, 10**6)  # a whole copy just does not fit half (it fits the whole memory)
    cases = [
        (small, mem, 16, 2),
        (host, mem, 16, 2),
        (big, mem, 16, 2),
        (host, mem, 8, 1),  # one host: hsdp is no choice
        (full, mem, 16, 2),
        (small, mem, 8, 1),
    ]
    rng.shuffle(cases)
    return cases


def check_pick_plan(pick_plan) -> str:
    """09.pick_plan: pick_plan(params, memory, devices, hosts) -> "replicate", "hsdp" or "fsdp2": what
    TrainConfig.parallel="auto" picks (labkit.parallel.auto_plan), on cases that tell its three rules apart."""
    todo(pick_plan)
    rng = random.Random(next(_calls))
    for params, memory, devices, hosts in _plan_cases(rng):
        with refusing(_rules(), WORK_IT_OUT):
            got = call(pick_plan, params, memory, devices, hosts)
        what = f"{params / GB:.3f} B weights, {memory / GB:.0f} GB a GPU, {devices} GPUs on {hosts} host(s)"
        if not isinstance(got, str) or got not in PLANS:
            raise Wrong(f"{what}: expected one of {', '.join(PLANS)}, got {got!r}")
        want = auto_plan(params, memory, devices, hosts)
        if got == want:
            continue
        state = params * STATE_BYTES_PER_WEIGHT
        hints = {
            "replicate": "a whole copy's state (16 B a weight) must fit HALF the memory (the rest: activations)"
            if state <= memory
            else "a whole copy's state does not fit",
            "hsdp": "hsdp needs 2 hosts or more (it replicates across hosts)"
            if hosts == 1
            else "a host's share (the state over the GPUs of ONE host) does not fit half the memory",
            "fsdp2": "a smaller layout fits, and auto prefers the one with the least traffic"
            if want != "fsdp2"
            else "",
        }
        raise Wrong(f"{what}: you say {got}, auto picks {want}: {hints[got]}")
    return "6 models, one near each rule's boundary"


def check_accumulate(accumulate_cost) -> str:
    """09.accumulate: accumulate_cost(mode, params, processes, k, n_layer) -> (bytes a process holds, all-gathers per
    optimizer step) under fsdp2 in float32, mode "gathered" or "sharded" (see accumulate_rule)."""
    todo(accumulate_cost)
    rng = random.Random(next(_calls))
    cases = []
    for mode in ("gathered", "sharded"):
        for _ in range(2):
            params = rng.randrange(10**6, 10**10)
            cases.append((mode, params, rng.choice([2, 4, 8, 16]), rng.choice([2, 3, 4, 8]), rng.choice([2, 12, 32])))
    rng.shuffle(cases)
    for mode, params, processes, k, layers in cases:
        with refusing(_rules(), WORK_IT_OUT):
            got = call(accumulate_cost, mode, params, processes, k, layers)
        what = f"{mode}, {params:,} weights over {processes} processes, k = {k}, {layers} blocks"
        require(isinstance(got, tuple) and len(got) == 2, f"{what}: return a pair (bytes, all_gathers), got {got!r}")
        nbytes = number(got[0], "the bytes (first of the pair)")
        gathers = integer(got[1], "the all-gathers (second of the pair)")
        want_bytes, want_gathers = accumulate_rule(mode, params, processes, k, layers)
        g_bytes, s_bytes = accumulation_bytes(params, processes, 4)
        if not _same(nbytes, want_bytes):
            hint = mistake(
                round(nbytes),
                want_bytes,
                {
                    "that is the sharded window's: gathered keeps whole weights AND whole gradients": s_bytes,
                    "that is the gathered window's: sharded holds only the shard": g_bytes,
                    "the whole gradients count too (4 B a weight, unreduced until the last micro-batch)": g_bytes
                    - 4 * params,
                },
            )
            raise Wrong(f"{what}: bytes: " + (hint or f"you say {nbytes:,.0f}, a process holds {want_bytes:,}"))
        if gathers != want_gathers:
            hint = mistake(
                gathers,
                want_gathers,
                {
                    "gathered keeps the weights gathered: nothing is gathered again until the last backward": k
                    * (2 * layers),
                    "sharded runs k = 1's step for every micro-batch: k times its all-gathers": 2 * layers,
                    "the last block stays gathered after its forward: its backward does not gather it again": 2 * layers
                    + 1
                    if mode == "gathered"
                    else k * (2 * layers + 1),
                    "each block but the last is gathered twice: before its forward and again before its backward": (
                        layers + 1
                    )
                    if mode == "gathered"
                    else k * (layers + 1),
                },
            )
            raise Wrong(f"{what}: all-gathers: " + (hint or f"you say {gathers}, a step issues {want_gathers}"))
    return f"{len(cases)} windows, gathered and sharded"
