"""Bytes into time (labkit.spmd.comm): ring collectives per device, the textbook strategies, Google's ICI
figures, and the critical batch where compute time equals communication time. Pure arithmetic: no device."""

import random

import pytest

from labkit.dashboard import flops
from labkit.spmd import comm


def test_ring_bytes_per_device():
    # a ring over W devices: W-1 steps of V/W bytes each; all-reduce = reduce-scatter + all-gather
    for w in (2, 4, 8, 256):
        v = 1024 * w
        assert comm.sent("all-gather", v, w) == comm.sent("reduce-scatter", v, w) == v * (w - 1) / w
        assert comm.sent("all-reduce", v, w) == 2 * v * (w - 1) / w
    assert comm.sent("all-reduce", 1000, 1) == 0 and comm.sent("collective-permute", 64, 2) == 64
    # a permute's line has source-target pairs and no replica groups (collective_ops says group 1): it still sends
    assert comm.traffic([{"op": "collective-permute", "bytes": 64, "group": 1}]) == 64
    with pytest.raises(ValueError, match="unknown collective"):
        comm.sent("broadcast", 1, 2)


def test_fsdp_sends_one_and_a_half_times_data_parallel_not_three():
    rng = random.Random(0)
    for _ in range(5):
        n, w = rng.randrange(10**6, 10**9), rng.choice([4, 8, 64, 256])
        dp = comm.traffic(comm.strategy_collectives("data", n, w))
        fsdp = comm.traffic(comm.strategy_collectives("fsdp", n, w))
        assert fsdp / dp == pytest.approx(1.5)
        buffers = sum(c["bytes"] for c in comm.strategy_collectives("fsdp", n, w))
        assert buffers / sum(c["bytes"] for c in comm.strategy_collectives("data", n, w)) == 3  # the wrong sum


def test_ici_figures_agree_with_the_pods_all_reduce_bandwidth():
    # Google's pages give both a chip's bidirectional ICI and a pod's all-reduce bandwidth: the second over the
    # pod's chips is what one chip sends (half the first) on v5e and v6e; v4's per-chip figure is derived so
    for chip, (pod_bw, chips) in comm.POD_ALL_REDUCE.items():
        assert comm.ICI[chip].send_bytes_per_s == pytest.approx(pod_bw / chips, rel=1e-9), chip
    assert [comm.ICI[c].send_bytes_per_s for c in ("v5e", "v6e", "v5p")] == [200e9, 400e9, 600e9]
    assert comm.ICI["v5e"].seconds(200e9) == 1.0 and comm.ICI["v5e"].seconds(200e9, ports=2) == 2.0
    with pytest.raises(ValueError, match="4 ICI ports"):
        comm.ICI["v5e"].seconds(1, ports=6)


def test_critical_batch_is_where_the_overlappable_compute_equals_communication():
    n = 7e8  # any weight count: it cancels
    for chip in comm.ICI:
        peak = flops.PEAKS[f"TPU {chip}"]["bf16"]
        b = comm.critical_tokens("data", peak, chip, devices=64)
        # data parallelism: the gradients exist only during the backward (4 of the 6 FLOPs per weight and token)
        t_comm = comm.step_comm("data", n, 64, chip)["seconds"]
        assert comm.compute_seconds(n, b, peak) * 4 / 6 == pytest.approx(t_comm, rel=1e-9), chip
        # the old reading (the whole step hides it) would call 2/3 of b* compute-bound: the backward cannot
        assert comm.compute_seconds(n, 2 * b / 3, peak) == pytest.approx(t_comm, rel=1e-9)
        assert comm.compute_seconds(n, 2 * b / 3, peak) * 4 / 6 < t_comm
        # FSDP: a third of its bytes (the forward all-gather) behind the forward, two thirds behind the backward
        t_fsdp = comm.step_comm("fsdp", n, 64, chip)["seconds"]
        assert comm.critical_tokens("fsdp", peak, chip, devices=64) == pytest.approx(b, rel=1e-12)
        assert comm.compute_seconds(n, b, peak) * 2 / 6 == pytest.approx(t_fsdp / 3, rel=1e-9), chip
    # v5e: 197 TFLOP/s over 200 GB/s sent, bf16: ~985 tokens per chip for both (scaling-book: C / W_ici per axis)
    assert comm.critical_tokens("data", 197e12, "v5e") == pytest.approx(985.0)
    assert comm.critical_tokens("fsdp", 197e12, "v5e") == pytest.approx(985.0)
    # half the ports (a ring along one axis of the 2-D torus): twice the batch
    assert comm.critical_tokens("data", 197e12, "v5e", ports=2) == pytest.approx(2 * 985.0)
    with pytest.raises(ValueError, match="'tensor'"):
        comm.critical_tokens("tensor", 197e12, "v5e")


def test_tensor_parallel_is_bound_by_width_not_batch():
    chip, peak = "v5e", 197e12
    for m in (2, 4, 8):
        c = comm.critical_width(m, peak, chip)
        layers, tokens = 3, 4096.0
        t_comm = comm.ICI[chip].seconds(comm.traffic(comm.megatron_collectives(tokens, c, layers, m)))
        t_comp = 72 * c * c / m * tokens * layers / peak  # 12·C² weights per block, 6 FLOPs each, split m ways
        assert t_comp == pytest.approx(t_comm, rel=1e-9)
        t_comm2 = comm.ICI[chip].seconds(comm.traffic(comm.megatron_collectives(2 * tokens, c, layers, m)))
        assert t_comm2 == pytest.approx(2 * t_comm)  # twice the batch: twice both sides, the same balance
    assert comm.max_model_axis(8192, peak, chip) == 1 + int(9 * 8192 * 200e9 / (2 * peak))
    assert comm.max_model_axis(64, peak, chip) == 1


