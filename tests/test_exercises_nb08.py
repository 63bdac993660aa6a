"""Notebook 08's checkers: a right answer passes, wrong ones fail with "not yet" and a reason, measuring is refused,
and each checker's truth is itself measured here against torch.compile and FSDP2 (a fake process group of 8 ranks:
torch's own test backend, shapes real, collectives no-ops), so a rule that drifts from torch fails this file."""

import contextlib
import math

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from labkit.lessons.exercises import NotDone, Wrong, check, nb08


def right_graphs(batches, lrs):
    return min(8, len(set(batches))) + min(8, len(set(lrs)))


def test_predict_graphs_right_and_wrong():
    assert "four step configurations" in nb08.check_predict_graphs(right_graphs)
    with pytest.raises(Wrong, match="counted the model only"):
        nb08.check_predict_graphs(lambda b, lrs: min(8, len(set(b))))
    with pytest.raises(Wrong, match="recompile_limit"):
        nb08.check_predict_graphs(lambda b, lrs: len(set(b)) + len(set(lrs)))
    with pytest.raises(Wrong, match="AOTAutograd"):
        nb08.check_predict_graphs(lambda b, lrs: 2 * min(8, len(set(b))) + min(8, len(set(lrs))))
    with pytest.raises(Wrong, match="must be a number"):
        nb08.check_predict_graphs(lambda b, lrs: str(right_graphs(b, lrs)))
    with pytest.raises(NotDone):
        nb08.check_predict_graphs(...)


def test_measuring_is_refused_by_code_object():
    def measured(batches, lrs):
        compile_ = torch.compile  # an alias: still the same code object
        compile_(lambda x: x + 1, backend="eager")
        return right_graphs(batches, lrs)

    with pytest.raises(Wrong, match="your code called torch.compile"):
        nb08.check_predict_graphs(measured)
    from torch.distributed.fsdp import fully_shard as fs

    def sharded(shape, devices, bytes_per):
        with contextlib.suppress(Exception):
            fs(torch.nn.Linear(2, 2))  # fails without a process group; the call is what counts
        return nb08.fsdp2_rule(shape, devices, bytes_per)

    with pytest.raises(Wrong, match="your code called fully_shard"):
        nb08.check_fsdp2_bytes(sharded)


def _measure_graphs(batches, lrs):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=lrs[0])
    cm = torch.compile(m, dynamic=False, backend="eager")

    @torch.compile(dynamic=False, backend="eager")
    def opt_step():
        opt.step()

    for b, lr in zip(batches, lrs):
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(cm(torch.randn(b, 8)), torch.randint(0, 3, (b,))).backward()
        opt_step()
    n = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return n


def test_graphs_rule_is_what_torch_compile_does():
    """The checker's rule against a real compiled step: a new batch size and a new float lr each compile a graph;
    past the limit a function runs eagerly (shown with a limit of 3, to keep it cheap)."""
    assert torch._dynamo.config.recompile_limit == nb08.RECOMPILE_LIMIT
    batches, lrs = [4, 4, 6, 4], [1e-3, 2e-3, 2e-3, 1e-3]  # sizes and lrs that come back: no new graph for them
    assert _measure_graphs(batches, lrs) == nb08.graphs_rule(batches, lrs) == 4
    with torch._dynamo.config.patch(recompile_limit=3):  # the cap, cheaply: 5 sizes and 4 lrs, 3 graphs each at most
        batches, lrs = [2, 3, 4, 5, 6], [1e-3, 2e-3, 3e-3, 4e-3, 4e-3]
        assert _measure_graphs(batches, lrs) == nb08.graphs_rule(batches, lrs, limit=3) == 6


def right_guard(key):
    return nb08.CHANGES[key][1]


def test_failing_guard_right_and_wrong():
    assert "all 13 changes, 3 of them on a GPU" in nb08.check_failing_guard(right_guard)
    # wrong on one change only (learners' own slips): refused on every call, not one in three
    for key, slip, says in [
        ("transposed", "size", "laid out"),
        ("new_values", "value", "not its values"),
        ("same_scale", "value", "not its values"),
        ("other_gpu", "none", "'device' guard"),
    ]:
        for _ in range(3):
            with pytest.raises(Wrong, match=says):
                nb08.check_failing_guard(lambda k, key=key, slip=slip: slip if k == key else right_guard(k))
    with pytest.raises(Wrong):
        nb08.check_failing_guard(lambda key: "size")
    with pytest.raises(Wrong, match="not its values"):  # every change recompiles: wrong for the no-guard changes
        nb08.check_failing_guard(lambda key: "value" if right_guard(key) == "none" else right_guard(key))
    with pytest.raises(Wrong, match="answer one of"):
        nb08.check_failing_guard(lambda key: "shape")
    with pytest.raises(Wrong, match="must be a str"):
        nb08.check_failing_guard(lambda key: 3)


