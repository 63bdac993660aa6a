"""Notebook 03's checkers: right answers pass; "split dim 0 always", "the last on a tie", work copied through the
host, a tensor left whole, a parameter count for bytes, a bf16 model counted at 4 bytes, a hard-coded number, the
forward-only Megatron count, a lying __eq__, a placeholder and an exception inside the learner's code all fail with
a reason; for the time over the links, a ring's time on an axis without wraparound, the communication all hidden or
all exposed, hidden behind the whole backward, or not queued, fail with the rule they miss, and labkit.spmd.comm's
own functions are refused. The FSDP checkers read torch_xla's own layouts on a mesh: those cases run in a child process with 4
virtual XLA:CPU devices under SPMD (SPMD must be on before the first XLA tensor exists; ~15 s)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit.lessons.exercises import NotDone, Wrong, nb03

ROOT = Path(__file__).resolve().parent.parent


class AlwaysEqual(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


def fsdp(shape, devices, bytes_per=4):
    big = max(shape)
    return math.ceil(big / devices) * math.prod(shape) // big * bytes_per


def dim0(shape, devices, bytes_per=4):
    return math.ceil(shape[0] / devices) * math.prod(shape) // shape[0] * bytes_per


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
    with pytest.raises(Wrong, match="ring all-reduce sends per device"):  # the traffic, not the gradients' bytes
        nb03.check_dp_bytes(lambda m: 2 * sum(p.numel() * p.element_size() for p in m.parameters()), model)
    with pytest.raises(Wrong, match="you say 0"):  # a lying __eq__ is read as the int it is
        nb03.check_dp_bytes(lambda m: AlwaysEqual(0), model)
    with pytest.raises(NotDone):
        nb03.check_dp_bytes(..., model)
    with pytest.raises(NotDone):  # the placeholder body returns None
        nb03.check_dp_bytes(lambda m: None, model)


def test_fsdp_bytes_on_paper_splits_the_largest_dimension():
    """Without a mesh the checker uses the rule on paper, for device counts of 3 and 4 or 6."""
    assert "in all" in nb03.check_fsdp_bytes(fsdp)
    with pytest.raises(Wrong, match=r"split along dim 0; FSDPv2 splits the largest dimension"):
        nb03.check_fsdp_bytes(dim0)
    with pytest.raises(Wrong, match="is an exact 1/"):
        nb03.check_fsdp_bytes(lambda shape, n, bytes_per=4: math.prod(shape) * bytes_per // n)
    with pytest.raises(Wrong, match="a count is a whole number"):
        nb03.check_fsdp_bytes(lambda shape, n, bytes_per=4: math.prod(shape) * bytes_per / n)
    with pytest.raises(Wrong, match="you say 0"):
        nb03.check_fsdp_bytes(lambda shape, n, bytes_per=4: AlwaysEqual(0))
    with pytest.raises(Wrong, match="you say 96"):
        nb03.check_fsdp_bytes(lambda shape, n, bytes_per=4: 96)
    with pytest.raises(Wrong, match="your code raised IndexError"):
        nb03.check_fsdp_bytes(lambda shape, n, bytes_per=4: shape[5])
    with pytest.raises(NotDone):
        nb03.check_fsdp_bytes(...)


def test_fsdp_shapes_tell_the_wrong_rules_apart():
    """Every call draws shapes where dim 0 is not the largest, a tie, and sizes that do not divide."""
    import random

    for seed in range(20):
        shapes = nb03._fsdp_shapes(random.Random(seed), 4)
        assert any(s.index(max(s)) != 0 for s in shapes)
        assert any(len(s) == 2 and s[0] == s[1] for s in shapes)
        assert all(d % 4 for s in shapes for d in s)
    assert nb03._fsdp_shapes(random.Random(1), 8) != nb03._fsdp_shapes(random.Random(2), 8)


def test_megatron_bytes():
    assert "4 all-reduces" in nb03.check_megatron_bytes(lambda B, T, C, L, data: 4 * L * (B // data) * T * C * 4)
    # the forward only and 2-byte values give the same half: neither is named (either could be the learner's)
    with pytest.raises(Wrong, match=r"you say \d+, Megatron moves \d+$"):
        nb03.check_megatron_bytes(lambda B, T, C, L, data: 2 * L * (B // data) * T * C * 4)
    with pytest.raises(Wrong, match="times L"):
        nb03.check_megatron_bytes(lambda B, T, C, L, data: 4 * (B // data) * T * C * 4)
    with pytest.raises(Wrong, match="one data slice"):
        nb03.check_megatron_bytes(lambda B, T, C, L, data: 4 * L * B * T * C * 4)
    with pytest.raises(Wrong, match="your code raised ZeroDivisionError"):
        nb03.check_megatron_bytes(lambda B, T, C, L, data: B // 0)
    with pytest.raises(Wrong, match="you say 32768"):
        nb03.check_megatron_bytes(lambda B, T, C, L, data: 32768)  # the first case's answer, hard-coded


# Run in a child: 4 virtual XLA:CPU devices under SPMD, a 1-D "fsdp" mesh. Each answer is checked and the outcome
# printed as one JSON line {name: "pass" or "Wrong: message"}.
_CHILD = r"""
import json, math, os, sys
import torch
import labkit
rt = labkit.setup("xla-cpu", spmd=True)
import torch_xla.distributed.spmd as xs
from labkit.lessons.exercises import Wrong, nb03

