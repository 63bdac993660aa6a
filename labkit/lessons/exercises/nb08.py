"""Checkers for notebook 08 (the compiled engine: torch.compile and DTensor). Each asks for something the notebook
never builds and this machine cannot measure for the learner: the graphs of a step configuration drawn anew on
every call, the guard a change fails (some of the changes need a GPU), and the bytes FSDP2 gives one device of a
mesh of 8, 16 or 64 devices. While the learner's function runs, the tools that would measure the answer
(`torch.compile`, `torch._dynamo.explain`, `fully_shard`, `distribute_tensor`, a process group, a device mesh, FSDP2's
own padding helper, labkit's shard-shape and bytes-per-device helpers) are refused by their code objects, so no alias
or re-import gets around the refusal.

    from labkit.lessons.exercises import check, nb08
    check("08.graphs", lambda: nb08.check_predict_graphs(predict_graphs))
    check("08.guard", lambda: nb08.check_failing_guard(failing_guard))
    check("08.fsdp2_bytes", lambda: nb08.check_fsdp2_bytes(fsdp2_bytes))
    check("08.overhead", lambda: nb08.check_overhead(step_time_us))   # nb08_overhead.py: launches vs kernels
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import random
import sys

from labkit.lessons.exercises import Wrong, call, integer, require, todo
from labkit.lessons.exercises.nb08_overhead import check_overhead  # 08.overhead's checker lives there

__all__ = [
    "CHANGES",
    "GUARD_KINDS",
    "RECOMPILE_LIMIT",
    "check_failing_guard",
    "check_fsdp2_bytes",
    "check_overhead",
    "check_predict_graphs",
]

_calls = itertools.count(1)

# torch._dynamo.config.recompile_limit in torch 2.9: graphs per function before Dynamo gives up and runs it eagerly
RECOMPILE_LIMIT = 8


# -- refusing the measurement: by code object, whatever name the learner reached it by ---------------------------------


def _codes(funcs) -> dict:
    """{code object: name} of each function, of what it wraps (functools.wraps, torch's @contract) and, for a class,
    of its __init__: a call through any alias runs one of these code objects."""
    out = {}
    for name, f in funcs:
        seen = [f, getattr(f, "__init__", None)]
        with contextlib.suppress(ValueError):
            seen.append(inspect.unwrap(f))
        for g in seen:
            code = getattr(g, "__code__", None)
            if code is not None:
                out[code] = name
    return out


@contextlib.contextmanager
def refusing_calls(funcs, why: str):
    """While the block runs, note every call of the given functions (a profile hook sees the code object run, so
    `from torch.distributed.fsdp import fully_shard as fs` is seen too); at the end raise Wrong(why + which).
    Calls are noted, not stopped: raising inside a profile hook would unset it and leave torch half way."""
    codes = _codes(funcs)
    called: list[str] = []
    old = sys.getprofile()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            called.append(codes[frame.f_code])

    sys.setprofile(hook)
    try:
        yield called
    finally:
        sys.setprofile(old)
    if called:
        raise Wrong(f"{why} (your code called {called[0]})")


def _compile_tools():
    import torch
    import torch._dynamo

    return [
        ("torch.compile", torch.compile),
        ("torch._dynamo.optimize", torch._dynamo.optimize),
        ("torch._dynamo.explain", torch._dynamo.explain),
    ]


def _sharding_tools():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    tools = [
        ("fully_shard", fully_shard),
        ("distribute_tensor", distribute_tensor),
        ("init_process_group", dist.init_process_group),
        ("init_device_mesh", init_device_mesh),
        ("DeviceMesh", DeviceMesh),
        ("Shard._split_tensor", Shard._split_tensor),
    ]
    with contextlib.suppress(ImportError):  # FSDP2's own padding rule (a private module: absent in other versions)
        from torch.distributed.fsdp._fully_shard._fsdp_common import _get_dim0_padded_size

        tools.append(("FSDP2's _get_dim0_padded_size", _get_dim0_padded_size))
    from labkit.spmd import dtensor_plans  # labkit's own shard shapes and bytes per device (notebook 08's last run)

    for name in ("fsdp2_shard_shape", "fsdp2_local_rows", "largest_dim_shard_shape", "predict_bytes", "padded_bytes"):
        tools.append((f"labkit.spmd.dtensor_plans.{name}", getattr(dtensor_plans, name)))
    tools.append(("nb08.fsdp2_rule", fsdp2_rule))  # this checker's own truth
    return tools


# -- 1. the graphs of a compiled training step ----------------------------------------------------------------------


def graphs_rule(batches, lrs, limit: int = RECOMPILE_LIMIT) -> int:
    """The graphs Dynamo compiles for section 2's step run with these batch sizes and (float) learning rates:
    one model graph per batch size (its backward is compiled with it by AOTAutograd: not a Dynamo graph of its own)
    plus one optimizer graph per lr value (the float is a constant guarded by value), each capped at `limit`.
    Measured against torch.compile in tests/test_exercises_nb08.py."""
    return min(limit, len(set(batches))) + min(limit, len(set(lrs)))


def _graph_cases(rng: random.Random) -> list[tuple[list[int], list[float]]]:
    sizes = rng.sample([8, 12, 16, 24, 32, 40, 48, 64, 96, 128], 10)
    base = rng.choice([1e-3, 3e-4, 6e-4])
    warm = rng.randint(3, 6)
    steps = rng.randint(10, 14)
    # a full epoch then a smaller last batch, with a linear warm-up of a float lr, then constant
    case1 = ([sizes[0]] * (steps - 1) + [sizes[1]], [base * min(1.0, (i + 1) / warm) for i in range(steps)])
    # batches that change every step (more sizes than the limit), one lr
    n = rng.randint(9, 10)
    case2 = ([sizes[i % n] for i in range(n + 2)], [base] * (n + 2))
    # two sizes alternating, an lr halved every few steps
    every = rng.randint(2, 4)
    k = rng.randint(8, 12)
    case3 = ([sizes[i % 2] for i in range(k)], [base / 2 ** (i // every) for i in range(k)])
    # an lr decayed every step (a cosine schedule read as a float): past the limit
    m = rng.randint(10, 13)
    case4 = ([sizes[2]] * m, [base * (0.5 + 0.5 * math.cos(math.pi * i / m)) for i in range(m)])
    cases = [case1, case2, case3, case4]
    rng.shuffle(cases)
    return cases


def check_predict_graphs(predict_graphs) -> str:
    """08.graphs: predict_graphs(batch_rows, lrs) -> the graphs Dynamo compiles when section 2's step (model compiled
    with dynamic=False, AdamW with a *float* lr, opt.step compiled with dynamic=False) runs step i on a batch of
    batch_rows[i] rows with lr lrs[i]. Judged on four configurations the notebook never runs, drawn anew each call,
    against the rule measured in the tests; torch.compile and explain are refused while the answer runs."""
    todo(predict_graphs)
    rng = random.Random(next(_calls))
    for batches, lrs in _graph_cases(rng):
        with refusing_calls(_compile_tools(), "predict it: compiling the step here is the measurement"):
            got = integer(call(predict_graphs, list(batches), list(lrs)), "predict_graphs(batch_rows, lrs)")
        want = graphs_rule(batches, lrs)
        nb, nl = len(set(batches)), len(set(lrs))
        what = f"{len(batches)} steps, {nb} batch sizes, {nl} lr values"
        if got == want:
            continue
        if got == min(RECOMPILE_LIMIT, nb):
            raise Wrong(f"{what}: you counted the model only; opt.step is compiled too, a graph per lr value")
        if got == nb + nl and got != want:
            raise Wrong(
                f"{what}: after {RECOMPILE_LIMIT} graphs of one function (torch._dynamo.config.recompile_limit) "
                "Dynamo stops compiling it and runs it eagerly"
            )
        if got == 2 * min(RECOMPILE_LIMIT, nb) + min(RECOMPILE_LIMIT, nl):
            raise Wrong(f"{what}: the backward is compiled with its forward by AOTAutograd, not as a Dynamo graph")
        if got == min(RECOMPILE_LIMIT, nb) + 1:
            raise Wrong(f"{what}: a float lr is a constant in the optimizer's graph: a new value, a new graph")
        require(got == want, f"{what}: you say {got} graphs, the step compiles {want}")
    return f"four step configurations, up to the limit of {RECOMPILE_LIMIT} graphs per function"


# -- 2. the guard a change fails ------------------------------------------------------------------------------------

GUARD_KINDS = ("size", "stride", "dtype", "device", "requires_grad", "global", "value", "none")

# Each change is made to the second call of `f = torch.compile(fn, dynamic=False)` after a first call f(x, scale)
# with x a float32 CPU tensor of shape (16, 64) that does not require grad, scale = 0.5 (a Python float), grad mode
# on, no autocast. The answer is the kind of guard that fails ("none": the cached graph runs again). Those marked
# cpu=True are measured against torch.compile in tests/test_exercises_nb08.py; the others need a GPU.
CHANGES: dict[str, tuple[str, str, bool]] = {
    "batch_12": ("x has 12 rows instead of 16", "size", True),
    "transposed": ("x is torch.randn(64, 16).t(): the same shape, a transposed view", "stride", True),
    "float64": ("x is in float64", "dtype", True),
    "bfloat16": ("x is in bfloat16", "dtype", True),
    "on_gpu": ("x is on cuda:0 (a GPU machine, first call on the CPU)", "device", False),
    "other_gpu": ("first call with x on cuda:0, then x on cuda:1 (a two-GPU machine)", "device", False),
    "needs_grad": ("x.requires_grad_(True)", "requires_grad", True),
    "no_grad": ("the call runs inside torch.no_grad()", "global", True),
    "autocast_gpu": (
        "the call runs inside torch.autocast('cuda', dtype=torch.bfloat16), x on cuda:0 both times",
        "global",
        False,
    ),
    "autocast_cpu": ("the call runs inside torch.autocast('cpu', dtype=torch.bfloat16)", "global", True),
    "scale": ("scale is 0.25 instead of 0.5", "value", True),
    "same_scale": ("scale is 0.5 again, computed as 1 / 2", "none", True),
    "new_values": ("x holds new random numbers, same shape, dtype and device", "none", True),
}


def check_failing_guard(failing_guard) -> str:
    """08.guard: failing_guard(change) -> one of GUARD_KINDS for a key of CHANGES. Judged on every change, every
    call, in an order drawn anew (a sample of them would let an answer wrong on one change pass one run in three);
    torch.compile is refused while the answer runs."""
    todo(failing_guard)
    rng = random.Random(next(_calls))
    keys = list(CHANGES)
    rng.shuffle(keys)
    for key in keys:
        text, want, _ = CHANGES[key]
        with refusing_calls(_compile_tools(), "predict it: compiling the change here is the measurement"):
            got = call(failing_guard, key)
        require(isinstance(got, str), f"failing_guard({key!r}) must be a str, one of {GUARD_KINDS}")
        got = str.__str__(got)
        require(got in GUARD_KINDS, f"failing_guard({key!r}) = {got!r}: answer one of {GUARD_KINDS}")
        if got == want:
            continue
        if want == "none":
            raise Wrong(f"{key} ({text}): Dynamo guards a tensor's metadata, not its values: the graph runs again")
        if want == "global":
            raise Wrong(f"{key} ({text}): grad mode and autocast are global state, checked on every call")
        if want == "stride":
            raise Wrong(f"{key} ({text}): the shape is the same; the guard also checks how the elements are laid out")
        if want == "value":
            raise Wrong(f"{key} ({text}): with dynamic=False a Python number is baked into the graph as a constant")
        raise Wrong(f"{key} ({text}): you say {got!r}, it fails the {want!r} guard")
    gpu = sum(not CHANGES[k][2] for k in keys)
    return f"all {len(keys)} changes, {gpu} of them on a GPU"


# -- 3. FSDP2's bytes per device -------------------------------------------------------------------------------------


def fsdp2_rule(shape, devices: int, bytes_per: int) -> int:
    """Bytes one device allocates for its FSDP2 shard: dim 0 padded up to a multiple of `devices`, then split."""
    return math.ceil(shape[0] / devices) * math.prod(shape[1:]) * bytes_per


def _fsdpv2_rule(shape, devices: int, bytes_per: int) -> int:
    """torch_xla's FSDPv2: the largest dimension (the first on a tie), padded."""
    d = max(range(len(shape)), key=lambda i: (shape[i], -i))
    return math.ceil(shape[d] / devices) * math.prod(shape) // shape[d] * bytes_per