def _fn(x, scale=0.5):
    return torch.sin(x) * scale


def _second_call(key):
    """(args, context) of the second call for each change that runs on a CPU."""
    x = torch.randn(16, 64)
    null = contextlib.nullcontext()
    return {
        "batch_12": ((torch.randn(12, 64), 0.5), null),
        "transposed": ((torch.randn(64, 16).t(), 0.5), null),
        "float64": ((x.double(), 0.5), null),
        "bfloat16": ((x.bfloat16(), 0.5), null),
        "needs_grad": ((x.clone().requires_grad_(True), 0.5), null),
        "no_grad": ((x, 0.5), torch.no_grad()),
        "autocast_cpu": ((x, 0.5), torch.autocast("cpu", dtype=torch.bfloat16)),
        "scale": ((x, 0.25), null),
        "same_scale": ((x, 1 / 2), null),
        "new_values": ((torch.randn(16, 64), 0.5), null),
    }[key]


def _kind(reason: str) -> str:
    for marker, kind in [
        ("size mismatch", "size"),
        ("stride mismatch", "stride"),
        ("dtype mismatch", "dtype"),
        ("device mismatch", "device"),
        ("requires_grad mismatch", "requires_grad"),
        ("GLOBAL_STATE", "global"),
        ("scale ==", "value"),
    ]:
        if marker in reason:
            return kind
    return f"unknown: {reason}"


def test_guard_answers_are_what_torch_compile_reports():
    cpu = [k for k, (_, _, on_cpu) in nb08.CHANGES.items() if on_cpu]
    assert len(cpu) >= 8 and set(nb08.GUARD_KINDS) - {"device"} <= {nb08.CHANGES[k][1] for k in cpu}
    for key in cpu:
        torch._dynamo.reset()
        f = torch.compile(_fn, dynamic=False, backend="eager")
        f(torch.randn(16, 64), 0.5)
        args, ctx = _second_call(key)
        with ctx:
            f(*args)
        reasons = [r for rs in torch._dynamo.utils.guard_failures.values() for r in rs]
        got = _kind(reasons[0]) if reasons else "none"
        assert got == nb08.CHANGES[key][1], (key, reasons)
    torch._dynamo.reset()


def right_bytes(shape, devices, bytes_per):
    return math.ceil(shape[0] / devices) * math.prod(shape[1:]) * bytes_per