mesh = labkit.spmd.make_mesh(None, ("fsdp",))

def largest(t, mesh):
    return xs.mark_sharding(t, mesh, tuple("fsdp" if d == t.shape.index(max(t.shape)) else None for d in range(t.dim())))

def largest_in_place(t, mesh):  # returns t itself, not the wrapper
    largest(t, mesh)
    return t

def dim0(t, mesh):
    xs.mark_sharding(t, mesh, ("fsdp",) + (None,) * (t.dim() - 1))
    return t

def last_on_tie(t, mesh):
    s = list(t.shape)
    d = len(s) - 1 - s[::-1].index(max(s))
    xs.mark_sharding(t, mesh, tuple("fsdp" if i == d else None for i in range(t.dim())))
    return t

def through_host(t, mesh):  # the right layout, reached through a copy on the host
    return largest(t.cpu().to(t.device), mesh)

def on_host(t, mesh):
    return t.cpu()

def whole(t, mesh):
    return t

def zeros(t, mesh):  # the right layout of a new tensor: the values are lost
    return largest(torch.zeros_like(t), mesh)

def by_spec(t, mesh):  # FSDPv2's own choice of partition spec: the function that is the answer
    from torch_xla.experimental import spmd_fully_sharded_data_parallel as f
    return xs.mark_sharding(t, mesh, f._prepare_spmd_partition_spec(t, shard_maximal=True))

def by_layout(t, mesh):  # the checker's own reading of FSDPv2, then marked as it says
    spec = nb03.fsdpv2_layout([tuple(t.shape)], mesh)[0][0]
    return largest(t, mesh)

def fsdp_bytes(shape, devices, bytes_per=4):
    big = max(shape)
    return math.ceil(big / devices) * math.prod(shape) // big * bytes_per

class Eq(int):  # an int whose __eq__ says yes to everything
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__

def exact(shape, devices, bytes_per=4):
    return math.prod(shape) * bytes_per // devices

model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Linear(40, 5))
run_bytes = sum(b for _, b in nb03.fsdpv2_layout([tuple(p.shape) for p in model.parameters()], mesh))
out = {}
for name, answer in [("largest", largest), ("largest_in_place", largest_in_place), ("dim0", dim0),
                     ("last_on_tie", last_on_tie), ("through_host", through_host), ("on_host", on_host),
                     ("whole", whole), ("zeros", zeros), ("by_spec", by_spec), ("by_layout", by_layout)]:
    try:
        out["shard." + name] = "pass: " + nb03.check_fsdp_shard(answer, mesh)
    except Wrong as e:
        out["shard." + name] = "Wrong: " + str(e)