def _fsdp2_cases(rng: random.Random) -> list[tuple[tuple[int, ...], int, int]]:
    cases = []
    for devices in (8, 16, 64):
        tall = devices * rng.randint(2, 9) + rng.randint(1, devices - 1)  # does not divide
        wide = rng.choice([256, 384, 512, 768])
        cases.append(((tall, rng.choice([48, 96, 200])), devices, 4))  # dim 0 the largest
        cases.append(
            ((rng.randint(3, 40) * 3 + 1, wide * 4 + rng.randint(1, 7)), devices, 2)
        )  # dim 1 larger: FSDPv2 differs
        cases.append(((rng.randint(1, devices - 1),), devices, 4))  # a bias with fewer rows than devices
    cases.append(((8 * rng.randint(20, 60) + 3, 4, 4), 8, 4))  # a 3-D tensor
    rng.shuffle(cases)
    return cases


def check_fsdp2_bytes(fsdp2_bytes) -> str:
    """08.fsdp2_bytes: fsdp2_bytes(shape, devices, bytes_per) -> bytes ONE device allocates for its shard of a
    parameter that fully_shard splits over `devices` (FSDP2: dim 0, padded to a multiple of the devices). Judged on
    10 shapes drawn anew on every call, over 8, 16 and 64 devices, shapes that do not divide and biases shorter than
    the mesh; the sharding tools (fully_shard, distribute_tensor, a process group, a mesh, FSDP2's padding helper,
    labkit.spmd.dtensor_plans' shard shapes and bytes, this checker's own rule) are refused while the answer runs."""
    todo(fsdp2_bytes)
    rng = random.Random(next(_calls))
    cases = _fsdp2_cases(rng)
    for shape, devices, bytes_per in cases:
        with refusing_calls(_sharding_tools(), "work it out: laying the tensor out here is the measurement"):
            got = integer(call(fsdp2_bytes, shape, devices, bytes_per), f"fsdp2_bytes({shape}, {devices}, {bytes_per})")
        want = fsdp2_rule(shape, devices, bytes_per)
        what = f"shape {shape} over {devices} devices, {bytes_per} B each"
        if got == want:
            continue
        numel, hints = math.prod(shape), []  # every known mistake this number matches, named
        if got in (numel * bytes_per // devices, -(-numel * bytes_per // devices)):
            hints.append(f"{got} is an even 1/{devices}? FSDP2 pads dim 0 to a multiple of the devices")
        if got == _fsdpv2_rule(shape, devices, bytes_per):
            hints.append("that is torch_xla's FSDPv2 (largest dimension); FSDP2 shards dim 0")
        if got == shape[0] // devices * math.prod(shape[1:]) * bytes_per:
            hints.append("rounded down? every device allocates the padded shard, ceil(rows / devices) rows")
        if got == math.ceil(shape[0] / devices) * math.prod(shape[1:]):
            hints.append(f"elements, not bytes? multiply by bytes_per ({bytes_per})")
        if hints:
            raise Wrong(f"{what}: " + "; or ".join(hints))
        require(got == want, f"{what}: you say {got}, one device allocates {want}")
    return f"{len(cases)} shapes over 8, 16 and 64 devices"