def test_fits_counts_sixteen_bytes_a_weight():
    assert comm.fits(1e9, 16e9, 256, "data") and not comm.fits(1e9 + 1, 16e9, 256, "data")
    assert comm.fits(1e9, 16e9, 256, "fsdp") and not comm.fits(300e9, 16e9, 256, "fsdp")


HLO = """
  %partition-id = u32[] partition-id()
  %all-reduce.11 = f32[32]{0} all-reduce(%multiply_reduce_fusion), channel_id=59, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%AddComputation.1581.clone
  %multiply_add_fusion.3 = f32[4]{0} fusion(%param.70, %all-reduce.11, %param.22, %partition-id), kind=kLoop, calls=%fused_computation.11
  %all-reduce.5 = f32[64,16,16]{2,1,0} all-reduce(%dot.11), channel_id=39, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add.4.clone
  %multiply_bitcast_fusion = f32[64,16,16]{2,1,0} fusion(%all-reduce.5, %partition-id), kind=kLoop, calls=%fused_computation.9
  %all-reduce.9 = f32[32,256]{1,0} all-reduce(%dot.16), channel_id=48, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add.6.clone
  %ds = f32[32,32]{1,0} dynamic-slice(%all-reduce.9, %c0, %offset, %partition-id), dynamic_slice_sizes={32,32}
  %keep = f32[32,256]{1,0} add(%all-reduce.9, %all-reduce.9)
"""


def test_all_reduce_then_own_slice_is_found_as_a_reduce_scatter_in_disguise():
    # lines in the form of XLA:CPU's optimized HLO (torch_xla 2.9, notebook 03's FSDP step); the whole-gradient
    # all-reduce read with partition-id into a 1/8 slice, and not the activation all-reduce kept whole
    from labkit.spmd import sharding as S

    got = S.sliced_all_reduces(HLO)
    assert [(a["all-reduce"], a["result"], a["slice"], a["group"]) for a in got] == [
        ("all-reduce.11", "f32[32]", "f32[4]", 8),
        ("all-reduce.9", "f32[32,256]", "f32[32,32]", 8),
    ]
    assert got[1]["user"] == "ds (dynamic-slice)"
    assert S.sliced_all_reduces(HLO.replace("%partition-id)", "%other)")) == []


def test_wraparound_follows_googles_rule_and_a_line_takes_twice_a_ring():
    # v5e/v6e: an axis wraps only with 16 chips; v4/v5p: only slices of whole 4x4x4 cubes, then every axis
    assert comm.wraparound("v5e", (2, 4)) == (False, False) and comm.wraparound("v6e", (16, 16)) == (True, True)
    assert comm.wraparound("v5e", (8, 16)) == (False, True)
    assert comm.wraparound("v4", (2, 2, 1)) == (False,) * 3 and comm.wraparound("v5p", (4, 4, 8)) == (True,) * 3
    assert comm.wraparound("v4", (4, 4, 2)) == (False,) * 3
    for bad in [("v5e", (2, 2, 2)), ("v4", (2, 4)), ("v5e", (0, 4)), ("v5e", (2.0, 4))]:
        with pytest.raises(ValueError, match="positive whole numbers"):
            comm.wraparound(*bad)
    with pytest.raises(ValueError, match="no ICI figure"):
        comm.wraparound("v3", (2, 2))
    # the ring's time is sent / rate (Ici.seconds over the 2 ports a ring along one axis uses); a line twice that
    link = comm.ICI["v5e"]
    for n in (2, 4, 16):
        ring = comm.ring_seconds("all-reduce", 1e8, n, link.send_bytes_per_s * 2 / link.ports)
        assert ring == pytest.approx(link.seconds(comm.sent("all-reduce", 1e8, n), ports=2), rel=1e-12)
        assert comm.ring_seconds("all-reduce", 1e8, n, 1e11, wraparound=False) == comm.LINE_FACTOR * comm.ring_seconds(
            "all-reduce", 1e8, n, 1e11
        )
    with pytest.raises(ValueError, match="a rate is positive"):
        comm.ring_seconds("all-reduce", 1, 2, 0)


def test_exposed_seconds_queues_the_reductions_behind_the_backward():
    # keep up: each reduction hides behind the next layer's backward; only the last one (the first layer's) shows
    assert comm.exposed_seconds([1, 1, 1, 1], [0.5, 0.5, 0.5, 0.25]) == 0.25
    # one large early reduction (ready at 1, done at 3.5) delays those after it: done at 5, the backward at 4
    assert comm.exposed_seconds([1, 1, 1, 1], [2.5, 0.5, 0.5, 0.5]) == 1.0
    # never keep up: the first starts at 1, then back to back
    assert comm.exposed_seconds([1, 1, 1], [2, 2, 2]) == pytest.approx(1 + 6 - 3)
    for b, r in [([], []), ([1, 1], [1]), ([1], [-1]), ([1], [float("nan")])]:
        with pytest.raises(ValueError, match="one backward time and one reduction time"):
            comm.exposed_seconds(b, r)