for name, answer, total in [("right", fsdp_bytes, run_bytes), ("wrong_total", fsdp_bytes, run_bytes + 4),
                            ("exact", exact, run_bytes), ("lying", lambda s, n, b=4: Eq(0), run_bytes)]:
    try:
        out["bytes." + name] = "pass: " + nb03.check_fsdp_bytes(answer, mesh, model, total)
    except Wrong as e:
        out["bytes." + name] = "Wrong: " + str(e)
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def on_a_mesh():
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULTS ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS ") :])


def test_fsdp_shard_passes_torch_xlas_own_layout(on_a_mesh):
    assert on_a_mesh["shard.largest"].startswith("pass: 5 shapes"), on_a_mesh
    assert on_a_mesh["shard.largest_in_place"].startswith("pass"), on_a_mesh


def test_fsdp_shard_rejects_wrong_layouts_and_host_work(on_a_mesh):
    r = on_a_mesh
    assert "you split dim 0; FSDPv2 splits the largest" in r["shard.dim0"], r
    assert "on a tie FSDPv2 splits the first" in r["shard.last_on_tie"], r
    assert "copied from the device to the host" in r["shard.through_host"], r
    assert "lives on 'cpu'" in r["shard.on_host"], r
    assert "not split, every device holds all of it" in r["shard.whole"], r
    assert "the values changed" in r["shard.zeros"], r
    # torch_xla's FSDPv2 computing the layout is the answer, refused
    assert "torch_xla's FSDPv2 computing the layout" in r["shard.by_spec"], r
    assert "torch_xla's FSDPv2 computing the layout" in r["shard.by_layout"], r


def test_fsdp_bytes_measured_on_the_mesh(on_a_mesh):
    r = on_a_mesh
    assert r["bytes.right"].startswith("pass: 6 shapes measured on the mesh"), r
    assert "summed over the model" in r["bytes.wrong_total"], r
    assert "is an exact 1/4" in r["bytes.exact"], r
    assert "you say 0" in r["bytes.lying"], r


# -- 03.comm_time: an all-reduce along an axis with and without wraparound, and the communication left exposed --


def ring_right(nbytes, chips, rate, wraparound):
    ring = 2 * nbytes * (chips - 1) / chips / rate
    return ring if wraparound else 2 * ring


def exposed_right(backward_s, reduce_s):
    ready = end = 0.0
    for back, red in zip(backward_s, reduce_s):
        ready += back
        end = max(ready, end) + red
    return end - ready


def test_comm_time_right_answers_pass():
    for _ in range(3):  # inputs drawn anew on every call
        assert "8 all-reduces" in nb03.check_comm_time(ring_right, exposed_right)
    # the learner's own order of arithmetic is not the library's: rounding passes
    assert nb03.check_comm_time(lambda b, n, s, w: b / s * 2 * (n - 1) / n * (1 + (not w)), exposed_right)


@pytest.mark.parametrize(
    "ring, why",
    [
        (lambda b, n, s, w: ring_right(b, n, s, True), "is a line, not a ring: .* about twice"),  # no wraparound factor
        (lambda b, n, s, w: ring_right(b, n, s, not w), "the doubling belongs to the axis WITHOUT wraparound"),
        (lambda b, n, s, w: ring_right(b, n, s, w) / 2, "a reduce-scatter then an all-gather"),
        (lambda b, n, s, w: 2 * b / s * (1 + (not w)), r"\(n−1\)/n of the buffer, not all of it"),
        (lambda b, n, s, w: 0.001, r"you say 0\.001 s, it is [\d.e-]+ s$"),  # hard-coded: no rule named
    ],
)
def test_comm_time_wrong_all_reduce_rules_are_named(ring, why):
    with pytest.raises(Wrong, match=why):
        nb03.check_comm_time(ring, exposed_right)