def test_fsdp2_bytes_right_and_wrong():
    assert "over 8, 16 and 64 devices" in nb08.check_fsdp2_bytes(right_bytes)
    with pytest.raises(Wrong, match="pads dim 0"):
        nb08.check_fsdp2_bytes(lambda s, n, b: math.prod(s) * b // n)
    with pytest.raises(Wrong, match="FSDPv2"):
        nb08.check_fsdp2_bytes(nb08._fsdpv2_rule)
    with pytest.raises(Wrong, match="rounded down"):
        nb08.check_fsdp2_bytes(lambda s, n, b: s[0] // n * math.prod(s[1:]) * b)
    with pytest.raises(Wrong, match="elements"):
        nb08.check_fsdp2_bytes(lambda s, n, b: math.ceil(s[0] / n) * math.prod(s[1:]))


def test_fsdp2_rule_is_what_fully_shard_allocates():
    """On a fake process group of 8 ranks (rank 0 and the last rank): the padded storage fully_shard gives each
    rank's shard equals the rule, for shapes that do not divide and a bias shorter than the mesh."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shapes = [(30, 12), (5,), (203, 4, 4), (13, 100)]
    for rank in (0, 7):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            for shape in shapes:
                holder = torch.nn.Module()
                holder.p = torch.nn.Parameter(torch.randn(shape))
                fully_shard(holder)
                local = holder.p.to_local()
                assert local.untyped_storage().nbytes() == nb08.fsdp2_rule(shape, 8, 4), (rank, shape)
                chunks = torch.arange(shape[0]).chunk(8)  # what DTensor's Shard(0) shows: torch.chunk, unpadded
                assert local.shape[0] == (len(chunks[rank]) if rank < len(chunks) else 0), (rank, shape)
        finally:
            dist.destroy_process_group()


def test_check_prints_not_yet_for_a_wrong_answer(capsys, monkeypatch):
    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    assert not check("08.fsdp2_bytes", lambda: nb08.check_fsdp2_bytes(lambda s, n, b: math.prod(s) * b // n))
    assert "not yet" in capsys.readouterr().out


def test_labkits_own_shard_helpers_are_refused(capsys, monkeypatch):
    """dtensor_plans computes the very answer (the notebook's last section uses it): an answer that calls it, under
    any name, fails, and so does one that hands back the checker's own rule."""
    from labkit.spmd.dtensor_plans import fsdp2_shard_shape as shard_shape

    def borrowed(shape, devices, bytes_per):
        return math.prod(shard_shape(shape, devices)) * bytes_per  # right number, measured by labkit

    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    assert not check("08.fsdp2_bytes", lambda: nb08.check_fsdp2_bytes(borrowed))
    out = capsys.readouterr().out
    assert "not yet" in out and "labkit.spmd.dtensor_plans.fsdp2_shard_shape" in out, out
    with pytest.raises(Wrong, match="your code called nb08.fsdp2_rule"):
        nb08.check_fsdp2_bytes(nb08.fsdp2_rule)


def right_step_time(kernels, launch_us, kernel_us, cuda_graph):
    if cuda_graph:
        return launch_us + kernels * kernel_us  # one launch, then the kernels back to back
    return max(kernels * launch_us, kernels * kernel_us)  # the slower of the two streams (the rough form passes)


def test_overhead_right_and_wrong():
    assert "host-bound, a device-bound and a tiny step" in nb08.check_overhead(right_step_time)
    from labkit.profiling.roofline import launch_bound_s

    exact = lambda k, lu, ku, g: launch_bound_s(k, lu, ku, graph=g)  # noqa: E731 - the same model in µs, unrefused copy
    assert exact(4, 10, 1, False) == 41 and exact(4, 10, 1, True) == 14 and exact(4, 1, 10, False) == 41
    wrong = [
        (lambda k, lu, ku, g: k * (lu + ku) if not g else lu + k * ku, "the two streams overlap"),  # sum, not max
        (lambda k, lu, ku, g: k * ku if not g else lu + k * ku, "the device waits on the host"),  # device time only
        (lambda k, lu, ku, g: k * lu if not g else lu + k * ku, "the queue waits on the device"),  # host time only
        (lambda k, lu, ku, g: right_step_time(k, lu, ku, False), "launched once"),  # the graph changes nothing
        (lambda k, lu, ku, g: k * ku if g else right_step_time(k, lu, ku, g), "one launch before the first kernel"),
        (lambda k, lu, ku, g: max(lu, k * ku) if g else right_step_time(k, lu, ku, g), "they do not overlap"),
        (lambda k, lu, ku, g: 2 * right_step_time(k, lu, ku, g), "the model says"),
    ]
    for answer, says in wrong:
        for _ in range(3):  # new steps each call: refused every time
            with pytest.raises(Wrong, match=says):
                nb08.check_overhead(answer)
    with pytest.raises(Wrong, match="must be a number"):
        nb08.check_overhead(lambda k, lu, ku, g: (lu, ku))
    with pytest.raises(NotDone):
        nb08.check_overhead(lambda k, lu, ku, g: ...)


def test_overhead_refuses_the_library_model(capsys, monkeypatch):
    from labkit.profiling import roofline
    from labkit.profiling.roofline import launch_bound_s as saved

    def borrowed(k, lu, ku, g):
        return saved(k, lu, ku, graph=g)  # the right numbers, computed by labkit

    with pytest.raises(Wrong, match="launch_bound_s is the answer"):
        nb08.check_overhead(borrowed)
    with pytest.raises(Wrong, match="launch_bound_s is the answer"):
        nb08.check_overhead(lambda k, lu, ku, g: roofline.launch_bound_s(k, lu, ku, g))
    monkeypatch.setenv("LABKIT_SOLUTIONS", "0")
    assert not check("08.overhead", lambda: nb08.check_overhead(borrowed))
    assert "✗ 08.overhead: not yet: work it out" in capsys.readouterr().out
    assert saved(3, 2.0, 1.0) == 7.0  # restored afterwards


def test_dispatch_and_kernel_count_of_a_real_step():
    """The notebook's measurement, small: a host cost per eager op in a sane range, and the ops of one training step
    counted with its backward and optimizer (views and `.item()` left out), the same count twice."""
    from labkit.profiling import roofline

    per_op = roofline.dispatch_s(n=500, repeats=3)
    assert 1e-7 < per_op < 1e-3, per_op  # 0.1 µs .. 1 ms: any CPU, loaded or not
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    ops = roofline.count_kernels(step)
    assert ops == roofline.count_kernels(step)
    assert ops["aten.addmm"] == 2 and ops["aten.threshold_backward"] == 1  # the forward and the backward
    assert not {"aten.t", "aten.detach", "aten.view", "aten._local_scalar_dense"} & set(ops)
    with pytest.raises(ValueError, match="dispatch_s: n=0"):
        roofline.dispatch_s(n=0)
    with pytest.raises(ValueError, match="launch_bound_s: kernels=2.5"):
        roofline.launch_bound_s(2.5, 1e-6, 1e-6)
    with pytest.raises(ZeroDivisionError):
        roofline.count_kernels(lambda: 1 / 0)  # the mode is popped: the next count still works
    assert roofline.count_kernels(step) == ops