@pytest.mark.parametrize(
    "exposed, why",
    [
        (lambda b, r: 0.0, "not all of it hides: the last gradient computed"),  # all communication hidden
        (lambda b, r: sum(r), "not all of it is exposed"),  # all of it exposed: compute + comm, the sum not the max
        (lambda b, r: max(0.0, sum(r) - sum(b)), "comparing the sums is not enough"),  # behind the whole backward
        (lambda b, r: r[-1], "the last reduction is not all"),
        (lambda b, r: sum(max(0.0, x - y) for x, y in zip(r[:-1], b[1:])) + r[-1], "a queue"),  # each on its own
        (lambda b, r: max(0.0, b[0] + sum(r) - sum(b)), "cannot start before the backward has made its gradient"),
        (lambda b, r: exposed_right(b[::-1], r[::-1]), "index 0 is the layer the backward computes first"),
        (lambda b, r: sum(b) + exposed_right(b, r), "the whole backward plus what is exposed"),
    ],
)
def test_comm_time_wrong_overlap_rules_are_named(exposed, why):
    with pytest.raises(Wrong, match=why):
        nb03.check_comm_time(ring_right, exposed)


def test_comm_time_refuses_the_library_and_waits_for_both_answers():
    from labkit.spmd import comm

    why = "labkit.spmd.comm computing the time is the answer"
    with pytest.raises(Wrong, match=why):
        nb03.check_comm_time(lambda b, n, s, w: comm.ring_seconds("all-reduce", b, n, s, w), exposed_right)
    with pytest.raises(Wrong, match=why):  # the ring formula's own home, called from the learner's code
        nb03.check_comm_time(lambda b, n, s, w: comm.sent("all-reduce", b, n) / s * (1 + (not w)), exposed_right)
    with pytest.raises(Wrong, match=why):
        nb03.check_comm_time(ring_right, comm.exposed_seconds)
    saved = comm.exposed_seconds  # a reference taken before the check is refused too
    with pytest.raises(Wrong, match=why):
        nb03.check_comm_time(ring_right, lambda b, r: saved(b, r))
    assert comm.exposed_seconds([1.0], [0.5]) == 0.5 and comm.ring_seconds("all-reduce", 8, 2, 4.0) == 2.0  # restored
    with pytest.raises(NotDone):
        nb03.check_comm_time(..., exposed_right)
    with pytest.raises(NotDone):  # the first function done, the second still its placeholder
        nb03.check_comm_time(ring_right, ...)
    with pytest.raises(NotDone):
        nb03.check_comm_time(ring_right, lambda b, r: None)
    with pytest.raises(Wrong, match="must be a number"):
        nb03.check_comm_time(lambda b, n, s, w: "1 ms", exposed_right)


def test_comm_time_cases_tell_every_wrong_rule_apart():
    """On every draw, each wrong rule misses at least one case and no two wrong rules agree on all of them (else the
    hint could not name one)."""
    import random

    from labkit.lessons.exercises import nb03_comm as m

    for seed in range(200):
        rng = random.Random(seed)
        for table, args, right in (
            (m._RING_WRONG, m._ring_cases(rng), m._ring),
            (m._EXPOSED_WRONG, m._exposed_cases(rng), m._queue),
        ):
            vals = {h: [float(f(*a)) for a in args] for h, f in table.items()}
            want = [right(*a) for a in args]
            for h, v in vals.items():
                assert not all(m._near(x, y) for x, y in zip(v, want)), (seed, h)
                same = [g for g, u in vals.items() if g != h and all(m._near(x, y) for x, y in zip(v, u))]
                assert not same, (seed, h, same)
